"""bcg.scope on the CPU: the graph-safe samplers run eagerly with graphs off, and scopes agree."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from conftest import cpu_job, png
from pipeline.demo import demo_table
from pipeline.job import run

# forward runs diffusers' scheduler, step/loop our tables: fp32 on the CPU they agree to rounding.
FORWARD_VS_STEP_MAX_LEVELS = 1


@pytest.fixture(scope="module")
def scope_runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("scopes")
    manifest = d / "demo.parquet"
    pq.write_table(demo_table(), manifest)
    reports = {scope: run(cpu_job(manifest, d / scope, f"bcg.scope={scope}")) for scope in ("forward", "step", "loop")}
    return d, reports


def test_every_scope_generates_every_image(scope_runs):
    d, reports = scope_runs
    for scope, report in reports.items():
        assert report["images"]["ok"] == 12 and report["scope"] == scope
        assert len(list((d / scope / "images").iterdir())) == 12
    assert reports["forward"]["sampler"] == "DPMSolverMultistepScheduler"
    assert reports["step"]["sampler"] == reports["loop"]["sampler"] == "dpmpp_2m"


def test_step_and_loop_give_identical_pngs(scope_runs):
    d, _ = scope_runs
    for image in (d / "step" / "images").iterdir():
        assert image.read_bytes() == (d / "loop" / "images" / image.name).read_bytes(), image.name


def test_forward_and_step_agree_within_the_stated_tolerance(scope_runs):
    d, _ = scope_runs
    worst = max(
        np.abs(png(image).astype(int) - png(d / "step" / "images" / image.name).astype(int)).max()
        for image in (d / "forward" / "images").iterdir()
    )
    assert worst <= FORWARD_VS_STEP_MAX_LEVELS, worst


@pytest.mark.parametrize(("model", "sampler"), [("tiny", "ddim"), ("tiny_sd3", "flow_euler")])
def test_named_sampler_runs_in_the_loop_scope(tmp_path, model, sampler):
    manifest = tmp_path / "demo.parquet"
    pq.write_table(demo_table().slice(0, 3), manifest)
    report = run(cpu_job(manifest, tmp_path / "out", f"model={model}", "bcg.scope=loop", f"sampler={sampler}",
                         "sampler.steps=3"))
    assert report["images"]["ok"] == 3 and report["sampler"] == sampler


@pytest.mark.parametrize(("model", "sampler", "reads", "predicts", "fitting"), [
    ("tiny", "flow_euler", "a flow-matching velocity", "the noise (epsilon)", "DPMSolverMultistepScheduler); choose "
     "sampler=default (the checkpoint's own) or dpmpp_2m or ddim"),
    ("tiny_sd3", "dpmpp_2m", "the noise (epsilon)", "a flow-matching velocity", "FlowMatchEulerDiscreteScheduler); "
     "choose sampler=default (the checkpoint's own) or flow_euler"),
    ("tiny_flux", "ddim", "the noise (epsilon)", "a flow-matching velocity", "FlowMatchEulerDiscreteScheduler); "
     "choose sampler=default (the checkpoint's own) or flow_euler"),
])
def test_a_sampler_that_misreads_the_models_output_is_refused_before_anything_is_written(
        tmp_path, model, sampler, reads, predicts, fitting):
    """A flow-matching sampler on a noise-predicting model (or the reverse) would make noise, not images."""
    manifest = tmp_path / "demo.parquet"
    pq.write_table(demo_table().slice(0, 1), manifest)
    for scope in ("forward", "step"):
        with pytest.raises(ValueError) as refused:
            run(cpu_job(manifest, tmp_path / "out", f"model={model}", f"sampler={sampler}", f"bcg.scope={scope}"))
        assert str(refused.value) == (f"sampler={sampler} reads the model's output as {reads}, but this model's "
                                      f"transformer predicts {predicts} (its scheduler: {fitting}")
    assert not (tmp_path / "out").exists()


def test_unknown_scope_and_sampler_are_named(tmp_path):
    manifest = tmp_path / "demo.parquet"
    pq.write_table(demo_table().slice(0, 1), manifest)
    with pytest.raises(ValueError, match=r"bcg.scope='graph'.*\['forward', 'step', 'loop'\]"):
        run(cpu_job(manifest, tmp_path / "out", "bcg.scope=graph"))
    with pytest.raises(ValueError, match=r"sampler.name='euler'"):
        run(cpu_job(manifest, tmp_path / "out", "sampler.name=euler"))
