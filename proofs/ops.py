"""A z3 backend for the ops interface of ``specdec.layout``.

The layout functions are written for torch tensors that broadcast (rows ``[B, 1]``,
slots ``[1, W]``). ``ZTensor`` is the smallest tensor that lets the same code run on z3
terms: a numpy object array of z3 expressions (or Python ints/bools) with torch-like
broadcasting operators, so ``j >= pad`` or ``new_width - n_new`` build z3 terms element
by element. ``Z3Ops`` supplies the rest: ``where`` -> ``z3.If``, ``clamp`` -> an ``If``
chain, ``minimum``, ``maximum``, and the reductions ``amax``/``amin``/``any`` over one axis (``If``
chains, ``Or``). ``Z3Ops(clamp=False)`` evaluates a function with every clamp replaced by
the identity, which is how the proofs observe the unclamped value a clamp receives.

A ``ZTensor`` refuses ``bool()``: a layout function that branches in Python on a symbolic
value fails loudly instead of silently proving one branch.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import z3

__all__ = ["ZTensor", "Z3Ops", "Z3", "Z3_NOCLAMP", "zt", "scalar", "column", "row", "term", "cell"]


def _to_bool(x):
    if isinstance(x, (bool, np.bool_)):
        return z3.BoolVal(bool(x))
    return x


def _if(c, a, b):
    if isinstance(c, (bool, np.bool_)):
        return a if c else b
    if isinstance(a, (bool, np.bool_)) and isinstance(b, (bool, np.bool_)):
        a, b = z3.BoolVal(bool(a)), z3.BoolVal(bool(b))
    elif isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        a, b = z3.IntVal(int(a)), z3.IntVal(int(b))
    return z3.If(c, a, b)


def _and(a, b):
    if isinstance(a, (bool, np.bool_)) and isinstance(b, (bool, np.bool_)):
        return bool(a) and bool(b)
    return z3.And(_to_bool(a), _to_bool(b))


def _or(a, b):
    if isinstance(a, (bool, np.bool_)) and isinstance(b, (bool, np.bool_)):
        return bool(a) or bool(b)
    return z3.Or(_to_bool(a), _to_bool(b))


def _not(a):
    if isinstance(a, (bool, np.bool_)):
        return not a
    return z3.Not(a)


def _plain(x):
    """numpy scalars -> Python scalars (z3 does not coerce numpy integers)."""
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


_UF = {
    "add": np.frompyfunc(lambda a, b: _plain(a) + _plain(b), 2, 1),
    "sub": np.frompyfunc(lambda a, b: _plain(a) - _plain(b), 2, 1),
    "mul": np.frompyfunc(lambda a, b: _plain(a) * _plain(b), 2, 1),
    "ge": np.frompyfunc(lambda a, b: _plain(a) >= _plain(b), 2, 1),
    "gt": np.frompyfunc(lambda a, b: _plain(a) > _plain(b), 2, 1),
    "le": np.frompyfunc(lambda a, b: _plain(a) <= _plain(b), 2, 1),
    "lt": np.frompyfunc(lambda a, b: _plain(a) < _plain(b), 2, 1),
    "eq": np.frompyfunc(lambda a, b: _plain(a) == _plain(b), 2, 1),
    "ne": np.frompyfunc(lambda a, b: _plain(a) != _plain(b), 2, 1),
    "and": np.frompyfunc(lambda a, b: _and(_plain(a), _plain(b)), 2, 1),
    "or": np.frompyfunc(lambda a, b: _or(_plain(a), _plain(b)), 2, 1),
    "not": np.frompyfunc(lambda a: _not(_plain(a)), 1, 1),
    "neg": np.frompyfunc(lambda a: -_plain(a), 1, 1),
    "if": np.frompyfunc(lambda c, a, b: _if(_plain(c), _plain(a), _plain(b)), 3, 1),
}


def _arr(x) -> np.ndarray:
    if isinstance(x, ZTensor):
        return x.a
    if isinstance(x, np.ndarray):
        return x.astype(object)
    out = np.empty((), dtype=object)
    out[()] = x
    return out


def _wrap(r) -> "ZTensor":
    if not isinstance(r, np.ndarray):
        out = np.empty((), dtype=object)
        out[()] = r
        r = out
    return ZTensor(r)


class ZTensor:
    """An object array of z3 terms with torch-like broadcasting operators."""

    __slots__ = ("a",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, a):
        self.a = a if isinstance(a, np.ndarray) and a.dtype == object else _arr(a)

    # shape helpers ---------------------------------------------------------------------
    @property
    def shape(self):
        return self.a.shape

    def __getitem__(self, idx):
        return _wrap(self.a[idx])

    def item(self):
        """The single term of a one-element tensor."""
        if self.a.size != 1:
            raise ValueError(f"item() of a ZTensor of shape {self.a.shape}")
        return _plain(self.a.reshape(-1)[0])

    def tolist(self):
        return [_plain(x) for x in self.a.reshape(-1)]

    def __bool__(self):
        raise TypeError("a symbolic ZTensor has no truth value: the layout function branches "
                        "in Python on a value it should compute with ops.where")

    def __repr__(self):
        return f"ZTensor(shape={self.a.shape}, {self.a!r})"

    # operators -------------------------------------------------------------------------
    def _bin(self, name, other, reverse=False):
        a, b = (_arr(other), self.a) if reverse else (self.a, _arr(other))
        return _wrap(_UF[name](a, b))

    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __ge__(self, o): return self._bin("ge", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __le__(self, o): return self._bin("le", o)
    def __lt__(self, o): return self._bin("lt", o)
    def __eq__(self, o): return self._bin("eq", o)  # type: ignore[override]
    def __ne__(self, o): return self._bin("ne", o)  # type: ignore[override]
    def __and__(self, o): return self._bin("and", o)
    def __rand__(self, o): return self._bin("and", o, True)
    def __or__(self, o): return self._bin("or", o)
    def __ror__(self, o): return self._bin("or", o, True)
    def __invert__(self): return _wrap(_UF["not"](self.a))
    def __neg__(self): return _wrap(_UF["neg"](self.a))


def zt(x) -> ZTensor:
    """Wrap a z3 term, a Python number, a nested list or an object array."""
    if isinstance(x, ZTensor):
        return x
    if isinstance(x, list):
        arr = np.empty(_nested_shape(x), dtype=object)
        for idx in np.ndindex(arr.shape):
            v = x
            for i in idx:
                v = v[i]
            arr[idx] = v
        return ZTensor(arr)
    return ZTensor(_arr(x))


def _nested_shape(x) -> tuple:
    shape = []
    while isinstance(x, list):
        shape.append(len(x))
        x = x[0] if x else None
    return tuple(shape)


def scalar(x) -> ZTensor:
    """A [1, 1] tensor: broadcasts against rows [B, 1] and slots [1, W] like a Python int."""
    return zt([[x]])


def column(xs: Iterable) -> ZTensor:
    """Per-row values as a [B, 1] tensor (the engine's ``t[:, None]``)."""
    return zt([[x] for x in xs])


def row(xs: Iterable) -> ZTensor:
    """Per-slot values as a [1, W] tensor (the engine's ``arange(W)[None, :]``)."""
    return zt([list(xs)])


def term(x):
    """A z3 term from a one-element ZTensor, a Python value or a term."""
    if isinstance(x, ZTensor):
        x = x.item()
    if isinstance(x, (bool, np.bool_)):
        return z3.BoolVal(bool(x))
    if isinstance(x, (int, np.integer)):
        return z3.IntVal(int(x))
    return x


def _reduce(x, dim: int, keepdim: bool, fn) -> ZTensor:
    a = _arr(x)
    moved = np.moveaxis(a, dim, -1)
    if moved.shape[-1] == 0:
        raise ValueError("reduction over an empty axis (torch raises here too)")
    out = np.empty(moved.shape[:-1], dtype=object)
    for idx in np.ndindex(out.shape):
        vals = [_plain(v) for v in moved[idx]]
        acc = vals[0]
        for v in vals[1:]:
            acc = fn(acc, v)
        out[idx] = acc
    if keepdim:
        out = np.expand_dims(out, dim)
    return _wrap(out)


class Z3Ops:
    """The ops interface of ``specdec.layout`` over ``ZTensor``.

    ``clamp=False`` makes ``clamp`` the identity (to observe what a clamp receives).
    """

    def __init__(self, clamp: bool = True):
        self.clamp_enabled = clamp

    def where(self, cond, a, b):
        return _wrap(_UF["if"](_arr(cond), _arr(a), _arr(b)))

    def clamp(self, x, lo, hi):
        if not self.clamp_enabled:
            return zt(x)
        x = zt(x)
        below = self.where(x < lo, lo, x)
        return self.where(below > hi, hi, below)

    def minimum(self, a, b):
        a = zt(a)
        return self.where(a <= b, a, b)

    def maximum(self, a, b):
        a = zt(a)
        return self.where(a >= b, a, b)

    def amax(self, x, dim, keepdim=False):
        return _reduce(x, dim, keepdim, lambda p, q: _if(q > p, q, p))

    def amin(self, x, dim, keepdim=False):
        return _reduce(x, dim, keepdim, lambda p, q: _if(q < p, q, p))

    def any(self, x, dim, keepdim=False):
        return _reduce(x, dim, keepdim, _or)


Z3 = Z3Ops()
Z3_NOCLAMP = Z3Ops(clamp=False)


def cell(x: Any, *idx):
    """Element ``idx`` of a ZTensor after broadcasting singleton axes (``x[b, 0]`` of a
    [1, 1] tensor is its only element), as a z3 term."""
    if not isinstance(x, ZTensor):
        return term(x)
    a = x.a
    fixed = tuple(0 if a.shape[d] == 1 else i for d, i in enumerate(idx[: a.ndim]))
    return term(_plain(a[fixed]))
