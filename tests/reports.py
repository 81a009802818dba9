"""Run reports with made-up values, built through the report types (for the readers' tests)."""

from __future__ import annotations

from collections import Counter

from bcg.metrics import EngineMetrics, EngineReport, GraphRecord
from pipeline.merge import merge_stats
from pipeline.report import GpuBusyReport, GpuMemory, ImageCounts, PartReport, PromptCacheCounts, RunReport, ShardInfo


def engine(pool_bytes: int = 3 * 2**20, capture_s: float = 0.75) -> EngineReport:
    """An engine with graphs on and one graph (none with pool_bytes=0: graphs off)."""
    metrics = EngineMetrics(active=pool_bytes > 0, reason="" if pool_bytes else "bcg.enabled=false",
                            pool_bytes=pool_bytes, hits=40 if pool_bytes else 0, eager_calls=0 if pool_bytes else 40)
    if pool_bytes:
        metrics.graphs["64x64-b4"] = GraphRecord([64, 64], 4, capture_s=capture_s, pool_bytes_added=pool_bytes, replays=40)
    return metrics.report()


def gpu_memory(index: int = 0) -> GpuMemory:
    """A shard's memory, its peak told apart by `index`; text encoders released."""
    return GpuMemory(model_gib=12.5, denoise_allocated_gib=3.25, denoise_reserved_gib=4.0,
                     peak_allocated_gib=13.0 + index, peak_reserved_gib=14.0 + index, text_encoders_resident=False)


def part(index: int = 0, count: int = 1, *, ok: int = 12, ladder: tuple[int, ...] = (1, 2, 4, 8),
         images_per_s: float | None = 31.5, pool_bytes: int = 3 * 2**20, started_at: float = 1000.0,
         wall_s: float = 4.25, generate_s: float = 2.5, gpu: bool = True) -> PartReport:
    return PartReport(
        images=ImageCounts(planned=ok, ok=ok, failed=0, skipped=0, invalid=0, generated=ok),
        oom_retries=0, batches=5, padded_rows=3, wall_s=wall_s, generate_s=generate_s, images_per_s=images_per_s,
        wall_images_per_s=round(ok / wall_s, 4),
        stage_s={"encode": 0.125, "noise": 0.01, "denoise": 1.75, "decode": 0.5},
        per_resolution={"64x64": ok}, batches_per_bucket={"1": 2, "4": 3}, ladder=list(ladder), scope="forward",
        sampler="DPMSolverMultistepScheduler", precision={"dtype": "bf16", "tf32": False, "cudnn_benchmark": False},
        device=f"cuda:{index}", model="tiny", prompt_cache=PromptCacheCounts(encoded=13, hits=11), writer_busy_s=0.5,
        gpu_busy=GpuBusyReport(fraction=0.93, between_batches=0.97, busy_s=2.325, device_span_s=2.4, generate_s=generate_s,
                               batches=5) if gpu else None,
        gpu_memory=gpu_memory(index) if gpu else None,
        kernels={"attention": "auto", "compile": False, "fp8": False}, ladder_auto=None, versions={"python": "3.11.7"},
        config={"bcg": {"ladder": list(ladder)}}, shard=ShardInfo(index=index, count=count), started_at=started_at,
        ended_at=started_at + wall_s, bcg=engine(pool_bytes),
    )


def run_report(**kwargs) -> RunReport:
    """stats.json of a one-process job whose rows are all committed (`part`'s arguments)."""
    one = part(**kwargs)
    return merge_stats([one], Counter(ok=one.images.ok))
