"""A local stage of an object-store output.dir, and the uploads that commit it there.

The job runs against a local directory exactly as it runs against any output.dir (its images,
staging journal, shard files, parts), and `Mirror` makes the store follow it:
- `pull` (at start, after the lock): the store's listing, and the files a resume reads: staged
  batches, the shard files' rows and index (a `parquet`-layout shard without its image column: the
  index and rows are all a resume and a merge read), parts and run-level files. Images and tars stay
  in the store.
- `sync` (a thread, every `SYNC_S`, and at the end): each file that appeared or changed locally is
  uploaded as one object (a PUT: whole or absent, no rename needed), in commit order: images, then
  staged batches, then tars, then shard `.parquet`s, then the rest, then parts. Files listed in the
  opposite order, so a file's prerequisites (written before it) are always in the listing. A file
  gone locally is deleted in the store one sync later, once whatever replaced it (a shard file for
  its staged batches) is uploaded. Run-level files are never uploaded from here: only `merge_store`
  writes them, from every shard's part in the store.
A process killed between a local commit and its upload loses that batch in the store only: the
next attempt makes it again, with the same bytes.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Iterator

import pyarrow.parquet as pq

from pipeline.card import CARD
from pipeline.completion import CONTACT_SHEET, STATS, SUCCESS
from pipeline.fsutil import TMP_PREFIX
from pipeline.layouts import IMAGE_FIELD, IMAGES_DIR, SHARDS_DIR, STAGING_DIR, write_parquet
from pipeline.merge import FAILED, PARTS_DIR, check_complete, merge, read_parts
from pipeline.report import RunReport
from pipeline.shard_files import INDEX_KEY
from pipeline.store import access_errors, download

LOCK_PREFIX = ".lock"  # the store's lease objects (pipeline.store_lock) and the stage's flock files (pipeline.guard)

log = logging.getLogger(__name__)

SYNC_S = 1.0
RUN_LEVEL = (FAILED, CARD, STATS, SUCCESS)  # written by merge_store, SUCCESS last
SKIPPED_DIRS = (".cache", ".hydra")  # caches (an older version kept kernels there); Hydra's files


class Mirror:
    """The store directory `root` on `fs` (`url`: how messages name it) and its local stage `local`."""

    def __init__(self, fs: Any, root: str, url: str, local: Path):
        self.fs, self.root, self.url, self.local = fs, root, url, Path(local)
        self.synced: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) as the store has it
        self._gone: set[str] = set()  # missing locally at the last sync: deleted in the store at the next
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.uploaded = 0

    # ---- start: what a resume reads ------------------------------------------------------------

    def pull(self) -> int:
        """An empty local stage, then the store's files that a resume reads; returns how many."""
        shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True)
        pulled = 0
        for rel in _resume_files(self.listing()):
            if self.fetch(rel, self.local):
                self.synced[rel] = _stat(self.local / rel)
                pulled += 1
        return pulled

    def fetch(self, rel: str, into: Path) -> bool:
        """The store's `rel` under `into` (a shard file as its index and rows); False if it went
        away since the listing: another shard's staged batch now in a shard file, or a part its
        shard is making again (this shard's own files change only under its lock)."""
        target = _parent(into / rel)
        try:
            if _is_shard(rel):
                copy_index_and_rows(self.fs, f"{self.root}/{rel}", target)
            else:
                download(self.fs, f"{self.root}/{rel}", target)
        except FileNotFoundError:
            return False
        return True

    def listing(self) -> list[str]:
        """Every object under the store directory, as paths relative to it."""
        self.fs.invalidate_cache(self.root)
        if not self.fs.exists(self.root):
            return []
        found = sorted(p[len(self.root) + 1:] for p in self.fs.find(self.root))
        self.fs.invalidate_cache(self.root)  # each read asks the store, not this listing
        return found

    # ---- while the job runs: uploads -----------------------------------------------------------

    def start(self) -> "Mirror":
        self._thread = threading.Thread(target=self._loop, name="store-sync", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> BaseException | None:
        """The last uploads (twice: the second applies the first one's deletions); returns the
        first error an upload met (None: everything committed locally is in the store)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.sync()
            self.sync()
        except access_errors() as err:
            return err
        return None

    def _loop(self) -> None:
        failing = False
        while not self._stop.wait(SYNC_S):
            try:
                self.sync()
            except access_errors() as err:  # the store unreachable for now: the job goes on locally, stop() tries last
                if not failing:
                    log.warning("uploading to %s failed (%s); trying again every %.0f s", self.url, err, SYNC_S)
                failing = True
                continue
            if failing:
                log.info("uploading to %s works again", self.url)
            failing = False

    def sync(self) -> None:
        with self._lock:
            present = dict(_local_files(self.local))
            for rel in (r for r in sorted(present, key=_rank) if r not in RUN_LEVEL):
                if self.synced.get(rel) != present[rel] and self._upload(rel):
                    self.synced[rel] = present[rel]
            for rel in sorted(self._gone - set(present), key=_rank):
                self._remove(rel)
            self._gone = {rel for rel in self.synced if rel not in present}

    def _upload(self, rel: str) -> bool:
        """False if the file went away since the listing (a staged batch now in its shard file,
        which the next sync uploads)."""
        try:
            self.fs.put_file(str(self.local / rel), f"{self.root}/{rel}")
        except FileNotFoundError as err:
            if Path(err.filename or "") != self.local / rel:
                raise
            return False
        self.uploaded += 1
        return True

    def _remove(self, rel: str) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{rel}")
        except FileNotFoundError:
            pass  # gone already: what this deletion wanted
        self.synced.pop(rel, None)

    # ---- the end: run-level files ----------------------------------------------------------------

    def merge(self, count: int | None = None) -> RunReport:
        """Every shard's part and shard index from the store into a local view, merged there, and
        the run-level files uploaded (`_SUCCESS` last); IncompleteError naming the URL if a shard's
        part is missing. `count`: the job's shard.count (parts of another count are ignored)."""
        self.sync()
        view = self.local.with_name(f"{self.local.name}.merge")
        shutil.rmtree(view, ignore_errors=True)
        try:
            return self._merge_in(view, count)
        finally:
            shutil.rmtree(view, ignore_errors=True)

    def _merge_in(self, view: Path, count: int | None) -> RunReport:
        listing = self.listing()
        for rel in (r for r in listing if r.startswith(f"{PARTS_DIR}/") or r == CARD):
            self.fetch(rel, view)  # a card not ours is kept as it is
        check_complete(read_parts(view, count), self.url)
        for rel in (r for r in listing if _is_shard(r)):
            self.fetch(rel, view)
        merged = merge(view, count)
        for name in RUN_LEVEL:
            if (view / name).is_file():
                self.fs.put_file(str(view / name), f"{self.root}/{name}")
            elif name in listing:
                self.fs.rm_file(f"{self.root}/{name}")  # failed.parquet of an earlier run: no failed row now
        return merged


def copy_index_and_rows(fs: Any, path: str, local: Path) -> None:
    """A shard's `.parquet` from the store without its image column (range reads: the image bytes
    are not downloaded); the footer, and so the shard index, as it is."""
    with fs.open(path, "rb") as f:
        shard = pq.ParquetFile(f)
        footer = shard.metadata.metadata or {}
        table = shard.read(columns=[n for n in shard.schema_arrow.names if n != IMAGE_FIELD.name])
    index = {INDEX_KEY: footer[INDEX_KEY]} if INDEX_KEY in footer else {}  # none: committed.py names the file
    write_parquet(local, table.schema, [table], index, None)


def _resume_files(listing: list[str]) -> list[str]:
    return [rel for rel in listing if not _skipped(rel) and not rel.startswith(f"{IMAGES_DIR}/")
            and not rel.endswith(".tar") and rel != CONTACT_SHEET]


def _local_files(local: Path) -> Iterator[tuple[str, tuple[int, int]]]:
    """(relative path, stat) of the stage's files, listed in the reverse of commit order."""
    folders = [(PARTS_DIR, "*"), ("", "*"), (SHARDS_DIR, "*.parquet"), (SHARDS_DIR, "*.tar"), (STAGING_DIR, "*"),
               (IMAGES_DIR, "*")]
    for folder, pattern in folders:
        for path in sorted((local / folder).glob(pattern)) if (local / folder).is_dir() else ():
            rel = path.relative_to(local).as_posix()
            if path.is_file() and not _skipped(rel):
                yield rel, _stat(path)


def _skipped(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.startswith((TMP_PREFIX, LOCK_PREFIX)) or rel.split("/", 1)[0] in SKIPPED_DIRS


def _is_shard(rel: str) -> bool:
    return rel.startswith(f"{SHARDS_DIR}/") and rel.count("/") == 1 and rel.endswith(".parquet")


def _rank(rel: str) -> int:
    """Commit order: a file is uploaded after every file it depends on."""
    if rel.startswith(f"{IMAGES_DIR}/"):
        return 0
    if rel.startswith(f"{STAGING_DIR}/"):
        return 1
    if rel.endswith(".tar"):
        return 2
    if _is_shard(rel):
        return 3
    return 5 if rel.startswith(f"{PARTS_DIR}/") else 4


def _stat(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def _parent(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
