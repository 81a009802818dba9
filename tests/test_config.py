"""The conf/ tree: every option composes into the typed schema; mistakes fail at start."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from conftest import CONF, job_config
from pipeline.config import JobConfig, check_choices

GROUPS = ["model", "sampler", "bcg", "precision", "output", "runtime", "job"]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "override",
    [f"{g}={o}" if g != "job" else f"+job={o}" for g in GROUPS for o in options(g)]
    + [f"bcg/ladder={o}" for o in options("bcg/ladder")],
)
def test_every_config_option_composes_into_the_schema(override):
    cfg = job_config(override, "manifest.path=m.parquet", "output.dir=out")
    assert isinstance(cfg, JobConfig)
    check_choices(cfg)


def test_ladder_files_and_literal_override():
    assert job_config("manifest.path=m", "output.dir=o").bcg.ladder == [1, 2, 4, 8]
    assert job_config("bcg/ladder=pow2_16", "manifest.path=m", "output.dir=o").bcg.ladder == [1, 2, 4, 8, 16]
    assert job_config("bcg/ladder=one_8", "manifest.path=m", "output.dir=o").bcg.ladder == [1, 8]
    assert job_config("bcg.ladder=[1,2,4]", "manifest.path=m", "output.dir=o").bcg.ladder == [1, 2, 4]


@pytest.mark.parametrize("name", ["auto", "bf16", "fp16", "fp32", "fp8"])
def test_precision_files_keep_tf32_and_cudnn_benchmark_off(name):
    p = job_config(f"precision={name}", "manifest.path=m", "output.dir=o").precision
    assert (p.dtype, p.tf32, p.cudnn_benchmark) == (name, False, False)


def test_misspelt_key_fails_with_hydras_message():
    with pytest.raises(ConfigCompositionException) as err:
        job_config("sampler.stepz=3", "manifest.path=m")
    assert "stepz" in str(err.value.__cause__ or err.value)


def test_wrong_type_fails_with_hydras_message():
    with pytest.raises((ConfigCompositionException, ValidationError)) as err:
        job_config("sampler.steps=many", "manifest.path=m")
    assert "many" in str(err.value.__cause__ or err.value)


def test_value_outside_the_accepted_set_is_named():
    cfg = job_config("manifest.on_invalid=ignore", "manifest.path=m", "output.dir=o")
    with pytest.raises(ValueError, match=r"manifest.on_invalid='ignore'.*\['error', 'skip'\]"):
        check_choices(cfg)


def test_capture_choice_is_checked():
    cfg = job_config("bcg.capture=all", "manifest.path=m", "output.dir=o")
    with pytest.raises(ValueError, match=r"bcg.capture='all'.*\['plan', 'ladder'\]"):
        check_choices(cfg)
