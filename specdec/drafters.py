"""Drafters: who proposes the k tokens a verify step checks.

One interface (``Drafter``):
- ``prefill(batch)``: called once after the target's prefill (a drafter with a cache
  builds it here);
- ``propose(batch, k) -> drafts [B, k] long``: called once per step; every row gets k
  proposals (rows whose budget allows fewer simply cannot accept the rest);
- ``uses_cache``: whether the drafter keeps ``batch.draft_cache``. The engine realigns that
  cache with the same gather as the target's;
- optional, for sampling runs: ``propose_sampled(batch, k, sampling) -> (drafts [B, k],
  logits [B, k+1, V])``: drafts chosen by the run's rule (``specdec.sampling.draft_choice``)
  and the draft model's logits at each draft and after the last one (rejection sampling
  reads its distribution q from them). A drafter without it is a point mass
  (``propose`` is called, q = onehot(draft)).

Cache convention of ``ModelDrafter``: outside a step its cache has width ``W - 1`` like the
target's. ``propose`` feeds the pending token and the k drafts one at a time (k + 1
forwards; the last output is discarded) so that after drafting its cache has width
``W + k``, exactly the target's extended width after verify; one realignment plan then
serves both caches. In the view: ``draft_cache_lag = k + 1`` during a step, 0 outside.
With holes (``strategy="holes"``) the draft cache has the target's hole layout too: the
same mask over slots, and for a sliding-window draft model the positions of every slot
(``cache.forward(key_positions=...)``) so that its window counts positions, not slots.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from . import cache as cache_mod
from . import layout, validation
from .batch import RaggedBatch
from .sampling import draft_choice


class Drafter(Protocol):
    uses_cache: bool

    def prefill(self, batch: RaggedBatch) -> None: ...
    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor: ...


class ModelDrafter:
    """Drafts with a smaller causal LM sharing the target's vocabulary: greedily, or by the
    run's sampling rule (``propose_sampled``).

    Evidence for the adaptive policy (``specdec.policy``): its own probability for each
    draft of the latest step, in classes ``CONFIDENCE_EDGES`` (a slot it did not draft
    then is the last class, "unknown"). The policy uses it for the next step's slots:
    the drafts of the next step are not known before its width is, so this is the
    evidence available without another host read. A sampling run's evidence is the
    draft model's probability of the token it drew, at the run's temperature.
    """

    uses_cache = True
    #: probability classes of the evidence: below 0.4, 0.7, 0.9, at least 0.9; unknown
    CONFIDENCE_EDGES = (0.4, 0.7, 0.9)
    evidence_prior = (0.2, 0.45, 0.7, 0.85, 0.5)

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.confidence = None  # [B, k] float: probability of each draft of the latest step

    def check_compatible(self, target: torch.nn.Module) -> None:
        from .models import vocab_size

        vt, vd = vocab_size(target), vocab_size(self.model)
        if vt != vd:
            raise ValueError(
                f"draft and target vocabularies must match: the draft model has {vd} tokens, "
                f"the target {vt}; a draft proposes token ids the target must verify"
            )

    def prefill(self, batch: RaggedBatch) -> None:
        self.confidence = None  # no draft of these rows yet: their evidence is "unknown"
        capacity = batch.target_cache.slab.capacity
        batch.draft_cache = cache_mod.new_cache(self.model, capacity)
        w = batch.width
        if w > 1:
            cache_mod.forward(self.model, batch.tokens[:, : w - 1], batch.positions[:, : w - 1],
                              batch.valid[:, : w - 1], batch.draft_cache, last_logits=True)

    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        """Greedy drafts [B, k]."""
        return self.draft(batch, k, None)[0]

    def propose_sampled(self, batch: RaggedBatch, k: int, sampling):
        """(drafts [B, k], logits [B, k+1, V]): each draft is ``sampling.draft_choice`` of
        the draft model's logits at its output position (coupled: the coupled choice with
        the request's own noise; rejection: a sample of q); the logits of all k + 1
        forwards are returned (the last one, after the k-th draft, is otherwise unused)."""
        return self.draft(batch, k, sampling)

    @torch.no_grad()
    def draft(self, batch: RaggedBatch, k: int, sampling):
        """(drafts [B, k], logits [B, k+1, V] or None when ``sampling`` is None)."""
        cache = batch.draft_cache
        b, w = batch.tokens.shape
        mask = batch.valid[:, : w - 1]
        ones = torch.ones(b, 1, dtype=mask.dtype, device=mask.device)
        token = batch.tokens[:, w - 1 :]
        # positions of the mask columns, needed only for a sliding window over holes
        kpos = batch.positions[:, : w - 1] if cache_mod.positions_matter(
            batch.holes, cache_mod.sliding_window(self.model)) else None
        drafts, conf, seen = [], [], []
        for i in range(k + 1):  # k + 1 sequential one-token forwards (see module docstring)
            mask = torch.cat([mask, ones], dim=1)
            pos = layout.verify_position(batch.lengths, i)[:, None]
            if kpos is not None:
                kpos = torch.cat([kpos, pos], dim=1)
            logits = cache_mod.forward(self.model, token, pos, mask, cache, key_positions=kpos)[:, -1]
            if sampling is not None:
                seen.append(logits)
            if i < k:
                if sampling is None:
                    top = logits.float().softmax(-1).max(-1, keepdim=True)
                    token, prob = top.indices, top.values
                else:
                    token = draft_choice(logits, sampling, batch.row_ids, batch.generated + i)[:, None]
                    prob = (logits.float() / sampling.temperature).softmax(-1).gather(-1, token)
                drafts.append(token)
                conf.append(prob)
        seen_logits = torch.stack(seen, dim=1) if sampling is not None else None
        if not drafts:
            self.confidence = torch.zeros(b, 0, device=batch.device)
            return torch.zeros(b, 0, dtype=torch.long, device=batch.device), seen_logits
        self.confidence = torch.cat(conf, dim=1)
        return torch.cat(drafts, dim=1), seen_logits

    def evidence(self, batch: RaggedBatch, predictions: torch.Tensor, committed: torch.Tensor,
                 k: int) -> torch.Tensor:
        """[B, k] long: the probability class of each slot's draft at the latest step."""
        conf = self.confidence
        b, dev = batch.batch_size, batch.device
        unknown = len(self.CONFIDENCE_EDGES) + 1
        out = torch.full((b, k), unknown, dtype=torch.long, device=dev)
        if conf is None or conf.shape[0] != b or not conf.shape[1]:
            return out
        q = min(k, conf.shape[1])
        cls = sum((conf[:, :q] >= e).long() for e in self.CONFIDENCE_EDGES)
        out[:, :q] = cls
        return out


