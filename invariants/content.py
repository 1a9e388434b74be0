"""Content rules for decoding loops the checker does not own (``guard_model`` with prompts).

A foreign loop feeds no ``StepView``: the guard sees only the forwards, the prompts it was
given and, at the end, the outputs. From those it checks

- **C1, context = prompt ++ committed tokens.** Each row of each forward is identified by
  matching its valid context (valid cache slots, then valid new tokens, read left to right)
  against the registered prompts; rows may be reordered, dropped or refilled between
  forwards. A row whose valid context starts with no registered prompt (padding attended as
  content), or that changes a token an earlier forward kept, breaks C1. Without a mask,
  every slot is valid, so C1 sees the padding.
- **C2, greedy consistency** (``greedy=True``). A post-forward hook records each row's
  argmax at every position it computes (the first record of a position stands until a
  token before it is replaced). A token past the prompt that a later forward keeps at the
  same position must equal the argmax recorded there. A forward keeps a token it attends
  as decided: presented by an earlier forward with the same context before it, and now in
  a valid cached slot or the row's first valid new token (its predecessor's logits are
  not computed here, so the loop chose it from earlier ones). Later new tokens are under
  verification, drafts, even when an earlier forward presented them at the same place: a
  row that drafts fewer tokens than the forward's width feeds drafts it does not verify,
  and its drafter may propose them again next step. A loop without a cache attends
  nothing as decided past its first token, so C2 leaves it to C3. The loop decides from
  the very logits recorded, so this holds exactly in bf16 as well.
- **C3, outputs** (``check_outputs``): each output is the row's committed chain, ends at
  its first stop token or has exactly ``max_new_tokens`` tokens; a row that ended early
  without a stop is reported with the argmax the model predicted there.

Where the tokens of the cache come from: the guard wraps the cache's ``update`` (for the
forwards it sees) and fingerprints the keys written to one full-attention layer; before
each forward it fingerprints that layer's cached keys and looks each slot up. Keys are
copied exactly by any realignment, row drop or reorder, so slots are followed wherever a
loop moves them. A fingerprint is an integer hash of the key's bits (exact, independent
of reduction order). A slot the guard never saw written (a cache filled outside the block,
a cache with only sliding-window layers, a legacy tuple cache) makes its row unknown: the
row is not checked (``Content.unknown`` counts such rows) rather than falsely flagged.

State per registered prompt ``p`` over context positions ``t`` (all device tensors; an
extra row ``P`` absorbs writes of unmatched rows): ``state[p, t]`` holds the token last presented
at ``t``, whether a later forward kept it, and the argmax recorded for ``t``. Nothing here reads a tensor on the host, uploads host data or makes a
data-dependent shape, except ``check_outputs`` and the reports (one read each).

Known limits: identical prompts under sampling (``greedy=False``) share one chain, so
only the first such row is checked by C1; a context position is matched to the longest
registered prompt it agrees with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._hf import cache_layers
from .predicates import valid_before
from .rules import Constants

#: the content rules' sentences, by id
C1_PROMPT = ("C1", "content.prompt",
             "a row's valid context starts with one of the registered prompts (padding "
             "attended as content, or a context that is no prompt, breaks it)")
C1_KEPT = ("C1", "content.kept",
           "a token kept by an earlier forward keeps its place: the context is prompt ++ "
           "committed tokens")
C2_ARGMAX = ("C2", "content.argmax",
             "greedy: every token kept past the prompt equals the target's argmax recorded "
             "at its position")
C3_CHAIN = ("C3", "outputs.chain", "each output is the row's committed chain")
C3_STOP = ("C3", "outputs.stop", "an output ends at its first stop token")
C3_LENGTH = ("C3", "outputs.length",
             "an output without a stop token has exactly max_new_tokens = {n} tokens")
C3_ARGMAX = ("C3", "outputs.argmax",
             "greedy: every output token equals the target's argmax recorded at its position")
DEVICE_RULES = (C1_PROMPT, C1_KEPT, C2_ARGMAX)

_HASH = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant, as a signed int64
_END = -3  # past the end of a context: equal to no token and to no chain entry


def key_fingerprint(keys: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] keys, [1, H, 1, D] multipliers -> [B, n] int64: an exact hash of the
    bits of every slot's keys."""
    bits = keys.detach().float().view(torch.int32).long()
    return (bits * mult).sum(dim=(1, 3))


