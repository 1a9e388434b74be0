"""Host reads that do not stall the stream: a device tensor's values copied to the host
without waiting, read later (``DeferredRead``).

On a GPU, ``tensor.tolist()`` waits for every kernel queued so far. A loop that only
needs a value one step later (the plain decoding loop's "has every row finished?")
starts the copy right after the kernels that compute it (``DeferredRead(t)``: a
non-blocking copy into pinned host memory and a CUDA event), queues the next step's
forward, and then reads (``tolist``): the host waits for the copy alone while the GPU
already runs the next forward. On a CPU there is nothing to overlap: ``tolist`` reads
the tensor itself (the one host read ``invariants.testing.no_host_transfers`` counts).
"""

from __future__ import annotations

import torch


class DeferredRead:
    """The values of ``tensor`` (any shape) as they are now, readable later on the host."""

    def __init__(self, tensor: torch.Tensor):
        if tensor.device.type == "cuda":
            # [same shape] pinned host copy, filled asynchronously
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tensor, None

    def tolist(self):
        """The values (waits for the copy only, never for later kernels)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
