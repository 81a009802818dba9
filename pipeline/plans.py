"""Kernel plans: which kernels the denoiser runs, as data.

A plan is a name and the kernel settings it changes from `KernelSettings`' defaults (`PLANS`). The
job's `kernels.plan` is `auto` by default, which picks the fastest measured plan of the model's
family for the device and the precision (`DEFAULT_PLANS`: eager kernels on a CPU, a family's fast
plan on CUDA, its float8 plan under `precision=fp8`); a plan's name picks that plan; and any
`kernels.<setting>` the user gives overrides the plan's value (experts only: a combination the
kernels cannot run is refused by `pipeline.kernels.check_kernels`).

Every plan here gives the same bytes in every process: its kernels' block sizes are constants or
chosen from shapes the job fixes (`pipeline.kernels.compile`), never timed. No torch here: the
command line resolves and checks the plan before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, Optional

from pipeline.errors import UserError

FAMILIES = ("pixart", "sd3", "dit", "flux")
AUTO = "auto"
FP8_ATTENTION_KERNELS = (AUTO, "triton", "cudnn")  # kernels.fp8_attention_kernel


@dataclass(frozen=True)
class KernelSettings:
    """Every kernel setting, resolved. The schema's `kernels.*` keys are these names (pipeline.config)."""

    # auto: PyTorch SDPA's own choice; cudnn | flash | efficient | math: that SDPA backend first (the
    # others serve only calls it cannot); flash_attn: the flash-attn package (extra `flash`).
    attention: str = "auto"
    # torch.compile the transformer (inductor, no inductor CUDA graphs) under our capture.
    compile: bool = False
    # default | coordinate-descent (inductor times each generated kernel's block sizes) |
    # max-autotune-no-cudagraphs (that and Triton matmul templates timed against cuBLAS).
    compile_mode: str = "default"
    # fixed: inductor's deterministic mode, block sizes from its heuristics (the same kernels in every
    # process) | timed: candidates timed at the first run (faster, but another process may choose others).
    compile_tuning: str = "fixed"
    # One compilation with symbolic batch and token counts for every shape (true), or one per shape.
    compile_dynamic: bool = True
    # model: the whole transformer | blocks: its repeated blocks, once for all | norms: what
    # fuse_residual's block leaves to fuse (its per-step constants; off CUDA its layer norms).
    compile_scope: str = "model"
    # One q|k|v matmul per attention (PixArt: diffusers' fused projections, or its own float8 blocks';
    # SD3, Flux: their own blocks'; SD3's joint attention: both streams' written into the buffer SDPA reads).
    fuse_qkv: bool = False
    # With compile: reductions over rows of up to 16,384 values read each row once.
    persistent_reductions: bool = False
    # The blocks' linear layers as rowwise-scaled float8 matmuls (CUDA sm89+; the own blocks of Flux, SD3, PixArt).
    fp8: bool = False
    # The feed-forward's tanh GELU in the up-projection's cuBLASLt epilogue (CUDA); with fp8, in the
    # down-projection's float8 quantization (one Triton kernel).
    fuse_gelu: bool = False
    # With fp8 and fuse_gelu: the up-projection, its GELU and the float8 rows the down-projection reads as one
    # Triton matmul (CUDA sm90+), each row scaled by a bound its input gives, not by its maximum. Images differ.
    fuse_gelu_mm: bool = False
    # Flux, SD3.5: the attention's two matmuls in float8, one Triton kernel (CUDA sm89+). Images differ.
    fp8_attention: bool = False
    # Float8 attention's kernel where its output goes to float8 layers: cudnn (cuDNN's float8 SDPA: sm90+,
    # cuDNN 9.13+, the `cudnn` extra) | triton | auto: cuDNN's where it runs, else Triton's (said once).
    # Their images differ.
    fp8_attention_kernel: str = "auto"
    # With fp8: the modulated layer norms that feed float8 layers write their float8 rows (one Triton
    # kernel: the norm, its modulation, the rowwise quantization; PixArt's: with the residual adds).
    fp8_norm: bool = False
    # Flux: the queries' and keys' RMS norms, the text and image tokens joined and the rotary
    # embedding in one Triton kernel (CUDA; the CPU runs the torch ops).
    fuse_qk_norm: bool = False
    # PixArt: each block's residual adds done by the matmuls (gates folded into the weights, biases carried).
    fuse_residual: bool = False
    # Flux: each single-stream block multiplies its attention and MLP outputs by their own parts of
    # proj_out instead of joining them first.
    split_out_proj: bool = False
    # Flux, SD3: every adaptive norm's modulation projection computed once per batch for every step
    # (bcg.scope forward or step).
    hoist_modulation: bool = False
    # PixArt: each batch's text cut to its longest prompt (rounded up to 64 tokens), not max_sequence_length;
    # an image is then a function of its batch's texts (the plan fixes them), equal to the untrimmed up to rounding.
    trim_text_padding: bool = False
    # The VAE decoder's group norms and their SiLUs in Triton kernels of fixed block sizes (CUDA; the CPU
    # runs PyTorch's ops): a faster decode, nothing compiled. Latents decoded `decode_chunk` at a time.
    fuse_decoder: bool = False
    # torch.compile the VAE decoder instead (the same chunks): a long compile in a new cache.
    compile_decoder: bool = False
    # Latents per decoder call with either (the last chunk padded): one is the fastest per image measured.
    decode_chunk: int = 1
    # With compile_scope=blocks: each kind of block's compiled code (dynamo's trace, its guards, inductor's
    # kernels) saved whole in the kernel cache by the process that compiles it (torch's aot_compile), and
    # loaded by later ones instead of traced again.
    precompile: bool = False
    # Where inductor keeps what it compiled (null: the user's cache, pipeline.kernels.compile.user_cache).
    # Not a plan's to set.
    compile_cache_dir: Optional[str] = None


