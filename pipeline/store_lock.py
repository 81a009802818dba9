"""The lock of an object-store output.dir: one lease object per shard, `<output.dir>/.lock-<shard name>`.

An object store has no flock, so a process holds its shard by writing a small JSON object naming
it (host, pid, shard.count, a random token) and the time its lease ends, and renews the lease
while it runs (every third of `LEASE_S`). A lock is live until its lease ends; one whose holder is
on this host and no longer running is free at once (a killed process, a retried Ray task).
The rule for who may write, as `pipeline.guard.JobLock` has it for a local directory:
- a live lock of a job with another shard.count refuses this process (another job writes there);
- a live lock of this shard held by another process refuses it, or with `wait_s` waits up to that
  long for the lease to end (a Ray task retried on another host while its dead attempt's lease runs);
- a lock is taken by writing it, then reading it back `SETTLE_S` later: of two processes that take
  the same shard within that time, the one whose write landed last proceeds and the other is refused.
Leases compare the holder's clock with the reader's: the machines' clocks must agree (NTP) to well
within `LEASE_S`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any

from pipeline.guard import LockedError, process_running
from pipeline.sharding import ShardSpec
from pipeline.store import access_errors, reaching

log = logging.getLogger(__name__)

LEASE_S = 60.0
SETTLE_S = 1.0
PREFIX = ".lock-"


class StoreLock:
    """Hold `shard` of the object-store directory `root` on `fs` (`url`: how messages name it)."""

    def __init__(self, fs: Any, root: str, url: str, shard: ShardSpec, wait_s: float = 0.0):
        self.fs, self.url, self.shard, self.wait_s = fs, url, shard, wait_s
        self.root = root
        self.path = f"{root}/{PREFIX}{shard.name}"
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def __enter__(self) -> "StoreLock":
        with reaching("output.dir", self.url, f"taking the lock {self.url}/{PREFIX}{self.shard.name}"):
            return self._take()

    def _take(self) -> "StoreLock":
        deadline = time.time() + self.wait_s
        while True:
            holder = self._blocking_holder()
            if holder is None:
                self._write()
                time.sleep(SETTLE_S)
                holder = self._read(self.path)
                if holder is None:  # removed meanwhile (its holder released a lock we overwrote): again
                    continue
                if holder.get("token") == self.token:
                    break
            if time.time() >= deadline or holder.get("count") != self.shard.count:
                raise LockedError(self._message(holder))
            time.sleep(min(5.0, max(deadline - time.time(), 0.1)))
        self._renewer = threading.Thread(target=self._renew, name="store-lock", daemon=True)
        self._renewer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        held = self._read(self.path)
        if held is not None and held.get("token") == self.token:
            self.fs.rm_file(self.path)

    def _blocking_holder(self) -> dict[str, Any] | None:
        """The first live lock that this process may not pass: another job's, or this shard's."""
        self.fs.invalidate_cache(self.root)
        for path in sorted(self.fs.glob(f"{self.root}/{PREFIX}shard-*")):
            held = self._read(path)
            if held is None or not _live(held):
                continue
            if held.get("count") != self.shard.count or path == self.path:
                return held
        return None

    def _message(self, held: dict[str, Any]) -> str:
        other = held.get("count") != self.shard.count
        who = f"{held.get('holder')} (shard.count={held.get('count')}, lease until {_clock(held.get('expires'))})"
        if other:
            return (f"{self.url} is being written by a job with another shard.count: {who}; this job has "
                    f"shard.count={self.shard.count}: wait for that job to finish, or use another output.dir")
        return (f"{self.url} is being written by {who}, which runs {self.shard.name} (lock {self.url}/"
                f"{PREFIX}{self.shard.name}); wait for it to finish, or use another output.dir")

    def _write(self) -> None:
        body = {"holder": f"pid {os.getpid()} on {socket.gethostname()}", "host": socket.gethostname(),
                "pid": os.getpid(), "count": self.shard.count, "token": self.token, "expires": time.time() + LEASE_S}
        self.fs.pipe_file(self.path, json.dumps(body).encode())

    def _read(self, path: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except ValueError:  # not ours, or cut short: names no holder, so it holds nothing
            return {"holder": f"an unreadable lock object {path}", "expires": 0}

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 3):
            try:
                self._write()
            except access_errors() as err:  # the store is unreachable for now: the next renewal tries again
                log.warning("renewing the lock %s failed (%s); retrying in %.0f s", self.path, err, LEASE_S / 3)


def _live(held: dict[str, Any]) -> bool:
    if float(held.get("expires") or 0) < time.time():
        return False
    pid = held.get("pid")
    return not (held.get("host") == socket.gethostname() and isinstance(pid, int) and not process_running(pid))


def _clock(epoch: Any) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(epoch or 0)))
