"""Finish a job made of shards: once every shard's part is complete, write the run-level
`stats.json` and then `_SUCCESS`.

Each process writes `parts/shard-<i>-of-<n>.json` (its own stats) when its batches are committed;
the last one to finish merges. By hand, or after a Slurm array:

    python -m pipeline.merge output.dir=outputs/my-dataset

exits 0 when merged, 1 (naming the missing shards) when some part is not complete.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.fsutil import atomic_write_text
from pipeline.stats import per_second
from pipeline.writer import SHARDS_DIR

PARTS_DIR = "parts"
SUCCESS = "_SUCCESS"
STATS = "stats.json"
SUMMED = ("batches", "padded_rows", "oom_retries")
ENGINE_SUMMED = ("graphs_captured", "capture_s", "warmup_s", "hits", "misses", "eager_calls", "padded_rows")
SUMMED_MAPS = ("stage_s", "per_resolution", "batches_per_bucket")


class IncompleteError(RuntimeError):
    """Some shards have not committed their part yet."""


def part_path(out_dir: Path, shard_name: str) -> Path:
    return Path(out_dir) / PARTS_DIR / f"{shard_name}.json"


def read_parts(out_dir: Path, count: int | None = None) -> list[dict]:
    """Every shard's part; with `count`, only the parts of a job with that many shards."""
    folder = Path(out_dir) / PARTS_DIR
    parts = [json.loads(p.read_text()) for p in sorted(folder.glob("shard-*.json"))] if folder.is_dir() else []
    return [p for p in parts if count is None or p["shard"]["count"] == count]


def committed_status(out_dir: Path) -> Counter:
    """ok / failed rows over every committed shard file: what the dataset holds, whichever run made it."""
    shards = Path(out_dir) / SHARDS_DIR
    if not shards.is_dir() or not any(shards.glob("*.parquet")):
        return Counter()
    return Counter(pq.read_table(shards, columns=["status"]).column("status").to_pylist())


def missing_shards(parts: list[dict]) -> list[int] | None:
    """Indexes of shards with no part yet (None: no part at all, so the count is unknown)."""
    if not parts:
        return None
    count = parts[0]["shard"]["count"]
    if any(p["shard"]["count"] != count for p in parts):
        counts = sorted({p["shard"]["count"] for p in parts})
        raise UserError(f"parts disagree on shard.count ({counts}): one output.dir holds two different jobs")
    return sorted(set(range(count)) - {p["shard"]["index"] for p in parts})


def merge_stats(parts: list[dict], status: Counter) -> dict:
    """Run-level stats. `images.ok` / `failed` count the committed rows on disk (the dataset, over
    every run that added to it); `generated` what the last run of each shard made. With several
    shards the times are spans over all of them: `wall_s` from the first shard's start to the last
    one's end, `generate_s` from the first shard's first batch to the last one's end. As for one
    process, `images_per_s` is over the generate phase (after warm-up) and `wall_images_per_s` over
    the wall time, so one GPU's and several GPUs' stats compare directly."""
    first = parts[0]
    merged = {k: v for k, v in first.items() if k not in ("shard", "started_at", "ended_at")}
    merged["bcg"] = first["bcg"] if len(parts) == 1 else merge_engine_metrics([p["bcg"] for p in parts])
    generated = sum(p["images"]["ok"] for p in parts)
    merged["images"] = {k: sum(p["images"][k] for p in parts) for k in first["images"]}
    merged["images"].update(ok=status["ok"], failed=status["failed"], generated=generated)
    for key in SUMMED:
        merged[key] = sum(p[key] for p in parts)
    for key in SUMMED_MAPS:
        total: Counter = Counter()
        for p in parts:
            total.update(p[key])
        merged[key] = {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(total.items())}
    if len(parts) > 1:  # one part keeps its own figures
        end = max(p["ended_at"] for p in parts)
        merged["wall_s"] = round(end - min(p["started_at"] for p in parts), 4)
        merged["generate_s"] = round(end - min(p["ended_at"] - p["generate_s"] for p in parts), 4)
        merged["images_per_s"] = per_second(generated, merged["generate_s"])
        merged["wall_images_per_s"] = per_second(generated, merged["wall_s"])
    merged["shards"] = [
        {"shard": p["shard"], "device": p["device"], "images": p["images"], "wall_s": p["wall_s"],
         "generate_s": p["generate_s"], "images_per_s": p["images_per_s"], "per_resolution": p["per_resolution"],
         "bcg": p["bcg"]}
        for p in parts
    ]
    return merged


def merge_engine_metrics(metrics: list[dict]) -> dict:
    """Engine totals over shards (per-graph records stay in each shard's entry)."""
    out = {k: sum(m[k] for m in metrics) for k in ENGINE_SUMMED}
    out["active"] = any(m["active"] for m in metrics)
    out["pool_bytes_max"] = max(m["pool_bytes"] for m in metrics)
    return out


def merge(out_dir: Path, count: int | None = None) -> dict:
    """Write stats.json then _SUCCESS if every shard is complete; IncompleteError otherwise.
    `count`: the job's shard.count (parts of a job with another count are ignored)."""
    parts = read_parts(out_dir, count)
    missing = missing_shards(parts)
    if missing is None:
        raise IncompleteError(f"{out_dir}: no shard has completed yet (no {PARTS_DIR}/shard-*.json)")
    if missing:
        count = parts[0]["shard"]["count"]
        raise IncompleteError(f"{out_dir}: {len(missing)} of {count} shards not complete yet: {missing}")
    merged = merge_stats(parts, committed_status(out_dir))
    atomic_write_text(Path(out_dir) / STATS, json.dumps(merged, indent=2, default=str))
    atomic_write_text(Path(out_dir) / SUCCESS, "")
    return merged


def main(argv: list[str]) -> int:
    dirs = [a.split("=", 1)[1] for a in argv if a.startswith("output.dir=")]
    if len(dirs) != 1 or len(argv) != 1:
        print("usage: python -m pipeline.merge output.dir=DIR", file=sys.stderr)
        return 2
    try:
        merged = merge(Path(dirs[0]))
    except IncompleteError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"merged {len(merged['shards'])} shard(s): {merged['images']} -> {dirs[0]}/{STATS}, {SUCCESS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
