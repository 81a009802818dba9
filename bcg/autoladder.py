"""Choose the bucket ladder from calibration: least predicted job time under the graph-pool limit.

Pure Python, no torch. Every non-empty subset of the calibrated batch sizes is a candidate; a
candidate's time is what `pipeline.planner.make_plan(costs=measured step times)` would plan (the
same `split_sizes` rule), and its pool is `predict_pool_bytes` over every (resolution, bucket).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from itertools import combinations
from typing import Mapping, Sequence

from bcg.buckets import parse_ladder, split_sizes
from bcg.errors import BCGConfigError
from bcg.memory import GIB, GraphNeed, predict_pool_bytes

MAX_SIZES = 8  # 2**8 - 1 = 255 candidate ladders
TIE_REL = 1e-9  # predicted times this close (relative) are a tie


class NoLadderFits(BCGConfigError):
    """Every candidate ladder's predicted pool exceeds the pool limit."""


@dataclass(frozen=True)
class Measurement:
    height: int
    width: int
    bucket: int
    step_s: float  # seconds of one denoising step (one CFG forward) at this batch size
    need: GraphNeed  # the graph's memory need at this (key, bucket)


@dataclass(frozen=True)
class LadderOption:
    ladder: tuple[int, ...]
    predicted_s: float  # steps * sum of step_s over the planned batches
    pool_bytes: int
    batches: int
    padded_rows: int
    fits: bool  # pool_bytes <= limit (True when no limit)


@dataclass(frozen=True)
class LadderChoice:
    ladder: tuple[int, ...]
    predicted_s: float
    pool_bytes: int
    options: tuple[LadderOption, ...]  # every candidate, best first (fitting ones before the rest)


