"""Static input buffers of one resolution, allocated once at the largest bucket and sliced per bucket."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class InputSpec:
    """One engine input: its per-row shape (batch is dim 0, added by the engine), dtype and the value
    that padded rows hold (fixed, so a padded row never carries data from another batch)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float = 0.0


@dataclass
class StaticInputs:
    """Buffers of one resolution at the largest bucket. `view(n)` is what a graph of bucket n reads."""

    tensors: dict[str, torch.Tensor]
    specs: dict[str, InputSpec]

    @classmethod
    def allocate(cls, specs: dict[str, InputSpec], rows: int, device: torch.device) -> "StaticInputs":
        tensors = {name: torch.full((rows, *s.shape), s.fill, dtype=s.dtype, device=device) for name, s in specs.items()}
        return cls(tensors, dict(specs))

    def view(self, bucket: int) -> dict[str, torch.Tensor]:
        return {name: t[:bucket] for name, t in self.tensors.items()}

    def load(self, inputs: dict[str, torch.Tensor], n: int, bucket: int) -> None:
        """Copy n real rows in and reset rows n..bucket to their fill value."""
        check_inputs(self.specs, inputs, n)
        for name, t in self.tensors.items():
            t[:n].copy_(inputs[name], non_blocking=True)
            if bucket > n:
                t[n:bucket].fill_(self.specs[name].fill)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def check_inputs(specs: dict[str, InputSpec], inputs: dict[str, torch.Tensor], n: int) -> None:
    """Inputs must match the specs exactly: a wrong shape would silently broadcast into a buffer."""
    if set(inputs) != set(specs):
        raise ValueError(f"engine inputs {sorted(inputs)} do not match the specs {sorted(specs)}")
    for name, spec in specs.items():
        t = inputs[name]
        if tuple(t.shape) != (n, *spec.shape):
            raise ValueError(f"engine input {name!r} has shape {tuple(t.shape)}, expected {(n, *spec.shape)}")


def pad_rows(specs: dict[str, InputSpec], inputs: dict[str, torch.Tensor], n: int, bucket: int) -> dict[str, torch.Tensor]:
    """Eager twin of `StaticInputs.load`: the same rows, padded with the same fixed values."""
    check_inputs(specs, inputs, n)
    if bucket == n:  # cast as the static buffers' copy_ would, so eager and replay see the same dtypes
        return {name: inputs[name].to(spec.dtype) for name, spec in specs.items()}
    out = {}
    for name, spec in specs.items():
        t = inputs[name]
        pad = torch.full((bucket - n, *spec.shape), spec.fill, dtype=spec.dtype, device=t.device)
        out[name] = torch.cat([t.to(spec.dtype), pad])
    return out
