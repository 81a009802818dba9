"""PixArt's float8 residual blocks' fused row functions: the residual add that the float8 matmul before
them leaves, the layer norm and its modulation after it, and the rowwise float8 quantization of what
the next float8 layers read, each as one function of whole rows.

A float8 matmul (torch._scaled_mm) cannot add into the residual stream in its epilogue as `addmm_`
does for kernels.fuse_residual's bf16 blocks: it writes its output, bias included. So each residual
add is done by the function that reads the stream next, which needs the whole row anyway: the layer
norm before the self-attention and the feed-forward (`norm_rows`) and the quantization of the
cross-attention's queries' input (`added_rows`). It reads the stream and the update, writes their
sum (the next stream, rounded once) and the float8 rows of the norm's (or the sum's) output. Compiled
(kernels.compile_scope=norms: inductor, its kernels generated for a fixed row count, so the same
kernel in every process), each is one kernel over a row; on the CPU, or uncompiled, the torch ops.

Numerics: the sum and the norm in fp32, the norm's output rounded once to the model's dtype (the value
the bf16 block's layer would read), then quantized as pipeline.kernels.fp8.quantize_rows does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8

# In the job's kernel digest (with the hint the compiled kernels are generated for, pipeline.blocks.pixart)
SETTING = "sum-fp32-norm-fp32-rounded-then-rowwise-e4m3"


def residual_add(rows: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """rows [M, C] + gate [C] * update [M, C] in fp32, rounded once to the rows' dtype; `rows` without an update,
    the plain sum without a gate."""
    if update is None:
        return rows
    if gate is None:
        return (rows.float() + update.float()).to(rows.dtype)
    return (rows.float() + gate.float() * update.float()).to(rows.dtype)


def norm_rows(rows: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None, modulation: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream `residual_add(rows, update, gate)` [M, C], then LN(stream) * (1 + scale) + shift in fp32
    (modulation [2, C]: scale, shift), rounded to the rows' dtype and quantized rowwise -> (the stream,
    float8 [M, C], scales [M, 1])."""
    stream = residual_add(rows, update, gate)
    scale, shift = modulation.float()
    normed = F.layer_norm(stream.float(), stream.shape[-1:], eps=eps) * (1 + scale) + shift
    return (stream, *fp8.quantize_rows(normed.to(rows.dtype)))


def added_rows(rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream `residual_add(rows, update, gate)` [M, C] and its rows quantized -> (the stream, float8
    [M, C], scales [M, 1])."""
    stream = residual_add(rows, update, gate)
    return (stream, *fp8.quantize_rows(stream))
