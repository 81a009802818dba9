"""The run report as typed records: each process's `parts/shard-*.json` (`PartReport`) and the
run-level `stats.json` (`RunReport`).

One schema, versioned by its `schema` field (SCHEMA_VERSION). The job writes a part through
`to_json`; `pipeline.merge` reads the parts back and sums them into the run's report; the sweep
summary and the bench read through the same types. `from_dict` / `read` check every key and
value against the dataclasses, so a field added here is written and read by the same line.
"""

from __future__ import annotations

import json
import types
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from bcg.metrics import EngineReport, EngineTotals
from pipeline.errors import UserError
from pipeline.fsutil import atomic_write_text

SCHEMA_VERSION = 1
READABLE = (SCHEMA_VERSION,)  # the schemas this version reads

R = TypeVar("R", bound="Report")


class ReportError(UserError):
    """A report file this version cannot read; the message names the file and what is wrong."""


@dataclass(frozen=True, kw_only=True)
class ImageCounts:
    planned: int  # rows in this shard's batches of the plan
    ok: int  # a part: made by this run; stats.json: committed rows on disk (every run that added to them)
    failed: int
    skipped: int  # committed by an earlier run of the same job
    invalid: int  # bad manifest rows (manifest.on_invalid=skip)
    generated: int  # made by this run (stats.json: by the last run of each shard)


def summary_line(ok: int, failed: int, skipped: int, invalid: int, wall_s: float, where: str) -> str:
    """The one line every job ends with (a Ray driver's: over its shards). Its wall time runs from the
    process's start (start-up included) where the system says when that was, else `wall_s`."""
    from pipeline.startup import process_age_s

    since_start = process_age_s()
    wall = (f"{since_start:.1f} s wall since the command started" if since_start is not None
            else f"{wall_s:.1f} s wall since the job started")
    return (f"summary: {ok} done, {failed} failed, {skipped} skipped (committed earlier), {invalid} invalid rows, "
            f"{wall}; {where}")


@dataclass(frozen=True, kw_only=True)
class ShardInfo:
    index: int
    count: int


@dataclass(frozen=True, kw_only=True)
class PromptCacheCounts:
    encoded: int  # prompts the text encoders encoded
    hits: int  # prompts asked for and found encoded
    calls: int = 0  # text-encoder calls
    padding: int = 0  # empty prompts that filled their short chunks
    cut: dict[str, int] = field(default_factory=dict)  # text encoder -> texts encoded that it cut to its token limit


@dataclass(frozen=True, kw_only=True)
class GpuBusyReport:
    """Device time on batches (CUDA events; `pipeline.generate.GpuBusy`)."""

    fraction: float  # busy seconds over the generate phase's wall time, the writer's tail included
    between_batches: float | None  # busy seconds over the device's span from the first batch to the last
    busy_s: float
    device_span_s: float
    generate_s: float
    batches: int


@dataclass(frozen=True, kw_only=True)
class GpuMemory:
    """The job's device memory in GiB (`pipeline.gpu_memory`): allocated is what tensors hold,
    reserved what PyTorch's caching allocator holds (graph pools included). Peaks count from the
    job's device set-up on, so what ran before in the process (+job=bench's baseline) is not in them."""

    model_gib: float  # allocated once the model is built and its kernels applied: its weights, text encoders included
    denoise_allocated_gib: float  # allocated as the first batch starts (prompts encoded, graphs captured)
    denoise_reserved_gib: float  # reserved then: the weights that stay, the graph pool, the static buffers
    peak_allocated_gib: float
    peak_reserved_gib: float
    text_encoders_resident: bool  # the model still held its text encoders then (false with model.offload_text_encoder)


