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
forwards it sees) and fingerprints the keys written to one full-attention layer. Before a
forward, while the cache still shows the keys its last update returned, untouched (the
same tensor, or for a cache that computes its keys on access, such as the engine's
``SlabCache``, a view of the same storage with the same shape, strides and offset; and
the storage's version counter as it was when that forward ended: no write since, in
place or by a realignment), its slots are that forward's slots; otherwise the guard
fingerprints that layer's cached keys and looks each slot up (a row whose slots carry
exactly the fingerprints the last forward left in a row takes that row's tokens without
a lookup). A write that bypasses the version counter (through ``.data``) is not seen.
Keys are copied exactly by any realignment, row drop or reorder, so slots are followed
wherever a loop moves them. A fingerprint is an integer hash of the key's bits, read as
8-byte words where the head size allows (exact, independent of reduction order). A slot
the guard never saw written (a
cache filled outside the block, a cache with only sliding-window layers, a legacy tuple
cache) makes its row unknown: the row is not checked (``Content.unknown`` counts such
rows) rather than falsely flagged.

Where the work is done: the hooks only capture, by a few kernels per forward and with no
host read, upload or data-dependent shape, what the rules need (a copy of the ids and of
the valid mask, the fingerprints, the argmax of the logits). The captures wait with the
coherence flags for the mode's one host read (per forward in strict mode, before the
forward runs; at ``check()`` in fast mode), and the rules then run on the host, forward
by forward in order, over host lists: per registered prompt the tokens last presented at
each context position, the kept length (the kept tokens are always a prefix: a token is
kept only when every token before it is, the prompt from the start) and the argmax
recorded at each position. A row is matched to its prompt through a radix tree of the
prompts, its context compared with the chain by slice comparisons. The keys a forward
writes are fingerprinted later, several forwards at once and together with the cache
slots a lookup needs (one ``cat``, one fingerprint). Fast mode keeps the captures (and
the written keys of the fingerprint layer) on the device until the read: in a long block,
call ``guard.check()`` now and then.

Known limits: rows of identical prompts are told apart by their agreement with each
chain and, within one forward, by taking a prompt no other row took: under sampling, a
loop that reorders such rows between forwards can make their chains swap, and
``check_outputs`` then reports C3 on outputs that are right.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress, repeat

import torch

from ._hf import cache_layers

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
#: mask dtypes the host reads as they are (0/1 or False/True) when no copy is needed
_READ_AS_IS = (torch.bool, torch.long, torch.int32)
_NOT_WATCHED = object()  # an update the content rules do not learn from


def key_words(keys: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] keys -> [B, H, n, w] integer words of their bits: each key vector's
    bytes as int64 words when they divide into 8-byte words (fp32 with an even head
    size, bf16/fp16 with one divisible by 4: no conversion), else its float32 value's
    bits as int32 words (exact for fp16/bf16). Which one depends on the dtype and head
    size only, so a copied key gets the words it had."""
    if keys.requires_grad:
        keys = keys.detach()
    if (keys.shape[-1] * keys.element_size()) % 8 == 0:
        try:
            return keys.view(torch.int64)
        except RuntimeError:  # a layout whose last dimension cannot be reinterpreted
            return keys.contiguous().view(torch.int64)
    return _float_words(keys)


def _float_words(keys: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] keys -> [B, H, n, D] int32: the bits of their float32 values."""
    k32 = keys if keys.dtype == torch.float32 else keys.float()
    try:
        return k32.view(torch.int32)
    except RuntimeError:
        return k32.contiguous().view(torch.int32)


