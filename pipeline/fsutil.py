"""Files that appear complete or not at all: write under a temporary name, then rename."""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

TMP_PREFIX = ".tmp-"


def _tmp_path(path: Path) -> Path:
    """`.tmp-<name>@<host>@<pid>`: hidden from readers, and traceable to its writer so a resumed job
    can delete what a dead process left (pipeline.guard.remove_stale_tmp)."""
    return path.with_name(f"{TMP_PREFIX}{path.name}@{socket.gethostname()}@{os.getpid()}")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    tmp = _tmp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_table(path: str | os.PathLike, table: pa.Table) -> None:
    with atomic_file(path) as f:
        pq.write_table(table, f)


def fsync_dir(folder: Path) -> None:
    """Make the rename itself durable: after a power loss the file is there whole, or not at all."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: it appears under its name, whole and on disk, when the
    block ends without an error; on an error the temporary file is removed."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
