"""Planner: grouping by resolution, batch sizes from the bucket rule, stable keys."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcg.buckets import linear_costs, parse_ladder, split_sizes
from pipeline.manifest import Item
from pipeline.planner import Batch, Plan, buckets_by_shape, make_plan, run_order

POW2_8 = (1, 2, 4, 8)


def item(row: int, height: int = 512, width: int = 512) -> Item:
    return Item(
        id=f"img-{row:05d}",
        prompt=f"prompt {row}",
        negative_prompt=None,
        width=width,
        height=height,
        seed=1000 + row,
        row=row,
        extra={},
    )


def ids(batch: Batch) -> list[str]:
    return [it.id for it in batch.items]


# --- examples ---------------------------------------------------------------------------------


def test_mixed_resolutions_example():
    items = (
        [item(r, 512, 512) for r in range(10)]
        + [item(r, 256, 256) for r in range(10, 13)]
        + [item(r, 512, 768) for r in range(13, 14)]
    )
    plan = make_plan(items, [8, 4, 2, 1], batch_overhead_rows=1.0)

    # 256x256 first (3 items: 2+1 ties 4 on cost, fewer padded rows wins), then 512x512 (10 = 8 + 2),
    # then 768 wide, 512 high as one batch of 1 (keys name a size width x height).
    assert [b.key for b in plan.batches] == [
        "256x256-000000-b2",
        "256x256-000001-b1",
        "512x512-000000-b8",
        "512x512-000001-b2",
        "768x512-000000-b1",
    ]
    assert ids(plan.batches[0]) == ["img-00010", "img-00011"]
    assert ids(plan.batches[3]) == ["img-00008", "img-00009"]
    assert (plan.batches[4].height, plan.batches[4].width) == (512, 768)
    assert plan.ladder == POW2_8
    assert plan.items == 14
    assert plan.padded_rows == 0
    assert plan.by_resolution() == {(256, 256): 3, (512, 512): 10, (512, 768): 1}
    assert plan.by_bucket() == {2: 2, 1: 2, 8: 1}
    assert plan.resolutions() == [(256, 256), (512, 512), (512, 768)]
    # bcg.capture=plan: graphs for these 5 (resolution, bucket) pairs, not the ladder's 12
    assert buckets_by_shape(plan.batches, POW2_8) == {(256, 256): {2, 1}, (512, 512): {8, 2}, (512, 768): {1}}
    # a model that cuts each batch's text: a shape per (resolution, text length)
    lengths = {b.key: 128 if b.height == 512 and b.bucket == 8 else 64 for b in plan.batches}
    assert buckets_by_shape(plan.batches, POW2_8, lengths) == {
        (256, 256, 64): {2, 1}, (512, 512, 128): {8}, (512, 512, 64): {2}, (512, 768, 64): {1}}


def test_seven_items_pad_into_one_batch_of_eight():
    # 4+2+1 costs 3 batches * 1.0 + 7 rows = 10; one 8 costs 1.0 + 8 = 9.
    plan = make_plan([item(r) for r in range(7)], POW2_8, batch_overhead_rows=1.0)
    assert [(b.key, len(b.items), b.padded_rows) for b in plan.batches] == [("512x512-000000-b8", 7, 1)]
    assert plan.padded_rows == 1


def test_items_keep_manifest_row_order():
    items = [item(r) for r in (5, 3, 9, 0, 1)]
    plan = make_plan(items, [4], batch_overhead_rows=0.0)
    assert [ids(b) for b in plan.batches] == [
        ["img-00000", "img-00001", "img-00003", "img-00005"],
        ["img-00009"],
    ]
    assert plan.batches[1].padded_rows == 3


def test_measured_costs_apply_per_resolution():
    items = [item(r, 256, 256) for r in range(3)] + [item(r, 512, 512) for r in range(3, 6)]
    # Launch-bound at 256 px: a batch of 4 costs what a batch of 1 does.
    costs = {(256, 256): {1: 10.0, 2: 10.0, 4: 10.0, 8: 11.0}}
    plan = make_plan(items, POW2_8, batch_overhead_rows=1.0, costs=costs)
    assert [b.key for b in plan.batches] == [
        "256x256-000000-b4",  # 10 < 2+1 at 20
        "512x512-000000-b2",  # linear model: 2+1 costs 5, ties 4 at 5, fewer padded rows wins
        "512x512-000001-b1",
    ]


def test_graphs_follow_the_bucket_the_engine_runs_not_a_cheaper_looking_one():
    """Measured costs (noise on a tiny model) can make a larger bucket look cheaper: the plan records
    it, but the engine runs the smallest bucket that holds the rows, so that is the graph to capture."""
    items = [item(r, 256, 256) for r in range(2)]
    plan = make_plan(items, POW2_8, costs={(256, 256): {1: 10.0, 2: 10.0, 4: 9.0, 8: 11.0}})
    assert [b.bucket for b in plan.batches] == [4]
    assert buckets_by_shape(plan.batches, POW2_8) == {(256, 256): {2}}


def test_missing_cost_entry_names_resolution_and_bucket():
    costs = {(512, 512): {1: 1.0, 2: 2.0}}
    with pytest.raises(ValueError, match=r"512x512.*no entry for bucket 4"):
        make_plan([item(0)], [1, 2, 4], costs=costs)


def test_bad_ladder_and_overhead_are_named():
    with pytest.raises(ValueError, match=re.escape("bcg.ladder=[0, 2] is not accepted")):
        make_plan([item(0)], [0, 2])
    with pytest.raises(ValueError, match="bcg.batch_overhead_rows=-1"):
        make_plan([item(0)], POW2_8, batch_overhead_rows=-1)


def test_cheapest_batch_runs_first_the_fewest_pixels_last_the_rest_in_plan_order():
    items = [item(k, 64, 64) for k in range(8)] + [item(8, 96, 96)] + [item(9 + k, 128, 128) for k in range(2)]
    plan = make_plan(items, [1, 2, 4])  # 64 px: 4, 4; 96 px: 1; 128 px: 2
    cost = lambda b: (b.bucket + 1) * b.height * b.width  # noqa: E731
    order = run_order(plan.batches, cost)
    assert [b.key for b in order] == [plan.batches[i].key for i in (2, 0, 3, 1)]
    assert ids(order[0]) == ["img-00008"] and ids(order[-1]) == [f"img-{k:05d}" for k in range(4, 8)]
    assert run_order([], cost) == [] and run_order(plan.batches[2:], cost) == list(plan.batches[2:])
    assert run_order(plan.batches[1:3], cost) == [plan.batches[2], plan.batches[1]]


def test_no_items_no_batches():
    plan = make_plan([], POW2_8)
    assert plan == Plan(batches=(), ladder=POW2_8)
    assert (plan.items, plan.padded_rows, plan.resolutions()) == (0, 0, [])
    assert plan.by_resolution() == {} and plan.by_bucket() == {}


# --- properties -------------------------------------------------------------------------------

RESOLUTIONS = [(256, 256), (512, 512), (512, 768), (768, 512), (1024, 1024)]


@st.composite
def plan_inputs(draw):
    ladder = draw(st.lists(st.integers(1, 16), min_size=1, max_size=5))
    overhead = draw(st.floats(0, 20))
    resolutions = draw(st.lists(st.sampled_from(RESOLUTIONS), max_size=80))
    # Manifest rows are a shuffle of 0..n-1: the planner must order them, not trust the input.
    rows = draw(st.permutations(range(len(resolutions))))
    items = [item(r, h, w) for r, (h, w) in zip(rows, resolutions)]
    return items, ladder, overhead


@settings(max_examples=150, deadline=None)
@given(plan_inputs())
def test_plan_properties(inputs):
    items, ladder, overhead = inputs
    plan = make_plan(items, ladder, batch_overhead_rows=overhead)
    ladder = parse_ladder(ladder)

    # Every item planned exactly once.
    planned = [it.id for b in plan.batches for it in b.items]
    assert Counter(planned) == Counter(it.id for it in items)
    assert plan.items == len(items)

    for b in plan.batches:
        assert b.bucket in ladder
        assert 1 <= len(b.items) <= b.bucket
        assert 0 <= b.padded_rows < b.bucket
        assert {(it.height, it.width) for it in b.items} == {(b.height, b.width)}
    assert plan.padded_rows == sum(b.padded_rows for b in plan.batches)

    keys = [b.key for b in plan.batches]
    assert len(set(keys)) == len(keys)

    # Groups in ascending (height, width) order, each a contiguous run of batches.
    order = [(b.height, b.width) for b in plan.batches]
    assert order == sorted(order)
    assert plan.resolutions() == sorted(set(order))
    assert plan.by_resolution() == dict(Counter((it.height, it.width) for it in items))
    assert plan.by_bucket() == dict(Counter(b.bucket for b in plan.batches))

    costs = linear_costs(ladder, overhead)
    for h, w in plan.resolutions():
        group = [b for b in plan.batches if (b.height, b.width) == (h, w)]
        # Keys count the batches of a resolution from 0.
        assert [b.key for b in group] == [f"{w}x{h}-{i:06d}-b{b.bucket}" for i, b in enumerate(group)]
        # Manifest order within the group, across batches.
        rows = [it.row for b in group for it in b.items]
        assert rows == sorted(rows)
        # Batch sizes are exactly the bucket rule's split: one implementation.
        assert [(b.bucket, len(b.items)) for b in group] == split_sizes(len(rows), ladder, costs)


@settings(max_examples=50, deadline=None)
@given(plan_inputs(), st.randoms(use_true_random=False))
def test_same_input_same_plan(inputs, rng):
    items, ladder, overhead = inputs
    plan = make_plan(items, ladder, batch_overhead_rows=overhead)
    assert make_plan(list(items), list(ladder), batch_overhead_rows=overhead) == plan
    # Rows are unique, so the order the items arrive in does not matter either.
    shuffled = list(items)
    rng.shuffle(shuffled)
    assert make_plan(shuffled, ladder, batch_overhead_rows=overhead) == plan
