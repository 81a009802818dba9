"""kernels.fuse_gelu under float8: the feed-forward's tanh GELU and the rowwise float8
quantization of its output as one Triton kernel, read by the down-projection's float8 matmul.

The up-projection is a float8 matmul, which has no GELU epilogue, so without this its bf16 output is
read by the GELU and the quantization that inductor fuses into one looped reduction: it reads every
row twice (once for the row's maximum, once to scale it) and computes the GELU twice. Here one program
holds a whole row: it reads it once, applies the GELU in fp32, rounds it to the row's dtype (the value
the unfused model multiplies), takes the row's absolute maximum, and writes the float8 row and its scale.
The kernel is bound by its instructions, not by memory (benchmarks/bench_fp8_gelu.py), so it spends few:
the GELU as x / (1 + exp(-2u)) (0.5 x (1 + tanh u) rewritten, without its cancellation where x < 0)
by the GPU's approximate 2^x and reciprocal, one instruction each, the exponent's constants folded
into its polynomial; each value times the row's 1 / scale, cast without a clamp (the float8 cast
saturates); the row as two blocks of powers of two, the largest that fits
and the rest (Flux's 12,288 columns are 8,192 + 4,096), where one block of the next power of two
would spend a quarter of its lanes on padding. Block sizes and warps are constants (`SETTING`):
every process reduces a row the same way.

Flux's own blocks (pipeline.blocks.flux) call it where a float8 layer alone reads a tanh GELU's
output: a double block's feed-forwards, and a single block's MLP once kernels.split_out_proj gives it
its own out-projection. The CPU runs the torch ops it replaces (`reference`), which the tests compare.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, rounding

MAX_COLS = 16384  # a row in one program's registers
WARPS = 8  # benchmarks/bench_fp8_gelu.py times others
SETTING = f"triton-row-warps{WARPS}-two-blocks-ex2-rcp"  # in the job's kernel digest: another setting, other bytes


def reference(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, as the unfused model does: fp8.quantize_rows(tanh GELU(rows))."""
    return fp8.quantize_rows(F.gelu(rows, approximate="tanh"))


@torch.library.custom_op("bcg::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [M, K] -> (float8 [M, K], scales float32 [M, 1]) of the rows' tanh GELU. An operator
    torch.compile calls as it is (it does not trace into it)."""
    if rows.device.type != "cuda":
        return reference(rows)
    return _triton_gelu_quantize(rows.contiguous())


@gelu_quantize_rows.register_fake
def _(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rows.new_empty(rows.shape, dtype=fp8.FP8), rows.new_empty((rows.shape[0], 1), dtype=torch.float32)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    round_to, store_float8, tanh_gelu = rounding.round_to(), rounding.store_float8(), rounding.tanh_gelu()

    @triton.jit
    def gelu_rounded(ptr, cols, ok, MASKED: tl.constexpr):
        """The row's dtype, GELU'd in fp32 and rounded back, as fp32 (masked lanes: 0)."""
        if MASKED:
            x = tl.load(ptr + cols, mask=ok, other=0.0).to(tl.float32)
        else:
            x = tl.load(ptr + cols).to(tl.float32)
        return round_to(tanh_gelu(x), ptr.dtype.element_ty)

    @triton.jit
    def gelu_quantize_kernel(x_ptr, q_ptr, scale_ptr, n_cols, fp8_max, min_amax, HEAD: tl.constexpr,
                             TAIL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row, q_row = x_ptr + row * n_cols, q_ptr + row * n_cols
        head = tl.arange(0, HEAD)
        y_head = gelu_rounded(x_row, head, None, False)
        y_tail, tail, tail_ok = y_head, head, None
        if TAIL > 0:
            tail = HEAD + tl.arange(0, TAIL)
            tail_ok = tail < n_cols
            y_tail = gelu_rounded(x_row, tail, tail_ok, True)
        store_float8(q_row, scale_ptr, y_head, head, None, y_tail, tail, tail_ok, row + tl.arange(0, 1), None,
                     fp8_max, min_amax, AXIS=0, TAIL=TAIL)

    return gelu_quantize_kernel


def row_blocks(n_cols: int) -> tuple[int, int]:
    """A row of n_cols > 0 values -> (head, tail): the largest power of two <= n_cols, and the power of two
    that holds the rest (0 when nothing is left; padded when the rest is not a power of two)."""
    head = 1 << (n_cols.bit_length() - 1)
    rest = n_cols - head
    return head, (1 << (rest - 1).bit_length()) if rest else 0


def _triton_gelu_quantize(rows: torch.Tensor, warps: int = WARPS) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on contiguous CUDA rows; `warps`: its fixed choice (a benchmark's to vary)."""
    n_rows, n_cols = rows.shape
    if n_cols > MAX_COLS:
        raise ValueError(f"gelu_quantize_rows: rows of at most {MAX_COLS} values, got {n_cols}")
    q = torch.empty((n_rows, n_cols), device=rows.device, dtype=fp8.FP8)
    scale = torch.empty((n_rows, 1), device=rows.device, dtype=torch.float32)
    if n_rows and n_cols:
        head, tail = row_blocks(n_cols)
        with torch.cuda.device(rows.device):
            _kernel()[(n_rows,)](rows, q, scale, n_cols, fp8.FP8_MAX, fp8.MIN_AMAX, HEAD=head, TAIL=tail,
                                 num_warps=warps)
    return q, scale
