"""The opt-in compiled fast path (``generate(..., compile=)``, ``reference_generate(...,
compile=)``, ``specdec generate --compile``; issue #19, point 3).

What is compiled: the width-independent regions of every decoder layer, i.e. each child
of a layer that is not its attention module (the MLP and the norms: ``regions``), and
the model's final norm. Their inputs are ``[B, q, hidden]`` whatever the cache holds, so
they see few shapes (rows x verify width), while the attention modules, which read and
write the ragged ``SlabCache`` at a width that changes every step, run eagerly. That
keeps every hook where it was: the model's own forward (``guard_model``'s pre- and
post-hooks), the cache's ``update`` (the guard's content rules), the engine's phase hooks
(the ``Monitor``) all run in Python around the compiled regions, and see the same
tensors.

Modes (``MODES``):

- ``None``: eager (the default);
- ``"inductor"``: ``torch.compile(backend="inductor")`` per region (on a CPU it needs a
  C++ compiler: ``check`` refuses the run up front when none is on PATH);
- ``"cuda-graphs"``: the target's whole decode and verify forwards captured as CUDA
  graphs, one per bucket (rows, tokens per row, key width: ``specdec/graphs.py``), with
  static shapes (``specdec/static.py``; ``compile="cuda-graphs"`` turns them on); the
  prefill stays eager, and a draft model's regions run ``torch.compile(mode=
  "reduce-overhead")`` (its forwards keep eager shapes). CUDA only (``check``), except
  inside ``specdec.graphs.cpu_proxy()``, the CPU stand-in the tests run. Not yet run on
  a GPU (no GPU in the sessions that wrote it): ``benchmarks/gpu_throughput.sh`` with
  ``COMPILE=cuda-graphs`` is its first check (exactness included: the benchmark
  compares every row with batch-1 decoding). A forward the graphs cannot serve (a
  guarded model, a failed capture) runs eagerly and is counted (``Stats.graphs``).

Regions are compiled once per module and mode and kept (``_COMPILED``), so later calls
reuse them; ``compiled(model, mode)`` installs them for the duration of a call only
(the model is left as it was, hooks included). Exactness: the regions compute the same
functions; fused kernels may round differently in the last bit, so the engine's
equivalence to batch-1 greedy decoding holds as it holds for any batch shape (tests:
``tests/test_compiled.py`` compares token ids on every tiny family and strategy).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import weakref

import torch

from . import graphs as graphs_mod

#: the values ``compile=`` takes
MODES = (None, "inductor", "cuda-graphs")

#: module -> {mode: compiled forward}: compiled once, reused by every later call
_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check(mode, model: torch.nn.Module) -> str | None:
    """``mode`` checked against ``model``'s device (``ValueError``/``TypeError`` stating
    the rule and the value), before any work."""
    if mode is None:
        return None
    if not isinstance(mode, str):
        raise TypeError(f"compile must be one of {MODES}, got {type(mode).__name__} {mode!r}")
    if mode not in MODES:
        raise ValueError(f"compile must be one of {MODES}, got {mode!r}")
    dev = next(model.parameters()).device
    if mode == "cuda-graphs" and dev.type != "cuda" and not graphs_mod.proxy_active():
        raise ValueError(f"compile='cuda-graphs' captures CUDA graphs: it needs a model on a "
                         f"CUDA device, the model is on {dev.type!r} (on a CPU use "
                         f"compile='inductor'; specdec.graphs.cpu_proxy() checks the "
                         f"capture path on a CPU)")
    if mode == "inductor" and dev.type == "cpu" and cxx_compiler() is None:
        raise ValueError("compile='inductor' on a CPU builds C++ kernels: it needs a C++ "
                         "compiler ($CXX, g++, c++ or clang++ on PATH), none was found "
                         "(use compile=None)")
    return mode


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would use on a CPU (None: none found)."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the longest ``ModuleList`` of identical module types
    (``model.layers``, ``transformer.h``, ...)."""
    best: list = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best) \
                and len({type(m) for m in module}) == 1:
            best = list(module)
    if not best:
        raise ValueError(f"compile: found no decoder layers (a ModuleList of layers) in "
                         f"{type(model).__name__}")
    return best


def is_attention(module: torch.nn.Module) -> bool:
    """An attention module (reads or writes the cache), by its class (``LlamaAttention``,
    ``GPT2Attention``, ...; not its attribute name: ``post_attention_layernorm`` is a
    norm): eager in every mode."""
    kind = type(module).__name__.lower()
    return "attention" in kind or "attn" in kind


def regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules compiled: every non-attention child of every decoder layer, and the
    final norm when the model has one (``model.model.norm``, ``transformer.ln_f``)."""
    out = []
    for layer in decoder_layers(model):
        out += [m for m in layer.children() if not is_attention(m)]
    base = getattr(model, "base_model", model)
    for name in ("norm", "ln_f", "final_layernorm"):
        final = getattr(base, name, None)
        if isinstance(final, torch.nn.Module):
            out.append(final)
    return out


def _compile(module: torch.nn.Module, mode: str):
    table = _COMPILED.setdefault(module, {})
    if mode not in table:
        forward = type(module).forward.__get__(module)
        if mode == "inductor":
            table[mode] = torch.compile(forward, backend="inductor", dynamic=None)
        else:
            table[mode] = torch.compile(forward, mode="reduce-overhead", dynamic=False)
    return table[mode]


@contextlib.contextmanager
def compiled(model: torch.nn.Module | None, mode: str | None, whole: bool = False):
    """Run the block with ``model``'s regions compiled for ``mode`` (``mode`` or ``model``
    None: nothing changes); every region's own ``forward`` is restored afterwards.
    ``whole`` (the target) with ``"cuda-graphs"``: its bucketed forwards are captured
    whole instead (``specdec.graphs``); yields the ``ForwardGraphs``, else None."""
    if mode is None or model is None:
        yield None
        return
    if whole and mode == "cuda-graphs":
        with graphs_mod.installed(model) as graphs:
            yield graphs
        return
    installed = []
    try:
        for module in regions(model):
            had = "forward" in vars(module)
            installed.append((module, had, vars(module).get("forward")))
            module.forward = _compile(module, mode)
        yield None
    finally:
        for module, had, old in installed:
            if had:
                module.forward = old
            else:
                vars(module).pop("forward", None)
