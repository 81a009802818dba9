"""kernels.compile_decoder: the VAE decoder compiled with inductor, one compilation for every
resolution, and latents decoded `kernels.decode_chunk` at a time (the last chunk padded) so that the
decoder always sees the same batch. Images differ from eager by rounding.

The decoder compiles with inductor's default mode and fixed tuning whatever kernels.compile_mode and
kernels.compile_tuning say of the transformer: timing its kernels did not make the decode faster
(docs/BENCHMARKS.md) and is paid again in every process, as the timed choices are not all cached,
while fixed tuning gives the same decoder kernels in every process."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import TYPE_CHECKING, Callable

import torch

from pipeline.plans import KernelSettings
from pipeline.errors import UserError
from pipeline.kernels.compile import TRACED_ONCE, compile_options

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)
# What dynamo says, while it traces, of diffusers' upsampling blocks: their bf16 branch asks an
# lru_cache'd version check, which dynamo traces through (a constant). It changes nothing compiled.
CACHED_CALL_NOTICE = r"Dynamo detected a call to a `functools.lru_cache`-wrapped function"
DECODER_COMPILE = ("default", "fixed")  # (mode, tuning) of the decoder's compile, the job's settings aside


def check(kernels: KernelSettings, device: torch.device | None) -> None:
    if kernels.compile_decoder and kernels.decode_chunk < 1:
        raise UserError(f"kernels.decode_chunk={kernels.decode_chunk} must be >= 1 (latents per decoder call)")


def padding_note(kernels: KernelSettings, largest_batch: int) -> str | None:
    """What to say at start when every decoder call would decode padding: a chunk larger than the
    largest batch the job decodes (the ladder's top). None when it would not."""
    chunk = kernels.decode_chunk
    if not kernels.compile_decoder or chunk <= largest_batch:
        return None
    return (f"kernels.decode_chunk={chunk} is larger than the largest batch this job decodes ({largest_batch}, the "
            f"ladder's top): each decoder call decodes {chunk - largest_batch} or more padded latents besides the "
            f"batch's; kernels.decode_chunk={largest_batch} decodes none (its images differ by rounding from a "
            f"chunk of {chunk}'s)")


def apply(kernels: KernelSettings, adapter: Adapter) -> dict:
    """-> {"compile_decoder", "decode_chunk"} when on, else {}. The adapter decodes through a
    `CompiledDecode` from now on; its first pass runs when the job starts it (`CompiledDecode.start`)
    or, at the latest, before the first latents are decoded."""
    if not kernels.compile_decoder:
        return {}
    compile_decoder(adapter, kernels.decode_chunk)
    log.info("kernels: VAE decoder compiled with inductor (mode=%s, tuning %s), %d latents per call; its first "
             "pass runs beside the first batches", *DECODER_COMPILE, kernels.decode_chunk)
    return {"compile_decoder": True, "decode_chunk": kernels.decode_chunk}


def compile_decoder(adapter: Adapter, chunk: int) -> CompiledDecode:
    """Compile this adapter's VAE decoder (`compile_vae_decoder`) and decode through a
    `CompiledDecode` of it from now on (the adapter instance's `decode`) -> that CompiledDecode."""
    compile_vae_decoder(adapter.vae.decoder)
    shape = (1, *adapter.latent_shape(adapter.native_side, adapter.native_side))
    adapter.decode = CompiledDecode(adapter.decode, chunk, shape, adapter.dtype, adapter.device)
    return adapter.decode


class CompiledDecode:
    """An adapter's `decode` under kernels.compile_decoder: `decode_in_chunks` over the compiled
    decoder, whose first pass (one chunk of zeros at the model's native size: the compile, or its
    load from the kernel cache) comes before any latents are decoded, so that its kernels are
    generated for the same size in every process and job, whatever the job decodes first.

    `start` runs that pass on a thread of its own: the job starts it once its graphs are captured,
    and its first batches denoise meanwhile; `ready` says whether it is done (until then the job
    keeps their latents, pipeline.generate), and every decode waits for it (`wait`). Only the time
    changes: the compiled decoder is the same, and so are the images."""

    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor], chunk: int, first_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device):
        self._decode, self.chunk = decode, chunk
        self._first = (first_shape, dtype, device)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.first_pass_s: float | None = None

    def start(self) -> None:
        """Run the first pass on a thread of its own (once; nothing when it ran)."""
        with self._lock:
            if self._thread is None and not self._done.is_set():
                self._thread = threading.Thread(target=self._first_pass, name="decoder-first-pass", daemon=True)
                self._thread.start()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        """Until the first pass is done (run here when nothing started it); raises its error."""
        if not self._done.is_set():
            with self._lock:
                started = self._thread is not None
                if not started and not self._done.is_set():
                    self._first_pass()
            self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"the VAE decoder's first pass (kernels.compile_decoder) failed: {self._error!r}") \
                from self._error

    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        self.wait()
        return decode_in_chunks(self._decode, latents, self.chunk)

    def _first_pass(self) -> None:
        shape, dtype, device = self._first
        start = time.perf_counter()
        try:
            with torch.no_grad():
                decode_in_chunks(self._decode, torch.zeros(shape, dtype=dtype, device=device), self.chunk)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as err:  # raised where the images are decoded (wait), not lost with this thread
            self._error = err
        self.first_pass_s = time.perf_counter() - start
        self._done.set()
        if self._error is None:
            log.info("kernels: the VAE decoder's first pass took %.1f s (compiled, or loaded from the kernel cache)",
                     self.first_pass_s)


def compile_vae_decoder(decoder: torch.nn.Module) -> None:
    """Compile the decoder's forward with symbolic height and width and a static batch (the caller
    decodes a fixed chunk: `decode_in_chunks`), so one graph serves every resolution. The batch is
    marked static on the tensor the compiled code receives, and duck sizing is off while dynamo
    traces: it would give a square latent's two sides one symbol, so a non-square one recompiles.
    dynamo traces it under TRACED_ONCE (once, not twice, in every process).
    The compiled forward is this decoder instance's; its class keeps its own. It runs under dynamo's
    compile lock: the settings it patches while it traces are not seen by another thread's compile."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.convert_frame import compile_lock

    compiled = torch.compile(type(decoder).forward.__get__(decoder), dynamic=True, fullgraph=True, **compile_options(*DECODER_COMPILE))

    def forward(sample: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        torch._dynamo.mark_static(sample, 0)
        # The settings below are the process's while they hold: under dynamo's compile lock, no other
        # thread compiles (or decodes) with them (the first pass runs beside the job's main thread).
        with compile_lock, fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(**TRACED_ONCE), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=CACHED_CALL_NOTICE, category=UserWarning)
            return compiled(sample, *args, **kwargs)

    decoder.forward = forward


def decode_in_chunks(decode: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor, chunk: int) -> torch.Tensor:
    """`decode` over `chunk` latents at a time, the last chunk padded with copies of its last row and
    the padding's images dropped: the decoder always sees the same batch."""
    images = []
    for first in range(0, latents.shape[0], chunk):
        part = latents[first:first + chunk]
        rows = part.shape[0]
        if rows < chunk:
            part = torch.cat([part, part[-1:].expand(chunk - rows, *part.shape[1:])])
        images.append(decode(part)[:rows])
    return torch.cat(images)
