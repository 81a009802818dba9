"""What a job counts and times while it runs; `figures` hands them to its report (pipeline.report)."""

from __future__ import annotations

import os
import platform
import signal
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from pipeline.planner import size_label
from pipeline.report import ImageCounts
from pipeline.startup import StartupClock

STAGES = ("encode", "noise", "denoise", "decode")
# Tests: SIGTERM this process once that many batches are done, to stop a job as a user does (the batches
# queued by then are committed, the job ends with the signal's exit status).
STOP_AFTER_BATCHES = "BCG_STOP_AFTER_BATCHES"
LIBRARIES = ("torch", "diffusers", "transformers", "hydra-core", "omegaconf", "pyarrow", "numpy", "pillow")


class StageTimer:
    """Times the stages of one batch. On CUDA it records events (no host sync); `seconds()` reads
    them once the batch's results have been waited for."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: dict[str, tuple] = {}

    @contextmanager
    def stage(self, name: str):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.marks[name] = (start, end)

    def seconds(self) -> dict[str, float]:
        if self.cuda:
            return {k: s.elapsed_time(e) / 1000 for k, (s, e) in self.marks.items()}
        return {k: e - s for k, (s, e) in self.marks.items()}


@dataclass
class RunStats:
    """The generate phase's counts (the writer thread adds each batch) and the job's clocks."""

    oom_retries: int = 0
    ok: int = 0
    failed: int = 0
    batches: int = 0
    padded_rows: int = 0
    stage_s: Counter = field(default_factory=Counter)
    per_resolution: Counter = field(default_factory=Counter)
    per_bucket: Counter = field(default_factory=Counter)
    started: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)  # wall clock, to merge shards that ran apart
    generate_started: float | None = None
    first_batch_at: float | None = None  # perf_counter when the first batch's images reached the host
    startup: StartupClock = field(default_factory=StartupClock)
    stop_after: int | None = field(default_factory=lambda: int(os.environ[STOP_AFTER_BATCHES])
                                   if os.environ.get(STOP_AFTER_BATCHES) else None)

    def add_batch(self, height: int, width: int, bucket: int, real: int, ok: int, stages: dict[str, float]) -> None:
        if self.first_batch_at is None:
            self.first_batch_at = time.perf_counter()
        self.batches += 1
        if self.batches == self.stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        self.ok += ok
        self.failed += real - ok
        self.padded_rows += bucket - real
        self.per_resolution[size_label(height, width)] += real
        self.per_bucket[str(bucket)] += 1
        self.stage_s.update(stages)

    def figures(self, planned: int, skipped: int, invalid: int) -> dict[str, Any]:
        """The counts and times of a `PartReport`, as of now, by field name."""
        now = time.perf_counter()
        generate_s = now - (self.generate_started or now)
        return dict(
            images=ImageCounts(planned=planned, ok=self.ok, failed=self.failed, skipped=skipped, invalid=invalid,
                               generated=self.ok),
            oom_retries=self.oom_retries,
            batches=self.batches,
            padded_rows=self.padded_rows,
            wall_s=round(now - self.started, 4),
            started_at=self.started_at,
            ended_at=time.time(),
            generate_s=round(generate_s, 4),
            images_per_s=per_second(self.ok, generate_s),
            wall_images_per_s=per_second(self.ok, now - self.started),
            stage_s={k: round(v, 4) for k, v in self.stage_s.items()},
            per_resolution=dict(sorted(self.per_resolution.items())),
            batches_per_bucket=dict(sorted(self.per_bucket.items(), key=lambda kv: int(kv[0]))),
        )


def per_second(count: int, seconds: float) -> float | None:
    """A rate for stats.json: None when no time passed."""
    return round(count / seconds, 4) if seconds > 0 else None


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda or ""
        out["gpu"] = torch.cuda.get_device_name()
    return out
