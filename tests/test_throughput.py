"""Job-level throughput features on the CPU: bcg.ladder=auto (calibrate, choose, save, reuse) and
`+job=bench` against diffusers' own pipeline on the same weights."""

from __future__ import annotations

import json
import time

import pytest

from conftest import cpu_job, rows, write_manifest
from pipeline.bench import BENCH, run_bench
from pipeline.calibrate import SAVED, load_choice, save_choice
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.manifest import ManifestError
from pipeline.startup import before_this_job

AUTO = ("bcg.ladder=auto", "bcg.auto_sizes=[1,2,4]")

BASELINE_PAUSE_S = 2.0
CHECK_PAUSE_S = 1.0


@pytest.fixture()
def manifest(tmp_path):
    # 5 rows at 64 px, 2 at 128 px wide: remainders at every ladder
    specs = [(f"a{k}", 64, 64, k) for k in range(5)] + [(f"b{k}", 128, 64, 10 + k) for k in range(2)]
    return write_manifest(tmp_path / "m.parquet", rows(*specs))


@pytest.mark.parametrize("scope", ["forward", "step"])
def test_auto_ladder_is_chosen_saved_and_reused(tmp_path, manifest, scope):
    out = tmp_path / "out"
    report = run(cpu_job(manifest, out, *AUTO, f"bcg.scope={scope}"))
    auto = report["ladder_auto"]
    assert report["images"]["ok"] == 7
    assert set(auto["chosen"]) <= {1, 2, 4} and report["ladder"] == auto["chosen"]
    assert auto["predicted_denoise_s"] > 0 and auto["measured_denoise_s"] > 0
    assert set(auto["step_s"]) == {f"{w}x{h}-b{b}" for h, w in ((64, 64), (64, 128)) for b in (1, 2, 4)}
    best = auto["options"][0]
    assert best["ladder"] == auto["chosen"]
    # the job runs the plan that was predicted: the measured step times are the planner's costs
    assert (report["batches"], report["padded_rows"]) == (best["batches"], best["padded_rows"])
    saved = json.loads((out / SAVED).read_text())
    assert saved["ladder"] == auto["chosen"] and set(saved["costs"]) == {"64x64", "128x64"}  # width x height
    for done in (out / "parts").glob("*.json"):  # as if the process died after its last commit: the job runs again
        done.unlink()
    again = run(cpu_job(manifest, out, *AUTO, f"bcg.scope={scope}"))  # resumed: the saved ladder, same plan
    assert again["ladder"] == auto["chosen"] and again["images"]["skipped"] == 7 and again["ladder_auto"] is None


def test_auto_ladder_refuses_shards_without_a_saved_choice(tmp_path, manifest):
    with pytest.raises(UserError, match="shard.count > 1"):
        run(cpu_job(manifest, tmp_path / "out", *AUTO, "shard.count=2"))


def test_auto_ladder_choice_is_checked_before_it_is_reused(tmp_path, manifest, caplog):
    out = tmp_path / "out"
    out.mkdir()
    (out / SAVED).write_text("{not json")
    with pytest.raises(UserError, match="ladder.json is not a ladder choice"):
        run(cpu_job(manifest, out, *AUTO))
    (out / SAVED).write_text(json.dumps({"ladder": [8], "fingerprint": "another job", "costs": {}}))
    report = run(cpu_job(manifest, out, *AUTO))
    assert report["ladder_auto"] is not None and "calibrating again" in caplog.text
    with pytest.raises(UserError, match="at most 8 sizes"):  # refused before any model or calibration
        run(cpu_job(manifest, tmp_path / "other", "bcg.ladder=auto", "bcg.auto_sizes=[1,2,3,4,5,6,7,8,9]"))