def key_fingerprint(keys: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    """[B, H, n, D] keys, [1, H, 1, w] odd int64 multipliers, one per word of
    ``key_words`` -> [B, n] int64: an exact hash of the bits of every slot's keys (the
    products and their sum wrap modulo 2^64, in any order). Multipliers of another width
    (``w = D``: one per element) hash the keys' float32 bits instead."""
    if keys.requires_grad:
        keys = keys.detach()
    words = key_words(keys)
    if mult.shape[-1] != words.shape[-1]:
        words = _float_words(keys)
    # heads first: an int64 sum over the short word dimension is slow on a CPU
    # (provenance.fingerprint)
    return (words * mult).sum(dim=1).sum(dim=-1)


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
    """The content state of one guard: per-prompt chains, kept lengths and argmax records
    (host lists), the fingerprint table (a host dict), and the hooks' side.

    The hooks only capture, on the device and by a few kernels per forward, what the
    content rules need: the forward's ids and valid mask (copies), the fingerprints of the
    cache's slots when the cache may have moved, of the keys it writes, and the argmax of
    its logits. Each capture is an ``Entry`` of the guard, read with its coherence flags
    in the one host transfer of the mode (per forward in strict mode, at ``check()`` in
    fast mode); ``process`` then applies C1/C2 forward by forward, in order, on the host.
    """

    def __init__(self, spec: ContentSpec, device, sink, copy: bool = True):
        self.spec = spec
        self.device = device
        self._sink = sink  # appends an Entry to the guard's pending flags
        # whether captures copy the loop's tensors (False: they are read before the forward
        # runs, as in strict mode, so the loop cannot change them first)
        self.copy = copy
        p = spec.prompts
        self.P = len(p)
        self.lmax = max(len(x) for x in p)
        self.plen_host = [len(x) for x in p]
        self.stop_set = frozenset(spec.stop_token_ids)
        # per prompt: the tokens last presented at context positions 0, 1, ..., the
        # kept length (positions 0 .. K-1 are kept; the prompt from the start: a token is
        # kept only when every token before it is, so the kept tokens are a prefix), the
        # argmax recorded at each position (-1: none)
        self.chains = [list(x) for x in p]
        self.kept = list(self.plen_host)
        self.recs: list = [[] for _ in p]
        self._tree = _prompt_tree(p)
        self._cands: dict = {}  # the first Lmax tokens of a context -> its candidate prompts
        self.table: dict = {}  # key fingerprint -> token
        self.unknown = 0  # rows skipped: a valid cached slot never seen written
        self.skipped = 0  # forwards whose context could not be read
        self._mult = {}
        self._wrapped: list = []  # (cache, had_attribute, old attribute)
        self._layer: dict = {}  # id(cache) -> fingerprint layer index (once known)
        self._computed: set = set()  # id of each watched cache whose layer computes its keys
        self._due = None  # the current forward's entry of ``_seen``, its version not read yet
        # hook side, id(cache) -> (keys tensor, its version, forward number) after the last
        # forward that appended to it: while the cache holds that very tensor, unchanged,
        # its slots are that forward's (no fingerprint); host side, id(cache) ->
        # (forward number, [B][W] slot tokens)
        self._seen: dict = {}
        self._slots: dict = {}
        # learned keys not fingerprinted yet: (learn capture, its info, [B, H, q, D] keys)
        self._refs: list = []
        self._groups = 0  # runs of learned keys fingerprinted so far
        self._group = None  # host side: (run number, its flat [B * W] fingerprints)
        self._stash = None  # the current forward's [B, q] ids copy, for the cache's update
        self._fwd = None  # the current forward's (number, b, c + q), for the cache's update
        self._count = 0  # forwards captured
        self._last = None  # what the current forward's record hook needs
        # host side: the last forward processed, for its learned keys and its records; the
        # (prompt, ...) of each row of the last forward and of the one before
        self._host = None
        self._host_rows: list = []
        self._host_prev: list = []

    # -- the cache ---------------------------------------------------------------------------
    def _fingerprint(self, keys: torch.Tensor) -> torch.Tensor:
        """``key_fingerprint`` of [B, H, n, D] keys -> [B, n] int64."""
        words = key_words(keys)
        return (words * self._mult_for(words.shape[1], words.shape[3])).sum(dim=3).sum(dim=1)

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

        key, layers = id(cache), self._layer

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            known = layers.get(key)
            if (known is not None and layer_idx != known) or self._stash is None:
                return inner(key_states, value_states, layer_idx, *args, **kwargs)
            before = self._watching(cache, layer_idx)
            out = inner(key_states, value_states, layer_idx, *args, **kwargs)
            if before is not _NOT_WATCHED:
                self._learn(key_states, cache, layer_idx, before, out)
            return out
        cache.update = update
        self._wrapped.append((cache, had, old))

    def unwatch(self) -> None:
        for cache, had, old in self._wrapped:
            if had:
                cache.update = old
            else:
                vars(cache).pop("update", None)
        self._wrapped, self._seen, self._due = [], {}, None
        self._computed.clear()
        self._layer.clear()  # in place: the wrappers' closures hold this dict

    def _watching(self, cache, layer_idx: int):
        """Before ``cache.update``: the keys tensor of layer ``layer_idx`` when the update
        is one to learn from (a captured forward, the fingerprint layer or layers not made
        yet), else _NOT_WATCHED."""
        if self._stash is None:
            return _NOT_WATCHED
        layer = self.layer_of(cache)
        if layer is None:
            return None
        if layer_idx != layer:
            return _NOT_WATCHED
        return self._held_keys(cache, layer_idx)

    def _held_keys(self, cache, layer_idx: int):
        """``_layer_keys(cache, layer_idx, tensor_only=True)``, remembering per watched
        cache that its layer computes its keys on access (``SlabCache``: a view of its
        slab each time), so that such a cache is not asked again at every update."""
        key = id(cache)
        if key in self._computed:
            return None
        keys = _layer_keys(cache, layer_idx, tensor_only=True)
        if keys is None and any(c is cache for c, _, _ in self._wrapped) \
                and _layer_keys(cache, layer_idx) is not None:
            self._computed.add(key)  # a property: never the tensor a dynamic cache holds
        return keys

    def _learn(self, keys: torch.Tensor, cache=None, layer_idx: int = 0, before=None,
               out=None) -> None:
        """Capture the fingerprints of the keys this forward wrote to the fingerprint
        layer ``layer_idx`` of ``cache`` (their tokens: the forward's ids), and whether the
        cache now holds keys with the old slots followed by this forward's: a new keys
        tensor (a dynamic cache), or, for a cache that computes its keys on access (a view
        of its storage: ``SlabCache``), the keys the update returned (``out``). While the
        cache shows that very tensor, or a view of the same storage with the same shape,
        strides and offset, and no write reached the storage since the forward ended (its
        version counter, read by ``after``), its slots are known without a fingerprint."""
        if cache is not None and layer_idx != self.layer_of(cache):
            return  # the layers exist once the first update made them
        after = self._held_keys(cache, layer_idx) if cache is not None else None
        if after is None and key_computed(cache, self._computed) and isinstance(out, tuple) \
                and out and isinstance(out[0], torch.Tensor):
            after = out[0]
        ids, fwd = self._stash, self._fwd
        if cache is not None:
            self._seen.pop(id(cache), None)
            if fwd is not None and isinstance(after, torch.Tensor) and after is not before \
                    and after.dim() == 4 and not after.is_inference() \
                    and (after.shape[0], after.shape[2]) == (fwd[1], fwd[2]):
                # the version is read when the forward has ended (``after``): later layers
                # may write to the same storage
                self._seen[id(cache)] = self._due = [after, None, fwd[0]]
            else:
                fwd = None
        if keys.dim() != 4 or keys.shape[0] != ids.shape[0] or keys.shape[2] != ids.shape[1]:
            self._sink(("learn", id(cache), fwd and fwd[0], None), [])
            return
        # the fingerprints are computed later, several forwards' keys at once (``settle``):
        # the keys a forward wrote are a tensor of their own that nothing changes
        info: dict = {}
        entry = self._sink(("learn", id(cache), fwd and fwd[0], info), [])
        self._refs.append((entry, info, keys.detach() if keys.requires_grad else keys))

    def settle(self, cached: torch.Tensor | None = None):
        """Fingerprint the keys learned since the last call, one ``cat`` and one
        fingerprint per run of forwards with the same batch and head shape, together with
        ``cached`` ([B, H, C, D]: a cache's slots to look up now) when its shape allows.
        Each run's [B, W] fingerprints ride with the first of its learn captures; the
        others (and the cache's slots) say where their columns are. Returns the cache's
        capture: ("group", (number, first column, C, W)) or ("fp", None) with the
        fingerprints as data."""
        refs, self._refs = self._refs, []
        runs: list = []
        for ref in refs:
            k = ref[2]
            sig = (k.shape[0], k.shape[1], k.shape[3], k.dtype, k.device)
            if runs and runs[-1][0] == sig:
                runs[-1][1].append(ref)
            else:
                runs.append((sig, [ref]))
        out, data = ("fp", None), None
        for i, (sig, members) in enumerate(runs):
            parts = [k for _, _, k in members]
            widths = [k.shape[2] for k in parts]
            last = i == len(runs) - 1
            if last and cached is not None and cached.dim() == 4 and (
                    cached.shape[0], cached.shape[1], cached.shape[3], cached.dtype,
                    cached.device) == sig:
                parts.append(cached)
            self._groups += 1
            keys = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
            fp = self._fingerprint(keys)
            width = keys.shape[2]
            members[0][0].masks.append(fp.reshape(-1))
            at = 0
            for (_, info, _), w in zip(members, widths):
                info.update(group=self._groups, at=at, q=w, width=width, b=sig[0])
                at += w
            if len(parts) > len(members):
                out = ("group", (self._groups, at, cached.shape[2], width))
        if cached is not None and out[0] == "fp":
            data = self._fingerprint(cached)
            data = data.reshape(-1)
        return out, [] if data is None else [data]

    def _cache_capture(self, cache, c: int, b: int):
        """How the host will know the tokens of the ``c`` cached slots: ("seen", forward
        number), ("fp", [B * C] fingerprints), or None when the cache cannot be read."""
        self.watch(cache)
        layer = self.layer_of(cache)
        if layer is None:
            return None
        keys = _layer_keys(cache, layer)
        if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[0] != b \
                or keys.shape[2] < c:
            return None
        seen = self._seen.get(id(cache))
        if seen is not None and seen[1] is not None and keys.shape[2] == c \
                and same_view(seen[0], keys) and keys._version == seen[1]:
            return ("seen", seen[2]), []  # the very tensor this guard saw written, untouched
        return self.settle(keys if keys.shape[2] == c else keys[:, :, :c])

    # -- the hooks: captures ---------------------------------------------------------------
    def skip(self, ids: torch.Tensor | None = None) -> None:
        """A forward whose context cannot be read (a prepared 4-D mask, an unreadable
        cache): its tokens are still learned (``ids``, when its cache is watched), and
        every record is dropped, since this forward may replace tokens unseen."""
        self.skipped += 1
        self._last, self._fwd = None, None
        self._stash = None if ids is None else ids.clone() if self.copy else ids
        self._sink(("skip",) + ((None,) if ids is None else tuple(ids.shape)),
                   [] if ids is None else [self._stash.reshape(-1)])

    def before(self, ids: torch.Tensor, cache, c: int, valid: torch.Tensor | None) -> bool:
        """Capture one forward of ``ids`` [B, q] over ``c`` cache slots with ``valid``
        [B, c + q] (None: every slot) for C1/C2; False when its context cannot be read."""
        b, q = ids.shape
        self._last = None
        cap, data = ("none", None), []
        if c > 0:
            got = self._cache_capture(cache, c, b) if cache is not None else None
            if got is None:
                self.skip(ids if cache is not None else None)
                return False
            cap, data = got
        elif cache is not None:
            self.watch(cache)
        self._count += 1
        self._fwd = (self._count, b, c + q)
        if self.copy:  # the loop may reuse its buffers before the flags are read
            ids = ids.clone()
        self._stash = ids if cache is not None else None
        v = valid if valid is None or (not self.copy and valid.dtype in _READ_AS_IS) \
            else valid.clone() if valid.dtype == torch.bool else valid.bool()
        self._sink(("forward", self._count, b, q, c, cap[0], cap[1],
                    id(cache) if cache is not None else None, v is not None),
                   [ids.reshape(-1)] + ([] if v is None else [v.reshape(-1)]) + data)
        self._last = (b, q)
        return True

    def after(self, logits) -> None:
        """Capture the argmax of every computed position of the forward ``before`` read."""
        last, self._last, self._stash, self._fwd = self._last, None, None, None
        if self._due is not None:  # the forward has ended: its cache's version now
            self._due[1], self._due = self._due[0]._version, None
        if last is None or not isinstance(logits, torch.Tensor) or logits.dim() != 3 \
                or logits.shape[0] != last[0] or logits.shape[1] > last[1]:
            return
        self._sink(("record", logits.shape[1]), [logits.argmax(dim=-1).reshape(-1)])

    # -- the host side: C1/C2, forward by forward -----------------------------------------
    def process(self, kind: tuple, rows: list) -> list:
        """Apply one capture (its tensors read as host lists ``rows``); returns the
        violations found, as (rule index in DEVICE_RULES, details) pairs."""
        what = kind[0]
        if what == "forward":
            return self._forward(kind, rows)
        host = self._host
        if what == "learn":
            _, cache_key, number, info = kind
            if info and host is not None and host["ids"] is not None:
                if rows:  # the first learn capture of a run carries the run's fingerprints
                    self._group = (info["group"], rows[0])
                fps = self._columns(info["group"], info["at"], info["q"], info["width"],
                                    info["b"])
                if fps is not None:
                    self.table.update(zip(fps, host["flat"]))
                    cfps = host.get("cfps")
                    if cfps is not None and info["b"] == len(cfps):
                        # every slot's fingerprints as this forward left them, per row
                        # (rows with a slot never seen: None), for the next forward
                        q = info["q"]
                        host["full"] = [None if f is None else f + fps[r * q: r * q + q]
                                        for r, f in enumerate(cfps)]
            if number is not None and host is not None and host["n"] == number:
                self._slots[cache_key] = (number, host["tok"])
            else:
                self._slots.pop(cache_key, None)
        elif what == "record":
            if host is not None and host["rows"] is not None:
                self._record(host, kind[1], rows[0])
        elif what == "skip":
            for r in self.recs:
                r.clear()
            ids = None if kind[1] is None else _split(rows[0], kind[1], kind[2])
            self._host = {"n": None, "ids": ids, "flat": rows[0] if ids else None,
                          "tok": None, "rows": None}
        return []

    def _forward(self, kind, rows) -> list:
        _, number, b, q, c, how, seen_at, cache_key, has_valid = kind
        s = c + q
        flat_ids = rows[0]
        ids = _split(flat_ids, b, q)
        flat_valid = rows[1] if has_valid else None
        looked = how in ("fp", "group")
        cfps = None  # per row: the fingerprints of its cached slots (None: not known)
        if c == 0:
            tok = ids
            cfps = [[] for _ in range(b)]
        elif how == "seen":
            at, old = self._slots.get(cache_key, (None, None))
            if at != seen_at or old is None or len(old) != b:
                old = [[-2] * c for _ in range(b)]
                looked = True
            else:  # the last forward's slots: their fingerprints too, when it knew them
                last = self._host
                full = last.get("full") if last is not None and last["n"] == at else None
                cfps = full if full is not None and len(full) == b else None
            tok = [o + i for o, i in zip(old, ids)]
        else:  # each row's cached slots looked up by their fingerprints (-2: never seen)
            get = self.table.get
            if seen_at is None:
                flat, width, at = rows[-1], c, 0
            elif self._group is not None and self._group[0] == seen_at[0]:
                flat, width, at = self._group[1], seen_at[3], seen_at[1]
            else:
                flat, width, at = None, c, 0
            if flat is None or len(flat) != b * width or at + c > width:
                tok = [[-2] * c + ids[r] for r in range(b)]
            else:
                # a row whose slots carry exactly the fingerprints the last forward left in
                # one of its rows (the same row, most often) holds that row's tokens: no
                # lookup (the table maps each fingerprint to one token)
                last = self._host
                full = last.get("full") if last is not None else None
                before = last["tok"] if full is not None else None
                cfps, tok = [], []
                for r in range(b):
                    f = flat[r * width + at: r * width + at + c]
                    if full is not None and r < len(full) and full[r] == f:
                        tok.append(before[r] + ids[r])
                    else:
                        tok.append(list(map(get, f, repeat(-2))) + ids[r])
                    cfps.append(f)
            looked = any(-2 in t for t in tok)  # a row is unknown only if one of these is
        out: list = []
        host = {"n": number, "ids": ids, "flat": flat_ids, "tok": tok, "rows": out,
                "cfps": None if cfps is None else
                [None if -2 in t else f for t, f in zip(tok, cfps)]}
        self._host = host
        self._host_prev, self._host_rows = self._host_rows, out
        found, claimed = [], set()
        prev = [x[0] if x else None for x in self._host_prev]
        chains, kept, recs, plen = self.chains, self.kept, self.recs, self.plen_host
        stop_set, greedy = self.stop_set, self.spec.greedy
        for r in range(b):
            if flat_valid is None:
                v = None
                ctx = tok[r]
            else:
                v = flat_valid[r * s: r * s + s]
                ctx = list(compress(tok[r], v))
            n = len(ctx)
            if n == 0:
                out.append(None)
                continue
            if looked and -2 in ctx:
                self.unknown += 1
                out.append(None)
                continue
            # the prompt this batch row had in the last forward, while the context still
            # agrees with its whole chain (no other chain agrees longer but one a swapped
            # row of an identical prompt took); else a match against every prompt
            p = prev[r] if r < len(prev) else None
            if p is not None:
                chain = chains[p]
                m = len(chain)
                if p not in claimed and ((m >= plen[p] or m == n) and chain == ctx[:m]
                                         if m <= n else chain[:n] == ctx):
                    agree = min(m, n)
                else:
                    p = None
            if p is None:
                p, agree = self._match(ctx, claimed)
            if p is None:
                found.append((0, {"row": r, "ctx": ctx}))
                out.append(None)
                continue
            claimed.add(p)
            chain, k0 = chains[p], kept[p]
            rec = recs[p]
            live = n
            if stop_set:  # past a row's first stop (after its prompt) nothing is checked
                for j in range(plen[p], n):
                    if ctx[j] in stop_set:
                        live = j + 1
                        break
            # kept after this forward: what it attends without the logits it was chosen
            # from being computed here (a valid cached slot, or the row's first valid new
            # token: its predecessor is cached), presented before with the same context up
            # to it, and live. A later new token is under verification, even when an
            # earlier forward presented it at the same place (a draft the loop did not
            # verify then, proposed again): it is kept only once a forward attends it as
            # decided
            vq = None if v is None else v[c:]
            cached = (n - q + vq.count(0) if v is not None else c) if c else 0
            k1 = min(agree, live, cached + 1)
            if agree < min(k0, live):  # C1: a kept token replaced
                found.append((1, {"row": r, "ctx": ctx, "prompt": p, "chain": list(chain),
                                  "kept": k0, "rec": list(rec),
                                  "at": [j for j in range(min(k0, live))
                                         if ctx[j] != chain[j]]}))
            elif greedy and k1 > k0:  # C2: newly kept tokens against the record
                top = min(k1, len(rec))
                if top == k0 + 1:  # one newly kept token (a decode step): no list to build
                    at = [k0] if rec[k0] >= 0 and ctx[k0] != rec[k0] else None
                else:
                    at = [j for j in range(k0, top) if rec[j] >= 0 and ctx[j] != rec[j]]
                if at:
                    found.append((2, {"row": r, "ctx": ctx, "prompt": p, "chain": list(chain),
                                      "kept": k0, "rec": list(rec), "at": at}))
            # tokens presented before and now replaced or dropped (past the kept ones, from
            # the first disagreement on while live, from the context's end on): records past
            # the first of them are stale
            first = k0 if k0 > agree else agree
            if first >= live and n > first:
                first = n
            if len(rec) > first + 1:
                del rec[first + 1:]
            chains[p] = ctx + chain[n:k0] if k0 > n else ctx
            if k1 > k0:
                kept[p] = k1
            out.append((p, cached, vq))
        return found

    def _columns(self, group: int, at: int, q: int, width: int, b: int):
        """[b * q] fingerprints, row by row, of columns at .. at + q - 1 of run ``group``
        (None when that run's fingerprints are not the ones held)."""
        if self._group is None or self._group[0] != group:
            return None
        flat = self._group[1]
        if q == width:
            return flat
        out: list = []
        for r in range(b):
            out += flat[r * width + at: r * width + at + q]
        return out

    def _match(self, ctx, claimed):
        """(prompt, agreement of ``ctx`` with its chain) of the registered prompt ``ctx``
        starts with (or, a prefill in pieces, is a prefix of), (None, 0) when none: the
        longest agreement wins, then a prompt no other row of the forward took, then the
        first."""
        head = tuple(ctx[: self.lmax])  # the candidates depend on these tokens only
        cands = self._cands.get(head)
        if cands is None:
            if len(self._cands) >= 4096:
                self._cands.clear()
            cands = self._cands[head] = _walk(self._tree, ctx)
        if not cands:
            return None, 0
        best, key = None, None
        n = len(ctx)
        for p in cands:
            chain = self.chains[p]
            m = min(n, len(chain))
            a = m if chain[:m] == ctx[:m] else _agreement(ctx, chain)
            k = (a, p not in claimed, -p)
            if key is None or k > key:
                best, key = p, k
        return best, key[0]

    def _record(self, host, ql: int, am: list) -> None:
        """Record the argmax of the last ``ql`` slots of each row at the context position
        they predict (the first record of a position stands)."""
        q = len(host["ids"][0]) if host["ids"] else 0
        skip = q - ql  # new slots before the recorded ones
        recs = self.recs
        for r, info in enumerate(host["rows"]):
            if info is None:
                continue
            p, cached, v = info
            rec = recs[p]
            # valid slots so far: the position the next valid slot predicts
            pos = cached + (skip if v is None else skip - v[:skip].count(0))
            for j in range(skip, q):
                if v is not None and not v[j]:
                    continue
                pos += 1
                if len(rec) <= pos:
                    rec.extend([-1] * (pos + 1 - len(rec)))
                if rec[pos] < 0:
                    rec[pos] = am[r * ql + j - skip]

    # -- host state (outputs) ---------------------------------------------------------------
    def host_state(self):
        """(chain, kept, rec) of every prompt as host lists, all of one length."""
        t = max(max(len(c) for c in self.chains), max(len(r) for r in self.recs), 1)
        chains = [c + [-1] * (t - len(c)) for c in self.chains]
        kept = [[1 if j < k else 0 for j in range(t)] for k in self.kept]
        recs = [r + [-1] * (t - len(r)) for r in self.recs]
        return chains, kept, recs


def _split(flat: list, b: int, w: int) -> list:
    return [flat[i * w: (i + 1) * w] for i in range(b)]


def _agreement(a: list, b: list) -> int:
    """Length of the common prefix of two lists (slice compares: C speed)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # the longest m with a[:m] == b[:m]
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _prompt_tree(prompts) -> dict:
    """A radix tree of the prompts: node = {"end": [prompts ending here], "below": [prompts
    strictly below], "kids": {first token: (edge tokens, node)}}."""
    def node():
        return {"end": [], "below": [], "kids": {}}
    root = node()
    for i, p in enumerate(prompts):
        cur, j = root, 0
        while True:
            if j == len(p):
                cur["end"].append(i)
                break
            cur["below"].append(i)
            kid = cur["kids"].get(p[j])
            if kid is None:
                leaf = node()
                cur["kids"][p[j]] = (list(p[j:]), leaf)
                leaf["end"].append(i)
                break
            edge, nxt = kid
            m = _agreement(edge, p[j:])
            if m < len(edge):  # split the edge at m
                mid = node()
                mid["below"] = list(nxt["below"]) + list(nxt["end"])
                mid["kids"][edge[m]] = (edge[m:], nxt)
                cur["kids"][p[j]] = (edge[:m], mid)
                nxt = mid
            cur, j = nxt, j + m
    return root


def _walk(tree: dict, ctx: list) -> list:
    """The prompts ``ctx`` starts with, or of which it is a prefix."""
    out, cur, j, n = [], tree, 0, len(ctx)
    while True:
        out.extend(cur["end"])
        if j == n:
            return out + cur["below"]
        kid = cur["kids"].get(ctx[j])
        if kid is None:
            return out
        edge, nxt = kid
        m = len(edge)
        if ctx[j: j + m] != edge:
            return out + (nxt["below"] + nxt["end"] if ctx[j:] == edge[: n - j] else [])
        cur, j = nxt, j + m


def _layer_keys(cache, layer: int, tensor_only: bool = False):
    """The keys of one layer of ``cache``; with ``tensor_only``, None when the layer
    computes them on each access (a property: a new view each time, never the tensor a
    dynamic cache holds)."""
    layers = cache_layers(cache)
    if layer >= len(layers):
        return None
    if tensor_only and isinstance(getattr(type(layers[layer]), "keys", None), property):
        return None
    return getattr(layers[layer], "keys", None)


def key_computed(cache, computed: set) -> bool:
    """Whether ``cache`` is known (``computed``: ids) to compute its keys on access."""
    return cache is not None and id(cache) in computed


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one tensor, or views of one storage with the same dtype,
    shape, strides and offset (the same elements)."""
    if a is b:
        return True
    base = a._base
    return base is not None and base is b._base and a.dtype == b.dtype and a.shape == b.shape \
        and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


def first_stop(tokens, stops) -> int | None:
    for i, t in enumerate(tokens):
        if t in stops:
            return i
    return None


__all__ = ["Content", "ContentSpec", "DEVICE_RULES", "key_fingerprint", "key_words",
           "fingerprint_layer",
           "C1_PROMPT", "C1_KEPT", "C2_ARGMAX", "C3_CHAIN", "C3_STOP", "C3_LENGTH", "C3_ARGMAX"]
