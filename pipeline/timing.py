"""Timing for the benchmarks: one call's median time, candidate kernels timed on one shape as rows,
their markdown table and their JSON with the environment they ran in.

On CUDA a call is timed between two events (the GPU's time, the host's launches included only when
the GPU waits on them); on the CPU by the host's clock. The benchmarks under benchmarks/ use these;
they are here so that the tests can check them without importing a script.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bcg.engine import precision_flags

TIMING = "median of per-iteration CUDA event pairs (perf_counter on CPU)"


@torch.no_grad()
def time_calls(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of one `call()` over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        call()
        end.record()
    events[-1][1].synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def environment(device: torch.device, args: argparse.Namespace, dtype: torch.dtype = torch.bfloat16) -> dict:
    """What a benchmark's figures depend on: its command, versions, device, dtype, precision flags, how
    it timed, and its arguments (all but --out)."""
    import diffusers

    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "precision_flags": precision_flags(),
        "timing": TIMING,
        **{k: v for k, v in vars(args).items() if k != "out"},
    }


def time_kernels(candidates: dict[str, Callable[[], object]], shape: dict, device: torch.device, iters: int,
                 measure: Callable[[object, float], dict]) -> list[dict]:
    """One row per candidate kernel on one input shape: {**shape, "kernel", "ms", **measure(its output,
    ms)}, each printed as it is measured; a candidate that cannot be built or run (a block size this
    Triton refuses) is a row with its "error", not the end of the benchmark."""
    rows = []
    for name, fn in candidates.items():
        try:
            out = fn()
            ms = time_calls(fn, device, 3, iters)
        except Exception as error:  # noqa: BLE001 - reported in its row, the other candidates still run
            row = {**shape, "kernel": name, "error": f"{type(error).__name__}: {error}"[:300]}
        else:
            row = {**shape, "kernel": name, "ms": round(ms, 4), **measure(out, ms)}
        rows.append(row)
        print(row, flush=True)
    return rows


def rows_table(rows: list[dict], shape: tuple[str, ...], columns: dict[str, str]) -> list[str]:
    """time_kernels' rows as a markdown table: the shape's keys joined by ' x ', the kernel, its ms,
    then `columns` ({header: row key}); a row with an error shows it in place of the ms."""
    lines = [f"| {' x '.join(shape)} | kernel | ms | {' | '.join(columns)} |",
             "|" + "---|" * (3 + len(columns))]
    for r in rows:
        size = " x ".join(str(r[key]) for key in shape)
        if "error" in r:
            values = [r["error"][:80], *[""] * len(columns)]
        else:
            values = [r["ms"], *(r.get(key, "") for key in columns.values())]
        lines.append(f"| {size} | {r['kernel']} | {' | '.join(str(v) for v in values)} |")
    return lines


def save_rows(out: Path, device: torch.device, args: argparse.Namespace, rows: list[dict]) -> None:
    """A kernel benchmark's JSON: its environment and rows."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(device, args), "rows": rows}, indent=1))


def save_and_print_rows(out: Path, device: torch.device, args: argparse.Namespace, rows: list[dict],
                        shape: tuple[str, ...], columns: dict[str, str]) -> None:
    """A kernel benchmark's end: its JSON (save_rows), then its table (rows_table) and where the JSON is."""
    save_rows(out, device, args, rows)
    print("", *rows_table(rows, shape, columns), "", f"written: {out}", sep="\n")
