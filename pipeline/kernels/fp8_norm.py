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

The CPU runs `reference`, the torch ops the kernel replaces; a norm with an affine weight, its own
embedding or a reader that is not a float8 layer keeps its forward.
"""

from __future__ import annotations

import functools
import logging
from types import MethodType

import torch
import torch.nn.functional as F

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.kernels import fp8, norm, rounding
from pipeline.kernels.fp8_gelu import row_blocks
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

WARPS = 4
SETTING = f"triton-row-warps{WARPS}-two-blocks"  # in the job's kernel digest: another setting, other bytes


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a known device: float8 tensor cores and Triton, or a refusal."""
    if kernels.fp8_norm and device is not None:
        fp8.check_fp8(device, "kernels.fp8_norm=true")
        if torch.device(device).type == "cuda":
            norm.check_triton("kernels.fp8_norm=true runs Flux's modulated norms and their float8 quantization",
                              "kernels.fp8_norm=false")


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fp8_norms": n} with kernels.fp8_norm (after fp8.apply), else {}."""
    if not kernels.fp8_norm:
        return {}
    norms = norms_to_rows(adapter.transformer)
    log.info("kernels: %d modulated layer norms write float8 rows for their float8 layers (Triton, %s)", norms, SETTING)
    return {"fp8_norms": norms}


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

    round_to = rounding.round_to()

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
        amax = tl.max(tl.abs(y_head), axis=0)
        if TAIL > 0:
            y_tail = modulated(x_tail, load(SHIFT + b * shift_b, tail, tail_ok, True),
                               load(SCALE + b * scale_b, tail, tail_ok, True), mean, rstd, dtype)
            amax = tl.maximum(amax, tl.max(tl.where(tail_ok, tl.abs(y_tail), 0.0), axis=0))
        row_scale = tl.maximum(amax, min_amax) / fp8_max
        inverse = 1.0 / row_scale
        q_row = Q + row * n_cols
        # the float8 cast saturates at +-448: a product rounded past it needs no clamp
        tl.store(q_row + head, (y_head * inverse).to(Q.dtype.element_ty))
        if TAIL > 0:
            tl.store(q_row + tail, (y_tail * inverse).to(Q.dtype.element_ty), mask=tail_ok)
        tl.store(QS + row, row_scale)

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


