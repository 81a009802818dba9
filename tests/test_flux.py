"""The flux family on the CPU: B rows per step (2B only with true CFG), negative prompts refused
where they have no use, FluxPipeline's noise and per-resolution schedule, resume. Images against
FluxPipeline itself: tests/test_diffusers_parity.py."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from diffusers import FluxPipeline

from conftest import cpu_job, job_config, png, rows, write_manifest
from pipeline.denoise import Denoiser
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.manifest import ManifestError
from pipeline.models import build_model, to_diffusers
from pipeline.noise import batch_noise
from pipeline.prompts import ENCODE_TOKENS, MOST_PER_CALL, encoding_digest, prompts_per_call

CPU = torch.device("cpu")
STEPS = 2


@pytest.fixture(scope="module")
def flux():
    cfg = job_config("model=tiny_flux", "manifest.path=m", "output.dir=o").model
    return build_model(cfg, CPU, torch.float32)


def transformer_rows(adapter) -> tuple[list[int], object]:
    """The batch of every transformer call, as a list that the returned hook handle fills."""
    seen: list[int] = []
    handle = adapter.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)
    return seen, handle


@pytest.mark.parametrize("scope", ["forward", "step"])
def test_a_step_runs_b_rows_and_2b_only_with_true_cfg(flux, tmp_path, scope):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 64, 3)))
    for true_cfg, expected in ((1.0, 4), (3.0, 8)):  # 3 rows at bucket 4
        seen, handle = transformer_rows(flux)
        try:
            report = run(cpu_job(manifest, tmp_path / f"out-{true_cfg}", "model=tiny_flux", f"bcg.scope={scope}",
                                 "bcg.ladder=[4]", f"sampler.steps={STEPS}", f"sampler.true_cfg_scale={true_cfg}"),
                         adapter=flux)
        finally:
            handle.remove()
        assert report["images"]["ok"] == 3
        assert seen[-STEPS:] == [expected] * STEPS
    assert not flux.uses_cfg  # the true-CFG job ran a copy; the adapter it was given is unchanged


def test_step_inputs_hold_the_prompt_alone(flux):
    denoiser = Denoiser(flux, "step", "default", STEPS)
    specs = denoiser._step_specs((64, 64))
    assert specs["emb"].shape == (1, flux.max_sequence_length, 32) and specs["pooled"].shape == (1, 32)
    guided = flux.with_true_cfg(3.0)
    assert guided.input_specs(64, 64)["emb"].shape[0] == 2 and guided.transformer is flux.transformer


def test_a_negative_prompt_without_true_cfg_is_a_bad_row(tmp_path):
    manifest_rows = rows(("a", 64, 64, 1), ("b", 64, 64, 2))
    manifest_rows[1]["negative_prompt"] = "blurry"
    manifest_rows[0]["negative_prompt"] = None
    manifest = write_manifest(tmp_path / "m.parquet", manifest_rows)
    with pytest.raises(ManifestError) as err:
        run(cpu_job(manifest, tmp_path / "out", "model=tiny_flux", f"sampler.steps={STEPS}"))
    lines = str(err.value).splitlines()
    assert "1 bad row(s)" in lines[0] and "row 1" in lines[1] and "'b'" in lines[1]
    assert "negative_prompt 'blurry' has no use in flux without true CFG" in lines[1]
    assert "sampler.true_cfg_scale" in lines[1]
    report = run(cpu_job(manifest, tmp_path / "skip", "model=tiny_flux", f"sampler.steps={STEPS}",
                         "manifest.on_invalid=skip"))
    assert report["images"]["ok"] == 1 and report["images"]["invalid"] == 1
    assert [e["id"] for e in pq.read_table(tmp_path / "skip" / "errors.parquet").to_pylist()] == ["b"]
    report = run(cpu_job(manifest, tmp_path / "true-cfg", "model=tiny_flux", f"sampler.steps={STEPS}",
                         "sampler.true_cfg_scale=4.0"))
    assert report["images"]["ok"] == 2


def test_true_cfg_scale_is_refused_where_it_has_no_meaning(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with pytest.raises(UserError, match=r"sampler.true_cfg_scale=2.0 is for guidance-distilled families \['flux'\]"):
        run(cpu_job(manifest, tmp_path / "pixart", "sampler.true_cfg_scale=2.0"))
    with pytest.raises(UserError, match="sampler.true_cfg_scale=0.5 must be >= 1"):
        run(cpu_job(manifest, tmp_path / "flux", "model=tiny_flux", "sampler.true_cfg_scale=0.5"))


def test_noise_is_what_flux_pipeline_draws_unpacked(flux):
    pipe = to_diffusers(flux)
    seeds, height, width = [3, 11], 64, 96
    packed, _ = pipe.prepare_latents(2, 16, height, width, torch.float32, CPU,
                                     [torch.Generator("cpu").manual_seed(s) for s in seeds])
    ours = batch_noise(seeds, flux.latent_shape(height, width), torch.float32, CPU)
    assert ours.shape == (2, 16, 8, 12)
    assert torch.equal(FluxPipeline._pack_latents(ours, 2, 16, 8, 12), packed)


def test_each_resolution_gets_the_schedule_flux_pipeline_uses(flux):
    pipe = to_diffusers(flux)
    pipe.set_progress_bar_config(disable=True)
    denoiser = Denoiser(flux, "step", "default", 3)
    for height, width in ((64, 64), (128, 96)):
        seen = []
        pipe(prompt="a cat", height=height, width=width, num_inference_steps=3, max_sequence_length=flux.max_sequence_length,
             output_type="latent", callback_on_step_end=lambda p, i, t, kw: seen.append(float(t)) or {})
        assert denoiser.sampler_at(height, width).tables["timestep"].tolist() == seen
    small, large = (denoiser.sampler_at(*size).tables["sigma"] for size in ((64, 64), (128, 96)))
    assert not torch.equal(small, large)  # the shift follows the patch count


def test_a_finished_flux_job_run_again_redoes_no_image(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 96, 64, 2), ("c", 64, 64, 3)))
    args = ("model=tiny_flux", "bcg.scope=step", f"sampler.steps={STEPS}")
    first = run(cpu_job(manifest, tmp_path / "out", *args))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out" / "images").iterdir()}
    again = run(cpu_job(manifest, tmp_path / "out", *args))
    assert first["images"]["ok"] == 3 and again["images"] == first["images"]  # the finished part, as committed
    assert {p.name: p.read_bytes() for p in (tmp_path / "out" / "images").iterdir()} == before
    assert png(tmp_path / "out" / "images" / "b.png").shape == (64, 96, 3)


@pytest.mark.parametrize("true_cfg", [1.0, 3.0])
def test_bench_job_takes_a_flux_model_against_flux_pipeline(tmp_path, true_cfg):
    from pipeline.bench import run_bench

    manifest_rows = rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 96, 64, 3))
    if true_cfg > 1:
        manifest_rows[0]["negative_prompt"] = "blurry"
    manifest = write_manifest(tmp_path / "m.parquet", manifest_rows)
    result = run_bench(cpu_job(manifest, tmp_path / "out", "+job=bench", "model=tiny_flux", "kernels.plan=eager",
                               "kernels.trim_text_padding=false", "bench.baseline_batch=2", f"sampler.steps={STEPS}",
                               f"sampler.true_cfg_scale={true_cfg}"))
    baseline = result["baseline"]
    assert (baseline["pipeline"], baseline["prompts"], baseline["calls"]) == ("FluxPipeline", "embeddings", 2)
    assert baseline["images"] == result["ours"]["images"] == 3
    assert result["vs_baseline_pixels"]["images"] == 3 and result["vs_baseline_pixels"]["max"] <= 2  # fp32, CPU


def test_auto_ladder_and_shards_serve_flux_like_any_family(tmp_path):
    """bcg.ladder=auto calibrates Flux's step (its per-resolution tables included); two shards of
    one job split the rows and merge into one complete output."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 96, 64, 2), ("c", 64, 64, 3)))
    args = ("model=tiny_flux", "bcg.scope=step", f"sampler.steps={STEPS}")
    report = run(cpu_job(manifest, tmp_path / "auto", *args, "bcg.ladder=auto", "bcg.auto_sizes=[1,2]"))
    assert report["images"]["ok"] == 3 and set(report["ladder_auto"]["chosen"]) <= {1, 2}
    for index in (0, 1):
        run(cpu_job(manifest, tmp_path / "shards", *args, f"shard.index={index}", "shard.count=2"))
    assert sorted(p.name for p in (tmp_path / "shards" / "images").iterdir()) == ["a.png", "b.png", "c.png"]
    assert (tmp_path / "shards" / "_SUCCESS").exists()


