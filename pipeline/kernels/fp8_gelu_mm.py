"""kernels.fuse_gelu_mm: a float8 feed-forward's up-projection, its tanh GELU and the float8 rows of the GELU's
output as one Triton matmul, whose epilogue writes what the down-projection multiplies.

Without it the up-projection is cuBLAS' float8 matmul (`torch._scaled_mm`), which writes its output in bf16,
and pipeline.kernels.fp8_gelu reads it back to apply the GELU and quantize each row by its absolute maximum:
the widest activation of the block written in two bytes, read, and written again in one. The maximum of a
row is known only once every column of the row is computed, which no tile of a matmul sees; so here a row's
scale is not its maximum but a bound on it that the row's input already gives:

    |y[m, n]| = |sx[m] sw[n] <x8[m], w8[n]> + b[n]| <= sx[m] 448 sqrt(K) max_n ||sw[n] w8[n]|| + max_n |b[n]|

(Cauchy-Schwarz: a float8 value is at most 448 in magnitude), and |GELU(y)| <= max(|y|, 0.17). The output
scale of row m is that bound over 448 (`out_scales`): no value saturates, a row's bytes depend on its own
input and the weights alone (not on its batch), and every tile of the row computes the same scale. The bound
is loose (a row's values use a part of float8's range, not all of it), which costs precision only where
values fall below float8's normal range, far below the row's largest; float8's relative step elsewhere is
the same at any scale.

The matmul: the float8 rows [M, K] and the weight [N, K] read through TMA descriptors, tile by tile along K
into one fp32 accumulator per [BLOCK_M, BLOCK_N] tile (wgmma), then in the epilogue the rows' and columns'
scales and the bias, the GELU (as pipeline.kernels.fp8_gelu computes it, from the fp32 value), the row's
inverse scale, the saturating float8 cast and a TMA store. Block sizes, warps and stages are constants (`CONFIG`):
every process, batch and shard sums a value in the same order. The CPU runs `reference`, the same math in
torch ops, which the tests compare.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from pipeline.kernels import fp8, rounding

GELU_MIN = 0.17  # |tanh GELU(y)| <= max(|y|, GELU_MIN): its negative lobe's depth is 0.1700...
SLACK = 1 + 2 ** -8  # the bound's own rounding and the accumulation's, covered


class Config(NamedTuple):
    """The kernel's fixed tiling: a tile [block_m, block_n] of the output per program, block_k along K per
    step, `stages` steps in flight, `group_m` row tiles walked per column tile (L2 reuse)."""
    block_m: int = 128
    block_n: int = 256
    block_k: int = 128
    warps: int = 8
    stages: int = 3
    group_m: int = 8


CONFIG = Config()
SETTING = "triton-tma-{}x{}x{}-w{}-s{}-g{}-ex2-rcp-bound-scale".format(*CONFIG)  # the job's kernel digest


def bounds(weight8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float8 layer's constants of `out_scales`, float32 [2] on the weight's device: sqrt(K) max_n ||w[n]||
    and (max_n |b[n]| + GELU_MIN) / 448, each times SLACK, from the dequantized weight [N, K] (weight8 with
    its scales [1, N]) and the bias [N] or None, in float64."""
    rows = weight8.double() * weight_scale.reshape(-1, 1).double()
    per_input = math.sqrt(weight8.shape[1]) * float(rows.norm(dim=1).max()) * SLACK
    bias_max = 0.0 if bias is None else float(bias.double().abs().max())
    return torch.tensor([per_input, (bias_max + GELU_MIN) * SLACK / fp8.FP8_MAX], dtype=torch.float32,
                        device=weight8.device)