def test_a_ladder_choice_saved_with_sizes_height_first_reads_as_it_was_saved(tmp_path):
    """ladder.json before version 2 named a size height x width; the same costs read back either way."""
    (tmp_path / SAVED).write_text(json.dumps({"ladder": [1], "fingerprint": "f", "costs": {"64x128": {"1": 0.5}}}))
    assert load_choice(tmp_path, "f").costs == {(64, 128): {1: 0.5}}
    save_choice(tmp_path, {(64, 128): {1: 0.5}}, "f", {"chosen": [1]})
    assert json.loads((tmp_path / SAVED).read_text())["costs"] == {"128x64": {"1": 0.5}}
    assert load_choice(tmp_path, "f").costs == {(64, 128): {1: 0.5}}


def test_auto_ladder_with_no_valid_row_finishes_like_any_ladder(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 63, 64, 1)))  # 63 px: not a multiple of 16
    report = run(cpu_job(manifest, tmp_path / "out", *AUTO, "manifest.on_invalid=skip"))
    assert report["images"]["invalid"] == 1 and report["images"]["ok"] == 0


def test_bench_refuses_before_the_baseline_runs(tmp_path, manifest, monkeypatch):
    import pipeline.bench as bench

    monkeypatch.setattr(bench, "diffusers_baseline", lambda *a, **k: pytest.fail("the baseline ran"))
    bad = write_manifest(tmp_path / "bad.parquet", rows(("a", 63, 64, 1)))
    with pytest.raises(ManifestError):
        run_bench(cpu_job(bad, tmp_path / "out", "bench.baseline=true"))
    with pytest.raises(UserError, match="no valid row"):
        run_bench(cpu_job(bad, tmp_path / "out", "bench.baseline=true", "manifest.on_invalid=skip"))
    with pytest.raises(UserError, match="bench.reference_images=0 must be >= 1"):
        run_bench(cpu_job(manifest, tmp_path / "out", "bench.baseline=true", "bench.reference_images=0"))
    with pytest.raises(UserError, match="kernels.fp8=true for model family 'pixart' needs kernels.fuse_residual=true"):
        run_bench(cpu_job(manifest, tmp_path / "out", "bench.baseline=true", "kernels.fp8=true"))
    committed = tmp_path / "committed"
    run(cpu_job(manifest, committed))
    with pytest.raises(UserError, match="needs an empty output.dir"):
        run_bench(cpu_job(manifest, committed, "bench.baseline=true"))


def test_bench_runs_diffusers_and_ours_on_the_same_rows_and_agrees(tmp_path, manifest, monkeypatch):
    from pipeline import bench

    baseline, baseline_took = bench.diffusers_baseline, []

    def slow_baseline(*args, **kwargs):  # a baseline of some seconds, which our start-up must not hold
        started = time.perf_counter()
        time.sleep(BASELINE_PAUSE_S)
        try:
            return baseline(*args, **kwargs)
        finally:
            baseline_took.append(time.perf_counter() - started)

    check = bench.check_cpu_scale

    def slow_check(*args, **kwargs):  # a check a job run alone makes too: part of our start-up
        time.sleep(CHECK_PAUSE_S)
        return check(*args, **kwargs)

    made, sizes = bench.to_diffusers, []

    class Counted:  # the pipeline, each call's size noted
        def __init__(self, pipe):
            self.pipe = pipe

        def __call__(self, **kwargs):
            sizes.append((kwargs["width"], kwargs["height"]))
            return self.pipe(**kwargs)

        def __getattr__(self, name):
            return getattr(self.pipe, name)

    monkeypatch.setattr(bench, "diffusers_baseline", slow_baseline)
    monkeypatch.setattr(bench, "check_cpu_scale", slow_check)
    monkeypatch.setattr(bench, "to_diffusers", lambda adapter: Counted(made(adapter)))
    ages = []

    def aged_run(*args, **kwargs):  # the seconds its start-up would count as the job begins
        ages.append(before_this_job())
        return run(*args, **kwargs)

    monkeypatch.setattr("pipeline.job.run", aged_run)  # run_bench imports it when called
    result = run_bench(cpu_job(manifest, tmp_path / "out", "bench.baseline=true", "bench.baseline_batch=4"))
    base = result["baseline"]
    assert base["images"] == result["ours"]["images"] == 7
    assert base["calls"] == 2 + 1  # 64 px: 4 + 1 rows, 64x128: 2 rows
    # one untimed warm-up call first, on the first timed call's rows; end to end, a script's run counts its set-up
    assert sizes == [(64, 64)] * 3 + [(128, 64)] and base["warmup_s"] > 0 and 0 < base["first_call_s"] < base["seconds"]
    assert base["end_to_end_s"] == pytest.approx(base["seconds"] + base["warmup_s"] - base["first_call_s"], abs=0.002)
    assert result["speedup_end_to_end"] == pytest.approx(base["end_to_end_s"] / result["ours"]["end_to_end_s"], rel=0.01)
    assert result["speedup_end_to_end"] > 0
    pixels = result["vs_baseline_pixels"]
    assert pixels["images"] == 4 + 2 and pixels["max"] <= 2  # fp32 on CPU: the parity tests' bound
    assert result["ours"]["gpu_memory"] is None  # on the CPU
    assert json.loads((tmp_path / "out" / BENCH).read_text()) == result
    startup = json.loads((tmp_path / "out" / "stats.json").read_text())["startup_s"]
    assert startup["build"] >= result["model_build_s"] > 0  # the model the bench built counts as our build
    if ages[0] is not None:  # Linux: imports is the process's age (or the time since its last job) as the job
        # began, less the model's build and the baseline's run, but not the bench's checks: a job run alone makes them
        left_out = ages[0] - startup["imports"]
        expected = result["model_build_s"] + sum(baseline_took)
        assert abs(left_out - expected) < CHECK_PAUSE_S / 2, (startup, ages, expected)


