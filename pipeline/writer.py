"""Background writer: image encoding and file writes on a thread behind a bounded queue.

One planned batch is committed as its images (`images/<id>.<ext>` in the `files` layout) and then
its staging file (`pipeline.staging`: its rows, the image bytes where the layout embeds them, its
index entry). Once every batch of a shard group is committed, the group becomes its shard file
(`pipeline.layouts`), assembled from the staging files in plan order, so a shard's bytes do not
depend on where an earlier run stopped. Every file is written under a temporary name and renamed,
so a reader never sees a partial file. A write failure stops the job at the next `submit`, with
the error, and loses nothing already committed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from pipeline.committed import read_committed
from pipeline.encoding import Encoding, encode_image
from pipeline.fsutil import atomic_write_bytes
from pipeline.layouts import (IMAGE_FIELD, IMAGES_DIR, SHARDS_DIR, STAGING_DIR, embeds, image_path, reserved_columns,
                              row_schema, write_shard)
from pipeline.shard_files import BatchEntry, ShardGroup, entry_of, file_stem
from pipeline.staging import load_staged, stage, unstage

__all__ = ["IMAGES_DIR", "SHARDS_DIR", "BatchResult", "Output", "WriteError", "Writer", "reserved_columns", "row_schema"]

log = logging.getLogger(__name__)


class WriteError(RuntimeError):
    """Outputs could not be written (disk full, permission denied, ...): the job must stop."""


@dataclass(frozen=True)
class Output:
    """What the writer makes of a batch: `output.layout`, the image encoding, the rows' columns."""

    layout: str
    encoding: Encoding
    schema: pa.Schema  # a staged batch's columns: row_schema(extras, embeds(layout))


@dataclass
class BatchResult:
    key: str
    rows: list[dict[str, Any]]  # output rows, without path / bytes / sha256 (the writer sets them)
    images: list[np.ndarray | None]  # [H, W, 3] uint8 per row, None for a failed row

    def resolve(self) -> "BatchResult":
        return self


class Pending(Protocol):
    """A batch whose results may still be on their way (pipeline.generate.PendingBatch)."""

    def resolve(self) -> BatchResult: ...


class Writer:
    def __init__(self, out_dir: Path, output: Output, groups: list[ShardGroup], queue_size: int, encode_threads: int = 1):
        self.out_dir = Path(out_dir)
        for folder in ((IMAGES_DIR,) if not embeds(output.layout) else ()) + (SHARDS_DIR, STAGING_DIR):
            (self.out_dir / folder).mkdir(parents=True, exist_ok=True)
        self.output = output
        self.busy_s = 0.0
        self.bytes_per_format: Counter = Counter()  # encoded image bytes this run wrote
        self.first_commit_at: float | None = None  # perf_counter when this run's first batch was committed
        self.error: BaseException | None = None  # writing failed
        self.failure: BaseException | None = None  # resolving a batch failed (a device error)
        self.assembler = Assembler(self.out_dir, output, groups)
        # Encoders (zlib, libjpeg, libwebp) release the GIL: a batch's images encode in parallel,
        # which shortens the tail after the last batch and keeps up with large images.
        self._encoder = ThreadPoolExecutor(max_workers=max(encode_threads, 1), thread_name_prefix="encode")
        self._queue: queue.Queue[Pending | None] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._loop, name="writer", daemon=True)
        self._thread.start()

    def submit(self, result: Pending) -> None:
        """Queue a batch; blocks while the queue is full. Raises the writer's error, if it had one.
        The thread resolves it (waits for the device) before writing."""
        self._raise_if_failed()
        self._queue.put(result)

    def close(self) -> None:
        """Drain the queue and stop the thread; raises the writer's error, if it had one."""
        self._queue.put(None)
        self._thread.join()
        self._encoder.shutdown()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure
        if self.error is not None:
            raise WriteError(f"writing outputs under {self.out_dir} failed: {self.error}") from self.error

    def _loop(self) -> None:
        while (pending := self._queue.get()) is not None:
            if self.error is not None or self.failure is not None:
                continue  # after a failure, drain without writing: the job is stopping
            try:
                result = pending.resolve()
            except Exception as err:  # noqa: BLE001 - not swallowed: re-raised by the main thread
                self.failure = err
                continue
            start = time.perf_counter()
            try:
                self._write(result)
            except Exception as err:  # noqa: BLE001 - not swallowed: re-raised by the main thread
                self.error = err
            self.busy_s += time.perf_counter() - start

    def _write(self, result: BatchResult) -> None:
        layout, encoding = self.output.layout, self.output.encoding
        ok = [(row, pixels) for row, pixels in zip(result.rows, result.images) if pixels is not None]
        encoded = self._encoder.map(lambda pixels: encode_image(encoding, pixels), [p for _, p in ok])
        for row in result.rows:
            row.update(path=None, bytes=None, sha256=None)
        for (row, _), image in zip(ok, encoded):
            row.update(path=image_path(layout, row["id"], encoding.ext), bytes=len(image.data), sha256=image.sha256)
            if embeds(layout):
                row[IMAGE_FIELD.name] = {"bytes": image.data, "path": f"{row['id']}.{encoding.ext}"}
            else:
                atomic_write_bytes(self.out_dir / row["path"], image.data)
        entry = entry_of(result.key, result.rows, encoding.format)
        stage(self.out_dir, layout, pa.Table.from_pylist(result.rows, schema=self.output.schema), entry)
        self.bytes_per_format[encoding.format] += entry.bytes
        if self.first_commit_at is None:
            self.first_commit_at = time.perf_counter()
        self.assembler.committed(entry)