def fingerprint_layer(cache) -> int | None:
    """Index of the first layer that keeps every slot (not a sliding window), or None."""
    for i, layer in enumerate(cache_layers(cache)):
        if not getattr(layer, "is_sliding", False):
            return i
    return None


@dataclass
class ContentSpec:
    """What the caller says about the run (validated at the boundary)."""

    # token ids of each prompt, in prompt order
    prompts: list
    # the budget of new tokens per prompt (None: C3's length rule is not checked)
    max_new_tokens: int | None
    # the ids that end a row
    stop_token_ids: tuple
    # whether the loop picks the argmax (C2 on)
    greedy: bool

    def __post_init__(self):
        if not isinstance(self.prompts, (list, tuple)) or not self.prompts:
            raise ValueError(f"prompts must be a non-empty list of token-id lists, got {self.prompts!r:.80}")
        out = []
        for i, p in enumerate(self.prompts):
            p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
            if not p or not all(isinstance(t, int) and t >= 0 for t in p):
                raise ValueError(f"prompts[{i}] must be a non-empty list of token ids >= 0, got {p!r:.80}")
            out.append(p)
        self.prompts = out
        n = self.max_new_tokens
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1 (or None), got {n!r}")
        stops = tuple(self.stop_token_ids or ())
        if not all(isinstance(s, int) and s >= 0 for s in stops):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {stops!r}")
        self.stop_token_ids = stops
        self.greedy = bool(self.greedy)


