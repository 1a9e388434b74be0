"""A CPU stand-in for CUDA's sync debug mode: refuse every host read of a tensor value."""

from __future__ import annotations

import torch


class HostReadError(AssertionError):
    """A tensor value was read on the host where no host transfer is allowed."""


def forbid_host_reads():
    """Context manager: any read of a tensor's values on the host (``item``, ``tolist``,
    ``bool(t)``, ``int(t)``, ``cpu``, ``numpy``, ``nonzero``) raises ``HostReadError``.

    On CPU this stands in for CUDA's sync debug mode (which the GPU tests use); it does
    not see reads made inside C++ (boolean-mask indexing), so code under test avoids those
    by construction.
    """
    import contextlib

    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu",
             "numpy", "nonzero")

    @contextlib.contextmanager
    def guard():
        saved = {n: getattr(torch.Tensor, n) for n in names}
        saved_nonzero = torch.nonzero

        def refuse(name):
            def f(*a, **k):
                raise HostReadError(f"host read of a tensor value: Tensor.{name}")
            return f
        try:
            for n in names:
                setattr(torch.Tensor, n, refuse(n))
            torch.nonzero = refuse("nonzero")
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)
            torch.nonzero = saved_nonzero
    return guard()
