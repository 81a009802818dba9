"""Typed configuration, mirrored one-to-one by the `conf/` tree.

The dataclasses are registered in Hydra's ConfigStore as the schema of the primary config, so a
misspelt key or a value of the wrong type fails at start with Hydra's own message. Below `run(cfg)`
nothing reads the config object: functions take the values they need as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class ModelConfig:
    name: str = "tiny"
    family: str = "pixart"
    # random: build `arch` with seeded random weights; pretrained: load the diffusers dir `path`.
    weights: str = "random"
    path: Optional[str] = None
    # Architecture of each component for `weights=random` (kwargs of the diffusers/transformers classes).
    arch: Dict[str, Any] = field(default_factory=dict)
    # diffusers scheduler class name and config: the checkpoint's own sampler for random models.
    scheduler: Dict[str, Any] = field(default_factory=dict)
    max_sequence_length: int = 300
    max_side: int = 2048
    init_seed: int = 0


@dataclass
class SamplerConfig:
    # "default": the checkpoint's own diffusers scheduler.
    name: str = "default"
    steps: int = 20
    guidance_scale: float = 4.5


@dataclass
class BCGConfig:
    enabled: bool = True
    ladder: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    scope: str = "forward"
    warmup: int = 3
    lazy: bool = False
    pool_limit_gib: Optional[float] = None
    pool_margin: float = 1.3
    # Planner cost model: one batch costs as much as this many extra rows (launches, host work).
    batch_overhead_rows: float = 1.0


@dataclass
class PrecisionConfig:
    dtype: str = "bf16"
    tf32: bool = False
    cudnn_benchmark: bool = False


@dataclass
class OutputConfig:
    dir: str = "${hydra:runtime.output_dir}"
    format: str = "png"
    png_compress_level: int = 6
    # Store the encoded image in each shard row as {bytes, path} (Hugging Face Image feature layout).
    embed_images: bool = False
    queue_size: int = 32


@dataclass
class ManifestConfig:
    path: str = MISSING
    on_invalid: str = "error"


@dataclass
class RuntimeConfig:
    device: str = "auto"
    progress: bool = True
    # Prompts encoded per text-encoder call.
    encode_batch_size: int = 64


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    bcg: BCGConfig = field(default_factory=BCGConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    manifest: ManifestConfig = field(default_factory=ManifestConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="job_schema", node=JobConfig)


ON_INVALID = ("error", "skip")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("bf16", "fp16", "fp32")
WEIGHTS = ("random", "pretrained")
SCOPES = ("forward",)


def check_choices(cfg: JobConfig) -> None:
    """Reject values outside the accepted sets, naming the key and the choices."""
    for key, value, accepted in (
        ("manifest.on_invalid", cfg.manifest.on_invalid, ON_INVALID),
        ("runtime.device", cfg.runtime.device, DEVICES),
        ("precision.dtype", cfg.precision.dtype, DTYPES),
        ("model.weights", cfg.model.weights, WEIGHTS),
        ("bcg.scope", cfg.bcg.scope, SCOPES),
        ("output.format", cfg.output.format, ("png",)),
    ):
        if value not in accepted:
            raise ValueError(f"{key}={value!r} is not accepted; choose one of {list(accepted)}")
    if cfg.sampler.steps < 1:
        raise ValueError(f"sampler.steps={cfg.sampler.steps} must be >= 1")
