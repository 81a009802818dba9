"""kernels.fuse_residual's modulated layer norm, per kernel, at PixArt-Sigma's row counts.

    python benchmarks/bench_norm.py --out outputs/benchmarks/bench_norm.json

On a CUDA GPU: pipeline.blocks.pixart.modulated_norm ([M, 1152] bf16 rows, fp32 pending, bf16 scale and shift) as
- `inductor-fixed`: compiled as kernels=fast compiled it before its Triton kernel (dynamic rows,
  NORM_ROWS_HINT, fixed tuning, dynamo's TRACED_ONCE settings);
- `inductor-fixed-hint-H`: the same with another row-count hint H;
- `inductor-timed`: compile_tuning=timed, compile_mode=coordinate-descent (its chosen block sizes
  printed);
- `triton-R-W`: pipeline.kernels.norm's kernel (kernels=fast's) with R rows per program and W warps.
Each: microseconds per call, from a CUDA graph of 20 calls replayed (median of 20 replays), at each row
count of `--rows` (2 x batch x tokens: CFG rows of 512, 768 and 1024 px buckets), the share of the
memory-bound time (bytes read and written at `--bandwidth` GB/s), the max difference from the fp32
eager norm, and whether two calls give the same bytes. Every variant compiles in a fresh dynamo and an
inductor cache of its own. Prints a table; saves JSON.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch

from pipeline.kernels import norm as triton_norm
from pipeline.blocks import pixart as residual
from pipeline.kernels.compile import TRACED_ONCE, compile_options

CHANNELS = 1152
ROWS = (2048, 9216, 16384, 36864, 65536, 131072)  # 512 px b1, 768 px b2, 512 px b8, 768 px b8, 1024 px b8, 1024 px b16
TRITON = ("4-4", "4-2", "4-8", "2-2", "2-4", "2-8", "1-2", "1-4", "1-8")  # R-W, R <= norm.TILE / 2048


def inputs(rows: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, CHANNELS, generator=g, device=device).to(torch.bfloat16)
    pending = torch.randn(CHANNELS, generator=g, device=device) * 0.1
    modulation = (torch.randn(2, CHANNELS, generator=g, device=device) * 0.2).to(torch.bfloat16)
    return x, pending, modulation


def time_us(fn, args, calls: int = 20, replays: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def inductor_variant(tuning: str, mode: str, hint: int, cache: Path):
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    torch._dynamo.reset()
    for key, value in TRACED_ONCE.items():  # as the job compiles it (pipeline.kernels.compile)
        setattr(torch._dynamo.config, key, value)
    residual.NORM_ROWS_HINT = hint
    fn = residual.compiled_norm(True, compile_options(mode, tuning))
    return lambda x, p, m: fn(x, p, m, 1e-6)


def best_configs(cache: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(p.read_text()).items() if k not in ("triton_cache_hash",)}
            for p in sorted(cache.rglob("*.best_config"))]


def row_kernel_arguments(doc: str, rows: tuple[int, ...], triton: tuple[str, ...], out: str) -> argparse.ArgumentParser:
    """The arguments of a benchmark of row kernels (this one's, bench_fp8_rows.py's): row counts, Triton's
    rows per program and warps, the memory's rate, the JSON's path."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=list(rows))
    p.add_argument("--triton", nargs="*", default=list(triton), help="R-W: rows per program, warps")
    p.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s for the memory-bound time")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / out)
    return p


def main() -> None:
    p = row_kernel_arguments(__doc__, ROWS, TRITON, "bench_norm.json")
    p.add_argument("--hints", type=int, nargs="*", default=[4096, 16384, 262144])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    work = Path(tempfile.mkdtemp(prefix="bench-norm-"))
    variants = {"inductor-fixed": ("fixed", "default", residual.NORM_ROWS_HINT)}
    variants |= {f"inductor-fixed-hint-{h}": ("fixed", "default", h) for h in args.hints}
    variants["inductor-timed"] = ("timed", "coordinate-descent", residual.NORM_ROWS_HINT)
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": args.rows, "us": {},
              "max_diff": {}, "same_bytes": {}, "best_configs": {}}
    data = {rows: inputs(rows, device) for rows in args.rows}
    reference = {rows: residual.modulated_norm(*data[rows], 1e-6).float() for rows in args.rows}

    def measure(name: str, fn) -> None:
        result["us"][name], result["max_diff"][name], result["same_bytes"][name] = {}, {}, {}
        for rows in args.rows:
            x, pending, modulation = data[rows]
            a, b = fn(x, pending, modulation), fn(x, pending, modulation)
            result["same_bytes"][name][rows] = bool(torch.equal(a, b))
            result["max_diff"][name][rows] = (a.float() - reference[rows]).abs().max().item()
            result["us"][name][rows] = round(time_us(fn, (x, pending, modulation)), 2)
        print(name, result["us"][name], flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    for spec in args.triton:
        r, w = (int(v) for v in spec.split("-"))
        measure(f"triton-{spec}", lambda x, p_, m, r=r, w=w: triton_norm.modulated_norm(x, p_, m, 1e-6, r, w))
    for name, (tuning, mode, hint) in variants.items():
        cache = work / name
        measure(name, inductor_variant(tuning, mode, hint, cache))
        result["best_configs"][name] = best_configs(cache)
    args.out.write_text(json.dumps(result, indent=2))
    bound = {rows: rows * CHANNELS * 2 * 2 / (args.bandwidth * 1e3) for rows in args.rows}  # us
    print(f"\n{torch.__version__} on {result['device']}; us per call (share of the memory-bound time at "
          f"{args.bandwidth:.0f} GB/s); max |diff| from fp32 eager; same bytes twice")
    print("| variant | " + " | ".join(str(r) for r in args.rows) + " | max diff | same bytes |")
    print("|---|" + "---|" * (len(args.rows) + 2))
    for name, us in result["us"].items():
        cells = [f"{us[r]:.1f} ({bound[r] / us[r]:.0%})" for r in args.rows]
        print(f"| {name} | " + " | ".join(cells) + f" | {max(result['max_diff'][name].values()):.4f} | "
              f"{all(result['same_bytes'][name].values())} |")
    for name, configs in result["best_configs"].items():
        if configs:
            print(name, "chose", configs)


if __name__ == "__main__":
    main()
