"""A float8 feed-forward's up-projection, tanh GELU and float8 rows (kernels.fuse_gelu_mm): cuBLAS' float8
matmul writing bf16 then the GELU's row kernel (pipeline.kernels.fp8_gelu, the plans without it) against one
Triton matmul whose epilogue writes the float8 rows (pipeline.kernels.fp8_gelu_mm), for several tilings, at
PixArt-Sigma's, SD3 Medium's and Flux's up-projection shapes.

On the GPU, from the repository root:

    python benchmarks/bench_fp8_gelu_mm.py --out outputs/benchmarks/bench_fp8_gelu_mm.json

Per shape [M rows, K, N] (float8 rows in, nn.Linear's initialisation for the weight): median ms over `--iters`
calls on CUDA events and TFLOP/s of the matmul; against the float32 GELU of the float32 product: the error's
RMS over the values' RMS, and the largest error over its row's largest value; whether a second call wrote
the same bytes. The table is printed last.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.kernels import fp8, fp8_gelu, fp8_gelu_mm
from pipeline.kernels.fp8_gelu_mm import Config
from pipeline.timing import save_and_print_rows, time_kernels

# PixArt-Sigma 512 px in batches of 16 and 1024 px in batches of 8 (CFG: twice the rows), SD3 Medium's image
# feed-forward at 1024 px batch 1 (CFG), Flux's double block's at 1024 px batch 1.
SHAPES = ((32768, 1152, 4608), (65536, 1152, 4608), (8192, 1536, 6144), (4096, 3072, 12288))
CONFIGS = (Config(), Config(128, 128, 128, 4, 4), Config(128, 128, 128, 8, 4), Config(128, 256, 64, 8, 4),
           Config(256, 128, 128, 8, 3), Config(64, 256, 128, 4, 4), Config(128, 128, 64, 4, 5),
           Config(128, 256, 128, 8, 2), Config(128, 256, 128, 8, 3, 16))


def errors(q: torch.Tensor, scale: torch.Tensor, exact: torch.Tensor) -> dict:
    got = q.float() * scale
    err = (got - exact).abs()
    row_max = exact.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    return {"rel_rms": float((err.square().mean() / exact.square().mean()).sqrt()),
            "max_of_row": float((err / row_max).max())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_fp8_gelu_mm.json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    results = []
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        layer = torch.nn.Linear(k, n, device=device)
        w8, ws = fp8.quantize_weight(layer.weight.detach())
        bias = layer.bias.detach().to(torch.bfloat16)
        x = F.layer_norm(torch.randn(m, k, device=device), (k,)) * 1.3 + 0.1
        x8, xs = fp8.quantize_rows(x.to(torch.bfloat16))
        b = fp8_gelu_mm.bounds(w8, ws, bias)
        exact = F.gelu((x8.float() @ w8.float().t()) * xs * ws + bias.float(), approximate="tanh")
        tflop = 2 * m * k * n / 1e12

        def cublas():
            return torch._scaled_mm(x8, w8.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=torch.bfloat16,
                                    use_fast_accum=True)

        def fused(c: Config):
            return fp8_gelu_mm.triton_gelu_mm(x8, xs, w8, ws, bias, b, c)

        tilings = {"fused {}x{}x{} w{} s{} g{}".format(*c): c for c in CONFIGS}
        candidates = {"cuBLAS bf16 out only": lambda: (cublas(), None),
                      "cuBLAS + GELU rows": lambda: fp8_gelu._triton_gelu_quantize(cublas()),
                      **{name: lambda c=c: fused(c) for name, c in tilings.items()}}

        def measure(out, ms):
            q, scale = out
            row = {"tflop_s": round(tflop / (ms / 1e3))}
            if scale is not None:
                row.update({key: round(v, 5) for key, v in errors(q, scale, exact).items()})
            return row

        rows = time_kernels(candidates, {"M": m, "K": k, "N": n}, device, args.iters, measure)
        for row in rows:
            if row["kernel"] in tilings and "error" not in row:
                first, again = fused(tilings[row["kernel"]]), fused(tilings[row["kernel"]])
                row["same_bytes"] = bool(torch.equal(first[0].view(torch.uint8), again[0].view(torch.uint8))
                                         and torch.equal(first[1], again[1]))
        results += rows
    save_and_print_rows(args.out, device, args, results, ("M", "K", "N"),
                        {"TFLOP/s": "tflop_s", "rel RMS err": "rel_rms", "max err / row max": "max_of_row",
                         "same bytes": "same_bytes"})


if __name__ == "__main__":
    main()
