"""Which kernels the denoiser runs: one module per option, each with its own `check` (what it refuses
without a model) where it has one, and `apply` (changes one model instance, returns what it reports):

- attention: kernels.attention, the SDPA backend or flash-attn's processor (`probe`: which ran)
- text: kernels.trim_text_padding
- qkv: kernels.fuse_qkv
- gelu: kernels.fuse_gelu (fp8_gelu: the same setting under kernels.fp8)
- residual: kernels.fuse_residual (norm: its layer norm's Triton kernel on CUDA)
- split: kernels.split_out_proj
- modulation: kernels.hoist_modulation
- fp8: kernels.fp8 (fp8_norm: kernels.fp8_norm, Flux's norms writing its float8 rows)
- qk_norm: kernels.fuse_qk_norm (Flux's attention processor; attention_inputs: its kernel)
- fp8_attention: kernels.fp8_attention (Flux's attention processor)
- compile: kernels.compile and what every compile shares (mode, tuning, the job's cache, workers, counts)
  (reductions: kernels.persistent_reductions, inductor's choice of persistent reductions)
- decoder: kernels.compile_decoder, kernels.decode_chunk

Which settings go together is stated once, as data (SUPPORTED_FAMILIES, EXCLUDES, REQUIRES,
NEEDS_CUDA): `check_kernels` walks those tables, then each module's own check. Every change is made
to the adapter's own modules (instance attributes, hooks, processors), never to a class; what a job
changes in the process (dynamo's limits, the cache directory) is put back when it ends
(pipeline.process_state).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.kernels import (attention, attention_inputs, compile, decoder, fp8, fp8_attention, fp8_gelu, fp8_norm,
                              gelu, modulation, norm, qk_norm, qkv, residual, split, text)
from pipeline.kernels.attention import SDPA, with_attention
from pipeline.kernels.compile import CONTIGUOUS_HOOK, compile_cache, compile_stats, start_compile_workers
from pipeline.kernels.decoder import compile_vae_decoder, decode_in_chunks
from pipeline.models.base import Adapter

__all__ = [
    "CONTIGUOUS_HOOK", "QUANTIZE", "REWRITES", "SDPA", "apply_kernels", "check_kernels", "compile_cache", "compile_stats",
    "compile_vae_decoder", "decode_in_chunks", "output_kernels", "start_compile_workers", "with_attention",
]


@dataclass(frozen=True)
class Option:
    """A kernel setting as the user types it (`kernels.<key>`), whether a config has it, and what
    to set instead."""

    key: str
    on: Callable[[KernelsConfig], bool]
    off: str


def switch(name: str) -> Option:
    """A boolean `kernels.<name>`."""
    return Option(f"{name}=true", lambda k: getattr(k, name), f"kernels.{name}=false")


FLASH_ATTN = Option("attention=flash_attn", lambda k: k.attention == "flash_attn",
                    f"kernels.attention to auto or one of PyTorch's SDPA backends {list(SDPA)}")
FUSE_QKV, FUSE_GELU, FUSE_RESIDUAL = switch("fuse_qkv"), switch("fuse_gelu"), switch("fuse_residual")
FP8, TRIM_TEXT, COMPILE = switch("fp8"), switch("trim_text_padding"), switch("compile")
SPLIT_OUT_PROJ, HOIST_MODULATION = switch("split_out_proj"), switch("hoist_modulation")
PERSISTENT, FP8_ATTENTION = switch("persistent_reductions"), switch("fp8_attention")
FUSE_QK_NORM, FP8_NORM = switch("fuse_qk_norm"), switch("fp8_norm")
NORMS = Option("compile_scope=norms", lambda k: k.compile and k.compile_scope == "norms",
               "kernels.compile_scope=blocks (or model)")

# option -> (the model families it serves, why: "{families}" and "{family}" filled in).
SUPPORTED_FAMILIES: dict[Option, tuple[tuple[str, ...], str]] = {
    FLASH_ATTN: (("pixart", "dit"), "its processor is written for the attention of model families {families}, "
                                    "not {family!r}"),
    FUSE_QKV: (("pixart", "sd3", "flux"), "diffusers fuses the projections of model families {families}, not {family!r}"),
    FUSE_RESIDUAL: (("pixart",), "the block it rewrites is PixArt's (model families {families}); this model is {family!r}"),
    SPLIT_OUT_PROJ: (("flux",), "the block it rewrites is Flux's single-stream block (model families {families}); this "
                                "model is {family!r}"),
    HOIST_MODULATION: (("flux",), "the modulation it precomputes is Flux's (one time, guidance and pooled-prompt "
                                  "embedding for every norm; model families {families}); this model is {family!r}"),
    TRIM_TEXT: (("pixart",), "model families {families} mask the text padding out of attention, {family!r} does "
                             "not (its images would change)"),
    # fp8 goes with kernels.compile (which fuses the activations' quantization) and under our graphs.
    FUSE_QK_NORM: (("flux",), "the attention it rewrites is Flux's (model families {families}); this model is "
                              "{family!r}"),
    FP8_ATTENTION: (("flux",), "its scales come from the bound of Flux's RMS-normalized queries and keys (model "
                               "families {families}); this model is {family!r}"),
    FP8_NORM: (("flux",), "the norms it rewrites are Flux's (model families {families}); this model is {family!r}"),
    FP8: (("pixart", "flux"), "its float8 blocks are measured against bf16 (speed and PSNR, docs/BENCHMARKS.md) for "
                              "model families {families}, not {family!r}"),
}

# (option, option it cannot be combined with, why the first excludes the second)
RESIDUAL_OWNS_ATTENTION = "computes the attention and folds the gates into bf16/fp16 weights itself"
EXCLUDES: tuple[tuple[Option, Option, str], ...] = (
    (FUSE_QKV, FLASH_ATTN, "replaces the attention processor"),
    (FUSE_RESIDUAL, FUSE_QKV, RESIDUAL_OWNS_ATTENTION),
    (FUSE_RESIDUAL, FP8, RESIDUAL_OWNS_ATTENTION),
    (FUSE_RESIDUAL, FLASH_ATTN, RESIDUAL_OWNS_ATTENTION),
)

# (options that, all on, need another option; why: the config's values filled in, e.g. "{compile_scope}")
REQUIRES: tuple[tuple[tuple[Option, ...], Option, str], ...] = (
    ((NORMS,), FUSE_RESIDUAL, "it compiles what kernels.fuse_residual's block leaves to fuse"),
    ((PERSISTENT,), COMPILE, "it chooses how inductor compiles the transformer's reductions"),
    ((FP8_NORM,), FP8, "it writes the norms' outputs as the float8 layers' quantized rows"),
    ((FUSE_RESIDUAL, COMPILE), NORMS, "the block adds into its input in place, which compile_scope={compile_scope} "
                                      "would trace; compile_scope=norms compiles what is left to fuse (the per-step "
                                      "constants, and off CUDA the layer norms), once"),
)

# option -> why it runs on CUDA only
NEEDS_CUDA: dict[Option, str] = {
    FUSE_GELU: "cuBLASLt's GELU epilogue is the tanh GELU these models use, while PyTorch's CPU version of the "
               "fused op computes the exact GELU",
}

# the options that rewrite the model's modules, in the order apply_kernels applies them (after the
# attention processor, before the probe, fp8 and compile)
REWRITES = (qkv, gelu, residual, split, modulation, qk_norm, fp8_attention)
# the options that make layers float8, in order (after the probe, before compile)
QUANTIZE = (fp8, fp8_gelu, fp8_norm)

# each option's refusals that the tables do not state (values, packages, the device's features)
CHECKS = (attention.check, compile.check, decoder.check, fp8.check, fp8_attention.check, fp8_gelu.check,
          fp8_norm.check, qk_norm.check, residual.check)


def check_kernels(kernels: KernelsConfig, family: str | None = None, device: torch.device | None = None) -> None:
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
    if family is not None:
        refusal = family_refusal(kernels, family)
        if refusal:
            raise UserError(refusal)
    if device is not None and torch.device(device).type != "cuda":
        for option, why in NEEDS_CUDA.items():
            if option.on(kernels):
                raise UserError(f"kernels.{option.key} needs CUDA: {why}; set {option.off}")
    for check in CHECKS:
        check(kernels, device)


def family_refusal(kernels: KernelsConfig, family: str) -> str | None:
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


def output_kernels(kernels: KernelsConfig) -> dict:
    """The kernel settings that change images, where they differ from the defaults."""
    out: dict = {}
    if kernels.attention != "auto":
        out["attention"] = kernels.attention
    for key in ("fuse_qkv", "fp8", "fuse_gelu", "persistent_reductions", "fuse_residual", "split_out_proj",
                "hoist_modulation", "trim_text_padding"):  # switches count only when on
        if getattr(kernels, key):
            out[key] = True
    if kernels.fuse_residual:  # its layer norm's kernel on CUDA, whose block sizes set a row's rounding
        out["residual_norm"] = norm.SETTING
        out["residual_constants"] = residual.CONSTANTS  # how its per-step constants are computed (their rounding)
    if kernels.fp8_attention:  # its kernel's block sizes set the order of a row's sums
        out["fp8_attention"] = fp8_attention.SETTING
    elif kernels.fuse_qk_norm:  # its kernel's (the same in fp8_attention's)
        out.update(fuse_qk_norm=True, qk_norm=attention_inputs.SETTING)
    if kernels.fp8 and kernels.fuse_gelu:  # its kernel's block sizes set a row's reduction
        out["fp8_gelu"] = fp8_gelu.SETTING
    if kernels.fp8_norm:  # likewise
        out["fp8_norm"] = fp8_norm.SETTING
    if kernels.compile:
        out.update(compile=True, compile_mode=kernels.compile_mode, compile_dynamic=kernels.compile_dynamic)
        if kernels.compile_scope != "model":  # keys added later count only away from their default
            out["compile_scope"] = kernels.compile_scope
    if kernels.compile_decoder:  # the chunk is the decoder's batch: its kernels, its rounding
        out.update(compile_decoder=True, decode_chunk=kernels.decode_chunk, decoder_compile=list(decoder.DECODER_COMPILE))
    if kernels.compile:  # counted at its default too: a digest without it was made by timed kernels
        out["compile_tuning"] = kernels.compile_tuning
    return out


def apply_kernels(kernels: KernelsConfig, adapter: Adapter, probe_size: tuple[int, int] | None, shapes: int,
                  texts: Iterable[str] | None = None) -> dict:
    """Set the kernels of this adapter's modules, in order: the text length (from every prompt the
    job may encode, `texts`), the attention processor, fused projections, GELU and residual adds,
    Flux's split out-projection and its precomputed modulation;
    then observe which attention backend serves its calls (one eager CFG forward, 1 row, at
    `probe_size`); then fp8, then compile (for `shapes` shapes) -> stats.json's `kernels`."""
    check_kernels(kernels, adapter.family, adapter.device)
    report: dict = {"attention": kernels.attention, "compile": kernels.compile, "fp8": kernels.fp8}
    report.update(text.apply(kernels, adapter, texts))
    for module in (attention, *REWRITES):
        report.update(module.apply(kernels, adapter))
    if probe_size is not None:
        report.update(attention.probe(kernels, adapter, probe_size))
    for module in QUANTIZE:
        report.update(module.apply(kernels, adapter))
    report.update(compile.apply(kernels, adapter, shapes))
    report.update(decoder.apply(kernels, adapter, probe_size))
    return report
