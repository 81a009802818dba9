"""kernels.fuse_residual's modulated layer norm as one Triton kernel whose block sizes are fixed here:
LN(rows + pending) * (1 + scale) + shift, in fp32, rounded once to the rows' dtype
(residual.modulated_norm is its definition).

Inductor generates a one-pass kernel of the same math, but picks its rows per program and warps when
it first runs: timed (compile_tuning=timed) they can differ between processes, and with them a row's
reduction order; untimed (fixed) they follow a heuristic that reads the first call's sizes. Compiled
alone, its kernel was slower at PixArt-Sigma's sizes either way (docs/BENCHMARKS.md). Here they are
constants: every process, every batch size and every shard reduces a row in the same
order, so the bytes are the same, and nothing is compiled by inductor or timed at start (Triton
compiles it once per process, from its own cache when warm). CUDA only; the module imports Triton
when the kernel is first asked for.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from pipeline.errors import UserError

# A program normalizes ROWS_PER_PROGRAM rows with WARPS warps, for every row count: a row's reduction
# order depends on those and on the channel count only. Fewer rows (down to one) where
# ROWS_PER_PROGRAM rows of next_power_of_2(channels) values would exceed TILE values. Chosen from
# bench_norm.py's sweep (docs/BENCHMARKS.md).
ROWS_PER_PROGRAM = 4
WARPS = 4
TILE = 8192
SETTING = f"triton-rows{ROWS_PER_PROGRAM}-warps{WARPS}-tile{TILE}"  # in the job's kernel digest: another setting, other bytes


def check_triton(what: str = "kernels.fuse_residual=true on a CUDA device runs its layer norm",
                 off: str = "kernels.fuse_residual=false") -> None:
    """Triton importable (PyTorch's CUDA wheels bring it), or a refusal naming the way out: `what`
    needs it, `off` turns that off."""
    if importlib.util.find_spec("triton") is None:
        raise UserError(f"{what} as a Triton kernel, and the triton package is not installed (PyTorch's CUDA wheels "
                        f"bring it: pip install triton); or set {off} kernels.compile=false (inductor's kernels need "
                        f"triton too)")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def modulated_norm_kernel(x_ptr, pending_ptr, mod_ptr, out_ptr, n_rows, n_cols, eps,
                              BLOCK_COLS: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        col_ok = cols < n_cols
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        offsets = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        pending = tl.load(pending_ptr + cols, mask=col_ok, other=0.0)
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32) + pending[None, :]
        mean = tl.sum(x, axis=1) / n_cols
        centred = tl.where(ok, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / n_cols + eps)
        scale = tl.load(mod_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        shift = tl.load(mod_ptr + n_cols + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = centred * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=ok)

    return modulated_norm_kernel, triton.next_power_of_2, triton.cdiv


def modulated_norm(rows: torch.Tensor, pending: torch.Tensor, modulation: torch.Tensor, eps: float,
                   rows_per_program: int = ROWS_PER_PROGRAM, warps: int = WARPS) -> torch.Tensor:
    """residual.modulated_norm on a CUDA device: rows [M, C] contiguous, pending [C] fp32, modulation
    [2, C] contiguous (scale, shift) -> [M, C] in the rows' dtype. `rows_per_program`, `warps`: the
    kernel's fixed block sizes (a benchmark's to vary)."""
    kernel, next_power_of_2, cdiv = _kernel()
    n_rows, n_cols = rows.shape
    if (pending.shape != (n_cols,) or modulation.shape != (2, n_cols) or pending.dtype != torch.float32
            or not (rows.is_contiguous() and pending.is_contiguous() and modulation.is_contiguous())
            or not rows.device == pending.device == modulation.device):
        raise ValueError(f"modulated_norm: rows [M, C] with pending [C] fp32 and modulation [2, C], contiguous, on one "
                         f"device; got {tuple(rows.shape)}, {tuple(pending.shape)} {pending.dtype}, {tuple(modulation.shape)}")
    block_cols = next_power_of_2(n_cols)
    per_program = max(1, min(rows_per_program, TILE // block_cols))
    out = torch.empty_like(rows)
    with torch.cuda.device(rows.device):
        kernel[(cdiv(n_rows, per_program),)](rows, pending, modulation, out, n_rows, n_cols, eps,
                                             BLOCK_COLS=block_cols, ROWS=per_program, num_warps=warps)
    return out
