"""The kernels the denoiser runs: kernels as plain functions and custom ops, and how a job sets them up.

The job's settings come resolved from its kernel plan (pipeline.plans.KernelSettings). Where they ask
for what diffusers' modules do not compute, the transformer is replaced by the project's own blocks
(pipeline.blocks), which call these kernels:

- attention: the SDPA backend (or flash-attn's processor) and `probe`, which observes what ran
- attention_inputs, fp8_attention: Flux's queries' and keys' norms and rotation, and its float8 attention
- fp8, fp8_gelu, fp8_norm: float8 numerics, the GELU and the modulated norms writing float8 rows;
  fp8_gelu_mm: the up-projection, its GELU and their float8 rows as one matmul
- norm: PixArt's fixed Triton layer norm (its own blocks, kernels.fuse_residual); residual_rows: its
  float8 blocks' residual adds, norms and quantizations
- qkv: diffusers' fused projections (PixArt); joined: SD3's joint attention's projections written into one
  buffer; text: kernels.trim_text_padding
- compile: inductor (mode, tuning, the cache, the shapes it first compiles, workers, counts);
  reductions: its persistent reductions; precompile: the compiled blocks saved whole and loaded; decoder: the VAE decoder's kernels (group_norm: its fused group
  norms, or inductor's compile)

Which settings go together is stated once, as data (SUPPORTED_FAMILIES, FAMILY_REQUIRES, EXCLUDES, REQUIRES,
NEEDS_CUDA):
`check_kernels` walks those tables, then each module's own check. A job changes only its own model
instance, and what it changes in the process (dynamo's limits, the cache directory) is put back when
it ends (pipeline.process_state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from pipeline.errors import UserError, not_accepted
from pipeline.kernels import (attention, compile, cudnn_attention, decoder, fp8, fp8_attention, fp8_gelu, fp8_gelu_mm,
                              fp8_norm, norm, qkv, text)
from pipeline.kernels import group_norm, precompile, residual_rows
from pipeline.kernels import attention_inputs
from pipeline.kernels.attention import SDPA, with_attention
from pipeline.kernels.compile import (CONTIGUOUS_HOOK, compile_cache, compile_stats, process_settings,
                                     start_compile_workers)
from pipeline.kernels.decoder import compile_vae_decoder, decode_in_chunks
from pipeline.plans import AUTO, FP8_ATTENTION_KERNELS, KernelSettings, ResolvedPlan

__all__ = [
    "CONTIGUOUS_HOOK", "SDPA", "apply_kernels", "check_kernels", "compile_cache", "compile_stats", "compile_vae_decoder",
    "decode_in_chunks", "fp8_attention_choice", "output_kernels", "process_settings", "start_compile_workers",
    "tma_choice", "with_attention",
]


@dataclass(frozen=True)
class Option:
    """A kernel setting as the user types it (`kernels.<key>`), whether a config has it, and what
    to set instead."""

    key: str
    on: Callable[[KernelSettings], bool]
    off: str


def switch(name: str) -> Option:
    """A boolean `kernels.<name>`."""
    return Option(f"{name}=true", lambda k: getattr(k, name), f"kernels.{name}=false")


FLASH_ATTN = Option("attention=flash_attn", lambda k: k.attention == "flash_attn",
                    f"kernels.attention to auto or one of PyTorch's SDPA backends {list(SDPA)}")
FUSE_QKV, FUSE_GELU, FUSE_RESIDUAL = switch("fuse_qkv"), switch("fuse_gelu"), switch("fuse_residual")
# PixArt's bf16/fp16 residual blocks (its float8 ones join their projections: kernels.fuse_qkv)
FUSE_RESIDUAL_BF16 = Option("fuse_residual=true", lambda k: k.fuse_residual and not k.fp8, "kernels.fuse_residual=false")
FP8, TRIM_TEXT, COMPILE = switch("fp8"), switch("trim_text_padding"), switch("compile")
SPLIT_OUT_PROJ, HOIST_MODULATION = switch("split_out_proj"), switch("hoist_modulation")
PERSISTENT, FP8_ATTENTION = switch("persistent_reductions"), switch("fp8_attention")
FUSE_QK_NORM, FP8_NORM, FUSE_GELU_MM = switch("fuse_qk_norm"), switch("fp8_norm"), switch("fuse_gelu_mm")
FUSE_DECODER, COMPILE_DECODER = switch("fuse_decoder"), switch("compile_decoder")
NORMS = Option("compile_scope=norms", lambda k: k.compile and k.compile_scope == "norms",
               "kernels.compile_scope=blocks (or model)")
FLUX_BLOCKS = "Flux's own blocks (model families {families}); this model is {family!r}"
JOINT_BLOCKS = "the own MM-DiT blocks of model families {families} (Flux's, SD3's); this model is {family!r}"

# option -> (the model families it serves, why: "{families}" and "{family}" filled in).
SUPPORTED_FAMILIES: dict[Option, tuple[tuple[str, ...], str]] = {
    FLASH_ATTN: (("pixart", "dit"), "its processor is written for the attention of model families {families}, "
                                    "not {family!r}"),
    FUSE_QKV: (("pixart", "sd3", "flux"), "diffusers fuses the projections of model families {families}, not {family!r}"),
    FUSE_RESIDUAL: (("pixart",), "the block it computes is PixArt's (model families {families}); this model is {family!r}"),
    SPLIT_OUT_PROJ: (("flux",), "it splits the out-projection of " + FLUX_BLOCKS),
    HOIST_MODULATION: (("flux", "sd3"), "it precomputes the adaptive norms' modulation of " + JOINT_BLOCKS),
    TRIM_TEXT: (("pixart",), "model families {families} mask the text padding out of attention, {family!r} does "
                             "not (its images would change)"),
    FUSE_QK_NORM: (("flux", "sd3"), "it computes the attention inputs of " + JOINT_BLOCKS),
    FP8_ATTENTION: (("flux", "sd3"), "its scales come from the bound of RMS-normalized queries and keys (Flux's, "
                                     "SD3.5's: model families {families}); this model is {family!r}"),
    FP8_NORM: (("pixart", "sd3", "flux"), "it computes the norms of the own float8 blocks of model families {families}; "
                                          "this model is {family!r}"),
    FP8: (("pixart", "sd3", "flux"), "its float8 layers are those of the own blocks of model families {families}; "
                                     "this model is {family!r}"),
    FUSE_GELU: (("pixart", "sd3", "flux"), "its GELU runs in the feed-forwards of the own blocks of model families "
                                           "{families}; this model is {family!r}"),
    FUSE_GELU_MM: (("pixart", "sd3", "flux"), "its matmul is the feed-forwards' of the own float8 blocks of model "
                                              "families {families}; this model is {family!r}"),
}

# (option, family) -> (the option it needs for that family, why)
FAMILY_REQUIRES: dict[tuple[Option, str], tuple[Option, str]] = {
    (FP8, "pixart"): (FUSE_RESIDUAL, "PixArt's float8 layers are those of its own residual blocks "
                                     "(pipeline/blocks/pixart_fp8.py)"),
    (FUSE_GELU, "pixart"): (FUSE_RESIDUAL, "PixArt's GELU epilogue is in the feed-forwards of its own residual blocks "
                                           "(pipeline/blocks/pixart.py)"),
}

# (option, option it cannot be combined with, why the first excludes the second)
RESIDUAL_OWNS_ATTENTION = "computes the attention and folds the gates into bf16/fp16 weights itself"
EXCLUDES: tuple[tuple[Option, Option, str], ...] = (
    (FUSE_QKV, FLASH_ATTN, "replaces the attention processor"),
    (FUSE_RESIDUAL_BF16, FUSE_QKV, RESIDUAL_OWNS_ATTENTION + " (its float8 blocks, kernels.fp8, join q|k|v)"),
    (FUSE_RESIDUAL, FLASH_ATTN, RESIDUAL_OWNS_ATTENTION),
    (FUSE_DECODER, COMPILE_DECODER, "runs the VAE decoder on Triton kernels of its own, which inductor would "
                                    "compile instead"),
    (FP8_NORM, NORMS, "runs PixArt's float8 row functions as Triton kernels of its own, which inductor would compile "
                      "instead"),
)

# (options that, all on, need another option; why: the settings' values filled in, e.g. "{compile_scope}")
REQUIRES: tuple[tuple[tuple[Option, ...], Option, str], ...] = (
    ((NORMS,), FUSE_RESIDUAL, "it compiles what kernels.fuse_residual's block leaves to fuse"),
    ((PERSISTENT,), COMPILE, "it chooses how inductor compiles the transformer's reductions"),
    ((FP8_NORM,), FP8, "it writes the norms' outputs as the float8 layers' quantized rows"),
    ((FUSE_GELU_MM,), FP8, "it is a float8 matmul"),
    ((FUSE_GELU_MM,), FUSE_GELU, "it is where kernels.fuse_gelu puts the GELU"),
    ((FUSE_RESIDUAL, COMPILE), NORMS, "the block adds into its input in place, which compile_scope={compile_scope} "
                                      "would trace; compile_scope=norms compiles what is left to fuse (the per-step "
                                      "constants, and off CUDA the layer norms), once"),
)

# option -> why it runs on CUDA only
NEEDS_CUDA: dict[Option, str] = {
    FUSE_GELU: "cuBLASLt's GELU epilogue is the tanh GELU these models use, while PyTorch's CPU version of the "
               "fused op computes the exact GELU",
}


def check(kernels: KernelSettings, device: torch.device | None) -> None:
    """Float8 attention's kernel is one of FP8_ATTENTION_KERNELS; the float8 settings need float8 tensor
    cores, the Triton kernels Triton, on a known device."""
    if kernels.fp8_attention_kernel not in FP8_ATTENTION_KERNELS:
        raise not_accepted("kernels.fp8_attention_kernel", kernels.fp8_attention_kernel, FP8_ATTENTION_KERNELS)
    if device is None:
        return
    for option in (FP8, FP8_ATTENTION, FP8_NORM, FUSE_GELU_MM):
        if option.on(kernels):
            fp8.check_fp8(device, f"kernels.{option.key}")
    if FUSE_GELU_MM.on(kernels) and (arch := without_tma(device)):
        raise UserError(f"kernels.fuse_gelu_mm=true reads its operands through the tensor memory accelerator of "
                        f"Hopper and later GPUs (sm90+), this GPU is {arch}; set {FUSE_GELU_MM.off}")
    if torch.device(device).type == "cuda":
        for option, what in ((FUSE_RESIDUAL, "runs its layer norm"), (FP8_NORM, "runs the modulated norms writing float8 rows"),
                             (FUSE_QK_NORM, "normalizes and rotates the queries and keys"),
                             (FP8_ATTENTION, "computes the attention"),
                             (FUSE_DECODER, "runs the VAE decoder's group norms"),
                             (FUSE_GELU_MM, "runs the up-projection and its GELU"),
                             (FUSE_GELU, "runs the GELU and its float8 quantization") if kernels.fp8 else (None, "")):
            if option is not None and option.on(kernels):
                norm.check_triton(f"kernels.{option.key} {what}", option.off)


# each option's refusals that the tables do not state (values, packages, the device's features)
CHECKS = (attention.check, compile.check, precompile.check, decoder.check, check)


def check_kernels(kernels: KernelSettings, family: str | None = None, device: torch.device | None = None) -> None:
    """What can be refused before the model is built or changed: settings that exclude each other or
    need another, a setting this family cannot use, one that needs CUDA elsewhere, then each option's
    own refusals (`family`, `device` None: not known yet)."""
    for first, second, why in EXCLUDES:
        if first.on(kernels) and second.on(kernels):
            raise UserError(f"kernels.{first.key} {why}; it cannot be combined with kernels.{second.key}: "
                            f"set {first.off} or {second.off}")
    for together, needed, why in REQUIRES:
        if all(option.on(kernels) for option in together) and not needed.on(kernels):
            keys = " with ".join(f"kernels.{option.key}" for option in together)
            instead = " or ".join(option.off for option in together)
            raise UserError(f"{keys} needs kernels.{needed.key}: {why.format_map(vars(kernels))}; "
                            f"set kernels.{needed.key}, or {instead}")
    if device is not None and torch.device(device).type != "cuda":  # first: no other setting makes it run
        for option, why in NEEDS_CUDA.items():
            if option.on(kernels) and not (option is FUSE_GELU and kernels.fp8):
                raise UserError(f"kernels.{option.key} needs CUDA: {why}; set {option.off}")
    if family is not None:
        refusal = family_refusal(kernels, family)
        if refusal:
            raise UserError(refusal)
        for (option, needs_family), (needed, why) in FAMILY_REQUIRES.items():
            if family == needs_family and option.on(kernels) and not needed.on(kernels):
                raise UserError(f"kernels.{option.key} for model family {family!r} needs kernels.{needed.key}: {why}; "
                                f"set kernels.{needed.key}, or {option.off}")
    for each in CHECKS:
        each(kernels, device)


def family_refusal(kernels: KernelSettings, family: str) -> str | None:
    """Every setting this family cannot use, in one message, with the whole fix: each one's `off`,
    and what turning the switches off would then need (compile_scope=norms serves fuse_residual only),
    so that one change of the command runs."""
    refused = [(option, families, why) for option, (families, why) in SUPPORTED_FAMILIES.items()
               if option.on(kernels) and family not in families]
    if not refused:
        return None
    reasons = "; ".join(f"kernels.{option.key}: {why.format(families=list(families), family=family)}"
                        for option, families, why in refused)
    fixes = [option.off for option, _, _ in refused]
    switched_off = replace(kernels, **{option.key.removesuffix("=true"): False for option, _, _ in refused
                                       if option.key.endswith("=true")})
    fixes += [together[0].off for together, needed, _ in REQUIRES
              if all(option.on(switched_off) for option in together) and not needed.on(switched_off)]
    return f"{reasons}; set {' '.join(fixes)}"


def tma_choice(plan: ResolvedPlan, device: torch.device) -> ResolvedPlan:
    """A plan's kernels.fuse_gelu_mm goes off on a float8 GPU below sm90, whose matmuls have no tensor memory
    accelerator to read by (the log's plan line and stats.json's kernels.off_with say so; the GELU then runs in
    the down-projection's quantization); given by the command there, check() refuses it."""
    arch = without_tma(device)
    if not plan.settings.fuse_gelu_mm or "fuse_gelu_mm" in plan.overrides or arch is None:
        return plan
    return replace(plan, settings=replace(plan.settings, fuse_gelu_mm=False),
                   off_with={**plan.off_with, "fuse_gelu_mm": f"a GPU of sm90+, this one is {arch}"})


def without_tma(device: torch.device) -> str | None:
    """A CUDA device's architecture ("sm89") where it has no tensor memory accelerator (below sm90); None
    for sm90 and later, and off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}" if (major, minor) < (9, 0) else None


def fp8_attention_choice(kernels: KernelSettings, device: torch.device | None) -> KernelSettings:
    """kernels.fp8_attention_kernel for this device (None: not known, left as it is): auto is cuDNN's where
    it runs (cudnn_attention.unavailable), else the Triton kernel, said once in the log and recorded in
    stats.json (`cudnn_attention_unavailable`); cudnn where it cannot run is refused, with why."""
    if not kernels.fp8_attention or device is None or kernels.fp8_attention_kernel not in (AUTO, "cudnn"):
        return kernels  # triton as asked; anything else is check()'s to refuse
    reason = cudnn_attention.unavailable(device)
    if reason and kernels.fp8_attention_kernel == "cudnn":
        raise UserError(f"kernels.fp8_attention_kernel=cudnn: cuDNN's float8 attention cannot run here: {reason}; "
                        "set kernels.fp8_attention_kernel=triton (or auto)")
    if reason:
        fp8.say_once(__name__, f"kernels: float8 attention by the Triton kernel; cuDNN's, faster, cannot run here: "
                               f"{reason}")
    return replace(kernels, fp8_attention_kernel="triton" if reason else "cudnn")


def output_kernels(kernels: KernelSettings) -> dict:
    """The kernel settings that change images, where they differ from the defaults (part of the
    settings' digest that a resumed job is checked against)."""
    from pipeline.blocks.pixart import CONSTANTS

    out: dict = {}
    if kernels.attention != "auto":
        out["attention"] = kernels.attention
    for key in ("fuse_qkv", "fp8", "fuse_gelu", "persistent_reductions", "fuse_residual", "split_out_proj",
                "hoist_modulation", "trim_text_padding"):  # switches count only when on
        if getattr(kernels, key):
            out[key] = True
    if kernels.trim_text_padding:  # a batch's text length: its rounding
        out["text_multiple"] = text.MULTIPLE
    if kernels.fuse_residual:  # its layer norm's kernel on CUDA, whose block sizes set a row's rounding
        out["residual_norm"] = norm.SETTING
        out["residual_constants"] = CONSTANTS  # how its per-step constants are computed (their rounding)
        if kernels.fp8:  # its float8 blocks' row functions (the residual adds, norms and quantizations)
            out["residual_rows"] = residual_rows.TRITON_SETTING if kernels.fp8_norm else residual_rows.SETTING
    if kernels.fp8_attention:  # its kernel's block sizes (cuDNN's: its version) set the order of a row's sums
        out["fp8_attention"] = (cudnn_attention.setting() if kernels.fp8_attention_kernel == "cudnn"
                                else fp8_attention.SETTING)
    elif kernels.fuse_qk_norm:  # its kernel's (the same in fp8_attention's)
        out.update(fuse_qk_norm=True, qk_norm=attention_inputs.SETTING)
    if kernels.fp8 and kernels.fuse_gelu:  # its kernel's block sizes set a row's reduction
        out["fp8_gelu"] = fp8_gelu.SETTING
    if kernels.fuse_gelu_mm:  # its matmul's tiling sets the order of a value's sums, its bound the rows' scales
        out["fp8_gelu_mm"] = fp8_gelu_mm.SETTING
    if kernels.fp8_norm:  # likewise
        out["fp8_norm"] = fp8_norm.SETTING
    if kernels.compile:
        out.update(compile=True, compile_mode=kernels.compile_mode, compile_dynamic=kernels.compile_dynamic)
        if kernels.compile_scope != "model":  # keys added later count only away from their default
            out["compile_scope"] = kernels.compile_scope
        if kernels.compile_dynamic:  # the shapes its kernels are generated for
            out["compiled_for"] = compile.CANONICAL
        if kernels.precompile:  # aot_compile's trace, whose kernels are not known to be the JIT compile's
            out["precompile"] = True
    if decoder.on(kernels):  # the chunk is the decoder's batch: its kernels, its rounding
        out["decode_chunk"] = kernels.decode_chunk
    if kernels.fuse_decoder:  # its kernels' block sizes set a group's reduction
        out.update(fuse_decoder=True, decoder_norm=group_norm.SETTING)
    if kernels.compile_decoder:
        out.update(compile_decoder=True, decoder_compile=list(decoder.DECODER_COMPILE))
    if kernels.compile:  # counted at its default too: a digest without it was made by timed kernels
        out["compile_tuning"] = kernels.compile_tuning
    return out


def apply_kernels(kernels: KernelSettings, adapter, probe_size: tuple[int, int] | None, shapes: int,
                  device_checks: bool = True) -> dict:
    """Set the kernels of this adapter, in order: the per-batch text length, the attention processor,
    our own blocks or diffusers' fused projections and GELUs; then observe which attention backend
    serves its calls (one eager CFG forward, 1 row, at `probe_size`); then compile (for `shapes`
    shapes) and the decoder -> stats.json's `kernels`.
    `device_checks` False: what needs a GPU runs its CPU reference (a benchmark's smoke run)."""
    from pipeline.blocks import own_blocks, owns_blocks

    device = adapter.device if device_checks else None
    check_kernels(kernels, adapter.family, device)  # first: a mistyped kernel is refused, not resolved
    kernels = fp8_attention_choice(kernels, device)
    report: dict = {"attention": kernels.attention, "compile": kernels.compile, "fp8": kernels.fp8}
    if kernels.fp8_attention:
        report["fp8_attention_kernel"] = kernels.fp8_attention_kernel
        why = None if device is None or kernels.fp8_attention_kernel == "cudnn" else cudnn_attention.unavailable(device)
        if why:
            report["cudnn_attention_unavailable"] = why
    report.update(text.apply(kernels, adapter))
    report.update(attention.apply(kernels, adapter))
    if not owns_blocks(kernels, adapter.family):  # our own blocks join their projections themselves
        report.update(qkv.apply(kernels, adapter))
    report.update(own_blocks(kernels, adapter))
    if probe_size is not None:
        report.update(attention.probe(kernels, adapter, probe_size))
    report.update(compile.apply(kernels, adapter, shapes))
    report.update(decoder.apply(kernels, adapter))
    return report