SETTINGS = tuple(f.name for f in fields(KernelSettings))


@dataclass(frozen=True)
class Plan:
    """A named set of kernel settings: what it does, which families it serves, where it runs."""

    summary: str
    families: tuple[str, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)  # what differs from KernelSettings()
    cuda_only: str | None = None  # why it needs CUDA; None: it runs anywhere
    float8: bool = False  # the plan `precision=fp8` asks for

    def resolved(self, **overrides: Any) -> KernelSettings:
        return replace(KernelSettings(), **{**self.settings, **overrides})


# the decoder's group norms fused (one latent per call, the default chunk: docs/BENCHMARKS.md)
_DECODER = {"fuse_decoder": True}
_COMPILED = {"attention": "cudnn", "compile": True, "compile_scope": "blocks"}
_FLUX = {"compile": True, "compile_scope": "blocks", "fuse_gelu": True, "split_out_proj": True,
         "hoist_modulation": True, "persistent_reductions": True, "fuse_qk_norm": True, "precompile": True, **_DECODER}
_FLUX_FP8 = {**_FLUX, "fp8": True, "fp8_attention": True, "fp8_norm": True, "fuse_qkv": True, "fuse_qk_norm": False}
# SD3's as Flux's where they apply (no single-stream blocks to split); its float8 plan keeps bf16 attention:
# at 64 values per head the softmax, not the matmuls, bounds it
_SD3 = {"attention": "cudnn", "compile": True, "compile_scope": "blocks", "fuse_gelu": True, "persistent_reductions": True,
        "fuse_qk_norm": True, "hoist_modulation": True, "fuse_qkv": True, "precompile": True, **_DECODER}
_SD3_FP8 = {**_SD3, "fp8": True, "fp8_norm": True}
_FAST = {"attention": "cudnn", "fuse_gelu": True, "fuse_residual": True, "trim_text_padding": True, **_DECODER}
# the float8 blocks' row functions (residual adds, norms, quantizations) each one Triton kernel, q|k|v joined, the
# up-projection writing its GELU's float8 rows
_FAST_FP8 = {**_FAST, "fp8": True, "fp8_norm": True, "fuse_qkv": True, "fuse_gelu_mm": True}
_EPILOGUE = "the GELU runs in cuBLASLt's epilogue, which only CUDA has"
_FP8_CORES = "float8 tensor cores (sm89+)"

