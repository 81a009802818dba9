"""Two shard processes sharing one GPU give the same, complete output as one process.

    python jobs/shards_one_gpu.py --out outputs/gpu/shards_one_gpu.json [--rows 200] [--model tiny]

Writes a mixed-resolution manifest, runs the dataset job once as one process, then as
`shard.count=2` with both processes started at once on the same GPU and the same output.dir (the
last to finish merges). Checks: every id exactly once, _SUCCESS and merged stats present, every PNG
byte-identical to the one-process run. Prints a table and saves JSON. On two GPUs the same script
with `--devices cuda:0 cuda:1` is the scaling run of issue 9.
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
SIZES = [(64, 64), (64, 96), (128, 128)]  # (height, width); multiples of 16, valid for the tiny model


def write_manifest(path: Path, rows: int) -> None:
    table = [
        {"id": f"img-{i:05d}", "prompt": f"a photo of object {i % 37}", "width": SIZES[i % 3][1],
         "height": SIZES[i % 3][0], "seed": 1000 + i}
        for i in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(table), path)


def job(manifest: Path, out: Path, model: str, device: str, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "pipeline.run", "+job=dataset", f"model={model}", f"manifest.path={manifest}",
            f"output.dir={out}", f"runtime.device={device}", "runtime.progress=false", *extra]
    return subprocess.Popen(args, cwd=ROOT, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            sys.exit(f"job failed ({p.returncode}):\n{out[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200)
    p.add_argument("--model", default="tiny")
    p.add_argument("--devices", nargs=2, default=["cuda:0", "cuda:0"])
    p.add_argument("--work", type=Path, default=Path("/tmp/shards-one-gpu"))
    p.add_argument("--out", type=Path, default=Path("shards_one_gpu.json"))
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    manifest = args.work / "manifest.parquet"
    write_manifest(manifest, args.rows)
    single, sharded = args.work / "single", args.work / "sharded"

    start = time.perf_counter()
    finish([job(manifest, single, args.model, args.devices[0])])
    single_s = time.perf_counter() - start
    start = time.perf_counter()
    finish([job(manifest, sharded, args.model, dev, f"shard.index={i}", "shard.count=2") for i, dev in enumerate(args.devices)])
    sharded_s = time.perf_counter() - start

    ids = pq.read_table(sharded / "shards", columns=["id"]).column("id").to_pylist()
    images = sorted((single / "images").iterdir())
    identical = sum((sharded / "images" / f.name).read_bytes() == f.read_bytes() for f in images)
    stats = json.loads((sharded / "stats.json").read_text())
    result = {
        "rows": args.rows, "model": args.model, "devices": args.devices,
        "single_wall_s": single_s, "sharded_wall_s": sharded_s,
        "single_images_per_s": json.loads((single / "stats.json").read_text())["images_per_s"],
        "sharded_images_per_s": stats["images_per_s"],
        "ids_exactly_once": sorted(ids) == sorted(f"img-{i:05d}" for i in range(args.rows)),
        "success_marker": (sharded / "_SUCCESS").exists(),
        "pngs_identical": f"{identical}/{len(images)}",
        "per_shard_images": [s["images"]["ok"] for s in stats["shards"]],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| check | result |\n|---|---|")
    for k, v in result.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