def out_scales(x_scale: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The output rows' scales [M, 1] float32 of input rows with scales x_scale [M, 1]: x_scale times the
    first constant of `bounds`, plus the second (rounded after each operation, as the kernel computes it)."""
    return x_scale.float() * bound[0] + bound[1]


def reference(x8: torch.Tensor, x_scale: torch.Tensor, weight8: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None, bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in torch ops: tanh GELU(x8 x_scale (w8 w_scale)^T + bias) in float32, each
    row times 1 / out_scales -> (float8 [M, N], the rows' scales float32 [M, 1])."""
    y = (x8.float() @ weight8.float().t()) * x_scale.float() * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    scale = out_scales(x_scale, bound)
    q = (F.gelu(y, approximate="tanh") * (1.0 / scale)).clamp(-fp8.FP8_MAX, fp8.FP8_MAX)
    return q.to(fp8.FP8), scale


@torch.library.custom_op("bcg::gelu_mm_rows", mutates_args=())
def gelu_mm_rows(x8: torch.Tensor, x_scale: torch.Tensor, weight8: torch.Tensor, weight_scale: torch.Tensor,
                 bias: Optional[torch.Tensor], bound: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference`'s result: on CUDA the Triton matmul, elsewhere `reference`. An operator torch.compile calls
    as it is (it does not trace into it)."""
    if x8.device.type != "cuda":
        return reference(x8, x_scale, weight8, weight_scale, bias, bound)
    return triton_gelu_mm(x8, x_scale, weight8, weight_scale, bias, bound)


@gelu_mm_rows.register_fake
def _(x8, x_scale, weight8, weight_scale, bias, bound):
    return (x8.new_empty((x8.shape[0], weight8.shape[0]), dtype=fp8.FP8),
            x8.new_empty((x8.shape[0], 1), dtype=torch.float32))


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    tanh_gelu = rounding.tanh_gelu()

    @triton.jit
    def gelu_mm_kernel(a_desc, b_desc, c_desc, a_scale_ptr, b_scale_ptr, bias_ptr, bound_ptr, out_scale_ptr, M,
                       N, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_size = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_size
        pid_n = (pid % in_group) // group_size
        off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            b = b_desc.load([off_n, k])
            acc = tl.dot(a, b.T, acc)
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < M, cols < N
        sa = tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)
        sb = tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)
        y = acc * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        g = tanh_gelu(y)
        scale = sa * tl.load(bound_ptr)
        scale = scale + tl.load(bound_ptr + 1)
        c_desc.store([off_m, off_n], (g * (1.0 / scale)[:, None]).to(c_desc.dtype))
        if pid_n == 0:
            tl.store(out_scale_ptr + rows, scale, mask=row_ok)

    return gelu_mm_kernel


def triton_gelu_mm(x8: torch.Tensor, x_scale: torch.Tensor, weight8: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None, bound: torch.Tensor,
                   config: Config = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA tensors: x8 [M, K] row-major float8, x_scale [M, 1], weight8 [N, K] row-major,
    weight_scale [1, N], bias [N] or None, `bounds`' constants -> (float8 [M, N], scales [M, 1]); `config`: the
    fixed tiling (a benchmark's to vary)."""
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    if x8.data_ptr() % 16 or x8.stride() != (x8.shape[1], 1):  # TMA reads 16-byte aligned rows
        x8 = x8.clone(memory_format=torch.contiguous_format)
    x_scale = x_scale.contiguous()
    m, k = x8.shape
    n = weight8.shape[0]
    out = torch.empty((m, n), device=x8.device, dtype=fp8.FP8)
    scale = torch.empty((m, 1), device=x8.device, dtype=torch.float32)
    if m == 0:
        return out, scale
    a_desc = TensorDescriptor.from_tensor(x8, [config.block_m, config.block_k])
    b_desc = TensorDescriptor.from_tensor(weight8, [config.block_n, config.block_k])
    c_desc = TensorDescriptor.from_tensor(out, [config.block_m, config.block_n])
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    with torch.cuda.device(x8.device):
        _kernel()[grid](a_desc, b_desc, c_desc, x_scale, weight_scale, bias if bias is not None else weight_scale,
                        bound, scale, m, n, K=k, HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
                        BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                        num_warps=config.warps, num_stages=config.stages)
    return out, scale
