"""What a job runs by default, from configs alone: each model's own sampler settings (a user's value
wins), the precision for the device, and the kernel plan for the family, device and precision
(pipeline/plans.py), with expert settings over it; what the log, `--cfg job`, stats.json and every
row say about them."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import CONF, job_config, rows, run_cli, write_manifest
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.kernels import check_kernels
from pipeline.model_info import sampler_defaults
from pipeline.plans import DEFAULT_PLANS, PLANS, KernelSettings, resolve_plan
from pipeline.precision import resolve_precision

# Each shipped model file -> (steps, guidance) its checkpoint's pipeline runs by default.
OWN_SAMPLERS = {"tiny": (20, 4.5), "digits": (20, 4.5), "pixart_sigma": (20, 4.5), "tiny_dit": (50, 4.0),
                "dit_xl_2_256": (50, 4.0), "tiny_flux": (28, 3.5), "flux_dev": (28, 3.5), "flux_schnell": (4, 0.0),
                "tiny_sd3": (28, 7.0), "sd3_medium": (28, 7.0), "tiny_sd35_large": (28, 3.5), "sd35_large": (28, 3.5),
                "tiny_sd35_medium": (40, 4.5), "sd35_medium": (40, 4.5)}
FAMILY = {"tiny": "pixart", "digits": "pixart", "pixart_sigma": "pixart", "tiny_dit": "dit", "dit_xl_2_256": "dit",
          "tiny_flux": "flux", "flux_dev": "flux", "flux_schnell": "flux", "tiny_sd3": "sd3", "sd3_medium": "sd3",
          "tiny_sd35_large": "sd3", "sd35_large": "sd3", "tiny_sd35_medium": "sd3", "sd35_medium": "sd3"}
# family -> the plan `auto` picks on CUDA in bf16, and in float8 (None: refused)
ON_CUDA = {"pixart": ("fast", "fast-fp8"), "sd3": ("sd3", "sd3-fp8"), "dit": ("eager", None),
           "flux": ("flux", "flux-fp8")}


@pytest.mark.parametrize("name", sorted(OWN_SAMPLERS))
def test_every_model_config_states_its_own_sampler_settings_and_a_users_value_wins(name):
    """The composed job (+job=dataset, which sets none) runs the model's own steps and guidance; a
    sampler.* the user gives wins; the shipped file states them itself (not a pipeline's fallback)."""
    job = job_config("+job=dataset", f"model={name}", "manifest.path=m", "output.dir=o")
    assert (job.model.steps, job.model.guidance_scale) == OWN_SAMPLERS[name]
    assert sampler_defaults(job.model).source == f"model {job.model.name}'s config"
    assert (job.sampler.steps, job.sampler.guidance_scale) == (None, None)  # filled in when the job starts
    given = job_config("+job=dataset", f"model={name}", "sampler.steps=7", "manifest.path=m", "output.dir=o")
    assert given.sampler.steps == 7


def test_a_checkpoint_directory_takes_its_pipelines_defaults(tmp_path):
    """model=pretrained: steps and guidance (and FLUX.1-schnell's 256 tokens) from the directory's
    pipeline class and transformer config; a directory that is none is named."""
    def checkpoint(name: str, pipeline: str, **transformer) -> Path:
        root = tmp_path / name
        (root / "transformer").mkdir(parents=True)
        (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        (root / "transformer" / "config.json").write_text(json.dumps(transformer))
        return root

    from pipeline.model_info import default_tokens

    for directory, want, tokens in (
            (checkpoint("dev", "FluxPipeline", guidance_embeds=True), (28, 3.5), None),
            (checkpoint("schnell", "FluxPipeline", guidance_embeds=False), (4, 0.0), 256),
            (checkpoint("sd3", "StableDiffusion3Pipeline"), (28, 7.0), None),
            (checkpoint("sigma", "PixArtSigmaPipeline"), (20, 4.5), None)):
        model = job_config("model=pretrained", f"model.path={directory}", "manifest.path=m", "output.dir=o").model
        own = sampler_defaults(model)
        assert (own.steps, own.guidance_scale) == want and default_tokens(model) == tokens
    with pytest.raises(UserError, match="model.path=.*: no model_index.json there"):
        sampler_defaults(job_config("model=pretrained", f"model.path={tmp_path}", "manifest.path=m", "output.dir=o").model)


def test_cfg_job_the_log_stats_and_rows_say_what_ran(tmp_path):
    """`--cfg job` prints the model's own sampler settings (not null), a given one as given; a job's log
    starts with them, the precision chosen for the device and the kernel plan; stats.json records the
    plan and the precision's choice; every row its steps and guidance."""
    shown = run_cli("+job=dataset", "model=flux_schnell", "--cfg", "job")
    assert shown.returncode == 0, shown.stderr
    assert "  steps: 4\n  guidance_scale: 0.0\n" in shown.stdout
    given = run_cli("+job=dataset", "model=flux_dev", "sampler.guidance_scale=5", "--cfg", "job")
    assert "  steps: 28\n  guidance_scale: 5.0\n" in given.stdout
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 32, 32, 1)))
    out = tmp_path / "out"
    proc = run_cli("+job=dataset", "model=tiny_flux", f"manifest.path={manifest}", f"output.dir={out}",
                   "runtime.device=cpu", "runtime.progress=false", "sampler.steps=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "run.log").read_text()
    first = log.splitlines()[:3]
    assert "model tiny_flux: 2 steps, guidance 3.5 (set for this job)" in first[0]
    assert "device cpu, precision fp32 (precision=auto: bf16 on CUDA, fp32 on a CPU)" in first[1]
    assert "kernels.plan=eager (auto: flux on cpu): PyTorch's own kernels" in first[2]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["kernels"]["plan"] == "eager" and stats["kernels"]["chosen"] == "auto: flux on cpu"
    assert stats["precision"] == {"dtype": "fp32", "tf32": False, "cudnn_benchmark": False, "requested": "auto"}
    table = pq.read_table(out / "shards").to_pylist()
    assert [(r["steps"], r["guidance_scale"]) for r in table] == [(2, 3.5)]


@pytest.mark.parametrize("family", sorted(ON_CUDA))
def test_the_default_plan_resolves_as_documented(family):
    """auto: eager kernels on a CPU; the family's plan on CUDA in bf16 and float8 (or float8 refused,
    naming why and the families that have one); every default plan passes the kernel checks for its
    family and exists in PLANS."""
    bf16, fp8 = ON_CUDA[family]
    assert resolve_plan("auto", {}, family, "cpu", False).name == "eager"
    on_cuda = resolve_plan("auto", {}, family, "cuda", False)
    assert on_cuda.name == bf16 and on_cuda.settings == PLANS[bf16].resolved() and on_cuda.overrides == {}
    check_kernels(on_cuda.settings, family)
    if fp8:
        plan = resolve_plan("auto", {}, family, "cuda", True)
        assert plan.name == fp8 and plan.settings.fp8 and PLANS[fp8].float8 and PLANS[fp8].cuda_only
        check_kernels(plan.settings, family)
    else:
        with pytest.raises(UserError, match=rf"precision=fp8 is not offered for model family '{family}': .*"
                                            r"kernels.plan=auto picks a float8 plan for \['flux', 'pixart', 'sd3'\]; choose precision=bf16"):
            resolve_plan("auto", {}, family, "cuda", True)
    for named in [name for name, plan in PLANS.items() if family in plan.families and plan.cuda_only]:
        plan = resolve_plan(named, {}, family, "cuda", PLANS[named].float8)  # every plan of the family, by name
        assert plan.name == named and plan.settings.fp8 == PLANS[named].float8
        check_kernels(plan.settings, family)
    with pytest.raises(UserError, match="precision=fp8 needs a CUDA GPU with float8 tensor cores"):
        resolve_plan("auto", {}, family, "cpu", True)
    assert set(DEFAULT_PLANS.values()) <= set(PLANS)


def test_expert_settings_override_the_plan_and_wrong_plans_are_refused_by_name():
    """A kernels.* value given overrides the plan's and is recorded as an override (the plan's own value
    given again is none); a plan for another family, another device or another precision is refused
    naming the plan and what to choose; the product's bench command resolves for Flux as it is."""
    plan = resolve_plan("auto", {"fuse_decoder": False, "fuse_gelu": True, "attention": None}, "flux", "cuda", False)
    assert plan.name == "flux" and not plan.settings.fuse_decoder and plan.overrides == {"fuse_decoder": False}
    assert "overridden by the command: kernels.fuse_decoder=False" in plan.describe()
    # the decoder's other way, given, turns the plan's fused decoder off; both given are refused
    plan = resolve_plan("flux", {"compile_decoder": True}, "flux", "cuda", False)
    assert plan.settings.compile_decoder and not plan.settings.fuse_decoder and plan.overrides == {"compile_decoder": True}
    # a plan's setting that needs what the command changed goes off with it, said; given, it is refused
    plan = resolve_plan("auto", {"compile_dynamic": False}, "flux", "cuda", True)
    assert plan.name == "flux-fp8" and plan.settings.compile and not plan.settings.precompile
    assert plan.to_dict()["off_with"] == {"precompile": "kernels.compile_dynamic=true"}
    assert "off with them: kernels.precompile (it needs kernels.compile_dynamic=true)" in plan.describe()
    check_kernels(plan.settings, "flux", None)
    given = resolve_plan("flux", {"compile_dynamic": False, "precompile": True}, "flux", "cuda", False)
    assert given.settings.precompile and "off_with" not in given.to_dict()
    with pytest.raises(UserError, match="kernels.precompile saves the compiled blocks .* set those, or kernels.precompile=false"):
        check_kernels(given.settings, "flux", None)
    both = resolve_plan("flux", {"compile_decoder": True, "fuse_decoder": True}, "flux", "cuda", False)
    with pytest.raises(UserError, match="kernels.fuse_decoder=true runs the VAE decoder on Triton kernels of its own.*"
                                        "cannot be combined with kernels.compile_decoder=true"):
        check_kernels(both.settings, "flux", None)
    with pytest.raises(UserError, match=r"kernels.plan=fast serves model families \['pixart'\], not 'flux'; choose auto "
                                        r"or one of \['eager', 'compiled', 'flux', 'flux-fp8'\]"):
        resolve_plan("fast", {}, "flux", "cuda", False)
    with pytest.raises(UserError, match=r"kernels.plan=flux runs on CUDA only .*choose kernels.plan=auto"):
        resolve_plan("flux", {}, "flux", "cpu", False)
    with pytest.raises(UserError, match=r"kernels.plan=flux-fp8 is a float8 plan: choose it with precision=fp8"):
        resolve_plan("flux-fp8", {}, "flux", "cuda", False)
    with pytest.raises(UserError, match=r"kernels.plan='fastest' is not a plan; choose auto or one of"):
        resolve_plan("fastest", {}, "pixart", "cuda", False)
    bench = job_config("+job=bench", "model=flux_dev", "output.dir=o")
    overrides = {key: getattr(bench.kernels, key) for key in KernelSettings.__dataclass_fields__}
    assert resolve_plan(bench.kernels.plan, overrides, "flux", "cuda", True).name == "flux-fp8"
    with pytest.raises(UserError, match=r"kernels.plan='fastest' is not accepted; choose one of \['auto', 'eager'"):
        from pipeline.config import check_choices

        check_choices(job_config("kernels.plan=fastest", "manifest.path=m", "output.dir=o"))


def test_precision_follows_the_device_and_float8_is_refused_off_cuda_before_any_model(tmp_path):
    """precision=auto: bf16 on CUDA, fp32 on a CPU; fp8 is bf16 with the float8 plan; on a CPU a float8
    job is refused at start with the reason, before anything is generated."""
    assert resolve_precision("auto", torch.device("cuda")).dtype == "bf16"
    assert resolve_precision("auto", torch.device("cpu")).dtype == "fp32"
    fp8 = resolve_precision("fp8", torch.device("cuda"))
    assert (fp8.dtype, fp8.float8) == ("bf16", True)
    assert job_config("manifest.path=m").precision.dtype == "auto" and (CONF / "precision" / "fp8.yaml").is_file()
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 32, 32, 1)))
    with pytest.raises(UserError, match="precision=fp8 needs a CUDA GPU with float8 tensor cores"):
        run(job_config(f"manifest.path={manifest}", f"output.dir={tmp_path / 'out'}", "model=tiny_flux", "precision=fp8",
                       "runtime.device=cpu"))
    assert not (tmp_path / "out" / "shards").exists()


