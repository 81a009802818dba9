"""GPU-free checks of the engine: padding, key handling, input checks, pool arithmetic."""

from __future__ import annotations

import pytest
import torch

from bcg.buffers import InputSpec, StaticInputs, pad_rows
from bcg.engine import BCGEngine
from bcg.memory import GIB, GraphNeed, check_pool_limit, predict_pool_bytes, predict_separate_pools_bytes

SPECS = {"x": InputSpec((3,), torch.float32), "m": InputSpec((), torch.int64, fill=1)}


def rowwise(inputs):
    # Each output row depends on its own input row only; padded rows would show as m == 1.
    return inputs["x"] * 2 + inputs["m"][:, None]


def inputs(n: int) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(n, 3), "m": torch.randint(2, 9, (n,))}


def test_without_cuda_the_engine_is_off_and_runs_eager_at_the_bucket():
    seen = []
    engine = BCGEngine(lambda i: seen.append(i["x"].shape[0]) or rowwise(i), lambda key: SPECS, [1, 2, 4, 8], "cpu")
    engine.capture_all([(64, 64)])
    x = inputs(3)
    out = engine.run((64, 64), x, 3)
    assert seen == [4]  # padded to bucket 4, as a graph would be
    torch.testing.assert_close(out, rowwise(x), rtol=0, atol=0)
    m = engine.metrics
    assert (m.active, m.graphs, m.hits, m.misses, m.eager_calls, m.padded_rows) == (False, {}, 0, 0, 1, 1)
    assert "cpu" in m.reason


def test_disabled_engine_says_why():
    engine = BCGEngine(rowwise, lambda key: SPECS, [1, 2], "cpu", enabled=False)
    assert engine.metrics.reason == "bcg.enabled=false"


def test_padding_rows_hold_the_fixed_values():
    padded = pad_rows(SPECS, inputs(2), 2, 4)
    assert padded["x"].shape == (4, 3) and torch.equal(padded["x"][2:], torch.zeros(2, 3))
    assert torch.equal(padded["m"][2:], torch.ones(2, dtype=torch.int64))


def test_static_buffers_are_sliced_and_padding_reset_between_loads():
    static = StaticInputs.allocate(SPECS, 8, torch.device("cpu"))
    static.load(inputs(8), 8, 8)
    first = inputs(3)
    static.load(first, 3, 4)
    view = static.view(4)
    assert view["x"].data_ptr() == static.tensors["x"].data_ptr()  # a slice, not a copy
    assert torch.equal(view["x"][:3], first["x"]) and torch.equal(view["x"][3], torch.zeros(3))
    assert torch.equal(view["m"][3:], torch.ones(1, dtype=torch.int64))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"x": torch.randn(3, 4), "m": torch.ones(3, dtype=torch.int64)}, r"'x' has shape \(3, 4\), expected \(3, 3\)"),
        ({"x": torch.randn(3, 3)}, r"inputs \['x'\] do not match the specs \['m', 'x'\]"),
    ],
)
def test_wrong_inputs_are_named(bad, message):
    engine = BCGEngine(rowwise, lambda key: SPECS, [1, 2, 4], "cpu")
    with pytest.raises(ValueError, match=message):
        engine.run((64, 64), bad, 3)


def test_batch_larger_than_the_ladder_is_refused():
    engine = BCGEngine(rowwise, lambda key: SPECS, [1, 2, 4], "cpu")
    with pytest.raises(ValueError, match="n=5"):
        engine.run((64, 64), inputs(5), 5)


def test_shared_pool_prediction_keeps_one_transient_and_every_output():
    mib = 2**20
    needs = [GraphNeed((64, 64), 8, peak_bytes=100 * mib, output_bytes=4 * mib), GraphNeed((64, 64), 4, 60 * mib, 1 * mib)]
    # largest transient (100 - 4) x 1.5, plus what each keeps: its output, at least a 2 MiB segment
    assert predict_pool_bytes(needs, 1.5) == 144 * mib + 4 * mib + 2 * mib
    assert predict_separate_pools_bytes(needs, 1.5) == (144 + 4) * mib + int(59 * 1.5 * mib) + 2 * mib
    assert predict_pool_bytes([], 1.3) == 0


def test_pool_limit_names_the_largest_needs():
    needs = [GraphNeed((1024, 1024), 8, peak_bytes=3 * GIB, output_bytes=0), GraphNeed((512, 512), 1, peak_bytes=GIB // 8, output_bytes=0)]
    check_pool_limit(needs, predict_pool_bytes(needs, 1.3), limit_gib=None, margin=1.3)
    check_pool_limit(needs, predict_pool_bytes(needs, 1.3), limit_gib=4.0, margin=1.3)
    with pytest.raises(ValueError, match=r"exceeds bcg.pool_limit_gib=2.0.*1024x1024 bucket 8 \(3.90 GiB\)"):
        check_pool_limit(needs, predict_pool_bytes(needs, 1.3), limit_gib=2.0, margin=1.3)


def test_capture_takes_only_ladder_buckets():
    """bcg.capture=plan hands the engine the buckets a plan uses; one outside the ladder is a bug named early."""
    engine = BCGEngine(rowwise, lambda key: SPECS, [1, 2, 4], "cpu")
    with pytest.raises(ValueError, match=r"buckets \[3\] are not in the ladder \[1, 2, 4\]"):
        engine.capture_all([(64, 64)], {(64, 64): [2, 3]})
    engine.capture_all([(64, 64), (32, 32)], {(64, 64): [4]})  # graphs off on the CPU: nothing captured, no error
    assert engine.metrics.graphs == {}
