"""kernels.attention: which kernel serves the denoiser's attention calls.

`auto` leaves the choice to PyTorch SDPA; `cudnn | flash | efficient | math` put that SDPA backend
first (`sdpa_kernel`), the others serving only calls it cannot; `flash_attn` installs
`FlashAttnProcessor` (flash-attn's kernel, the optional `flash` extra) on the transformer's
attention modules. What actually ran is observed, not assumed: `probe` counts the attention kernels of
one eager call and the job reports them.
"""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter
from contextlib import nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.buffers import StaticInputs
from pipeline.config import ATTENTION
from pipeline.plans import KernelSettings
from pipeline.errors import UserError, not_accepted

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# the fused aten ops behind F.scaled_dot_product_attention -> the backend that ran it; a call that
# reaches none of them ran the math backend, which decomposes into plain matmuls and a softmax.
SDPA_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
FLASH_ATTN_OP = "flash_attn"
FP8_ATTENTION_OP = "fp8_attention"  # kernels.fp8_attention's processor
NOT_SDPA = (FLASH_ATTN_OP, FP8_ATTENTION_OP)  # processors' own kernels, counted by count_call
MATH = "math"
UNSET = ("auto", "flash_attn")  # no SDPA backend to choose: PyTorch's own choice, or not SDPA at all


def check(kernels: KernelSettings, device: torch.device | None) -> None:
    """A backend that is not accepted, or whose package is missing."""
    if kernels.attention not in ATTENTION:
        raise not_accepted("kernels.attention", kernels.attention, ATTENTION)
    if kernels.attention == "flash_attn" and importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            "kernels.attention=flash_attn needs the flash-attn package, which is not installed "
            "(pip install -e '.[flash]' on a CUDA machine); or choose one of PyTorch's SDPA backends: "
            f"{list(SDPA)}"
        )


def apply(kernels: KernelSettings, adapter: Adapter) -> dict:
    """flash-attn's processor on every attention module of this transformer (kernels.attention=
    flash_attn); an SDPA backend is chosen per call instead (`with_attention`). -> {}"""
    if kernels.attention == "flash_attn":
        use_flash_attn(adapter.transformer)
    return {}


def probe(kernels: KernelSettings, adapter: Adapter, probe_size: tuple[int, int]) -> dict:
    """One eager CFG forward (1 row at `probe_size`) under the chosen backend -> {"attention_calls_per_forward":
    {backend: calls}}, or what kept it from being observed."""
    inputs = StaticInputs.allocate(adapter.input_specs(*probe_size), 1, adapter.device).view(1)
    step = with_attention(adapter.guided_eps, kernels.attention, adapter.device.type)
    try:
        with torch.no_grad():
            calls = probe_attention(lambda: step(inputs))
    except torch.OutOfMemoryError:
        calls = {"not observed": "out of memory in the probe"}
        log.warning("kernels: the attention probe ran out of memory; which backend serves attention is not known")
    log.info("kernels: attention=%s; attention calls per CFG forward by backend: %s", kernels.attention, calls)
    return {"attention_calls_per_forward": calls}


def attention_context(name: str, device_type: str = "cuda"):
    """The SDPA backends for one call of the denoiser: on CUDA `name` first, the others in PyTorch's
    order for calls it cannot serve; on the CPU (which ignores priorities) `name` and math only."""
    if name in UNSET:
        return nullcontext()
    first = SDPA[name]
    if device_type != "cuda":
        return sdpa_kernel(list(dict.fromkeys([first, SDPBackend.MATH])))
    return sdpa_kernel([first, *(b for b in SDPA.values() if b != first)], set_priority=True)


def with_attention(fn: Callable, name: str, device_type: str = "cuda") -> Callable:
    """fn, run under `attention_context(name, device_type)`; `fn` itself when nothing needs setting."""
    if name in UNSET:
        return fn

    def run(*args, **kwargs):
        with attention_context(name, device_type):
            return fn(*args, **kwargs)

    return run


