"""Bucket arithmetic: the ladder, the bucket for a batch, and how a group of items splits into batches.

Pure Python, no torch: the engine picks a bucket with `pick_bucket`, the planner splits groups with
`split_sizes`, and both use the one remainder rule in `cover_remainder`.

Costs are in any unit that adds up over batches (rows of work, or measured seconds); a cost table
maps every ladder bucket to the predicted cost of one batch run at that bucket.
"""

from __future__ import annotations

import math
import numbers
from bisect import bisect_left
from fractions import Fraction
from typing import Iterable, Mapping, Sequence

from bcg.errors import BCGConfigError


def parse_ladder(values: Iterable[int]) -> tuple[int, ...]:
    """Return the ladder as sorted, unique buckets; `ValueError` naming the value that is not a bucket."""
    try:
        given = list(values)
    except TypeError:
        raise BCGConfigError(
            f"bcg.ladder={values!r} is not accepted: give a list of integers >= 1, e.g. [1, 2, 4, 8]"
        ) from None
    if not given:
        raise BCGConfigError("bcg.ladder=[] is not accepted: give at least one bucket, e.g. [1, 2, 4, 8]")
    for v in given:
        # bool is an int to Python but never a batch size; numpy integers are fine.
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise BCGConfigError(
                f"bcg.ladder={given!r} is not accepted: {v!r} is not a bucket; "
                "buckets must be integers >= 1"
            )
    return tuple(sorted({int(v) for v in given}))


def pick_bucket(ladder: Sequence[int], n: int) -> int:
    """Smallest bucket that holds `n` rows."""
    ladder = parse_ladder(ladder)
    if n < 1 or n > ladder[-1]:
        raise BCGConfigError(
            f"batch of n={n} rows has no bucket: n must be in 1..{ladder[-1]} "
            f"(the largest bucket of ladder {list(ladder)})"
        )
    return ladder[bisect_left(ladder, n)]


def linear_costs(ladder: Sequence[int], overhead_rows: float) -> dict[int, float]:
    """Default cost model: a batch at bucket b costs `overhead_rows + b`, in units of one row's time.

    `overhead_rows` is what a batch costs beyond its rows (launches, host work); padded rows cost
    as much as real ones.
    """
    if not _is_cost(overhead_rows):
        raise BCGConfigError(
            f"bcg.batch_overhead_rows={overhead_rows!r} is not accepted: give a finite number >= 0"
        )
    return {b: float(overhead_rows) + b for b in parse_ladder(ladder)}


def cover_remainder(n: int, ladder: Sequence[int], costs: Mapping[int, float]) -> tuple[int, ...]:
    """Buckets, largest first, that together hold `n` items at the least predicted cost.

    Rule: among the multisets of ladder buckets where every bucket but the last (smallest) is
    filled completely and the last holds the leftover (1..bucket rows; padding = bucket - leftover),
    choose the one whose total cost `sum(costs[b])` is least. Ties go to fewer padded rows, then to
    fewer batches, then to larger buckets first (the descending tuple compared from the front).
    So padding appears only where one larger bucket is predicted cheaper than several smaller ones.

    Dynamic programming over k = 0..n: best[k] = min over b of costs[b] + best[max(0, k - b)].
    Costs are summed as exact fractions, so ties are ties and the choice never depends on
    floating-point rounding. `n` is normally below the largest bucket, but any `n >= 0` works.
    """
    ladder = parse_ladder(ladder)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise BCGConfigError(f"n={n!r} items cannot be covered: n must be an integer >= 0")
    exact = {b: _exact(c) for b, c in _checked_costs(ladder, costs).items()}

    # best[k]: (cost, padded rows, batches) of the best cover of k items; compared as tuples.
    best: list[tuple[Fraction, int, int]] = [(Fraction(0), 0, 0)]
    for k in range(1, n + 1):
        best.append(min(_extend(best, exact, k, b) for b in ladder))

    # Walk back taking the largest bucket that reaches best[k]: the largest bucket of any best
    # cover comes first, and what is left of k is itself covered best (largest first again).
    chosen: list[int] = []
    k = n
    while k > 0:
        b = next(b for b in reversed(ladder) if _extend(best, exact, k, b) == best[k])
        chosen.append(b)
        k = max(0, k - b)
    assert chosen == sorted(chosen, reverse=True), chosen
    return tuple(chosen)


def split_sizes(n: int, ladder: Sequence[int], costs: Mapping[int, float]) -> list[tuple[int, int]]:
    """Whole plan for a group of `n` items: `(bucket, real_rows)` per batch, in order.

    Full batches of the largest bucket first, then `cover_remainder(n % largest)`; within the
    remainder every batch is full except the last, which holds the leftover.
    """
    ladder = parse_ladder(ladder)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise BCGConfigError(f"group of n={n!r} items cannot be split: n must be an integer >= 0")
    top = ladder[-1]
    plan = [(top, top)] * (n // top)
    left = n % top
    for b in cover_remainder(left, ladder, costs):
        rows = min(b, left)
        plan.append((b, rows))
        left -= rows
    assert left == 0 and all(1 <= rows <= b for b, rows in plan), plan
    return plan


def _extend(
    best: list[tuple[Fraction, int, int]], costs: Mapping[int, Fraction], k: int, b: int
) -> tuple[Fraction, int, int]:
    """Key of covering k items with one batch at bucket b plus the best cover of what is left."""
    if b >= k:  # b is the last batch: it holds all k, the rest is padding
        return (costs[b], b - k, 1)
    cost, padded, batches = best[k - b]
    return (costs[b] + cost, padded, batches + 1)


def _checked_costs(ladder: tuple[int, ...], costs: Mapping[int, float]) -> dict[int, float]:
    out = {}
    for b in ladder:
        if b not in costs:
            raise BCGConfigError(
                f"costs have no entry for bucket {b} (ladder {list(ladder)}, costs for "
                f"{sorted(costs)}): give a cost for every bucket"
            )
        if not _is_cost(costs[b]):
            raise BCGConfigError(f"cost {costs[b]!r} of bucket {b} is not accepted: give a finite number >= 0")
        out[b] = costs[b]
    return out


def _exact(x: float) -> Fraction:
    # Fraction of the float's exact binary value; rationals (ints included) stay exact.
    return Fraction(x) if isinstance(x, numbers.Rational) else Fraction(float(x))


def _is_cost(x: object) -> bool:
    return (
        isinstance(x, numbers.Real)
        and not isinstance(x, bool)
        and math.isfinite(x)
        and x >= 0
    )
