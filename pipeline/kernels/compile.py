"""kernels.compile: the transformer compiled with inductor, without inductor's own CUDA graphs, so
that our engine captures the compiled kernels like any others; and what every compile shares: the
mode's and the tuning's options, the job's on-disk cache, the compile workers, and the counts the
job reports.

`compile_scope`: `model` compiles the whole transformer; `blocks` its repeated blocks, each kind once,
the code reused by every block of it (regional compilation: far shorter compiles, no fusion across
blocks); `norms` what PixArt's own blocks leave to fuse (pipeline.blocks.pixart, which compiles them
when it is built).

Why two processes could run different kernels, and what keeps them the same:
- A kernel's block sizes (and with them the order in which a reduction adds, so its rounding) are
  chosen when it is generated. `compile_tuning=timed` lets inductor time the candidates there
  (coordinate descent, autotuning): timing noise can choose differently in another process. `fixed`
  (inductor's deterministic mode) chooses from the kernel's sizes alone.
- With symbolic sizes, "the kernel's sizes" are the size hints of the first call of each compiled
  graph (dynamo compiles a batch of 1 apart from larger ones). So that they never depend on the
  job's first shape, a compiled transformer's first call of each kind is made at a fixed shape
  (`CANONICAL`: the model's native size, 1 or 2 rows; `CanonicalFirstCalls`), whatever the job runs:
  every process, shard, resume and job generates the same kernels. PixArt's layer norm off CUDA is
  compiled for a fixed row-count hint (pipeline.blocks.pixart.NORM_ROWS_HINT).
- What one process compiled lands in the user's cache for these kernels (`compile_cache`), which
  later processes and jobs on the same GPU model load instead of compiling.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import MethodType
from typing import TYPE_CHECKING, Callable

import torch

from pipeline.config import COMPILE_MODES, COMPILE_SCOPES, COMPILE_TUNINGS
from pipeline.plans import KernelSettings
from pipeline.errors import not_accepted
from pipeline.kernels import precompile, reductions
from pipeline.paths import check_writable_dir
from pipeline.process_state import saved_environ

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # what compile_cache points at the job's cache
CACHE_HOME = "BCG_CACHE_DIR"  # the per-user cache's root where set; else $XDG_CACHE_HOME/bcg-datagen, ~/.cache/bcg-datagen
# dynamo's settings under which a block or the VAE decoder is traced once: float scalars as constants
# (theirs are: norm epsilons, attention and upsampling scales). Left symbolic, the pass that turns them
# into tensors stops the first trace and dynamo traces it all again, in every process, a warm one too.
TRACED_ONCE = {"specialize_float": True}
CONTIGUOUS_HOOK = "_contiguous_output_hook"  # the patch embedding's hook handle (contiguous_block_input)


def check(kernels: KernelSettings, device: torch.device | None) -> None:
    """A compile mode or scope that is not accepted, for whichever compile is on."""
    if kernels.compile or kernels.compile_decoder:
        compile_options(kernels.compile_mode, kernels.compile_tuning)
    if kernels.compile and kernels.compile_scope not in COMPILE_SCOPES:
        raise not_accepted("kernels.compile_scope", kernels.compile_scope, COMPILE_SCOPES)


# The shapes a compiled transformer is first called at (the kernels' size hints): the native size, and
# a batch of 1 or of 2 (dynamo specializes a batch of 1, so each kind has its own kernels).
CANONICAL = "native-size-rows-1-and-2"


def apply(kernels: KernelSettings, adapter: Adapter, shapes: int) -> dict:
    """Compile this adapter's transformer (kernels.compile) -> the compile settings the job reports:
    where the job keeps the kernels it builds and whether every process runs the same kernels
    (`reproducible`, with the reason when not), also where it builds only the decoder's compile
    (kernels.compile_decoder) or the Triton layer norm; with kernels.compile, the transformer's mode,
    tuning, shapes and scope. A dynamic compile makes the adapter's step call each kind of graph first
    at its canonical shape (`CanonicalFirstCalls`)."""
    report: dict = {}
    if builds_kernels(kernels, adapter.device):  # where compile_cache put them (None outside a job)
        why = not_reproducible(kernels)
        report.update(compile_cache_dir=os.environ.get(CACHE_ENV[0]), reproducible=why is None,
                      **({"not_reproducible": why} if why else {}))
    if kernels.compile:
        report.update(compile_mode=kernels.compile_mode, compile_tuning=kernels.compile_tuning,
                      compile_dynamic=kernels.compile_dynamic, compile_scope=kernels.compile_scope)
        if kernels.persistent_reductions:
            report.update(persistent_reductions=reductions.MAX_VALUES)
        report.update(compile_transformer(adapter.transformer, kernels.compile_mode, kernels.compile_tuning, shapes,
                                          kernels.compile_dynamic, kernels.compile_scope, kernels.persistent_reductions,
                                          kernels.precompile))
        if kernels.compile_dynamic and kernels.compile_scope != "norms":
            adapter.guided_eps = CanonicalFirstCalls(adapter)
            report.update(compiled_for=CANONICAL)
    return report


class CanonicalFirstCalls:
    """The adapter's step (`guided_eps`), which before its first call of each kind (a batch of 1, or
    of more) makes one call at the canonical shape: the model's native size, 1 or 2 rows, zeros for
    the latents and conditioning. The compiled graph of that kind is generated for those sizes,
    whatever size the job runs first. A call while a CUDA graph is being captured must find its kind
    compiled already (the engine's warm-up passes run before every capture)."""

    def __init__(self, adapter: Adapter):
        self.step: Callable = adapter.guided_eps
        self.specs, self.side, self.device = adapter.input_specs, adapter.native_side, adapter.device
        self.done: set[bool] = set()

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        single = inputs["x"].shape[0] == 1
        if single not in self.done:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("kernels.compile: a graph kind first called during a CUDA graph capture; "
                                   "warm-up passes (bcg.warmup >= 1) must run before capture")
            self.done.add(single)
            import torch.fx.experimental._config as fx_config

            # without duck sizing, a canonical size that equals a weight's (a tiny model's hidden size)
            # is not made one symbol with it, which a later shape would have to compile again for
            with fx_config.patch(use_duck_shape=False):
                self.step(canonical_inputs(self.specs(self.side, self.side), 1 if single else 2, self.device))
        return self.step(inputs)


def canonical_inputs(specs: dict, rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Zeros of every input the step takes, `rows` rows (the size hints are what matters)."""
    return {name: torch.zeros((rows, *spec.shape), dtype=spec.dtype, device=device) for name, spec in specs.items()}


def not_reproducible(kernels: KernelSettings) -> str | None:
    """Why this job's compiled kernels may differ between its processes (and so images by rounding),
    or None where every process runs the same (see the module's docstring)."""
    if kernels.compile and kernels.compile_tuning == "timed":  # the decoder's compile is never timed
        return ("kernels.compile_tuning=timed: inductor times candidate block sizes in the process that compiles a "
                "kernel, and another process may time others faster; processes that load this job's compile cache "
                "(a resume on the same GPU) run the kernels it holds the choices of, though a few are timed again, "
                "and those that compile for themselves (shards that start together or run on other GPUs, jobs with "
                "another cache) may make images that differ by rounding; kernels.compile_tuning=fixed makes them "
                "the same")
    return None


def compile_transformer(transformer: torch.nn.Module, mode: str, tuning: str, shapes: int, dynamic: bool,
                        scope: str = "model", persistent: bool = False, saved: bool = False) -> dict:
    """Compile this transformer instance in place with inductor (see the module's docstring for
    `scope` and `tuning`). `dynamic`: one compilation with symbolic batch and token counts serves every
    (resolution, bucket) (see broadcast_attention_masks, contiguous_block_input); else one per shape.
    `shapes` raises dynamo's recompile limit so that no shape silently falls back to eager, and
    TRACED_ONCE applies (process-wide settings: the job puts them back when it ends,
    pipeline.process_state). `persistent`: kernels.persistent_reductions (pipeline.kernels.reductions).
    `norms`: nothing here (PixArt's own blocks compiled theirs when built). `saved`: kernels.precompile
    (pipeline.kernels.precompile), whose counts (loaded, compiled) the returned report holds as they grow."""
    how = compile_options(mode, tuning, persistent)
    if scope not in COMPILE_SCOPES:
        raise not_accepted("kernels.compile_scope", scope, COMPILE_SCOPES)
    compile_limits(shapes)
    if scope == "norms":
        return {}
    owned = hasattr(transformer, "repeated_blocks")  # our own blocks (pipeline.blocks): contiguous, no masks
    if dynamic and not owned:
        broadcast_attention_masks(transformer)
    report: dict = {}
    if scope == "blocks":
        if not owned:
            contiguous_block_input(transformer)
        why = precompile.unsupported(owned) if saved else None
        if why:
            log.warning("kernels.precompile: %s; the blocks are traced in every process, as without it", why)
            report["precompiled"] = {"unsupported": why}
        if saved and not why:
            directory = Path(os.environ.get(CACHE_ENV[0]) or tempfile.mkdtemp(prefix="bcg-precompiled-")) / "precompiled"
            blocks = precompile.SavedBlocks(repeated_blocks(transformer), directory, how["options"])
            report["precompiled"] = blocks.counts
        else:
            for block in repeated_blocks(transformer):
                block.compile(dynamic=dynamic, fullgraph=True, **how)
    else:
        transformer.compile(dynamic=dynamic, fullgraph=True, **how)
    log.info("kernels: transformer %s compiled with inductor (mode=%s, tuning %s, %s shapes, no inductor CUDA graphs%s)",
             scope, mode, tuning, "dynamic" if dynamic else "static",
             ", each kind saved whole" if "loaded" in report.get("precompiled", {}) else "")
    return report


def compile_limits(shapes: int) -> None:
    """dynamo's recompile limit raised for `shapes` shapes, and TRACED_ONCE: settings of the process
    (a job puts them back when it ends, pipeline.process_state), set by every job that runs compiled
    code, whether it compiled it or took it from an earlier job of a sweep (pipeline.kept_model)."""
    import torch._dynamo.config as dynamo_config

    limit = max(dynamo_config.recompile_limit, shapes + 2)
    dynamo_config.recompile_limit = limit
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, limit * 8)
    for key, value in TRACED_ONCE.items():
        setattr(dynamo_config, key, value)


def process_settings(kernels: KernelSettings, shapes: int) -> None:
    """What `apply` sets in the process rather than on the model, set again for a model whose kernels
    an earlier job of this process applied: dynamo's limits, inductor's choices of persistent
    reductions in this thread (a recompile for a new shape uses both)."""
    if kernels.compile:
        compile_limits(shapes)
        if kernels.persistent_reductions:
            reductions.compile_options()


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks a regional compile compiles: our own transformer's, or a diffusers transformer's
    `transformer_blocks` (and Flux's `single_transformer_blocks`)."""
    if hasattr(transformer, "repeated_blocks"):
        return transformer.repeated_blocks()
    return [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", ())]


def compile_options(mode: str, tuning: str, persistent: bool = False) -> dict:
    """kernels.compile_mode and kernels.compile_tuning (and for the transformer
    kernels.persistent_reductions) -> torch.compile's keywords (the transformer's and the decoder's
    compile). torch.compile takes a mode or options, not both: the mode is given as its options
    (`torch._inductor.list_mode_options`); `coordinate-descent` is inductor's default mode with
    `coordinate_descent_tuning`, `fixed` tuning its `deterministic` mode (no timing decides what
    changes numerics); `persistent`: pipeline.kernels.reductions. Part of inductor's cache key: a
    cache never serves one for the other."""
    if mode not in COMPILE_MODES:
        raise not_accepted("kernels.compile_mode", mode, COMPILE_MODES)
    if tuning not in COMPILE_TUNINGS:
        raise not_accepted("kernels.compile_tuning", tuning, COMPILE_TUNINGS)
    from torch._inductor import list_mode_options

    options = {"coordinate_descent_tuning": True} if mode == "coordinate-descent" else dict(list_mode_options(mode))
    if tuning == "fixed":
        options["deterministic"] = True
    if persistent:
        options.update(reductions.compile_options())
    return {"options": options}


def start_compile_workers(kernels: KernelSettings, device: torch.device) -> bool:
    """Start inductor's compile worker processes now, when this job will compile for CUDA -> whether
    they were started. torch starts them only once dynamo hands it the first graph, and until they
    are up inductor compiles each Triton kernel in this process, one after another. Started before
    the model is built, they come up while it loads."""
    if torch.device(device).type != "cuda" or not (kernels.compile or kernels.compile_decoder):
        return False
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()  # does nothing where torch would not use workers (TORCH_WARM_POOL=0, one compile thread)
    return True


def builds_kernels(kernels: KernelSettings, device: torch.device | str | None) -> bool:
    """Whether this job builds kernels a later process can load: an inductor compile, or Triton kernels
    of our own on a CUDA device (kernels.fuse_residual's layer norm, kernels.fuse_decoder's group norms)."""
    triton_norms = (kernels.fuse_residual or kernels.fuse_decoder) and device is not None \
        and torch.device(device).type == "cuda"
    return kernels.compile or kernels.compile_decoder or triton_norms


def cache_directory(kernels: KernelSettings, out_dir: Path, device: torch.device | str | None) -> Path | None:
    """Where this job keeps the kernels it builds (`builds_kernels`) and the block sizes it tunes:
    kernels.compile_cache_dir, else the user's cache (`user_cache`), shared by every job with the same
    kernels on the same GPU model and versions; None when it builds none. (`out_dir`: the job's, which
    holds no kernels.)"""
    if not builds_kernels(kernels, device):
        return None
    return Path(kernels.compile_cache_dir or user_cache(kernels, device)).expanduser().resolve()


def user_cache(kernels: KernelSettings, device: torch.device | str | None) -> Path:
    """<the user's cache>/kernels/<key>: the key digests what makes compiled kernels differ: the
    settings that change images (pipeline.kernels.output_kernels, the plan's among them), the GPU's
    model, torch's, Triton's and this package's versions. A job on other prompts and sizes with the same
    key starts warm (its compiled code was first called at the same canonical shapes)."""
    import hashlib
    import importlib.metadata
    import json

    from pipeline.kernels import output_kernels

    def version(name: str) -> str | None:  # None: not installed (this package run from a checkout)
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    device = torch.device(device or "cpu")
    what = {"kernels": output_kernels(kernels), "torch": torch.__version__, "triton": version("triton"),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "package": version("bcg-datagen")}
    key = hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
    home = os.environ.get(CACHE_HOME) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bcg-datagen"
    return Path(home) / "kernels" / key


@contextmanager
def compile_cache(kernels: KernelSettings, out_dir: Path, device: torch.device | str | None):
    """Inductor's on-disk caches (FX graphs, AOT autograd, the tuned block sizes next to each kernel)
    and Triton's (its compiled kernels: inductor's, and kernels.fuse_residual's layer norm on `device`)
    in `cache_directory` while the block runs, then the environment as it was: the next job of the
    same process (a Hydra sweep) gets its own. A job that builds no kernels leaves the environment
    alone. Says at the start when the job's processes may run different kernels (`not_reproducible`)."""
    directory = cache_directory(kernels, out_dir, device)
    if directory is not None:  # refused before the model is built (null: the per-user cache, which CACHE_HOME moves)
        check_writable_dir("kernels.compile_cache_dir", directory,
                           f"set kernels.compile_cache_dir or {CACHE_HOME} to a folder you can write")
    with saved_environ():
        if directory is not None:
            inductor_env, triton_env = CACHE_ENV
            os.environ[inductor_env] = str(directory)
            os.environ[triton_env] = str(directory / "triton")
            log.info("kernels: the kernel cache in %s (later jobs with these kernels load what this one builds)",
                     directory)
            why = not_reproducible(kernels)
            if why:
                log.warning("kernels: not the same kernels in every process: %s", why)
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
    inductor = counters["inductor"]
    now = {"compiled_graphs": int(counters["stats"]["unique_graphs"]), "compile_s": seconds,
           # inductor's FX graph cache (compile_cache): graphs loaded instead of compiled, and graphs it
           # could not keep (a process after this one compiles them again)
           "cache_hits": int(inductor["fxgraph_cache_hit"]), "cache_misses": int(inductor["fxgraph_cache_miss"]),
           "cache_bypasses": int(inductor["fxgraph_cache_bypass"]),
           # candidate kernels timed by coordinate descent (compile_tuning=timed; none where the cache had the choice)
           "tuning_benchmarks": int(inductor["coordesc_tuning_bench"])}
    if since is not None:
        now = {key: value - since[key] for key, value in now.items()}
    return {**now, "compile_s": round(now["compile_s"], 2)}
