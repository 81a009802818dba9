"""PixArt's float8 residual blocks' fused row functions: the residual add that the float8 matmul before
them leaves, the layer norm and its modulation after it, and the rowwise float8 quantization of what
the next float8 layers read, each as one function of whole rows.

A float8 matmul (torch._scaled_mm) cannot add into the residual stream in its epilogue as `addmm_`
does for kernels.fuse_residual's bf16 blocks: it writes its output, bias included. So each residual
add is done by the function that reads the stream next, which needs the whole row anyway: the layer
norm before the self-attention and the feed-forward (`norm_rows`) and the quantization of the
cross-attention's queries' input (`added_rows`). It reads the stream and the update, writes their
sum (the next stream, rounded once) and the float8 rows of the norm's (or the sum's) output. Compiled
(kernels.compile_scope=norms: inductor, its kernels generated for a fixed row count, so the same
kernel in every process), each is one kernel over a row; on the CPU, or uncompiled, the torch ops.

With kernels.fp8_norm (the `fast-fp8` plan) each function is one Triton kernel on CUDA (`triton_functions`),
nothing compiled: a program reads ROWS_PER_PROGRAM whole rows once, the row as two blocks of powers of two
(PixArt-Sigma's 1,152 channels are 1,024 + 128, as in pipeline.kernels.fp8_gelu), writes the stream where an
update was added and the float8 rows and their scales. Inductor's kernels of the same functions hold a row
per program and read the rows well below the memory's rate (docs/BENCHMARKS.md). Block sizes and warps are
constants (`TRITON_SETTING`): every process, batch and shard reduces a row the same way.

Numerics: the sum and the norm in fp32, the norm's output rounded once to the model's dtype (the value
the bf16 block's layer would read), then quantized as pipeline.kernels.fp8.quantize_rows does. The Triton
kernel rounds each multiply and add as the torch ops do (no fused multiply-adds: the stream's bytes are
theirs); it multiplies by the scale's inverse where quantize_rows divides (a float8 step apart at most).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, rounding
from pipeline.kernels.fp8_gelu import row_blocks

# In the job's kernel digest (with the hint the compiled kernels are generated for, pipeline.blocks.pixart)
SETTING = "sum-fp32-norm-fp32-rounded-then-rowwise-e4m3"
ROWS_PER_PROGRAM = 4  # rows a Triton program reads, whatever the row count (fewer for rows over TILE values)
WARPS = 4
TILE = 8192
TRITON_SETTING = f"{SETTING}-triton-rows{ROWS_PER_PROGRAM}-warps{WARPS}-two-blocks"  # the digest's with fp8_norm


def residual_add(rows: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """rows [M, C] + gate [C] * update [M, C] in fp32, rounded once to the rows' dtype; `rows` without an update,
    the plain sum without a gate."""
    if update is None:
        return rows
    if gate is None:
        return (rows.float() + update.float()).to(rows.dtype)
    return (rows.float() + gate.float() * update.float()).to(rows.dtype)


def norm_rows(rows: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None, modulation: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream `residual_add(rows, update, gate)` [M, C], then LN(stream) * (1 + scale) + shift in fp32
    (modulation [2, C]: scale, shift), rounded to the rows' dtype and quantized rowwise -> (the stream,
    float8 [M, C], scales [M, 1])."""
    stream = residual_add(rows, update, gate)
    scale, shift = modulation.float()
    normed = F.layer_norm(stream.float(), stream.shape[-1:], eps=eps) * (1 + scale) + shift
    return (stream, *fp8.quantize_rows(normed.to(rows.dtype)))


