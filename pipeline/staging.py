"""The staging journal: each committed batch as one small Parquet file,
`shards/.staging/<batch key>.parquet`, until the shard file that holds it is written.

A batch is committed when its staging file is renamed into place (after its images, in the `files`
layout); its footer holds its index entry, as a shard file's does (`pipeline.shard_files`). Once
every batch of a group is committed, the writer assembles the group's shard file from these, in plan
order, then removes them. A batch both staged and in a shard file (the process stopped between the
two) is in the shard file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.fsutil import TMP_PREFIX, fsync_dir
from pipeline.layouts import STAGING_DIR, write_parquet
from pipeline.shard_files import BatchEntry, encode_index


def staged_path(out_dir: Path, key: str) -> Path:
    return Path(out_dir) / STAGING_DIR / f"{key}.parquet"


def stage(out_dir: Path, layout: str, table: pa.Table, entry: BatchEntry) -> None:
    """Commit one batch: its rows (every one, ok or failed; with the image column where the layout
    embeds) and its index entry."""
    write_parquet(staged_path(out_dir, entry.key), table.schema, [table], encode_index(layout, [entry]), None)


def staged_files(out_dir: Path) -> list[Path]:
    folder = Path(out_dir) / STAGING_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix == ".parquet" and not p.name.startswith(TMP_PREFIX))


def load_staged(out_dir: Path, key: str) -> pa.Table:
    return pq.read_table(staged_path(out_dir, key))


def unstage(out_dir: Path, keys: Iterable[str]) -> None:
    """Remove these batches' staging files (they are in a shard file now, or being regenerated)."""
    removed = False
    for key in keys:
        path = staged_path(out_dir, key)
        if path.exists():
            os.unlink(path)
            removed = True
    if removed:
        fsync_dir(Path(out_dir) / STAGING_DIR)
