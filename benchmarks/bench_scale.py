"""Scale on the CPU: a million-row manifest read, checked and planned; a million-image output's shard
files and the resume scan of it; a ten-million-row manifest split over 100 shard processes.

    python benchmarks/bench_scale.py --out outputs/benchmarks/scale.json [--work /tmp/bench-scale]
    python benchmarks/bench_scale.py --smoke --out /tmp/scale.json    # 20,000 and 200,000 rows: seconds

Every measurement runs in a child process of its own, so its peak memory is that process's maxrss;
the children run the functions the job runs for these steps, without torch:
1. `plan`: the manifest (`--rows`, synthetic: 60% 512 px, 25% 768 px, 15% 1024 px squares, in
   shuffled order) read and every row checked (`pipeline.manifest.scan_manifest`), planned on the
   ladder [1, 2, 4, 8, 16] and its items made (`pipeline.sharding.plan_shard`), as one process.
2. `output`: the output of that plan at the default `output.shard_size` in the `files` layout: its
   shard files as the writer leaves them (rows and footers; no image files, which this layout keeps
   apart), how many; then the resume scan of it: what is committed, from the footers
   (`pipeline.committed.read_committed`), and every batch compared with the plan
   (`pipeline.resume.find_conflicts`, by digest).
3. `big`: a manifest of `--big-rows` rows planned by processes 0, count/2 and count-1 of
   `shard.count=--shards`: each reads and checks every row (the plan depends on which rows are
   valid) and makes items for its own batches only.
Prints a table; `--out` gets the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LADDER = [1, 2, 4, 8, 16]
GRANULARITY, MAX_SIDE = 16, 2048  # PixArt-Sigma's (model_limits): VAE 8 x patch 2, twice its native 1024 px
ATTENTION_PIXELS = 1.77e6  # PixArt-Sigma's pipeline.models.attention_pixels: the cost split of shard.count > 1
SHARES = ((512, 0.60), (768, 0.25), (1024, 0.15))
FIELDS = {"steps": 20, "guidance_scale": 4.5, "model": "pixart-sigma", "sampler": "dpmpp_2m", "settings": "0" * 16,
          "format": "png", "quality": None}  # what every output row of the synthetic job says
IMAGE_BYTES = 1_500_000  # a 1024 px PNG's order of size, for the index's byte counts


def child_write_manifest(path: str, rows: str) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = int(rows)
    rng = np.random.default_rng(0)
    sides = np.array([s for s, _ in SHARES])[rng.choice(len(SHARES), rows, p=[p for _, p in SHARES])]
    order = pa.array(rng.permutation(rows)).cast(pa.string())
    ids = pc.binary_join_element_wise("img-", pc.utf8_lpad(order, 9, "0"), "")
    prompts = pc.binary_join_element_wise("a photo of subject ", order, ", in the style of painter ",
                                          pa.array(rng.integers(0, 5000, rows)).cast(pa.string()), "")
    table = pa.table({"id": ids, "prompt": prompts, "width": sides, "height": sides, "seed": np.arange(rows)})
    pq.write_table(table, path)
    return {"rows": rows}


def peak_mib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def plan(path: Path, count: int, index: int):
    """(manifest, plan, this process's batches, seconds to read and check, seconds to plan)."""
    from pipeline.manifest import scan_manifest
    from pipeline.sharding import ShardSpec, plan_shard

    start = time.perf_counter()
    manifest, bad = scan_manifest(path, GRANULARITY, MAX_SIDE)
    assert not bad, bad[:3]
    checked = time.perf_counter()
    whole, mine = plan_shard(manifest, LADDER, 1.0, None, ShardSpec(index, count), ATTENTION_PIXELS if count > 1 else None)
    return manifest, whole, mine, checked - start, time.perf_counter() - checked


def child_plan(path: str, count: str, index: str) -> dict:
    import numpy
    import pyarrow

    manifest, whole, mine, check_s, plan_s = plan(Path(path), int(count), int(index))
    return {"versions": {"python": platform.python_version(), "pyarrow": pyarrow.__version__, "numpy": numpy.__version__},
            "rows": len(manifest), "shard_count": int(count), "shard_index": int(index), "read_check_s": round(check_s, 2),
            "plan_s": round(plan_s, 2), "total_s": round(check_s + plan_s, 2), "batches": len(whole.batches),
            "own_batches": len(mine), "own_items": sum(b.size for b in mine), "peak_mib": peak_mib()}


def child_make_output(path: str, out: str) -> dict:
    """The `files` layout's shard files of the whole plan, as the writer would leave them."""
    import pyarrow as pa

    from pipeline.config import OutputConfig
    from pipeline.layouts import SHARDS_DIR, row_schema, write_parquet
    from pipeline.shard_files import BatchEntry, encode_index, file_stem, group_batches, planned_digest

    _, whole, mine, _, _ = plan(Path(path), 1, 0)
    start = time.perf_counter()
    out = Path(out)
    (out / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    schema = row_schema(pa.schema([]), with_image=False)
    by_key = {b.key: b for b in mine}
    groups = group_batches(whole.batches, mine, OutputConfig().shard_size)
    for group in groups:
        batches = [by_key[k] for k in group.keys]
        rows = [{**it.fields(), "bucket": b.bucket, "batch_key": b.key, **FIELDS, "status": "ok",
                 "path": f"images/{it.id}.png", "bytes": IMAGE_BYTES, "sha256": "0" * 64} for b in batches for it in b.items]
        entries = [BatchEntry(b.key, tuple(it.id for it in b.items), planned_digest(b, FIELDS), "png",
                              IMAGE_BYTES * b.size, ()) for b in batches]
        write_parquet(out / SHARDS_DIR / f"{file_stem(group.ordinals[0])}.parquet", schema,
                      [pa.Table.from_pylist(rows, schema=schema)], encode_index("files", entries), None)
    return {"images": whole.items, "shard_size": OutputConfig().shard_size, "shard_files": len(groups),
            "write_s": round(time.perf_counter() - start, 2)}


def child_resume_scan(path: str, out: str) -> dict:
    from pipeline.committed import read_committed
    from pipeline.resume import find_conflicts

    _, whole, mine, check_s, plan_s = plan(Path(path), 1, 0)
    start = time.perf_counter()
    committed = read_committed(Path(out))
    read_s = time.perf_counter() - start
    conflicts = find_conflicts(whole.batches, mine, committed, FIELDS, "files")
    compare_s = time.perf_counter() - start - read_s
    assert not conflicts, list(conflicts.items())[:3]
    left = [b for b in mine if b.key not in committed.batches]
    return {"shard_files": len(committed.shards()), "committed_batches": len(committed.batches), "batches_left": len(left),
            "read_footers_s": round(read_s, 2), "compare_s": round(compare_s, 2), "scan_s": round(read_s + compare_s, 2),
            "plan_first_s": round(check_s + plan_s, 2), "peak_mib": peak_mib()}


CHILDREN = {"write-manifest": child_write_manifest, "plan": child_plan, "make-output": child_make_output,
            "resume-scan": child_resume_scan}


def run_child(*args: str) -> dict:
    """A child process's figures. The parent imports neither numpy nor pyarrow, so that a child's
    peak memory is its own (Linux keeps maxrss across fork and exec)."""
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def manifest_of(work: Path, rows: int) -> Path:
    path = work / f"manifest_{rows}.parquet"
    if not path.exists():
        run_child("write-manifest", str(path), str(rows))
    return path


def table(r: dict) -> str:
    p, o, s = r["plan"], r["output"], r["resume_scan"]
    lines = ["| measurement | rows | seconds | peak MiB | target |", "|---|---|---|---|---|",
             f"| read, check and plan, one process | {p['rows']:,} | {p['total_s']} (read+check {p['read_check_s']}, "
             f"plan {p['plan_s']}) | {p['peak_mib']} | <= 10 s, <= 1,024 MiB |",
             f"| shard files of that job's output (output.shard_size={o['shard_size']}) | {o['images']:,} | - | - | "
             f"{o['shard_files']} files (target <= 1,000) |",
             f"| resume scan: footers, then every batch against the plan | {o['images']:,} | {s['scan_s']} (footers "
             f"{s['read_footers_s']}, compare {s['compare_s']}) | {s['peak_mib']} | <= 10 s |"]
    for b in r["big"]:
        lines.append(f"| shard {b['shard_index']} of shard.count={b['shard_count']}: read, check, plan its "
                     f"{b['own_items']:,} items | {b['rows']:,} | {b['total_s']} (read+check {b['read_check_s']}, "
                     f"plan {b['plan_s']}) | {b['peak_mib']} | <= 30 s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--big-rows", type=int, default=10_000_000)
    parser.add_argument("--shards", type=int, default=100)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-scale"))
    parser.add_argument("--out", type=Path, default=Path("scale.json"))
    parser.add_argument("--smoke", action="store_true", help="20,000 and 200,000 rows over 10 shards")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, *rest = args.child
        print(json.dumps(CHILDREN[name](*rest)))
        return
    if args.smoke:
        args.rows, args.big_rows, args.shards = 20_000, 200_000, 10
    args.work.mkdir(parents=True, exist_ok=True)
    small, big = manifest_of(args.work, args.rows), manifest_of(args.work, args.big_rows)
    out = args.work / f"output_{args.rows}"
    shutil.rmtree(out, ignore_errors=True)
    result = {"plan": run_child("plan", str(small), "1", "0"), "output": run_child("make-output", str(small), str(out)),
              "resume_scan": run_child("resume-scan", str(small), str(out)),
              "big": [run_child("plan", str(big), str(args.shards), str(i))
                      for i in sorted({0, args.shards // 2, args.shards - 1})]}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result["environment"] = {**result["plan"].pop("versions"), "cpus": len(os.sched_getaffinity(0)), "commit": commit or None}
    for big in result["big"]:
        big.pop("versions")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(table(result))


if __name__ == "__main__":
    main()