def test_a_small_job_encodes_its_prompts_in_one_call_of_their_token_budget(tmp_path, caplog):
    """By default a text-encoder call holds ENCODE_TOKENS tokens of prompts (at 512 T5 tokens, 8 of
    them), so 5 prompts are one call with 3 of padding, not a chunk of 64. A fixed
    runtime.encode_batch_size is part of what an image is made from: a resume with another count
    refuses the committed images."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"r{i}", 64, 64, i) for i in range(5)]))
    job = ("model=tiny_flux", "model.max_sequence_length=512", f"sampler.steps={STEPS}")
    with caplog.at_level("INFO", logger="pipeline.prompts"):
        report = run(cpu_job(manifest, tmp_path / "out", *job))
    per_call = ENCODE_TOKENS // 512
    assert report["images"]["ok"] == 5
    # that call ran at start-up (the first batch's prompts, and the rest of the chunk): every batch
    # found its prompts encoded
    assert {k: report["prompt_cache"][k] for k in ("encoded", "calls", "padding", "hits")} == \
        {"encoded": 5, "calls": 1, "padding": per_call - 5, "hits": 5}
    assert f"prompts: {per_call} per text-encoder call" in caplog.text
    assert prompts_per_call(512, fixed=64) == 64 and prompts_per_call(None) == prompts_per_call(1) == MOST_PER_CALL
    # calls of 64, as every job's before: the digest of outputs written then, which still resume
    assert encoding_digest(None, 32) == encoding_digest(64, 512) == {} != encoding_digest(None, 512)
    with pytest.raises(UserError, match=r"(?s)id 'r0': settings changed.*the prompts per text-encoder call"):
        run(cpu_job(manifest, tmp_path / "out", *job, "runtime.encode_batch_size=4"))
    with pytest.raises(UserError, match=r"runtime.encode_batch_size=0 must be >= 1, or null"):
        run(cpu_job(manifest, tmp_path / "zero", *job, "runtime.encode_batch_size=0"))
    assert not (tmp_path / "zero").exists()