def added_rows(rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream `residual_add(rows, update, gate)` [M, C] and its rows quantized -> (the stream, float8
    [M, C], scales [M, 1])."""
    stream = residual_add(rows, update, gate)
    return (stream, *fp8.quantize_rows(stream))


class RowFunctions(NamedTuple):
    """The row functions PixArt's float8 blocks call: eager, compiled by inductor or Triton kernels."""

    norm: Callable  # norm_rows(rows, update, gate, modulation, eps) -> (stream, x8, scales)
    add: Callable  # added_rows(rows, update, gate) -> (stream, x8, scales)
    quantize: Callable  # fp8.quantize_rows(rows) -> (x8, scales)


EAGER = RowFunctions(norm_rows, added_rows, fp8.quantize_rows)


def triton_functions(rows_per_program: int = ROWS_PER_PROGRAM, warps: int = WARPS) -> RowFunctions:
    """The three functions as the Triton kernel (CUDA rows, their last dimension contiguous); its block
    sizes the fixed ones unless a benchmark gives others."""
    def kernel(rows, update, gate, modulation, eps):
        return _triton(rows, update, gate, modulation, eps, rows_per_program, warps)

    return RowFunctions(kernel, lambda rows, update, gate: kernel(rows, update, gate, None, 0.0),
                        lambda rows: kernel(rows, None, None, None, 0.0)[1:])


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    round_to, store_float8 = rounding.round_to(), rounding.store_float8()

    @triton.jit
    def stream_part(X, U, GATE, S, offsets, cols, ok, col_ok, UPDATE: tl.constexpr, GATED: tl.constexpr):
        """The stream's values at these offsets as fp32: X's, or X + (GATE *) U rounded once to X's dtype
        and stored to S."""
        dtype: tl.constexpr = X.dtype.element_ty
        x = tl.load(X + offsets, mask=ok, other=0.0).to(tl.float32)
        if UPDATE:
            u = tl.load(U + offsets, mask=ok, other=0.0).to(tl.float32)
            if GATED:
                u = tl.load(GATE + cols, mask=col_ok, other=0.0).to(tl.float32) * u
            x = round_to(x + u, dtype)
            tl.store(S + offsets, x.to(dtype), mask=ok)
        return x

    @triton.jit
    def modulated(centred, rstd, MOD, cols, col_ok, n_cols, dtype: tl.constexpr):
        """(x - mean) * rstd * (1 + scale) + shift in fp32, rounded to `dtype` (MOD [2, C]: scale, shift)."""
        scale = tl.load(MOD + cols, mask=col_ok, other=0.0).to(tl.float32)
        shift = tl.load(MOD + n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
        return round_to(centred * rstd[:, None] * (1.0 + scale) + shift, dtype)

    @triton.jit
    def residual_rows_kernel(X, U, GATE, MOD, S, Q, QS, n_rows, n_cols, eps, fp8_max, min_amax, ROWS: tl.constexpr,
                             HEAD: tl.constexpr, TAIL: tl.constexpr, UPDATE: tl.constexpr, GATED: tl.constexpr,
                             NORM: tl.constexpr):
        dtype: tl.constexpr = X.dtype.element_ty
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < n_rows
        base = rows.to(tl.int64)[:, None] * n_cols
        head = tl.arange(0, HEAD)[None, :]
        head_ok = row_ok[:, None] & (head < HEAD)
        x_head = stream_part(X, U, GATE, S, base + head, head, head_ok, head < HEAD, UPDATE, GATED)
        if TAIL > 0:
            tail = HEAD + tl.arange(0, TAIL)[None, :]
            tail_cols = tail < n_cols
            tail_ok = row_ok[:, None] & tail_cols
            x_tail = stream_part(X, U, GATE, S, base + tail, tail, tail_ok, tail_cols, UPDATE, GATED)
        if NORM:
            total = tl.sum(x_head, axis=1)
            if TAIL > 0:
                total += tl.sum(x_tail, axis=1)
            mean = total / n_cols
            centred = x_head - mean[:, None]
            squares = tl.sum(centred * centred, axis=1)
            if TAIL > 0:
                centred_tail = tl.where(tail_ok, x_tail - mean[:, None], 0.0)
                squares += tl.sum(centred_tail * centred_tail, axis=1)
            rstd = tl.math.rsqrt(squares / n_cols + eps)
            y_head = modulated(centred, rstd, MOD, head, head < HEAD, n_cols, dtype)
            if TAIL > 0:
                y_tail = modulated(centred_tail, rstd, MOD, tail, tail_cols, n_cols, dtype)
        else:
            y_head = x_head
            if TAIL > 0:
                y_tail = x_tail
        if TAIL == 0:
            y_tail, tail, tail_ok = y_head, head, head_ok
        store_float8(Q + base, QS, y_head, head, head_ok, y_tail, tail, tail_ok, rows[:, None], row_ok[:, None],
                     fp8_max, min_amax, AXIS=1, TAIL=TAIL)

    return residual_rows_kernel


def program_rows(n_cols: int, wanted: int = ROWS_PER_PROGRAM) -> int:
    """The rows one program reads for rows of n_cols values: `wanted`, fewer where their blocks would pass
    TILE values, rounded down to a power of two (a Triton block's length is one)."""
    head, tail = row_blocks(n_cols)
    fit = max(1, min(wanted, TILE // (head + tail)))
    return 1 << (fit.bit_length() - 1)


def _triton(rows: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None,
            modulation: torch.Tensor | None, eps: float, rows_per_program: int = ROWS_PER_PROGRAM,
            warps: int = WARPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel: rows [M, C] plus (gate [C] *) update [M, C] where given, normed and modulated where
    `modulation` [2, C] is given, quantized -> (the stream: `rows` itself without an update, float8 [M, C],
    scales [M, 1]). `rows_per_program`, `warps`: the fixed choice (a benchmark's to vary)."""
    rows, update, gate, modulation = (None if t is None else t.contiguous() for t in (rows, update, gate, modulation))
    n_rows, n_cols = rows.shape
    q = torch.empty((n_rows, n_cols), device=rows.device, dtype=fp8.FP8)
    row_scale = torch.empty((n_rows, 1), device=rows.device, dtype=torch.float32)
    stream = rows if update is None else torch.empty_like(rows)
    if n_rows and n_cols:
        head, tail = row_blocks(n_cols)
        per_program = program_rows(n_cols, rows_per_program)
        with torch.cuda.device(rows.device):
            _kernel()[(-(-n_rows // per_program),)](
                rows, rows if update is None else update, rows if gate is None else gate,
                rows if modulation is None else modulation, stream, q, row_scale, n_rows, n_cols, eps, fp8.FP8_MAX,
                fp8.MIN_AMAX, ROWS=per_program, HEAD=head, TAIL=tail, UPDATE=update is not None,
                GATED=gate is not None, NORM=modulation is not None, num_warps=warps, enable_fp_fusion=False)
    return stream, q, row_scale
