"""Background writer: PNG encoding and file writes on a thread behind a bounded queue.

One planned batch becomes its images (`images/<id>.png`) and one Parquet shard
(`shards/<batch key>.parquet`, one row per image). Every file is written under a temporary name and
renamed, so a reader never sees a partial file; the shard is renamed after its images, so a shard
on disk means its batch is complete. A write failure stops the job at the next `submit`, with the
error, and loses nothing already written.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
from PIL import Image

from pipeline.fsutil import atomic_write_bytes, atomic_write_table

IMAGES_DIR = "images"
SHARDS_DIR = "shards"

BASE_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("negative_prompt", pa.string()),
    pa.field("seed", pa.int64()),
    pa.field("width", pa.int64()),
    pa.field("height", pa.int64()),
    pa.field("bucket", pa.int64()),
    pa.field("batch_key", pa.string()),
    pa.field("steps", pa.int64()),
    pa.field("guidance_scale", pa.float64()),
    pa.field("model", pa.string()),
    pa.field("sampler", pa.string()),
    # digest of every other setting an image depends on (model config, precision, scope, ...)
    pa.field("settings", pa.string()),
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("path", pa.string()),
    pa.field("time_encode_s", pa.float64()),
    pa.field("time_noise_s", pa.float64()),
    pa.field("time_denoise_s", pa.float64()),
    pa.field("time_decode_s", pa.float64()),
]
IMAGE_FIELD = pa.field("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


RESERVED = frozenset(f.name for f in BASE_FIELDS) | {IMAGE_FIELD.name}


def shard_schema(extra: pa.Schema, embed_images: bool) -> pa.Schema:
    """Base columns, the optional image column, then the manifest's own extra columns (whose names
    must not be ours: `reserved_columns` says which are)."""
    fields = BASE_FIELDS + ([IMAGE_FIELD] if embed_images else [])
    return pa.schema(fields + list(extra))


def reserved_columns(extra: pa.Schema) -> list[str]:
    return sorted(RESERVED & set(extra.names))


class WriteError(RuntimeError):
    """Outputs could not be written (disk full, permission denied, ...): the job must stop."""


@dataclass
class BatchResult:
    key: str
    rows: list[dict[str, Any]]  # shard rows; "path" is set for rows with an image
    images: list[np.ndarray | None]  # [H, W, 3] uint8 per row, None for a failed row

    def resolve(self) -> "BatchResult":
        return self


class Pending(Protocol):
    """A batch whose results may still be on their way (pipeline.generate.PendingBatch)."""

    def resolve(self) -> BatchResult: ...


def encode_png(pixels: np.ndarray, compress_level: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG", compress_level=compress_level)
    return buf.getvalue()


class Writer:
    def __init__(self, out_dir: Path, schema: pa.Schema, queue_size: int, compress_level: int, embed_images: bool,
                 encode_threads: int = 1):
        self.out_dir = Path(out_dir)
        (self.out_dir / IMAGES_DIR).mkdir(parents=True, exist_ok=True)
        (self.out_dir / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
        self.schema = schema
        self.compress_level = compress_level
        self.embed_images = embed_images
        self.busy_s = 0.0
        self.error: BaseException | None = None  # writing failed
        self.failure: BaseException | None = None  # resolving a batch failed (a device error)
        # PNG encoding (zlib) releases the GIL: a batch's images encode in parallel, which shortens
        # the tail after the last batch and keeps up with large images.
        self._encoder = ThreadPoolExecutor(max_workers=max(encode_threads, 1), thread_name_prefix="png")
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
        ok = [(row, pixels) for row, pixels in zip(result.rows, result.images) if pixels is not None]
        encoded = self._encoder.map(lambda pixels: encode_png(pixels, self.compress_level), [p for _, p in ok])
        for (row, _), data in zip(ok, encoded):
            atomic_write_bytes(self.out_dir / row["path"], data)
            if self.embed_images:
                row["image"] = {"bytes": data, "path": row["path"]}
        table = pa.Table.from_pylist(result.rows, schema=self.schema)
        atomic_write_table(self.out_dir / SHARDS_DIR / f"{result.key}.parquet", table)
