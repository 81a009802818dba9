"""Where a model comes from: a local diffusers directory, or a config with random weights.

A `Source` holds every component's config (dicts, as diffusers and transformers store them) and,
for a directory, which class each component is. Reading one touches only JSON files, so the
manifest can be checked against a checkpoint's limits before any weights are loaded. Loading
weights from a directory is safetensors only, offline only, and only classes of diffusers or
transformers themselves (no remote code).
"""

from __future__ import annotations

import inspect
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import importlib
import torch
from packaging import version

from pipeline.errors import UserError, not_accepted
from pipeline.model_info import MODEL_INDEX, pipeline_dir_problem

LIBRARIES = ("diffusers", "transformers")  # the only packages a directory's components may come from
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
INIT_DEVICES = ("cpu", "target")


def library(name: str):
    """diffusers or transformers, imported when a model first needs it (not by the command's checks)."""
    return importlib.import_module(name)


def transformers_dtype_kwarg() -> str:
    """transformers renamed `torch_dtype` to `dtype` in 4.56 (diffusers' loader makes the same choice)."""
    installed = version.parse(library("transformers").__version__).base_version
    return "dtype" if version.parse(installed) >= version.parse("4.56") else "torch_dtype"


@dataclass(frozen=True)
class Source:
    family: str
    pipeline: str  # the diffusers pipeline class this model is (or mirrors, for random weights)
    configs: dict[str, dict[str, Any]]  # component -> config; "scheduler" holds `_class_name`
    path: Path | None = None  # the local diffusers directory; None for random weights
    classes: dict[str, tuple[str, str]] = field(default_factory=dict)  # component -> (library, class)
    index: dict[str, Any] = field(default_factory=dict)  # model_index.json

    def has(self, component: str) -> bool:
        return component in self.configs or component in self.classes

    @property
    def scheduler(self) -> tuple[str, dict[str, Any]]:
        """(diffusers scheduler class name, its config)."""
        config = dict(self.configs["scheduler"])
        return config["_class_name"], config


# ---- reading a directory (JSON only) --------------------------------------------------------


def force_offline() -> None:
    """No network for anything loaded from here on (hub lookups, downloads)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"


def read_pipeline_dir(path: str | os.PathLike, pipelines: dict[str, str]) -> Source:
    """A local diffusers pipeline directory -> its Source (configs only, no weights).

    `pipelines` maps supported diffusers pipeline class names to family names; anything else is a
    ValueError naming what is supported.
    """
    root = Path(path).expanduser()
    where = f"model.path={os.fspath(path)}"
    why = pipeline_dir_problem(root)
    if why:
        raise UserError(f"{where}: {why}")
    index_file = root / MODEL_INDEX
    index = _read_json(index_file)
    pipeline = index.get("_class_name")
    if pipeline not in pipelines:
        supported = ", ".join(f"{cls} ({fam})" for cls, fam in sorted(pipelines.items()))
        raise UserError(
            f"{where}: {MODEL_INDEX} names pipeline class {pipeline!r}, which is not supported; "
            f"supported pipeline classes (family): {supported}"
        )
    classes = _component_classes(index, where)
    configs = {}
    for name in classes:
        folder = root / name
        if not folder.is_dir():
            raise UserError(f"{where}: {MODEL_INDEX} lists component {name!r} but there is no folder {folder}")
        config = folder / ("scheduler_config.json" if name == "scheduler" else "config.json")
        if config.is_file():
            configs[name] = _read_json(config)
    if "scheduler" not in configs:
        raise UserError(f"{where}: no scheduler/scheduler_config.json (the checkpoint's own sampler)")
    source = Source(pipelines[pipeline], pipeline, configs, root, classes, index)
    check_safetensors(source)
    return source


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err})") from None


def _component_classes(index: dict[str, Any], where: str) -> dict[str, tuple[str, str]]:
    """model_index.json's components: name -> (library, class); [null, null] means absent."""
    out = {}
    for name, entry in index.items():
        if name.startswith("_") or not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            continue
        package, cls = entry
        if package not in LIBRARIES:
            raise UserError(
                f"{where}: component {name!r} comes from {package!r}; only components of "
                f"{sorted(LIBRARIES)} are loaded (no remote code)"
            )
        out[name] = (package, cls)
    return out


# ---- loading weights -------------------------------------------------------------------------


def component_class(source: Source, name: str) -> type:
    library_name, cls = source.classes[name]
    found = getattr(library(library_name), cls, None)
    if not isinstance(found, type):
        raise UserError(f"model.path={source.path}: {library_name} has no class {cls!r} (component {name!r})")
    return found


def _is_model(cls: type) -> bool:
    return issubclass(cls, (library("diffusers").ModelMixin, library("transformers").PreTrainedModel))


def weighted_components(source: Source) -> list[str]:
    """The directory's components with weights (models, not tokenizers or the scheduler)."""
    return [name for name in source.classes if _is_model(component_class(source, name))]


