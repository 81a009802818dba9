"""Triton helpers shared by our kernels: a float32 value rounded to a 16-bit float, as the model's
own ops round it; pairs of values held in one word, read and written; and rows written as float8 with
their scales, as pipeline.kernels.fp8.quantize_rows writes them (`store_float8`).

Triton converts float32 to bfloat16 or float16 one value per instruction (F2F), and on Hopper that
instruction runs on the same narrow unit as the exponentials and reciprocals (16 per clock per SM),
which a kernel such as the GELU's already keeps busy. The paired conversion (`cvt.rn.bf16x2.f32`,
`cvt.rn.f16x2.f32`: one F2FP instruction for two values) rounds to nearest even as the single one
does, so `round_to` gives the same bytes with half the instructions, off that unit. Triton's
interpreter (TRITON_INTERPRET=1, no PTX) gets the plain conversion: the same values.

A kernel that treats a row's even and odd values differently (a rotary embedding's pairs) reads the
row as words of two values and writes it the same way (`unpair`, `pair_to`): its even and odd values
are then two tensors of one layout, where splitting a row of values in two would pass them through
shared memory. The pair is rounded and packed by one conversion (`cvt.rn.bf16x2.f32`,
`cvt.rn.satfinite.e4m3x2.f32`: the rounding and the saturation of the single conversions).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def round_to():
    """-> the jitted round_to(x, dtype): float32 x rounded to `dtype` (bfloat16, float16 or float32:
    unchanged), as float32."""
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") == "1":
        @triton.jit
        def plain(x, dtype: tl.constexpr):
            return x.to(dtype).to(tl.float32)

        return plain

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        if dtype == tl.bfloat16:
            y = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                          is_pure=True, pack=2)
            return y.to(tl.float32)
        elif dtype == tl.float16:
            y = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.float16,
                                          is_pure=True, pack=2)
            return y.to(tl.float32)
        else:
            return x.to(dtype).to(tl.float32)

    return round_to


@functools.cache
def pairs():
    """-> the jitted (unpair, pair_to):
    unpair(word, dtype): words each holding two values of `dtype` (float32: int64 words, else int32;
    the lower address in the low bits) -> the two values as float32;
    pair_to(lo, hi, dtype): two float32 tensors rounded to `dtype` (float8e4nv: saturating at +-448,
    bfloat16, float16, float32) -> the words holding both (int16 for float8, int32, int64)."""
    import triton
    import triton.language as tl

    @triton.jit
    def unpair(word, dtype: tl.constexpr):
        if dtype == tl.float32:
            word = word.to(tl.uint64, bitcast=True)
            lo = word.to(tl.uint32).to(tl.float32, bitcast=True)
            hi = (word >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            word = word.to(tl.uint32, bitcast=True)
            lo = word.to(tl.uint16).to(dtype, bitcast=True).to(tl.float32)
            hi = (word >> 16).to(tl.uint16).to(dtype, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def plain(lo, hi, dtype: tl.constexpr, bits: tl.constexpr, uint: tl.constexpr, word: tl.constexpr,
              out: tl.constexpr):
        lo = lo.to(dtype).to(uint, bitcast=True).to(word)
        hi = hi.to(dtype).to(uint, bitcast=True).to(word)
        return (lo | (hi << bits)).to(out, bitcast=True)

    if os.environ.get("TRITON_INTERPRET") == "1":
        @triton.jit
        def plain_pair_to(lo, hi, dtype: tl.constexpr):
            if dtype == tl.float32:
                return plain(lo, hi, dtype, 32, tl.uint32, tl.uint64, tl.int64)
            elif dtype == tl.float8e4nv:
                return plain(lo, hi, dtype, 8, tl.uint8, tl.uint16, tl.int16)
            else:
                return plain(lo, hi, dtype, 16, tl.uint16, tl.uint32, tl.int32)

        return unpair, plain_pair_to

    @triton.jit
    def pair_to(lo, hi, dtype: tl.constexpr):
        if dtype == tl.float32:
            return plain(lo, hi, dtype, 32, tl.uint32, tl.uint64, tl.int64)
        elif dtype == tl.float8e4nv:
            return tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $2, $1;", "=h,r,r", [lo, hi],
                                             dtype=tl.int16, is_pure=True, pack=1)
        elif dtype == tl.bfloat16:
            return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                             is_pure=True, pack=1)

    return unpair, pair_to


@functools.cache
def store_float8():
    """-> the jitted store_float8(Q, QS, y_head, head_at, head_ok, y_tail, tail_at, tail_ok, scale_at, scale_ok,
    fp8_max, min_amax, AXIS, TAIL): rows of float32 values held as a head block and, where TAIL > 0, a tail
    block (lanes outside tail_ok: any value), quantized as pipeline.kernels.fp8.quantize_rows does along AXIS
    (the blocks' last): each row's absolute maximum (at least min_amax) / fp8_max is its scale, its values
    times the scale's inverse are written as float8 to Q + head_at and Q + tail_at, the scale to QS + scale_at
    (a block of one per row). *_ok: the masks of those stores (None: all)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_float8(Q, QS, y_head, head_at, head_ok, y_tail, tail_at, tail_ok, scale_at, scale_ok, fp8_max,
                     min_amax, AXIS: tl.constexpr, TAIL: tl.constexpr):
        amax = tl.max(tl.abs(y_head), axis=AXIS, keep_dims=True)
        if TAIL > 0:
            amax = tl.maximum(amax, tl.max(tl.where(tail_ok, tl.abs(y_tail), 0.0), axis=AXIS, keep_dims=True))
        scale = tl.maximum(amax, min_amax) / fp8_max
        inverse = 1.0 / scale
        # the float8 cast saturates at +-448: a product rounded past it needs no clamp
        tl.store(Q + head_at, (y_head * inverse).to(Q.dtype.element_ty), mask=head_ok)
        if TAIL > 0:
            tl.store(Q + tail_at, (y_tail * inverse).to(Q.dtype.element_ty), mask=tail_ok)
        tl.store(QS + scale_at, scale, mask=scale_ok)

    return store_float8


@functools.cache
def tanh_gelu():
    """-> the jitted tanh_gelu(x): tanh GELU of float32 x as x / (1 + exp(-2u)) (0.5 x (1 + tanh u) rewritten,
    without its cancellation where x < 0), u = sqrt(2/pi) (x + 0.044715 x^3), by the GPU's approximate 2^x and
    reciprocal, one instruction each (flush to zero), the exponent's constants folded into its polynomial;
    e^(-2u) overflows to inf where x is very negative: the GELU is then -0. Triton's interpreter (no PTX) gets
    the same formula by tl.exp2 and a division."""
    import math

    import triton
    import triton.language as tl

    linear = -2 * math.sqrt(2 / math.pi) * math.log2(math.e)  # e^(-2u) = 2^(x (linear + linear 0.044715 x^2))
    exp_linear, exp_cubic = tl.constexpr(linear), tl.constexpr(linear * 0.044715)

    if os.environ.get("TRITON_INTERPRET") == "1":
        @triton.jit
        def plain(x):
            return x / (1.0 + tl.exp2(x * (exp_linear + exp_cubic * (x * x))))

        return plain

    @triton.jit
    def approx(x, OP: tl.constexpr):
        return tl.inline_asm_elementwise(OP + ".approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def tanh_gelu(x):
        return x * approx(1.0 + approx(x * (exp_linear + exp_cubic * (x * x)), "ex2"), "rcp")

    return tanh_gelu
