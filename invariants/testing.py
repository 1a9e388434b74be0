"""Prove "no host transfer" on a CPU: a detector of host reads, host uploads and
data-dependent shapes.

On a GPU, three kinds of operation stall the stream: a **read** of a tensor's values on
the host (``item``, ``tolist``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``.numpy()``), an
**upload** of host data (``torch.tensor(list)``, ``torch.as_tensor``, ``t[i] = 5``: a
pageable host-to-device copy) and a **data-dependent shape** (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``: the host must learn the size of the result).
CUDA's sync debug mode sees them on a GPU. On a CPU every tensor already lives on the
host, so nothing synchronises; this detector flags the operations that *would* transfer
on a GPU::

    from invariants.testing import no_host_transfers

    with no_host_transfers():                  # any transfer inside raises HostTransferError
        step(batch)
    with no_host_transfers(allow_reads=1):     # at most one read (a strict checker's step)
        step(batch)
    with no_host_transfers(raise_on_transfer=False) as log:   # count only
        step(batch)
    log.reads, log.uploads, log.dynamic_shapes, log.events

How it sees them:

- a ``TorchDispatchMode`` sees every aten op run inside the block: ``lift_fresh`` (a tensor
  built from Python data, also what ``t[i] = 5`` and ``t[[0, 1]]`` dispatch first) is an
  upload; ``_local_scalar_dense`` (``item``, ``bool``, ``int``, ``float`` of a tensor),
  ``equal`` and ``is_nonzero`` are reads; ``nonzero``, ``masked_select``, ``unique``,
  ``repeat_interleave`` without ``output_size``, and ``index``/``index_put`` with a boolean
  index are data-dependent shapes; a copy between the CPU and another device is a read or
  an upload by its direction;
- ``tolist``, ``numpy``, ``cpu`` and ``__array__`` dispatch nothing on a CPU tensor, so the
  Tensor methods that read the host (``item``, ``tolist``, ``numpy``, ``cpu``,
  ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``__complex__``, ``__array__``)
  are replaced inside the block and report themselves.

``torch.where(c, x, 0)`` dispatches ``scalar_tensor``: a Python scalar travels as a kernel
argument, not a transfer, and is not flagged; nor is ``torch.full``/``fill_``, the way to
put host numbers on a device without a copy. Not seen: ``torch.from_numpy`` and a
``.to("cpu")`` of a tensor that is already on the CPU (no op is dispatched; on a GPU the
latter is a ``_to_copy`` across devices, which is seen).

The block's log can also be started and stopped by hand (``start()``/``stop()``, e.g.
from two forward pre-hooks around another one) and can wrap a function (``wrap``);
``watch_hook`` wraps a step hook and counts per engine step.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the kinds of transfer the detector reports
KINDS = ("read", "upload", "dynamic_shape")

#: Tensor methods that read values on the host (patched inside a block)
READ_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__",
                "__index__", "__complex__", "__array__")
_READ_OPS = frozenset({"_local_scalar_dense", "equal", "is_nonzero"})
_UPLOAD_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
_DYNAMIC_OPS = frozenset({"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique",
                          "_unique", "_unique2", "unique_dim", "unique_consecutive",
                          "unique_dim_consecutive"})
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_",
                        "_unsafe_index", "_unsafe_index_put"})
_COPY_OPS = frozenset({"_to_copy", "copy_", "copy", "_copy_from"})


class HostTransferError(AssertionError):
    """A host read, upload or data-dependent shape beyond what the block allows."""


@dataclass(frozen=True)
class Transfer:
    """One transfer seen inside a block."""

    # one of KINDS
    kind: str
    # the operation: "Tensor.tolist", "aten.nonzero", "aten.index (boolean index)", ...
    what: str
    # "path/file.py:LINE in function": the first frame outside torch and this module
    where: str

    def __str__(self) -> str:
        return f"host {self.kind.replace('_', '-')} {self.what} at {self.where}"


_THIS = __file__.rsplit(".", 1)[0]
_TORCH = torch.__file__.rsplit("/", 1)[0]


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH) or name.startswith(_THIS)):
            return f"{name}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "?"


# ---------------------------------------------------------------------------------------
# The active logs and the patched Tensor methods (installed while any block is active)
# ---------------------------------------------------------------------------------------

_LOCK = threading.RLock()
_ACTIVE: list = []  # TransferLog, innermost last
_SAVED: dict = {}  # method name -> the attribute torch.Tensor.__dict__ held (or _MISSING)
_MISSING = object()
_STATE = threading.local()  # .inside: depth of patched-method calls on this thread


def _report(kind: str, what: str) -> None:
    where = None
    me = threading.get_ident()
    for log in list(_ACTIVE):
        if log._thread == me:
            where = where or _caller()
            log._record(Transfer(kind, what, where))


def _patched(name: str, original):
    def method(self, *args, **kwargs):
        depth = getattr(_STATE, "inside", 0)
        if depth == 0:
            _report("read", f"Tensor.{name}")
        _STATE.inside = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _STATE.inside = depth
    method.__name__ = name
    method.__qualname__ = f"Tensor.{name}"
    return method


def _install() -> None:
    for name in READ_METHODS:
        _SAVED[name] = torch.Tensor.__dict__.get(name, _MISSING)
        setattr(torch.Tensor, name, _patched(name, getattr(torch.Tensor, name)))


def _uninstall() -> None:
    for name, saved in _SAVED.items():
        if saved is _MISSING:
            delattr(torch.Tensor, name)
        else:
            setattr(torch.Tensor, name, saved)
    _SAVED.clear()


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _classify(func, args, kwargs) -> tuple[str, str] | None:
    """(kind, what) of one aten op, or None when it moves nothing."""
    name = func._schema.name.split("::", 1)[-1]
    if name in _UPLOAD_OPS:
        return "upload", f"aten.{name} (a tensor built from host data)"
    if name in _READ_OPS:
        return "read", f"aten.{name}"
    if name in _DYNAMIC_OPS:
        return "dynamic_shape", f"aten.{name}"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and any(
            isinstance(a, torch.Tensor) for a in args[:2]) and \
            func._overloadname != "self_int":
        return "dynamic_shape", "aten.repeat_interleave (repeats as a tensor, no output_size)"
    if name in _INDEX_OPS and len(args) > 1 and _is_bool_index(args[1]):
        return "dynamic_shape", f"aten.{name} (boolean index)"
    if name in _COPY_OPS:
        if name == "_to_copy":
            src = args[0]
            dst = kwargs.get("device") or src.device
        elif name == "_copy_from":
            src, dst = args[0], args[1].device
        else:
            dst, src = args[0].device, args[1]
        if not isinstance(src, torch.Tensor):
            return None
        s, d = src.device.type, torch.device(dst).type
        if s == "cpu" and d not in ("cpu", "meta"):
            return "upload", f"aten.{name} (host to {d})"
        if d == "cpu" and s not in ("cpu", "meta"):
            return "read", f"aten.{name} ({s} to host)"
    return None


class _Mode(TorchDispatchMode):
    def __init__(self, log: "TransferLog"):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_STATE, "inside", 0) == 0:
            found = _classify(func, args, kwargs)
            if found is not None:
                self.log._record(Transfer(found[0], found[1], _caller()))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# The log
# ---------------------------------------------------------------------------------------

class TransferLog:
    """Transfers seen inside one or more blocks; see the module docstring.

    ``allow``: how many transfers of each kind pass before one raises (all 0 by default);
    ``raise_on_transfer=False`` only counts. Re-entrant: entering an active log again
    counts into the same events.
    """

    def __init__(self, *, allow: dict | None = None, raise_on_transfer: bool = True):
        allow = dict(allow or {})
        unknown = sorted(set(allow) - set(KINDS))
        if unknown:
            raise ValueError(f"allow names unknown kinds {unknown}; expected some of {KINDS}")
        for kind, n in allow.items():
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"allow[{kind!r}] must be an integer >= 0, got {n!r}")
        self.allow = {k: allow.get(k, 0) for k in KINDS}
        self.raise_on_transfer = raise_on_transfer
        self.events: list[Transfer] = []
        self._modes: list = []
        self._thread = None

    # -- counting --------------------------------------------------------------------------
    def count(self, kind: str | None = None) -> int:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return sum(1 for e in self.events if kind is None or e.kind == kind)

    @property
    def reads(self) -> int:
        return self.count("read")

    @property
    def uploads(self) -> int:
        return self.count("upload")

    @property
    def dynamic_shapes(self) -> int:
        return self.count("dynamic_shape")

    def counts(self) -> dict:
        """{kind: count} over KINDS."""
        c = Counter(e.kind for e in self.events)
        return {k: c.get(k, 0) for k in KINDS}

    def _record(self, event: Transfer) -> None:
        self.events.append(event)
        if self.raise_on_transfer and self.count(event.kind) > self.allow[event.kind]:
            raise HostTransferError(
                f"{event} (a block checked by no_host_transfers allows "
                f"{self.allow[event.kind]} {event.kind.replace('_', '-')}"
                f"{'' if self.allow[event.kind] == 1 else 's'})")

    # -- activation ------------------------------------------------------------------------
    def start(self) -> "TransferLog":
        """Start watching on this thread (``stop`` ends it; blocks may nest)."""
        with _LOCK:
            me = threading.get_ident()
            if self._thread not in (None, me):
                raise RuntimeError("a TransferLog watches one thread at a time")
            self._thread = me
            if not _ACTIVE:
                _install()
            _ACTIVE.append(self)
        mode = _Mode(self)
        mode.__enter__()
        self._modes.append(mode)
        return self

    def stop(self) -> None:
        mode = self._modes.pop()
        mode.__exit__(None, None, None)
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _uninstall()
            if not self._modes:
                self._thread = None

    def __enter__(self) -> "TransferLog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` run inside this log at every call."""
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        wrapped.__wrapped__ = fn
        return wrapped

    def __repr__(self) -> str:
        return f"TransferLog({self.counts()})"


