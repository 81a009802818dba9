"""Host <-> device copies that do not make the host wait for the device.

A copy from pageable host memory, or any copy with non_blocking=False, synchronises: the host waits
until the device has drained its queue, and the device then idles while the host prepares more
work. Through pinned memory with non_blocking=True both directions are queued like kernels
(PyTorch's pinned allocator keeps a buffer alive until its copy has run).
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`; from the host to a CUDA device, queued via pinned memory."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`, queued (pinned memory, no wait) when `t` is on a CUDA device: read it
    only after an event recorded after this call has completed."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
