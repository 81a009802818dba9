"""What a job changes in its process, put back when it ends (`job_scope`), so that the jobs of a
Hydra sweep in one process behave as each would alone and a caller finds torch as it left it.

A job sets torch's numerics flags (pipeline.precision), dynamo's recompile limits (a compile),
environment variables (the Hugging Face offline flags for a local checkpoint, inductor's cache
directory), inductor's choices for this thread (kernels.persistent_reductions), seeds the CPU
generator (random weights), makes its GPU the current CUDA device, and leaves its compiled code in
dynamo's caches, where a later model of the same classes passes the guards: it would run the first
job's compilation and report none of its own (unless the next job takes the model itself,
pipeline.kept_model). Changes to a model need no undoing: they are made to
that model's instances (pipeline.kernels).
"""

from __future__ import annotations

import operator
import os
import sys
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import importlib

import torch

# Where torch (2.9 and later) keeps its per-backend fp32 precision; setting allow_tf32 or the float32
# matmul precision changes them, and setting those back does not change them all back.
FP32_PRECISION_OWNERS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul",
                         "mkldnn.conv", "mkldnn.rnn")
CONFIGS = ("torch._dynamo.config", "torch._inductor.config")  # imported when a job starts, not with this module
CHOICES = "torch._inductor.choices"  # what reading inductor's choices imports (most of a second)


@contextmanager
def job_scope(keeps_compiled: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Run the block (one job) with everything above saved on entry and restored on exit, also when
    it raises. Usable as a decorator: `@job_scope()`. `keeps_compiled`, asked at the end: whether the
    job left its model, compiled code and all, for the next job (pipeline.kept_model), which then
    drops that code itself when it drops the model."""
    with ExitStack() as stack:
        stack.enter_context(saved_environ())
        stack.enter_context(saved_numerics())
        for name in CONFIGS:
            stack.enter_context(saved_config(importlib.import_module(name)))
        stack.enter_context(saved_inductor_choices())
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator; CUDA's are seeded per job
        stack.enter_context(saved_cuda_device())
        stack.enter_context(dropped_compilations(keeps_compiled))
        yield


@contextmanager
def saved_environ() -> Iterator[None]:
    """os.environ as it was when the block began, once it ends: variables set in it removed, changed
    ones put back."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for name in [name for name in os.environ if name not in saved]:
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


def _fp32_precision_owners() -> list[Any]:
    owners = []
    for path in FP32_PRECISION_OWNERS:
        owner = operator.attrgetter(path)(torch.backends) if path else torch.backends
        if hasattr(owner, "fp32_precision"):
            owners.append(owner)
    return owners


@contextmanager
def saved_numerics() -> Iterator[None]:
    """TF32 (cuBLAS, cuDNN), cuDNN's benchmark mode and the float32 matmul precision as they were.
    Set back through the same calls pipeline.precision uses, then each fp32_precision that differs
    (torch refuses a read of allow_tf32 after a mix of the two APIs that disagree)."""
    b = torch.backends
    matmul_tf32, cudnn_tf32, benchmark = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark
    matmul_precision = torch.get_float32_matmul_precision()
    precisions = [(owner, owner.fp32_precision) for owner in _fp32_precision_owners()]
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, b.cudnn.benchmark = matmul_tf32, cudnn_tf32, benchmark
        for owner, value in precisions:
            if owner.fp32_precision != value:
                owner.fp32_precision = value


@contextmanager
def saved_config(config) -> Iterator[None]:
    """A torch config module (torch._dynamo.config, torch._inductor.config) as it was: every value
    that changed in the block set back (torch's own get_config_copy and load_config)."""
    saved = config.get_config_copy()
    try:
        yield
    finally:
        now = config.get_config_copy()
        config.load_config({key: value for key, value in saved.items() if now.get(key) != value})


@contextmanager
def saved_inductor_choices() -> Iterator[None]:
    """The object inductor asks, in this thread, how to generate kernels (torch._inductor's
    V.choices) as it was. Where it was never asked for (`torch._inductor.choices` not imported: a
    job that compiles nothing need not import it), one the block installs gives way to a default."""
    asked = CHOICES in sys.modules
    if asked:
        from torch._inductor.virtualized import V

        saved = V.choices
    try:
        yield
    finally:
        if asked or CHOICES in sys.modules:
            from torch._inductor import config
            from torch._inductor.choices import InductorChoices
            from torch._inductor.virtualized import V

            V.set_choices_handler(saved if asked else (config.inductor_choices_class or InductorChoices)())


@contextmanager
def saved_cuda_device() -> Iterator[None]:
    """The current CUDA device as it was (device 0 where CUDA was not yet initialised)."""
    before = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    try:
        yield
    finally:
        if torch.cuda.is_initialized() and torch.cuda.current_device() != before:
            torch.cuda.set_device(before)


@contextmanager
def dropped_compilations(keeps_compiled: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """dynamo's caches emptied at the end (`torch._dynamo.reset`) when the block compiled a graph,
    unless `keeps_compiled()`: the next job's models compile for themselves."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    try:
        yield
    finally:
        if counters["stats"]["unique_graphs"] != before and not keeps_compiled():
            torch._dynamo.reset()
