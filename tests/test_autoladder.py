"""Autoladder: the ladder with the least predicted job time that fits the graph pool."""

from __future__ import annotations

import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcg.autoladder import (
    LadderChoice,
    Measurement,
    NoLadderFits,
    candidate_ladders,
    choose_ladder,
    describe,
)
from bcg.memory import GIB, GraphNeed
from pipeline.manifest import Item
from pipeline.planner import make_plan

POW2_8 = (1, 2, 4, 8)
STEPS = 30
MARGIN = 1.3
MIB = 2**20


def need(h: int, w: int, b: int) -> GraphNeed:
    """Transient memory grows with rows and pixels, so bigger buckets need bigger pools."""
    rows_px = b * h * w / 512**2
    return GraphNeed((h, w), b, peak_bytes=int(rows_px * GIB) + 64 * MIB, output_bytes=int(rows_px * 16 * MIB))


def calibrate(resolutions, sizes, step) -> list[Measurement]:
    """One measurement per (resolution, size), step time from `step(h, w, b)`."""
    return [Measurement(h, w, b, step(h, w, b), need(h, w, b)) for h, w in resolutions for b in sizes]


def overhead_step(h: int, w: int, b: int) -> float:
    # Launch-bound: 0.1 s per batch beyond 0.01 s per row, scaled by pixels.
    return h * w / 512**2 * (0.1 + 0.01 * b)


def item(row: int, height: int, width: int) -> Item:
    return Item(id=f"img-{row:05d}", prompt=f"p {row}", negative_prompt=None, width=width, height=height,
                seed=row, row=row, extra={})


def items_for(counts) -> list[Item]:
    res = [r for r, n in sorted(counts.items()) for _ in range(n)]
    return [item(i, h, w) for i, (h, w) in enumerate(res)]


COUNTS = {(512, 512): 17, (256, 256): 5}


# --- choices a user would notice --------------------------------------------------------------


def test_per_batch_overhead_picks_the_largest_bucket_and_one():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    choice = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    # 17 = 8 + 8 + 1: three batches, none padded, is the least any cover of 17 rows can cost.
    # 5 rows at 256 px: one padded 8 (0.1 + 0.08) beats 4 + 1 (0.2 + 0.05).
    # Every ladder holding 1 and 8 ties on time; (1, 8) keeps the fewest graphs, so the least pool.
    expected = STEPS * (2 * overhead_step(512, 512, 8) + overhead_step(512, 512, 1) + overhead_step(256, 256, 8))
    assert choice.ladder == (1, 8)
    assert choice.predicted_s == pytest.approx(expected, rel=1e-12)
    best = choice.options[0]
    assert (best.batches, best.padded_rows, best.fits) == (4, 3, True)


def test_no_speedup_from_big_batches_means_no_padding():
    # Time proportional to rows: a padded row is pure waste, and every unpadded plan costs the same.
    ms = calibrate(COUNTS, POW2_8, lambda h, w, b: 0.25 * b)
    choice = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    rows = sum(COUNTS.values())
    assert choice.predicted_s == pytest.approx(STEPS * 0.25 * rows, rel=1e-12)
    assert choice.options[0].padded_rows == 0
    assert choice.ladder == (1,)  # ties on time; one graph per resolution is the least pool
    assert all(o.predicted_s > choice.predicted_s for o in choice.options if o.padded_rows)


def test_pool_limit_drops_the_big_bucket():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    free = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    with_8 = [o.pool_bytes for o in free.options if 8 in o.ladder]
    without_8 = [o.pool_bytes for o in free.options if 8 not in o.ladder]
    limit = min(with_8) - 1
    assert max(without_8) <= limit  # the limit excludes exactly the ladders holding 8

    limited = choose_ladder(COUNTS, ms, STEPS, limit, MARGIN)
    assert 8 not in limited.ladder and limited.pool_bytes <= limit
    assert limited.predicted_s > free.predicted_s
    # Same as if 8 had never been calibrated.
    assert limited.ladder == choose_ladder(COUNTS, [m for m in ms if m.bucket != 8], STEPS, None, MARGIN).ladder
    assert [o.fits for o in limited.options] == [8 not in o.ladder for o in limited.options]


def test_no_ladder_fits_names_limit_and_smallest_pool():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    free = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    smallest = min(free.options, key=lambda o: o.pool_bytes)
    assert smallest.ladder == (1,)
    limit = smallest.pool_bytes - 1
    with pytest.raises(NoLadderFits) as e:
        choose_ladder(COUNTS, ms, STEPS, limit, MARGIN)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert f"{limit / GIB:.2f} GiB" in msg
    assert f"{smallest.pool_bytes / GIB:.2f} GiB (ladder [1])" in msg
    assert "bcg.pool_limit_gib" in msg and "smaller batch sizes" in msg


