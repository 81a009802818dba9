"""One planned batch on the device, queued without waiting for it.

`submit_batch` queues a batch's work (conditioning, noise, denoise, decode, the uint8 conversion and
the finite check, and the copy of both into pinned host memory) and returns a `PendingBatch` at
once; the writer thread resolves it (waits for its event, builds its rows) while the main thread
queues the next batch. So the GPU never waits for PNG encoding or Parquet writes. `Lookahead`
prepares the next batch's inputs (`prepare_batch`: tokenizing, drawing its noise) between a batch's
denoise and its decode, while the GPU runs the denoise, so the GPU does not wait for that host work
either, however long the decode's launches keep the host. `Inflight` bounds how far the host runs
ahead, and `GpuBusy` measures what is left of the waiting, from events on the GPU's own timeline.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from bcg.buckets import pick_bucket
from pipeline.denoise import Denoiser
from pipeline.models.base import Adapter
from pipeline.noise import batch_noise
from pipeline.planner import Batch
from pipeline.prompts import PromptCache, negative_or_default
from pipeline.report import GpuBusyReport
from pipeline.stats import RunStats, StageTimer
from pipeline.transfer import to_host
from pipeline.writer import BatchResult

log = logging.getLogger(__name__)

NON_FINITE = "image has non-finite values (NaN or inf)"
OUT_OF_MEMORY = "CUDA out of memory even alone and without graphs"


@dataclass
class PendingBatch:
    """A batch whose device work is queued. `resolve` (writer thread) waits for it and returns its
    rows and images; it also counts the batch in the run's stats (only the writer thread does)."""

    batch: Batch
    fields: dict
    stats: RunStats
    timer: StageTimer | None = None
    pixels: torch.Tensor | None = None  # [n, H, W, 3] uint8 on the host (pinned on CUDA)
    finite: torch.Tensor | None = None  # [n] bool on the host
    done: torch.cuda.Event | None = None
    parts: list["PendingBatch"] = field(default_factory=list)  # an out-of-memory split
    error: str | None = None  # every row failed with this reason

    def resolve(self) -> BatchResult:
        rows, images = self._rows()
        return BatchResult(self.batch.key, rows, images)

    def _rows(self) -> tuple[list[dict], list[np.ndarray | None]]:
        if self.parts:
            rows, images = [], []
            for part in self.parts:
                r, i = part._rows()
                rows += r
                images += i
            return rows, images
        b, n = self.batch, len(self.batch.items)
        if self.error is not None:
            self.stats.add_batch(b.height, b.width, b.bucket, n, 0, {})
            return [shard_row(it, b, self.fields, self.error) for it in b.items], [None] * n
        if self.done is not None:
            self.done.synchronize()
        seconds = self.timer.seconds()
        finite, pixels = self.finite.numpy(), self.pixels.numpy()
        rows = [shard_row(it, b, self.fields, None if ok else NON_FINITE) for it, ok in zip(b.items, finite)]
        if not finite.all():
            bad = [it.id for it, ok in zip(b.items, finite) if not ok]
            log.warning("batch %s: non-finite images for %s; rows marked failed", b.key, bad)
        self.stats.add_batch(b.height, b.width, b.bucket, n, int(finite.sum()), seconds)
        return rows, [pixels[i] if ok else None for i, ok in enumerate(finite)]


def submit_with_retry(adapter: Adapter, denoiser: Denoiser, prompts: PromptCache, batch: Batch, fields: dict,
                      stats: RunStats, text_length: int | None, prepared: Prepared | None = None,
                      between: Callable[[], None] | None = None) -> PendingBatch:
    """`submit_batch`, and on a CUDA out-of-memory the same rows again split in two (each half at
    its own smaller ladder bucket), down to single rows, then a single row with graphs off; a row
    that still does not fit is marked failed. The batch still commits as one shard under its key,
    and its parts run at the batch's text length (`text_length`: the adapter's `text_length_for` the
    batch's texts). `prepared` and `between` serve the first attempt only (`submit_batch`)."""
    try:
        return submit_batch(adapter, denoiser, prompts, batch, fields, stats, text_length, prepared, between)
    except torch.OutOfMemoryError:
        free_after_oom(adapter.device)
    stats.oom_retries += 1
    items = batch.items
    log.warning("batch %s: CUDA out of memory with %d rows; retrying it split", batch.key, len(items))
    if len(items) > 1:
        half = (len(items) + 1) // 2
        halves = (items[:half], items[half:])
        parts = [submit_with_retry(adapter, denoiser, prompts, sub_batch(batch, h, denoiser.engine.ladder), fields, stats,
                                   text_length) for h in halves]
        return PendingBatch(batch, fields, stats, parts=parts)
    try:
        with denoiser.engine.eager():
            return submit_batch(adapter, denoiser, prompts, batch, fields, stats, text_length)
    except torch.OutOfMemoryError:
        return PendingBatch(batch, fields, stats, error=OUT_OF_MEMORY)


