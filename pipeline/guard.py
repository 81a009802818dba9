"""What keeps an unattended job safe: one writer per output part, a clean stop on SIGINT/SIGTERM,
and no stale temporary files from a process that died."""

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
from pipeline.exit_codes import ExitCode
from pipeline.fsutil import TMP_PREFIX

log = logging.getLogger(__name__)


class LockedError(UserError):
    """Another live process holds the lock; the message says which."""


class JobLock:
    """An exclusive `flock` on `<output.dir>/.lock-<part>`; the file names the holder (pid, host,
    start time) so a second run can say who holds it. The kernel drops the lock when the holder
    dies, so a crash never leaves the directory locked."""

    def __init__(self, out_dir: Path, part: str):
        self.path = Path(out_dir) / f".lock-{part}"
        self._fd: int | None = None

    def __enter__(self) -> "JobLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.ENOSYS, errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                os.close(fd)
                raise LockedError(f"{self.path.parent}: this file system does not support flock ({err.strerror}), "
                                  "so two runs could write it at once; use an output.dir on a local or "
                                  "flock-capable file system") from None
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "an unknown process"
            os.close(fd)
            raise LockedError(f"{self.path.parent} is being written by {holder} (lock {self.path}); "
                              "wait for it to finish, or use another output.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays, naming the last holder
            self._fd = None


class Interrupted(RuntimeError):
    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; committed batches are kept, "
                         "run the same command again to finish")
        self.exit_code = ExitCode.for_signal(signum)


class StopSignals:
    """SIGINT and SIGTERM set a flag instead of killing the process; the job checks it between
    batches, so it stops after the current batch is committed. Only in the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
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
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