class Assembler:
    """Writes a group's shard file once every batch of it is committed, and removes the staging
    files it was made from. Starts by writing the groups that an earlier run committed whole but
    did not assemble. Only this process's groups: another process of the job owns the others."""

    def __init__(self, out_dir: Path, output: Output, groups: list[ShardGroup]):
        self.out_dir, self.output = out_dir, output
        self.shard_files = 0  # written by this run
        committed = read_committed(out_dir)
        filed = {k for k, b in committed.batches.items() if not b.staged}
        self._staged: dict[str, BatchEntry] = {k: b.entry for k, b in committed.batches.items() if b.staged}
        self._groups: list[tuple[ShardGroup, list[str]]] = []  # each with its batches that no shard holds yet
        self._left: dict[str, int] = {}  # batch key -> its group, while not committed
        self._remaining: dict[int, set[str]] = {}
        mine = {k for g in groups for k in g.keys}
        unstage(out_dir, sorted(mine & committed.staged_too))  # stopped between a shard and its cleanup
        self._remove_unfinished_tars(groups, filed)
        for g, group in enumerate(groups):
            pending = [k for k in group.keys if k not in filed]
            self._groups.append((group, pending))
            remaining = {k for k in pending if k not in self._staged}
            self._remaining[g] = remaining
            self._left.update({k: g for k in remaining})
            if pending and not remaining:
                self._assemble(g)

    def committed(self, entry: BatchEntry) -> None:
        self._staged[entry.key] = entry
        g = self._left.pop(entry.key)
        self._remaining[g].discard(entry.key)
        if not self._remaining[g]:
            self._assemble(g)

    def _assemble(self, g: int) -> None:
        group, pending = self._groups[g]
        stem = file_stem(group.ordinals[group.keys.index(pending[0])])
        tables = (load_staged(self.out_dir, key) for key in pending)
        write_shard(self.out_dir, self.output.layout, stem, self.output.schema, tables,
                    [self._staged[k] for k in pending])
        unstage(self.out_dir, pending)
        for key in pending:
            del self._staged[key]
        self.shard_files += 1

    def _remove_unfinished_tars(self, groups: list[ShardGroup], filed: set[str]) -> None:
        """A tar whose `.parquet` never came (the process stopped between the two) holds batches
        that are still staged; it is written again, perhaps under another name. Only tars named
        after this process's batches: another process may be between the two right now."""
        shards = self.out_dir / SHARDS_DIR
        unfinished = {p.stem for p in shards.glob("*.tar")} - {p.stem for p in shards.glob("*.parquet")}
        mine = {file_stem(o) for g in groups for k, o in zip(g.keys, g.ordinals) if k not in filed}
        for stem in sorted(unfinished & mine):
            (shards / f"{stem}.tar").unlink()