def free_after_oom(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def sub_batch(batch: Batch, items, ladder) -> Batch:
    return Batch(batch.key, batch.height, batch.width, pick_bucket(ladder, len(items)), tuple(items))


@dataclass
class Prepared:
    """A batch's inputs, queued on the device: its conditioning (cut to `text_length` tokens where
    given), initial noise and guidance, and the timer that holds their stages."""

    batch: Batch
    text_length: int | None
    timer: StageTimer
    cond: dict[str, torch.Tensor]
    noise: torch.Tensor
    guidance: torch.Tensor


def prepare_batch(adapter: Adapter, prompts: PromptCache, batch: Batch, fields: dict,
                  text_length: int | None) -> Prepared:
    """Queue a batch's inputs: the encode and noise stages (mostly host work: tokenizing, seeded
    draws on the CPU); nothing here waits for the device."""
    items = batch.items
    n = len(items)
    device = adapter.device
    timer = StageTimer(device)
    with timer.stage("encode"):
        cond = conditioning(prompts, [it.prompt for it in items], [it.negative_prompt for it in items], adapter.uses_cfg)
        if text_length is not None:
            cond = adapter.trim_text(cond, text_length)
        cond.update(adapter.size_inputs(batch.height, batch.width, n))
    with timer.stage("noise"):
        shape = adapter.latent_shape(batch.height, batch.width)
        noise = batch_noise([it.seed for it in items], shape, adapter.dtype, device)
        guidance = torch.full((n,), fields["guidance_scale"], dtype=torch.float32, device=device)
    return Prepared(batch, text_length, timer, cond, noise, guidance)


def submit_batch(adapter: Adapter, denoiser: Denoiser, prompts: PromptCache, batch: Batch, fields: dict,
                 stats: RunStats, text_length: int | None, prepared: Prepared | None = None,
                 between: Callable[[], None] | None = None) -> PendingBatch:
    """Queue one planned batch's device work, its text cut to `text_length` tokens where given, from
    its `prepared` inputs (`prepare_batch` now when None); `between` runs after the denoise is queued
    and before the decode. Nothing here waits for the device."""
    p = prepared if prepared is not None else prepare_batch(adapter, prompts, batch, fields, text_length)
    timer = p.timer
    with timer.stage("denoise"):
        latents = denoiser.denoise(p.noise, p.cond, p.guidance, batch.height, batch.width, p.text_length)
    if between is not None:
        between()
    with timer.stage("decode"):
        images = adapter.decode(latents)
        finite = torch.isfinite(images).flatten(1).all(1)
        pixels = to_uint8(images)
    pending = PendingBatch(batch, fields, stats, timer, to_host(pixels), to_host(finite))
    if adapter.device.type == "cuda":
        pending.done = torch.cuda.Event()
        pending.done.record()
    return pending


class Lookahead:
    """The next batch's inputs, prepared while the device runs this batch's denoise: `prepare` (a
    submit's `between`) queues them, `take` hands them to that batch's submit. A batch's inputs are
    the same whenever they are prepared (the same calls, in the same order), so its bytes are too.
    Out of memory while preparing ahead leaves nothing prepared: the batch prepares its inputs when
    it runs, under its own retries; counted in the stats' oom_retries."""

    def __init__(self, prepare: Callable[[Batch], Prepared], device: torch.device, stats: RunStats):
        self._prepare, self._device, self._stats = prepare, device, stats
        self._ready: Prepared | None = None

    def prepare(self, batch: Batch | None) -> None:
        self._ready = None
        if batch is None:
            return
        try:
            self._ready = self._prepare(batch)
        except torch.OutOfMemoryError:
            free_after_oom(self._device)
            self._stats.oom_retries += 1
            log.warning("batch %s: CUDA out of memory preparing its inputs ahead; they are prepared when it runs",
                        batch.key)

    def take(self, batch: Batch) -> Prepared | None:
        ready, self._ready = self._ready, None
        return ready if ready is not None and ready.batch is batch else None


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[n,3,H,W] in [-1,1] -> [n,H,W,3] uint8 on the same device, rounded as diffusers'
    postprocess does (clamp in the image dtype, then x255 and round-half-even in float32: each is a
    single correctly rounded operation, so device and host give the same bytes)."""
    images = (images / 2 + 0.5).clamp(0, 1)
    return (images.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8)


def conditioning(prompts: PromptCache, positive: list[str], negative: list[str | None],
                 cfg: bool) -> dict[str, torch.Tensor]:
    """Each tensor [n, 2, ...] for CFG: index 0 the negative prompt ("" when the row has none, as
    diffusers), index 1 the prompt; [n, 1, ...], the prompt alone, without CFG."""
    if not cfg:
        return {name: t.unsqueeze(1) for name, t in prompts.get(positive).items()}
    n = len(positive)
    both = prompts.get([negative_or_default(p) for p in negative] + positive)  # one text length for both
    return {name: torch.stack([t[:n], t[n:]], 1) for name, t in both.items()}


def shard_row(item, batch: Batch, fields: dict, error: str | None) -> dict:
    """An output row as the batch makes it; the writer adds where its image went (path, bytes, sha256)."""
    ok = error is None
    return {
        **item.extra,
        **item.fields(),
        "bucket": batch.bucket,
        "batch_key": batch.key,
        **fields,
        "status": "ok" if ok else "failed",
        "error": error,
    }


class Inflight:
    """Bounds how many submitted batches the device may still be working on: `admit` waits (on the
    host, while the device stays busy with the others) for the oldest while more than `depth` are
    queued; depth 0 waits for every batch as soon as it is queued (no overlap at all)."""

    def __init__(self, depth: int):
        self.depth = max(depth, 0)
        self._events: deque[torch.cuda.Event] = deque()

    def admit(self, pending: PendingBatch) -> None:
        for event in _events_of(pending):
            self._events.append(event)
        while len(self._events) > self.depth:
            self._events.popleft().synchronize()


def _events_of(pending: PendingBatch) -> list[torch.cuda.Event]:
    if pending.parts:
        return [e for p in pending.parts for e in _events_of(p)]
    return [pending.done] if pending.done is not None else []


class GpuBusy:
    """The fraction of the generate phase's wall time the device spent on batches, from events on
    the device's own timeline: a `begin` event queued before each batch's work and its `done` event
    after. When the host falls behind, the next `begin` runs late and the gap counts as idle; so
    does the writer's tail after the last batch. Gaps *inside* a batch (eager launches slower than
    the kernels) are not seen here: graphs remove those, and a profiler run measures them."""

    def __init__(self, device: torch.device):
        self.active = device.type == "cuda"
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._begin: torch.cuda.Event | None = None

    def begin(self) -> None:
        if self.active:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def end(self) -> None:
        if self.active and self._begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.spans.append((self._begin, end))

    def report(self, wall_s: float) -> GpuBusyReport | None:
        """Once every span has completed (after the writer closed): `fraction`, busy seconds over
        `wall_s` (the generate phase, the writer's tail included), and `between_batches`, busy
        seconds over the device's own span from the first batch to the last (gaps only)."""
        if not self.active or not self.spans or wall_s <= 0:
            return None
        busy_s = sum(b.elapsed_time(e) for b, e in self.spans) / 1000
        span_s = self.spans[0][0].elapsed_time(self.spans[-1][1]) / 1000
        return GpuBusyReport(
            fraction=round(min(busy_s / wall_s, 1.0), 4),
            between_batches=round(min(busy_s / span_s, 1.0), 4) if span_s > 0 else None,
            busy_s=round(busy_s, 4), device_span_s=round(span_s, 4), generate_s=round(wall_s, 4), batches=len(self.spans),
        )
