"""Splitting a plan across processes: pure checks, and sharded runs that equal one process's run."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import cpu_job, rows, run_benchmark, write_manifest
from pipeline.job import run
from pipeline.manifest import Item
from pipeline.contact_sheet import CONTACT_SHEET
from pipeline.errors import UserError
from pipeline.exit_codes import ExitCode
from pipeline.merge import main as merge_main
from pipeline.planner import make_plan
from pipeline.sharding import ShardSpec, batch_cost, shard_batches

SIDES = [64, 96, 128, 256]


def items(counts: dict[tuple[int, int], int]) -> list[Item]:
    out, row = [], 0
    for (h, w), n in counts.items():
        for _ in range(n):
            out.append(Item(f"i{row}", "p", None, w, h, row, row, {}))
            row += 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    counts=st.dictionaries(st.tuples(st.sampled_from(SIDES), st.sampled_from(SIDES)), st.integers(1, 40), min_size=1, max_size=5),
    count=st.integers(1, 6),
    overhead=st.sampled_from([0.0, 1.0, 3.0]),
    attention=st.sampled_from([None, 1e4, 1.77e6]),
)
def test_every_batch_in_exactly_one_shard_balanced_within_one_batch(counts, count, overhead, attention):
    plan = make_plan(items(counts), [1, 2, 4, 8], overhead)
    shards = [shard_batches(plan, ShardSpec(i, count), overhead, attention) for i in range(count)]
    assert sorted(b.key for s in shards for b in s) == sorted(b.key for b in plan.batches)
    assert [b.key for s in shards for b in s] == [b.key for b in plan.batches]  # contiguous slices, plan order
    total = sum(batch_cost(b, overhead, attention) for b in plan.batches)
    largest = max(batch_cost(b, overhead, attention) for b in plan.batches)
    for s in shards:
        assert abs(sum(batch_cost(b, overhead, attention) for b in s) - total / count) <= largest
    split_groups = sum(
        len({i for i, s in enumerate(shards) if any((b.height, b.width) == res for b in s)}) - 1 for res in plan.resolutions()
    )
    assert split_groups <= count - 1
    assert shards == [shard_batches(plan, ShardSpec(i, count), overhead, attention) for i in range(count)]  # deterministic


def test_cost_balances_pixels_not_rows():
    # 32 small rows and 16 large ones (16x the pixels each): by cost, one shard takes the small
    # rows and one large batch (40 rows), the other one large batch (8 rows).
    plan = make_plan(items({(64, 64): 32, (256, 256): 16}), [8], 1.0)
    a, b = (shard_batches(plan, ShardSpec(i, 2), 1.0) for i in range(2))
    assert sum(len(x.items) for x in a) == 40 and sum(len(x.items) for x in b) == 8
    assert [(x.height, x.width) for x in b] == [(256, 256)]


def test_attention_weighs_large_rows_more_so_the_split_moves():
    # 64 rows at 512 px and 16 at 1024 px in batches of 4: linear in pixels, the 1024 px rows are
    # half the work and make one shard; with attention's share, they are more than half, so the
    # first shard also takes one batch of them.
    plan = make_plan(items({(512, 512): 64, (1024, 1024): 16}), [4], 0.0)
    linear, attention = (shard_batches(plan, ShardSpec(0, 2), 0.0, a) for a in (None, 1.77e6))
    assert [(b.height, len(b.items)) for b in linear] == [(512, 4)] * 16
    assert [(b.height, len(b.items)) for b in attention] == [(512, 4)] * 16 + [(1024, 4)]


def test_pixart_sigmas_config_predicts_the_measured_cost_of_a_large_row(tmp_path):
    """With attention's share, PixArt-Sigma's config weighs a 1024 px row at about 5.5 times a 512 px
    row (docs/BENCHMARKS.md holds the measured ratio), where pixels alone say 4."""
    from conftest import cpu_job
    from pipeline.models import attention_pixels
    from pipeline.sharding import row_cost

    model = cpu_job(tmp_path / "m.parquet", tmp_path / "out", "model=pixart_sigma").model
    a = attention_pixels(model)
    assert 4.9 < row_cost(1024, 1024, a) / row_cost(512, 512, a) < 5.8
    assert row_cost(1024, 1024) / row_cost(512, 512) == 4


@pytest.mark.parametrize("index, count", [(2, 2), (-1, 2), (0, 0)])
def test_bad_shard_spec_is_named(index, count):
    with pytest.raises(ValueError, match=f"shard.index={index} shard.count={count}"):
        ShardSpec(index, count)


def test_two_shards_in_turn_equal_one_process_and_merge_once_both_are_in(tmp_path, capsys):
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"a{k}", 64, 64, k) for k in range(7)], *[(f"b{k}", 96, 64, 10 + k) for k in range(5)]))
    run(cpu_job(manifest, tmp_path / "single"))
    sharded = tmp_path / "sharded"
    run(cpu_job(manifest, sharded, "shard.index=1", "shard.count=2", "output.contact_sheet=true"))
    assert not (sharded / "_SUCCESS").exists() and not (sharded / "stats.json").exists()
    assert not (sharded / CONTACT_SHEET).exists()  # a sheet of every image, so only once the job is complete
    assert merge_main([f"output.dir={sharded}"]) == ExitCode.INCOMPLETE
    assert "1 of 2 shards not complete yet: [0]" in capsys.readouterr().err
    run(cpu_job(manifest, sharded, "shard.index=0", "shard.count=2", "output.contact_sheet=true"))
    assert (sharded / "_SUCCESS").exists() and (sharded / CONTACT_SHEET).is_file()
    stats = json.loads((sharded / "stats.json").read_text())
    assert stats["images"]["ok"] == 12 and len(stats["shards"]) == 2
    assert all(s["images"]["ok"] > 0 for s in stats["shards"])
    # the shards ran one after the other, so the job's spans hold both, and its rates are over them
    parts = stats["shards"]
    assert stats["wall_s"] >= sum(s["wall_s"] for s in parts) - 1e-3
    assert stats["generate_s"] >= sum(s["generate_s"] for s in parts) - 1e-3
    assert stats["images_per_s"] == pytest.approx(12 / stats["generate_s"], rel=1e-3)
    assert stats["wall_images_per_s"] == pytest.approx(12 / stats["wall_s"], rel=1e-3)
    assert stats["wall_images_per_s"] < stats["images_per_s"] and [s["device"] for s in parts] == ["cpu", "cpu"]
    for image in (tmp_path / "single" / "images").iterdir():
        assert (sharded / "images" / image.name).read_bytes() == image.read_bytes(), image.name
    assert merge_main([f"output.dir={sharded}"]) == 0


def test_sharded_multirun_through_submitit_local_equals_one_process(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the `slurm` extra (hydra-submitit-launcher)")
    from conftest import run_cli

    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"a{k}", 64, 64, k) for k in range(5)], *[(f"b{k}", 96, 64, 10 + k) for k in range(3)]))
    common = ["+job=dataset", f"manifest.path={manifest}", "runtime.device=cpu", "precision=fp32", "sampler.steps=2"]
    single = run_cli(*common, f"output.dir={tmp_path / 'single'}")
    assert single.returncode == 0, single.stderr[-2000:]
    sharded = tmp_path / "sharded"
    proc = run_cli("-m", *common, f"output.dir={sharded}", "shard.count=2", "shard.index=0,1",
                   "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sharded / "_SUCCESS").exists()  # merged by the callback at the end of the multirun
    stats = json.loads((sharded / "stats.json").read_text())
    assert stats["images"]["ok"] == 8 and sorted(s["shard"]["index"] for s in stats["shards"]) == [0, 1]
    for image in (tmp_path / "single" / "images").iterdir():
        assert (sharded / "images" / image.name).read_bytes() == image.read_bytes(), image.name


def test_slurm_launcher_off_a_slurm_machine_is_one_line_before_anything_runs(tmp_path, monkeypatch):
    import shutil

    from conftest import one_error_line, run_cli
    from pipeline import preflight

    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 0)))
    proc = run_cli("-m", "+job=dataset", f"manifest.path={manifest}", f"output.dir={tmp_path / 'ds'}", "shard.count=2",
                   "shard.index=range(2)", "hydra/launcher=slurm", "hydra.launcher.partition=gpu", cwd=tmp_path,
                   env={"PATH": os.path.dirname(sys.executable)})  # no Slurm command on it
    line = one_error_line(proc)
    assert proc.returncode == 2 and line.startswith("error: hydra/launcher=slurm ") and ("pip install" in line or "srun" in line)
    assert not (tmp_path / "ds").exists() and not (tmp_path / "multirun").exists()
    # each refusal, whichever this machine gives
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"hydra/launcher=submitit_slurm needs .*pip install 'bcg-datagen\[slurm\]'"):
        preflight.check_launcher("submitit_slurm")
    monkeypatch.undo()
    if preflight.importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
        monkeypatch.setattr(shutil, "which", lambda name: None if name == "srun" else f"/usr/bin/{name}")
        with pytest.raises(UserError, match=r"whose srun this machine does not have: run the command on a Slurm login"):
            preflight.check_launcher("slurm")
    preflight.check_launcher("local_gpus")  # not Slurm's: nothing to check


@pytest.mark.slow
def test_bench_shards_script_finds_every_image_of_one_process_in_the_shards(tmp_path):
    """benchmarks/bench_shards.py, as on two GPUs but with two CPU processes: its checks and its figures."""
    out = tmp_path / "r.json"
    proc = run_benchmark("bench_shards.py", "--rows", "6", "--devices", "cpu", "cpu", "--work", str(tmp_path / "w"),
                         "--out", str(out), "--", "precision=fp32", "sampler.steps=2", timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert r["ids_exactly_once"] and r["success_marker"]
    assert r["images_vs_one_process"]["images"] == 6 and r["images_vs_one_process"]["identical"] == 6
    assert [s["device"] for s in r["per_shard"]] == ["cpu", "cpu"] and sum(s["images"] for s in r["per_shard"]) == 6
    assert sum(n for s in r["per_shard"] for n in s["per_resolution"].values()) == 6
    assert r["images_vs_one_process"]["identical_per_resolution"] == {"128x128": "2/2", "64x64": "2/2", "96x64": "2/2"}
    assert r["single"]["images"] == r["sharded"]["images"] == 6 and r["speedup"]["images_per_s"] > 0
