"""kernels.fp8: the transformer blocks' linear layers as rowwise-scaled float8 matmuls.

Each linear layer of the repeated blocks (`BLOCKS`) keeps its module and gets, on the instance:
- its weight in float8 e4m3, quantized once here with one scale per output channel (the weight
  parameter itself becomes the float8 [N, K] tensor, the scales a float32 [1, N] buffer);
- a forward that scales each activation row by its own absolute maximum, casts it to float8 and
  calls `torch._scaled_mm(x8 [M, K], w8.t() [K, N] column-major, scale_x [M, 1], scale_w [1, N],
  bias, out_dtype=x.dtype)`, which multiplies in float8 and rescales in its epilogue.

The activation's quantization is plain torch ops, so under kernels.compile inductor fuses it into
the kernel that produces the activation (the layer norm's modulation, the GELU, the attention's
output copy); eager, it is separate kernels that cost about what the float8 matmul saves, which
`apply` warns about. The adaptive norms' modulation layers (one row per image) stay in bf16, and
so does every layer outside the blocks, so the model's dtype (its first parameter's) is unchanged.

torch._scaled_mm on CUDA needs a row-major first operand, a column-major second, K and N multiples
of 16 and, for rowwise scales, float32 scales of shapes [M, 1] and [1, N] and a bfloat16 output;
layers whose sizes are not multiples of 16 stay as they are. On the CPU torch runs the same op
(emulated, slowly): the tests check the numerics there; a job refuses fp8 without float8 tensor cores.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import NamedTuple

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Scales never below this: an all-zero row (a padded row) quantizes to zeros, not to NaN.
MIN_AMAX = 1e-12
BLOCKS = ("transformer_blocks", "single_transformer_blocks")  # the repeated blocks (Flux has both kinds)
ALIGN = 16  # torch._scaled_mm's K and N multiple on CUDA
WEIGHT_SCALE = "fp8_weight_scale"  # the buffer of per-output-channel scales, float32 [1, N]
# a module's flag: its output goes to float8 layers only, which take it as QuantizedRows (Flux's attention
# under kernels.fp8_attention, its modulated norms under kernels.fp8_norm)
ROWS_OUT = "fp8_rows_out"


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a known device: float8 tensor cores, or a refusal."""
    if kernels.fp8 and device is not None:
        check_fp8(device)


def check_fp8(device: torch.device, what: str = "kernels.fp8=true") -> None:
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError(f"{what} needs a CUDA GPU with float8 tensor cores (sm89+: Ada, Hopper, Blackwell)")


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fp8_linear_layers": n} when on, else {}."""
    if not kernels.fp8:
        return {}
    if adapter.device.type == "cuda" and adapter.dtype != torch.bfloat16:
        raise UserError(f"kernels.fp8=true needs precision=bf16: rowwise-scaled float8 matmuls give bfloat16 "
                        f"results, the model runs in {adapter.dtype}")
    layers = quantize_fp8(adapter.transformer)
    log.info("kernels: %d linear layers as rowwise-scaled float8 matmuls", layers)
    if not kernels.compile:
        log.warning("kernels: float8 without kernels.compile scales activations in separate, unfused kernels, "
                    "which makes a step slower than bf16 (docs/BENCHMARKS.md)")
    return {"fp8_linear_layers": layers}


def quantize_fp8(transformer: torch.nn.Module) -> int:
    """Every linear layer of the transformer's repeated blocks, except the norms' modulation and
    layers whose sizes are not multiples of 16, as a float8 layer (this instance only) -> layers
    converted."""
    layers = 0
    for name, module in block_linears(transformer):
        if module.in_features % ALIGN or module.out_features % ALIGN:
            log.debug("kernels.fp8: %s stays %s (%d x %d, not multiples of %d)", name, module.weight.dtype,
                      module.out_features, module.in_features, ALIGN)
            continue
        to_fp8(module)
        layers += 1
    return layers


def block_linears(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """(name, layer) of the nn.Linear layers inside `BLOCKS`, without the adaptive norms' ones."""
    found = []
    for blocks in BLOCKS:
        for name, module in getattr(transformer, blocks, torch.nn.ModuleList()).named_modules(prefix=blocks):
            if isinstance(module, torch.nn.Linear) and not any(part.startswith("norm") for part in name.split(".")):
                found.append((name, module))
    return found


def is_fp8(module: object) -> bool:
    """A linear layer that `to_fp8` made float8."""
    return isinstance(module, torch.nn.Linear) and hasattr(module, WEIGHT_SCALE)


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


def to_fp8(linear: torch.nn.Linear) -> None:
    """This layer's weight in float8 with per-output-channel scales, and its forward as a float8
    matmul (instance attributes; the class is untouched). dynamo traces the instance's forward
    (it guards on that function), so the compiled block calls it like any op."""
    w8, scale = quantize_weight(linear.weight)
    linear.weight = torch.nn.Parameter(w8, requires_grad=False)
    if linear.bias is not None:  # inference only: torch._scaled_mm has no derivative
        linear.bias.requires_grad_(False)
    linear.register_buffer(WEIGHT_SCALE, scale)
    linear.forward = MethodType(fp8_forward, linear)


def fp8_forward(linear: torch.nn.Linear, x: "torch.Tensor | QuantizedRows") -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: each row quantized with its own scale (or already, as
    QuantizedRows), one float8 matmul."""
    if isinstance(x, QuantizedRows):
        return scaled_matmul(linear, x.x8.reshape(-1, x.x8.shape[-1]), x.scale, x.x8.shape, x.dtype)
    x8, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return scaled_matmul(linear, x8, scale, x.shape, x.dtype)


def scaled_matmul(linear: torch.nn.Linear, x8: torch.Tensor, scale: torch.Tensor, shape: torch.Size,
                  dtype: torch.dtype) -> torch.Tensor:
    """A float8 layer on quantized rows (x8 [M, K], scale [M, 1]) of an activation of `shape` [..., K]
    -> [..., N] in `dtype`."""
    out = torch._scaled_mm(x8, linear.weight.t(), scale_a=scale, scale_b=getattr(linear, WEIGHT_SCALE),
                           bias=linear.bias, out_dtype=dtype, use_fast_accum=True)
    return out.reshape(*shape[:-1], out.shape[-1])



class QuantizedRows(NamedTuple):
    """An activation that its producer has already quantized for float8 layers (Flux's float8
    attention, pipeline/kernels/fp8_attention.py; its modulated norms, pipeline/kernels/fp8_norm.py):
    float8 rows [..., K], row-major, their scales float32 [rows, 1], and the dtype the activation
    stands in for."""
    x8: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        """The activation's shape (a processor reads a token count from it)."""
        return self.x8.shape

    def dequantize(self) -> torch.Tensor:
        return (self.x8.reshape(-1, self.x8.shape[-1]).float() * self.scale).to(self.dtype).reshape(self.x8.shape)


def linear(layer: torch.nn.Module, x: "torch.Tensor | QuantizedRows") -> torch.Tensor:
    """layer(x), where x may be QuantizedRows: a float8 layer multiplies those rows as they are, any
    other layer (one kernels.fp8 left in bf16: its sizes not multiples of 16) their dequantized values."""
    if isinstance(x, QuantizedRows) and not hasattr(layer, WEIGHT_SCALE):
        return layer(x.dequantize())
    return layer(x)
