"""Typed configuration, mirrored one-to-one by the `conf/` tree.

The dataclasses are registered in Hydra's ConfigStore as the schema of the primary config, so a
value of the wrong type or a key that no schema has fails at start (the CLI checks the command
line's overrides first: pipeline/overrides.py). `resolve_job` turns the composed config into the
job's typed config. Below `run(cfg)` nothing reads the config object: functions take the values
they need as arguments.
"""

from __future__ import annotations

import os
import re
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.errors import UserError, not_accepted
from pipeline.exit_codes import text_table
from pipeline.manifest import check_manifest_file
from pipeline.paths import absolute, asset, check_writable_dir
from pipeline.model_info import sampler_defaults
from pipeline.plans import AUTO, FP8_ATTENTION_KERNELS, PLANS, KernelSettings
from pipeline.store import fetch_manifest, is_url, local_path


@dataclass
class ModelConfig:
    name: str = "tiny"
    # random: build `arch` with seeded random weights; pretrained: load the local diffusers
    # directory `path` (safetensors only, offline; its family comes from model_index.json).
    weights: str = "random"
    path: Optional[str] = None
    # Random weights: the family (pixart | sd3 | dit | flux), the diffusers pipeline it mirrors (None: the
    # family's first, e.g. PixArtSigmaPipeline), the architecture of each component (kwargs of the
    # diffusers/transformers classes) and the scheduler (diffusers class name and config).
    family: str = "pixart"
    pipeline: Optional[str] = None
    arch: Dict[str, Any] = field(default_factory=dict)
    scheduler: Dict[str, Any] = field(default_factory=dict)
    init_seed: int = 0
    # cpu: build on the CPU, then move (the same weights on every device; small models);
    # target: initialise directly on the job's device (large models: no host copy).
    init_device: str = "cpu"
    # DiT with random weights: class id -> "name, synonym, ..." (None: the names are "0" ... "999").
    id2label: Optional[Dict[str, str]] = None
    # Text tokens per prompt; None: the pipeline's default (PixArt-Sigma 300, PixArt-Alpha 120, SD3 256,
    # Flux 512; FLUX.1-schnell's checkpoints use 256).
    max_sequence_length: Optional[int] = None
    # Largest width/height a manifest may ask for; None: twice the native side, within the
    # architecture's hard limit (SD3: its positional grid; DiT: its one native size).
    max_side: Optional[int] = None
    # Encode every prompt of the plan first, then free the text encoders (log says so once).
    offload_text_encoder: bool = False
    # The checkpoint's own sampler settings, which sampler.steps and sampler.guidance_scale take where
    # the user gives none; null: its diffusers pipeline's defaults (pipeline.model_info).
    steps: Optional[int] = None
    guidance_scale: Optional[float] = None


@dataclass
class SamplerConfig:
    # "default": the checkpoint's own diffusers scheduler.
    name: str = "default"
    # null: the model's own (model.steps, model.guidance_scale, else its pipeline's defaults); the job
    # fills them in at start, so the recorded config, the log and every row say what ran.
    steps: Optional[int] = None
    # CFG's scale (at most 1: no CFG, one forward per row and no negative prompt, as diffusers' pipelines);
    # for FLUX.1-dev the value its guidance embedding reads (FLUX.1-schnell has none).
    guidance_scale: Optional[float] = None
    # Guidance-distilled families (flux): 1.0 runs one forward per row; above 1, diffusers' true CFG
    # (a forward over [negative; positive], 2B rows, combined with this scale; negative prompts allowed).
    true_cfg_scale: float = 1.0


@dataclass
class BCGConfig:
    enabled: bool = True
    # Batch sizes that get a graph, or "auto": chosen at warm-up from a calibration of `auto_sizes`
    # at every resolution of the manifest (least predicted job time under pool_limit_gib).
    ladder: Any = field(default_factory=lambda: [1, 2, 4, 8])
    auto_sizes: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    scope: str = "forward"
    warmup: int = 2
    # plan: graphs for the (resolution, bucket) pairs this run's batches use; ladder: for every
    # bucket of the ladder at each of its resolutions (what a batch split after an out-of-memory
    # error may also need; without it those run eagerly, counted as misses).
    capture: str = "plan"
    lazy: bool = False
    pool_limit_gib: Optional[float] = None
    pool_margin: float = 1.3
    # Planner cost model: one batch costs as much as this many extra rows (launches, host work).
    batch_overhead_rows: float = 1.0