@dataclass(frozen=True, kw_only=True)
class StartupTimes:
    """Seconds from the process's start to its first batch, by stage, in the order they run
    (`pipeline.startup`). A warm run (the job's compile cache filled by an earlier process) differs
    from a cold one in `kernels` and `warmup`, where compiling happens. `imports` is measured from
    the process's start as Linux's /proc records it (None elsewhere), so in a sweep run in one
    process it holds the jobs before too. `prompts` encodes every prompt only with
    model.offload_text_encoder; otherwise each batch encodes its own."""

    imports: float | None  # process start to the job's start: Python, imports, Hydra, the config
    prepare: float  # checks, device, manifest, ladder and plan, the output lock
    build: float  # the model built or read, its weights on the device (0 when the caller built it)
    kernels: float  # kernel setup (apply_kernels: the attention probe, the decoder's first pass with fuse_decoder or compile_decoder)
    calibrate: float  # bcg.ladder=auto's calibration; 0 with a decided ladder
    prompts: float  # the batches left to run (committed ones skipped), the prompt cache
    warmup: float  # the engine's warm-up passes, where the compiled transformer code compiles (and tunes)
    capture: float  # CUDA graph capture (and its static buffers)
    first_batch: float | None  # first batch queued to its images on the host (then written); None: no batch
    total: float | None  # process start to the first batch's images; None without `imports` or a batch
    to_first_commit: float | None = None  # process start to the first batch committed (its images and rows written)
    # packages this process compiled from source (no bytecode, and none written): their compiling is in `imports`
    imported_from_source: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class OutputReport:
    """What the writer made (`output.layout`). A part: what this run wrote; stats.json: what the
    shard files on disk hold, over every run that added to them."""

    layout: str
    shard_files: int
    bytes_per_format: dict[str, int]  # encoded image bytes, by output.format


@dataclass(frozen=True, kw_only=True)
class ShardEntry:
    """One shard's figures in stats.json's `shards`."""

    shard: ShardInfo
    device: str
    images: ImageCounts
    wall_s: float
    generate_s: float
    images_per_s: float | None
    per_resolution: dict[str, int]
    bcg: EngineReport
    startup_s: StartupTimes | None = None
    gpu_memory: GpuMemory | None = None


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a part and stats.json both hold. Rates: `images_per_s` over the generate phase (after
    warm-up and capture), `wall_images_per_s` over the wall time; None when no time passed."""

    schema: int = SCHEMA_VERSION
    images: ImageCounts
    oom_retries: int
    batches: int
    padded_rows: int
    wall_s: float
    generate_s: float
    images_per_s: float | None
    wall_images_per_s: float | None
    stage_s: dict[str, float]  # encode, noise, denoise, decode: device seconds summed over batches
    per_resolution: dict[str, int]  # "WxH" (pipeline.planner.size_label) -> images
    batches_per_bucket: dict[str, int]
    ladder: list[int]
    scope: str
    sampler: str
    precision: dict[str, Any]
    device: str
    model: str
    prompt_cache: PromptCacheCounts
    writer_busy_s: float
    output: OutputReport | None = None  # absent from reports written before it existed
    gpu_busy: GpuBusyReport | None  # None off CUDA
    gpu_memory: GpuMemory | None = None  # None off CUDA (stats.json: the first shard's)
    kernels: dict[str, Any]  # what pipeline.kernels applied and observed (open-ended)
    ladder_auto: dict[str, Any] | None  # bcg.ladder=auto: the calibration, when this run made it
    versions: dict[str, str]
    config: dict[str, Any] | None  # the resolved Hydra config
    startup_s: StartupTimes | None = None  # this process's start-up by stage (stats.json: the first shard's)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def write(self, path: Path) -> None:
        atomic_write_text(Path(path), self.to_json())

    @classmethod
    def from_dict(cls: type[R], data: Any, source: str) -> R:
        """`data` (a parsed report) as this type; ReportError naming `source` (the file, or what
        produced `data`) when its schema is not one this version reads or a key or value is wrong."""
        check_schema(data, source)
        return _typed(cls, data, source, "")

    @classmethod
    def read(cls: type[R], path: Path) -> R:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ReportError(f"{path} cannot be read as a report: {err}") from None
        return cls.from_dict(data, str(path))


@dataclass(frozen=True, kw_only=True)
class PartReport(Report):
    """One process's report (`parts/shard-<i>-of-<n>.json`); what `pipeline.job.run` returns."""

    shard: ShardInfo
    started_at: float  # wall clock (time.time), to merge shards that ran apart
    ended_at: float
    bcg: EngineReport


