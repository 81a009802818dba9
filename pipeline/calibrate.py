"""`bcg.ladder=auto`: a short calibration at warm-up, then the ladder with the least predicted job time.

Every (resolution of the manifest, batch size in `bcg.auto_sizes`) gets one graph of one denoising
step in the job's scope (`Denoiser.one_step`: the CFG forward in `forward`, forward + sampler
update in `step` and `loop`; eager on the CPU), replayed a few times on the device's own clock; its measured memory need goes into the
same pool prediction the real engine uses. A size that does not fit (out of memory, or over
`bcg.pool_limit_gib` alone) is dropped, said once and listed. `bcg.autoladder.choose_ladder` does
the rest, and the job plans with the measured step times as its costs, so the plan it runs is the
plan that was predicted. The choice is saved under output.dir with a fingerprint of what it was
chosen for, so a resumed job plans exactly as the first run did.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bcg.autoladder import LadderChoice, Measurement, choose_ladder, describe
from bcg.buffers import StaticInputs
from bcg.engine import BCGEngine
from bcg.errors import BCGConfigError
from bcg.memory import GIB, GraphNeed, mib
from pipeline.errors import UserError
from pipeline.fsutil import atomic_write_text
from pipeline.planner import size_label

log = logging.getLogger(__name__)

AUTO = "auto"
SAVED = "ladder.json"
VERSION = 2  # ladder.json's: 2 names resolutions width x height
REPLAYS = 3

Costs = dict[tuple[int, int], dict[int, float]]


@dataclass(frozen=True)
class SavedChoice:
    ladder: list[int]
    costs: Costs  # measured seconds per step, per resolution and bucket: the planner's costs


def fingerprint(counts: dict[tuple[int, int], int], sizes, pool_limit_gib, pool_margin: float, graphs: bool,
                settings: str) -> str:
    """What a choice depends on: rows per resolution, the calibrated sizes, the pool limit and
    margin, whether graphs were on, and every setting an image (and a step's time) depends on."""
    # "HxW": the text earlier versions hashed, so that their saved choices stay valid
    what = {"counts": {"{}x{}".format(*res): n for res, n in sorted(counts.items())}, "sizes": list(sizes),
            "pool_limit_gib": pool_limit_gib, "pool_margin": pool_margin, "graphs": graphs, "settings": settings}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def load_choice(out_dir: Path, expected: str) -> SavedChoice | None:
    """The choice an earlier run of this job saved; None when there is none, or when it was made
    for something else (then the job calibrates again, and says why)."""
    path = Path(out_dir) / SAVED
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
        ladder, found = [int(b) for b in raw["ladder"]], raw["fingerprint"]
        width_first = raw.get("version") == VERSION
        costs = {_res(k, width_first): {int(b): float(s) for b, s in table.items()} for k, table in raw["costs"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not a ladder choice this version wrote ({err!r}); delete it to calibrate again") from err
    if found != expected:
        log.warning("bcg.ladder=auto: %s was chosen for another manifest, auto_sizes, pool limit or settings; "
                    "calibrating again", path)
        return None
    return SavedChoice(ladder, costs)


def save_choice(out_dir: Path, costs: Costs, print_: str, report: dict) -> None:
    """`report` (auto_ladder's) holds the chosen ladder; saved with the costs and the fingerprint."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    body = {"version": VERSION, "ladder": report["chosen"], "fingerprint": print_,
            "costs": {size_label(*res): {str(b): s for b, s in t.items()} for res, t in costs.items()}, **report}
    atomic_write_text(Path(out_dir) / SAVED, json.dumps(body, indent=2))


def _res(key: str, width_first: bool) -> tuple[int, int]:
    """ladder.json's key of a resolution -> (height, width): "WxH" (size_label) since VERSION, "HxW" before."""
    first, second = (int(side) for side in key.split("x"))
    return (second, first) if width_first else (first, second)


def measure(fn, spec_fn, resolutions: list[tuple[int, int]], sizes: list[int], device: torch.device, warmup: int,
            graphs: bool, pool_limit_gib: float | None) -> tuple[list[Measurement], dict[int, str]]:
    """Seconds per step and memory need at every (resolution, size); -> (measurements,
    {size: why it was dropped})."""
    out, dropped = [], {}
    for b in sizes:
        engine = BCGEngine(fn, spec_fn, [b], device, enabled=graphs, warmup=warmup, pool_limit_gib=pool_limit_gib)
        try:
            engine.capture_all(resolutions)
            if engine.metrics.dropped:
                raise torch.OutOfMemoryError(f"capture of {engine.metrics.dropped}")
            for h, w in resolutions:
                inputs = StaticInputs.allocate(spec_fn((h, w)), b, device).view(b)
                engine.run((h, w), inputs, b)  # one untimed call (eager: the warm-up)
                step_s = _timed(lambda: engine.run((h, w), inputs, b), device)
                out.append(Measurement(h, w, b, step_s, engine.need((h, w), b) or GraphNeed((h, w), b, 0, 0)))
        except (torch.OutOfMemoryError, BCGConfigError) as err:
            dropped[b] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            out = [m for m in out if m.bucket != b]
            log.warning("bcg.ladder=auto: batch size %d dropped from the calibration (%s)", b, dropped[b])
        finally:
            engine.close()
    return out, dropped


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
                warmup: int, graphs: bool, pool_limit_gib: float | None, margin: float) -> tuple[LadderChoice, Costs, dict]:
    """Calibrate, choose, log the choice and its prediction; -> (choice, the planner's costs, report)."""
    start = time.perf_counter()
    measurements, dropped = measure(fn, spec_fn, sorted(counts), sizes, device, warmup, graphs, pool_limit_gib)
    calibration_s = time.perf_counter() - start
    if not measurements:
        raise UserError(f"bcg.ladder=auto: no batch size of bcg.auto_sizes={list(sizes)} fits: {dropped}")
    limit = None if pool_limit_gib is None else int(pool_limit_gib * GIB)
    choice = choose_ladder(counts, measurements, steps, limit, margin)
    log.info("%s\n(calibration: %d shapes in %.1f s)", describe(choice), len(measurements), calibration_s)
    costs: Costs = {}
    for m in measurements:
        costs.setdefault((m.height, m.width), {})[m.bucket] = m.step_s
    report = {
        "chosen": list(choice.ladder),
        "predicted_denoise_s": round(choice.predicted_s, 4),
        "predicted_pool_mib": mib(choice.pool_bytes),
        "calibration_s": round(calibration_s, 3),
        "sizes": list(sizes),
        "dropped_sizes": {str(b): why for b, why in dropped.items()},
        "step_s": {f"{size_label(m.height, m.width)}-b{m.bucket}": round(m.step_s, 6) for m in measurements},
        "options": [
            {"ladder": list(o.ladder), "predicted_s": round(o.predicted_s, 4), "pool_mib": mib(o.pool_bytes),
             "batches": o.batches, "padded_rows": o.padded_rows, "fits": o.fits}
            for o in choice.options[:8]
        ],
    }
    return choice, costs, report
