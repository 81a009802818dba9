"""What is committed under output.dir: every batch in a shard file or staged, read from the footers
alone (`pipeline.shard_files`' index), so a resume of a million images reads a few hundred footers,
not its rows. The rows of a batch are read only when asked for (`Committed.rows`: to say what
changed in a batch whose digest differs), and `clear` takes batches out (output.on_conflict=overwrite).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.encoding import EXTENSIONS
from pipeline.errors import UserError
from pipeline.fsutil import TMP_PREFIX
from pipeline.layouts import IMAGE_FIELD, IMAGES_DIR, SHARDS_DIR, embeds, read_index, read_rows, read_samples, shard_paths
from pipeline.shard_files import COMPARED, BatchEntry
from pipeline.staging import stage, staged_files, unstage


class UnreadableOutput(UserError):
    """A file under shards/ that is not a whole shard of this version; the message names it."""


@dataclass(frozen=True)
class CommittedBatch:
    entry: BatchEntry
    layout: str  # the output.layout that wrote it
    source: Path  # its shard's `.parquet`, or its staging file
    staged: bool


@dataclass(frozen=True)
class Committed:
    out_dir: Path
    batches: dict[str, CommittedBatch]  # batch key -> where it is committed
    # filed batches whose staging file is still there (the writer stopped before removing it)
    staged_too: frozenset[str] = frozenset()

    @property
    def ids(self) -> int:
        return sum(len(b.entry.ids) for b in self.batches.values())

    def shards(self) -> list[Path]:
        """Every shard's `.parquet`, in name (plan) order."""
        return sorted({b.source for b in self.batches.values() if not b.staged})

    def rows(self, key: str) -> list[dict[str, Any]]:
        """A batch's rows, id and COMPARED, in batch order (read from its file)."""
        batch = self.batches[key]
        columns = ["id", *COMPARED]
        if batch.staged:
            return pq.read_table(batch.source, columns=columns).to_pylist()
        by_id = {r["id"]: r for r in read_rows(batch.source, [key], columns).to_pylist()}
        by_id.update({r["id"]: {c: r.get(c) for c in columns} for r in batch.entry.failed})
        return [by_id[i] for i in batch.entry.ids]


def read_committed(out_dir: Path) -> Committed:
    """Staged batches first, then shard files: a staging file removed in between is in a shard file
    by then (the writer writes the shard, then removes its staging files)."""
    out_dir = Path(out_dir)
    batches: dict[str, CommittedBatch] = {}
    for path in staged_files(out_dir):
        index = _index(path, missing_ok=True)
        if index is not None:
            layout, (entry,) = index
            batches[entry.key] = CommittedBatch(entry, layout, path, staged=True)
    folder = out_dir / SHARDS_DIR
    shards = sorted(p for p in folder.glob("*.parquet") if not p.name.startswith(TMP_PREFIX)) if folder.is_dir() else []
    filed: dict[str, Path] = {}
    staged = set(batches)
    for path in shards:
        layout, entries = _index(path)
        for entry in entries:
            if entry.key in filed:
                raise UnreadableOutput(f"batch {entry.key} is in two shard files, {filed[entry.key]} and {path}; "
                                       "delete one of them")
            filed[entry.key] = path
            batches[entry.key] = CommittedBatch(entry, layout, path, staged=False)
    return Committed(out_dir, batches, frozenset(staged & set(filed)))


def _index(path: Path, missing_ok: bool = False) -> tuple[str, list[BatchEntry]] | None:
    try:
        index = read_index(path)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise
    except (pa.ArrowInvalid, OSError) as err:  # cut short by a power loss, or not ours
        raise UnreadableOutput(f"{path} cannot be read as a committed shard ({err}); delete it to regenerate "
                               "its batches") from None
    if index is None:
        raise UnreadableOutput(f"{path} holds no shard index: it was not written by this version of bcg-datagen "
                               "(earlier versions wrote one file per batch); use another output.dir")
    return index


def clear(committed: Committed, keys: Iterable[str]) -> None:
    """Take these batches out of the output (their images too), so that they are generated again.
    A shard file holding one of them is taken apart: its other batches go back to staging, and
    their group is written again once the cleared ones are committed."""
    keys = set(keys)
    out_dir = committed.out_dir
    by_shard: dict[Path, list[CommittedBatch]] = defaultdict(list)
    for key in sorted(keys):
        batch = committed.batches[key]
        if batch.staged:
            unstage(out_dir, [key])
        else:
            by_shard[batch.source].append(batch)
        _remove_images(out_dir, batch)
    for meta, cleared in sorted(by_shard.items()):
        layout, entries = _index(meta)
        _restage(out_dir, layout, meta, [e for e in entries if e.key not in keys])
        for path in reversed(shard_paths(out_dir, layout, meta.stem)):  # the index first
            path.unlink(missing_ok=True)


def _remove_images(out_dir: Path, batch: CommittedBatch) -> None:
    if embeds(batch.layout):
        return
    failed = {r["id"] for r in batch.entry.failed}
    images = Path(out_dir) / IMAGES_DIR
    for row_id in batch.entry.ids:
        image = images / f"{row_id}.{EXTENSIONS[batch.entry.format]}"
        if row_id not in failed and image.parent == images:  # an id read back from disk: stay inside
            image.unlink(missing_ok=True)


def _restage(out_dir: Path, layout: str, meta: Path, keep: list[BatchEntry]) -> None:
    """The batches `keep` of a shard, staged again as the writer staged them."""
    if not keep:
        return
    schema = pq.read_schema(meta).with_metadata(None)
    if embeds(layout) and IMAGE_FIELD.name not in schema.names:
        schema = schema.insert(schema.get_field_index("sha256") + 1, IMAGE_FIELD)
    rows: dict[str, dict[str, dict]] = defaultdict(dict)
    wanted = {e.key for e in keep}
    for row, data in read_samples(out_dir, layout, meta) if embeds(layout) else ((r, None) for r in read_rows(meta).to_pylist()):
        if row["batch_key"] in wanted:
            if data is not None:
                row[IMAGE_FIELD.name] = {"bytes": data, "path": f"{row['id']}.{EXTENSIONS[row['format']]}"}
            rows[row["batch_key"]][row["id"]] = row
    for entry in keep:
        for failed in entry.failed:
            rows[entry.key][failed["id"]] = failed
        table = pa.Table.from_pylist([rows[entry.key][i] for i in entry.ids], schema=schema)
        stage(out_dir, layout, table, entry)


def read_images(out_dir: Path, ids: set[str] | None = None) -> dict[str, bytes]:
    """id -> encoded image, for every sample of the shard files (of `ids` only, if given), in any
    layout. All in memory: for comparisons and contact sheets, not for a whole large dataset."""
    committed = read_committed(out_dir)
    layouts = {b.source: b.layout for b in committed.batches.values() if not b.staged}
    return {row["id"]: data for meta in committed.shards() for row, data in read_samples(out_dir, layouts[meta], meta, ids)}