def probe_attention(call: Callable[[], object]) -> dict[str, int]:
    """Run `call` once, eagerly (compiled functions too: the modes that count see nothing inside
    compiled code), counting its attention calls -> {backend: calls it served}: each
    F.scaled_dot_product_attention call by the fused op it dispatched to (`math` when none), and
    FlashAttnProcessor's flash-attn calls as `flash_attn`."""
    counts: Counter[str] = Counter()
    calls, kernels = _SdpaCalls(), _SdpaKernels(counts)
    token = _PROCESSOR_CALLS.set(counts)
    try:
        with torch.compiler.set_stance("force_eager"), calls, kernels:
            call()
    finally:
        _PROCESSOR_CALLS.reset(token)
    fused = sum(n for backend, n in counts.items() if backend not in NOT_SDPA)
    if calls.count > fused:
        counts[MATH] += calls.count - fused
    return dict(sorted(counts.items()))


class _SdpaCalls(TorchFunctionMode):
    """Counts F.scaled_dot_product_attention calls."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _SdpaKernels(TorchDispatchMode):
    """Counts the fused SDPA ops below autograd, by backend, into `counts`."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = getattr(func, "_schema", None)  # an OpOverload's; a higher-order op has none
        backend = SDPA_OPS.get(schema.name) if schema is not None else None
        if backend is not None:
            self.counts[backend] += 1
        return func(*args, **(kwargs or {}))


# the probe's counter while it runs, where processors count the calls their own kernels serve
_PROCESSOR_CALLS: ContextVar[Counter | None] = ContextVar("processor_calls", default=None)


def count_call(backend: str) -> None:
    """One attention call served by a processor's own kernel (`backend`, one of NOT_SDPA), counted
    while `probe_attention` runs (which runs eagerly: a compile traces no count)."""
    if not torch.compiler.is_compiling() and (probing := _PROCESSOR_CALLS.get()) is not None:
        probing[backend] += 1


class FlashAttnProcessor:
    """diffusers' AttnProcessor2_0 (PixArt's and DiT's attention) with flash-attn's kernel for every
    call without a mask. A masked call (PixArt's cross-attention over padded prompt tokens) has no
    flash-attn equivalent at fixed shapes and goes to SDPA; `probe_attention` reports both."""

    def __init__(self, flash_attn_func: Callable | None = None):
        if flash_attn_func is None:
            from flash_attn import flash_attn_func
        self.flash_attn_func = flash_attn_func

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, *args, **kwargs):
        if attn.spatial_norm is not None or attn.group_norm is not None or hidden_states.ndim != 3:
            raise NotImplementedError("FlashAttnProcessor handles token attention only (PixArt, DiT)")
        residual = hidden_states
        b = hidden_states.shape[0]
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)
        query, key, value = attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)
        head_dim = key.shape[-1] // attn.heads
        # flash-attn's layout is [B, N, heads, head_dim]; SDPA's is [B, heads, N, head_dim].
        query, key, value = (t.view(b, -1, attn.heads, head_dim) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query.transpose(1, 2)).transpose(1, 2)
        if attn.norm_k is not None:
            key = attn.norm_k(key.transpose(1, 2)).transpose(1, 2)
        if attention_mask is None:
            out = self.flash_attn_func(query, key, value, dropout_p=0.0, causal=False)
            count_call(FLASH_ATTN_OP)
        else:
            mask = attn.prepare_attention_mask(attention_mask, context.shape[1], b)
            mask = mask.view(b, attn.heads, -1, mask.shape[-1])
            out = torch.nn.functional.scaled_dot_product_attention(
                query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
            ).transpose(1, 2)
        out = attn.to_out[1](attn.to_out[0](out.reshape(b, -1, attn.heads * head_dim).to(query.dtype)))
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor


def use_flash_attn(transformer: torch.nn.Module, flash_attn_func: Callable | None = None) -> None:
    """FlashAttnProcessor on every attention module of this transformer instance."""
    transformer.set_attn_processor(FlashAttnProcessor(flash_attn_func))