def test_the_kernels_page_shows_the_default_plans_every_plan_and_every_setting():
    """docs/kernels.md as a user reads it: its table of what `auto` picks is DEFAULT_PLANS (and the
    refusals), it has a row for every plan and one for every kernel setting."""
    from pipeline.plans import FP8_REFUSALS, SETTINGS

    page = (Path(__file__).resolve().parents[1] / "docs/kernels.md").read_text()
    cells = lambda line: [cell.strip() for cell in line.strip().strip("|").split(" | ")]  # noqa: E731
    rows_of = lambda header: [cells(line) for line in page.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]]  # noqa: E731
    names = {"PixArt": "pixart", "SD3 (SD3, SD3.5)": "sd3", "DiT": "dit", "Flux": "flux"}
    defaults = {names[family]: (cpu, bf16, fp8) for family, cpu, bf16, fp8 in rows_of("| family | CPU |")}
    assert set(defaults) == set(ON_CUDA)
    for family, (cpu, bf16, fp8) in defaults.items():
        assert cpu == "`eager`" and bf16 == f"`{DEFAULT_PLANS[family, False]}`", family
        if (family, True) in DEFAULT_PLANS:
            assert fp8 == f"`{DEFAULT_PLANS[family, True]}`", family
        else:
            assert fp8 == f"refused: {FP8_REFUSALS[family].removeprefix('it has ')}", family
    assert [row[0].strip("`") for row in rows_of("| plan | families |")] == list(PLANS)
    documented = {name for row in rows_of("| key | what it does |") for name in row[0].replace("`", "").split(", ")}
    assert documented == set(SETTINGS)
