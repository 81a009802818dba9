"""Attention at Flux's shapes: PyTorch SDPA in bf16 (cuDNN, flash) against our float8 Triton kernel
(pipeline/kernels/fp8_attention.py) for several block sizes, warps and stages, and the compiled
quantize-then-attend function against compiled bf16 SDPA (the quantization's cost included).

On the GPU, from the repository root:

    python benchmarks/bench_fp8_attention.py --out outputs/benchmarks/bench_fp8_attention.json

Inputs are [B, S, H, D] bf16 (diffusers' layout): queries and keys RMS-normalized per head as Flux's
are, values N(0, 1). Per shape and kernel: median ms over `--iters` calls on CUDA events, TFLOP/s
counted as 4 B H S^2 D, and the error against cuDNN's bf16 result (RMS relative, max absolute).
The table is printed last.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.kernels import fp8_attention as fa
from pipeline.timing import save_and_print_rows, time_kernels

# Flux 1024 px batch 1 and 4 (4096 image + 512 text tokens), 512 px batch 1 (1024 + 512)
SHAPES = ((1, 4608), (4, 4608), (1, 1536))
HEADS, DIM = 24, 128
# (block_m, block_n, warps, stages, loads by TMA)
CONFIGS = ((64, 64, 4, 3, False), (64, 128, 4, 3, False), (64, 64, 4, 3, True), (64, 128, 4, 3, True),
           (64, 128, 4, 2, True), (64, 128, 4, 4, True), (128, 128, 8, 3, True))


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def under(backend, fn):
    def run(*args):
        with sdpa_kernel([backend]):
            return fn(*args)
    return run


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref.float()
    return {"rel_rms": round(float(diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()), 5),
            "max_abs": round(float(diff.abs().max()), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_fp8_attention.json")
    args = p.parse_args()
    device = torch.device("cuda")
    results = []
    for batch, tokens in SHAPES:
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, tokens, HEADS, DIM, device="cuda", generator=gen) for _ in range(3))
        q, k = (F.rms_norm(t, (DIM,)) for t in (q, k))
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        tflop = 4 * batch * HEADS * tokens ** 2 * DIM / 1e12
        ref = under(SDPBackend.CUDNN_ATTENTION, sdpa)(q, k, v)
        scales = torch.full((2,), DIM ** 0.5 / fa.FP8_MAX, device="cuda")  # the bound of RMS-normalized heads
        q8, k8 = ((t.float() / s).to(fa.FP8) for t, s in ((q, scales[0]), (k, scales[1])))
        v8t, v_scale = fa.quantize_values(v)
        scale = 1 / math.sqrt(DIM)
        candidates = {"sdpa cudnn bf16": lambda: under(SDPBackend.CUDNN_ATTENTION, sdpa)(q, k, v),
                      "sdpa flash bf16": lambda: under(SDPBackend.FLASH_ATTENTION, sdpa)(q, k, v)}
        for bm, bn, w, st, tma in CONFIGS:
            candidates[f"fp8 m{bm} n{bn} w{w} s{st}{' tma' if tma else ''}"] = (
                lambda bm=bm, bn=bn, w=w, st=st, tma=tma: fa.attention(q8, k8, v8t, scales, v_scale, scale,
                                                                       bm, bn, w, st, tma))
        compiled_bf16 = torch.compile(under(SDPBackend.CUDNN_ATTENTION, sdpa), dynamic=False)
        compiled_fp8 = torch.compile(lambda q, k, v: fa.fp8_sdpa(q, k, v, scales), dynamic=False)
        candidates["compiled cudnn bf16"] = lambda: compiled_bf16(q, k, v)
        candidates["compiled quantize + fp8"] = lambda: compiled_fp8(q, k, v)
        results += time_kernels(candidates, {"batch": batch, "tokens": tokens}, device, args.iters,
                                lambda out, ms: {"tflops": round(tflop / (ms / 1e3)), **errors(out, ref)})
    save_and_print_rows(args.out, device, args, results, ("batch", "tokens"),
                        {"TFLOP/s": "tflops", "rel RMS vs cuDNN bf16": "rel_rms", "max abs": "max_abs"})


if __name__ == "__main__":
    main()