class Content:
    """The content state of one guard: per-prompt chains, kept lengths, argmax records,
    the fingerprint table.

    The kept tokens of a chain are always a prefix of it (a token is kept only when every
    token before it is), so one length per prompt says which are kept; C1 and C2 are then
    comparisons of each row's first disagreement with that length (a few ops per forward
    over [B, T] tensors, whatever the batch or context length)."""

    def __init__(self, spec: ContentSpec, device):
        self.spec = spec
        self.device = device
        p = spec.prompts
        self.P = len(p)
        self.lmax = max(len(x) for x in p)
        self.plen_host = [len(x) for x in p]
        # built once, outside any hook: the only uploads the content rules make
        # [P, Lmax] long: prompt tokens, -1 past each prompt
        self.prompt = torch.tensor([x + [-1] * (self.lmax - len(x)) for x in p],
                                   dtype=torch.long, device=device)
        # [P + 1] long: prompt lengths (the extra row: unmatched rows' writes)
        self.plen = torch.tensor(self.plen_host + [0], dtype=torch.long, device=device)
        # [S] long: stop ids (S may be 0)
        self.stops = torch.tensor(list(spec.stop_token_ids), dtype=torch.long, device=device)
        self.T = 0
        # [P + 1, T] long: per prompt (row P: the writes of unmatched rows) and context
        # position, the token last presented there (-1: none); prompts count as presented
        self.chain = None
        # [P + 1, T] long: the argmax recorded for each position (-1: none)
        self.rec = None
        # [P + 1] long: kept length: positions 0 .. K-1 of the chain are kept (the prompt
        # from the start); -1 on row P, which nothing keeps
        self.K = torch.cat([self.plen[: self.P], self.plen[self.P:] - 1])
        self._consts = Constants()  # arange rows and counts, by fill kernels
        self._grow(self.lmax + (spec.max_new_tokens or 0) + 8)
        self.chain[: self.P, : self.lmax] = self.prompt
        # fingerprint table: [M] int64 sorted fingerprints, [M] long their tokens; keys
        # learned since the last sort wait in _pending ([N] fingerprints, [N] tokens)
        self.fp = torch.full((0,), 0, dtype=torch.long, device=device)
        self.fp_tok = torch.full((0,), 0, dtype=torch.long, device=device)
        self._pending: list = []
        self._unknown: list = []  # [B] bool per looked-up forward: rows skipped
        self._mult = {}
        self._wrapped: list = []  # (cache, had_attribute, old attribute)
        self._layer: dict = {}  # id(cache) -> fingerprint layer index (once known)
        # id(cache) -> (keys tensor, its version, [B, W] tokens of its slots) after the
        # last forward that appended to it: while the cache holds that very tensor,
        # unchanged, its tokens are known without a lookup
        self._seen: dict = {}
        self._stash = None  # the current forward's [B, q] ids, for the cache's update
        self._tok = None  # the current forward's [B, c + q] slot tokens (cached, new)
        self.skipped = 0  # forwards whose context could not be read (host count)
        self._last = None  # what the current forward's record hook needs

    # -- state size ----------------------------------------------------------------------
    def _grow(self, t: int) -> None:
        """Make room for context positions 0 .. t-1 (new columns by fill kernels)."""
        if t <= self.T:
            return
        t = max(t, 2 * self.T)
        chain = torch.full((self.P + 1, t), -1, dtype=torch.long, device=self.device)
        rec = torch.full((self.P + 1, t), -1, dtype=torch.long, device=self.device)
        if self.chain is not None:
            self._flush()
            chain[:, : self.T] = self.chain
            rec[:, : self.T] = self.rec
        self.chain, self.rec, self.T = chain, rec, t

    def _flush(self) -> None:
        """Write the records of a forward whose record hook did not run."""
        last, self._last = self._last, None
        if last is not None:
            self.rec.index_copy_(0, last[0], last[1])

    @property
    def unknown(self) -> int:
        """Rows skipped so far because a cached slot was never seen written (a host read)."""
        return int(torch.cat(self._unknown).sum().item()) if self._unknown else 0

    # -- the cache's tokens ----------------------------------------------------------------
    def _mult_for(self, h: int, d: int) -> torch.Tensor:
        m = self._mult.get((h, d))
        if m is None:
            i = torch.arange(h * d, device=self.device, dtype=torch.long).view(h, d)
            m = self._mult[(h, d)] = ((i * 2 + 1) * _HASH)[None, :, None, :]
        return m

    def layer_of(self, cache) -> int | None:
        """The fingerprint layer of ``cache`` (chosen once its layers exist)."""
        key = id(cache)
        layer = self._layer.get(key)
        if layer is None:
            layer = fingerprint_layer(cache)
            if layer is not None:
                self._layer[key] = layer
        return layer

    def watch(self, cache) -> None:
        """Wrap ``cache.update`` (once) so that the keys each forward writes to the
        fingerprint layer are learned with the forward's tokens."""
        if any(c is cache for c, _, _ in self._wrapped):
            return
        had = "update" in vars(cache)
        old = vars(cache).get("update")
        inner = cache.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            layer = self.layer_of(cache) if self._stash is not None else -1
            if layer is not None and layer_idx != layer:
                return inner(key_states, value_states, layer_idx, *args, **kwargs)
            before = _layer_keys(cache, layer_idx) if layer is not None else None
            out = inner(key_states, value_states, layer_idx, *args, **kwargs)
            if layer is None and layer_idx != self.layer_of(cache):
                return out  # the layers exist once the first update made them
            self._learn(key_states)
            self._appended(cache, before, _layer_keys(cache, layer_idx))
            return out
        cache.update = update
        self._wrapped.append((cache, had, old))

    def unwatch(self) -> None:
        for cache, had, old in self._wrapped:
            if had:
                cache.update = old
            else:
                vars(cache).pop("update", None)
        self._wrapped, self._layer, self._seen = [], {}, {}

    def _appended(self, cache, before, after) -> None:
        """Remember the slot tokens of ``cache`` when this forward's update made a new
        keys tensor holding the old slots followed by the new ones (a dynamic cache)."""
        tok = self._tok
        self._seen.pop(id(cache), None)
        if tok is None or not isinstance(after, torch.Tensor) or after is before \
                or after.dim() != 4 or after.is_inference() \
                or tuple(after.shape[::2]) != tuple(tok.shape):
            return
        self._seen[id(cache)] = (after, after._version, tok)

    def _learn(self, keys: torch.Tensor) -> None:
        ids = self._stash
        if keys.dim() != 4 or keys.shape[0] != ids.shape[0] or keys.shape[2] != ids.shape[1]:
            return
        fp = key_fingerprint(keys, self._mult_for(keys.shape[1], keys.shape[3]))
        self._pending.append((fp.reshape(-1), ids.reshape(-1)))

    def _table(self):
        """The sorted fingerprint table, with the keys learned since the last lookup."""
        if self._pending:
            fps, toks = zip(*self._pending)
            self._pending = []
            self.fp, order = torch.cat((self.fp,) + fps).sort()
            self.fp_tok = torch.cat((self.fp_tok,) + toks)[order]
        return self.fp, self.fp_tok

    def cached_tokens(self, cache, c: int, b: int):
        """([B, C] long: the token at every cache slot, -2 where never seen; whether a
        slot may be -2), or None when the cache cannot be read."""
        self.watch(cache)
        layer = self.layer_of(cache)
        if layer is None:
            return None
        keys = _layer_keys(cache, layer)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != b \
                or keys.shape[2] < c:
            return None
        seen = self._seen.get(id(cache))
        if seen is not None and seen[0] is keys and keys._version == seen[1] \
                and tuple(seen[2].shape) == (b, c):
            return seen[2], False  # the very tensor this guard saw written, untouched
        fp = key_fingerprint(keys[:, :, :c], self._mult_for(keys.shape[1], keys.shape[3]))
        table, tokens = self._table()
        if table.shape[0] == 0:
            return torch.full((b, c), -2, dtype=torch.long, device=keys.device), True
        at = torch.searchsorted(table, fp).clamp_(max=table.shape[0] - 1)
        return torch.where(table[at] == fp, tokens[at], -2), True

    # -- one forward ---------------------------------------------------------------------
    def skip(self, ids: torch.Tensor | None = None) -> None:
        """A forward whose context cannot be read (a prepared 4-D mask, an unreadable
        cache): its tokens are still learned (``ids``, when its cache is watched), and
        every record is dropped, since this forward may replace tokens unseen."""
        self.skipped += 1
        self._stash, self._last, self._tok = ids, None, None
        self.rec.fill_(-1)

    def before(self, ids: torch.Tensor, cache, c: int, valid: torch.Tensor | None):
        """Check C1/C2 for one forward of ``ids`` [B, q] over ``c`` cache slots with
        ``valid`` [B, c + q] (None: every slot). Returns ([B] masks by DEVICE_RULES,
        report context) or None when the forward cannot be read."""
        self._flush()
        b, q = ids.shape
        self._stash = ids if cache is not None else None
        self._tok = None
        looked = False
        if c > 0:
            got = self.cached_tokens(cache, c, b) if cache is not None else None
            if got is None:
                self.skip(self._stash)
                return None
            old, looked = got
            tok = torch.cat([old, ids], dim=1)
        else:
            if cache is not None:
                self.watch(cache)
            tok = ids
        self._tok = tok
        s = c + q
        self._grow(max(s, self.lmax) + 1)
        t, dev, P = self.T, ids.device, self.P
        pos = self._consts.row(t, dev)  # [1, T]
        # [B, T + 1] long: the valid context read left to right, _END past its end (the
        # last column takes the invalid slots)
        ctx = torch.full((b, t + 1), _END, dtype=torch.long, device=dev)
        if valid is None:
            ctx[:, :s] = tok
            n = self._consts.count(s, b, dev)  # [B] valid slots
            cached = c  # valid cached slots (every row)
            col = self._consts.row(s + 1, dev)[:, 1:]  # [1, S]: each slot's next position
        else:
            valid = valid if valid.dtype == torch.bool else valid.bool()
            col = valid.cumsum(dim=1)  # [B, S] long: valid slots up to each slot
            ctx.scatter_(1, torch.where(valid, col - 1, t), tok)
            n = col[:, -1]
            cached = col[:, c - 1] if c > 0 else 0
            col = torch.where(valid, col, 0)  # position 0 is never a record that is read
        ctx = ctx[:, :t]
        # match every row against every prompt ([B, P]): the chains begin with the prompts,
        # so a context agreeing with chain p over min(its length, len(p)) tokens starts
        # with prompt p (or is a prefix of it: a prefill in pieces); the longest agreement
        # wins; D [B] is the matched row's agreement with its chain (-1: no prompt)
        agree = (ctx[:, None, :] == self.chain[None, :P]).cumprod(dim=2).sum(dim=2)
        ok = agree >= torch.minimum(self.plen[None, :P], n[:, None])
        D, best = torch.where(ok, agree, -1).max(dim=1)
        if looked:  # a row with a slot never seen written is not checked
            unknown = (ctx == -2).any(dim=1)
            self._unknown.append(unknown)
            no_prompt = (D < 0) & ~unknown
            D = torch.where(unknown, -1, D)
        else:
            no_prompt = D < 0
        idx = torch.where(D >= 0, best, P)  # [B]: the prompt row, P for none
        chain, rec, k0 = self.chain[idx], self.rec[idx], self.K[idx]  # [B, T] [B, T] [B]
        live = n  # [B]: past it nothing is checked: the context's end, or its first stop
        if self.stops.numel():
            stop = (ctx[:, :, None] == self.stops).any(dim=2) & (pos >= self.plen[idx][:, None])
            live = torch.minimum(n, (stop.cumsum(dim=1) == 0).sum(dim=1) + 1)
        # kept after this forward: what a forward attends without the logits it was chosen
        # from being computed here (a valid cached slot, or the row's first valid new token:
        # its predecessor is cached), presented before with the same context up to it, and
        # live. A later new token is under verification, even when an earlier forward
        # presented it at the same place (a draft the loop did not verify then, proposed
        # again): it is kept only once a forward attends it as decided
        if isinstance(cached, int):
            k1 = torch.minimum(D, live).clamp(max=cached + 1)
        else:
            k1 = torch.minimum(torch.minimum(D, live), cached + 1)
        changed = D < torch.minimum(k0, live)  # C1: a kept token replaced
        if self.spec.greedy:  # C2: newly kept tokens against the recorded argmax
            wrong = ((ctx != rec) & (rec >= 0) & (pos >= k0[:, None])
                     & (pos < k1[:, None])).any(dim=1)
        else:
            wrong = self._consts.zeros(b, dev)
        # tokens presented before and now replaced or dropped (past the kept ones, from the
        # first disagreement on while live, from the context's end on): records past the
        # first of them are stale
        first = torch.maximum(k0, D)
        first = torch.where(first < live, first, torch.maximum(first, n))
        rec_new = torch.where(pos > first[:, None], -1, rec)
        self.chain.index_copy_(0, idx, torch.where(
            ctx >= 0, ctx, torch.where(pos < k0[:, None], chain, -1)))
        self.K.index_copy_(0, idx, torch.maximum(k0, k1))
        self._last = (idx, rec_new, col, s)
        report = {"ctx": ctx, "n": n, "chain": chain, "k0": k0, "k1": k1, "live": live,
                  "rec": rec, "idx": idx}
        return [no_prompt, changed, wrong], report

    def after(self, logits) -> None:
        """Record the argmax of every computed position of the forward ``before`` read
        (the first record of a position stands)."""
        last, self._stash, self._tok = self._last, None, None
        if last is None:
            return
        idx, rec, col, s = last
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 \
                or logits.shape[1] > s or logits.shape[0] != idx.shape[0]:
            return self._flush()
        self._last = None
        col = col[:, s - logits.shape[1]:].expand(idx.shape[0], -1)
        cur = rec.gather(1, col)
        rec.scatter_(1, col, torch.where(cur < 0, logits.argmax(dim=-1), cur))
        self.rec.index_copy_(0, idx, rec)

    # -- host reads (reports, outputs) -----------------------------------------------------
    def host_state(self):
        """(chain, kept, rec) of every prompt as host lists (one read)."""
        self._flush()
        host = torch.cat([self.chain[: self.P], self.rec[: self.P],
                          self.K[: self.P, None]], dim=1).tolist()
        t = self.T
        chains = [row[:t] for row in host]
        kept = [[1 if j < row[2 * t] else 0 for j in range(t)] for row in host]
        recs = [row[t: 2 * t] for row in host]
        return chains, kept, recs


def _layer_keys(cache, layer: int):
    layers = cache_layers(cache)
    return getattr(layers[layer], "keys", None) if layer < len(layers) else None


def first_stop(tokens, stops) -> int | None:
    for i, t in enumerate(tokens):
        if t in stops:
            return i
    return None


__all__ = ["Content", "ContentSpec", "DEVICE_RULES", "key_fingerprint", "fingerprint_layer",
           "C1_PROMPT", "C1_KEPT", "C2_ARGMAX", "C3_CHAIN", "C3_STOP", "C3_LENGTH", "C3_ARGMAX"]