def test_options_are_every_candidate_best_first():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    limit = min(o.pool_bytes for o in choose_ladder(COUNTS, ms, STEPS, None, MARGIN).options if 8 in o.ladder) - 1
    choice = choose_ladder(COUNTS, ms, STEPS, limit, MARGIN)
    ladders = [o.ladder for o in choice.options]
    assert sorted(ladders) == sorted(candidate_ladders(POW2_8)) and len(ladders) == 2**4 - 1
    assert (choice.ladder, choice.predicted_s, choice.pool_bytes) == (
        choice.options[0].ladder, choice.options[0].predicted_s, choice.options[0].pool_bytes)
    fits = [o.fits for o in choice.options]
    assert fits == sorted(fits, reverse=True)  # every fitting ladder before any that does not
    for a, b in zip(choice.options, choice.options[1:]):
        if a.fits == b.fits:
            assert b.predicted_s >= a.predicted_s * (1 - 1e-9)
            if b.predicted_s <= a.predicted_s * (1 + 1e-9):
                assert (a.pool_bytes, len(a.ladder), a.ladder) < (b.pool_bytes, len(b.ladder), b.ladder)


def test_same_choice_whatever_order_measurements_come_in():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    choice = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    shuffled = list(ms)
    random.Random(0).shuffle(shuffled)
    assert choose_ladder(dict(reversed(COUNTS.items())), shuffled, STEPS, None, MARGIN) == choice


def test_measurements_at_unused_resolutions_are_ignored():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    extra = calibrate([(1024, 1024)], POW2_8, overhead_step)
    counts = {**COUNTS, (1024, 1024): 0}
    assert choose_ladder(counts, ms + extra, STEPS, None, MARGIN) == choose_ladder(COUNTS, ms, STEPS, None, MARGIN)


# --- agreement with the planner ---------------------------------------------------------------


def check_against_make_plan(counts, ms, choice: LadderChoice) -> None:
    items = items_for(counts)
    costs = {}
    for m in ms:
        costs.setdefault((m.height, m.width), {})[m.bucket] = m.step_s
    for o in choice.options:
        plan = make_plan(items, o.ladder, costs={r: {b: c[b] for b in o.ladder} for r, c in costs.items()})
        planned = STEPS * math.fsum(costs[(b.height, b.width)][b.bucket] for b in plan.batches)
        assert o.predicted_s == pytest.approx(planned, rel=1e-12), o.ladder
        assert (o.batches, o.padded_rows) == (len(plan.batches), plan.padded_rows), o.ladder


def test_prediction_is_what_make_plan_plans():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    check_against_make_plan(COUNTS, ms, choose_ladder(COUNTS, ms, STEPS, None, MARGIN))


RESOLUTIONS = [(256, 256), (512, 512), (512, 768)]


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(st.sampled_from(RESOLUTIONS), st.integers(0, 40), min_size=1),
    st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True),
    st.data(),
)
def test_prediction_is_what_make_plan_plans_property(counts, sizes, data):
    step = st.floats(1e-3, 2.0, allow_nan=False, allow_infinity=False)
    ms = [Measurement(h, w, b, data.draw(step), need(h, w, b)) for h, w in counts for b in sizes]
    choice = choose_ladder(counts, ms, STEPS, None, MARGIN)
    check_against_make_plan(counts, ms, choice)
    assert choice.predicted_s <= min(o.predicted_s for o in choice.options) * (1 + 1e-9)


# --- errors and edges -------------------------------------------------------------------------


def test_missing_measurement_is_named():
    ms = [m for m in calibrate(COUNTS, POW2_8, overhead_step) if (m.height, m.width, m.bucket) != (256, 256, 4)]
    with pytest.raises(ValueError, match=re.escape("(height, width, bucket)=(256, 256, 4)")):
        choose_ladder(COUNTS, ms, STEPS, None, MARGIN)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_bad_step_time_is_named(bad):
    ms = calibrate(COUNTS, POW2_8, lambda h, w, b: bad if (h, w, b) == (512, 512, 2) else 1.0)
    with pytest.raises(ValueError, match=re.escape(f"step_s={bad!r} at (height, width, bucket)=(512, 512, 2)")):
        choose_ladder(COUNTS, ms, STEPS, None, MARGIN)


def test_duplicate_measurement_and_bad_steps_are_refused():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    with pytest.raises(ValueError, match=re.escape("two measurements for (height, width, bucket)=(512, 512, 1)")):
        choose_ladder(COUNTS, ms + ms[:1], STEPS, None, MARGIN)
    with pytest.raises(ValueError, match="steps=0"):
        choose_ladder(COUNTS, ms, 0, None, MARGIN)
    with pytest.raises(ValueError, match="no measurements"):
        choose_ladder(COUNTS, [], STEPS, None, MARGIN)


def test_candidate_ladders():
    assert candidate_ladders([4, 1, 2, 2]) == [(1,), (2,), (4,), (1, 2), (1, 4), (2, 4), (1, 2, 4)]
    assert len(candidate_ladders(range(1, 9))) == 255
    with pytest.raises(ValueError, match=r"9 calibrated batch sizes .*at most 8"):
        candidate_ladders(range(1, 10))


def test_describe_shows_choice_and_runner_ups():
    ms = calibrate(COUNTS, POW2_8, overhead_step)
    choice = choose_ladder(COUNTS, ms, STEPS, None, MARGIN)
    text = describe(choice, top=3)
    lines = text.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("autoladder chose ladder [1, 8]: ")
    assert f"{choice.predicted_s:.1f} s" in lines[0] and "15 ladders evaluated" in lines[0]
    assert all(re.match(r"  runner-up \(\+\d+\.\d%\) ladder \[", line) for line in lines[1:])
