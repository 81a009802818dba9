"""Two streams' projections written into one joined buffer: an MM-DiT's joint attention without a join.

SD3's joint attention attends over each sample's image tokens then its text tokens. Projected apart and
joined afterwards, every q|k|v value is written twice (by the matmul, then by the join that lays out
attention's input). Here each sample's image rows and text rows are multiplied by their own weights
straight into their places in one buffer [B, S_i + S_t, N], the image's first; attention reads its
queries, keys and values as strided views of it.

A sample's rows are one matmul of its own (of S_i and of S_t rows), so its values do not depend on its
batch-mates or on the batch size. Each is an operator torch.compile calls as it is (the slices they
write cannot be expressed to inductor without the copy they avoid).
"""

from __future__ import annotations

from typing import Optional

import torch


def _joined(image: torch.Tensor, text: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    return image.new_empty((image.shape[0], image.shape[1] + text.shape[1], width), dtype=dtype)


def _into(out: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if bias is None:
        torch.mm(rows, weight.t(), out=out)
    else:
        torch.addmm(bias, rows, weight.t(), out=out)


def _aligned(scales: torch.Tensor) -> torch.Tensor:
    """A sample's rows' scales where cuBLASLt reads them: at a 16-byte boundary (a copy where the slice is not)."""
    return scales if scales.data_ptr() % 16 == 0 else scales.clone()


def _scaled_into(out: torch.Tensor, rows8: torch.Tensor, scales: torch.Tensor, sample: int, weight8: torch.Tensor,
                 weight_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """Sample `sample` of float8 rows [B, S, K] (their scales [B * S, 1]) through a float8 layer, into out [S, N]."""
    tokens = rows8.shape[1]
    torch._scaled_mm(rows8[sample], weight8.t(), scale_a=_aligned(scales[sample * tokens:(sample + 1) * tokens]),
                     scale_b=weight_scale, bias=bias, out_dtype=out.dtype, use_fast_accum=True, out=out)


@torch.library.custom_op("bcg::joined_linear", mutates_args=())
def joined_linear(image: torch.Tensor, text: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  text_weight: torch.Tensor, text_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """image [B, S_i, K] and text [B, S_t, K'] through their layers (weight [N, K], text_weight [N, K'],
    biases [N] or None) -> [B, S_i + S_t, N]: each sample's image rows, then its text rows."""
    out = _joined(image, text, weight.shape[0], image.dtype)
    split = image.shape[1]
    for b in range(image.shape[0]):
        _into(out[b, :split], image[b], weight, bias)
        _into(out[b, split:], text[b], text_weight, text_bias)
    return out


@joined_linear.register_fake
def _(image, text, weight, bias, text_weight, text_bias):
    return _joined(image, text, weight.shape[0], image.dtype)


@torch.library.custom_op("bcg::joined_scaled_mm", mutates_args=())
def joined_scaled_mm(image8: torch.Tensor, image_scale: torch.Tensor, text8: torch.Tensor, text_scale: torch.Tensor,
                     weight8: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                     text_weight8: torch.Tensor, text_weight_scale: torch.Tensor, text_bias: Optional[torch.Tensor],
                     out_dtype: torch.dtype) -> torch.Tensor:
    """`joined_linear` of float8 rows through float8 layers (pipeline.blocks.layers.Fp8Linear): image8
    [B, S_i, K] with its rows' scales [B * S_i, 1], text8 [B, S_t, K] with [B * S_t, 1], each weight8 [N, K]
    with its scales [1, N] -> [B, S_i + S_t, N] in out_dtype, one torch._scaled_mm per sample and stream."""
    out = _joined(image8, text8, weight8.shape[0], out_dtype)
    split = image8.shape[1]
    for b in range(image8.shape[0]):
        _scaled_into(out[b, :split], image8, image_scale, b, weight8, weight_scale, bias)
        _scaled_into(out[b, split:], text8, text_scale, b, text_weight8, text_weight_scale, text_bias)
    return out


@joined_scaled_mm.register_fake
def _(image8, image_scale, text8, text_scale, weight8, weight_scale, bias, text_weight8, text_weight_scale, text_bias,
      out_dtype):
    return _joined(image8, text8, weight8.shape[0], out_dtype)
