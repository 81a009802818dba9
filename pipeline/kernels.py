"""Which kernels the denoiser runs: the attention backend, torch.compile, float8 linear layers.

`kernels.attention` picks PyTorch SDPA's backend (`sdpa_kernel` with that backend first, the others
as fallbacks for calls it cannot serve) or flash-attn's kernel (the optional `flash` extra). What
actually ran is observed, not assumed: `probe_attention` records the SDPA ops of one eager call and
the job reports them. `kernels.compile` compiles the transformer with inductor, without inductor's
own CUDA graphs, so our engine captures the compiled kernels like any others.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import MethodType
from typing import Callable, Iterable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.config import ATTENTION, COMPILE_MODES, COMPILE_SCOPES
from pipeline.errors import UserError

log = logging.getLogger(__name__)

SDPA = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# aten ops behind F.scaled_dot_product_attention -> the backend that ran it.
SDPA_OPS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
FLASH_ATTN_OP = "flash_attn"
CONTIGUOUS_HOOK = "_contiguous_output_hook"  # the patch embedding's hook handle (contiguous_block_input)
TRIM_TEXT_FAMILIES = ("pixart",)
FUSE_RESIDUAL_FAMILIES = ("pixart",)


def check_kernels(kernels, family: str | None = None, device: torch.device | None = None) -> None:
    """What can be refused before the model is built or changed: a backend whose package is missing,
    settings that exclude each other, a setting this family cannot use, fp8 on a device without
    float8 tensor cores (`family`, `device` None: not known yet)."""
    if kernels.fuse_qkv and kernels.attention == "flash_attn":
        raise UserError("kernels.fuse_qkv=true replaces the attention processor and cannot be combined with "
                        f"kernels.attention=flash_attn; choose one of {list(SDPA)} with it, or fuse_qkv=false")
    check_fuse_residual(kernels, family)
    check_attention(kernels.attention, family)
    if kernels.fuse_qkv and family is not None and family not in FUSE_QKV_FAMILIES:
        raise UserError(f"kernels.fuse_qkv=true: diffusers fuses the projections of model families "
                        f"{list(FUSE_QKV_FAMILIES)}, not {family!r}; set kernels.fuse_qkv=false")
    if kernels.fp8 and device is not None:
        check_fp8(device)
    if kernels.fuse_gelu and kernels.fp8:
        raise UserError("kernels.fuse_gelu=true fuses bf16/fp16 matmuls; it cannot be combined with kernels.fp8=true "
                        "(float8 weights): set one of them false")
    if kernels.fuse_gelu and device is not None and torch.device(device).type != "cuda":
        raise UserError("kernels.fuse_gelu=true needs CUDA: cuBLASLt's GELU epilogue is the tanh GELU these models use, "
                        "while PyTorch's CPU version of the fused op computes the exact GELU; set kernels.fuse_gelu=false")
    if kernels.compile_decoder and kernels.decode_chunk < 1:
        raise UserError(f"kernels.decode_chunk={kernels.decode_chunk} must be >= 1 (latents per decoder call)")
    if kernels.trim_text_padding and family is not None and family not in TRIM_TEXT_FAMILIES:
        raise UserError(f"kernels.trim_text_padding=true: model families {list(TRIM_TEXT_FAMILIES)} mask the text padding "
                        f"out of attention, {family!r} does not (its images would change); set kernels.trim_text_padding=false")


def check_fuse_residual(kernels, family: str | None) -> None:
    """kernels.fuse_residual runs its own block forward: the settings that would change or compile
    that forward are refused, and compile_scope=norms means nothing without it."""
    if not kernels.fuse_residual:
        if kernels.compile and kernels.compile_scope == "norms":
            raise UserError("kernels.compile_scope=norms compiles the layer norms of kernels.fuse_residual's block: set "
                            "kernels.fuse_residual=true, or choose compile_scope model or blocks")
        return
    if family is not None and family not in FUSE_RESIDUAL_FAMILIES:
        raise UserError(f"kernels.fuse_residual=true: the block it rewrites is PixArt's (model families "
                        f"{list(FUSE_RESIDUAL_FAMILIES)}), not {family!r}'s; set kernels.fuse_residual=false")
    clashing = [key for key, on in (("fuse_qkv", kernels.fuse_qkv), ("fp8", kernels.fp8),
                                    ("attention=flash_attn", kernels.attention == "flash_attn")) if on]
    if clashing:
        raise UserError(f"kernels.fuse_residual=true computes the attention and folds the gates into bf16/fp16 weights "
                        f"itself; it cannot be combined with kernels.{clashing[0]}: set one of them off")
    if kernels.compile and kernels.compile_scope != "norms":
        raise UserError(f"kernels.fuse_residual=true with kernels.compile: the block adds into its input in place, which "
                        f"compile_scope={kernels.compile_scope} would trace; set kernels.compile_scope=norms (the layer "
                        "norms, all that is left to fuse, compiled once)")


def check_attention(name: str, family: str | None) -> None:
    """Refuse, at start, a backend that is not there or that this family cannot use."""
    if name not in ATTENTION:
        raise UserError(f"kernels.attention={name!r} is not accepted; choose one of {list(ATTENTION)}")
    if name != "flash_attn":
        return
    if importlib.util.find_spec("flash_attn") is None:
        raise UserError(
            "kernels.attention=flash_attn needs the flash-attn package, which is not installed "
            "(pip install -e '.[flash]' on a CUDA machine); or choose one of PyTorch's SDPA backends: "
            f"{list(SDPA)}"
        )
    if family is not None and family not in FLASH_ATTN_FAMILIES:
        raise UserError(
            f"kernels.attention=flash_attn supports model families {list(FLASH_ATTN_FAMILIES)}, not {family!r}; "
            f"choose one of {list(SDPA)}"
        )


def attention_context(name: str, device_type: str = "cuda"):
    """The SDPA backends for one call of the denoiser: on CUDA `name` first, the others in PyTorch's
    order for calls it cannot serve; on the CPU (which ignores priorities) `name` and math only."""
    if name in ("auto", "flash_attn"):
        return nullcontext()
    first = SDPA[name]
    if device_type != "cuda":
        return sdpa_kernel(list(dict.fromkeys([first, SDPBackend.MATH])))
    return sdpa_kernel([first, *(b for b in SDPA.values() if b != first)], set_priority=True)


def with_attention(fn: Callable, name: str, device_type: str = "cuda") -> Callable:
    """fn, run under `attention_context(name, device_type)`; `fn` itself when nothing needs setting."""
    if name in ("auto", "flash_attn"):
        return fn

    def run(*args, **kwargs):
        with attention_context(name, device_type):
            return fn(*args, **kwargs)

    return run


def probe_attention(call: Callable[[], object]) -> dict[str, int]:
    """Run `call` once under the profiler -> {backend: SDPA calls it served}. The SDPA op names say
    which kernel PyTorch chose for every attention call (flash-attn's calls show as `flash_attn`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
    counts: Counter[str] = Counter()
    for event in prof.events():
        if event.name in SDPA_OPS:
            counts[SDPA_OPS[event.name]] += 1
        elif event.name == FlashAttnProcessor.RECORD:
            counts[FLASH_ATTN_OP] += 1
    return dict(sorted(counts.items()))


# ---- flash-attn ---------------------------------------------------------------------------------

FLASH_ATTN_FAMILIES = ("pixart", "dit")


class FlashAttnProcessor:
    """diffusers' AttnProcessor2_0 (PixArt's and DiT's attention) with flash-attn's kernel for every
    call without a mask. A masked call (PixArt's cross-attention over padded prompt tokens) has no
    flash-attn equivalent at fixed shapes and goes to SDPA; `probe_attention` reports both."""

    RECORD = "flash_attn::flash_attn_func"

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
            with torch.profiler.record_function(self.RECORD):
                out = self.flash_attn_func(query, key, value, dropout_p=0.0, causal=False)
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
    transformer.set_attn_processor(FlashAttnProcessor(flash_attn_func))


# ---- fused projections --------------------------------------------------------------------------

FUSE_QKV_FAMILIES = ("pixart", "sd3")


def fuse_qkv(transformer: torch.nn.Module) -> int:
    """diffusers' `fuse_qkv_projections`: q, k and v of each self-attention as one linear layer (k and
    v of each cross-attention), with diffusers' fused attention processor; the projections the fused
    processor no longer reads are removed (no dead weights in memory or in fp8's count) -> attention
    layers fused. Refused where diffusers' fused processor would compute something else."""
    from diffusers.models.attention_processor import Attention

    attentions = [m for m in transformer.modules() if isinstance(m, Attention)]
    if type(transformer).__name__ == "SD3Transformer2DModel":
        # diffusers' FusedJointAttnProcessor2_0 applies no q/k norm and needs the text stream in every
        # attention: SD3.5's qk norm and its second (image-only) attention would silently change.
        odd = [name for name, m in transformer.named_modules() if isinstance(m, Attention)
               and (m.norm_q is not None or getattr(m, "norm_added_q", None) is not None or m.add_q_proj is None)]
        if odd:
            raise UserError(f"kernels.fuse_qkv=true: diffusers' fused SD3 attention ignores q/k norms and needs the "
                            f"text stream, which {odd[0]} (and {len(odd) - 1} more) use or lack; set kernels.fuse_qkv=false")
    transformer.fuse_qkv_projections()
    for m in attentions:
        unused = ("to_k", "to_v") if m.is_cross_attention else ("to_q", "to_k", "to_v")
        if getattr(m, "to_added_qkv", None) is not None:
            unused += ("add_q_proj", "add_k_proj", "add_v_proj")
        for name in unused:
            delattr(m, name)
    return len(attentions)


# ---- GELU in the matmul epilogue -----------------------------------------------------------------


def fuse_gelu(transformer: torch.nn.Module) -> int:
    """Every diffusers `GELU` activation with the tanh approximation and a biased projection runs as
    one `torch._addmm_activation`: on CUDA a cuBLASLt matmul whose epilogue adds the bias and applies
    the tanh GELU to the fp32 accumulator. -> modules changed (a model with none is refused)."""
    from diffusers.models.activations import GELU

    changed = 0
    for module in transformer.modules():
        if isinstance(module, GELU) and module.approximate == "tanh" and module.proj.bias is not None:
            module.forward = _gelu_epilogue_forward(module)
            changed += 1
    if not changed:
        raise UserError("kernels.fuse_gelu=true: this transformer has no tanh-GELU feed-forward with a biased projection "
                        "to fuse; set kernels.fuse_gelu=false")
    return changed


def _gelu_epilogue_forward(module: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        proj = module.proj  # read at call time: a projection swapped later is the one used
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch._addmm_activation(proj.bias, rows, proj.weight.t(), use_gelu=True)
        return out.view(*hidden_states.shape[:-1], out.shape[-1])

    return forward


# ---- torch.compile ------------------------------------------------------------------------------


def compile_transformer(transformer: torch.nn.Module, mode: str, shapes: int, dynamic: bool, scope: str = "model") -> None:
    """Compile in place with inductor; inductor's own CUDA graphs stay off, ours capture the
    compiled kernels. `dynamic`: one compilation with symbolic batch and token counts serves every
    (resolution, bucket) (see broadcast_attention_masks, contiguous_block_input); else one per shape.
    `shapes` raises dynamo's recompile limit so that no shape silently falls back to eager.
    `scope`: `model` compiles the whole transformer; `blocks` compiles its repeated transformer block
    once and reuses the code for every block (diffusers' regional compilation: a fraction of the
    compile time, no fusion across block boundaries); `norms` compiles what kernels.fuse_residual's
    block leaves to fuse: its layer norm and its per-step constants (pipeline/residual.py)."""
    how = compile_options(mode)
    if scope not in COMPILE_SCOPES:
        raise UserError(f"kernels.compile_scope={scope!r} is not accepted; choose one of {list(COMPILE_SCOPES)}")
    import torch._dynamo.config as dynamo_config

    limit = max(dynamo_config.recompile_limit, shapes + 2)
    dynamo_config.recompile_limit = limit
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit * 8)
    if scope == "norms":  # kernels.fuse_residual's block, with its one fusable kernel compiled
        from pipeline.residual import compiled_functions, fuse_residual

        fuse_residual(transformer, *compiled_functions(dynamic, how))
    elif dynamic:
        broadcast_attention_masks(transformer)
    if scope == "blocks":
        # diffusers compiles every submodule whose class is listed in `_repeated_blocks`; these
        # families do not list theirs, so name the class of the first of `transformer_blocks`.
        transformer._repeated_blocks = (type(transformer.transformer_blocks[0]).__name__,)
        contiguous_block_input(transformer)
        transformer.compile_repeated_blocks(dynamic=dynamic, fullgraph=True, **how)
    elif scope == "model":
        transformer.compile(dynamic=dynamic, fullgraph=True, **how)
    log.info("kernels: transformer %s compiled with inductor (mode=%s, %s shapes, no inductor CUDA graphs)",
             scope, mode, "dynamic" if dynamic else "static")


def start_compile_workers(kernels, device: torch.device) -> bool:
    """Start inductor's compile worker processes now, when this job will compile for CUDA -> whether
    they were started. torch starts them only once dynamo hands it the first graph, and until they
    are up inductor compiles each Triton kernel in this process, one after another (on the H200 the
    60-row job's first compiled pass took 16.8 to 20.1 s from a cold start, 14.1 s with the workers
    started 10 s ahead). Started before the model is built, they come up while it loads."""
    if torch.device(device).type != "cuda" or not (kernels.compile or kernels.compile_decoder):
        return False
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # does nothing where torch would not use workers (TORCH_WARM_POOL=0, one compile thread)
    return True


def compile_options(mode: str) -> dict:
    """kernels.compile_mode -> torch.compile's keywords (the transformer's and the decoder's compile).
    `coordinate-descent` is inductor's default mode with `coordinate_descent_tuning` (torch.compile
    takes a mode or options, not both)."""
    if mode not in COMPILE_MODES:
        raise UserError(f"kernels.compile_mode={mode!r} is not accepted; choose one of {list(COMPILE_MODES)}")
    if mode == "coordinate-descent":
        return {"options": {"coordinate_descent_tuning": True}}
    return {"mode": mode}


CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextmanager
def compile_cache(directory: str | None):
    """Inductor's on-disk caches (FX graphs, autotuning, Triton kernels) in `directory` while the
    block runs (None: torch's choice), then the environment as it was: the next job of the same
    process (a Hydra sweep) gets its own setting. Inductor sets Triton's directory inside its own at
    the first compile, so a Triton directory inside the old one follows the move."""
    saved = {name: os.environ.get(name) for name in CACHE_ENV}
    if directory is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(directory).expanduser().resolve())
        old, triton = saved["TORCHINDUCTOR_CACHE_DIR"], saved["TRITON_CACHE_DIR"]
        if old and triton and triton.startswith(old):
            del os.environ["TRITON_CACHE_DIR"]
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compile_decoder(adapter, mode: str, chunk: int, probe_size: tuple[int, int] | None) -> float:
    """Compile the VAE decoder (`compile_vae_decoder`) and decode through `decode_in_chunks` from now
    on; with `probe_size`, decode one chunk of zeros there so that the compile happens now, at
    warm-up, not in the first batch -> seconds that took."""
    compile_vae_decoder(adapter.vae.decoder, mode)
    decode = adapter.decode
    adapter.decode = lambda latents: decode_in_chunks(decode, latents, chunk)
    if probe_size is None:
        return 0.0
    start = time.perf_counter()
    zeros = torch.zeros(1, *adapter.latent_shape(*probe_size), dtype=adapter.dtype, device=adapter.device)
    with torch.no_grad():
        adapter.decode(zeros)
    if adapter.device.type == "cuda":
        torch.cuda.synchronize(adapter.device)
    return time.perf_counter() - start


