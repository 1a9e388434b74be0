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
    run's sampling rule (``propose_sampled``)."""

    uses_cache = True

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def check_compatible(self, target: torch.nn.Module) -> None:
        from .models import vocab_size

        vt, vd = vocab_size(target), vocab_size(self.model)
        if vt != vd:
            raise ValueError(
                f"draft and target vocabularies must match: the draft model has {vd} tokens, "
                f"the target {vt}; a draft proposes token ids the target must verify"
            )

    def prefill(self, batch: RaggedBatch) -> None:
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
        kpos = batch.positions[:, : w - 1] if batch.holes and \
            cache_mod.sliding_window(self.model) is not None else None
        drafts, seen = [], []
        for i in range(k + 1):  # k + 1 sequential one-token forwards (see module docstring)
            mask = torch.cat([mask, ones], dim=1)
            pos = layout.verify_position(batch.lengths, i)[:, None]
            if kpos is not None:
                kpos = torch.cat([kpos, pos], dim=1)
            logits = cache_mod.forward(self.model, token, pos, mask, cache, key_positions=kpos)[:, -1]
            if sampling is not None:
                seen.append(logits)
            if i < k:
                token = (logits.argmax(-1) if sampling is None else
                         draft_choice(logits, sampling, batch.row_ids, batch.generated + i))[:, None]
                drafts.append(token)
        out = torch.cat(drafts, dim=1) if drafts else torch.zeros(b, 0, dtype=torch.long,
                                                                   device=batch.device)
        return out, (torch.stack(seen, dim=1) if sampling is not None else None)


class NGramDrafter:
    """Model-free drafts from n-grams of the row's own prompt and output.

    For n from ``max_n`` down to ``min_n``: find the latest earlier occurrence of the row's
    last n tokens and propose the k tokens that followed it (prompt lookup decoding). Rows
    with no match propose their pending token repeated. Vectorised over rows. A batch with
    holes is first compacted logically (``RaggedBatch.contiguous_tokens``, an int gather),
    so that no suffix or match spans a rejected slot.
    """

    uses_cache = False

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def prefill(self, batch: RaggedBatch) -> None:
        pass

    @torch.no_grad()
    def propose(self, batch: RaggedBatch, k: int) -> torch.Tensor:
        tokens, valid = batch.contiguous_tokens()
        b, w = tokens.shape
        dev = tokens.device
        pending = tokens[:, w - 1 :]
        best = pending.expand(b, k).clone()
        if k == 0:
            return best
        found = torch.zeros(b, dtype=torch.bool, device=dev)
        for n in range(self.max_n, self.min_n - 1, -1):  # a few n-gram sizes, not rows
            if w - 1 < n:
                continue
            # windows[b, s, :] = tokens[b, s : s + n] for starts s in 0 .. w - n - 1
            windows = tokens[:, : w - 1].unfold(1, n, 1)  # [B, w-n, n]
            wvalid = valid[:, : w - 1].unfold(1, n, 1).all(dim=2)
            suffix = tokens[:, w - n :]  # [B, n]
            hit = (windows == suffix[:, None, :]).all(dim=2) & wvalid  # [B, w - n]
            hit = hit & valid[:, w - n : w].all(dim=1, keepdim=True)
            s = torch.arange(hit.shape[1], device=dev)[None, :]
            last = torch.where(hit, s, -1).max(dim=1).values  # latest match start
            ok = (last >= 0) & ~found
            follow = (last + n)[:, None] + torch.arange(k, device=dev)[None, :]
            follow = follow.clamp(max=w - 1)
            cand = tokens.gather(1, follow)
            best = torch.where(ok[:, None], cand, best)
            found = found | ok
        return best


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