PLANS: dict[str, Plan] = {
    "eager": Plan("diffusers' modules on PyTorch's own kernels, nothing compiled", FAMILIES),
    "compiled": Plan("cuDNN attention and the transformer's repeated blocks compiled once for every shape", FAMILIES,
                     _COMPILED),
    "fast": Plan("PixArt's own blocks with the residual adds in the matmuls, the GELU in the up-projection's "
                 "epilogue, a fixed Triton layer norm and cuDNN attention, each batch's text cut to its longest prompt, "
                 "the decoder's group norms fused; nothing compiled",
                 ("pixart",), _FAST, cuda_only=_EPILOGUE),
    "fast-fp8": Plan("PixArt's own blocks with float8 linear layers, each residual add and layer norm in the Triton "
                     "kernel that quantizes the next layers' rows, the up-projection, its GELU and the down-projection's "
                     "float8 rows one Triton matmul (sm90+; below, the GELU in that quantization), q|k|v joined, "
                     "cuDNN attention, each batch's text cut to its longest prompt; nothing compiled; the decoder's "
                     "group norms fused", ("pixart",), _FAST_FP8,
                     cuda_only=_FP8_CORES, float8=True),
    "sd3": Plan("SD3's own joint blocks compiled once for every shape and saved whole for later jobs to load: the GELU in "
                "the up-projection's epilogue, q|k|v joined (SD3's written into the buffer attention reads), SD3.5's "
                "queries' and keys' norms in one kernel, every step's modulation computed before a batch's first, cuDNN "
                "attention; the decoder's group norms fused", ("sd3",), _SD3,
                cuda_only=_EPILOGUE),
    "sd3-fp8": Plan("the sd3 plan with float8 linear layers and norms writing float8 rows; "
                    "attention stays in bf16 (float8's, at SD3's 64 values per head, is no faster: docs/BENCHMARKS.md)",
                    ("sd3",), _SD3_FP8,
                    cuda_only=_FP8_CORES, float8=True),
    "flux": Plan("Flux's own blocks compiled once for every shape: the GELU in the up-projection's epilogue, the "
                 "single blocks' out-projection split, the modulation once per batch, the queries' and keys' norms "
                 "and rotation in one kernel, each kind of block saved whole for later processes; the decoder's "
                 "group norms fused", ("flux",), _FLUX, cuda_only=_EPILOGUE),
    "flux-fp8": Plan("the flux plan with float8 linear layers, float8 attention and norms writing float8 rows, "
                     "fused q|k|v projections", ("flux",), _FLUX_FP8, cuda_only=_FP8_CORES, float8=True),
}

# (family, float8) -> the plan `kernels.plan=auto` picks on CUDA (on a CPU: eager, and no float8). Only
# plans whose cuda tests and benchmarks have run on a GPU (docs/BENCHMARKS.md); the others are chosen by name.
DEFAULT_PLANS: dict[tuple[str, bool], str] = {
    ("pixart", False): "fast",
    ("pixart", True): "fast-fp8",
    ("sd3", False): "sd3",
    ("sd3", True): "sd3-fp8",
    ("dit", False): "eager",
    ("flux", False): "flux",
    ("flux", True): "flux-fp8",
}
FP8_REFUSALS = {  # family -> why `precision=fp8` has no plan for it
    "dit": "it has no float8 blocks yet",
}


@dataclass(frozen=True)
class ResolvedPlan:
    """The plan a job runs: its name, every setting, the user's overrides of it and how it was chosen."""

    name: str
    settings: KernelSettings
    overrides: dict[str, Any]  # kernels.<key> the user set to a value other than the plan's
    chosen: str  # e.g. "auto: flux on cuda in bf16"
    off_with: dict[str, str] = field(default_factory=dict)  # the plan's settings those overrides turned off (`NEEDS`)

    def describe(self) -> str:
        """One line for the log: the plan, how it was chosen, the settings it changes, the overrides."""
        changed = {k: v for k, v in asdict(self.settings).items() if v != getattr(KernelSettings(), k)}
        text = f"kernels.plan={self.name} ({self.chosen}): " + (", ".join(f"{k}={v}" for k, v in changed.items())
                                                                 or "PyTorch's own kernels")
        if self.overrides:
            text += "; overridden by the command: " + ", ".join(f"kernels.{k}={v}" for k, v in self.overrides.items())
        if self.off_with:
            text += "; off with them: " + ", ".join(f"kernels.{k} (it needs {v})" for k, v in self.off_with.items())
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.name, "chosen": self.chosen, "overrides": dict(self.overrides),
                **({"off_with": dict(self.off_with)} if self.off_with else {})}


# Settings that choose between two ways of doing one thing: the one a command turns on turns the plan's
# other off (both turned on by the command are refused: pipeline.kernels.decoder.check).
ALTERNATIVES = (("fuse_decoder", "compile_decoder"),)


# A plan's setting that changes no image, and the settings it needs: where the command changes one of
# those, the plan's setting goes off with it (said in the plan's log line; settings that change images
# are refused instead, pipeline.kernels.REQUIRES); turned on by the command itself, it is refused
# (pipeline.kernels.precompile.check).
NEEDS = {"precompile": {"compile": True, "compile_scope": "blocks", "compile_dynamic": True}}


