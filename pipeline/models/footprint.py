"""How much memory a model's weights take while it is built, against what the machine has: a model
that cannot fit is refused by name before any weight is allocated, instead of a process the kernel
kills or a CUDA out-of-memory traceback half-way through a load.

A component is built and then cast (random weights: constructed in float32 where
model.init_device says, then moved and cast to the job's dtype; a checkpoint: loaded on the host in
the job's dtype, then moved), one component after another. Its bytes as built come from its
constructor run on the meta device (random weights) or from its safetensors headers (a checkpoint);
nothing is allocated. Only weights are counted, so the figure is a lower bound: a refused model
could not have been built, a passed one may still need more for its activations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline.errors import UserError
from pipeline.gpu_memory import gib

SAFETENSORS_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                           "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
FLOATING = ("F64", "F32", "F16", "BF16")  # what a load in the job's dtype casts
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "model.safetensors")  # what from_pretrained loads


@dataclass(frozen=True)
class Component:
    name: str
    floating: int  # elements of its floating tensors (cast to the job's dtype)
    other: int  # bytes of the rest (kept as they are)
    constructed: int | None = None  # bytes as its constructor makes them (random weights); None: loaded in the dtype

    def kept(self, dtype: torch.dtype) -> int:
        """Bytes once cast to `dtype`."""
        return self.floating * dtype.itemsize + self.other

    def built(self, dtype: torch.dtype) -> int:
        """Bytes while it is built, before the cast."""
        return self.constructed if self.constructed is not None else self.kept(dtype)


def peak_bytes(components: list[Component], where: torch.device, device: torch.device,
               dtype: torch.dtype) -> dict[str, tuple[int, str]]:
    """Memory kind ("host" or the device) -> (the most bytes its weights hold at once, the component
    being built then, or "all"), for components built in order on `where`, each moved to `device`
    and cast to `dtype` before the next is built."""
    if not components:
        return {}
    if where == device:  # one pool: the earlier components, cast, beside the one being built
        held, peaks = 0, []
        for c in components:
            peaks.append((held + c.built(dtype), c.name))
            held += c.kept(dtype)
        return {_kind(device): max(peaks)}
    biggest = max(components, key=lambda c: c.built(dtype))
    return {_kind(where): (biggest.built(dtype), biggest.name),
            _kind(device): (sum(c.kept(dtype) for c in components), "all")}


def _kind(device: torch.device) -> str:
    return "host" if device.type == "cpu" else str(device)


def module_component(name: str, factory: Callable[[], torch.nn.Module]) -> Component:
    """The module `factory` makes, from its parameters and buffers on the meta device (nothing is
    allocated; Module.to casts the floating ones only)."""
    with torch.device("meta"):
        module = factory()
    constructed = floating = other = 0
    for t in [*module.parameters(), *module.buffers()]:
        constructed += t.numel() * t.element_size()
        if t.is_floating_point():
            floating += t.numel()
        else:
            other += t.numel() * t.element_size()
    return Component(name, floating, other, constructed)


def random_components(factories: dict[str, Callable[[], torch.nn.Module]]) -> list[Component]:
    return [module_component(name, factory) for name, factory in factories.items()]


def checkpoint_components(root: Path, names: list[str]) -> list[Component]:
    """Each named component folder's weights, from its safetensors headers (the files from_pretrained
    loads: the single file, or the shards its index lists); a folder without them counts 0."""
    out = []
    for name in names:
        floating = other = 0
        for path in weight_files(root / name):
            f, o = safetensors_sizes(path)
            floating, other = floating + f, other + o
        out.append(Component(name, floating, other))
    return out


def weight_files(folder: Path) -> list[Path]:
    for file in WEIGHT_FILES:
        if (folder / file).is_file():
            return [folder / file]
        index = folder / f"{file}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            return [folder / shard for shard in shards if (folder / shard).is_file()]
    return []


def safetensors_sizes(path: Path) -> tuple[int, int]:
    """(elements of floating tensors, bytes of the others) of a safetensors file, from its header
    alone (8 bytes of length, then JSON)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    floating = other = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        numel = 1
        for n in entry["shape"]:
            numel *= n
        if entry["dtype"] in FLOATING:
            floating += numel
        else:
            other += numel * SAFETENSORS_DTYPE_BYTES.get(entry["dtype"], 4)
    return floating, other