def _kernels_schema() -> type:
    """KernelsConfig: `plan` (auto, or a name in pipeline.plans.PLANS) and every setting of
    pipeline.plans.KernelSettings, each null unless the user gives it (then it overrides the plan)."""
    types = typing.get_type_hints(KernelSettings)
    settings = [(f.name, Optional[types[f.name]], None) for f in fields(KernelSettings)]
    return make_dataclass("KernelsConfig", [("plan", str, "auto"), *settings])


KernelsConfig = _kernels_schema()


@dataclass
class PrecisionConfig:
    # auto: bf16 on CUDA, fp32 on a CPU; fp8: bf16 with the family's float8 plan (pipeline.plans).
    dtype: str = "auto"
    tf32: bool = False
    cudnn_benchmark: bool = False


@dataclass
class OutputConfig:
    # null: a new directory per run (outputs/<date>/<time>) or per multirun job (under the sweep dir).
    # Hydra's own files (.hydra/, run.log) go to this directory in a single run.
    dir: Optional[str] = None
    # png | jpeg | webp; `quality` is JPEG's and lossy WebP's (1-100), `lossless` WebP's.
    format: str = "png"
    quality: int = 95
    lossless: bool = False
    png_compress_level: int = 6
    # files (images/<id>.<ext> + Parquet rows) | webdataset (tar shards) | parquet (images in the rows).
    layout: str = "files"
    # Images per shard file. Thousands keep a million-image job to a few hundred files (a resume
    # reads each one's footer) while a shard of 1024 px JPEGs stays around a gigabyte; a shard is
    # written once all its batches are committed, so a stopped job redoes none of it.
    shard_size: int = 5000
    queue_size: int = 32
    # Threads that encode a batch's images in parallel (Pillow's encoders release the GIL).
    encode_threads: int = 4
    # Committed batches that no longer match the job (manifest rows or settings changed):
    # error (refuse, naming the ids) or overwrite (regenerate them).
    on_conflict: str = "error"
    # Also write <dir>/contact_sheet.png: every image with its prompt under it (the demo does).
    contact_sheet: bool = False


@dataclass
class ManifestConfig:
    path: str = MISSING
    on_invalid: str = "error"


@dataclass
class RuntimeConfig:
    device: str = "auto"
    progress: bool = True
    # Prompts encoded per text-encoder call; null: as many as make pipeline.prompts.ENCODE_TOKENS text
    # tokens at the prompts' length, at most MOST_PER_CALL (a small job encodes little padding).
    encode_batch_size: Optional[int] = None
    # Batches the device may still be working on when the host queues the next one (0: the host
    # waits for each batch before it prepares the next, nothing overlaps).
    inflight_batches: int = 2
    # Batches run under the torch profiler, from the second: their kernel time per image by category
    # and the slowest kernels in stats.json's kernels.profile and the log (0: none). It drains the
    # device before and after them, so it costs those batches their overlap.
    profile_batches: int = 0


@dataclass
class ShardConfig:
    # This process runs slice `index` of `count` of the plan (balanced by predicted cost).
    index: int = 0
    count: int = 1


@dataclass
class ClusterConfig:
    # local: this process runs shard.index of shard.count; ray: this process drives every shard as a
    # Ray task and merges them (pipeline.ray_cluster).
    name: str = "local"
    # ray: null starts a Ray cluster on this machine; "auto" joins the one it belongs to; ray://head:10001.
    address: Optional[str] = None
    gpus_per_shard: float = 1.0  # 0 on a CPU-only cluster
    cpus_per_shard: float = 1.0
    # A task whose process dies is run again (Ray's max_retries) and resumes from its shard's commits.
    max_retries: int = 3


