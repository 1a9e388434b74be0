"""Validation at the public boundary: every bad input is a one-line error naming the rule.

One layer, shared by ``specdec.generate``, ``specdec.reference_generate``, the known-bad
engine, the command line (``specdec.cli``) and trace replay (``specdec.forensics.replay``).
Every message states the rule and the offending value. Nothing is coerced silently: a
float or a bool is never taken for an integer (``6.7`` is not token 6, ``True`` is not
``k = 1``); integer scalars of numpy and torch (0-d integer tensors) and 1-D integer
tensors or arrays of token ids are accepted, since they are integers. A value of the wrong
kind raises ``TypeError``, a value of the right kind outside its range ``ValueError``.

What is checked before any work:

- prompts (``prompt_ids``): a list of prompts, each a flat sequence of integer token ids
  or a string (all strings, with ``tokenizer=``); never empty, also after tokenising: a
  text that tokenises to 0 tokens is refused (a model predicts the next token from the
  prompt; an empty row would decode padding); ids in ``[0, vocab)`` (``in_vocab``);
- models (``causal_lm``): a transformers causal LM that can generate: an LM head, not an
  encoder-decoder, ``can_generate()`` true (a masked-LM head is refused), and a config that
  declares ``is_decoder`` must set it (a bidirectional encoder with an LM head attends to
  the right, so it cannot decode left to right);
- integers (``integer``), options from a fixed set (``choice``), stop ids (``stop_ids``),
  hooks (``hooks``: a list of callables), the drafter's interface (``drafter``), budgets
  within the context (``within_context``), run specs of replay (``run_spec``), paths
  (``existing_file``, ``writable_dir``).

What is checked while decoding (``checked_drafts``, ``HookWatch``):

- drafter output after every ``propose``: a tensor of an integer dtype, on the batch's
  device, of shape ``[B, k]`` (host facts: checked at once), and ``0 <= id < vocab``. The
  range check costs no host sync: it is a device flag that the engine folds into the
  step's one host read (``engine.sync``). Until then the out-of-range ids are replaced
  (clamped into the vocabulary) in the tensor the verify forward embeds, so they never
  reach the embedding (on a CPU an ``IndexError`` deep in torch, on CUDA a device-side
  assert); the step's output is never returned: the read raises ``ValueError`` naming
  the rule, the step, the rows and the ids.
- hooks get a read-only view: every tensor of the view (and the caches it exposes) has
  its version counter (``Tensor._version``, host memory) read before the hooks and again
  after each hook; a hook that wrote in place raises ``ValueError`` naming the hook and
  the tensor, unless it was declared with ``fault_injection(hook)`` (tests of the checker
  corrupt the state on purpose). Chosen over handing out copies or write-refusing tensor subclasses by cost
  (``benchmarks/validation_overhead.py``). A hook whose ``read_only`` attribute is True
  declares that it never writes its view (``invariants.Monitor`` does, and its tests run
  it watched to prove it: ``tests/test_invariants_integration.py``); when every hook of a run
  declares it, the engine builds no watch (``watched``) past the run's first
  ``WATCH_STEPS`` steps, which saves reading some 20 version counters twice per phase;
  those first steps are watched anyway, so a hook that declares it falsely and writes
  there is named (one that writes only later is not seen). Not seen: writes through
  ``.data`` or ``.numpy()`` (they bypass the counter) and writes to tensors created under
  ``torch.inference_mode`` (they keep no counter).
"""

from __future__ import annotations

import functools
import operator
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path

import torch

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxlist, _repr.maxother = 40, 6, 40


def describe(value) -> str:
    """A short repr of ``value`` with its type: ``6.7 (float)``."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}, dtype {value.dtype}"
    return f"{_repr.repr(value)} ({type(value).__name__})"


def _is_bool(value) -> bool:
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return True
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _int_dtype(dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def as_int(value):
    """``value`` as a Python int when it is an integer (not a bool); else None."""
    if type(value) is int:
        return value
    if _is_bool(value):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or not _int_dtype(value.dtype):
            return None
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        return None


def integer(value, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int, refusing bools, floats and anything else; within the bounds."""
    v = as_int(value)
    if v is None:
        kind = "a bool" if _is_bool(value) else describe(value)
        raise TypeError(f"{name} must be an integer, got {kind}")
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        if maximum is None:
            rule = f">= {minimum}"
        elif minimum is None:
            rule = f"<= {maximum}"
        else:
            rule = f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {rule}, got {v}")
    return v


