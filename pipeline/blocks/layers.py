"""The linear layers the project's own blocks are built of, from diffusers' `nn.Linear` weights.

- `Linear`: the weight as it is (the same tensor as the checkpoint's module: nothing is copied), or
  several layers' weights joined along their outputs (q|k|v: one wider matmul).
- `Fp8Linear`: the weight in float8 e4m3 with one scale per output channel, quantized once here; an
  activation's rows are scaled by their own absolute maxima at each call (or arrive quantized, as
  `fp8.QuantizedRows`, from a kernel that wrote them so) and one `torch._scaled_mm` multiplies them.
- `GeluLinear`: a bf16/fp16 layer whose tanh GELU runs in cuBLASLt's matmul epilogue (CUDA).
- `Fp8GeluLinear`: a float8 up-projection whose output is the float8 rows of its tanh GELU, for a float8
  down-projection to multiply as they are: one Triton matmul on CUDA (pipeline.kernels.fp8_gelu_mm).

`linear(layers, fp8)` makes the layer a plan asks for; a layer whose sizes float8 matmuls cannot take
(not multiples of 16) stays a `Linear`, and reads quantized rows dequantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, fp8_gelu_mm
from pipeline.kernels.fp8 import QuantizedRows

Activation = "torch.Tensor | QuantizedRows"


class OwnTransformer(torch.nn.Module):
    """A transformer of ours over a diffusers model's weights: the source's config; its dtype and device
    are those of its output projection (`proj_out`, a layer outside the blocks, never float8)."""

    def __init__(self, source: torch.nn.Module):
        super().__init__()
        self.config = source.config

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device


def _frozen(t: torch.Tensor | None) -> torch.nn.Parameter | None:
    return None if t is None else torch.nn.Parameter(t.detach(), requires_grad=False)


def _joined(layers: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layers' weights [N_i, K] and biases joined along the outputs; one layer's are its own tensors."""
    if len(layers) == 1:
        return layers[0].weight, layers[0].bias
    weight = torch.cat([layer.weight.detach() for layer in layers])
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return weight, None
    return weight, torch.cat([(b if b is not None else torch.zeros_like(layer.weight[:, 0])).detach()
                              for b, layer in zip(biases, layers)])


class Linear(torch.nn.Module):
    """y = x W^T + b in the weight's dtype; quantized rows are dequantized first."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = _frozen(weight), _frozen(bias)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def forward(self, x: Activation) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            x = x.dequantize()
        return F.linear(x, self.weight, self.bias)


class GeluLinear(Linear):
    """tanh GELU(x W^T + b) as one cuBLASLt matmul with a GELU epilogue (CUDA: PyTorch's CPU version
    of the fused op computes the exact GELU). The GELU rounds once, from the fp32 accumulator."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = torch._addmm_activation(self.bias, rows, self.weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], out.shape[-1])


class Fp8Linear(torch.nn.Module):
    """A rowwise-scaled float8 layer: weight8 [N, K] e4m3 with scales [1, N] (row n of the weight is
    weight8[n] * scale[0, n]), bias in the model's dtype. x [..., K] (or its quantized rows) -> [..., N]
    in the activation's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        w8, scale = fp8.quantize_weight(weight)
        self.weight8 = _frozen(w8)
        self.register_buffer("weight_scale", scale)
        self.bias = _frozen(bias)

    @property
    def in_features(self) -> int:
        return self.weight8.shape[1]

    def forward(self, x: Activation) -> torch.Tensor:
        x8, scale = self.quantized(x)
        return self.rows(x8.reshape(-1, x8.shape[-1]), scale, x8.shape, x.dtype)

    @staticmethod
    def quantized(x: Activation) -> tuple[torch.Tensor, torch.Tensor]:
        """x's float8 rows [..., K] (as its producer wrote them, or quantized here) and their scales [rows, 1]."""
        if isinstance(x, QuantizedRows):
            return x.x8, x.scale
        x8, scale = fp8.quantize_rows(x.reshape(-1, x.shape[-1]))
        return x8.view(x.shape), scale

    def rows(self, x8: torch.Tensor, scale: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Quantized rows x8 [M, K] with scales [M, 1] of an activation of `shape` [..., K] -> [..., N]."""
        out = torch._scaled_mm(x8, self.weight8.t(), scale_a=scale, scale_b=self.weight_scale, bias=self.bias,
                               out_dtype=dtype, use_fast_accum=True)
        return out.reshape(*shape[:-1], out.shape[-1])


class Fp8GeluLinear(Fp8Linear):
    """tanh GELU(x W^T + b) of a float8 layer, as float8 rows (`QuantizedRows`) scaled by a bound the input's
    scale gives (pipeline.kernels.fp8_gelu_mm): the down-projection's input, never a bf16 tensor."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight, bias)
        self.register_buffer("gelu_bounds", fp8_gelu_mm.bounds(self.weight8, self.weight_scale, self.bias))

    def forward(self, x: Activation) -> QuantizedRows:
        x8, scale = self.quantized(x)
        q, out_scale = torch.ops.bcg.gelu_mm_rows(x8.reshape(-1, x8.shape[-1]), scale, self.weight8,
                                                  self.weight_scale, self.bias, self.gelu_bounds)
        return QuantizedRows(q.view(*x8.shape[:-1], q.shape[-1]), out_scale, x.dtype)


def fp8_sized(weight: torch.Tensor) -> bool:
    """Whether float8 matmuls take this weight's sizes (torch._scaled_mm: K and N multiples of 16)."""
    return weight.shape[0] % fp8.ALIGN == 0 and weight.shape[1] % fp8.ALIGN == 0


def linear(layers: list[torch.nn.Linear], as_fp8: bool = False, gelu: bool = False,
           gelu_rows: bool = False) -> torch.nn.Module:
    """One layer of the given diffusers layers (several: joined along their outputs): float8 where
    `as_fp8` and its sizes allow (with `gelu_rows`, writing its GELU's float8 rows), a GELU epilogue
    with `gelu` (bf16/fp16 only), else as it is."""
    return linear_of(*_joined(layers), as_fp8, gelu, gelu_rows)


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None, as_fp8: bool = False,
              gelu: bool = False, gelu_rows: bool = False) -> torch.nn.Module:
    """`linear`'s layer of this weight [N, K] and bias [N] (or None)."""
    if as_fp8 and fp8_sized(weight):
        return Fp8GeluLinear(weight, bias) if gelu_rows else Fp8Linear(weight, bias)
    if gelu:
        return GeluLinear(weight, bias)
    return Linear(weight, bias)