def candidate_ladders(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every non-empty subset of `sizes`, each ascending; fewer buckets first, then lexicographic."""
    sizes = parse_ladder(sizes)
    if len(sizes) > MAX_SIZES:
        raise BCGConfigError(
            f"{len(sizes)} calibrated batch sizes {list(sizes)} give {2 ** len(sizes) - 1} candidate "
            f"ladders: calibrate at most {MAX_SIZES} sizes"
        )
    return [c for r in range(1, len(sizes) + 1) for c in combinations(sizes, r)]


def choose_ladder(
    counts: Mapping[tuple[int, int], int],
    measurements: Sequence[Measurement],
    steps: int,
    pool_limit_bytes: int | None,
    margin: float,
) -> LadderChoice:
    """Best ladder: least predicted_s (ties within TIE_REL), then smaller pool, fewer buckets, smaller
    ladder. Resolutions with 0 rows need no graphs; measurements at resolutions not in `counts` are unused."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise BCGConfigError(f"steps={steps!r} is not accepted: give an integer >= 1")
    if not (isinstance(margin, numbers.Real) and math.isfinite(margin) and margin > 0):
        raise BCGConfigError(f"margin={margin!r} is not accepted: give a finite number > 0")
    table = _measurement_table(measurements)
    res = sorted(r for r, n in counts.items() if _rows(r, n) > 0)
    sizes = sorted({b for _, _, b in table})
    for (h, w), b in ((r, b) for r in res for b in sizes):
        if (h, w, b) not in table:
            raise BCGConfigError(
                f"no measurement for (height, width, bucket)=({h}, {w}, {b}): calibrate every "
                f"resolution in the manifest at every batch size ({sizes})"
            )
    options = [_evaluate(L, counts, res, table, steps, pool_limit_bytes, margin) for L in candidate_ladders(sizes)]
    ranked = _rank([o for o in options if o.fits]) + _rank([o for o in options if not o.fits])
    best = ranked[0]
    if not best.fits:
        least = min(options, key=lambda o: (o.pool_bytes, o.ladder))
        raise NoLadderFits(
            f"no ladder fits bcg.pool_limit_gib={pool_limit_bytes / GIB:.2f} GiB: the smallest predicted pool "
            f"is {least.pool_bytes / GIB:.2f} GiB (ladder {list(least.ladder)}). Raise bcg.pool_limit_gib "
            "or calibrate smaller batch sizes"
        )
    return LadderChoice(best.ladder, best.predicted_s, best.pool_bytes, tuple(ranked))


def describe(choice: LadderChoice, top: int = 5) -> str:
    """Log lines: the chosen ladder, its predicted time and pool, then up to `top - 1` runner-ups."""
    def line(o: LadderOption) -> str:
        over = "" if o.fits else ", over the pool limit"
        return (f"ladder {list(o.ladder)}: {o.predicted_s:.1f} s, pool {o.pool_bytes / GIB:.2f} GiB, "
                f"{o.batches} batches, {o.padded_rows} padded rows{over}")

    head, *rest = choice.options
    lines = [f"autoladder chose {line(head)} ({len(choice.options)} ladders evaluated)"]
    for o in rest[: max(0, top - 1)]:
        slower = (o.predicted_s / head.predicted_s - 1) * 100 if head.predicted_s > 0 else 0.0
        lines.append(f"  runner-up ({slower:+.1f}%) {line(o)}")
    return "\n".join(lines)


def _measurement_table(measurements: Sequence[Measurement]) -> dict[tuple[int, int, int], Measurement]:
    table: dict[tuple[int, int, int], Measurement] = {}
    for m in measurements:
        at = (m.height, m.width, m.bucket)
        if at in table:
            raise BCGConfigError(f"two measurements for (height, width, bucket)={at}: give one each")
        ok = isinstance(m.step_s, numbers.Real) and not isinstance(m.step_s, bool)
        if not (ok and math.isfinite(m.step_s) and m.step_s > 0):
            raise BCGConfigError(f"step_s={m.step_s!r} at (height, width, bucket)={at} is not accepted: "
                                 "give seconds > 0")
        if m.need.bucket != m.bucket:
            raise BCGConfigError(f"measurement at (height, width, bucket)={at} carries the need of "
                                 f"bucket {m.need.bucket}")
        table[at] = m
    if not table:
        raise BCGConfigError("no measurements: calibrate at least one batch size per resolution")
    parse_ladder(b for _, _, b in table)  # every measured bucket must be a valid bucket
    return table


def _rows(res: tuple[int, int], n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise BCGConfigError(f"count {n!r} for resolution {res[0]}x{res[1]} is not accepted: give an integer >= 0")
    return n


def _evaluate(ladder, counts, res, table, steps, limit, margin) -> LadderOption:
    step_s, batches, padded = [], 0, 0
    for h, w in res:
        costs = {b: table[(h, w, b)].step_s for b in ladder}
        split = split_sizes(counts[(h, w)], ladder, costs)
        step_s += [costs[b] for b, _ in split]
        batches += len(split)
        padded += sum(b - rows for b, rows in split)
    pool = predict_pool_bytes([table[(h, w, b)].need for h, w in res for b in ladder], margin)
    fits = limit is None or pool <= limit
    return LadderOption(ladder, steps * math.fsum(step_s), pool, batches, padded, fits)


def _rank(options: list[LadderOption]) -> list[LadderOption]:
    """Best first. Times are grouped into ties from the fastest up (each group spans TIE_REL of its
    first time), so the order is a strict one; within a group: smaller pool, fewer buckets, ladder."""
    by_time = sorted(options, key=lambda o: (o.predicted_s, o.pool_bytes, len(o.ladder), o.ladder))
    ranked: list[LadderOption] = []
    while by_time:
        edge = by_time[0].predicted_s * (1 + TIE_REL)
        group = [o for o in by_time if o.predicted_s <= edge]
        by_time = by_time[len(group):]
        ranked += sorted(group, key=lambda o: (o.pool_bytes, len(o.ladder), o.ladder))
    return ranked
