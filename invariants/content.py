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
    """[B, H, n, D] keys -> [B, n] int64: an exact hash of the bits of every slot's keys."""
    bits = keys.detach().float().contiguous().view(torch.int32).long()
    return (bits * mult[: keys.shape[1], : keys.shape[3]][None, :, None, :]).sum(dim=(1, 3))


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
    """The content state of one guard: per-prompt chains, records, the fingerprint table."""

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
        # [P + 1, T, 3] long: per prompt (row P: the writes of unmatched rows) and context
        # position, the token last presented there (-1: none), whether a later forward
        # kept it (0/1), the argmax recorded for it (-1: none)
        self.state = None
        self._consts = Constants()  # arange rows and counts, by fill kernels
        self._grow(self.lmax + (spec.max_new_tokens or 0) + 8)
        self.state[: self.P, : self.lmax, 0] = self.prompt  # prompts count as presented
        # fingerprint table: [M] int64 sorted fingerprints, [M] long their tokens
        self.fp = torch.full((0,), 0, dtype=torch.long, device=device)
        self.fp_tok = torch.full((0,), 0, dtype=torch.long, device=device)
        # [1] long: rows skipped because a valid slot's token was unknown
        self._unknown = torch.zeros(1, dtype=torch.long, device=device)
        self._mult = {}
        self._wrapped: list = []  # (cache, had_attribute, old attribute)
        self._layer: dict = {}  # id(cache) -> fingerprint layer index (once known)
        self._stash = None  # the current forward's [B, q] ids, for the cache's update
        self.skipped = 0  # forwards whose context could not be read (host count)
        self._last = None  # what the current forward's record hook needs

    # -- state size ----------------------------------------------------------------------
    def _grow(self, t: int) -> None:
        """Make room for context positions 0 .. t-1 (new columns by fill kernels)."""
        if t <= self.T:
            return
        t = max(t, 2 * self.T)
        new = torch.full((self.P + 1, t, 3), -1, dtype=torch.long, device=self.device)
        new[:, :, 1].fill_(0)
        if self.state is not None:
            new[:, : self.T] = self.state
        self.state, self.T = new, t

    @property
    def unknown(self) -> int:
        """Rows skipped so far because a cached slot was never seen written (a host read)."""
        return int(self._unknown.item())

    # -- the cache's tokens ----------------------------------------------------------------
    def _mult_for(self, h: int, d: int) -> torch.Tensor:
        m = self._mult.get((h, d))
        if m is None:
            i = torch.arange(h * d, device=self.device, dtype=torch.long).view(h, d)
            m = self._mult[(h, d)] = (i * 2 + 1) * _HASH
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
            out = inner(key_states, value_states, layer_idx, *args, **kwargs)
            if self._stash is not None and layer_idx == self.layer_of(cache):
                self._learn(key_states)
            return out
        cache.update = update
        self._wrapped.append((cache, had, old))

    def unwatch(self) -> None:
        for cache, had, old in self._wrapped:
            if had:
                cache.update = old
            else:
                vars(cache).pop("update", None)
        self._wrapped, self._layer = [], {}

    def _learn(self, keys: torch.Tensor) -> None:
        ids = self._stash
        if keys.dim() != 4 or keys.shape[0] != ids.shape[0] or keys.shape[2] != ids.shape[1]:
            return
        fp = key_fingerprint(keys, self._mult_for(keys.shape[1], keys.shape[3])).reshape(-1)
        allfp = torch.cat([self.fp, fp])
        self.fp, order = allfp.sort()
        self.fp_tok = torch.cat([self.fp_tok, ids.reshape(-1)])[order]

    def cached_tokens(self, cache, c: int, b: int) -> torch.Tensor | None:
        """[B, C] long: the token at every cache slot (-2 where never seen), or None when
        the cache cannot be read."""
        self.watch(cache)
        layer = self.layer_of(cache)
        if layer is None:
            return None
        keys = getattr(cache_layers(cache)[layer], "keys", None)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != b \
                or keys.shape[2] < c:
            return None
        fp = key_fingerprint(keys[:, :, :c], self._mult_for(keys.shape[1], keys.shape[3]))
        if self.fp.shape[0] == 0:
            return torch.full((b, c), -2, dtype=torch.long, device=keys.device)
        at = torch.searchsorted(self.fp, fp).clamp(max=self.fp.shape[0] - 1)
        return torch.where(self.fp[at] == fp, self.fp_tok[at], -2)

    # -- one forward ---------------------------------------------------------------------
    def skip(self, ids: torch.Tensor | None = None) -> None:
        """A forward whose context cannot be read (a prepared 4-D mask, an unreadable
        cache): its tokens are still learned (``ids``, when its cache is watched), and
        every record is dropped, since this forward may replace tokens unseen."""
        self.skipped += 1
        self._stash, self._last = ids, None
        self.state[:, :, 2].fill_(-1)

    def before(self, ids: torch.Tensor, cache, c: int, valid: torch.Tensor | None):
        """Check C1/C2 for one forward of ``ids`` [B, q] over ``c`` cache slots with
        ``valid`` [B, c + q] (None: every slot). Returns ([B] masks by DEVICE_RULES,
        report context) or None when the forward cannot be read."""
        b, q = ids.shape
        self._stash = ids if cache is not None else None
        self._last = None
        unknown = None
        if c > 0:
            old = self.cached_tokens(cache, c, b) if cache is not None else None
            if old is None:
                self.skip(self._stash)
                return None
            tok = torch.cat([old, ids], dim=1)
        else:
            if cache is not None:
                self.watch(cache)
            tok = ids
        s = c + q
        self._grow(max(s, self.lmax) + 1)
        t = self.T
        dev = ids.device
        pos = self._consts.row(t, dev)  # [1, T]
        if valid is None:
            rank, n, col = pos[:, :s].expand(b, s), self._consts.count(s, b, dev), None
            cached = self._consts.count(c, b, dev)  # [B] long: valid cached slots
        else:
            valid = valid.bool()
            rank = valid_before(valid)  # [B, S] long
            n = valid.sum(dim=1)  # [B]
            col = torch.where(valid, rank, t)
            cached = valid[:, :c].sum(dim=1)
        # [B, T] long: the valid context read left to right, _END past its end
        ctx = torch.full((b, t + 1), _END, dtype=torch.long, device=dev)
        if col is None:
            ctx[:, :s] = tok
        else:
            ctx.scatter_(1, col, tok)
        ctx = ctx[:, :t]
        in_ctx = pos < n[:, None]
        # match every row against every prompt ([B, P]): the chains begin with the prompts,
        # so a context agreeing with chain p over min(its length, len(p)) tokens starts
        # with prompt p (or is a prefix of it: a prefill in pieces); the longest agreement
        # wins
        agree = (ctx[:, None, :] == self.state[None, : self.P, :, 0]).cumprod(dim=2).sum(dim=2)
        score = torch.where(agree >= torch.minimum(self.plen[None, : self.P], n[:, None]),
                            agree + 1, 0)
        best, top = score.argmax(dim=1), score.amax(dim=1)
        matched = top > 0
        no_prompt = ~matched & (n > 0)
        if c > 0:
            unknown = (ctx == -2).any(dim=1)
            matched, no_prompt = matched & ~unknown, no_prompt & ~unknown
            self._unknown += unknown.sum()
        idx = torch.where(matched, best, self.P)  # [B]: the prompt row, P for none
        st = self.state[idx]  # [B, T, 3]
        chain, kept, rec = st[..., 0], st[..., 1] > 0, st[..., 2]
        past = pos >= self.plen[idx][:, None]  # past the prompt
        rows = in_ctx & matched[:, None]  # the context of a matched row
        live = rows
        if self.stops.numel():  # past a row's first stop nothing is checked
            stop = (ctx[:, :, None] == self.stops).any(dim=2) & past
            live = live & (stop.long().cumsum(dim=1) - stop.long() == 0)
        eq = ctx == chain
        # presented before with the same context up to it: a token is kept only when
        # nothing before it changed
        same = eq.cumprod(dim=1).bool()
        # attended without the logits it was chosen from being computed here: a valid
        # cached slot, or the row's first valid new token (its predecessor is cached). A
        # later new token is under verification in this forward, even when an earlier
        # forward presented it at the same place (a draft the loop did not verify then,
        # proposed again): it is kept only once a forward attends it as decided
        decided = pos <= cached[:, None]
        changed = live & kept & ~eq
        newly = live & ~kept & same & past & decided
        if self.spec.greedy:
            wrong = newly & (rec >= 0) & (ctx != rec)
        else:
            wrong = torch.zeros_like(newly)
        # tokens presented before and now replaced or dropped: records past them are stale
        gone = (chain >= 0) & ~kept & ((live & ~same) | ~in_ctx)
        first_gone = torch.where(gone, pos, t).amin(dim=1, keepdim=True)  # [B, 1]
        new = torch.stack([torch.where(rows, ctx, torch.where(kept | ~past, chain, -1)),
                           (kept | (live & same & (decided | ~past))).long(),
                           torch.where(pos > first_gone, -1, rec)], dim=2)
        self.state.index_copy_(0, idx, new)
        self._last = (idx, matched, valid, rank, s)
        masks = [no_prompt, changed.any(dim=1), wrong.any(dim=1)]
        report = {"ctx": ctx, "n": n, "chain": chain, "kept": kept, "rec": rec,
                  "idx": idx, "slots": [None, changed, wrong]}
        return masks, report

    def after(self, logits) -> None:
        """Record the argmax of every computed position of the forward ``before`` read."""
        last, self._last, self._stash = self._last, None, None
        if last is None or not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            return
        idx, matched, valid, rank, s = last
        ql = logits.shape[1]
        if ql > s or logits.shape[0] != idx.shape[0]:
            return
        am = logits.argmax(dim=-1)  # [B, ql]
        ok = matched[:, None] if valid is None else valid[:, s - ql:] & matched[:, None]
        # position 0 is never a record that is read (records start past the prompt): the dump
        col = torch.where(ok, rank[:, s - ql:] + 1, 0)
        rec = self.state[idx, :, 2]  # [B, T]
        cur = rec.gather(1, col)
        rec.scatter_(1, col, torch.where(cur < 0, am, cur))
        self.state[:, :, 2].index_copy_(0, idx, rec)

    # -- host reads (reports, outputs) -----------------------------------------------------
    def host_state(self):
        """(chain, kept, rec) of every prompt as host lists (one read)."""
        host = self.state[: self.P].tolist()  # [P][T][3]
        return tuple([[x[i] for x in row] for row in host] for i in range(3))


def first_stop(tokens, stops) -> int | None:
    for i, t in enumerate(tokens):
        if t in stops:
            return i
    return None


__all__ = ["Content", "ContentSpec", "DEVICE_RULES", "key_fingerprint", "fingerprint_layer",
           "C1_PROMPT", "C1_KEPT", "C2_ARGMAX", "C3_CHAIN", "C3_STOP", "C3_LENGTH", "C3_ARGMAX"]
