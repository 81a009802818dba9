"""Finish a job made of shards: once every shard's part is complete, write the run-level
`stats.json` (with `failed.parquet`, the failed rows, and `README.md`, the dataset card that tells
`datasets.load_dataset` which files are the data) and then `_SUCCESS`.

Each process writes `parts/shard-<i>-of-<n>.json` (its own stats) when its batches are committed;
the last one to finish merges. By hand, or after a Slurm array:

    python -m pipeline.merge output.dir=outputs/my-dataset      # or output.dir=s3://bucket/my-dataset

exits 0 when merged, 4 (naming the missing shards) when some part is not complete, 2 when the
directory does not exist or its parts cannot be merged (parts of jobs with different shard.count).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import asdict, fields, replace
from pathlib import Path

import pyarrow as pa

from bcg.metrics import EngineTotals
from pipeline.completion import STATS, SUCCESS, success_record
from pipeline.card import write_card
from pipeline.committed import Committed, read_committed
from pipeline.errors import UserError
from pipeline.exit_codes import ExitCode
from pipeline.fsutil import atomic_write_table, atomic_write_text
from pipeline.report import ImageCounts, OutputReport, PartReport, Report, RunReport, ShardEntry
from pipeline.stats import per_second

PARTS_DIR = "parts"
FAILED = "failed.parquet"


class IncompleteError(RuntimeError):
    """Some shards have not committed their part yet."""


def part_path(out_dir: Path, shard_name: str) -> Path:
    return Path(out_dir) / PARTS_DIR / f"{shard_name}.json"


def read_parts(out_dir: Path, count: int | None = None) -> list[PartReport]:
    """Every shard's part; with `count`, only the parts of a job with that many shards."""
    folder = Path(out_dir) / PARTS_DIR
    parts = [PartReport.read(p) for p in sorted(folder.glob("shard-*.json"))] if folder.is_dir() else []
    return [p for p in parts if count is None or p.shard.count == count]


def committed_status(committed: Committed) -> Counter:
    """ok / failed rows over every shard file: what the dataset holds, whichever run made it."""
    status: Counter = Counter()
    for batch in committed.batches.values():
        if not batch.staged:
            status.update(ok=batch.entry.ok, failed=len(batch.entry.failed))
    return status


def committed_output(committed: Committed) -> OutputReport | None:
    """The shard files' layout, count and image bytes per format (None: no shard file yet)."""
    filed = [b for b in committed.batches.values() if not b.staged]
    if not filed:
        return None
    per_format: Counter = Counter()
    for batch in filed:
        per_format[batch.entry.format] += batch.entry.bytes
    return OutputReport(layout=filed[0].layout, shard_files=len(committed.shards()), bytes_per_format=dict(sorted(per_format.items())))


def write_failed(out_dir: Path, committed: Committed) -> None:
    """`failed.parquet`: every failed row of the shard files (they are in no data file), with its
    reason; removed when there is none."""
    rows = [r for b in committed.batches.values() if not b.staged for r in b.entry.failed]
    path = Path(out_dir) / FAILED
    if rows:
        atomic_write_table(path, pa.Table.from_pylist(sorted(rows, key=lambda r: r["id"])))
    else:
        path.unlink(missing_ok=True)


def missing_shards(parts: list[PartReport]) -> list[int] | None:
    """Indexes of shards with no part yet (None: no part at all, so the count is unknown)."""
    if not parts:
        return None
    count = parts[0].shard.count
    if any(p.shard.count != count for p in parts):
        counts = sorted({p.shard.count for p in parts})
        raise UserError(f"parts disagree on shard.count ({', '.join(map(str, counts))}): {PARTS_DIR}/ holds the "
                        "parts of jobs with different shard.count; run the job of the count you want again (it "
                        "removes the other parts), then merge")
    return sorted(set(range(count)) - {p.shard.index for p in parts})


def check_complete(parts: list[PartReport], where: Path | str) -> None:
    """IncompleteError naming `where` and the shards with no part yet, unless every shard has one."""
    missing = missing_shards(parts)
    if missing is None:
        raise IncompleteError(f"{where}: no shard has completed yet (no {PARTS_DIR}/shard-*.json)")
    if missing:
        raise IncompleteError(f"{where}: {len(missing)} of {parts[0].shard.count} shards not complete yet: {missing}")


