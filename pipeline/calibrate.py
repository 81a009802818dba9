"""`bcg.ladder=auto`: a short calibration at warm-up, then the ladder with the least predicted job time.

Every (resolution of the plan, batch size in `bcg.auto_sizes`) gets one CFG forward graph (eager on
the CPU) in a throwaway engine, replayed a few times on the device's own clock; its measured memory
need goes into the same pool prediction the real engine uses. `bcg.autoladder.choose_ladder` does
the rest. The choice is saved under output.dir, so a resumed job plans exactly as the first run did.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from bcg.autoladder import LadderChoice, Measurement, choose_ladder, describe
from bcg.buffers import StaticInputs
from bcg.engine import BCGEngine
from bcg.memory import GIB, GraphNeed
from pipeline.fsutil import atomic_write_text

log = logging.getLogger(__name__)

AUTO = "auto"
SAVED = "ladder.json"
REPLAYS = 3


def saved_ladder(out_dir: Path) -> list[int] | None:
    """The ladder an earlier run of this job chose, if any."""
    path = Path(out_dir) / SAVED
    if not path.exists():
        return None
    return list(json.loads(path.read_text())["ladder"])


def save_choice(out_dir: Path, choice: LadderChoice, report: dict) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(out_dir) / SAVED, json.dumps({"ladder": list(choice.ladder), **report}, indent=2))


def measure(fn, spec_fn, resolutions: list[tuple[int, int]], sizes: list[int], device: torch.device,
            warmup: int, graphs: bool) -> list[Measurement]:
    """Seconds per CFG forward and memory need at every (resolution, size)."""
    engine = BCGEngine(fn, spec_fn, sizes, device, enabled=graphs, warmup=warmup)
    try:
        engine.capture_all(resolutions)
        out = []
        for h, w in resolutions:
            specs = spec_fn((h, w))
            for b in engine.ladder:
                inputs = StaticInputs.allocate(specs, b, device).view(b)
                engine.run((h, w), inputs, b)  # one untimed call (eager: the warm-up)
                step_s = _timed(lambda: engine.run((h, w), inputs, b), device)
                need = engine.need((h, w), b) or GraphNeed((h, w), b, 0, 0)
                out.append(Measurement(h, w, b, step_s, need))
        return out
    finally:
        engine.close()


def _timed(call, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / REPLAYS
    start = time.perf_counter()
    for _ in range(REPLAYS):
        call()
    return (time.perf_counter() - start) / REPLAYS


def auto_ladder(fn, spec_fn, counts: dict[tuple[int, int], int], sizes: list[int], steps: int, device: torch.device,
                warmup: int, graphs: bool, pool_limit_gib: float | None, margin: float) -> tuple[LadderChoice, dict]:
    """Calibrate, choose, log the choice and its prediction; -> (choice, report for stats.json)."""
    start = time.perf_counter()
    measurements = measure(fn, spec_fn, sorted(counts), sizes, device, warmup, graphs)
    calibration_s = time.perf_counter() - start
    limit = None if pool_limit_gib is None else int(pool_limit_gib * GIB)
    choice = choose_ladder(counts, measurements, steps, limit, margin)
    log.info("%s\n(calibration: %d shapes in %.1f s)", describe(choice), len(measurements), calibration_s)
    report = {
        "chosen": list(choice.ladder),
        "predicted_denoise_s": round(choice.predicted_s, 4),
        "predicted_pool_mib": round(choice.pool_bytes / 2**20, 1),
        "calibration_s": round(calibration_s, 3),
        "sizes": list(sizes),
        "step_s": {f"{m.height}x{m.width}-b{m.bucket}": round(m.step_s, 6) for m in measurements},
        "options": [
            {"ladder": list(o.ladder), "predicted_s": round(o.predicted_s, 4), "pool_mib": round(o.pool_bytes / 2**20, 1),
             "padded_rows": o.padded_rows, "fits": o.fits}
            for o in choice.options[:8]
        ],
    }
    return choice, report
