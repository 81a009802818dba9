"""Triton helpers shared by our kernels: a float32 value rounded to a 16-bit float, as the model's
own ops round it.

Triton converts float32 to bfloat16 or float16 one value per instruction (F2F), and on Hopper that
instruction runs on the same narrow unit as the exponentials and reciprocals (16 per clock per SM),
which a kernel such as the GELU's already keeps busy. The paired conversion (`cvt.rn.bf16x2.f32`,
`cvt.rn.f16x2.f32`: one F2FP instruction for two values) rounds to nearest even as the single one
does, so `round_to` gives the same bytes with half the instructions, off that unit. Triton's
interpreter (TRITON_INTERPRET=1, no PTX) gets the plain conversion: the same values.
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
