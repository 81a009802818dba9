"""A batch's decode, queued behind its denoise: latents -> uint8 pixels and a finite flag per image,
copied into pinned host memory for the writer.

With `kernels.compile_decoder`, the decoder's first call (where dynamo traces and inductor compiles,
20 to 40 s on the H200) runs on a thread of its own (`DecoderWarmup`) while the denoiser replays
its graphs. Batches denoised meanwhile keep their latents on the device, in order, and are decoded
as soon as the compile is done (`Decodes`). So the compile takes no time from a job longer than
itself, and every image of the job goes through the same decoder whatever the timing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from typing import Callable

import torch

from pipeline.transfer import to_host

log = logging.getLogger(__name__)

OUT_OF_MEMORY = "CUDA out of memory even alone and without graphs"


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[n,3,H,W] in [-1,1] -> [n,H,W,3] uint8 on the same device, rounded as diffusers'
    postprocess does (clamp in the image dtype, then x255 and round-half-even in float32: each is a
    single correctly rounded operation, so device and host give the same bytes)."""
    images = (images / 2 + 0.5).clamp(0, 1)
    return (images.permute(0, 2, 3, 1).float() * 255).round().to(torch.uint8)


def decode_into(adapter, pending, latents: torch.Tensor) -> None:
    """Queue `latents`' decode, the uint8 conversion, the finite check and their copies to the
    host into `pending` (a generate.PendingBatch), with the event its writer waits for."""
    with pending.timer.stage("decode"):
        images = adapter.decode(latents)
        finite = torch.isfinite(images).flatten(1).all(1)
        pixels = to_uint8(images)
    pending.pixels, pending.finite = to_host(pixels), to_host(finite)
    if adapter.device.type == "cuda":
        pending.done = torch.cuda.Event()
        pending.done.record()


class DecoderWarmup:
    """The compiled decoder's first call, one latent of zeros at `size`, on a daemon thread with a
    CUDA stream of its own (dynamo's frame hook, grad mode and the current stream are per thread;
    the main thread keeps replaying graphs meanwhile). `wait` returns its seconds or raises its
    error."""

    def __init__(self, adapter, size: tuple[int, int]):
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(adapter, size), name="decoder-compile", daemon=True)
        self._thread.start()

    def _run(self, adapter, size: tuple[int, int]) -> None:
        start = time.perf_counter()
        device = adapter.device
        cuda = device.type == "cuda"
        try:
            with torch.no_grad(), torch.cuda.device(device) if cuda else nullcontext():
                with torch.cuda.stream(torch.cuda.Stream(device)) if cuda else nullcontext():
                    zeros = torch.zeros(1, *adapter.latent_shape(*size), dtype=adapter.dtype, device=device)
                    adapter.decode(zeros)
                    if cuda:
                        torch.cuda.current_stream(device).synchronize()
            self.seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - not swallowed: `wait` raises it in the main thread
            self.error = err
        finally:
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"kernels.compile_decoder: compiling the VAE decoder failed ({type(self.error).__name__}: "
                               f"{self.error}); kernels.compile_decoder=false decodes eagerly") from self.error
        return self.seconds


class Decodes:
    """Every batch's decode, and its hand-off to the writer (`deliver`), in submission order.

    Without a warm-up, or once it is done, `submit` decodes at once (an out-of-memory error reaches
    the caller, which retries the batch split) and `deliver` hands the batch over. While the decoder
    compiles, batches (or the parts of a split one) wait with their latents, and the batches are
    held back from the writer, which only ever sees batches whose decode is queued; the first
    `submit`, `deliver` or `flush` after the compile decodes the waiting parts (an out-of-memory
    error then fails that part's rows) and hands the held batches over."""

    def __init__(self, adapter, deliver: Callable, warmup: DecoderWarmup | None = None):
        self.adapter = adapter
        self._deliver = deliver
        self.warmup = warmup
        self.waiting: deque = deque()  # (part, latents) whose decode waits for the compile
        self.held: deque = deque()  # batches not yet handed to the writer
        self.waited = 0  # batches held back while the decoder compiled
        self.first_pass_s: float | None = None

    def submit(self, part, latents: torch.Tensor) -> None:
        if self.warmup is not None and not self.warmup.ready():
            self.waiting.append((part, latents))
            return
        self.flush()
        decode_into(self.adapter, part, latents)

    def deliver(self, pending) -> None:
        if self.warmup is not None and not self.warmup.ready():
            self.held.append(pending)
            self.waited += 1
            return
        self.flush()
        self._deliver(pending)

    def flush(self, wait: bool = False) -> None:
        """Once the decoder is compiled (`wait`: wait for that), decode the waiting parts and hand
        the held batches to the writer."""
        if self.warmup is not None:
            if not (wait or self.warmup.ready()):
                return
            self.first_pass_s = self.warmup.wait()
            self.warmup = None
            log.info("kernels: VAE decoder compiled in the background in %.1f s; %d batches waited for it",
                     self.first_pass_s, self.waited)
        while self.waiting:
            part, latents = self.waiting.popleft()
            try:
                decode_into(self.adapter, part, latents)
            except torch.OutOfMemoryError:
                log.warning("batch %s: CUDA out of memory in the decode; rows marked failed", part.batch.key)
                part.error = OUT_OF_MEMORY
        while self.held:
            self._deliver(self.held.popleft())

    def cancel(self) -> None:
        """The job is stopping: held batches are not written (a resumed job generates them)."""
        if self.held:
            log.warning("%d denoised batches were waiting for the decoder's compile and are not written; "
                        "a resumed job generates them", len(self.held))
        self.waiting.clear()
        self.held.clear()

    def report(self) -> dict:
        if self.first_pass_s is None:
            return {}
        return {"decoder_first_pass_s": round(self.first_pass_s, 2), "decoder_waited_batches": self.waited}
