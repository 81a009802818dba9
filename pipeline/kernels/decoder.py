"""The VAE decoder's kernels: `kernels.fuse_decoder`, the decoder's group norms and their SiLUs in
Triton kernels of fixed block sizes (pipeline.blocks.vae.FusedDecoder: nothing compiled by inductor,
the plans' choice), or `kernels.compile_decoder`, the decoder compiled with inductor, one compilation
for every resolution. With either, latents are decoded `kernels.decode_chunk` at a time (the last chunk
padded) so that the decoder always sees the same batch, and an image's bytes do not depend on the
batch it was denoised in. Images differ from eager by rounding.

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
from pipeline.kernels import group_norm
from pipeline.kernels.compile import TRACED_ONCE, compile_options

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)
# What dynamo says, while it traces, of diffusers' upsampling blocks: their bf16 branch asks an
# lru_cache'd version check, which dynamo traces through (a constant). It changes nothing compiled.
CACHED_CALL_NOTICE = r"Dynamo detected a call to a `functools.lru_cache`-wrapped function"
DECODER_COMPILE = ("default", "fixed")  # (mode, tuning) of the decoder's compile, the job's settings aside


def check(kernels: KernelSettings, device: torch.device | None) -> None:
    if on(kernels) and kernels.decode_chunk < 1:
        raise UserError(f"kernels.decode_chunk={kernels.decode_chunk} must be >= 1 (latents per decoder call)")


def on(kernels: KernelSettings) -> bool:
    """Whether the job sets the decoder's kernels (and decodes `decode_chunk` latents per call)."""
    return kernels.compile_decoder or kernels.fuse_decoder


def padding_note(kernels: KernelSettings, largest_batch: int) -> str | None:
    """What to say at start when every decoder call would decode padding: a chunk larger than the
    largest batch the job decodes (the ladder's top). None when it would not."""
    chunk = kernels.decode_chunk
    if not on(kernels) or chunk <= largest_batch:
        return None
    return (f"kernels.decode_chunk={chunk} is larger than the largest batch this job decodes ({largest_batch}, the "
            f"ladder's top): each decoder call decodes {chunk - largest_batch} or more padded latents besides the "
            f"batch's; kernels.decode_chunk={largest_batch} decodes none (its images differ by rounding from a "
            f"chunk of {chunk}'s)")


def apply(kernels: KernelSettings, adapter: Adapter, first_call: bool = True) -> dict:
    """-> {"fuse_decoder" or "compile_decoder", "decode_chunk", "decoder_first_pass_s"} when on, else {}.
    `first_call`: run the decoder now (a chunk decoded at the model's native size), not at the first batch."""
    if not on(kernels):
        return {}
    if kernels.fuse_decoder:
        key, setup = "fuse_decoder", fuse_decoder
        how = f"'s group norms fused with their SiLUs (Triton, {group_norm.SETTING})"
    else:
        key, setup = "compile_decoder", compile_decoder
        how = " compiled with inductor (mode={}, tuning {})".format(*DECODER_COMPILE)
    seconds = setup(adapter, kernels.decode_chunk, adapter.native_side if first_call else None)
    log.info("kernels: VAE decoder%s, %d latents per call; first pass %.1f s", how, kernels.decode_chunk, seconds)
    return {key: True, "decode_chunk": kernels.decode_chunk, "decoder_first_pass_s": round(seconds, 2)}


def fuse_decoder(adapter: Adapter, chunk: int, side: int | None) -> float:
    """This adapter's VAE decoder as `FusedDecoder` (the same modules and weights; one already fused
    stays as it is) and `chunked` -> seconds its first pass took (0 without `side`)."""
    from pipeline.blocks.vae import FusedDecoder

    if not isinstance(adapter.vae.decoder, FusedDecoder):
        adapter.vae.decoder = FusedDecoder(adapter.vae.decoder)
    return chunked(adapter, chunk, side)


def compile_decoder(adapter: Adapter, chunk: int, side: int | None) -> float:
    """Compile this adapter's VAE decoder (`compile_vae_decoder`) and `chunked` -> seconds its first
    pass (the compile) took (0 without `side`)."""
    compile_vae_decoder(adapter.vae.decoder)
    return chunked(adapter, chunk, side)


def chunked(adapter: Adapter, chunk: int, side: int | None) -> float:
    """Decode through `decode_in_chunks` from now on (the adapter instance's `decode`); with `side`,
    decode one chunk of zeros of that side now, so that the decoder's kernels are built at warm-up,
    not in the first batch, and for the same size in every process and job (the model's native size,
    not the job's first) -> seconds that took."""
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
