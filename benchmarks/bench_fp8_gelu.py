"""The tanh GELU and rowwise float8 quantization of a feed-forward activation (kernels.fuse_gelu with
kernels.fp8): inductor's kernel for the torch ops (fp8_gelu.reference, compiled, static shapes) against
our Triton kernel for several warp counts, at Flux's and PixArt-Sigma's activation shapes.

On the GPU, from the repository root:

    python benchmarks/bench_fp8_gelu.py --out outputs/benchmarks/bench_fp8_gelu.json

Per shape [rows, columns] (bf16 in): median ms over `--iters` calls on CUDA events, GB/s counted as
one read of the bf16 rows and one write of the float8 rows, and against the reference: the largest
dequantized difference in float8 steps and the share of equal bytes. The table is printed last.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.kernels import fp8_gelu
from pipeline.timing import save_and_print_rows, time_kernels

# Flux 1024 px batch 1: single blocks (text + image tokens), the image and text streams' feed-forward;
# PixArt-Sigma 1024 px batch 8: 8 x 4096 tokens through a 4 x 1152 feed-forward.
SHAPES = ((4608, 12288), (4096, 12288), (512, 12288), (32768, 4608))
WARPS = (4, 8, 16, 32)


def compare(out, ref) -> dict:
    (q, scale), (ref_q, ref_scale) = out, ref
    a, b = q.float() * scale, ref_q.float() * ref_scale
    steps = (a - b).abs() / (0.125 * torch.maximum(a.abs(), b.abs()) + scale * 2 ** -9)
    return {"max_fp8_steps": round(float(steps.max()), 3),
            "equal_bytes": round(float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean()), 5)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_fp8_gelu.json")
    args = p.parse_args()
    device = torch.device("cuda")
    rows_out = []
    for n_rows, n_cols in SHAPES:
        x = (torch.randn(n_rows, n_cols, device="cuda") * 3).to(torch.bfloat16)
        gbytes = n_rows * n_cols * 3 / 1e9
        compiled = torch.compile(fp8_gelu.reference, dynamic=False)
        ref = fp8_gelu.reference(x)
        candidates = {"inductor": lambda: compiled(x)}
        for warps in WARPS:
            candidates[f"triton w{warps}"] = lambda w=warps: fp8_gelu._triton_gelu_quantize(x, w)
        rows_out += time_kernels(candidates, {"rows": n_rows, "cols": n_cols}, device, args.iters,
                                 lambda out, ms: {"gb_per_s": round(gbytes / (ms / 1e3)), **compare(out, ref)})
    save_and_print_rows(args.out, device, args, rows_out, ("rows", "cols"),
                        {"GB/s": "gb_per_s", "max fp8 steps": "max_fp8_steps", "equal bytes": "equal_bytes"})


if __name__ == "__main__":
    main()
