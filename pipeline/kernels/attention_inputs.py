"""Flux's attention inputs: its queries and keys RMS-normalized, joined (text, then image tokens) and
rotated, straight from the projections' outputs, by one Triton kernel, in the model's dtype
(kernels.fuse_qk_norm: `rotated_qk` op) or quantized to float8 with the values quantized and
transposed too (kernels.fp8_attention: `fp8_attention_inputs` op, two kernels). Flux's own blocks
(pipeline.blocks.flux) call them with each attention's norms' weights [4, D]: queries, keys, text
queries, text keys (a single block's text rows repeat the image's).

What the kernels replace (`rotated_reference` and `reference`, which the CPU runs): each head's RMS
norm of the queries and keys (the text's norms for a double block's text tokens), the text and image
tokens joined, diffusers' rotary embedding, and for float8 the quantization of
pipeline/kernels/fp8_attention.py: the queries and keys divided by the module's fixed scales, the
values by one scale per (row, head, block of `V_BLOCK` tokens) from their absolute maximum there,
stored [B, H, D, S]. Compiled, those ops are several inductor kernels that read the projections more
than once and copy the joined tokens; here two:

- `qk_kernel`, per block of tokens and a few heads: reads the queries and keys where the projections
  wrote them (text or image), normalizes and rotates them, rounding to the model's dtype where the
  model does (after the norm's weight, after the rotation), and writes them, as float8 or in the
  model's dtype; the rotary embedding's cos and sin are read once for those heads, and the next
  head's queries and keys while one head's are computed. It reads and writes words of two values,
  a rotated pair (`rounding.pairs`): splitting a row into its even and odd values instead passes
  them through shared memory;
- `v_kernel`, per block of `V_BLOCK` tokens of one (row, head): reads the values once, takes their
  absolute maximum, writes the block's scale and the values divided by it, transposed (tokens
  contiguous). A block's scale needs no other block's values: one pass, no second kernel.

The values' scales round as torch's do on the GPU (the same bytes); the queries and keys are
multiplied by their scales' inverse (a division's result but for a rare last bit), and so are the
values (as `reference` computes them: the same bytes). The
float8 casts saturate at +-448, as torch's clamps before its casts do. Block sizes and warps are
constants: every process computes a value the same way, and a row's values do not depend on the
batch's other rows.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, rounding

QK_BLOCK, WARPS = 8, 4  # qk_kernel's tokens per program and warps
# tokens per value scale: v_kernel's block, a multiple of the attention kernel's key blocks
V_BLOCK, V_WARPS = 128, 8
SETTING = f"inputs-pairs-t{QK_BLOCK}-w{WARPS}-vb{V_BLOCK}-w{V_WARPS}"  # in the kernel digest: fuse_qk_norm's, part of fp8_attention's


def rotated_reference(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, heads: int,
                      eps: float):
    """The torch ops of diffusers' Flux attention before its SDPA call: per head the RMS norms, the text
    and image tokens joined, the rotary embedding -> queries, keys, values [B, S, H, D] (values None:
    None)."""
    from diffusers.models.embeddings import apply_rotary_emb

    def heads_of(t):
        return t.unflatten(-1, (heads, -1))

    dim = query.shape[-1] // heads
    query, key = (F.rms_norm(heads_of(t), (dim,), w, eps)
                  for t, w in ((query, norm_weights[0]), (key, norm_weights[1])))
    value = None if value is None else heads_of(value)
    if text_query is not None:
        text_q, text_k = (F.rms_norm(heads_of(t), (dim,), w, eps)
                          for t, w in ((text_query, norm_weights[2]), (text_key, norm_weights[3])))
        query, key = torch.cat([text_q, query], dim=1), torch.cat([text_k, key], dim=1)
        value = None if value is None else torch.cat([heads_of(text_value), value], dim=1)
    query, key = (apply_rotary_emb(t, (cos, sin), sequence_dim=1) for t in (query, key))
    return query, key, value


def reference(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, qk_scales,
              heads: int, eps: float):
    """The torch ops the float8 kernels replace (see the module's docstring) -> q8, k8 [B, S, H, D]
    float8, v8t [B, H, D, S] float8, v_scale [B, H, blocks of V_BLOCK tokens] float32."""
    query, key, value = rotated_reference(query, key, value, text_query, text_key, text_value, norm_weights, cos,
                                          sin, heads, eps)
    q8, k8 = quantize_qk(query, key, qk_scales)
    v8t, v_scale = quantize_values(value)
    return q8, k8, v8t, v_scale


def quantize_qk(query: torch.Tensor, key: torch.Tensor, qk_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated queries and keys divided by their fixed scales, as float8."""
    return tuple((t.float() / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8) for t, s in ((query, qk_scales[0]),
                                                                                          (key, qk_scales[1])))


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v [B, S, H, D] -> (float8 [B, H, D, S] contiguous, scales float32 [B, H, blocks]): one scale per
    row, head and block of V_BLOCK tokens (the last one partial), from the block's absolute maximum."""
    batch, tokens, heads, dim = v.shape
    blocks = -(-tokens // V_BLOCK)
    padded = torch.nn.functional.pad(v.abs(), (0, 0, 0, 0, 0, blocks * V_BLOCK - tokens))
    amax = padded.view(batch, blocks, V_BLOCK, heads, dim).amax(dim=(2, 4)).float()  # [B, blocks, H]
    scale = amax.clamp(min=fp8.MIN_AMAX) / fp8.FP8_MAX
    # times the inverse of each scale (as the values' Triton kernel computes them)
    v8 = (v.float() * token_scales(scale.reciprocal(), tokens, 1)[..., None]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return v8.permute(0, 2, 3, 1).contiguous(), scale.transpose(1, 2).contiguous()


def token_scales(scale: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """Scales per block of V_BLOCK tokens along `dim` -> each token's scale along it."""
    return scale.repeat_interleave(V_BLOCK, dim=dim).narrow(dim, 0, tokens)



@torch.library.custom_op("bcg::rotated_qk", mutates_args=())
def rotated_qk_op(query: torch.Tensor, key: torch.Tensor, text_query: torch.Tensor | None,
                  text_key: torch.Tensor | None, norm_weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  heads: int, eps: float, qk_scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The projections as fp8_attention_inputs takes them -> the normalized, joined and rotated queries
    and keys [B, S, H, D] in the projections' dtype (`rotated_reference`'s), or with `qk_scales` as
    float8 divided by them (`reference`'s). An operator torch.compile calls as it is."""
    if query.device.type != "cuda":
        q, k, _ = rotated_reference(query, key, None, text_query, text_key, None, norm_weights, cos, sin, heads, eps)
        return (q, k) if qk_scales is None else quantize_qk(q, k, qk_scales)
    return rotated_qk(query, key, text_query, text_key, norm_weights, cos, sin, qk_scales, heads, eps)


@rotated_qk_op.register_fake
def _(query, key, text_query, text_key, norm_weights, cos, sin, heads, eps, qk_scales=None):
    batch, tokens = query.shape[0], query.shape[1] + (0 if text_query is None else text_query.shape[1])
    q = query.new_empty((batch, tokens, heads, query.shape[-1] // heads),
                        dtype=query.dtype if qk_scales is None else fp8.FP8)
    return q, torch.empty_like(q)


@torch.library.custom_op("bcg::fp8_attention_inputs", mutates_args=())
def fp8_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         text_query: torch.Tensor | None, text_key: torch.Tensor | None,
                         text_value: torch.Tensor | None, norm_weights: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, qk_scales: torch.Tensor, heads: int,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The image's (or a single block's) projections [B, S_i, H*D], a double block's text projections
    [B, S_t, H*D] (else None), the norms' weights [4, D] (queries, keys, text queries, text keys), the
    rotary embedding's cos and sin [S_t + S_i, D] -> q8, k8, v8t, v_scale [B, H, blocks of V_BLOCK
    tokens] (`reference`). An operator
    torch.compile calls as it is."""
    if query.device.type != "cuda":
        return reference(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, qk_scales,
                         heads, eps)
    return _triton(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, qk_scales, heads, eps)


@fp8_attention_inputs.register_fake
def _(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, qk_scales, heads, eps):
    batch, tokens = query.shape[0], query.shape[1] + (0 if text_query is None else text_query.shape[1])
    dim = query.shape[-1] // heads
    q8 = query.new_empty((batch, tokens, heads, dim), dtype=fp8.FP8)
    return (q8, torch.empty_like(q8), query.new_empty((batch, heads, dim, tokens), dtype=fp8.FP8),
            query.new_empty((batch, heads, -(-tokens // V_BLOCK)), dtype=torch.float32))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    round_to = rounding.round_to()
    unpair, pair_to = rounding.pairs()

    @triton.jit
    def load_tokens(IMG, TXT, img_b, img_s, txt_b, txt_s, b, toks, ok, cols, S_TXT, TEXT: tl.constexpr):
        """[tokens, cols] of the joined tokens: the text's first (with TEXT), then the image's; 0 past the end."""
        if TEXT:
            is_txt = toks < S_TXT
            x = tl.load(IMG + b * img_b + (toks - S_TXT)[:, None] * img_s + cols[None, :],
                        mask=(ok & ~is_txt)[:, None], other=0)
            x += tl.load(TXT + b * txt_b + toks[:, None] * txt_s + cols[None, :], mask=(ok & is_txt)[:, None],
                         other=0)
        else:
            x = tl.load(IMG + b * img_b + toks[:, None] * img_s + cols[None, :], mask=ok[:, None], other=0)
        return x

    @triton.jit
    def weight_pairs(W, toks, words, S_TXT, D: tl.constexpr, TEXT: tl.constexpr):
        """The norm's weight for each token's even and odd dimensions [tokens, D / 2] each: W's row (the
        image's norm), or for text tokens the row two below it (the text's norm of the same queries or
        keys)."""
        even, odd = tl.load(W + 2 * words).to(tl.float32)[None, :], tl.load(W + 2 * words + 1).to(tl.float32)[None, :]
        if TEXT:
            is_txt = (toks < S_TXT)[:, None]
            even = tl.where(is_txt, tl.load(W + 2 * D + 2 * words).to(tl.float32)[None, :], even)
            odd = tl.where(is_txt, tl.load(W + 2 * D + 2 * words + 1).to(tl.float32)[None, :], odd)
        return even, odd

    @triton.jit
    def normed_rotated(x, w_even, w_odd, cos_even, cos_odd, sin_even, sin_odd, eps, D: tl.constexpr,
                       DTYPE: tl.constexpr):
        """One head's queries or keys, words of two values of DTYPE [tokens, D / 2]: the RMS norm times its
        weight (`weight_pairs`; fp32, rounded to DTYPE), then the rotation x cos + rotated(x) sin,
        rotated(x) = (-x[1], x[0], -x[3], x[2], ...) (fp32, not yet rounded) -> its even and its odd
        dimensions, fp32 [tokens, D / 2] each."""
        even, odd = unpair(x, DTYPE)
        r = tl.math.rsqrt(tl.sum(even * even + odd * odd, 1) / D + eps)[:, None]
        even, odd = round_to(even * r * w_even, DTYPE), round_to(odd * r * w_odd, DTYPE)
        return even * cos_even - odd * sin_even, odd * cos_odd + even * sin_odd

    @triton.jit
    def written(even, odd, inverse, DTYPE: tl.constexpr, QUANT: tl.constexpr):
        """The rotated pairs as the words stored: rounded to DTYPE, with QUANT times `inverse` as float8."""
        if QUANT:
            words = pair_to(round_to(even, DTYPE) * inverse, round_to(odd, DTYPE) * inverse, tl.float8e4nv)
        else:
            words = pair_to(even, odd, DTYPE)
        return words

    @triton.jit
    def qk_kernel(Q, K, TQ, TK, W, COS, SIN, SCALES, Q8, K8, q_b, q_s, k_b, k_s, tq_b, tq_s, tk_b, tk_s,
                  S_TXT, S, H, eps, D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, TEXT: tl.constexpr,
                  QUANT: tl.constexpr, DTYPE: tl.constexpr):
        """Every tensor but W and SCALES as words of two values (strides in words): the projections of
        DTYPE, COS and SIN of float32, the outputs of float8 (QUANT: divided by SCALES) or DTYPE."""
        b = tl.program_id(2).to(tl.int64)
        toks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = toks < S
        words = tl.arange(0, D // 2)
        q_inverse, k_inverse = 1.0, 1.0
        if QUANT:
            q_inverse, k_inverse = tl.math.div_rn(1.0, tl.load(SCALES)), tl.math.div_rn(1.0, tl.load(SCALES + 1))
        at = toks[:, None] * (D // 2) + words[None, :]  # once for HEADS heads
        cos_even, cos_odd = unpair(tl.load(COS + at, mask=ok[:, None], other=0), tl.float32)
        sin_even, sin_odd = unpair(tl.load(SIN + at, mask=ok[:, None], other=0), tl.float32)
        qw_even, qw_odd = weight_pairs(W, toks, words, S_TXT, D, TEXT)
        kw_even, kw_odd = weight_pairs(W + D, toks, words, S_TXT, D, TEXT)
        cols = tl.program_id(1) * HEADS * (D // 2) + words  # the first head's words
        q = load_tokens(Q, TQ, q_b, q_s, tq_b, tq_s, b, toks, ok, cols, S_TXT, TEXT)
        k = load_tokens(K, TK, k_b, k_s, tk_b, tk_s, b, toks, ok, cols, S_TXT, TEXT)
        for i in tl.range(HEADS):
            # the next head's words are read while this head's are computed and written
            cols += D // 2
            more = ok & (i + 1 < HEADS)
            q_next = load_tokens(Q, TQ, q_b, q_s, tq_b, tq_s, b, toks, more, cols, S_TXT, TEXT)
            k_next = load_tokens(K, TK, k_b, k_s, tk_b, tk_s, b, toks, more, cols, S_TXT, TEXT)
            h = tl.program_id(1) * HEADS + i
            out = (b * S + toks)[:, None] * (H * D // 2) + h * (D // 2) + words[None, :]  # [B, S, H, D / 2]
            q_even, q_odd = normed_rotated(q, qw_even, qw_odd, cos_even, cos_odd, sin_even, sin_odd, eps, D, DTYPE)
            tl.store(Q8 + out, written(q_even, q_odd, q_inverse, DTYPE, QUANT), mask=ok[:, None])
            k_even, k_odd = normed_rotated(k, kw_even, kw_odd, cos_even, cos_odd, sin_even, sin_odd, eps, D, DTYPE)
            tl.store(K8 + out, written(k_even, k_odd, k_inverse, DTYPE, QUANT), mask=ok[:, None])
            q, k = q_next, k_next

    @triton.jit
    def v_kernel(V, TV, V8T, VS, v_b, v_s, tv_b, tv_s, S_TXT, S, H, BLOCKS, inverse_max, min_amax,
                 D: tl.constexpr, BLOCK: tl.constexpr, TEXT: tl.constexpr):
        """One block of tokens of one (row, head): the scale of its absolute maximum, the values divided by
        it, written transposed."""
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = bh % H
        toks = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = toks < S
        dims = tl.arange(0, D)
        v = load_tokens(V, TV, v_b, v_s, tv_b, tv_s, b, toks, ok, h * D + dims, S_TXT, TEXT).to(tl.float32)
        # times the float32 1 / 448, as torch divides a tensor by a number on the GPU
        scale = tl.maximum(tl.max(tl.max(tl.abs(v), 1), 0), min_amax) * inverse_max
        v8 = (v * tl.math.div_rn(1.0, scale)).to(V8T.dtype.element_ty)  # the cast saturates at +-448
        tl.store(V8T + (bh.to(tl.int64) * D + dims[None, :]) * S + toks[:, None], v8, mask=ok[:, None])
        tl.store(VS + bh * BLOCKS + tl.program_id(0), scale)

    return qk_kernel, v_kernel


def rotated_qk(query, key, text_query, text_key, norm_weights, cos, sin, qk_scales, heads: int, eps: float):
    """qk_kernel on the GPU (or the Triton interpreter) -> the joined queries and keys [B, S, H, D]: float8
    divided by `qk_scales`, or with `qk_scales` None in the projections' dtype."""
    text = text_query is not None
    batch, image_tokens, width = query.shape
    text_tokens = text_query.shape[1] if text else 0
    tokens, dim = image_tokens + text_tokens, width // heads
    if cos.shape != (tokens, dim) or sin.shape != (tokens, dim):
        raise ValueError(f"attention_inputs: the rotary embedding's cos and sin must be [{tokens}, {dim}], "
                         f"got {list(cos.shape)} and {list(sin.shape)}")
    _check_rows(query, key, text_query, text_key)
    text_query, text_key = (text_query, text_key) if text else (query, key)
    cos, sin = (t.to(torch.float32).contiguous() for t in (cos, sin))
    q = torch.empty((batch, tokens, heads, dim), device=query.device,
                    dtype=query.dtype if qk_scales is None else fp8.FP8)
    k = torch.empty_like(q)
    heads_per_program = next(n for n in (4, 3, 2, 1) if heads % n == 0)
    words = [_words(t) for t in (query, key, text_query, text_key)]  # the kernel reads and writes pairs
    with torch.cuda.device(query.device) if query.is_cuda else nullcontext():
        _kernels()[0][(-(-tokens // QK_BLOCK), heads // heads_per_program, batch)](
            *words, norm_weights, _words(cos), _words(sin), norm_weights if qk_scales is None else qk_scales,
            _words(q), _words(k), *(w.stride(i) for w in words for i in (0, 1)), text_tokens, tokens, heads, eps,
            D=dim, BLOCK=QK_BLOCK, HEADS=heads_per_program, TEXT=text, QUANT=qk_scales is not None,
            DTYPE=_triton_dtype(query.dtype), num_warps=WARPS)
    return q, k


def _triton(query, key, value, text_query, text_key, text_value, norm_weights, cos, sin, qk_scales, heads: int,
            eps: float):
    q8, k8 = rotated_qk(query, key, text_query, text_key, norm_weights, cos, sin, qk_scales, heads, eps)
    batch, tokens, _, dim = q8.shape
    text_tokens = tokens - query.shape[1]
    _check_rows(value, text_value)
    text_value = value if text_value is None else text_value
    blocks = -(-tokens // V_BLOCK)
    v8t = torch.empty((batch, heads, dim, tokens), device=query.device, dtype=fp8.FP8)
    v_scale = torch.empty((batch, heads, blocks), device=query.device, dtype=torch.float32)
    with torch.cuda.device(query.device) if query.is_cuda else nullcontext():
        _kernels()[1][(blocks, batch * heads)](
            value, text_value, v8t, v_scale, value.stride(0), value.stride(1), text_value.stride(0),
            text_value.stride(1), text_tokens, tokens, heads, blocks, 1.0 / fp8.FP8_MAX, fp8.MIN_AMAX, D=dim,
            BLOCK=V_BLOCK, TEXT=text_tokens > 0, num_warps=V_WARPS)
    return q8, k8, v8t, v_scale


def _words(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] as words of two values [..., n / 2] (float32: int64, 16 bits: int32, float8: int16)."""
    return t.view({4: torch.int64, 2: torch.int32, 1: torch.int16}[t.element_size()])


def _triton_dtype(dtype: torch.dtype):
    """The projections' dtype as Triton names it, or a refusal that names the ones the kernel takes."""
    import triton.language as tl

    known = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
    if dtype not in known:
        raise ValueError(f"attention_inputs: the projections must be bfloat16, float16 or float32, got {dtype}")
    return known[dtype]


def _check_rows(*projections) -> None:
    """The kernels read each token's row of a projection as one contiguous run (None: absent)."""
    if any(t is not None and t.stride(-1) != 1 for t in projections):
        raise ValueError("attention_inputs: the projections' last dimension must be contiguous")
