"""kernels.fp8_norm: Flux's modulated layer norms that feed float8 layers write float8 rows, the norm,
its modulation and the rowwise quantization in one Triton kernel.

A Flux block's norms compute LN(x) * (1 + scale) + shift, and only the block's float8 layers read
the result, each quantizing it row by row: a double block's first norms (AdaLayerNormZero, for its
image and its text tokens: the attention's projections) and its second ones (plain LayerNorms that
its forward modulates, after adding the gated attention output to the residual stream: the
feed-forwards' up-projections), a single block's norm (AdaLayerNormZeroSingle: the attention's
projections and the MLP's up-projection). Compiled, inductor fuses each norm, its modulation and
that quantization into one kernel, but it holds a row per program and runs well below the memory's
rate. Here one program reads a row once (text or image tokens where they lie: a single block's
joined tokens are not copied together first; for a second norm the residual and the attention's
output, writing their gated sum too), computes the norm in float32 and the modulation as diffusers'
bf16 ops round it (`reference`), takes the row's absolute maximum and writes the float8 row and its
scale (`fp8.QuantizedRows`), which the float8 layers multiply as they are. The row is two blocks of
powers of two, as in the GELU's kernel (Flux's 3,072 channels are 2,048 + 1,024). Block sizes and
warps are constants (`SETTING`): every process reduces a row the same way.

Flux's own blocks (pipeline.blocks.flux) call it where only float8 layers read a norm's output. The
CPU runs `reference`, the torch ops the kernel replaces.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, rounding
from pipeline.kernels.fp8_gelu import row_blocks

WARPS = 4
SETTING = f"triton-row-warps{WARPS}-two-blocks"  # in the job's kernel digest: another setting, other bytes


def reference(image: torch.Tensor, text: torch.Tensor | None, shift: torch.Tensor, scale: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, as diffusers' norm and fp8's quantization do: the text rows [B, S_t, C]
    (or None) then the image rows [B, S_i, C] joined, LN(x) * (1 + scale) + shift in their dtype (shift,
    scale [B, C]), quantized row by row -> (float8 [B, S, C], scales float32 [B * S, 1])."""
    x = image if text is None else torch.cat([text, image], dim=1)
    y = F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]
    x8, row_scale = fp8.quantize_rows(y.reshape(-1, y.shape[-1]))
    return x8.view(y.shape), row_scale


