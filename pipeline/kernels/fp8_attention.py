"""kernels.fp8_attention: Flux's attention with both of its matmuls in float8, one Triton kernel.

Flux normalizes its queries and keys (an RMS norm per head, then the rotary embedding), which bounds
them: after the norm a head's values have a root mean square of 1, so no value exceeds sqrt(D)
times the norm's largest weight, and the rotation keeps that bound. The queries' and keys' float8
scales are those bounds / 448, computed once per attention module from its norms' weights
(`qk_scales`): the quantization is a multiply and a cast, and it cannot overflow. The values are
not normalized: one scale per (row, head, block of `attention_inputs.V_BLOCK` tokens) from their
absolute maximum there (`quantize_values`: one pass over the values, no maximum over all tokens
first), stored transposed ([B, H, D, S], tokens contiguous) as the float8 tensor cores read their
second operand. Norms, rotation and quantization run in the Triton kernels of
pipeline/kernels/attention_inputs.py, straight from the projections' outputs.

The kernel (`attention`) is a flash-attention forward: per block of queries it walks the keys in
blocks, keeps the running maximum and sum of the softmax in float32, and multiplies the
probabilities, scaled by 2^8 and cast to float8 e4m3, by the float8 values. Its running sum of those
products is kept in units of the current block's value scale: where the scale changes, the rescale
that the new maximum asks for takes the ratio of the two scales too (one multiply per row), and the
last block's scale multiplies the result. Block sizes and warps are
constants (`SETTING`): every process computes a row the same way. The blocks of queries, keys and
values are loaded by the GPU's tensor memory accelerator (TMA) where their layout allows it, else by
address (the same values, slower; said once). The CPU runs `reference`: the same quantized inputs,
dequantized, through float32 attention with unrounded probabilities.

Where the attention's output goes to float8 layers only (a double block's out-projections, a single
block's attention part of proj_out under kernels.split_out_proj), which would read it back to
quantize it, the kernel writes it as float8 rows itself (`fp8_attention_rows`), text and image rows
apart as the out-projections take them. An output is an average of the values, so no output exceeds
the largest value: one scale per batch row, the largest value scale of all its heads and blocks
(times `OUT_HEADROOM`), known before the kernel starts, where a rowwise quantization needs each row's
maximum first. A value below that bound keeps float8's relative precision down to about 2^-15 of it.
"""

from __future__ import annotations

import functools
import math
from contextlib import nullcontext

import torch

from pipeline.kernels import attention_inputs, fp8
from pipeline.kernels.attention_inputs import quantize_values, token_scales

FP8 = fp8.FP8
FP8_MAX = fp8.FP8_MAX
V_BLOCK = attention_inputs.V_BLOCK  # tokens per value scale
P_SHIFT = 8  # probabilities (at most 1) times 2^8 before the float8 cast: small ones keep their bits
BLOCK_M, BLOCK_N, WARPS, STAGES = 64, 128, 4, 3  # benchmarks/bench_fp8_attention.py times others
HEAD_DIMS = (32, 64, 128, 256)  # float8 tensor cores multiply at least 32 values; a block's width is a power of 2
# float8 outputs: scaled by the values' largest magnitude times this; the probabilities' float8 rounding
# (at most 2^-4 up) cannot take a row past it
OUT_HEADROOM = 1.125
# TMA or not: the same sums; with the inputs' kernels' own
SETTING = (f"triton-fa-m{BLOCK_M}-n{BLOCK_N}-w{WARPS}-s{STAGES}-p{P_SHIFT}-rows{OUT_HEADROOM}"
           f"+{attention_inputs.SETTING}")


def qk_scales(norm_weights: torch.Tensor) -> torch.Tensor:
    """An attention's norms' weights [4, D] (queries, keys, text queries, text keys) -> float32 [2]:
    the float8 scales of its queries and keys, sqrt(D) times the largest weight of their norms (the
    image's and, in a double block, the text's) / 448."""
    bound = norm_weights.detach().abs().float().view(2, 2, -1).amax(dim=(0, 2))  # [queries, keys]
    return (math.sqrt(norm_weights.shape[-1]) * bound / FP8_MAX).to(torch.float32)