def as_override(key: str, value: Any) -> str:
    """A setting as the command line gives it: kernels.compile_dynamic=true."""
    return f"kernels.{key}={str(value).lower() if isinstance(value, bool) else value}"


def unmet_needs(settings: KernelSettings, key: str) -> list[str]:
    """What `key` (a setting of NEEDS) needs that `settings` lacks, as the command line gives it."""
    return [as_override(k, v) for k, v in NEEDS[key].items() if getattr(settings, k) != v]


def off_with_overrides(settings: KernelSettings, given: Mapping[str, Any]) -> dict[str, str]:
    """{setting: what it needs}: the plan's settings on that the command's values leave without what they need."""
    off = {}
    for key in NEEDS:
        missing = unmet_needs(settings, key)
        if key not in given and getattr(settings, key) and missing:
            off[key] = ", ".join(missing)
    return off


def alternatives_off(given: Mapping[str, Any]) -> dict[str, bool]:
    """{setting: False} for the alternative of each setting in `given` set to true."""
    off = {}
    for a, b in ALTERNATIVES:
        if given.get(a) is True:
            off[b] = False
        if given.get(b) is True:
            off[a] = False
    return off


def default_plan(family: str, device_type: str, float8: bool) -> str:
    """The plan `auto` picks, or a refusal (UserError) naming why float8 has none here."""
    if float8 and device_type != "cuda":
        raise UserError("precision=fp8 needs a CUDA GPU with float8 tensor cores (sm89+: Ada, Hopper, Blackwell); "
                         f"this job runs on {device_type}: choose precision=auto, bf16 or fp32")
    if float8 and (family, True) not in DEFAULT_PLANS:
        why = FP8_REFUSALS.get(family, "it has no float8 plan")
        with_fp8 = sorted(f for f, fp8 in DEFAULT_PLANS if fp8)
        raise UserError(f"precision=fp8 is not offered for model family {family!r}: {why}; kernels.plan=auto picks "
                         f"a float8 plan for {with_fp8}; choose precision=bf16")
    if device_type != "cuda":
        return "eager"
    return DEFAULT_PLANS.get((family, float8), "eager")


def resolve_plan(plan: str, overrides: Mapping[str, Any], family: str, device_type: str, float8: bool) -> ResolvedPlan:
    """`kernels.plan` and the kernels.<key> values the user gave (None: not given) -> the plan this
    job runs, or a UserError that names the key and what is accepted."""
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise UserError(f"kernels.{unknown[0]} is not a kernel setting; the settings are {list(SETTINGS)}")
    if plan == AUTO:
        name = default_plan(family, device_type, float8)
        chosen = f"auto: {family} on {device_type}" + (" in float8" if float8 else "")
    elif plan in PLANS:
        name, chosen = plan, "kernels.plan"
    else:
        raise UserError(f"kernels.plan={plan!r} is not a plan; choose auto or one of {list(PLANS)}")
    spec = PLANS[name]
    if family not in spec.families:
        fits = [n for n, p in PLANS.items() if family in p.families]
        raise UserError(f"kernels.plan={name} serves model families {list(spec.families)}, not {family!r}; choose "
                         f"auto or one of {fits}")
    if spec.cuda_only and device_type != "cuda":
        raise UserError(f"kernels.plan={name} runs on CUDA only ({spec.cuda_only}); this job runs on {device_type}: "
                         "choose kernels.plan=auto (eager kernels there) or eager")
    if float8 and not spec.float8:
        fp8_plans = [n for n, p in PLANS.items() if p.float8 and family in p.families]
        raise UserError(f"precision=fp8 asks for a float8 plan, and kernels.plan={name} is not one; choose "
                         f"kernels.plan=auto{''.join(' or ' + n for n in fp8_plans)}, or precision=bf16")
    if spec.float8 and not float8:
        raise UserError(f"kernels.plan={name} is a float8 plan: choose it with precision=fp8 (its images differ from "
                         "bf16's), or choose kernels.plan=auto")
    settings = spec.resolved(**{**alternatives_off(given), **given})
    off = off_with_overrides(settings, given)
    settings = replace(settings, **dict.fromkeys(off, False))
    differs = {k: v for k, v in given.items() if getattr(spec.resolved(), k) != v}
    return ResolvedPlan(name, settings, differs, chosen, off)
