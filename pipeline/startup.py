"""Where a process's start-up goes, from its start to its first batch: stats.json's `startup_s`
(`pipeline.report.StartupTimes`).

The job marks the end of each of its steps (`StartupClock.lap`); the time before the job began is
measured from the process's start as the kernel records it (Linux /proc), so it holds the
interpreter's start, the imports, Hydra and the config checks. A later job of the same process (a
one-process sweep, a caller's loop over `pipeline.job.run`) counts from the end of the one before it
(`job_ended`): what its launcher did between them, not the earlier jobs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.report import StartupTimes

STAGES = ("prepare", "build", "kernels", "calibrate", "prompts", "graphs")  # the job's laps, in order
# The packages whose import is most of `imports`: their bytecode decides whether a process compiles them from source.
IMPORTED = ("torch", "diffusers", "transformers", "hydra", "omegaconf")

log = logging.getLogger(__name__)

_last_job_end: float | None = None  # perf_counter when this process's last job ended (job_ended)


def imported_from_source() -> tuple[str, ...]:
    """The packages of IMPORTED this process imported without bytecode and could not save it for
    (PYTHONDONTWRITEBYTECODE, a read-only install): every process compiles them from source again,
    which is in `imports`. A module's `__cached__` names the bytecode file Python reads or writes."""
    missing = []
    for name in IMPORTED:
        cached = getattr(sys.modules.get(name), "__cached__", None)
        if cached and not Path(cached).exists():
            missing.append(name)
    return tuple(missing)


def say_imported_from_source(packages: tuple[str, ...]) -> None:
    """Once per job, where `packages` is not empty: why its start-up is slower and the fix."""
    if packages:
        places = sorted({str(Path(sys.modules[name].__file__).parent.parent) for name in packages})
        log.warning("startup: %s have no bytecode and Python writes none here (%s), so every process compiles them "
                    "from source, seconds of its start-up; compile them once: %s -m compileall -q %s",
                    ", ".join(packages), "PYTHONDONTWRITEBYTECODE is set" if sys.dont_write_bytecode else
                    "their directory is read-only", Path(sys.executable).name, " ".join(places))


def process_age_s() -> float | None:
    """Seconds since this process started (the kernel's start time, 10 ms steps); None where /proc
    does not say."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    # fields after the command name (which may hold spaces, in parentheses) start at field 3; starttime is 22
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def job_ended() -> None:
    """A job of this process ended: the next one's start-up counts from now."""
    global _last_job_end
    _last_job_end = time.perf_counter()


def before_this_job() -> float | None:
    """The seconds before this job began that are its start-up: the process's age for its first job
    (None where /proc does not say), the seconds since the last one ended for a later job."""
    if _last_job_end is not None:
        return time.perf_counter() - _last_job_end
    return process_age_s()


@dataclass(frozen=True)
class Preamble:
    """What the caller did in this process before the job began, which `imports` would otherwise
    hold: the model it built for the job (`build_s`, counted as the job's build) and other work that
    is not the job's start-up (`other_s`, e.g. +job=bench's diffusers baseline; counted nowhere)."""

    build_s: float
    other_s: float


@dataclass
class StartupClock:
    """The job's start-up laps: `lap(stage)` gives `stage` the seconds since the previous lap (or the
    job's start)."""

    before_job: float | None = field(default_factory=before_this_job)
    from_source: tuple[str, ...] = field(default_factory=imported_from_source)
    started: float = field(default_factory=time.perf_counter)
    laps: dict[str, float] = field(default_factory=dict)
    last: float | None = None

    def exclude(self, preamble: Preamble) -> None:
        """Take the caller's work out of `imports`; its model build goes to `build`."""
        if self.before_job is not None:
            self.before_job = max(self.before_job - preamble.build_s - preamble.other_s, 0.0)
        self.laps["build"] = self.laps.get("build", 0.0) + preamble.build_s

    def lap(self, stage: str) -> None:
        assert stage in STAGES, stage
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - (self.started if self.last is None else self.last)
        self.last = now

    def times(self, warmup_s: float, first_batch_at: float | None, generate_started: float | None,
              first_commit_at: float | None = None) -> StartupTimes:
        """The laps as stats.json reports them. The graphs lap splits into the engine's warm-up
        passes (`warmup_s`, its metrics) and the capture; `first_batch_at`: when the first batch's
        images reached the host, `first_commit_at` when it was committed (written where a resumed job
        finds it) (perf_counter), None when none ran."""
        lap = {stage: self.laps.get(stage, 0.0) for stage in STAGES}
        warmup = min(warmup_s, lap["graphs"])
        first = None if first_batch_at is None or generate_started is None else first_batch_at - generate_started
        total = None if first is None or self.before_job is None else self.before_job + first_batch_at - self.started
        committed = None if first_commit_at is None or self.before_job is None \
            else self.before_job + first_commit_at - self.started
        r = lambda seconds: None if seconds is None else round(seconds, 3)  # noqa: E731
        return StartupTimes(imports=r(self.before_job), prepare=r(lap["prepare"]), build=r(lap["build"]),
                            kernels=r(lap["kernels"]), calibrate=r(lap["calibrate"]), prompts=r(lap["prompts"]),
                            warmup=r(warmup), capture=r(lap["graphs"] - warmup), first_batch=r(first), total=r(total),
                            to_first_commit=r(committed), imported_from_source=list(self.from_source))
