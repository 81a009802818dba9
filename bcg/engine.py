"""The BCG engine: one CUDA graph per (resolution, ladder bucket), captured at warm-up into one pool.

`fn` maps a dict of batch-first tensors to a batch-first output tensor (or a tuple of them) and must
be graph-safe: no
host syncs, no Python values that change between calls (they go in as tensors). `specs(key)` says
which inputs `fn` takes at a shape key (per-row shape, dtype, padding value). The engine owns the
static buffers, captures, replays, pads and counts. With graphs off (no CUDA, or `enabled=False`)
the very same `fn` runs eagerly on the same padded rows, so a batch's result does not depend on
whether graphs are on.
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from bcg.buckets import parse_ladder, pick_bucket
from bcg.buffers import InputSpec, StaticInputs, pad_rows
from bcg.memory import MIB, GraphNeed, check_pool_limit, predict_pool_bytes, predict_separate_pools_bytes
from bcg.metrics import EngineMetrics, GraphRecord, graph_name

log = logging.getLogger(__name__)

Output = torch.Tensor | tuple[torch.Tensor, ...]
StepFn = Callable[[dict[str, torch.Tensor]], Output]
# Everything that changes a shape or a captured constant: (height, width), plus the step count for
# a graph of the whole denoising loop.
ShapeKey = tuple[int, ...]
SpecFn = Callable[[ShapeKey], dict[str, InputSpec]]


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    output: Output  # lives in the shared pool; copied out after each replay


def rows_of(output: Output, n: int, copy: bool) -> Output:
    """The first n rows of every output tensor; copied when the storage will be overwritten."""
    if isinstance(output, torch.Tensor):
        return output[:n].clone() if copy else output[:n]
    return tuple(t[:n].clone() if copy else t[:n] for t in output)


def nbytes(output: Output) -> int:
    tensors = (output,) if isinstance(output, torch.Tensor) else output
    return sum(t.numel() * t.element_size() for t in tensors)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (0 while dynamo was never imported):
    a warm-up pass that leaves it unchanged compiled nothing."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def precision_flags() -> dict[str, bool]:
    return {
        "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


class BCGEngine:
    def __init__(
        self,
        fn: StepFn,
        specs: SpecFn,
        ladder: Sequence[int],
        device: torch.device,
        *,
        enabled: bool = True,
        warmup: int = 2,
        lazy: bool = False,
        pool_limit_gib: float | None = None,
        pool_margin: float = 1.3,
    ):
        self.fn = fn
        self.spec_fn = specs
        self.ladder = parse_ladder(ladder)
        self.device = torch.device(device)
        self.warmup = warmup
        self.lazy = lazy
        self.pool_limit_gib = pool_limit_gib
        self.pool_margin = pool_margin
        self.metrics = EngineMetrics()
        self._peaks_seen = (0, 0)  # (allocated, reserved) peaks before this engine reset CUDA's peak statistics
        self.specs: dict[ShapeKey, dict[str, InputSpec]] = {}
        self.static: dict[ShapeKey, StaticInputs] = {}
        self.graphs: dict[tuple[ShapeKey, int], Graph] = {}
        self._missed: set[tuple[ShapeKey, int]] = set()
        self._needs: dict[tuple[ShapeKey, int], GraphNeed] = {}
        self._warmups: dict[tuple[ShapeKey, int], tuple[float, int]] = {}  # its passes' seconds, their count
        self._force_eager = False
        self._flags: dict[str, bool] | None = None
        self.pool = None
        self._stream: torch.cuda.Stream | None = None  # the warm-up passes' side stream, one for all
        if not enabled:
            self._off("bcg.enabled=false")
        elif self.device.type != "cuda":
            self._off(f"device is {self.device.type}, CUDA graphs need a CUDA device")
        else:
            self.metrics.active = True

    def _off(self, reason: str) -> None:
        self.metrics.active, self.metrics.reason = False, reason
        log.info("BCG off (%s): the denoiser runs eagerly", reason)

    # ---- warm-up and capture -------------------------------------------------------------------

    def capture_all(self, keys: Iterable[ShapeKey], buckets: Mapping[ShapeKey, Iterable[int]] | None = None) -> None:
        """With graphs on: warm up, predict the shared pool (refusing to start above
        `pool_limit_gib`), then capture every (key, bucket), largest bucket first, into one pool.
        `buckets`: per key, the ladder buckets to capture (those a plan uses; a key it leaves out
        gets none); None: every bucket of the ladder."""
        keys = list(dict.fromkeys(keys))
        wanted = {key: set(self.ladder if buckets is None else buckets.get(key, ())) for key in keys}
        odd = sorted({b for chosen in wanted.values() for b in chosen} - set(self.ladder))
        if odd:
            raise ValueError(f"buckets {odd} are not in the ladder {list(self.ladder)}")
        shapes = [(key, b) for b in reversed(self.ladder) for key in keys if b in wanted[key]]
        if not self.metrics.active:
            return
        self._flags = precision_flags()
        for key in keys:
            self._allocate(key)
        start = time.perf_counter()
        needs = [self._measure(key, b) for key, b in shapes]
        self.metrics.warmup_s += time.perf_counter() - start
        predicted = predict_pool_bytes(needs, self.pool_margin)
        check_pool_limit(needs, predicted, self.pool_limit_gib, self.pool_margin)
        self.metrics.predicted_pool_bytes = predicted
        self.metrics.predicted_separate_pools_bytes = predict_separate_pools_bytes(needs, self.pool_margin)
        self._needs.update({(n.key, n.bucket): n for n in needs})
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(self.device)
        for key, b in shapes:
            self._capture(key, b)
        self.metrics.pool_bytes = torch.cuda.memory_reserved(self.device) - base
        log.info(
            "BCG: %d graphs captured in %.2f s; pool %.1f MiB (predicted %.1f MiB)",
            len(self.graphs), self.metrics.capture_s, self.metrics.pool_bytes / MIB, predicted / MIB,
        )

    def _allocate(self, key: ShapeKey) -> None:
        self.specs[key] = self.spec_fn(key)
        self.static[key] = StaticInputs.allocate(self.specs[key], self.ladder[-1], self.device)
        self.metrics.static_input_bytes = sum(s.nbytes for s in self.static.values())

    @torch.no_grad()
    def _measure(self, key: ShapeKey, bucket: int) -> GraphNeed:
        """Up to `warmup` eager passes on the engine's side stream, each from an empty cache, the
        last one's peak *reserved* growth being the graph's need: segments as the allocator rounds
        them, which is what a pool holds (or the allocated peak, when the pass fits in segments that
        were already reserved). The first pass at a shape does the lazy initialisation and any
        compiling; a pass that compiled nothing (a warm cache, a plan that compiles nothing) already
        measured what the next would, so the passes stop there (counted in `warmup_passes_skipped`)."""
        inputs = self.static[key].view(bucket)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        passes, began, ran = max(self.warmup, 1), time.perf_counter(), 0
        with torch.cuda.stream(stream):
            for i in range(passes):
                torch.cuda.synchronize(self.device)
                torch.cuda.empty_cache()
                self._peaks_seen = self.peak_memory()
                torch.cuda.reset_peak_memory_stats(self.device)
                reserved = torch.cuda.memory_reserved(self.device)
                allocated = torch.cuda.memory_allocated(self.device)
                compiled, start = compiled_graphs(), time.perf_counter()
                out = self.fn(inputs)
                torch.cuda.synchronize(self.device)
                if i == 0:  # the first pass at a shape: lazy init, autotuning, compilation
                    self.metrics.first_pass_s += time.perf_counter() - start
                peak = max(
                    torch.cuda.max_memory_reserved(self.device) - reserved,
                    torch.cuda.max_memory_allocated(self.device) - allocated,
                )
                self.metrics.warmup_passes += 1
                ran += 1
                if compiled_graphs() == compiled:
                    self.metrics.warmup_passes_skipped += passes - i - 1
                    break
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self._warmups[(key, bucket)] = (time.perf_counter() - began, ran)
        out_bytes = nbytes(out)
        return GraphNeed(key, bucket, peak_bytes=max(peak, out_bytes), output_bytes=out_bytes)

    def peak_memory(self) -> tuple[int, int]:
        """(allocated, reserved) peak bytes of the device so far, CUDA's own peak statistics taken
        with the peaks they held before this engine's measurements reset them (each pass's need is
        measured from a reset)."""
        if self.device.type != "cuda":
            return (0, 0)
        return (max(self._peaks_seen[0], torch.cuda.max_memory_allocated(self.device)),
                max(self._peaks_seen[1], torch.cuda.max_memory_reserved(self.device)))

    @torch.no_grad()
    def _capture(self, key: ShapeKey, bucket: int) -> None:
        name = graph_name(key, bucket)
        before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the writer thread may wait on events while a lazy capture runs here
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                output = self.fn(self.static[key].view(bucket))
        except torch.OutOfMemoryError:
            torch.cuda.synchronize(self.device)
            self.metrics.dropped.append(name)
            log.warning("BCG: out of memory capturing %s; that bucket runs eagerly (counted as misses)", name)
            return
        torch.cuda.synchronize(self.device)
        self.graphs[(key, bucket)] = Graph(graph, output)
        need = self._needs.get((key, bucket))
        warmup_s, passes = self._warmups.get((key, bucket), (0.0, 0))
        self.metrics.graphs[name] = GraphRecord(
            list(key), bucket,
            capture_s=time.perf_counter() - start,
            pool_bytes_added=torch.cuda.memory_reserved(self.device) - before,
            eager_peak_bytes=need.peak_bytes if need else 0,
            warmup_s=round(warmup_s, 4), warmup_passes=passes,
        )

    def need(self, key: ShapeKey, bucket: int) -> GraphNeed | None:
        """The memory need measured before capturing (key, bucket); None when not measured."""
        return self._needs.get((key, bucket))

    # ---- replay ----------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, key: ShapeKey, inputs: dict[str, torch.Tensor], n: int) -> Output:
        """n real rows of `inputs` (each [n, ...]) -> fn's output for those rows ([n, ...] each),
        tensors the caller owns. The rows run at the smallest ladder bucket >= n, padded with fixed values."""
        bucket = pick_bucket(self.ladder, n)
        self.metrics.padded_rows += bucket - n
        graph = None if self._force_eager else self.graphs.get((key, bucket))
        if graph is None and self.metrics.active and self.lazy and not self._force_eager:
            self._capture_late(key, bucket)
            graph = self.graphs.get((key, bucket))
        if graph is None:
            return self._run_eager(key, inputs, n, bucket)
        if precision_flags() != self._flags:
            raise RuntimeError(
                f"precision flags changed since capture: captured with {self._flags}, now {precision_flags()}; "
                "set them once (precision config) before the engine captures"
            )
        self.static[key].load(inputs, n, bucket)
        graph.graph.replay()
        self.metrics.hits += 1
        self.metrics.graphs[graph_name(key, bucket)].replays += 1
        return rows_of(graph.output, n, copy=True)

    def _capture_late(self, key: ShapeKey, bucket: int) -> None:
        """`lazy=True` only: a (key, bucket) first seen during the run is warmed up and captured now."""
        if self._flags is None:
            self._flags = precision_flags()
        if key not in self.static:
            self._allocate(key)
        start = time.perf_counter()
        self._needs[(key, bucket)] = self._measure(key, bucket)
        self.metrics.warmup_s += time.perf_counter() - start
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_reserved(self.device)
        self._capture(key, bucket)
        self.metrics.pool_bytes += torch.cuda.memory_reserved(self.device) - before
        log.info("BCG: captured %s during the run (bcg.lazy=true)", graph_name(key, bucket))

    @contextmanager
    def eager(self):
        """Inside, every call runs eagerly (graphs stay captured): the last resort of a retry after
        an out-of-memory error. Counted in `eager_calls`, not as misses."""
        self._force_eager = True
        try:
            yield
        finally:
            self._force_eager = False

    def _run_eager(self, key: ShapeKey, inputs: dict[str, torch.Tensor], n: int, bucket: int) -> Output:
        if key not in self.specs:
            self.specs[key] = self.spec_fn(key)
        self.metrics.eager_calls += 1
        if self.metrics.active and not self._force_eager:
            self.metrics.misses += 1
            if (key, bucket) not in self._missed:
                self._missed.add((key, bucket))
                log.warning("BCG: no graph for %s; running it eagerly (counted as a miss)", graph_name(key, bucket))
        return rows_of(self.fn(pad_rows(self.specs[key], inputs, n, bucket)), n, copy=False)

    def __enter__(self) -> "BCGEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release graphs, static buffers and the pool before the process exits."""
        self.graphs.clear()
        self.static.clear()
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