def merge_stats(parts: list[PartReport], status: Counter, output: OutputReport | None = None) -> RunReport:
    """Run-level stats. `images.ok` / `failed` count the committed rows on disk (the dataset, over
    every run that added to it); `generated` what the last run of each shard made. With several
    shards the times are spans over all of them: `wall_s` from the first shard's start to the last
    one's end, `generate_s` from the first shard's first batch to the last one's end. As for one
    process, `images_per_s` is over the generate phase (after warm-up) and `wall_images_per_s` over
    the wall time, so one GPU's and several GPUs' stats compare directly. The rest (ladder, model,
    versions, config, gpu_memory...) is the first shard's that ran a batch (a shard whose batches a
    job of another shard.count committed built nothing); `shards` holds each shard's own."""
    first = next((p for p in parts if p.batches), parts[0])
    merged = {f.name: getattr(first, f.name) for f in fields(Report)}
    images = ImageCounts(**{f.name: sum(getattr(p.images, f.name) for p in parts) for f in fields(ImageCounts)})
    merged.update(
        images=replace(images, ok=status["ok"], failed=status["failed"]),
        output=output,
        batches=sum(p.batches for p in parts),
        padded_rows=sum(p.padded_rows for p in parts),
        oom_retries=sum(p.oom_retries for p in parts),
        stage_s=summed([p.stage_s for p in parts]),
        per_resolution=summed([p.per_resolution for p in parts]),
        batches_per_bucket=summed([p.batches_per_bucket for p in parts]),
    )
    if len(parts) > 1:  # one part keeps its own figures
        end = max(p.ended_at for p in parts)
        wall_s = round(end - min(p.started_at for p in parts), 4)
        generate_s = round(end - min(p.ended_at - p.generate_s for p in parts), 4)
        merged.update(wall_s=wall_s, generate_s=generate_s, images_per_s=per_second(images.generated, generate_s),
                      wall_images_per_s=per_second(images.generated, wall_s))
    entries = [ShardEntry(**{f.name: getattr(p, f.name) for f in fields(ShardEntry)}) for p in parts]
    bcg = first.bcg if len(parts) == 1 else EngineTotals.of([p.bcg for p in parts])
    return RunReport(**merged, bcg=bcg, shards=entries)


def summed(maps: list[dict]) -> dict:
    """Key by key over every map, sorted by key; float sums rounded as the parts round them."""
    total: Counter = Counter()
    for m in maps:
        total.update(m)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in sorted(total.items())}


def merge(out_dir: Path, count: int | None = None) -> RunReport:
    """Write stats.json then _SUCCESS if every shard is complete; IncompleteError otherwise.
    `count`: the job's shard.count (parts of a job with another count are ignored)."""
    parts = read_parts(out_dir, count)
    check_complete(parts, out_dir)
    committed = read_committed(out_dir)
    merged = merge_stats(parts, committed_status(committed), committed_output(committed))
    write_failed(out_dir, committed)
    if merged.output is not None:
        write_card(out_dir, merged.output.layout, merged.images.ok)
    merged.write(Path(out_dir) / STATS)
    atomic_write_text(Path(out_dir) / SUCCESS, success_record(parts[0].config))
    return merged


def main(argv: list[str]) -> int:
    dirs = [a.split("=", 1)[1] for a in argv if a.startswith("output.dir=")]
    if len(dirs) != 1 or len(argv) != 1:
        bare = argv[0] if len(argv) == 1 and "=" not in argv[0] and not argv[0].startswith("-") else None
        hint = f" (did you mean output.dir={bare}?)" if bare else ""
        print(f"usage: python -m pipeline.merge output.dir=DIR{hint}", file=sys.stderr)
        return ExitCode.USER_ERROR
    from pipeline.launch import merge_any
    from pipeline.store import is_url, local_path

    out_dir = dirs[0] if is_url(dirs[0]) else local_path(dirs[0])
    try:
        if not is_url(out_dir) and not Path(out_dir).is_dir():
            raise UserError(f"output.dir={out_dir}: no such directory")
        merged = merge_any(out_dir)  # an object store's URL: from its listing (pipeline.store_sync)
    except IncompleteError as err:
        print(err, file=sys.stderr)
        return ExitCode.INCOMPLETE
    except UserError as err:  # mixed shard counts, a part this version cannot read
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.USER_ERROR
    print(f"merged {len(merged.shards)} shard(s): {asdict(merged.images)} -> {dirs[0]}/{STATS}, {SUCCESS}")
    return ExitCode.DONE


if __name__ == "__main__":
    # `python -m` runs this file as __main__, a second copy of the module: the package's own (whose
    # IncompleteError the merge raises) catches what the merge raises
    from pipeline.merge import main as package_main

    sys.exit(package_main(sys.argv[1:]))
