"""The BCG engine: one CUDA graph per (resolution, ladder bucket), captured at warm-up into one pool.

`fn` maps a dict of batch-first tensors to one batch-first output tensor and must be graph-safe: no
host syncs, no Python values that change between calls (they go in as tensors). The engine owns the
static buffers, captures, replays, pads and counts. With graphs off (no CUDA, or `enabled=False`)
the very same `fn` runs eagerly on the same padded rows, so a batch's result does not depend on
whether graphs are on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from bcg.buckets import parse_ladder, pick_bucket
from bcg.buffers import InputSpec, StaticInputs, pad_rows
from bcg.memory import GraphNeed, check_pool_limit, predict_pool_bytes
from bcg.metrics import EngineMetrics, GraphRecord, graph_name

log = logging.getLogger(__name__)

StepFn = Callable[[dict[str, torch.Tensor]], torch.Tensor]
ShapeKey = tuple[int, int]  # (height, width)


@dataclass
class Graph:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor  # lives in the shared pool; copied out after each replay


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
        ladder: Sequence[int],
        device: torch.device,
        *,
        enabled: bool = True,
        warmup: int = 3,
        lazy: bool = False,
        pool_limit_gib: float | None = None,
        pool_margin: float = 1.3,
    ):
        self.fn = fn
        self.ladder = parse_ladder(ladder)
        self.device = torch.device(device)
        self.warmup = warmup
        self.lazy = lazy
        self.pool_limit_gib = pool_limit_gib
        self.pool_margin = pool_margin
        self.metrics = EngineMetrics()
        self.specs: dict[ShapeKey, dict[str, InputSpec]] = {}
        self.static: dict[ShapeKey, StaticInputs] = {}
        self.graphs: dict[tuple[ShapeKey, int], Graph] = {}
        self._missed: set[tuple[ShapeKey, int]] = set()
        self._flags: dict[str, bool] | None = None
        self.pool = None
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

    def capture_all(self, shapes: Mapping[ShapeKey, dict[str, InputSpec]]) -> None:
        """Register every resolution's inputs; with graphs on, predict the pool, then capture every
        (resolution, bucket), largest bucket first, into one shared pool."""
        self.specs.update(shapes)
        if not self.metrics.active:
            return
        self._flags = precision_flags()
        for key in shapes:
            self.static[key] = StaticInputs.allocate(shapes[key], self.ladder[-1], self.device)
        self.metrics.static_input_bytes = sum(s.nbytes for s in self.static.values())
        needs = [self._measure(key, b) for b in reversed(self.ladder) for key in shapes]
        predicted = predict_pool_bytes(needs, self.pool_margin)
        check_pool_limit(needs, predicted, self.pool_limit_gib, self.pool_margin)
        self.metrics.predicted_pool_bytes = predicted
        self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved(self.device)
        for b in reversed(self.ladder):
            for key in shapes:
                self._capture(key, b)
        self.metrics.pool_bytes = torch.cuda.memory_reserved(self.device) - base
        log.info(
            "BCG: %d graphs captured in %.2f s; pool %.1f MiB (predicted %.1f MiB)",
            len(self.graphs), self.metrics.capture_s, self.metrics.pool_bytes / 2**20, predicted / 2**20,
        )

    @torch.no_grad()
    def _measure(self, key: ShapeKey, bucket: int) -> GraphNeed:
        """Eager passes on a side stream: warm-up (lazy init, autotuning) and the peak transient memory."""
        inputs = self.static[key].view(bucket)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(max(self.warmup - 1, 0)):
                self.fn(inputs)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            out = self.fn(inputs)
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return GraphNeed(key, bucket, peak_bytes=peak, output_bytes=out.numel() * out.element_size())

    @torch.no_grad()
    def _capture(self, key: ShapeKey, bucket: int) -> None:
        name = graph_name(key, bucket)
        before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.fn(self.static[key].view(bucket))
        except torch.OutOfMemoryError:
            del graph
            torch.cuda.synchronize(self.device)
            self.metrics.dropped.append(name)
            log.warning("BCG: out of memory capturing %s; that bucket runs eagerly (counted as misses)", name)
            return
        torch.cuda.synchronize(self.device)
        self.graphs[(key, bucket)] = Graph(graph, output)
        self.metrics.graphs[name] = GraphRecord(
            key[0], key[1], bucket,
            capture_s=time.perf_counter() - start,
            pool_bytes_added=torch.cuda.memory_reserved(self.device) - before,
        )

    # ---- replay ----------------------------------------------------------------------------------

    @torch.no_grad()
    def run(self, key: ShapeKey, inputs: dict[str, torch.Tensor], n: int) -> torch.Tensor:
        """n real rows of `inputs` (each [n, ...]) -> fn's output for those rows, [n, ...], a tensor
        the caller owns. The rows run at the smallest ladder bucket >= n, padded with fixed values."""
        if key not in self.specs:
            raise KeyError(f"resolution {key} was not registered with capture_all (registered: {sorted(self.specs)})")
        bucket = pick_bucket(self.ladder, n)
        self.metrics.padded_rows += bucket - n
        graph = self.graphs.get((key, bucket))
        if graph is None and self.metrics.active and self.lazy:
            self._capture(key, bucket)
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
        return graph.output[:n].clone()

    def _run_eager(self, key: ShapeKey, inputs: dict[str, torch.Tensor], n: int, bucket: int) -> torch.Tensor:
        self.metrics.eager_calls += 1
        if self.metrics.active:
            self.metrics.misses += 1
            if (key, bucket) not in self._missed:
                self._missed.add((key, bucket))
                log.warning("BCG: no graph for %s; running it eagerly (counted as a miss)", graph_name(key, bucket))
        return self.fn(pad_rows(self.specs[key], inputs, n, bucket))[:n]

    def close(self) -> None:
        """Release graphs, static buffers and the pool before the process exits."""
        self.graphs.clear()
        self.static.clear()
        self.pool = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
