"""kernels.precompile: each kind of compiled block saved whole in the kernel cache and loaded by later
processes instead of traced again.

A regional compile (`compile_scope=blocks`) traces each kind of block with dynamo in every process,
a warm one too: inductor's cache spares it the kernels' code generation, not the trace. Here the
first process compiles each kind ahead of time with torch's `aot_compile` (the trace, its guards and
inductor's code in one artifact) and saves it beside the other kernels (pipeline.kernels.compile's
cache directory); a later process loads it and traces nothing.

A kind is the block's class and whether it runs one row or more (dynamo specializes a batch of 1).
Its first call is made at the canonical shapes (pipeline.kernels.compile.CanonicalFirstCalls), so its
kernels are generated for those sizes whichever process compiles them, as the JIT compile's are;
every other dimension of more than one element is symbolic, as under `compile_dynamic`. Every block
of a kind calls the same compiled function with its own weights (they are its inputs). An artifact is
keyed by what its code depends on: the kind, the settings the block was built with (`settings`), the
weights' shapes and dtypes, the inputs' dtypes and ranks, the compile options, torch's version and the
source of the blocks and kernels that it traced.

Guards that name objects (the block instance, its modules) cannot be saved and are dropped
(`torch.compiler.keep_portable_guards_unsafe`): the blocks are ours, their calls come from our
forward only, and the tensor guards (dtypes, devices, ranks, the symbolic sizes' bounds) stay.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.errors import UserError
from pipeline.plans import NEEDS, as_override, unmet_needs

log = logging.getLogger(__name__)

# what loading an artifact that is not one (cut short, another format) raises
UNREADABLE = (OSError, EOFError, pickle.UnpicklingError, RuntimeError, ValueError, TypeError, KeyError, AttributeError)
SOURCES = ("blocks", "kernels")  # pipeline's packages whose code a block's trace reads
GUARD_MISS = "GuardManager check failed"  # what a saved function raises for inputs its guards refuse
TORCH_API = ("load_compiled_function", "keep_portable_guards_unsafe")  # torch.compiler's, that this needs


def unsupported(owned: bool) -> str | None:
    """Why these blocks cannot be saved compiled (`owned`: the project's own, pipeline.blocks), or None.
    diffusers' blocks carry per-instance methods (pipeline.kernels.compile.broadcast_attention_masks)
    that dynamo's saved guards cannot name."""
    import torch._dynamo

    missing = [f"torch.compiler.{name}" for name in TORCH_API if not hasattr(torch.compiler, name)]
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        missing.append("torch._dynamo.config.enable_aot_compile")
    if missing:
        return f"torch {torch.__version__} has no {', '.join(missing)} (aot_compile's API)"
    if not owned:
        return "it saves the project's own blocks (the flux and sd3 plans'), and this model runs diffusers' blocks"
    return None


def check(kernels, device: torch.device | None) -> None:
    """kernels.precompile needs a regional compile with symbolic sizes (one artifact per kind)."""
    if kernels.precompile and unmet_needs(kernels, "precompile"):
        *first, last = (as_override(key, value) for key, value in NEEDS["precompile"].items())
        raise UserError("kernels.precompile saves the compiled blocks of a regional compile with symbolic sizes: it "
                        f"needs {', '.join(first)} and {last}; set those, or kernels.precompile=false")


def source_digest() -> str:
    """A digest of the code a block's trace reads (our blocks and kernels), so that an edited checkout
    never loads code compiled from the old one."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for package in SOURCES:
        for path in sorted((root / package).glob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def settings(block: torch.nn.Module) -> list:
    """What the trace of a block reads as constants, its guards naming the block being dropped: each
    submodule's class and its attributes of plain values (the kernels it was built with: float8
    attention's kernel, whether it writes rows, its norms' eps)."""
    def plain(v: Any) -> bool:
        return isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(map(plain, v)))
    return [(name, type(m).__qualname__, sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and plain(v)))
            for name, m in block.named_modules()]


def describe(value: Any) -> Any:
    """What of a block's input its compiled code depends on: a tensor's dtype, rank and whether it is
    contiguous (its sizes are symbolic; a view's strides are guarded: hoist_modulation's windows), anything
    else as it is (dicts and tuples of them item by item)."""
    if torch.is_tensor(value):
        return [str(value.dtype), value.dim(), value.is_contiguous()]
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    return stable(value)


def stable(value: Any) -> str:
    """A value as the same text in every process: an inductor pass (pipeline.kernels.reductions' marker)
    by its uuid, an object whose text holds its address by its type, anything else as its repr."""
    if callable(getattr(value, "uuid", None)):
        return f"{type(value).__qualname__}:{value.uuid()}"
    text = repr(value)
    return f"{type(value).__module__}.{type(value).__qualname__}" if " at 0x" in text else text


def brief(err: BaseException) -> str:
    """An error's message on one line, cut to what a log line holds."""
    return f"{type(err).__name__}: " + str(err).replace("\n", " ")[:300]


def unaliased(value: Any) -> Any:
    """A tensor that is a view traced as such makes dynamo guard on its base's sizes and strides
    (`x._base`), which later calls need not share (their input another view, or none): the trace gets a
    tensor of the same sizes, strides and values that is no view, so that only the input's own layout is
    guarded."""
    if not torch.is_tensor(value) or value._base is None:
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(value)


class SavedBlocks:
    """The repeated blocks of one transformer, each kind's calls served by one compiled function:
    loaded from `directory` where an earlier process saved it, else compiled at the kind's first call
    and saved there. `options`: inductor's (pipeline.kernels.compile.compile_options)."""

    def __init__(self, blocks: list[torch.nn.Module], directory: Path, options: dict):
        self.directory = directory
        self.options = options
        self.calls: dict[tuple, Callable] = {}  # (kind, rows, inputs) -> its compiled function
        # the artifacts loaded and compiled so far (the job's stats hold this dict and see it grow)
        self.counts: dict[str, Any] = {"loaded": [], "compiled": [], "load_s": 0.0, "compile_s": 0.0}
        self.fallbacks: dict[type, Callable] = {}  # a class -> its forward traced (pipeline.kernels.compile's way)
        self.sources = source_digest()
        for block in blocks:
            block.forward = self._serving(block)  # the instance's: the class keeps its forward

    def _serving(self, block: torch.nn.Module) -> Callable:
        kind = json.dumps({"kind": type(block).__qualname__, "settings": settings(block),
                           "weights": [(name, list(t.shape), str(t.dtype)) for name, t in block.state_dict().items()]})

        def forward(*args: Any, **kwargs: Any) -> Any:
            inputs = [*args, *kwargs.values()]
            rows = "rows1" if next(a for a in inputs if torch.is_tensor(a)).shape[0] == 1 else "rows"
            call = (kind, rows, repr([(name, describe(a)) for name, a in [*enumerate(args), *kwargs.items()]]))
            fn = self.calls.get(call)
            if fn is None:
                fn = self.calls[call] = self._load_or_compile(self.key(type(block).__name__, *call), block, args, kwargs)
            try:
                return fn(block, *args, **kwargs)
            except RuntimeError as err:  # its guards refuse these inputs: traced as without kernels.precompile
                if GUARD_MISS not in str(err):
                    raise
                return self._traced(type(block), err)(block, *args, **kwargs)
        return forward

    def _traced(self, cls: type, err: RuntimeError) -> Callable:
        """The class's forward compiled by dynamo as a regional compile does, for the calls whose inputs a
        saved function's guards refuse; said once per class, each call counted (`guard_misses`)."""
        self.counts["guard_misses"] = self.counts.get("guard_misses", 0) + 1
        if cls not in self.fallbacks:
            log.warning("kernels.precompile: the saved %s refuses a call's inputs (%s); such calls are traced and "
                        "compiled as without kernels.precompile", cls.__name__, brief(err))
            self.fallbacks[cls] = torch.compile(cls.forward, dynamic=True, options=self.options)
        return self.fallbacks[cls]

    def key(self, name: str, kind: str, rows: str, inputs: str) -> str:
        """The artifact's name: the block's class, one row or more (the block's first tensor input), and
        a digest of everything its code depends on (its weights' shapes, its inputs' dtypes, ranks and layouts)."""
        what = [kind, rows, inputs, self.options, torch.__version__, self.sources]
        digest = hashlib.sha256(json.dumps(what, sort_keys=True, default=stable).encode()).hexdigest()[:16]
        return f"{name}-{rows}-{digest}"

    def _load_or_compile(self, key: str, block: torch.nn.Module, args: tuple, kwargs: dict) -> Callable:
        path = self.directory / f"{key}.aot"
        start = time.perf_counter()
        fn, how = self._load(path), "load"
        if fn is None:
            fn, how = self._compile(block, args, kwargs), "compile"
            self._save(fn, path)
        self.counts["loaded" if how == "load" else "compiled"].append(key)
        self.counts[f"{how}_s"] = round(self.counts[f"{how}_s"] + time.perf_counter() - start, 3)
        return fn

    def _load(self, path: Path) -> Callable | None:
        if not path.exists():
            return None
        try:
            with path.open("rb") as f:
                return torch.compiler.load_compiled_function(f)
        except UNREADABLE as err:  # compiled again, said
            log.warning("kernels.precompile: %s cannot be loaded (%s); compiling it again", path.name, brief(err))
            return None

    def _compile(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> Callable:
        """aot_compile at these (the canonical) shapes, every dimension of more than one element symbolic."""
        args, kwargs = tuple(unaliased(a) for a in args), {k: unaliased(v) for k, v in kwargs.items()}
        for a in [*args, *kwargs.values()]:
            if torch.is_tensor(a):
                for dim, size in enumerate(a.shape):
                    if size > 1:
                        torch._dynamo.maybe_mark_dynamic(a, dim)
        options = {**self.options, "guard_filter_fn": torch.compiler.keep_portable_guards_unsafe}
        serving = block.__dict__.pop("forward")  # the class's forward, traced; the block as its `self`
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):  # off by default in torch 2.11
                compiled = torch.compile(block, fullgraph=True, dynamic=True, options=options).forward
            return compiled.aot_compile((args, kwargs))
        finally:
            block.forward = serving

    def _save(self, fn: Any, path: Path) -> None:
        """Written whole or not at all (a temporary file renamed); a failed write (a full or read-only
        disk, an object torch cannot save) costs a later process a compile, nothing else: said, and
        counted (`not_saved`)."""
        temporary = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(temporary))
            os.replace(temporary, path)
        except (OSError, RuntimeError) as err:  # RuntimeError: an object in the trace that torch cannot save
            log.warning("kernels.precompile: %s not saved (%s); a later process compiles it again", path.name,
                        brief(err))
            self.counts.setdefault("not_saved", []).append(path.stem)
            temporary.unlink(missing_ok=True)