def check_safetensors(source: Source) -> None:
    """Every weighted component must have safetensors: pickles can run code when loaded."""
    for name in weighted_components(source):
        folder = source.path / name
        files = sorted(p.name for p in folder.iterdir() if p.is_file())
        if any(f.endswith(".safetensors") for f in files):
            continue
        pickles = [f for f in files if f.endswith(PICKLE_SUFFIXES)]
        found = f"only pickle weights ({', '.join(pickles)})" if pickles else "no weights"
        raise UserError(
            f"model.path={source.path}: component {name!r} has {found}; only safetensors are loaded "
            "(pickle files can run code when loaded). Convert it with "
            "pipeline.save_pretrained(dir, safe_serialization=True)."
        )


def load_component(source: Source, name: str, dtype: torch.dtype, device: torch.device) -> Any:
    """One component from the directory: models in `dtype` on `device`, tokenizers as they are."""
    cls = component_class(source, name)
    folder = source.path / name
    if not _is_model(cls):
        return cls.from_pretrained(folder, local_files_only=True)
    kwargs = dict(local_files_only=True, use_safetensors=True)
    if issubclass(cls, library("transformers").PreTrainedModel):
        kwargs[transformers_dtype_kwarg()] = dtype
    else:
        kwargs["torch_dtype"] = dtype
    with no_loading_bars():
        model = cls.from_pretrained(folder, **kwargs)
    return model.to(device).eval()


@contextmanager
def no_loading_bars() -> Iterator[None]:
    """Without transformers' and diffusers' progress bars (transformers draws one per component as
    its weights load): the job's own log says what it loaded."""
    libraries = (library("transformers").utils.logging, library("diffusers").utils.logging)
    enabled = [logs.is_progress_bar_enabled() for logs in libraries]
    for logs in libraries:
        logs.disable_progress_bar()
    try:
        yield
    finally:
        for logs, was in zip(libraries, enabled):
            if was:
                logs.enable_progress_bar()


# ---- random weights --------------------------------------------------------------------------


def init_where(init_device: str, device: torch.device) -> torch.device:
    """Where random weights are initialised (model.init_device: cpu, or the job's device)."""
    if init_device not in INIT_DEVICES:
        raise not_accepted("model.init_device", init_device, INIT_DEVICES, synonyms={"gpu": "target", "cuda": "target"})
    return torch.device("cpu") if init_device == "cpu" else device


def build_random_modules(
    factories: dict[str, Callable[[], torch.nn.Module]],
    seed: int,
    init_device: str,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.nn.Module]:
    """Build each module in order from one seed, each moved to `device` and cast to `dtype` before the
    next is built (`pipeline.models.footprint` counts that peak). `init_device=cpu`: on the CPU, then
    moved, so the weights are the same on every device (small models); `target`: initialised
    directly on `device` (no host copy of a multi-billion-parameter model; weights then depend on
    the device's random generator)."""
    where = init_where(init_device, device)
    torch.manual_seed(seed)
    out = {}
    for name, factory in factories.items():  # each moved and cast before the next is built (no random draws)
        with torch.device(where):
            module = factory()
        with quiet_diffusers():  # diffusers warns on every dtype cast; the dtype is ours to choose
            out[name] = module.to(device=device, dtype=dtype).eval()
    return out


def make_modules(
    source: "Source", cfg, factories: dict[str, Callable[[], torch.nn.Module]], device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, torch.nn.Module], str]:
    """The model's modules and name: random weights from `factories` (component -> constructor)
    for a config, or every one of those components loaded from the checkpoint directory."""
    if source.path is None:
        modules = build_random_modules(factories, cfg.init_seed, cfg.init_device, device, dtype)
    else:
        modules = {m: load_component(source, m, dtype, device) for m in factories}
    return modules, model_name(source, cfg)


def model_name(source: Source, cfg) -> str:
    """What output rows and stats.json call the model: the config's name for random weights, the
    checkpoint directory's name for a local directory."""
    return cfg.name if source.path is None else source.path.name


def default_max_side(native: int, hard: int | None, configured: int | None) -> int:
    """The largest side a manifest may ask for: `configured` when set, else twice the native side
    (the largest side in diffusers' aspect-ratio bins), never above a hard architectural limit."""
    side = configured if configured is not None else 2 * native
    return min(side, hard) if hard is not None else side


@contextmanager
def quiet_diffusers() -> Iterator[None]:
    logging = library("diffusers").utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def config_value(cls: type, config: dict[str, Any], key: str) -> Any:
    """A component config's value, or the class's own default where the JSON leaves it out (as
    diffusers does when it builds the class from that config)."""
    if key in config:
        return config[key]
    return inspect.signature(cls.__init__).parameters[key].default


def vae_scale_factor(vae_config: dict[str, Any]) -> int:
    """Pixels per latent pixel, as diffusers' pipelines compute it: 2 ** (VAE levels - 1)."""
    return 2 ** (len(config_value(library("diffusers").AutoencoderKL, vae_config, "block_out_channels")) - 1)