def test_bench_table_shows_our_gpu_memory():
    from pipeline.bench import comparison, table
    from reports import part

    baseline = {"pipeline": "PixArtSigmaPipeline", "images": 12, "calls": 3, "batch": 4, "seconds": 6.0,
                "images_per_s": 2.0, "prompts": "text", "warmup_s": 3.0, "end_to_end_s": 7.0}
    result = {"rows": 12, **comparison(baseline, part(), 3.0), "vs_baseline_pixels": {"images": 0}}
    assert result["ours"]["gpu_memory"]["peak_allocated_gib"] == 13.0
    # end to end against the script's run (its first call's set-up counted), the generate phase against its calls warm
    assert (result["speedup_end_to_end"], result["speedup_generate"]) == (round(7.0 / 3.0, 3), round(31.5 / 2.0, 3))
    lines = table(result).splitlines()
    assert any(line.endswith("end to end (first call's set-up counted) | 12 | 7.0 | 1.714 | 1.00x |") for line in lines)
    assert "| diffusers, after an untimed warm-up call | 12 | 6.0 | 2.000 | 1.00x |" in lines
    assert "GPU memory: peak 13.0 GiB allocated (14.0 GiB reserved); model 12.5 GiB; as denoising starts 3.25 GiB " \
           "allocated (4.0 GiB reserved), text encoders released" in lines


def write_output(out, images, layout):
    """An output directory of one batch of these [n, H, W, 3] images, as a job's writer commits it."""
    import pyarrow as pa

    from pipeline.encoding import Encoding
    from pipeline.layouts import embeds
    from pipeline.shard_files import ShardGroup
    from pipeline.writer import BatchResult, Output, Writer, row_schema

    key = "16x16-000000-b3"
    fields = {"prompt": "p", "negative_prompt": None, "width": 16, "height": 16, "bucket": 3, "batch_key": key, "steps": 1,
              "guidance_scale": 1.0, "model": "m", "sampler": "s", "settings": "x", "format": "png", "quality": None,
              "status": "ok", "error": None}
    rows = [{"id": f"r{k}", "seed": k, **fields} for k in range(len(images))]
    writer = Writer(out, Output(layout, Encoding(), row_schema(pa.schema([]), embeds(layout))), [ShardGroup((key,), (0,))], 1)
    writer.submit(BatchResult(key, rows, list(images)))
    writer.close()


