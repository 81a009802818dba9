"""What keeps an unattended job safe: one writer job per output.dir (one process per shard of it),
a clean stop on SIGINT/SIGTERM, and no stale temporary files from a process that died."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import time
from pathlib import Path

from pipeline.errors import UserError
from pipeline.exit_codes import ExitCode, stopped_text
from pipeline.fsutil import TMP_PREFIX
from pipeline.sharding import ShardSpec

log = logging.getLogger(__name__)


class LockedError(UserError):
    """Another live process holds the lock; the message says which."""


LOCK = ".lock"  # the directory's: held shared by every process of the job that writes it
GATE = ".lock-gate"  # held for the few calls that check and take LOCK, so that two jobs cannot both see it free
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP)


class JobLock:
    """One writer job per output.dir, one process per shard of it.

    Every process of a job holds `<output.dir>/.lock` shared (`flock`); the first one to take it
    writes the job's shard.count into it, so a process of a job with another count finds it held
    by that job and is refused. The check and the take happen under `.lock-gate`, held
    exclusively for those few calls: two processes that start at once see the same state, so
    two shards of one job both get in, and of two jobs with different counts only one does.
    Each process also holds `<output.dir>/.lock-<shard name>` exclusively: a second process of
    the same shard is refused. The files name their holders (pid, host, start time); the kernel
    drops a lock when its holder dies, so a crash never leaves the directory locked."""

    def __init__(self, out_dir: Path, shard: ShardSpec):
        self.out_dir = Path(out_dir)
        self.shard = shard
        self.path = self.out_dir / LOCK
        self.shard_path = self.out_dir / f"{LOCK}-{shard.name}"
        self._fds: list[int] = []

    def __enter__(self) -> "JobLock":
        self.out_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._fds.append(self._join_job())
            fd = _open(self.shard_path)
            self._fds.append(fd)
            if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.out_dir):
                raise _shard_held(self.out_dir, self.shard_path, fd, self.shard)
            _record(fd, _whoami())
        except BaseException:
            self.__exit__()
            raise
        return self

    def _join_job(self) -> int:
        """The directory lock, shared with this job's other shards; LockedError if a job with
        another shard.count holds it."""
        gate = _open(self.out_dir / GATE)
        try:
            _flock(gate, fcntl.LOCK_EX, self.out_dir)  # blocks only while another process is here
            fd = _open(self.path)
            try:
                if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.out_dir):  # no job holds it: this one is the first
                    _record(fd, f"shard.count={self.shard.count}: {_whoami()}")
                    fcntl.flock(fd, fcntl.LOCK_SH)  # a conversion, safe under the gate: nobody can take it meanwhile
                    return fd
                holder = _holder(fd)
                same_job = holder.startswith(f"shard.count={self.shard.count}:")
                if same_job and _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, self.out_dir):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
            raise _other_job(self.out_dir, self.path, holder, self.shard)
        finally:
            os.close(gate)  # releases the gate

    def __exit__(self, *exc) -> None:
        while self._fds:  # closing releases each flock; the files stay, naming the last holders
            os.close(self._fds.pop())


def check_free(out_dir: Path, shard: ShardSpec) -> None:
    """JobLock's refusals made without taking its locks or writing a file (the CLI checks before
    Hydra writes into output.dir): LockedError when a job with another shard.count holds `out_dir`,
    or a live process runs this shard there. The job takes the locks itself afterwards."""
    out_dir = Path(out_dir)
    gate = _open_existing(out_dir / GATE)
    if gate is None:
        return  # no job has locked this directory
    try:
        _flock(gate, fcntl.LOCK_EX, out_dir)  # as JobLock checks: never while a job is taking the lock
        fd = _open_existing(out_dir / LOCK)
        try:
            if fd is not None and not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, out_dir):
                holder = _holder(fd)
                if not (holder.startswith(f"shard.count={shard.count}:") and _flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, out_dir)):
                    raise _other_job(out_dir, out_dir / LOCK, holder, shard)
        finally:
            if fd is not None:
                os.close(fd)
    finally:
        os.close(gate)
    path = out_dir / f"{LOCK}-{shard.name}"
    fd = _open_existing(path)
    if fd is not None:
        try:
            if not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, out_dir):
                raise _shard_held(out_dir, path, fd, shard)
        finally:
            os.close(fd)


def _other_job(out_dir: Path, path: Path, holder: str, shard: ShardSpec) -> LockedError:
    return LockedError(f"{out_dir} is being written by a job with {holder} (lock {path}); this job has "
                       f"shard.count={shard.count}: wait for that job to finish, or use another output.dir")


def _shard_held(out_dir: Path, path: Path, fd: int, shard: ShardSpec) -> LockedError:
    return LockedError(f"{out_dir} is being written by {_holder(fd)}, which runs {shard.name} (lock {path}); wait "
                       "for it to finish, or use another output.dir")


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


def _open_existing(path: Path) -> int | None:
    """A lock file opened to test its lock (flock needs no write access); None where there is none."""
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None


def _flock(fd: int, operation: int, out_dir: Path) -> bool:
    """-> whether the lock was taken (False: another holder, with LOCK_NB)."""
    try:
        fcntl.flock(fd, operation)
    except OSError as err:
        if err.errno in _UNSUPPORTED:
            raise LockedError(f"{out_dir}: this file system does not support flock ({err.strerror}), so two runs "
                              "could write it at once; use an output.dir on a local or flock-capable file "
                              "system") from None
        if err.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        return False
    return True


def _whoami() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"


def _record(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)


def _holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"


class Interrupted(RuntimeError):
    def __init__(self, signum: int):
        super().__init__(stopped_text(signum))
        self.signum = signum
        self.exit_code = ExitCode.for_signal(signum)


# SIGINTs the CLI's handler received before a job's StopSignals took over (`interrupts_remembered`)
_REMEMBERED: list[int] = []


def _remember(signum, frame) -> None:
    _REMEMBERED.append(signum)
    raise KeyboardInterrupt


def interrupts_remembered():
    """The CLI's start, until a job's StopSignals takes over: SIGINT raises KeyboardInterrupt, as
    Python's own handler does, and is remembered, so that where a library swallows the exception (a
    bare `except:` around an optional import, which runs in ours) the job still stops, before it
    starts work. -> a function that puts the previous handler back."""
    previous = signal.signal(signal.SIGINT, _remember)
    return lambda: signal.signal(signal.SIGINT, previous)


class StopSignals:
    """SIGINT and SIGTERM set a flag instead of killing the process; the job checks it between
    batches, so it stops after the current batch is committed. Only in the main thread. A SIGINT
    remembered before (`interrupts_remembered`) is one received: the job's first check stops it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        if _REMEMBERED:
            self.received = _REMEMBERED.pop()
            _REMEMBERED.clear()
        return self

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # a second signal: stop now, as the default handler would
            self.__exit__()
            signal.raise_signal(signum)
            return
        log.warning("%s received: stopping after the current batch is committed (again to stop now)",
                    signal.Signals(signum).name)
        self.received = signum

    def check(self) -> None:
        if self.received is not None:
            raise Interrupted(self.received)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def remove_stale_tmp(out_dir: Path, dirs: tuple[str, ...]) -> int:
    """Delete temporary files left by dead processes of this host (a SIGKILL mid-write)."""
    host = socket.gethostname()
    removed = 0
    for d in dirs:
        folder = Path(out_dir) / d
        if not folder.is_dir():
            continue
        for path in folder.glob(f"{TMP_PREFIX}*"):
            if _tmp_owner_dead(path.name, host):
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def _tmp_owner_dead(name: str, host: str) -> bool:
    """Temporary names end in `@<host>@<pid>` (pipeline.fsutil); only this host's can be checked."""
    parts = name.rsplit("@", 2)
    if len(parts) != 3 or parts[1] != host or not parts[2].isdigit():
        return False
    return not process_running(int(parts[2]))


def process_running(pid: int) -> bool:
    """Whether process `pid` of this host still runs (one of another user's counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