@dataclass
class BenchConfig:
    # `+job=bench`: also run the manifest through diffusers' own pipeline (grouped by resolution,
    # `baseline_batch` prompts per call) on the same weights, before our job, and compare.
    baseline: bool = False
    baseline_batch: int = 8
    # Run the baseline alone and save it (bench.json, and the images it compares on under
    # <output.dir>/baseline/); then `baseline_from=<that output.dir>` runs our job against it. For a
    # manifest whose two halves do not fit one allocation or time limit; same machine, same settings.
    baseline_only: bool = False
    baseline_from: Optional[str] = None
    # Images per resolution that ours is compared with, pixel by pixel: the first rows of the
    # baseline's first call at each resolution, so at most baseline_batch (kept small: a saved
    # baseline travels with its PNGs).
    reference_images: int = 4


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    bcg: BCGConfig = field(default_factory=BCGConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    manifest: ManifestConfig = field(default_factory=ManifestConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)


# Keys that name files or directories: relative to where the command ran, made absolute at start.
PATH_KEYS = ("manifest.path", "model.path", "output.dir", "bench.baseline_from", "kernels.compile_cache_dir")


def output_dir_or(default: str, *, _root_: DictConfig) -> str:
    """`${output_dir_or:...}` (hydra.run.dir): output.dir where it is a local path (`~` expanded, as
    pipeline.paths.absolute does for the job), else `default`."""
    if _root_.output.dir is None or is_url(_root_.output.dir):
        return default
    return os.path.expanduser(local_path(_root_.output.dir))


def dirname(text: str) -> str:
    """`${dirname:...}` (hydra.sweep.subdir): one directory name, each `/` (a config group's, as in
    `bcg/ladder=pow2_8`) written `-`."""
    return text.replace("/", "-")


def register_configs() -> None:
    """The schema and the resolvers that conf/ uses (`${asset:...}`, `${output_dir_or:...}`,
    `${dirname:...}`, `${exit_codes:}` in the help text). Hydra is imported here, not with the
    module: a job's process that only reads the typed config does not load it."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    OmegaConf.register_new_resolver("asset", asset, replace=True)
    OmegaConf.register_new_resolver("output_dir_or", output_dir_or, replace=True)
    OmegaConf.register_new_resolver("dirname", dirname, replace=True)
    OmegaConf.register_new_resolver("exit_codes", text_table, replace=True)


def resolve_job(cfg: DictConfig, cwd: str | os.PathLike, run_dir: str | os.PathLike) -> JobConfig:
    """The composed config (without its `hydra` node) as the job's typed config, checked. Fills in
    `cfg` itself, so that the recorded config says what ran: output.dir (null: `run_dir`, Hydra's
    directory for this run) and every path of PATH_KEYS made absolute against `cwd`, where the
    command ran. Refuses a mandatory key left unset, a value outside its accepted set, an
    output.dir that cannot be written, and a manifest.path that is not a readable Parquet manifest."""
    try:
        return _resolve_job(cfg, cwd, run_dir)
    except OmegaConfBaseException as err:  # e.g. output.dir=${oc.env:SCRATCH}/x with SCRATCH unset
        raise UserError(f"{err.full_key}: {str(err).splitlines()[0]}") from None


def _resolve_job(cfg: DictConfig, cwd: str | os.PathLike, run_dir: str | os.PathLike) -> JobConfig:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing == ["manifest.path"]:
        raise UserError("manifest.path is not set: name the Parquet manifest of prompts, e.g. "
                        "`bcg-datagen +job=dataset manifest.path=prompts.parquet output.dir=outputs/prompts` "
                        "(or run the demo: `bcg-datagen +job=demo`)")
    if missing:
        raise UserError(f"{', '.join(missing)}: not set and no default; pass {missing[0]}=...")
    if cfg.output.dir is None and cfg.shard.count > 1:
        raise UserError(f"shard.count={cfg.shard.count} needs output.dir set: every shard writes to the same "
                        "directory (without it each process gets a directory of its own)")
    if cfg.output.dir is None:
        cfg.output.dir = str(run_dir)
    for key in PATH_KEYS:
        value = OmegaConf.select(cfg, key)
        if value is not None and not is_url(value):
            OmegaConf.update(cfg, key, absolute(local_path(value), cwd))
    fill_sampler_defaults(cfg.sampler, cfg.model)
    job = OmegaConf.to_object(cfg)
    check_choices(job)
    if is_url(job.output.dir):
        check_store_output(job)
    else:
        check_writable_dir("output.dir", Path(job.output.dir))
    check_manifest_file(fetch_manifest(job.manifest.path) if is_url(job.manifest.path) else job.manifest.path)
    return job


def fill_sampler_defaults(sampler: Any, model: Any) -> None:
    """sampler.steps and sampler.guidance_scale the user left null: the model's own (model.steps,
    model.guidance_scale, else its checkpoint's pipeline's defaults), written into `sampler` (the
    composed config, so that the recorded config says what ran, or a JobConfig's)."""
    if sampler.steps is not None and sampler.guidance_scale is not None:
        return
    own = sampler_defaults(model)
    if sampler.steps is None:
        sampler.steps = own.steps
    if sampler.guidance_scale is None:
        sampler.guidance_scale = own.guidance_scale


ON_INVALID = ("error", "skip")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp16", "fp32", "fp8")  # pipeline.precision
WEIGHTS = ("random", "pretrained")
SCOPES = ("forward", "step", "loop")
SAMPLER_NAMES = ("default", "dpmpp_2m", "flow_euler", "ddim")
ATTENTION = ("auto", "cudnn", "flash", "efficient", "math", "flash_attn")
COMPILE_MODES = ("default", "coordinate-descent", "max-autotune-no-cudagraphs")
COMPILE_SCOPES = ("model", "blocks", "norms")
COMPILE_TUNINGS = ("fixed", "timed")
CAPTURE = ("plan", "ladder")
FORMATS = ("png", "jpeg", "webp")  # pipeline.encoding
LAYOUTS = ("files", "webdataset", "parquet")  # pipeline.layouts
CLUSTERS = ("local", "ray")  # pipeline.launch


def check_auto_sizes(sizes) -> None:
    """bcg.auto_sizes, checked before any calibration: batch sizes for at most 8 ladders' worth."""
    from bcg.autoladder import MAX_SIZES
    from bcg.buckets import parse_ladder
    from bcg.errors import BCGConfigError

    try:
        sizes = parse_ladder(list(sizes))
    except BCGConfigError as err:
        raise UserError(f"bcg.auto_sizes={list(sizes)}: {err}") from err
    if len(sizes) > MAX_SIZES:
        raise UserError(f"bcg.auto_sizes={list(sizes)}: at most {MAX_SIZES} sizes (every subset is a candidate ladder)")


def check_ladder(ladder) -> None:
    """bcg.ladder as a list: every bucket an integer >= 1."""
    from bcg.buckets import parse_ladder
    from bcg.errors import BCGConfigError

    try:
        parse_ladder(list(ladder))
    except BCGConfigError as err:
        raise UserError(str(err)) from None


def check_output(output: OutputConfig) -> None:
    """The image options (output.format's choice is checked with the others)."""
    if not 1 <= output.quality <= 100:
        raise UserError(f"output.quality={output.quality} must be 1 (smallest) to 100 (best)")
    if output.lossless and output.format != "webp":
        raise UserError(f"output.lossless=true is WebP's option; output.format={output.format} "
                        f"{'is lossless already' if output.format == 'png' else 'has no lossless mode'}")
    if not 0 <= output.png_compress_level <= 9:
        raise UserError(f"output.png_compress_level={output.png_compress_level} must be 0 (fastest) to 9 (smallest)")
    if output.shard_size < 1:
        raise UserError(f"output.shard_size={output.shard_size} must be >= 1 (images per shard file)")


def check_choices(cfg: JobConfig) -> None:
    """Reject values outside the accepted sets, naming the key and the choices."""
    for key, value, accepted in (
        ("manifest.on_invalid", cfg.manifest.on_invalid, ON_INVALID),
        ("precision.dtype", cfg.precision.dtype, PRECISIONS),
        ("model.weights", cfg.model.weights, WEIGHTS),
        ("bcg.scope", cfg.bcg.scope, SCOPES),
        ("bcg.capture", cfg.bcg.capture, CAPTURE),
        ("sampler.name", cfg.sampler.name, SAMPLER_NAMES),
        ("kernels.plan", cfg.kernels.plan, (AUTO, *PLANS)),
        ("output.format", cfg.output.format, FORMATS),
        ("output.layout", cfg.output.layout, LAYOUTS),
        ("output.on_conflict", cfg.output.on_conflict, ("error", "overwrite")),
        ("cluster.name", cfg.cluster.name, CLUSTERS),
    ):
        if value not in accepted:
            raise not_accepted(key, value, accepted)
    for key, value, accepted in (  # kernel settings the user gave (null: the plan's)
        ("kernels.attention", cfg.kernels.attention, ATTENTION),
        ("kernels.compile_mode", cfg.kernels.compile_mode, COMPILE_MODES),
        ("kernels.compile_scope", cfg.kernels.compile_scope, COMPILE_SCOPES),
        ("kernels.compile_tuning", cfg.kernels.compile_tuning, COMPILE_TUNINGS),
        ("kernels.fp8_attention_kernel", cfg.kernels.fp8_attention_kernel, FP8_ATTENTION_KERNELS),
    ):
        if value is not None and value not in accepted:
            raise not_accepted(key, value, accepted)
    if cfg.output.dir is None:
        raise UserError("output.dir is not set: name the directory the job writes to, e.g. output.dir=outputs/my-dataset")
    if cfg.runtime.device not in DEVICES and not re.fullmatch(r"cuda:\d+", cfg.runtime.device):
        raise not_accepted("runtime.device", cfg.runtime.device, DEVICES, " or cuda:N", {"gpu": "cuda"})
    check_output(cfg.output)
    if cfg.output.encode_threads < 1:
        raise UserError(f"output.encode_threads={cfg.output.encode_threads} must be >= 1")
    if cfg.output.queue_size < 1:
        raise UserError(f"output.queue_size={cfg.output.queue_size} must be >= 1 (batches waiting for the writer)")
    ladder = cfg.bcg.ladder
    if ladder != "auto" and not (OmegaConf.is_list(ladder) or isinstance(ladder, list)):
        raise UserError(f"bcg.ladder={ladder!r} is not accepted; give a list of batch sizes, e.g. [1,2,4,8], or auto")
    if ladder == "auto":
        check_auto_sizes(cfg.bcg.auto_sizes)
    else:
        check_ladder(ladder)
    if cfg.runtime.encode_batch_size is not None and cfg.runtime.encode_batch_size < 1:
        raise UserError(f"runtime.encode_batch_size={cfg.runtime.encode_batch_size} must be >= 1, or null "
                        "(prompts per call from their text length)")
    if cfg.runtime.inflight_batches < 0:
        raise UserError(f"runtime.inflight_batches={cfg.runtime.inflight_batches} must be >= 0")
    if cfg.runtime.profile_batches < 0:
        raise UserError(f"runtime.profile_batches={cfg.runtime.profile_batches} must be >= 0 (0: no profile)")
    if cfg.sampler.steps is not None and cfg.sampler.steps < 1:  # null: the model's own
        raise UserError(f"sampler.steps={cfg.sampler.steps} must be >= 1")
    if cfg.bench.reference_images < 1:
        raise UserError(f"bench.reference_images={cfg.bench.reference_images} must be >= 1 (rows per resolution "
                        "compared with the baseline; at most bench.baseline_batch are there to compare)")


def check_store_output(cfg: JobConfig) -> None:
    """An object-store output.dir: its fsspec backend is installed, no option needs a local one, and the
    store answers (pipeline.store.check_reachable)."""
    from pipeline.store import check_reachable, open_store

    fs, root = open_store("output.dir", cfg.output.dir)
    for key, value, why in (
        ("output.contact_sheet", cfg.output.contact_sheet, "it reads every image back"),
        ("output.on_conflict", cfg.output.on_conflict == "overwrite", "it rewrites committed shard files in place"),
        ("bench.baseline", cfg.bench.baseline or cfg.bench.baseline_only or cfg.bench.baseline_from,
         "the benchmark compares local files"),
    ):
        if value:
            raise UserError(f"{key}: not available with an object-store output.dir ({cfg.output.dir}): {why}; "
                            "use a local output.dir for it, or leave the key at its default")
    check_reachable("output.dir", cfg.output.dir, fs, root)