def compile_vae_decoder(decoder: torch.nn.Module, mode: str) -> None:
    """Compile the decoder's forward with symbolic height and width and a static batch (the caller
    decodes a fixed chunk: `decode_in_chunks`), so one graph serves every resolution. The batch is
    marked static on the tensor the compiled code receives, and duck sizing is off while dynamo
    traces: it would give a square latent's two sides one symbol, so a non-square one recompiles."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    compiled = torch.compile(type(decoder).forward.__get__(decoder), dynamic=True, fullgraph=True, **compile_options(mode))

    def forward(sample: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        torch._dynamo.mark_static(sample, 0)
        with fx_config.patch(use_duck_shape=False):
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


def broadcast_attention_masks(transformer: torch.nn.Module) -> None:
    """diffusers repeats an attention mask per head with `repeat_interleave`, whose output size
    dynamo fixes to the batch it first sees (on the H200, torch 2.11: one compilation per bucket).
    The same mask, per head, from `expand`: the same values in the same layout, any batch size."""
    from diffusers.models.attention_processor import Attention

    for module in transformer.modules():
        if isinstance(module, Attention):
            module.prepare_attention_mask = MethodType(_prepare_attention_mask, module)


def _prepare_attention_mask(attn, attention_mask, target_length: int, batch_size: int, out_dim: int = 3):
    """Attention.prepare_attention_mask for a [B, 1, L] mask of full length (PixArt's captions);
    every other case is left to diffusers."""
    if (attention_mask is None or out_dim != 3 or attention_mask.ndim != 3 or attention_mask.shape[-1] != target_length
            or attention_mask.shape[0] != batch_size):
        return type(attn).prepare_attention_mask(attn, attention_mask, target_length, batch_size, out_dim)
    rows, queries, keys = attention_mask.shape
    per_head = attention_mask.unsqueeze(1).expand(rows, attn.heads, queries, keys)
    return per_head.reshape(rows * attn.heads, queries, keys)


def contiguous_block_input(transformer: torch.nn.Module) -> None:
    """The patch embedding hands the first block a transposed view (tokens with stride 1), every
    other block a contiguous tensor; dynamo guards on strides, so the block would compile twice.
    A contiguous copy of the embedding (outside the compiled blocks) leaves one compilation."""
    embed = getattr(transformer, "pos_embed", None)
    if embed is not None and getattr(embed, CONTIGUOUS_HOOK, None) is None:
        hook = embed.register_forward_hook(lambda module, args, out: out.contiguous() if torch.is_tensor(out) else out)
        setattr(embed, CONTIGUOUS_HOOK, hook)


def compile_stats(since: dict | None = None) -> dict:
    """What torch.compile did in this process (since the `since` snapshot, an earlier return): the
    graphs dynamo compiled (a new shape that breaks a guard adds one), the seconds spent compiling
    them (tracing, inductor, Triton), and how many inductor found in its cache. dynamo's counters are
    per process, never reset."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(times) for name, times in compilation_time_metrics.items() if name.endswith("compile_inner"))
    now = {"compiled_graphs": int(counters["stats"]["unique_graphs"]), "compile_s": seconds,
           # inductor's FX graph cache (kernels.compile_cache_dir): graphs loaded instead of compiled
           "cache_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
           "cache_misses": int(counters["inductor"]["fxgraph_cache_miss"])}
    if since is not None:
        now = {key: value - since[key] for key, value in now.items()}
    return {**now, "compile_s": round(now["compile_s"], 2)}


# ---- float8 -------------------------------------------------------------------------------------


def check_fp8(device: torch.device) -> None:
    """kernels.fp8=true needs float8 tensor cores and torchao; refused at start otherwise."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError("kernels.fp8=true needs a CUDA GPU with float8 tensor cores (sm89+: Ada, Hopper, Blackwell)")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("kernels.fp8=true needs the torchao package (pip install torchao); it is not installed")


def quantize_fp8(transformer: torch.nn.Module) -> int:
    """Float8 weights and dynamically scaled float8 activations for the transformer's linear layers
    (torchao); -> layers converted. CUDA with sm89+ only."""
    check_fp8(transformer.device)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    before = sum(isinstance(m, torch.nn.Linear) for m in transformer.modules())
    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return before


def output_kernels(kernels) -> dict:
    """The kernel settings that change images, where they differ from the defaults."""
    out: dict = {}
    if kernels.attention != "auto":
        out["attention"] = kernels.attention
    for key in ("fuse_qkv", "fp8", "fuse_gelu", "fuse_residual", "trim_text_padding"):  # switches count only when on
        if getattr(kernels, key):
            out[key] = True
    if kernels.compile:
        out.update(compile=True, compile_mode=kernels.compile_mode, compile_dynamic=kernels.compile_dynamic)
        if kernels.compile_scope != "model":  # keys added later count only away from their default
            out["compile_scope"] = kernels.compile_scope
    if kernels.compile_decoder:  # the chunk is the decoder's batch: its kernels, its rounding
        out.update(compile_decoder=True, decode_chunk=kernels.decode_chunk, compile_mode=kernels.compile_mode)
    return out


# ---- all of it, in order ------------------------------------------------------------------------


def apply_kernels(kernels, adapter, probe_size: tuple[int, int] | None, shapes: int,
                  texts: Iterable[str] | None = None) -> dict:
    """Set the transformer's kernels from `kernels` (KernelsConfig): the text length (from every
    prompt the job may encode, `texts`), attention processor, fused projections and GELU, then fp8,
    then compile; observe which attention backend serves its calls (one eager CFG forward, 1 row, at
    `probe_size`) -> stats.json's `kernels`."""
    from bcg.buffers import StaticInputs

    check_kernels(kernels, adapter.family, adapter.device)
    attention = kernels.attention
    report: dict = {"attention": attention, "compile": kernels.compile, "fp8": kernels.fp8}
    if kernels.trim_text_padding:
        if texts is None:
            raise ValueError("kernels.trim_text_padding: apply_kernels needs every text the job will encode (texts=...)")
        report["text_length"] = adapter.fit_text_length(texts)
        log.info("kernels: prompts padded to %d tokens (the longest prompt, rounded up), not %d",
                 report["text_length"], adapter.max_sequence_length)
    if attention == "flash_attn":
        use_flash_attn(adapter.transformer)
    if kernels.fuse_qkv:
        report["fused_attention_layers"] = fuse_qkv(adapter.transformer)
        log.info("kernels: fused q|k|v projections in %d attention layers", report["fused_attention_layers"])
    if kernels.fuse_gelu:
        report["fused_gelu_layers"] = fuse_gelu(adapter.transformer)
        log.info("kernels: %d feed-forward GELUs in the up-projection's cuBLASLt epilogue", report["fused_gelu_layers"])
    if kernels.fuse_residual:  # eager layer norms until compile_transformer (scope norms) compiles them
        from pipeline.residual import fuse_residual

        report["fused_residual_blocks"] = fuse_residual(adapter.transformer)
        log.info("kernels: the residual adds of %d blocks inside their matmuls", report["fused_residual_blocks"])
        if not kernels.compile and adapter.device.type == "cuda":
            log.warning("kernels: fuse_residual without kernels.compile runs its layer norms as separate fp32 ops "
                        "(more passes, fp32 temporaries); kernels.compile=true kernels.compile_scope=norms fuses them")
    if probe_size is not None:
        inputs = StaticInputs.allocate(adapter.input_specs(*probe_size), 1, adapter.device).view(1)
        try:
            with torch.no_grad():
                calls = probe_attention(lambda: with_attention(adapter.guided_eps, attention, adapter.device.type)(inputs))
        except torch.OutOfMemoryError:
            calls = {"not observed": "out of memory in the probe"}
            log.warning("kernels: the attention probe ran out of memory; which backend serves attention is not known")
        report["attention_calls_per_forward"] = calls
        log.info("kernels: attention=%s; attention calls per CFG forward by backend: %s", attention, calls)
    if kernels.fp8:
        report["fp8_linear_layers"] = quantize_fp8(adapter.transformer)
        log.info("kernels: %d linear layers in float8 (torchao)", report["fp8_linear_layers"])
        if not kernels.compile:
            log.warning("kernels: float8 without kernels.compile scales activations in separate, unfused kernels: "
                        "on the H200 a step took 1.6x as long as bf16 (docs/BENCHMARKS.md)")
    if kernels.compile or kernels.compile_decoder:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        report.update(compile_mode=kernels.compile_mode, compile_cache_dir=cache_dir())
    if kernels.compile:
        report.update(compile_dynamic=kernels.compile_dynamic, compile_scope=kernels.compile_scope)
        compile_transformer(adapter.transformer, kernels.compile_mode, shapes, kernels.compile_dynamic,
                            kernels.compile_scope)
    if kernels.compile_decoder:
        seconds = compile_decoder(adapter, kernels.compile_mode, kernels.decode_chunk, probe_size)
        report.update(compile_decoder=True, decode_chunk=kernels.decode_chunk, decoder_first_pass_s=round(seconds, 2))
        log.info("kernels: VAE decoder compiled with inductor (mode=%s), %d latents per call; first pass %.1f s",
                 kernels.compile_mode, kernels.decode_chunk, seconds)
    return report
