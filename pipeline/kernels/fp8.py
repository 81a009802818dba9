"""Float8 numerics: rowwise-scaled e4m3 weights and activations, and quantized rows passed between kernels.

A float8 layer (pipeline.blocks.layers.Fp8Linear) holds its weight quantized once with one scale
per output channel, and scales each activation row by its own absolute maximum before one
`torch._scaled_mm(x8 [M, K], w8.t() [K, N] column-major, scale_x [M, 1], scale_w [1, N], bias,
out_dtype)`, which multiplies in float8 and rescales in its epilogue. A kernel that produces an
activation only float8 layers read (Flux's float8 attention, its modulated norms, the GELU) writes
it as `QuantizedRows` instead, which the layer multiplies as they are.

torch._scaled_mm on CUDA needs a row-major first operand, a column-major second, K and N multiples
of 16 and, for rowwise scales, float32 scales of shapes [M, 1] and [1, N] and a bfloat16 output. On
the CPU torch runs the same op (emulated, slowly): the tests check the numerics there; a job refuses
float8 without float8 tensor cores.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch

from pipeline.errors import UserError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Scales never below this: an all-zero row (a padded row) quantizes to zeros, not to NaN.
MIN_AMAX = 1e-12
ALIGN = 16  # torch._scaled_mm's K and N multiple on CUDA


@functools.cache
def say_once(logger: str, message: str) -> None:
    """A float8 kernel's choice the job makes by itself (a slower path, another kernel), warned once in the
    log of `logger`; stats.json records it where it changes images."""
    logging.getLogger(logger).warning(message)


def check_fp8(device: torch.device, what: str = "kernels.fp8=true") -> None:
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError(f"{what} needs a CUDA GPU with float8 tensor cores (sm89+: Ada, Hopper, Blackwell)")


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (float8 [N, K], scales float32 [1, N]): row n of the weight is
    w8[n] * scale[0, n], each row scaled by its own absolute maximum."""
    amax = weight.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=MIN_AMAX)  # [N, 1]
    scale = amax / FP8_MAX
    w8 = (weight.detach().float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8.contiguous(), scale.reshape(1, -1).contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K] row-major, scales float32 [M, 1]): x[m] ~ x8[m] * scale[m]."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class QuantizedRows(NamedTuple):
    """An activation that its producer has already quantized for float8 layers: float8 rows [..., K],
    row-major, their scales float32 [rows, 1], and the dtype the activation stands in for."""
    x8: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The activation's shape."""
        return self.x8.shape

    def dequantize(self) -> torch.Tensor:
        return (self.x8.reshape(-1, self.x8.shape[-1]).float() * self.scale).to(self.dtype).reshape(self.x8.shape)
