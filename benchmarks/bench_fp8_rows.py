"""PixArt's float8 row functions (pipeline.kernels.residual_rows), per kernel, at PixArt-Sigma's row counts.

    python benchmarks/bench_fp8_rows.py --out outputs/benchmarks/bench_fp8_rows.json

On a CUDA GPU with float8 tensor cores, each function the `fast-fp8` plan's blocks call, [M, 1152] bf16 rows:
`norm` (the previous feed-forward's gated output added, the layer norm, its modulation, the rows quantized),
`norm-ungated` (the cross-attention's output added), `add` (the gated self-attention's output added, the sum
quantized) and `quantize` (an attention's output), as
- `triton-R-W`: the Triton kernel (kernels.fp8_norm, the plan's) with R rows per program and W warps;
- `inductor`: compiled as compile_scope=norms compiles it (dynamic rows, NORM_ROWS_HINT, fixed tuning,
  persistent reductions: the plan before the Triton kernel).
Each: microseconds per call from a CUDA graph of 20 calls replayed (median of 20 replays, as bench_norm.py),
the share of the memory-bound time (the bytes each function must read and write, at `--bandwidth` GB/s),
whether the stream's bytes equal the torch functions', the share of float8 bytes equal to theirs, and whether
two calls give the same bytes. Prints a table; saves JSON.
"""

# ruff: noqa: E402
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import torch

from benchmarks.bench_norm import row_kernel_arguments, time_us
from pipeline.blocks.pixart_fp8 import row_functions
from pipeline.kernels import fp8, residual_rows
from pipeline.kernels.compile import TRACED_ONCE, compile_options

CHANNELS = 1152
ROWS = (2048, 32768, 65536, 131072)  # 512 px b1, 512 px b16, 1024 px b8, 1024 px b16 (CFG rows)
TRITON = ("4-4", "2-4", "1-4", "4-8")  # R-W (rows a program, warps)
# function -> (its name in residual_rows.RowFunctions, the arguments it takes, bytes read and written per value)
FUNCTIONS = {"norm": ("norm", ("rows", "update", "gate", "modulation"), 2 + 2 + 2 + 1),
             "norm-ungated": ("norm", ("rows", "update", None, "modulation"), 2 + 2 + 2 + 1),
             "add": ("add", ("rows", "update", "gate"), 2 + 2 + 2 + 1),
             "quantize": ("quantize", ("rows",), 2 + 1)}


def inputs(rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(rows)
    new = lambda *shape, s=1.0: (torch.randn(*shape, generator=g, device=device) * s).to(torch.bfloat16)  # noqa: E731
    return {"rows": new(rows, CHANNELS), "update": new(rows, CHANNELS), "gate": new(CHANNELS, s=0.2),
            "modulation": new(2, CHANNELS, s=0.2)}


def call(functions: residual_rows.RowFunctions, function: str, data: dict):
    """The function's call on `data`, as the blocks make it -> a callable of no arguments."""
    name, names, _ = FUNCTIONS[function]
    args = [None if n is None else data[n] for n in names]
    if name == "norm":
        return lambda: functions.norm(*args, 1e-6)
    return lambda: getattr(functions, name)(*args)


def inductor(cache: Path) -> residual_rows.RowFunctions:
    """The row functions compiled as compile_scope=norms compiled them, in an inductor cache of their own."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    os.environ["TRITON_CACHE_DIR"] = str(cache / "triton")
    torch._dynamo.reset()
    for key, value in TRACED_ONCE.items():  # as the job compiles (pipeline.kernels.compile)
        setattr(torch._dynamo.config, key, value)
    return row_functions({"dynamic": True, "options": compile_options("default", "fixed", True)})


def main() -> None:
    args = row_kernel_arguments(__doc__, ROWS, TRITON, "bench_fp8_rows.json").parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_rows.py needs a CUDA GPU")
    fp8.check_fp8(torch.device("cuda"), "bench_fp8_rows.py")
    device = torch.device("cuda")
    variants = {f"triton-{spec}": (lambda spec=spec: residual_rows.triton_functions(*(int(v) for v in spec.split("-"))))
                for spec in args.triton}
    variants["inductor"] = lambda: inductor(Path(tempfile.mkdtemp(prefix="bench-fp8-rows-")))
    data = {rows: inputs(rows, device) for rows in args.rows}
    result = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": args.rows, "us": {},
              "stream_equal": {}, "fp8_equal": {}, "same_bytes": {}}
    for variant, make in variants.items():
        functions = make()
        for function in FUNCTIONS:
            key = f"{variant} {function}"
            for table in ("us", "stream_equal", "fp8_equal", "same_bytes"):
                result[table][key] = {}
            for rows in args.rows:
                fn, eager = call(functions, function, data[rows]), call(residual_rows.EAGER, function, data[rows])
                got, again, want = fn(), fn(), eager()
                result["same_bytes"][key][rows] = all(torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                                                                  b.view(torch.uint8) if b.dtype == fp8.FP8 else b)
                                                      for a, b in zip(got, again))
                result["stream_equal"][key][rows] = function == "quantize" or bool(torch.equal(got[0], want[0]))
                result["fp8_equal"][key][rows] = round((got[-2].view(torch.uint8) == want[-2].view(torch.uint8))
                                                       .float().mean().item(), 5)
                result["us"][key][rows] = round(time_us(lambda *_: fn(), ()), 2)
            print(key, result["us"][key], flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{torch.__version__} on {result['device']}; us per call (share of the memory-bound time at "
          f"{args.bandwidth:.0f} GB/s); stream equal to torch's; float8 bytes equal; same bytes twice")
    print("| variant | function | " + " | ".join(str(r) for r in args.rows) + " | stream | float8 | same |")
    print("|---|---|" + "---|" * (len(args.rows) + 3))
    for key, us in result["us"].items():
        variant, function = key.split(" ")
        per_value = FUNCTIONS[function][2]
        cells = [f"{us[r]:.1f} ({r * CHANNELS * per_value / (args.bandwidth * 1e3) / us[r]:.0%})" for r in args.rows]
        print(f"| {variant} | {function} | " + " | ".join(cells) + f" | {all(result['stream_equal'][key].values())} | "
              f"{min(result['fp8_equal'][key].values()):.4f} | {all(result['same_bytes'][key].values())} |")


if __name__ == "__main__":
    main()