@torch.library.custom_op("bcg::modulated_norm_rows", mutates_args=())
def modulated_norm_rows(image: torch.Tensor, text: torch.Tensor | None, shift: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference`'s result; on CUDA one Triton kernel. An operator torch.compile calls as it is."""
    if image.device.type != "cuda":
        return reference(image, text, shift, scale, eps)
    return _triton(image, text, shift, scale, eps)


@modulated_norm_rows.register_fake
def _(image, text, shift, scale, eps):
    batch, tokens, channels = image.shape
    tokens += 0 if text is None else text.shape[1]
    return (image.new_empty((batch, tokens, channels), dtype=fp8.FP8),
            image.new_empty((batch * tokens, 1), dtype=torch.float32))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    round_to, store_float8 = rounding.round_to(), rounding.store_float8()

    @triton.jit
    def modulated(x, shift, scale, mean, rstd, dtype):
        """LN(x) * (1 + scale) + shift, each op rounded to `dtype` as diffusers' bf16 ops round it (fp32 out)."""
        normed = round_to((x - mean) * rstd, dtype)
        return round_to(round_to(normed * round_to(1.0 + scale, dtype), dtype) + shift, dtype)

    @triton.jit
    def load(ptr, cols, ok, MASKED: tl.constexpr):
        """ptr[cols] as fp32; MASKED: 0 where not ok."""
        if MASKED:
            return tl.load(ptr + cols, mask=ok, other=0.0).to(tl.float32)
        return tl.load(ptr + cols).to(tl.float32)

    @triton.jit
    def residual_added(x_row, u_row, gate, h_row, cols, ok, MASKED: tl.constexpr, RESIDUAL: tl.constexpr, dtype):
        """The row's values as fp32; RESIDUAL: x + gate * u as diffusers' bf16 ops round it, stored to h too."""
        x = load(x_row, cols, ok, MASKED)
        if RESIDUAL:
            u = load(u_row, cols, ok, MASKED)
            x = round_to(x + round_to(load(gate, cols, ok, MASKED) * u, dtype), dtype)
            if MASKED:
                tl.store(h_row + cols, x.to(dtype), mask=ok)
            else:
                tl.store(h_row + cols, x.to(dtype))
        return x

    @triton.jit
    def norm_rows_kernel(IMG, TXT, SHIFT, SCALE, Q, QS, U, GATE, H, img_b, img_s, txt_b, txt_s, shift_b, scale_b,
                         u_b, u_s, gate_b, S, S_TXT, n_cols, eps, fp8_max, min_amax, HEAD: tl.constexpr,
                         TAIL: tl.constexpr, RESIDUAL: tl.constexpr):
        """RESIDUAL: the rows are IMG + GATE * U (no text rows), written to H [B * S, n_cols] before the norm."""
        row = tl.program_id(0).to(tl.int64)
        b = row // S
        t = row % S
        if t < S_TXT:
            x_row = TXT + b * txt_b + t * txt_s
        else:
            x_row = IMG + b * img_b + (t - S_TXT) * img_s
        u_row, gate, h_row = U + b * u_b + t * u_s, GATE + b * gate_b, H + row * n_cols
        dtype: tl.constexpr = IMG.dtype.element_ty
        head = tl.arange(0, HEAD)
        x_head = residual_added(x_row, u_row, gate, h_row, head, None, False, RESIDUAL, dtype)
        total = tl.sum(x_head, axis=0)
        if TAIL > 0:
            tail = HEAD + tl.arange(0, TAIL)
            tail_ok = tail < n_cols
            x_tail = residual_added(x_row, u_row, gate, h_row, tail, tail_ok, True, RESIDUAL, dtype)
            total += tl.sum(x_tail, axis=0)
        mean = total / n_cols
        centred = x_head - mean
        squares = tl.sum(centred * centred, axis=0)
        if TAIL > 0:
            centred_tail = tl.where(tail_ok, x_tail - mean, 0.0)
            squares += tl.sum(centred_tail * centred_tail, axis=0)
        rstd = tl.math.rsqrt(squares / n_cols + eps)
        y_head = modulated(x_head, load(SHIFT + b * shift_b, head, None, False), load(SCALE + b * scale_b, head, None, False),
                           mean, rstd, dtype)
        y_tail, tail_at, tail_mask = y_head, head, None
        if TAIL > 0:
            y_tail = modulated(x_tail, load(SHIFT + b * shift_b, tail, tail_ok, True),
                               load(SCALE + b * scale_b, tail, tail_ok, True), mean, rstd, dtype)
            tail_at, tail_mask = tail, tail_ok
        store_float8(Q + row * n_cols, QS, y_head, head, None, y_tail, tail_at, tail_mask, row + tl.arange(0, 1),
                     None, fp8_max, min_amax, AXIS=0, TAIL=TAIL)

    return norm_rows_kernel


def _triton(image, text, shift, scale, eps: float, update=None, gate=None,
            warps: int = WARPS) -> tuple[torch.Tensor, ...]:
    """The kernel on CUDA rows whose last dimension is contiguous -> (float8 rows, scales), or with
    `update` and `gate` (no text) (image + gate * update, float8 rows, scales); `warps`: its fixed
    choice (a benchmark's to vary)."""
    batch, image_tokens, channels = image.shape
    text_tokens = 0 if text is None else text.shape[1]
    if any(t is not None and t.stride(-1) != 1 for t in (image, text, shift, scale, update, gate)):
        raise ValueError("modulated_norm_rows: the rows', shifts', scales' and gates' last dimension must be contiguous")
    text = image if text is None else text
    residual = update is not None
    update, gate = (update, gate) if residual else (image, shift)  # unused pointers
    tokens = image_tokens + text_tokens
    new = functools.partial(torch.empty, device=image.device)
    q, row_scale = new((batch, tokens, channels), dtype=fp8.FP8), new((batch * tokens, 1), dtype=torch.float32)
    added = new((batch, tokens, channels), dtype=image.dtype) if residual else q
    if q.numel():
        head, tail = row_blocks(channels)
        with torch.cuda.device(image.device):
            _kernel()[(batch * tokens,)](image, text, shift, scale, q, row_scale, update, gate, added, image.stride(0),
                                         image.stride(1), text.stride(0), text.stride(1), shift.stride(0),
                                         scale.stride(0), update.stride(0), update.stride(1), gate.stride(0), tokens,
                                         text_tokens, channels, eps, fp8.FP8_MAX, fp8.MIN_AMAX, HEAD=head, TAIL=tail,
                                         RESIDUAL=residual, num_warps=warps)
    return (added, q, row_scale) if residual else (q, row_scale)


def residual_reference(rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                       scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the kernel computes for a double block's second norm, as diffusers' block does: rows +
    gate * update (gate [B, C]), then `reference` of that -> (the sum, float8 rows, scales)."""
    added = rows + gate.unsqueeze(1) * update
    return (added, *reference(added, None, shift, scale, eps))


@torch.library.custom_op("bcg::residual_norm_rows", mutates_args=())
def residual_norm_rows(rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                       scale: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`residual_reference`'s result; on CUDA the same kernel as modulated_norm_rows. An operator
    torch.compile calls as it is."""
    if rows.device.type != "cuda":
        return residual_reference(rows, update, gate, shift, scale, eps)
    return _triton(rows, None, shift, scale, eps, update=update, gate=gate)


@residual_norm_rows.register_fake
def _(rows, update, gate, shift, scale, eps):
    batch, tokens, channels = rows.shape
    return (rows.new_empty(rows.shape), rows.new_empty(rows.shape, dtype=fp8.FP8),
            rows.new_empty((batch * tokens, 1), dtype=torch.float32))
