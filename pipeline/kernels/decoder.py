"""kernels.compile_decoder: the VAE decoder compiled with inductor, one compilation for every
resolution, and latents decoded `kernels.decode_chunk` at a time (the last chunk padded) so that the
decoder always sees the same batch. Images differ from eager by rounding.

The decoder compiles with inductor's default mode and fixed tuning whatever kernels.compile_mode and
kernels.compile_tuning say of the transformer: timing its kernels did not make the decode faster
(docs/BENCHMARKS.md) and is paid again in every process, as the timed choices are not all cached,
while fixed tuning gives the same decoder kernels in every process."""

from __future__ import annotations

import logging
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


def apply(kernels: KernelSettings, adapter: Adapter, first_call: bool = True) -> dict:
    """-> {"compile_decoder", "decode_chunk", "decoder_first_pass_s"} when on, else {}. `first_call`:
    compile now (a chunk decoded at the model's native size), not at the first batch."""
    if not kernels.compile_decoder:
        return {}
    seconds = compile_decoder(adapter, kernels.decode_chunk, adapter.native_side if first_call else None)
    log.info("kernels: VAE decoder compiled with inductor (mode=%s, tuning %s), %d latents per call; first pass %.1f s",
             *DECODER_COMPILE, kernels.decode_chunk, seconds)
    return {"compile_decoder": True, "decode_chunk": kernels.decode_chunk, "decoder_first_pass_s": round(seconds, 2)}


def compile_decoder(adapter: Adapter, chunk: int, side: int | None) -> float:
    """Compile this adapter's VAE decoder (`compile_vae_decoder`) and decode through
    `decode_in_chunks` from now on (the adapter instance's `decode`); with `side`, decode one chunk of
    zeros of that side now, so that the compile happens at warm-up, not in the first batch, and its
    kernels are generated for the same size in every process and job (the model's native size, not
    the job's first) -> seconds that took."""
    compile_vae_decoder(adapter.vae.decoder)
    decode = adapter.decode
    adapter.decode = lambda latents: decode_in_chunks(decode, latents, chunk)
    if side is None:
        return 0.0
    start = time.perf_counter()
    zeros = torch.zeros(1, *adapter.latent_shape(side, side), dtype=adapter.dtype, device=adapter.device)
    with torch.no_grad():
        adapter.decode(zeros)
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    return time.perf_counter() - start


def compile_vae_decoder(decoder: torch.nn.Module) -> None:
    """Compile the decoder's forward with symbolic height and width and a static batch (the caller
    decodes a fixed chunk: `decode_in_chunks`), so one graph serves every resolution. The batch is
    marked static on the tensor the compiled code receives, and duck sizing is off while dynamo
    traces: it would give a square latent's two sides one symbol, so a non-square one recompiles.
    dynamo traces it under TRACED_ONCE (once, not twice, in every process).
    The compiled forward is this decoder instance's; its class keeps its own."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(type(decoder).forward.__get__(decoder), dynamic=True, fullgraph=True, **compile_options(*DECODER_COMPILE))

    def forward(sample: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        torch._dynamo.mark_static(sample, 0)
        with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(**TRACED_ONCE), \
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