def rows_forward(module: torch.nn.Module, x, *args, emb: torch.Tensor | None = None, **kwargs) -> tuple:
    """diffusers' AdaLayerNormZero / AdaLayerNormZeroSingle forward with its normed output as float8
    rows (`fp8.QuantizedRows`): the same modulation chunks after it. `x`: the rows, or (text, image)
    rows to normalize as if joined (a single block's tokens, not copied together first)."""
    emb = module.linear(module.silu(emb))
    text, image = x if isinstance(x, tuple) else (None, x)
    shift, scale, *rest = emb.chunk(emb.shape[1] // image.shape[-1], dim=1)  # 6 (AdaLayerNormZero) or 3 (Single)
    x8, row_scale = torch.ops.bcg.modulated_norm_rows(image, text, shift, scale, module.norm.eps)
    return (fp8.QuantizedRows(x8, row_scale, image.dtype), *rest)


def double_forward(block: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                   temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                   joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' FluxTransformerBlock.forward (0.42) with each stream's residual add, second norm and
    its modulation as one kernel (`residual_norm_rows`) whose float8 rows its feed-forward multiplies:
    the same arguments and results."""
    norm_hidden, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(hidden_states, emb=temb)
    norm_context, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(encoder_hidden_states, emb=temb)
    outputs = block.attn(hidden_states=norm_hidden, encoder_hidden_states=norm_context,
                         image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    if len(outputs) != 2:
        raise NotImplementedError("kernels.fp8_norm's double block takes the attention's image and text outputs only "
                                  "(no IP-adapter output)")
    out = []
    for rows, update, gate, shift, scale, ff, gate_ff, norm2 in (
            (hidden_states, outputs[0], gate_msa, shift_mlp, scale_mlp, block.ff, gate_mlp, block.norm2),
            (encoder_hidden_states, outputs[1], c_gate_msa, c_shift_mlp, c_scale_mlp, block.ff_context, c_gate_mlp,
             block.norm2_context)):
        added, x8, row_scale = torch.ops.bcg.residual_norm_rows(rows, update, gate, shift, scale, norm2.eps)
        out.append(added + gate_ff.unsqueeze(1) * ff(fp8.QuantizedRows(x8, row_scale, rows.dtype)))
    hidden_states, encoder_hidden_states = out
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def norms_to_rows(transformer: torch.nn.Module) -> int:
    """Every Flux block's first norm whose every reader is a float8 layer, with `rows_forward` and
    flagged `fp8.ROWS_OUT`; every double block whose second norms feed float8 layers, with
    `double_forward` (this instance only) -> norms changed (none: refused)."""
    changed = 0
    for name in fp8.BLOCKS:
        for block in getattr(transformer, name, ()):
            for norm_module, readers in _first_norms(block):
                if _plain_modulated(norm_module) and readers and all(map(fp8.is_fp8, readers)):
                    norm_module.forward = MethodType(rows_forward, norm_module)
                    setattr(norm_module, fp8.ROWS_OUT, True)
                    changed += 1
            if _second_norms_to_rows(block):
                block.forward = MethodType(double_forward, block)
                changed += 2
    if not changed:
        raise UserError("kernels.fp8_norm=true: this transformer has no Flux modulated norm read by float8 layers only "
                        "(it needs kernels.fp8=true and Flux's blocks); set kernels.fp8_norm=false")
    return changed


def _first_norms(block: torch.nn.Module) -> list[tuple[torch.nn.Module, list]]:
    """(norm, the layers that read its output) for a Flux block's first norms: a double block's norm1
    (the attention's query, key and value projections of the image) and norm1_context (the text's); a
    single block's norm (the attention's projections and the MLP's up-projection)."""
    attn = getattr(block, "attn", None)
    if attn is None:
        return []
    image = [attn.to_qkv] if getattr(attn, "fused_projections", False) else [attn.to_q, attn.to_k, attn.to_v]
    if hasattr(block, "norm1"):  # a double block
        text = ([getattr(attn, "to_added_qkv", None)] if getattr(attn, "fused_projections", False)
                else [getattr(attn, name, None) for name in ("add_q_proj", "add_k_proj", "add_v_proj")])
        return [(block.norm1, image), (getattr(block, "norm1_context", None), text)]
    if hasattr(block, "norm") and hasattr(block, "proj_mlp"):  # a single block
        return [(block.norm, image + [block.proj_mlp])]
    return []


def _second_norms_to_rows(block: torch.nn.Module) -> bool:
    """A Flux double block whose second norms (plain LayerNorms, modulated in its forward) feed
    feed-forwards whose first layer is float8 (`double_forward` can take it)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformerBlock

    def fp8_first(ff) -> bool:
        net = getattr(ff, "net", None)
        return isinstance(net, torch.nn.ModuleList) and fp8.is_fp8(getattr(net[0], "proj", None))

    return (type(block) is FluxTransformerBlock and _plain(block.norm2) and _plain(block.norm2_context)
            and fp8_first(block.ff) and fp8_first(block.ff_context))


def _plain_modulated(module: object) -> bool:
    """A norm of diffusers' AdaLayerNormZero kind without an embedding of its own: a LayerNorm without
    affine weights, modulated by shift and scale, the first two chunks of its projection."""
    return (_plain(getattr(module, "norm", None)) and getattr(module, "emb", None) is None
            and hasattr(module, "linear") and hasattr(module, "silu"))


def _plain(layer_norm: object) -> bool:
    """A LayerNorm without affine weights (Flux's)."""
    return isinstance(layer_norm, torch.nn.LayerNorm) and layer_norm.weight is None and layer_norm.bias is None