# ---- what the machine has --------------------------------------------------------------------


def available_bytes(kind: str) -> int | None:
    """Bytes free for this process: on the host MemAvailable, capped by its cgroups' limits less their
    usage (a container's, a Slurm job's); on a CUDA device its free memory and what this process's
    allocator holds unused. None where unknown."""
    if kind == "host":
        return host_available()
    device = torch.device(kind)
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # our allocator's spare


def host_available(meminfo: Path = Path("/proc/meminfo"), cgroups: Path = Path("/proc/self/cgroup"),
                   root: Path = Path("/sys/fs/cgroup")) -> int | None:
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    found += cgroup_room(cgroups, root)
    return min(found) if found else None


def cgroup_room(cgroups: Path, root: Path) -> list[int]:
    """limit - usage of every cgroup above this process that sets a memory limit (v2: memory.max and
    memory.current along its path; v1: the memory controller's limit_in_bytes and usage_in_bytes)."""
    try:
        lines = cgroups.read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, names = root, ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):  # v1
            base, names = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            room = _room(base.joinpath(*parts[:depth]), *names)
            if room is not None:
                rooms.append(room)
    return rooms


def _room(folder: Path, limit: str, usage: str, cache: str) -> int | None:
    """A cgroup's limit less its usage, the page cache in it not counted (the kernel reclaims it
    before it refuses memory); None without a limit ("max", or v1's near 2**63)."""
    try:
        limit_text, usage_text = (folder / limit).read_text().strip(), (folder / usage).read_text().strip()
    except OSError:
        return None
    if not limit_text.isdigit() or not usage_text.isdigit() or int(limit_text) >= 2**60:
        return None
    try:
        stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    except OSError:
        stat = {}
    cached = int(stat.get(cache, "0")) if stat.get(cache, "0").isdigit() else 0
    return max(int(limit_text) - max(int(usage_text) - cached, 0), 0)


# ---- the check -------------------------------------------------------------------------------


def shortfall(components: list[Component], where: torch.device, device: torch.device, dtype: torch.dtype,
              available: Callable[[str], int | None]) -> tuple[str, int, str, int] | None:
    """(memory kind, bytes needed, the component then, bytes free) where the weights cannot fit; None
    where they can (or nothing is known of what is free)."""
    for kind, (need, at) in peak_bytes(components, where, device, dtype).items():
        free = available(kind)
        if free is not None and need > free:
            return kind, need, at, free
    return None


def check_fits(model: str, components: list[Component], where: torch.device, device: torch.device,
               dtype: torch.dtype, available: Callable[[str], int | None] | None = None) -> None:
    """UserError naming the model, the memory its weights need and the settings that would make them
    fit, where they cannot while it is built (`where`: where its components are built, `device`:
    where they run; `available`: bytes free per memory kind, by default `available_bytes`)."""
    available = available or available_bytes
    short = shortfall(components, where, device, dtype, available)
    if short is None:
        return
    kind, need, at, free = short
    alternatives = []  # (setting, where, device, dtype) the user could choose instead
    if dtype.itemsize > 2:
        alternatives.append(("precision=bf16", where, device, torch.bfloat16))
    if where == device and device.type == "cuda":  # random weights initialised on the GPU
        alternatives.append(("model.init_device=cpu", torch.device("cpu"), device, dtype))
    if device.type == "cpu" and torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        alternatives.append(("runtime.device=cuda", gpu if where == device else where, gpu, dtype))
    fitting = [setting for setting, *alt in alternatives if shortfall(components, *alt, available) is None]
    cast = str(dtype).removeprefix("torch.")
    during = (f"all its components in {cast}" if at == "all"
              else f"its {at} as built, beside the components before it in {cast}")
    raise UserError(f"model {model}: its weights need at least {gib(need)} GiB of {kind} memory ({during}), and "
                    f"{gib(free)} GiB are free there; "
                    + (f"they would fit with {' or '.join(fitting)}" if fitting else
                       "it needs a machine with more memory" + (", or a GPU" if device.type == "cpu" else "")))
