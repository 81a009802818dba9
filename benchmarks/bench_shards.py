"""One process against N shard processes: the same images, and images/s each way.

    python benchmarks/bench_shards.py --out outputs/benchmarks/shards.json [--rows 200] [--model tiny]
        [--manifest M] [--launcher popen|local_gpus|ray] [--shards 2] [--devices cuda:0 cuda:0]
        [-- OVERRIDE ...]

Runs the dataset job (`+job=dataset`, the given model, any extra Hydra overrides) once as one
process on the first device, then as `shard.count=N` into a fresh output.dir:
- `--launcher popen`: N processes started at once, shard i on `--devices[i]`. The default,
  two processes on one GPU, checks that shards sharing a device still give complete, correct output.
- `--launcher local_gpus`: the README's multi-GPU command, a Hydra multirun through
  hydra-submitit-launcher's local executor, one process per GPU (`runtime.device=auto`).
- `--launcher ray`: `cluster=ray`, one Ray task per shard with a GPU of its own on a Ray cluster of
  this machine (docs/clusters.md); with `--devices cpu ...`, tasks without GPUs (a CPU check).
Each run compiles (where its kernels do) into its own empty cache, so neither reuses the other's;
with `--shared-cache` the shards load what the one-process run compiled and tuned.
Checks: every id exactly once, _SUCCESS and the merged stats.json, and every image against the
one-process run (byte-identical, or else the largest difference in levels and the PSNR). Figures:
each command's wall time and images/s over the generate phase and over the whole run, from
stats.json, and each shard's device and images. Without `--manifest`, writes a mixed manifest of
`--rows` rows at sizes valid for the tiny model. Prints a table and saves JSON.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline.compare import compare
from pipeline.merge import STATS
from pipeline.planner import size_label
from pipeline.report import RunReport
from pipeline.stats import per_second

SIZES = [(64, 64), (64, 96), (128, 128)]  # (height, width); multiples of 16, valid for the tiny model


def write_manifest(path: Path, rows: int) -> None:
    table = [
        {"id": f"img-{i:05d}", "prompt": f"a photo of object {i % 37}", "width": SIZES[i % 3][1],
         "height": SIZES[i % 3][0], "seed": 1000 + i}
        for i in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)


def start(*overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "pipeline.run", *overrides]
    return subprocess.Popen(args, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen], log: Path) -> None:
    outputs = [p.communicate()[0] for p in procs]
    log.write_text("\n".join(outputs))
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            sys.exit(f"job failed ({p.returncode}), log {log}:\n{out[-3000:]}")


def timed(procs: list[subprocess.Popen], log: Path) -> float:
    began = time.perf_counter()
    finish(procs, log)
    return time.perf_counter() - began


def rates(stats: RunReport, command_s: float) -> dict:
    return {"images": stats.images.ok, "command_s": round(command_s, 2), "wall_s": stats.wall_s,
            "generate_s": stats.generate_s, "images_per_s": stats.images_per_s,
            "wall_images_per_s": stats.wall_images_per_s, "command_images_per_s": per_second(stats.images.ok, command_s)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--manifest", type=Path, help="an existing manifest instead of the written one")
    p.add_argument("--model", default="tiny")
    p.add_argument("--launcher", choices=["popen", "local_gpus", "ray"], default="popen")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--devices", nargs="+", default=["cuda:0", "cuda:0"], help="the one-process run's is the first; popen: shard i's runtime.device; ray: cpu for tasks without GPUs")
    p.add_argument("--shared-cache", action="store_true", help="the shards reuse the one-process run's compile cache")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-shards"))
    p.add_argument("--out", type=Path, default=Path("shards.json"))
    p.add_argument("overrides", nargs="*", help="after --: Hydra overrides for every run")
    args = p.parse_args(argv)
    if args.launcher == "popen" and len(args.devices) != args.shards:
        p.error(f"--devices names {len(args.devices)} devices for --shards {args.shards}")
    args.work.mkdir(parents=True, exist_ok=True)
    manifest = args.manifest or args.work / "manifest.parquet"
    if not args.manifest:
        write_manifest(manifest, args.rows)
    single, sharded = args.work / "single", args.work / "sharded"
    common = ["+job=dataset", f"model={args.model}", f"manifest.path={Path(manifest).resolve()}", "runtime.progress=false", *args.overrides]

    def cache(name: str) -> str:
        return f"kernels.compile_cache_dir={args.work / ('inductor-' + name)}"

    single_s = timed([start(*common, f"output.dir={single}", f"runtime.device={args.devices[0]}", cache("single"))],
                     args.work / "single.log")
    shard_args = [*common, f"output.dir={sharded}", f"shard.count={args.shards}", cache("single" if args.shared_cache else "sharded")]
    if args.launcher == "popen":
        procs = [start(*shard_args, f"runtime.device={dev}", f"shard.index={i}") for i, dev in enumerate(args.devices)]
    elif args.launcher == "ray":
        procs = [start(*shard_args, "cluster=ray", f"cluster.gpus_per_shard={0 if args.devices[0] == 'cpu' else 1}")]
    else:
        procs = [start("-m", *shard_args, "hydra/launcher=local_gpus", f"hydra.launcher.gpus_per_node={args.shards}",
                       f"shard.index=range({args.shards})", f"hydra.sweep.dir={args.work / 'sweep'}")]
    sharded_s = timed(procs, args.work / "sharded.log")

    ids = pq.read_table(sharded / "shards", columns=["id"]).column("id").to_pylist()
    rows = pq.read_table(manifest, columns=["id", "height", "width"]).to_pylist()
    stats = {name: RunReport.read(d / STATS) for name, d in (("single", single), ("sharded", sharded))}
    one, many = rates(stats["single"], single_s), rates(stats["sharded"], sharded_s)
    result = {
        "rows": len(rows), "model": args.model, "launcher": args.launcher, "shards": args.shards,
        "shared_cache": args.shared_cache,
        "overrides": args.overrides, "gpu": stats["single"].versions.get("gpu"),
        "ids_exactly_once": sorted(ids) == sorted(r["id"] for r in rows),
        "success_marker": (sharded / "_SUCCESS").exists(),
        "single": one, "sharded": many,
        "speedup": {k: round(many[k] / one[k], 3) for k in ("images_per_s", "wall_images_per_s", "command_images_per_s")},
        "per_shard": [{"index": s.shard.index, "device": s.device, "images": s.images.ok, "generate_s": s.generate_s,
                       "images_per_s": s.images_per_s, "per_resolution": s.per_resolution} for s in stats["sharded"].shards],
    }
    save(args.out, result)  # the figures first: the image comparison below reads every image twice
    images = compare(single, sharded, per_image=True)
    size = {r["id"]: size_label(r["height"], r["width"]) for r in rows}
    by_size: dict[str, list[int]] = {}
    for image in images.pop("per_image"):
        counts = by_size.setdefault(size[image["id"]], [0, 0])
        counts[0] += image["max_levels"] == 0
        counts[1] += 1
    result["images_vs_one_process"] = {**images, "identical_per_resolution": {k: f"{a}/{n}" for k, (a, n) in sorted(by_size.items())}}
    save(args.out, result)


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print("| check | result |\n|---|---|")
    for k, v in result.items():
        print(f"| {k} | {v} |", flush=True)


if __name__ == "__main__":
    main()
