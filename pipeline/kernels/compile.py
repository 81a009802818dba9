"""kernels.compile: the transformer compiled with inductor, without inductor's own CUDA graphs, so
that our engine captures the compiled kernels like any others; and what every compile shares: the
mode's options, inductor's on-disk cache, its compile workers, and the counts the job reports.

`compile_scope`: `model` compiles the whole transformer; `blocks` its repeated block, once, the code
reused by every block (diffusers' regional compilation: far shorter compiles, no fusion across
blocks); `norms` what kernels.fuse_residual's block leaves to fuse (pipeline/kernels/residual.py).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path
from types import MethodType

import torch

from pipeline.config import COMPILE_MODES, COMPILE_SCOPES, KernelsConfig
from pipeline.errors import UserError
from pipeline.kernels import residual
from pipeline.models.base import Adapter
from pipeline.process_state import saved_environ

log = logging.getLogger(__name__)

CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
CONTIGUOUS_HOOK = "_contiguous_output_hook"  # the patch embedding's hook handle (contiguous_block_input)


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """A compile mode or scope that is not accepted, for whichever compile is on."""
    if kernels.compile or kernels.compile_decoder:
        compile_options(kernels.compile_mode)
    if kernels.compile and kernels.compile_scope not in COMPILE_SCOPES:
        raise UserError(f"kernels.compile_scope={kernels.compile_scope!r} is not accepted; "
                        f"choose one of {list(COMPILE_SCOPES)}")


def apply(kernels: KernelsConfig, adapter: Adapter, shapes: int) -> dict:
    """Compile this adapter's transformer (kernels.compile) -> the compile settings the job reports
    (also those of the decoder's compile, kernels.compile_decoder: the mode, the cache directory)."""
    report: dict = {}
    if kernels.compile or kernels.compile_decoder:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        report.update(compile_mode=kernels.compile_mode, compile_cache_dir=cache_dir())
    if kernels.compile:
        report.update(compile_dynamic=kernels.compile_dynamic, compile_scope=kernels.compile_scope)
        compile_transformer(adapter.transformer, kernels.compile_mode, shapes, kernels.compile_dynamic,
                            kernels.compile_scope)
    return report


def compile_transformer(transformer: torch.nn.Module, mode: str, shapes: int, dynamic: bool, scope: str = "model") -> None:
    """Compile this transformer instance in place with inductor (see the module's docstring for
    `scope`). `dynamic`: one compilation with symbolic batch and token counts serves every
    (resolution, bucket) (see broadcast_attention_masks, contiguous_block_input); else one per shape.
    `shapes` raises dynamo's recompile limit so that no shape silently falls back to eager (a
    process-wide setting: the job puts it back when it ends, pipeline.process_state)."""
    how = compile_options(mode)
    if scope not in COMPILE_SCOPES:
        raise UserError(f"kernels.compile_scope={scope!r} is not accepted; choose one of {list(COMPILE_SCOPES)}")
    import torch._dynamo.config as dynamo_config

    limit = max(dynamo_config.recompile_limit, shapes + 2)
    dynamo_config.recompile_limit = limit
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit * 8)
    if scope == "norms":  # kernels.fuse_residual's block, with its one fusable kernel compiled
        residual.fuse_residual(transformer, *residual.compiled_functions(dynamic, how))
    elif dynamic:
        broadcast_attention_masks(transformer)
    if scope == "blocks":
        # diffusers compiles every submodule whose class is listed in `_repeated_blocks` (Flux lists
        # its two kinds); PixArt, SD3 and DiT do not list theirs, so name the class of the first of
        # `transformer_blocks` (an attribute of this instance, shadowing the class's).
        if not type(transformer)._repeated_blocks:
            transformer._repeated_blocks = (type(transformer.transformer_blocks[0]).__name__,)
        contiguous_block_input(transformer)
        transformer.compile_repeated_blocks(dynamic=dynamic, fullgraph=True, **how)
    elif scope == "model":
        transformer.compile(dynamic=dynamic, fullgraph=True, **how)
    log.info("kernels: transformer %s compiled with inductor (mode=%s, %s shapes, no inductor CUDA graphs)",
             scope, mode, "dynamic" if dynamic else "static")


def compile_options(mode: str) -> dict:
    """kernels.compile_mode -> torch.compile's keywords (the transformer's and the decoder's compile).
    `coordinate-descent` is inductor's default mode with `coordinate_descent_tuning` (torch.compile
    takes a mode or options, not both)."""
    if mode not in COMPILE_MODES:
        raise UserError(f"kernels.compile_mode={mode!r} is not accepted; choose one of {list(COMPILE_MODES)}")
    if mode == "coordinate-descent":
        return {"options": {"coordinate_descent_tuning": True}}
    return {"mode": mode}


def start_compile_workers(kernels: KernelsConfig, device: torch.device) -> bool:
    """Start inductor's compile worker processes now, when this job will compile for CUDA -> whether
    they were started. torch starts them only once dynamo hands it the first graph, and until they
    are up inductor compiles each Triton kernel in this process, one after another. Started before
    the model is built, they come up while it loads."""
    if torch.device(device).type != "cuda" or not (kernels.compile or kernels.compile_decoder):
        return False
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # does nothing where torch would not use workers (TORCH_WARM_POOL=0, one compile thread)
    return True


@contextmanager
def compile_cache(directory: str | None):
    """Inductor's on-disk caches (FX graphs, autotuning, Triton kernels) in `directory` while the
    block runs (None: torch's choice), then the environment as it was: the next job of the same
    process (a Hydra sweep) gets its own setting. Inductor sets Triton's directory inside its own at
    the first compile, so a Triton directory inside the old one follows the move."""
    with saved_environ():
        if directory is not None:
            old, triton = (os.environ.get(name) for name in CACHE_ENV)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(directory).expanduser().resolve())
            if old and triton and triton.startswith(old):
                del os.environ["TRITON_CACHE_DIR"]
        yield


def broadcast_attention_masks(transformer: torch.nn.Module) -> None:
    """diffusers repeats an attention mask per head with `repeat_interleave`, whose output size
    dynamo fixes to the batch it first sees (one compilation per bucket). The same mask, per head,
    from `expand`: the same values in the same layout, any batch size. Set on each attention module
    instance; the class keeps diffusers' method."""
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