@dataclass(frozen=True, kw_only=True)
class RunReport(Report):
    """The run-level stats.json (`pipeline.merge`); see `merge_stats` for how shards combine."""

    bcg: EngineReport | EngineTotals  # one shard: its engine's report; several: the totals
    shards: list[ShardEntry]


def check_schema(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ReportError(f"{source} is not a report (a JSON object), but {type(data).__name__}")
    if "schema" not in data:
        raise ReportError(f"{source} has no `schema` field: it was written before the report was versioned; this "
                          f"version reads schema {list(READABLE)}. Run that job again to rewrite it.")
    found = data["schema"]
    if found not in READABLE:
        newer = isinstance(found, int) and found > SCHEMA_VERSION
        raise ReportError(f"{source} has report schema {found!r}, {'newer than' if newer else 'not one of'} the "
                          f"schemas this version reads ({list(READABLE)})"
                          + ("; read it with the version that wrote it" if newer else ""))


def _typed(tp: Any, value: Any, source: str, where: str) -> Any:
    """`value` (parsed JSON) checked against the type `tp` and built into it: dataclasses from
    objects with exactly their fields (a field with a default may be absent: a report written before
    it existed), lists and str-keyed dicts item by item, ints taken as floats."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if is_dataclass(tp):
        return _record(tp, value, source, where)
    if origin in (Union, types.UnionType):
        return _union(get_args(tp), value, source, where)
    if origin is list and isinstance(value, list):
        (item,) = get_args(tp)
        return [_typed(item, v, source, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        _, item = get_args(tp)
        return {k: _typed(item, v, source, f"{where}.{k}") for k, v in value.items()}
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bool) and type(value) is tp:
        return value
    raise ReportError(f"{source}: `{where}` is {value!r}, not {_name(tp)}")


def _record(tp: type, value: Any, source: str, where: str) -> Any:
    if not isinstance(value, dict):
        raise ReportError(f"{source}: `{where}` is {value!r}, not an object ({tp.__name__})")
    names = [f.name for f in fields(tp)]
    required = _required(tp)
    missing = [n for n in names if n not in value and n in required]
    unknown = [k for k in value if k not in names]
    if missing or unknown:
        what = "; ".join(part for part in (missing and f"missing {missing}", unknown and f"unknown {unknown}") if part)
        raise ReportError(f"{source}: {f'`{where}`' if where else 'the report'} ({tp.__name__}) has keys that do not "
                          f"match this version's: {what}")
    hints = get_type_hints(tp)
    return tp(**{n: _typed(hints[n], value[n], source, f"{where}.{n}".lstrip(".")) for n in names if n in value})


def _union(options: tuple, value: Any, source: str, where: str) -> Any:
    """`X | None`, or a choice of records told apart by their keys (EngineReport | EngineTotals)."""
    if value is None and type(None) in options:
        return None
    options = tuple(o for o in options if o is not type(None))
    if len(options) == 1:
        return _typed(options[0], value, source, where)
    matching = [o for o in options if isinstance(value, dict) and _keys_fit(o, set(value))]
    if len(matching) != 1:
        raise ReportError(f"{source}: `{where}` matches none of {[_name(o) for o in options]}")
    return _record(matching[0], value, source, where)


def _required(tp: type) -> set[str]:
    """The fields of record `tp` without a default: a report must hold them (the others may be absent
    from one written before they existed)."""
    return {f.name for f in fields(tp) if f.default is MISSING and f.default_factory is MISSING}


def _keys_fit(tp: type, keys: set[str]) -> bool:
    """Whether a record of `tp` can hold exactly these keys: every required field, and no key it lacks."""
    return _required(tp) <= keys <= {f.name for f in fields(tp)}


def _name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))