def _real(value, rule: str) -> float:
    """``value`` as a float when it is a real number (int or float, not a bool), else
    TypeError stating ``rule``."""
    if _is_bool(value) or isinstance(value, (str, bytes)):
        raise TypeError(f"{rule}, got {describe(value)}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{rule}, got {describe(value)}") from None


def number(value, name: str, low: float, high: float) -> float:
    """A real number (int or float, not a bool) in ``[low, high]``."""
    rule = f"{name} must be a number in [{low}, {high}]"
    v = _real(value, rule)
    if not low <= v <= high:  # NaN fails too
        raise ValueError(f"{rule}, got {value!r}")
    return v


def positive_number(value, name: str, *, hint: str = "") -> float:
    """A finite real number > 0 (int or float, not a bool)."""
    rule = f"{name} must be a finite number > 0" + (f" ({hint})" if hint else "")
    v = _real(value, rule)
    if not 0 < v < float("inf"):  # NaN fails too
        raise ValueError(f"{rule}, got {value!r}")
    return v


def choice(value, name: str, known) -> str:
    """One of ``known`` (compared as given: no case folding)."""
    if not isinstance(value, str) or value not in known:
        raise ValueError(f"{name} must be one of {', '.join(map(str, known))}; got {value!r}")
    return value


# ---------------------------------------------------------------------------------------
# Token ids and prompts
# ---------------------------------------------------------------------------------------

def token_ids(seq, name: str) -> list[int]:
    """A flat sequence of integer token ids (list, tuple, 1-D integer tensor or array)."""
    if isinstance(seq, torch.Tensor) or (hasattr(seq, "ndim") and hasattr(seq, "dtype")):
        if seq.ndim != 1:
            raise TypeError(f"{name} must be a flat sequence of token ids; got {seq.ndim}-D "
                            f"{type(seq).__name__} of shape {list(seq.shape)}")
        ok = _int_dtype(seq.dtype) if isinstance(seq, torch.Tensor) else seq.dtype.kind in "iu"
        if not ok:
            raise TypeError(f"{name}: token ids must be integers, got a {type(seq).__name__} "
                            f"of dtype {seq.dtype}")
        return [int(t) for t in seq.tolist()]
    if isinstance(seq, (str, bytes, Mapping, set, frozenset)) or not hasattr(seq, "__len__") \
            or not hasattr(seq, "__getitem__"):
        raise TypeError(f"{name} must be a list of token ids, got {describe(seq)}")
    out = []
    for j, t in enumerate(seq):
        v = as_int(t)
        if v is None:
            raise TypeError(f"{name}, position {j}: a token id must be an integer (not a bool, "
                            f"a float or a list), got {describe(t)}")
        out.append(v)
    return out


def in_vocab(ids: list[list[int]], vocab: int, what: str = "prompt") -> None:
    """Every id of every sequence in ``[0, vocab)``."""
    for i, p in enumerate(ids):
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} {i} has token ids outside the vocabulary [0, {vocab}): "
                             f"{bad[:5]}")


