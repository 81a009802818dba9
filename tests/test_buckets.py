"""Bucket arithmetic: ladder parsing, bucket choice, the remainder rule and whole-group splits."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bcg.buckets import cover_remainder, linear_costs, parse_ladder, pick_bucket, split_sizes

POW2_8 = (1, 2, 4, 8)
ONE_8 = (1, 8)


def cost_of(buckets, costs) -> Fraction:
    return sum((Fraction(costs[b]) for b in buckets), Fraction(0))


def padding_of(buckets, n: int) -> int:
    return sum(buckets) - n


# --- parse_ladder -----------------------------------------------------------------------------


def test_parse_ladder_sorts_and_dedupes():
    assert parse_ladder([8, 1, 2, 2, 4]) == POW2_8
    assert parse_ladder((3,)) == (3,)


@pytest.mark.parametrize(
    "values, bad",
    [([0, 2], "0"), ([1, -4], "-4"), ([1, 2.0], "2.0"), ([True, 2], "True"), ([1, "8"], "'8'")],
)
def test_parse_ladder_names_the_bad_value(values, bad):
    with pytest.raises(ValueError, match=re.escape(f"bcg.ladder={values!r} is not accepted: {bad} ")):
        parse_ladder(values)


def test_parse_ladder_error_message_reads_well():
    with pytest.raises(ValueError) as e:
        parse_ladder([0, 2])
    assert str(e.value).startswith("bcg.ladder=[0, 2] is not accepted")
    assert "integers >= 1" in str(e.value)


def test_parse_ladder_rejects_empty_and_non_lists():
    with pytest.raises(ValueError, match=r"bcg.ladder=\[\] .*at least one bucket"):
        parse_ladder([])
    with pytest.raises(ValueError, match="bcg.ladder=8 is not accepted"):
        parse_ladder(8)


# --- pick_bucket ------------------------------------------------------------------------------


@pytest.mark.parametrize("n, bucket", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (7, 8), (8, 8)])
def test_pick_bucket_is_smallest_that_fits(n, bucket):
    assert pick_bucket(POW2_8, n) == bucket


def test_pick_bucket_on_one_8():
    assert [pick_bucket(ONE_8, n) for n in range(1, 9)] == [1, 8, 8, 8, 8, 8, 8, 8]


@pytest.mark.parametrize("n", [0, -1, 9, 100])
def test_pick_bucket_out_of_range_names_n_and_largest(n):
    with pytest.raises(ValueError, match=rf"n={n} .*1\.\.8 \(the largest bucket"):
        pick_bucket(POW2_8, n)


@given(st.lists(st.integers(1, 64), min_size=1, max_size=6), st.data())
def test_pick_bucket_property(values, data):
    ladder = parse_ladder(values)
    n = data.draw(st.integers(1, ladder[-1]))
    b = pick_bucket(values, n)
    assert b in ladder and b >= n
    assert all(smaller < n for smaller in ladder if smaller < b)


# --- cover_remainder: examples a user would notice --------------------------------------------


def test_pow2_8_overhead_1_seven_items_pad_to_eight():
    # 4+2+1 costs 3 batches * 1.0 + 7 rows = 10; one 8 costs 1.0 + 8 = 9  -> pad 1 row into an 8.
    costs = linear_costs(POW2_8, 1.0)
    assert cover_remainder(7, POW2_8, costs) == (8,)
    assert split_sizes(7, POW2_8, costs) == [(8, 7)]


def test_pow2_8_overhead_1_every_remainder():
    costs = linear_costs(POW2_8, 1.0)
    # 3: 2+1 costs 2+3=5, 4 costs 1+4=5 -> tie on cost, fewer padded rows wins -> (2, 1).
    # 5: 4+1 costs 2+5=7 < 8 costs 9.   6: 4+2 costs 8 < 9.
    expected = {0: (), 1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 7: (8,)}
    assert {n: cover_remainder(n, POW2_8, costs) for n in expected} == expected


@given(st.lists(st.integers(2, 32), max_size=5), st.integers(0, 40))
def test_overhead_0_never_pads(values, n):
    # Every row costs 1 and a batch costs nothing extra, so a padded row is pure waste.
    ladder = parse_ladder([1, *values])
    assert sum(cover_remainder(n, ladder, linear_costs(ladder, 0.0))) == n


def test_one_8_three_items():
    # Three 1s cost 3 * (o + 1); one 8 costs o + 8; they meet at o = 2.5 (tie -> no padding).
    assert cover_remainder(3, ONE_8, linear_costs(ONE_8, 0.5)) == (1, 1, 1)  # 4.5 vs 8.5
    assert cover_remainder(3, ONE_8, linear_costs(ONE_8, 2.5)) == (1, 1, 1)  # 10.5 vs 10.5
    assert cover_remainder(3, ONE_8, linear_costs(ONE_8, 5.0)) == (8,)  # 18 vs 13


def test_measured_costs_cheaper_per_row_for_large_buckets():
    # Launch-bound: a batch of 8 costs barely more than a batch of 1.
    costs = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0}
    assert cover_remainder(3, POW2_8, costs) == (4,)  # 11 < 2+1 at 20.5
    assert cover_remainder(5, POW2_8, costs) == (8,)  # 12 < 4+1 at 21
    assert split_sizes(21, POW2_8, costs) == [(8, 8), (8, 8), (8, 5)]


def test_zero_costs_break_ties_on_padding_then_batches():
    costs = {b: 0 for b in POW2_8}
    assert cover_remainder(7, POW2_8, costs) == (4, 2, 1)
    assert cover_remainder(6, POW2_8, costs) == (4, 2)


def test_ties_prefer_larger_buckets_first():
    # 2+2 and 3+1 both cost 2, pad nothing, use 2 batches: the larger bucket comes first.
    costs = {1: 1, 2: 1, 3: 1}
    assert cover_remainder(4, (1, 2, 3), costs) == (3, 1)
    # 7+2+2 and 5+5+1 tie on everything but the buckets: compared from the front, 7 beats 5.
    assert cover_remainder(11, (1, 2, 5, 7), {1: 0, 2: 0, 5: 0, 7: 0}) == (7, 2, 2)


def test_ladder_without_one_pads_the_last_batch():
    assert split_sizes(5, (2, 4), linear_costs((2, 4), 0.0)) == [(4, 4), (2, 1)]


def test_cover_remainder_works_beyond_the_largest_bucket():
    assert cover_remainder(1000, POW2_8, linear_costs(POW2_8, 1.0)) == (8,) * 125
    assert cover_remainder(13, POW2_8, linear_costs(POW2_8, 1.0)) == (8, 4, 1)


# --- errors -----------------------------------------------------------------------------------


def test_missing_cost_entry_names_the_bucket():
    with pytest.raises(ValueError, match="no entry for bucket 4"):
        cover_remainder(3, (1, 2, 4), {1: 1.0, 2: 2.0})
    with pytest.raises(ValueError, match="no entry for bucket 8"):
        split_sizes(20, POW2_8, {1: 1.0, 2: 2.0, 4: 3.0})


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True])
def test_bad_cost_is_named(bad):
    with pytest.raises(ValueError, match=rf"cost {re.escape(repr(bad))} of bucket 2"):
        cover_remainder(3, (1, 2), {1: 1.0, 2: bad})


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_bad_overhead_is_named(bad):
    with pytest.raises(ValueError, match="bcg.batch_overhead_rows="):
        linear_costs(POW2_8, bad)


@pytest.mark.parametrize("n", [-1, 2.5, True])
def test_bad_item_count_is_named(n):
    costs = linear_costs(POW2_8, 1.0)
    with pytest.raises(ValueError, match=re.escape(f"n={n!r}")):
        cover_remainder(n, POW2_8, costs)
    with pytest.raises(ValueError, match=re.escape(f"n={n!r}")):
        split_sizes(n, POW2_8, costs)


# --- properties -------------------------------------------------------------------------------

small_ladders = st.lists(st.integers(1, 12), min_size=1, max_size=4).map(parse_ladder)
# Small integers make ties common, so the tie-breaks get exercised; floats test inexact sums.
cost_values = st.one_of(st.integers(0, 12), st.floats(0, 50, allow_nan=False, allow_infinity=False))


def brute_force_covers(n: int, ladder: tuple[int, ...]):
    """Every descending multiset whose buckets are full except the last, which holds 1..bucket."""
    if n == 0:
        yield ()
        return

    def extend(prefix: tuple[int, ...], filled: int):
        for b in ladder:
            if prefix and b > prefix[-1]:
                continue
            if filled + b >= n:
                yield prefix + (b,)  # b is the last batch: it holds the leftover
            else:
                yield from extend(prefix + (b,), filled + b)

    yield from extend((), 0)


def rule_key(buckets, n, costs):
    """The documented rule: least cost, then fewer padded rows, fewer batches, larger first."""
    return (cost_of(buckets, costs), padding_of(buckets, n), len(buckets), tuple(-b for b in buckets))


@settings(max_examples=200, deadline=None)
@given(small_ladders, st.integers(0, 20), st.data())
def test_cover_remainder_matches_brute_force(ladder, n, data):
    costs = {b: data.draw(cost_values, label=f"cost[{b}]") for b in ladder}
    got = cover_remainder(n, ladder, costs)
    best = min(brute_force_covers(n, ladder), key=lambda c: rule_key(c, n, costs))
    assert cost_of(got, costs) == cost_of(best, costs)
    assert got == best


@given(small_ladders, st.integers(0, 60), st.floats(0, 20))
def test_cover_remainder_shape(ladder, n, overhead):
    got = cover_remainder(n, ladder, linear_costs(ladder, overhead))
    assert list(got) == sorted(got, reverse=True)
    assert all(b in ladder for b in got)
    if n == 0:
        assert got == ()
    else:
        # Full batches before the last one, which holds 1..last rows.
        assert sum(got[:-1]) < n <= sum(got)
        assert padding_of(got, n) < got[-1]


@given(small_ladders, st.integers(0, 100), st.floats(0, 20))
def test_split_sizes_covers_every_item_once(ladder, n, overhead):
    plan = split_sizes(n, ladder, linear_costs(ladder, overhead))
    assert sum(rows for _, rows in plan) == n
    assert all(b in ladder and 1 <= rows <= b for b, rows in plan)
    assert all(rows == b for b, rows in plan[:-1])  # only the last batch may be padded
    top = ladder[-1]
    assert plan[: n // top] == [(top, top)] * (n // top)
    assert plan == split_sizes(n, ladder, linear_costs(ladder, overhead))