@pytest.mark.parametrize("layout", ["files", "webdataset"])
def test_image_comparison_reports_psnr_and_worst_difference(tmp_path, layout):
    import numpy as np

    from pipeline.compare import compare

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    shifted = base.copy()
    shifted[1, 0, 0, 0] = base[1, 0, 0, 0] ^ 8  # one channel of one pixel off by 8 levels
    for name, images in (("a", base), ("b", shifted)):
        write_output(tmp_path / name, images, layout)
    result = compare(tmp_path / "a", tmp_path / "b")
    expected_psnr = 10 * np.log10(255.0**2 / (8.0**2 / base[0].size))
    assert result["images"] == 3 and result["identical"] == 2 and result["max_levels"] == 8
    assert abs(result["min_psnr_db"] - expected_psnr) < 0.01
    with pytest.raises(UserError, match=r"/nope: no such directory"):
        compare(tmp_path / "a", tmp_path / "nope")


def test_bench_baseline_saved_then_compared_from_another_process(tmp_path, manifest, monkeypatch):
    """The two halves of +job=bench in two runs: the saved baseline gives the comparison the same
    run gives, and a baseline made for other rows is refused before anything runs."""
    import pipeline.bench as bench

    base = tmp_path / "base"
    saved = run_bench(cpu_job(manifest, base, "bench.baseline=true", "bench.baseline_batch=4", "bench.baseline_only=true",
                              "bench.reference_images=2"))
    assert saved["baseline"]["images"] == 7 and not (base / "images").exists()  # the baseline only
    assert len(list((base / bench.BASELINE_DIR).glob("*.png"))) == 2 + 2  # two per resolution
    monkeypatch.setattr(bench, "diffusers_baseline", lambda *a, **k: pytest.fail("the baseline ran again"))
    result = run_bench(cpu_job(manifest, base, "bench.baseline=true", "bench.baseline_batch=4", f"bench.baseline_from={base}"))
    assert result["baseline"] == saved["baseline"] and result["baseline_from"] == str(base)
    assert result["ours"]["images"] == 7 and result["vs_baseline_pixels"]["images"] == 4
    assert result["vs_baseline_pixels"]["max"] <= 2  # as in the same-run test
    with pytest.raises(UserError, match="that baseline ran other rows or settings"):
        run_bench(cpu_job(manifest, tmp_path / "other", "bench.baseline=true", f"bench.baseline_from={base}"))  # batch 8
    with pytest.raises(UserError, match="no bench.json there"):
        run_bench(cpu_job(manifest, tmp_path / "o2", "bench.baseline=true", f"bench.baseline_from={tmp_path / 'none'}"))
    with pytest.raises(UserError, match="need bench.baseline=true"):
        run_bench(cpu_job(manifest, tmp_path / "o3", "bench.baseline_only=true"))


def test_the_bench_of_a_real_size_model_on_a_machine_without_gpu_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """+job=bench measures a GPU: on a CPU it did not ask for, PixArt-Sigma's 1,000 rows would run for
    hours, twice. Refused before any model is built, naming the ways on; a small model or an explicit
    runtime.device=cpu runs."""
    import torch

    import pipeline.bench as bench
    from conftest import job_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("pipeline.job.job_plan", lambda *a, **k: pytest.fail("the bench went on to plan its kernels"))
    with pytest.raises(UserError) as refused:
        run_bench(job_config("+job=bench", f"output.dir={tmp_path / 'out'}"))
    assert str(refused.value).startswith("+job=bench measures a GPU, and this machine has none: model pixart_sigma (")
    assert "on 1000 rows would run for hours" in str(refused.value) and "runtime.device=cpu" in str(refused.value)
    assert not (tmp_path / "out").exists()
    cpu = torch.device("cpu")
    bench.check_cpu_scale(job_config("+job=bench", "model=tiny", "output.dir=o"), cpu, torch.float32, 1000)
    bench.check_cpu_scale(job_config("+job=bench", "runtime.device=cpu", "output.dir=o"), cpu, torch.float32, 1000)