def tokenizer_ids(out) -> list[int]:
    """Token ids of one text from a tokenizer's output (a BatchEncoding/dict with
    ``input_ids``, a list or a tensor; a batch of one is unwrapped)."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if out and isinstance(out[0], (list, tuple)):  # a batch of one
        if len(out) != 1:
            raise ValueError(f"expected one sequence of token ids, got a batch of {len(out)}")
        out = list(out[0])
    return token_ids(out, "the tokenizer's output")


def tokenizer(tok):
    """A tokenizer object: callable on text."""
    if not callable(tok):
        raise TypeError(f"tokenizer must be a tokenizer object (callable on text, returning "
                        f"input_ids), got {describe(tok)}; load one with "
                        f"transformers.AutoTokenizer.from_pretrained")
    return tok


EMPTY_RULE = "every prompt needs at least one token (the model predicts the next token from it)"


def prompt_ids(prompts, tok=None) -> list[list[int]]:
    """Prompts as lists of ints: token-id sequences, or strings tokenised by ``tok``
    (without special tokens). Refuses empty prompts, also after tokenisation."""
    if isinstance(prompts, torch.Tensor):
        raise TypeError(f"prompts must be a list of prompts, got {describe(prompts)}: pass a "
                        "list of 1-D tensors or id lists (padding is never inferred from ids)")
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of prompts (token-id lists, or strings with "
                        f"tokenizer=), got {describe(prompts)}")
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt, got an empty list")
    texts = [isinstance(p, str) for p in prompts]
    if tok is not None:
        tokenizer(tok)
    if all(texts):
        if tok is None:
            raise ValueError("text prompts need tokenizer=; or pass token-id lists")
        out = []
        for i, p in enumerate(prompts):
            ids = tokenizer_ids(tok(p, add_special_tokens=False))
            if not ids:
                raise ValueError(f"prompt {i} is empty: {EMPTY_RULE}; the text {p!r} "
                                 "tokenises to 0 tokens")
            out.append(ids)
        return out
    if any(texts):
        raise TypeError("prompts must be all strings or all token-id lists, not a mix")
    out = []
    for i, p in enumerate(prompts):
        if p is None or as_int(p) is not None or _is_bool(p) or isinstance(p, float):
            raise TypeError(f"prompt {i} must be a list of token ids (or a string, with "
                            f"tokenizer=), got {describe(p)}")
        ids = token_ids(p, f"prompt {i}")
        if not ids:
            raise ValueError(f"prompt {i} is empty: {EMPTY_RULE}")
        out.append(ids)
    return out


def stop_ids(stops, vocab: int) -> list[int] | None:
    """``stop_token_ids``: None (the model's own), or a list of ids in ``[0, vocab)``."""
    if stops is None:
        return None
    if as_int(stops) is not None or isinstance(stops, (str, bytes)):
        raise TypeError(f"stop_token_ids must be a list of token ids (or None for the "
                        f"model's own), got {describe(stops)}")
    ids = token_ids(stops, "stop_token_ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"stop_token_ids must be token ids in the vocabulary [0, {vocab}), got {bad[:5]}")
    return ids


# ---------------------------------------------------------------------------------------
# Models, budgets, drafters, hooks
# ---------------------------------------------------------------------------------------

def causal_lm(model, role: str) -> None:
    """A transformers causal LM that can generate (see the module docstring)."""
    rule = f"the {role} must be a transformers causal language model (a *ForCausalLM with an LM head)"
    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config")):
        raise TypeError(f"{rule}, got {type(model).__name__}")
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        raise TypeError(f"{rule}, got the encoder-decoder {type(model).__name__}")
    head = getattr(model, "get_output_embeddings", None)
    if not callable(head) or head() is None:
        raise TypeError(f"{rule}, got {type(model).__name__}, which has no LM head")
    can = getattr(model, "can_generate", None)
    if callable(can) and not can():
        raise TypeError(f"{rule} that can generate, got {type(model).__name__}: can_generate() "
                        "is False (a masked-LM or encoder head sees later tokens)")
    if getattr(cfg, "is_decoder", True) is False:
        raise TypeError(f"{rule}, got {type(model).__name__} with config.is_decoder=False: it "
                        "attends to later tokens, so it cannot decode left to right")


def within_context(ids: list[list[int]], max_new_tokens: int, context: int | None) -> None:
    """Prompt + budget fits the model's context (when the config states one)."""
    if context is None:
        return
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it "
                f"needs {len(p) + max_new_tokens} positions, beyond the model's context of "
                f"{context}: prompt + budget must be <= context"
            )


def request(target, ids: list[list[int]], *, max_new_tokens, stop_token_ids, role="target"):
    """The checks every decoding entry point shares: a causal LM, a budget >= 1 within the
    context, prompt ids and stop ids in the vocabulary. Returns (max_new_tokens, stop
    ids or None)."""
    from .models import context_length, vocab_size

    causal_lm(target, role)
    budget = integer(max_new_tokens, "max_new_tokens", minimum=1)
    vocab = vocab_size(target)
    in_vocab(ids, vocab)
    within_context(ids, budget, context_length(target))
    return budget, stop_ids(stop_token_ids, vocab)


DRAFTER_RULE = ("a drafter needs prefill(batch), propose(batch, k) -> [B, k] ids and a bool "
                "uses_cache (see specdec.drafters)")


def drafter(d) -> None:
    """The documented Drafter interface (``specdec.drafters.Drafter``)."""
    missing = [n for n in ("prefill", "propose") if not callable(getattr(d, n, None))]
    if missing or not isinstance(getattr(d, "uses_cache", None), bool):
        missing += [] if isinstance(getattr(d, "uses_cache", None), bool) else ["uses_cache"]
        raise TypeError(f"{DRAFTER_RULE}; {describe(d)} lacks {', '.join(missing)}")
    if d.uses_cache:
        if not hasattr(d, "model"):
            raise TypeError(f"a drafter with uses_cache=True needs .model (the draft model "
                            f"whose cache the engine keeps); {type(d).__name__} has none")
        causal_lm(d.model, "draft model")
    for name in ("bind", "check_compatible"):
        if hasattr(d, name) and not callable(getattr(d, name)):
            raise TypeError(f"drafter.{name} must be a method, got {describe(getattr(d, name))}")


def hooks(hs) -> tuple:
    """A list of callables ``hook(phase, view)``."""
    if callable(hs) and not isinstance(hs, (list, tuple)):
        raise TypeError(f"hooks must be a list of callables hook(phase, view), got a single "
                        f"{type(hs).__name__}: pass hooks=[...]")
    if not isinstance(hs, (list, tuple)):
        raise TypeError(f"hooks must be a list of callables hook(phase, view), got {describe(hs)}")
    for i, h in enumerate(hs):
        if not callable(h):
            raise TypeError(f"hooks[{i}] must be callable as hook(phase, view), got {describe(h)}")
    return tuple(hs)


# ---------------------------------------------------------------------------------------
# While decoding: drafter output, hooks' writes
# ---------------------------------------------------------------------------------------

def checked_drafts(drafts, batch_size: int, k: int, device, vocab: int, step: int):
    """(ids for the verify forward [B, k] long, out-of-vocabulary flags [B, k] bool).

    Type, dtype, device and shape are host facts and raise at once. The range is checked
    on the device: ids outside ``[0, vocab)`` are clamped into it for the forward and
    flagged; ``engine.sync`` reads the flags with the step's one host read and calls
    ``raise_bad_drafts``. No host sync here.
    """
    where = f"drafter.propose must return a tensor of token ids [B, k] = [{batch_size}, {k}]"
    if not isinstance(drafts, torch.Tensor):
        raise TypeError(f"{where}; at step {step} it returned {describe(drafts)}")
    if not _int_dtype(drafts.dtype):
        raise TypeError(f"{where} of an integer dtype; at step {step} it returned dtype {drafts.dtype}")
    if drafts.device != device:
        raise ValueError(f"{where} on the batch's device {device}; at step {step} it returned "
                         f"a tensor on {drafts.device}")
    if tuple(drafts.shape) != (batch_size, k):
        raise ValueError(f"{where}; at step {step} it returned drafts of shape {list(drafts.shape)}")
    drafts = drafts.long()
    safe = drafts.clamp(0, vocab - 1)
    return safe, safe != drafts


def draft_logits(logits, batch_size: int, k: int, device, vocab: int, step: int) -> None:
    """The draft model's logits of ``propose_sampled``: a floating tensor [B, k+1, V] on
    the batch's device (host facts only)."""
    where = (f"drafter.propose_sampled must return (drafts, logits) with logits a floating "
             f"tensor [B, k+1, V] = [{batch_size}, {k + 1}, {vocab}]")
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{where}; at step {step} it returned {describe(logits)}")
    if not logits.dtype.is_floating_point or logits.device != device \
            or tuple(logits.shape) != (batch_size, k + 1, vocab):
        raise ValueError(f"{where} on {device}; at step {step} it returned dtype {logits.dtype}, "
                         f"shape {list(logits.shape)} on {logits.device}")


def raise_bad_drafts(proposed: torch.Tensor, bad: torch.Tensor, row_ids: torch.Tensor,
                     vocab: int, step: int):
    """The error for flagged drafts (called after the step's host read found a flag)."""
    rows = bad.any(dim=1).nonzero().flatten().tolist()
    parts = [f"row {b} (prompt {int(row_ids[b])}) proposed "
             f"{proposed[b][bad[b]].tolist()[:5]}" for b in rows[:4]]
    raise ValueError(f"every draft must be a token id in the vocabulary [0, {vocab}); at step "
                     f"{step} drafter.propose returned out-of-range ids: {'; '.join(parts)}")


#: the tensor fields of ``invariants.StepView`` a hook could write
VIEW_TENSORS = ("tokens", "valid", "positions", "lengths", "prompt_lengths", "budgets",
                "generated", "finished", "row_ids", "output", "drafts", "draft_limit",
                "predictions", "accepted", "committed", "generated_before")
_view_tensors = operator.attrgetter(*VIEW_TENSORS)


#: the first steps of a run watch every hook, even when all declare ``read_only``
WATCH_STEPS = 2


def watched(hooks) -> bool:
    """Whether ``emit`` watches the hooks' writes: unless every hook declares
    ``read_only = True`` (a promise its own tests keep, see above)."""
    return not all(getattr(h, "read_only", False) is True for h in hooks)


class HookWatch:
    """Version counters of a view's tensors, read before the hooks run.

    ``check(hook)`` after each hook: a changed counter means the hook wrote in place.
    ``stores`` are extra tensors the view exposes (the caches' storage)."""

    __slots__ = ("view", "stores", "tensors", "versions")

    def __init__(self, view, stores=()):
        tensors = [t for t in _view_tensors(view) if t is not None]
        fwd = view.forward
        if fwd is not None:
            tensors += (fwd.input_ids, fwd.positions, fwd.attention_mask)
        tensors += [t for _, t in stores if t is not None]
        try:
            versions = [t._version for t in tensors]
        except RuntimeError:  # inference tensors keep no version counter: not watched
            tensors = [t for t in tensors if not t.is_inference()]
            versions = [t._version for t in tensors]
        self.view, self.stores, self.tensors, self.versions = view, stores, tensors, versions

    def names(self) -> list:
        """The view's names of ``tensors`` (built only to report a write)."""
        v, fwd = self.view, self.view.forward
        named = [(n, getattr(v, n)) for n in VIEW_TENSORS]
        if fwd is not None:
            named += [(f"forward.{n}", getattr(fwd, n)) for n in ("input_ids", "positions", "attention_mask")]
        named += list(self.stores)
        return [n for n, t in named if t is not None and any(t is u for u in self.tensors)]

    def check(self, hook) -> None:
        now = [t._version for t in self.tensors]
        if now != self.versions:
            if getattr(hook, "injects_faults", False):  # declared: later hooks see the write
                self.versions = now
                return
            moved = [t for t, a, b in zip(self.tensors, self.versions, now) if a != b]
            named = dict(zip(map(id, self.tensors), self.names()))
            changed = [named[id(t)] for t in moved]
            name = getattr(hook, "__qualname__", None) or type(hook).__name__
            liar = " (it declares read_only = True, which only a hook that never writes its " \
                "view may declare)" if getattr(hook, "read_only", False) is True else ""
            raise ValueError(
                f"hooks must not modify the view (it is the engine's state): hook {name} wrote "
                f"in place to {', '.join('view.' + c for c in changed)} after the "
                f"{self.view.phase} phase of step {self.view.step}{liar}; copy a tensor (.clone()) "
                "before changing it (a hook that corrupts state on purpose declares it: "
                "specdec.validation.fault_injection(hook))")


def fault_injection(hook):
    """``hook`` marked as one that writes the engine's state on purpose: tests of the
    checker inject faults this way (hooks after it see the corrupted state)."""
    @functools.wraps(hook)
    def injecting(phase, view):
        return hook(phase, view)

    injecting.injects_faults = True
    return injecting


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------

def existing_file(path, what: str) -> Path:
    """A path to a readable regular file."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{what} {path} does not exist")
    if p.is_dir():
        raise ValueError(f"{what} {path} is a directory, not a file")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{what} {path} is not readable")
    return p


def read_text(path, what: str) -> str:
    """The UTF-8 text of an existing file."""
    p = existing_file(path, what)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r})") from None


def writable_dir(path, what: str) -> Path:
    """A directory that exists (created if missing) and that a file can be written into."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {path} exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".specdec-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{what} {path} is not a writable directory ({e.strerror or e})") from None
    return p


# ---------------------------------------------------------------------------------------
# Run specs (trace replay)
# ---------------------------------------------------------------------------------------

RUN_FIELDS = ("model", "prompts", "drafter", "strategy", "k", "batch_size", "max_new_tokens",
              "stop_token_ids", "known_bad", "mutant", "sampling")
#: the fields of a run spec's "sampling" object (``specdec.Sampling``'s, which checks values)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed", "mode")
DRAFTER_FIELDS = {"ngram": (), "model": ("model",), "scripted": ("scripts",),
                  "forcing": ("reference", "pattern")}


def _id_lists(value, name: str, *, allow_empty: bool) -> list[list[int]]:
    if not isinstance(value, list):
        raise TypeError(f"{name} must be a list of token-id lists, got {describe(value)}")
    out = []
    for i, s in enumerate(value):
        if not isinstance(s, list):
            raise TypeError(f"{name}[{i}] must be a list of token ids, got {describe(s)}")
        ids = token_ids(s, f"{name}[{i}]")
        if not ids and not allow_empty:
            raise ValueError(f"{name}[{i}] is empty: {EMPTY_RULE}")
        out.append(ids)
    return out


def run_spec(spec, *, strategy_names=(), known_bad_names=()) -> dict:
    """The fields of a replay run spec (``specdec.forensics.replay``), checked; no field
    is ignored: an unknown field, or one that does not apply, is refused. The model-
    dependent checks (vocabulary, context) follow once the model is loaded (``request``).
    ``strategy_names`` and ``known_bad_names``: what a ``strategy`` or ``known_bad`` field
    may name (the caller passes the registry's names and its catalogue: this module sits
    below both)."""
    from . import mutants

    if not isinstance(spec, dict):
        raise TypeError(f"a run spec must be a JSON object, got {describe(spec)}")
    unknown = sorted(set(spec) - set(RUN_FIELDS))
    if unknown:
        raise ValueError(f"unknown run spec fields {unknown}; a run spec has {', '.join(RUN_FIELDS)}")
    out = dict(spec)
    model = spec.get("model", "default")
    if not isinstance(model, str):
        raise TypeError(f"run spec 'model' must be a model name (a string), got {describe(model)}")
    if "prompts" not in spec:
        raise ValueError("run spec 'prompts' is missing: a run spec needs the token ids it decodes")
    prompts = spec["prompts"]
    if not isinstance(prompts, list) or not prompts:
        raise TypeError(f"run spec 'prompts' must be a non-empty list of token-id lists, got "
                        f"{describe(prompts)}")
    out["prompts"] = _id_lists(prompts, "run spec 'prompts'", allow_empty=False)
    known_bad = spec.get("known_bad")
    if known_bad is not None:
        choice(known_bad, "run spec 'known_bad'", tuple(known_bad_names))
        if spec.get("strategy") is not None:
            raise ValueError("run spec 'strategy' does not apply to a known_bad run (the "
                             "known-bad engine has one layout); remove one of them")
    else:
        choice(spec.get("strategy", "eqspec"), "run spec 'strategy'", tuple(strategy_names))
    if spec.get("mutant") is not None:
        choice(spec["mutant"], "run spec 'mutant'", mutants.NAMES)
    smp = spec.get("sampling")
    if smp is not None:
        if not isinstance(smp, dict) or set(smp) - set(SAMPLING_FIELDS):
            raise ValueError(f"run spec 'sampling' must be null or an object with fields among "
                             f"{', '.join(SAMPLING_FIELDS)}, got {describe(smp)}")
        if known_bad is not None:
            raise ValueError("run spec 'sampling' does not apply to a known_bad run (the "
                             "known-bad engine decodes greedily); remove one of them")
    integer(spec.get("k", 4), "run spec 'k' (drafts per step)", minimum=0)
    integer(spec.get("batch_size", 8), "run spec 'batch_size'", minimum=1)
    integer(spec.get("max_new_tokens", 16), "run spec 'max_new_tokens'", minimum=1)
    if spec.get("stop_token_ids") is not None:
        v = spec["stop_token_ids"]
        if not isinstance(v, list):
            raise TypeError(f"run spec 'stop_token_ids' must be a list of token ids or null, got {describe(v)}")
        token_ids(v, "run spec 'stop_token_ids'")
    d = spec.get("drafter")
    if d is not None:
        if not isinstance(d, dict):
            raise TypeError(f"run spec 'drafter' must be an object such as {{\"kind\": \"ngram\"}}, "
                            f"got {describe(d)}")
        kind = choice(d.get("kind"), "run spec drafter 'kind'", tuple(DRAFTER_FIELDS))
        fields = DRAFTER_FIELDS[kind]
        extra = sorted(set(d) - {"kind", *fields})
        missing = [f for f in fields if f not in d]
        if extra or missing:
            raise ValueError(f"run spec drafter of kind {kind!r} has the fields "
                             f"{['kind', *fields]}; got {sorted(d)}")
        if kind == "model" and not isinstance(d["model"], str):
            raise TypeError(f"run spec drafter 'model' must be a model name, got {describe(d['model'])}")
        if kind == "scripted":
            _id_lists(d["scripts"], "run spec drafter 'scripts'", allow_empty=True)
        if kind == "forcing":
            _id_lists(d["reference"], "run spec drafter 'reference'", allow_empty=True)
            _id_lists(d["pattern"], "run spec drafter 'pattern'", allow_empty=True)
    return out