class NGramDrafter:
    """Model-free drafts from the row's own prompt and output (prompt lookup), longest
    match first.

    For every earlier position ``s`` of the row, ``L[s]`` is how many tokens before ``s``
    equal the row's last tokens (its suffix), up to ``max_n``: one comparison of the
    shifted row per suffix length, over all rows and positions at once (no loop over
    rows). The longest match wins, the latest among equally long ones, if it is at least
    ``min_n`` long; the drafts are the tokens that followed it. When that continuation
    reaches the row's end, it continues periodically with period ``W - s`` (a row caught
    in a repetition loop is drafted the loop). Rows with no match propose their pending
    token repeated. A batch with holes is first compacted logically
    (``RaggedBatch.contiguous_tokens``, an int gather), so that no suffix or match spans
    a rejected slot.

    Evidence for the adaptive policy (``specdec.policy``), per row: the match length and
    how often its continuation was seen (how many equally long matches are followed by
    the same token), as one of ``len(evidence_prior)`` features; ``evidence_prior`` is
    the acceptance a feature starts from before the policy has measured it.
    """

    uses_cache = False
    #: the evidence is known at every step, whether or not the row drafted (its match
    #: length, from the row's own tokens): a policy that stops drafting still sees when a
    #: long match appears (``specdec.policy``, ``drain_margin``)
    standing_evidence = True
    #: match-length classes of the evidence: 0, 1, 2, 3-4, 5-7, 8+ tokens
    LENGTH_EDGES = (1, 2, 3, 5, 8)
    #: agreement classes: the continuation seen once, twice, three times or more
    AGREEMENT_CLASSES = 3
    #: prior acceptance per match-length class (the same for every agreement class and
    #: slot): the first draft's acceptance measured on SmolLM2-135M-Instruct over the 48
    #: built-in prompts, every row drafting 4 (0.0, 0.15, 0.35, 0.67, 0.58, 0.96), rounded
    #: and made monotone; later slots, given the earlier ones accepted, measured higher
    #: (0.6-0.9), which the policy learns
    LENGTH_PRIOR = (0.02, 0.15, 0.35, 0.6, 0.65, 0.9)

    def __init__(self, max_n: int = 8, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.evidence_prior = tuple(p for p in self.LENGTH_PRIOR for _ in range(self.AGREEMENT_CLASSES))
        self._edges: dict = {}  # device -> LENGTH_EDGES as a tensor (``feature``)

    def prefill(self, batch: RaggedBatch) -> None:
        pass

    @torch.no_grad()
    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        if k == 0:  # a plain step: nothing to look up
            return batch.tokens.new_zeros(batch.batch_size, 0)
        tokens, valid = batch.contiguous_tokens()
        return self.lookup(tokens, valid, k)[0]

    @torch.no_grad()
    def evidence_drafts(self, batch: RaggedBatch, predictions: torch.Tensor,
                        committed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(``evidence``, [B] long: every row's first draft of its next step, as ``propose``
        would make it), from one lookup: a policy that learns from plain steps too
        (``AdaptivePolicy(shadow=True)``) compares that draft with the token the step
        commits."""
        tokens, valid = batch.committed_context(predictions, committed)
        length, start, agree = self.match(tokens, valid)
        first = self.continuation(tokens, length, start, 1)[:, 0]
        return self.feature(length, agree)[:, None].expand(-1, k), first

    @torch.no_grad()
    def evidence(self, batch: RaggedBatch, predictions: torch.Tensor, committed: torch.Tensor,
                 k: int) -> torch.Tensor:
        """[B, k] long: the feature of every row's next drafts (the same for each slot),
        from the row's tokens after this step's commit (the match only: no drafts)."""
        tokens, valid = batch.committed_context(predictions, committed)
        length, _, agree = self.match(tokens, valid)
        return self.feature(length, agree)[:, None].expand(-1, k)

    def feature(self, length: torch.Tensor, agree: torch.Tensor) -> torch.Tensor:
        """[B] long: the evidence feature of a match ``length`` [B] seen ``agree`` [B] times:
        its length class (how many ``LENGTH_EDGES`` it reaches, one ``bucketize``) times
        ``AGREEMENT_CLASSES``, plus its agreement class."""
        edges = self._edges.get(length.device)
        if edges is None:  # once per device: a constant, not an upload per step
            edges = self._edges[length.device] = torch.tensor(self.LENGTH_EDGES, device=length.device)
        cls = torch.bucketize(length, edges, right=True)  # 0 .. len(edges)
        return cls * self.AGREEMENT_CLASSES + (agree - 1).clamp(0, self.AGREEMENT_CLASSES - 1)

    def lookup(self, tokens: torch.Tensor, valid: torch.Tensor, k: int):
        """(drafts [B, k] long, match length [B] long (0: none), agreement [B] long) for
        right-aligned rows ``tokens``/``valid`` [B, W] whose last slot is the pending token."""
        length, start, agree = self.match(tokens, valid)
        return self.continuation(tokens, length, start, k), length, agree

    def match(self, tokens: torch.Tensor, valid: torch.Tensor):
        """(match length [B] long (0: none), the slot its continuation starts at [B] long,
        agreement [B] long (0 without a match)) of right-aligned rows ``tokens``/``valid``
        [B, W] whose last slot is the pending token."""
        b, w = tokens.shape
        dev = tokens.device
        if w == 1:
            none = torch.zeros(b, dtype=torch.long, device=dev)
            return none, none, none
        # padding reads -1, as does the lead before the row: never a token, so a window
        # matches only real tokens (a match cannot run into the padding: it would need all
        # of the row's real tokens to end before its last slot)
        t = torch.where(valid, tokens, -1)
        n = min(self.max_n, w - 1)
        # win[b, e, j] = t[b, e - (n-1) + j], the n tokens ending at slot e, whose
        # continuation would start at slot e + 1, against the row's last n
        win = torch.cat([t.new_full((b, n - 1), -1), t[:, : w - 1]], dim=1).unfold(1, n, 1)
        eq = win == t[:, None, w - n:]  # [B, W-1, n]
        # match length: equal tokens counted back from the end, up to the first mismatch
        length = eq.flip(-1).cummin(dim=-1).values.sum(dim=-1)  # [B, W-1]
        if self.min_n > 1:
            length = torch.where(length >= self.min_n, length, 0)
        best_len, best = longest_match(length)  # the one place a match is chosen
        start = best + 1  # slot of the continuation's first token
        follows = tokens.gather(1, start[:, None])  # [B, 1]
        agree = ((length >= best_len[:, None]) & (tokens[:, 1:] == follows)).sum(dim=1)
        return best_len, start, torch.where(best_len > 0, agree, 0)

    def continuation(self, tokens: torch.Tensor, length: torch.Tensor, start: torch.Tensor,
                     k: int) -> torch.Tensor:
        """[B, k] long: the drafts of a match (``match``): the tokens from slot ``start``
        on, periodic with period ``W - start`` past the row's end; the pending token
        repeated where there is no match (``length`` 0)."""
        w = tokens.shape[1]
        period = (w - start).clamp(min=1)
        j = torch.arange(k, device=tokens.device)[None, :]
        cand = tokens.gather(1, start[:, None] + torch.remainder(j, period[:, None]))
        return torch.where(length[:, None] > 0, cand, tokens[:, w - 1 :])


def longest_match(length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(match length [B] long, its index [B] long) of the match a row's drafts continue:
    the longest, the latest among equally long ones. ``length`` [B, W-1] long is the
    length of the match ending at slot ``e`` (its continuation starts at slot ``e + 1``;
    0: no match). A shorter match never overrides a longer one, wherever it lies."""
    w = length.shape[1] + 1
    s = torch.arange(1, w, device=length.device)
    key, best = (length * w + s).max(dim=1)  # longest first, then latest
    return key // w, best


class ScriptedDrafter:
    """Proposes given tokens: ``scripts[r]`` is the continuation to propose for request r.

    At each step row b proposes ``scripts[row_ids[b]][generated[b] : generated[b] + k]``;
    past the end of a script it proposes ``fill``. With the target's own greedy output as
    script every draft is accepted; any other script forces rejections.

    Scripts are checked at construction (lists of integer ids >= 0, like prompts) and
    against the target's vocabulary when ``generate`` starts (``check_compatible``).
    """

    uses_cache = False

    def __init__(self, scripts: Sequence[Sequence[int]], fill: int = 0):
        if isinstance(scripts, (str, bytes)) or not isinstance(scripts, (list, tuple)):
            raise TypeError(f"ScriptedDrafter scripts must be a list of token-id lists, got "
                            f"{validation.describe(scripts)}")
        if not scripts:
            raise ValueError("ScriptedDrafter needs one script per request, got none")
        self.fill = validation.integer(fill, "ScriptedDrafter fill (a token id)", minimum=0)
        rows = [validation.token_ids(s, f"ScriptedDrafter script {r}") for r, s in enumerate(scripts)]
        for r, s in enumerate(rows):
            if any(t < 0 for t in s):
                raise ValueError(f"ScriptedDrafter script {r} has negative token ids: "
                                 f"{[t for t in s if t < 0][:5]}; token ids are >= 0")
        longest = max(len(s) for s in rows)
        table = torch.full((len(rows), longest + 1), self.fill, dtype=torch.long)
        for r, s in enumerate(rows):  # host-side, once at construction
            if s:
                table[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        self.table = table
        self.top = max([self.fill, *(max(s) for s in rows if s)])  # largest id it proposes

    def check_compatible(self, target: torch.nn.Module) -> None:
        """Every scripted id (and ``fill``) must be in the target's vocabulary."""
        from .models import vocab_size

        self.check_vocab(vocab_size(target))

    def check_vocab(self, vocab: int) -> None:
        if self.top >= vocab:
            rows = self.table.cpu()
            r = int((rows >= vocab).any(dim=1).nonzero()[0])
            raise ValueError(f"ScriptedDrafter script {r} (or fill) has token ids outside the "
                             f"target's vocabulary [0, {vocab}): "
                             f"{rows[r][rows[r] >= vocab].tolist()[:5]}")

    def bind(self, prompts: Sequence[Sequence[int]]) -> None:
        """Called by ``generate`` with the prompts: one script per prompt is required."""
        if len(prompts) > self.table.shape[0]:
            raise ValueError(f"ScriptedDrafter has {self.table.shape[0]} scripts for "
                             f"{len(prompts)} prompts: give one script per prompt")

    def prefill(self, batch: RaggedBatch) -> None:
        if self.table.device != batch.device:
            self.table = self.table.to(batch.device)

    @torch.no_grad()
    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        rows = self.table.index_select(0, batch.row_ids)  # [B, S]
        cols = batch.generated[:, None] + torch.arange(k, device=batch.device)[None, :]
        cols = cols.clamp(max=self.table.shape[1] - 1)
        return rows.gather(1, cols)


class ForcingDrafter:
    """Forces a chosen acceptance pattern on any model.

    ``reference[r]`` is the target's greedy continuation of request r (batch-1 reference,
    e.g. from ``specdec.reference_generate`` with no stop tokens); ``pattern[r][s]`` is how
    many drafts request r must accept at its s-th step (past the end of a pattern: its
    last value; an empty pattern: k). At each step row b proposes the reference tokens
    that follow its committed output, with the token at offset ``pattern`` replaced by a
    different one, so an exact engine accepts exactly ``min(pattern, draft_limit)``
    drafts. Steps are counted per ``generate`` batch (``prefill`` resets the count).
    """

    uses_cache = False

    def __init__(self, reference: Sequence[Sequence[int]], pattern: Sequence[Sequence[int]],
                 vocab_size: int):
        self.vocab_size = validation.integer(vocab_size, "ForcingDrafter vocab_size", minimum=2)
        self.scripted = ScriptedDrafter(reference)
        self.scripted.check_vocab(self.vocab_size)
        if isinstance(pattern, (str, bytes)) or not isinstance(pattern, (list, tuple)):
            raise TypeError(f"ForcingDrafter pattern must be a list of accepted-count lists, "
                            f"got {validation.describe(pattern)}")
        if len(pattern) != len(reference):
            raise ValueError(f"one pattern per request: {len(pattern)} patterns for "
                             f"{len(reference)} references")
        pattern = [validation.token_ids(p, f"ForcingDrafter pattern {r}") for r, p in enumerate(pattern)]
        steps = max(1, max((len(p) for p in pattern), default=1))
        table = torch.full((len(pattern), steps), -1, dtype=torch.long)
        for r, p in enumerate(pattern):  # host-side, once at construction
            if any(a < 0 for a in p):
                raise ValueError(f"pattern {r} has a negative accepted count: {list(p)}")
            if len(p):
                table[r, : len(p)] = torch.tensor(p, dtype=torch.long)
                table[r, len(p):] = p[-1]
        self.table = table
        self.calls = 0

    def bind(self, prompts) -> None:
        self.scripted.bind(prompts)

    def check_compatible(self, target: torch.nn.Module) -> None:
        """The reference ids, and the replacements drawn from ``vocab_size`` ids, must be
        in the target's vocabulary."""
        from .models import vocab_size

        if self.vocab_size > vocab_size(target):
            raise ValueError(f"ForcingDrafter vocab_size {self.vocab_size} exceeds the target's "
                             f"vocabulary of {vocab_size(target)}: it would propose ids the "
                             "target cannot embed")
        self.scripted.check_compatible(target)

    def prefill(self, batch: RaggedBatch) -> None:
        self.scripted.prefill(batch)
        self.table = self.table.to(batch.device)
        self.calls = 0

    def forced(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        """[B] long: the accepted count this step forces per row (before the draft limit)."""
        col = min(self.calls, self.table.shape[1] - 1)
        a = self.table.index_select(0, batch.row_ids)[:, col]
        return torch.where(a < 0, k, a).clamp(max=k)

    @torch.no_grad()
    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        drafts = self.scripted.propose(batch, k)
        a = self.forced(batch, k)
        self.calls += 1
        if k == 0:
            return drafts
        j = torch.arange(k, device=batch.device)[None, :]
        wrong = (drafts + 1) % self.vocab_size
        return torch.where(j == a[:, None], wrong, drafts)