def fp8_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Attention of [B, S, H, D] queries, keys and values (diffusers' layout), the queries and keys
    bounded by `scales` * 448 -> [B, S, H, D] in the queries' dtype."""
    q8 = (query.float() / scales[0]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    k8 = (key.float() / scales[1]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    v8t, v_scale = quantize_values(value)
    out = torch.ops.bcg.fp8_attention(q8, k8, v8t, scales, v_scale, 1.0 / math.sqrt(query.shape[-1]))
    return out.to(query.dtype)


def reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale: float) -> torch.Tensor:
    """The kernel's result in float32 from the dequantized inputs -> [B, S, H, D] bfloat16."""
    return _reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale).to(torch.bfloat16)


def _reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale: float) -> torch.Tensor:
    q = (q8.float() * qk_scales[0]).transpose(1, 2)  # [B, H, S, D]
    k = (k8.float() * qk_scales[1]).transpose(1, 2)
    v = (v8t.float() * token_scales(v_scale, v8t.shape[-1], 2)[:, :, None]).transpose(2, 3)
    out = torch.softmax(q @ k.transpose(2, 3) * softmax_scale, dim=-1) @ v  # not SDPA: the probe counts SDPA's calls
    return out.transpose(1, 2).contiguous()


def rows_reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale: float, text_tokens: int) -> tuple:
    """`fp8_attention_rows`' result from `reference`'s float32 attention -> text rows [B, S_t, H*D] and
    image rows [B, S - S_t, H*D] in float8, each with their scales [rows, 1]: every row of a batch row
    divided by that row's `output_scale`."""
    out = _reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale).flatten(2)
    scale = output_scale(v_scale)
    x8 = (out / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return tuple(part for rows in (x8[:, :text_tokens], x8[:, text_tokens:])
                 for part in (rows.clone(memory_format=torch.contiguous_format),
                              scale.repeat_interleave(rows.shape[1])[:, None]))


def output_scale(v_scale: torch.Tensor) -> torch.Tensor:
    """Value scales [B, H, blocks] -> each batch row's float8 output scale [B]: an attention output is
    an average of the values (|out| <= the largest |value| over the heads' tokens), here times
    OUT_HEADROOM, over 448."""
    return v_scale.amax(dim=(1, 2)) * OUT_HEADROOM


@torch.library.custom_op("bcg::fp8_attention_rows", mutates_args=())
def fp8_attention_rows(q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, qk_scales: torch.Tensor,
                       v_scale: torch.Tensor, softmax_scale: float,
                       text_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fp8_attention`'s inputs and the count of text tokens (the first ones) -> the attention as float8
    rows for float8 layers (`rows_reference`): text rows, their scales, image rows, their scales. An
    operator torch.compile calls as it is."""
    if q8.device.type != "cuda":
        return rows_reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale, text_tokens)
    return attention(q8, k8, v8t, qk_scales, v_scale, softmax_scale, text_tokens=text_tokens)


@fp8_attention_rows.register_fake
def _(q8, k8, v8t, qk_scales, v_scale, softmax_scale, text_tokens):
    batch, tokens, heads, dim = q8.shape
    return tuple(part for n in (text_tokens, tokens - text_tokens)
                 for part in (q8.new_empty((batch, n, heads * dim)), q8.new_empty((batch * n, 1), dtype=torch.float32)))


@torch.library.custom_op("bcg::fp8_attention", mutates_args=())
def fp8_attention(q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor, qk_scales: torch.Tensor,
                  v_scale: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Quantized queries and keys [B, S, H, D], values [B, H, D, S] (`fp8_sdpa`) -> attention
    [B, S, H, D] bfloat16. An operator torch.compile calls as it is."""
    if q8.device.type != "cuda":
        return reference(q8, k8, v8t, qk_scales, v_scale, softmax_scale)
    return attention(q8, k8, v8t, qk_scales, v_scale, softmax_scale)


@fp8_attention.register_fake
def _(q8, k8, v8t, qk_scales, v_scale, softmax_scale):
    return q8.new_empty(q8.shape, dtype=torch.bfloat16)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_attention_kernel(Q, K, V, QK_SCALES, VS, OT, OI, XST, XSI, Q_DESC, K_DESC, V_DESC,
                             q_b, q_s, q_h, k_b, k_s, k_h, v_b, v_h, v_d, vs_b, vs_h, ot_b, ot_s, oi_b, oi_s,
                             H, S, S_TXT, BLOCKS, scale_log2,
                             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, V_BLOCK: tl.constexpr,
                             SHIFT: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr, OUT8: tl.constexpr,
                             HEADROOM: tl.constexpr):
        """Rows below S_TXT go to OT, the others to OI (row r to its row r - S_TXT), each [B, rows, H * D];
        OUT8: in float8, divided by the batch row's output scale, which the programs of head 0 write to
        XST and XSI per row."""
        start_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        row_ok = rows < S
        # TMA: the descriptors' 2-D views, q and k [B*S, H*D], v [B*H*D, S]; a block past a row's tokens
        # reads the next row's (queries: not stored; keys: masked below) or zeros past the tensor's end
        if TMA:
            q = Q_DESC.load([(b * S + start_m * BLOCK_M).to(tl.int32), (h * D).to(tl.int32)])
        else:
            q = tl.load(Q + b * q_b + h * q_h + rows[:, None] * q_s + dims[None, :], mask=row_ok[:, None], other=0.0)
        # scores in the log2 domain: q8 . k8 times both scales, the softmax scale and log2(e)
        c = tl.load(QK_SCALES) * tl.load(QK_SCALES + 1) * scale_log2
        k_ptr = K + b * k_b + h * k_h + cols[None, :] * k_s + dims[:, None]  # [D, BLOCK_N]
        v_ptr = V + b * v_b + h * v_h + cols[:, None] + dims[None, :] * v_d  # [BLOCK_N, D], tokens contiguous
        vs_ptr = VS + b * vs_b + h * vs_h  # this (row, head)'s value scales, one per V_BLOCK tokens
        v_scale = tl.load(vs_ptr)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)  # in units of the current block's value scale
        for start_n in tl.range(0, S, BLOCK_N):
            col_ok = start_n + cols < S
            block_scale = tl.load(vs_ptr + start_n // V_BLOCK)
            if TMA:
                k = K_DESC.load([(b * S + start_n).to(tl.int32), (h * D).to(tl.int32)]).T
                v = V_DESC.load([(bh * D).to(tl.int32), start_n]).T
            elif EVEN:
                k = tl.load(k_ptr)
                v = tl.load(v_ptr)
            else:
                k = tl.load(k_ptr, mask=col_ok[None, :], other=0.0)
                v = tl.load(v_ptr, mask=col_ok[:, None], other=0.0)
            qk = tl.dot(q, k)
            if not EVEN:
                qk = tl.where(col_ok[None, :], qk, float("-inf"))
            # the scale c > 0 commutes with the maximum: one multiply per row, and one fused
            # multiply-add per score below
            m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(qk * c - (m_new - SHIFT)[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(V.dtype.element_ty), v, acc * (alpha * (v_scale / block_scale))[:, None])
            m_i = m_new
            v_scale = block_scale
            k_ptr += BLOCK_N * k_s
            v_ptr += BLOCK_N
        if OUT8:  # the largest value scale of this batch row (all heads, all blocks), times the headroom
            scales = tl.arange(0, 256)
            largest = tl.zeros([256], tl.float32)
            for start in tl.range(0, H * BLOCKS, 256):
                largest = tl.maximum(largest, tl.load(VS + b * vs_b + start + scales, mask=start + scales < H * BLOCKS,
                                                      other=0.0))
            x_scale = tl.max(largest, 0) * HEADROOM
            out = acc * (v_scale / (l_i * x_scale))[:, None]
        else:
            out = acc * (v_scale / l_i)[:, None]
        image = row_ok & (rows >= S_TXT)
        text = row_ok & (rows < S_TXT)
        columns = h * D + dims[None, :]
        tl.store(OI + b * oi_b + (rows - S_TXT)[:, None] * oi_s + columns, out.to(OI.dtype.element_ty),
                 mask=image[:, None])
        if S_TXT > 0:
            tl.store(OT + b * ot_b + rows[:, None] * ot_s + columns, out.to(OT.dtype.element_ty), mask=text[:, None])
        if OUT8:
            if h == 0:
                x_scales = tl.zeros([BLOCK_M], tl.float32) + x_scale
                tl.store(XSI + b * (S - S_TXT) + rows - S_TXT, x_scales, mask=image)
                tl.store(XST + b * S_TXT + rows, x_scales, mask=text)

    return fp8_attention_kernel


def attention(q8, k8, v8t, qk_scales, v_scale, softmax_scale: float, block_m: int = BLOCK_M, block_n: int = BLOCK_N,
              warps: int = WARPS, stages: int = STAGES, tma: bool = True, text_tokens: int | None = None):
    """The Triton kernel (CUDA, or the Triton interpreter on the CPU) -> [B, S, H, D] bfloat16, or with
    `text_tokens` `fp8_attention_rows`' four tensors; block sizes, warps and stages are its fixed
    choices (a benchmark's to vary). With `tma`, blocks of queries, keys and values are loaded by the
    GPU's tensor memory accelerator where their layout allows it (`tma_layout`), else by address: the
    same values, the same result."""
    batch, tokens, heads, dim = q8.shape
    if q8.stride(-1) != 1 or k8.stride(-1) != 1 or v8t.stride(-1) != 1 or not v_scale.is_contiguous():
        raise ValueError("fp8_attention: the last dimension of q8, k8 and v8t must be contiguous, and v_scale")
    blocks = -(-tokens // V_BLOCK)
    if V_BLOCK % block_n or v_scale.shape != (batch, heads, blocks):
        raise ValueError(f"fp8_attention: value scales [{batch}, {heads}, {blocks}] (one per {V_BLOCK} tokens, a "
                         f"multiple of the key block {block_n}), got {list(v_scale.shape)}")
    new = functools.partial(torch.empty, device=q8.device)
    if text_tokens is None:
        out = new((batch, tokens, heads * dim), dtype=torch.bfloat16)
        text = image = (out, out)  # the scales' pointers unused
        text_tokens = 0
    else:
        text, image = ((new((batch, n, heads * dim), dtype=FP8), new((batch * n, 1), dtype=torch.float32))
                       for n in (text_tokens, tokens - text_tokens))
    descriptors = (None, None, None)
    if tma:
        reason = tma_layout(q8, k8, v8t)
        if reason is None:
            descriptors = _descriptors(q8, k8, v8t, block_m, block_n)
        else:
            tma = False
            fp8.say_once(__name__, f"fp8_attention: blocks loaded by address, not by TMA ({reason}); the same result, "
                                   "slower")
    text_out = text if text_tokens else image  # no text rows: never written, any valid pointer
    grid = (-(-tokens // block_m), batch * heads)
    with torch.cuda.device(q8.device) if q8.is_cuda else nullcontext():
        _kernel()[grid](q8, k8, v8t, qk_scales, v_scale, text_out[0], image[0], text_out[1], image[1], *descriptors,
                        q8.stride(0), q8.stride(1), q8.stride(2), k8.stride(0), k8.stride(1), k8.stride(2),
                        v8t.stride(0), v8t.stride(1), v8t.stride(2), v_scale.stride(0), v_scale.stride(1),
                        text_out[0].stride(0), text_out[0].stride(1), image[0].stride(0), image[0].stride(1),
                        heads, tokens, text_tokens, blocks, softmax_scale * math.log2(math.e),
                        D=dim, BLOCK_M=block_m, BLOCK_N=block_n, V_BLOCK=V_BLOCK, SHIFT=P_SHIFT,
                        EVEN=tokens % block_n == 0, TMA=tma, OUT8=image[0].dtype == FP8, HEADROOM=OUT_HEADROOM,
                        num_warps=warps, num_stages=stages)
    if image[0].dtype != FP8:
        return image[0].view(batch, tokens, heads, dim)
    return (*text, *image)


def tma_layout(q8: torch.Tensor, k8: torch.Tensor, v8t: torch.Tensor) -> str | None:
    """None when the tensor memory accelerator can load the kernel's blocks (dense tensors starting on
    16 bytes, the token count a multiple of 16 bytes: the values' rows), else why not."""
    if not (q8.is_contiguous() and k8.is_contiguous() and v8t.is_contiguous()):
        return "queries, keys or values not contiguous"
    if any(t.data_ptr() % 16 for t in (q8, k8, v8t)):
        return "queries, keys or values not starting on 16 bytes"
    if q8.shape[1] % 16:
        return f"{q8.shape[1]} tokens, not a multiple of 16"
    return None


def _descriptors(q8, k8, v8t, block_m: int, block_n: int):
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, tokens, heads, dim = q8.shape
    return (TensorDescriptor.from_tensor(q8.view(batch * tokens, heads * dim), [block_m, dim]),
            TensorDescriptor.from_tensor(k8.view(batch * tokens, heads * dim), [block_n, dim]),
            TensorDescriptor.from_tensor(v8t.view(batch * heads * dim, tokens), [dim, block_n]))

