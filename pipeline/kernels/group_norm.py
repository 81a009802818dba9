"""The VAE decoder's group norms (and the SiLU that follows most of them) as two Triton kernels whose
block sizes are fixed here: a group's statistics in fixed-size chunks, then the normalization, its
affine and the SiLU in one pass, in fp32, rounded once to the input's dtype.

A group (one image's `channels / groups` channels, contiguous in NCHW) is split into chunks of CHUNK
values; each chunk's mean and squared deviations are summed tile by tile in a fixed order and the
chunks are combined in a fixed order, so a group's statistics, and an image's bytes, depend on its
own values and shape only: not on the batch, the process or the GPU's load. Nothing is compiled by
inductor (Triton compiles each kernel once, from its own cache when warm). CUDA only; `reference` is
the definition, PyTorch's ops, which the CPU runs.

One compiled kernel serves every resolution: a group's chunk statistics are combined in SLOTS slots
(the unused ones masked) whatever its number of chunks, up to SLOTS of them, and the sizes that vary
with the resolution are not specialized on by Triton (`do_not_specialize`), so the decoder's pass at
the model's native size at start-up (pipeline.kernels.decoder) builds what every later size runs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

BLOCK = 2048  # values a program reads at once
CHUNK = 16 * BLOCK  # values a program reduces, then normalizes
WARPS = 8
SLOTS = 256  # chunk statistics a program combines (groups of up to SLOTS * CHUNK values: one kernel for all)
SETTING = f"triton-block{BLOCK}-chunk{CHUNK}-warps{WARPS}-slots{SLOTS}"  # in the job's kernel digest: another setting, other bytes


def reference(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
              silu: bool) -> torch.Tensor:
    """What `group_norm` computes, as PyTorch's ops: F.group_norm, then F.silu when `silu`."""
    y = F.group_norm(x, groups, weight, bias, eps)
    return F.silu(y) if silu else y


def group_length(shape: torch.Size, groups: int) -> int:
    """Values in one group of an [N, C, *spatial] tensor: C / groups channels of every position."""
    return shape[1] // groups * shape[2:].numel()


def chunks(group_len: int) -> tuple[int, int]:
    """A group of `group_len` values -> (its chunks, the slots its statistics are combined in: SLOTS, or
    the next power of two above for a group of more chunks)."""
    n_chunks = -(-group_len // CHUNK)
    return n_chunks, max(SLOTS, 1 << (n_chunks - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
        n = n_a + n_b
        delta = mean_b - mean_a
        share = tl.where(n > 0, n_b / tl.maximum(n, 1.0), 0.0)
        return mean_a + delta * share, m2_a + m2_b + delta * delta * n_a * share, n

    @triton.jit(do_not_specialize=["n_chunks"])
    def chunk_stats(x_ptr, stats_ptr, group_len, n_chunks, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        group = tl.program_id(0)
        chunk = tl.program_id(1)
        base = group.to(tl.int64) * group_len
        lanes = tl.arange(0, BLOCK)
        mean = 0.0
        m2 = 0.0
        count = 0.0
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + lanes
            ok = offs < group_len
            x = tl.load(x_ptr + base + offs, mask=ok, other=0.0).to(tl.float32)
            n = tl.sum(ok.to(tl.float32), axis=0)
            tile_mean = tl.sum(x, axis=0) / tl.maximum(n, 1.0)
            centred = tl.where(ok, x - tile_mean, 0.0)
            mean, m2, count = combine(mean, m2, count, tile_mean, tl.sum(centred * centred, axis=0), n)
        out = stats_ptr + (group * n_chunks + chunk) * 3
        tl.store(out, mean)
        tl.store(out + 1, m2)
        tl.store(out + 2, count)

    @triton.jit(do_not_specialize=["n_chunks", "plane", "channels_per_group", "n_groups"])
    def normalize(x_ptr, stats_ptr, weight_ptr, bias_ptr, out_ptr, group_len, n_chunks, plane, channels_per_group,
                  n_groups, eps, HAS_AFFINE: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
                  CHUNK: tl.constexpr, CHUNKS: tl.constexpr):
        group = tl.program_id(0)
        chunk = tl.program_id(1)
        slots = tl.arange(0, CHUNKS)
        have = slots < n_chunks
        at = stats_ptr + (group * n_chunks + slots) * 3
        means = tl.load(at, mask=have, other=0.0)
        m2s = tl.load(at + 1, mask=have, other=0.0)
        counts = tl.load(at + 2, mask=have, other=0.0)
        mean, m2, count = tl.reduce((means, m2s, counts), 0, combine)
        rstd = tl.rsqrt(m2 / count + eps)
        base = group.to(tl.int64) * group_len
        first_channel = (group % n_groups) * channels_per_group
        lanes = tl.arange(0, BLOCK)
        for start in range(0, CHUNK, BLOCK):
            offs = chunk * CHUNK + start + lanes
            ok = offs < group_len
            x = tl.load(x_ptr + base + offs, mask=ok, other=0.0).to(tl.float32)
            y = (x - mean) * rstd
            if HAS_AFFINE:
                channel = first_channel + offs // plane
                y = y * tl.load(weight_ptr + channel, mask=ok, other=1.0).to(tl.float32) \
                    + tl.load(bias_ptr + channel, mask=ok, other=0.0).to(tl.float32)
            if SILU:
                y = y / (1.0 + tl.exp(-y))
            tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    return chunk_stats, normalize


def group_norm(x: torch.Tensor, groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
               silu: bool) -> torch.Tensor:
    """`reference` on a CUDA device (x [N, C, *spatial] read as NCHW: a copy first where it is laid out
    otherwise) -> x's shape and dtype, contiguous; elsewhere `reference` itself."""
    if x.device.type != "cuda":
        return reference(x, groups, weight, bias, eps, silu)
    x = x.contiguous()
    chunk_stats, normalize = _kernels()
    batch, channels = x.shape[:2]
    if channels % groups or (weight is None) != (bias is None):
        raise ValueError(f"group_norm: x [N, C, ...] with C ({channels}) a multiple of groups ({groups}), "
                         "weight and bias both given or both None")
    plane = x[0, 0].numel()
    group_len = group_length(x.shape, groups)
    n_chunks, slots = chunks(group_len)
    stats = torch.empty(batch * groups, n_chunks, 3, dtype=torch.float32, device=x.device)
    grid = (batch * groups, n_chunks)
    chunk_stats[grid](x, stats, group_len, n_chunks, BLOCK=BLOCK, CHUNK=CHUNK, num_warps=WARPS)
    out = torch.empty_like(x)
    affine = weight is not None
    normalize[grid](x, stats, weight if affine else x, bias if affine else x, out, group_len, n_chunks, plane,
                    channels // groups, groups, eps, HAS_AFFINE=affine, SILU=silu, BLOCK=BLOCK, CHUNK=CHUNK,
                    CHUNKS=slots, num_warps=WARPS)
    return out
