"""Shard files: which batches go into which file, and the index each file keeps of them. Pure.

A process cuts its batches (its slice of the plan, in plan order) into groups of consecutive
batches holding at most `output.shard_size` images; a group becomes one shard file once every
batch of it is committed. So a file's contents depend only on the plan, shard.index/count and
shard_size, never on when a process was stopped. A file is named by the plan position of the
first batch it holds (`shards/00001234.<ext>`): processes own disjoint batches, so two never write
the same file; and a group whose first batches were filed already (by a run with another
shard.count or shard_size) names its file after the first batch it adds, so no file is ever
replaced by one with other contents.

Each shard file (and each staged batch) carries, in its Parquet footer, one `BatchEntry` per batch:
its ids, a digest of what its rows were made from (`COMPARED`), its bytes and its failed rows. A
resume reads these footers, not the rows: the job compares digests, and reads the rows of a batch
only where its digest differs, to say what changed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from pipeline.planner import Batch

# Output columns that must equal what the job would write now for a committed row to count as done.
# The first are the manifest row's own (planned_digest reads them off an Item in this order), the
# rest the same for every row of a job (`fields`).
OWN = ("prompt", "negative_prompt", "seed", "width", "height")
JOB_WIDE = ("steps", "guidance_scale", "model", "sampler", "settings", "format", "quality")
COMPARED = OWN + JOB_WIDE
INDEX_KEY = b"bcg_datagen"  # the Parquet footer's key-value entry that holds the index


@dataclass(frozen=True)
class ShardGroup:
    keys: tuple[str, ...]  # batch keys, plan order
    ordinals: tuple[int, ...]  # their positions in the plan


def group_batches(plan_batches: Sequence[Batch], mine: Sequence[Batch], shard_size: int) -> list[ShardGroup]:
    """`mine` (a contiguous slice of `plan_batches`) cut into groups of consecutive batches of at
    most `shard_size` images each (a batch larger than that alone)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    position = {b.key: i for i, b in enumerate(plan_batches)} if mine else {}
    groups: list[ShardGroup] = []
    keys: list[str] = []
    images = 0
    for batch in mine:
        if keys and images + len(batch.items) > shard_size:
            groups.append(ShardGroup(tuple(keys), tuple(position[k] for k in keys)))
            keys, images = [], 0
        keys.append(batch.key)
        images += len(batch.items)
    if keys:
        groups.append(ShardGroup(tuple(keys), tuple(position[k] for k in keys)))
    return groups


def file_stem(ordinal: int) -> str:
    """The shard file of a group whose first batch (among those it holds) is plan batch `ordinal`."""
    return f"{ordinal:08d}"


@dataclass(frozen=True)
class BatchEntry:
    """One committed batch as a shard file's index lists it."""

    key: str
    ids: tuple[str, ...]  # every row, batch order
    digest: str  # batch_digest of its rows
    format: str  # output.format of its images
    bytes: int  # encoded image bytes of its ok rows
    failed: tuple[dict[str, Any], ...]  # the metadata rows of its failed rows (they are in no data file)

    @property
    def ok(self) -> int:
        return len(self.ids) - len(self.failed)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "ids": list(self.ids), "digest": self.digest, "format": self.format,
                "bytes": self.bytes, "failed": list(self.failed)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BatchEntry":
        return cls(d["key"], tuple(d["ids"]), d["digest"], d["format"], d["bytes"], tuple(d["failed"]))


def entry_of(key: str, rows: Sequence[Mapping[str, Any]], fmt: str) -> BatchEntry:
    """The index entry of a batch's rows, as the writer commits them."""
    failed = tuple({k: v for k, v in r.items() if k != "image"} for r in rows if r["status"] != "ok")
    return BatchEntry(key, tuple(r["id"] for r in rows), rows_digest(rows), fmt,
                      sum(r["bytes"] for r in rows if r["status"] == "ok"), failed)


def encode_index(layout: str, entries: Iterable[BatchEntry]) -> dict[bytes, bytes]:
    return {INDEX_KEY: json.dumps({"layout": layout, "batches": [e.to_dict() for e in entries]},
                                  default=str, separators=(",", ":")).encode()}


def decode_index(metadata: Mapping[bytes, bytes] | None) -> tuple[str, list[BatchEntry]] | None:
    """(layout, entries) from a Parquet footer's key-value metadata; None if it holds no index."""
    if not metadata or INDEX_KEY not in metadata:
        return None
    index = json.loads(metadata[INDEX_KEY])
    return index["layout"], [BatchEntry.from_dict(e) for e in index["batches"]]


def norm(field: str, value: Any) -> Any:
    # A missing negative prompt means "" (diffusers' default): the same image either way.
    return (value or "") if field == "negative_prompt" else value


def rows_digest(rows: Sequence[Mapping[str, Any]]) -> str:
    """What a batch's rows were made from: each one's id and OWN values, and the JOB_WIDE values
    they share (the writer's rows of one batch always do)."""
    (job_wide,) = {tuple(r[f] for f in JOB_WIDE) for r in rows}
    return _digest(job_wide, [(r["id"], *(norm(f, r[f]) for f in OWN)) for r in rows])


def planned_digest(batch: Batch, fields: Mapping[str, Any]) -> str:
    """The digest a committed batch must have to be this job's `batch` (`fields`: the job-wide
    values of its rows)."""
    return _digest(tuple(fields[f] for f in JOB_WIDE),
                   [(it.id, it.prompt, it.negative_prompt or "", it.seed, it.width, it.height) for it in batch.items])


def _digest(job_wide: tuple, own: list[tuple]) -> str:
    # repr writes each of these values (str, int, float, None) one way, and tells them apart
    return hashlib.sha256(repr((job_wide, own)).encode()).hexdigest()[:32]