def no_host_transfers(*, allow_reads: int = 0, allow_uploads: int = 0,
                      allow_dynamic_shapes: int = 0,
                      raise_on_transfer: bool = True) -> TransferLog:
    """A block (``with``) in which host reads, uploads and data-dependent shapes raise
    ``HostTransferError`` past the allowed counts; ``raise_on_transfer=False`` only counts.
    Returns the ``TransferLog`` (also what ``with`` yields)."""
    return TransferLog(allow={"read": allow_reads, "upload": allow_uploads,
                              "dynamic_shape": allow_dynamic_shapes},
                       raise_on_transfer=raise_on_transfer)


class HookWatch:
    """A step hook (``hook(phase, view)``) run inside a counting log at every call, with
    the transfers of each call kept per engine step (``view.step``) and phase::

        watched = watch_hook(invariants.Monitor("fast"))
        specdec.generate(model, prompts, hooks=[watched])
        watched.per_step()     # {step: {"read": n, "upload": n, "dynamic_shape": n}}
        watched.total()        # the same summed over the run
    """

    def __init__(self, hook: Callable):
        self.hook = hook
        self.calls: list[tuple[int, str, tuple]] = []  # (step, phase, events)

    def __call__(self, phase: str, view) -> None:
        log = TransferLog(raise_on_transfer=False)
        try:
            with log:
                self.hook(phase, view)
        finally:
            self.calls.append((int(view.step), phase, tuple(log.events)))

    def per_step(self) -> dict:
        out: dict = defaultdict(lambda: {k: 0 for k in KINDS})
        for step, _, events in self.calls:
            row = out[step]
            for e in events:
                row[e.kind] += 1
        return dict(out)

    def total(self) -> dict:
        c = Counter(e.kind for _, _, events in self.calls for e in events)
        return {k: c.get(k, 0) for k in KINDS}

    def events(self) -> list:
        """(step, phase, Transfer) of every transfer seen."""
        return [(s, p, e) for s, p, events in self.calls for e in events]


def watch_hook(hook: Callable) -> HookWatch:
    """``hook`` wrapped so that each call's transfers are counted (see ``HookWatch``)."""
    return HookWatch(hook)


__all__ = ["KINDS", "READ_METHODS", "HostTransferError", "Transfer", "TransferLog",
           "no_host_transfers", "HookWatch", "watch_hook"]
