"""Graph-safe samplers against diffusers' own schedulers (CPU, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import diffusers
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.samplers import SAMPLERS, Sampler, make_sampler, sampler_name_for

REPO = Path(__file__).resolve().parents[1]
TINY = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/tiny.yaml").scheduler.config)
SD3 = {"num_train_timesteps": 1000, "shift": 3.0}
DDIM_DEFAULT: dict = {}
DDIM_CUSTOM = {"clip_sample": True, "set_alpha_to_one": False, "steps_offset": 1, "timestep_spacing": "trailing"}
B, SHAPE = 3, (3, 4, 8, 8)
# Max abs difference allowed on the final latents, fp32 on the CPU, with a denoiser-like model that
# keeps the latents O(1). The tables reproduce diffusers' float32 scalar arithmetic and the step its
# elementwise ops, so the measured difference is 0; a float64 table rounded to float32 was already
# 5e-5 off after one step from t = 999, where x0 = (x - sigma eps) / alpha amplifies ulps by 157.
TOL = 1e-5

CASES = {  # id -> (sampler, scheduler class, config)
    "dpm_tiny": ("dpmpp_2m", "DPMSolverMultistepScheduler", TINY),
    "flow_sd3": ("flow_euler", "FlowMatchEulerDiscreteScheduler", SD3),
    "ddim_default": ("ddim", "DDIMScheduler", DDIM_DEFAULT),
    "ddim_custom": ("ddim", "DDIMScheduler", DDIM_CUSTOM),
}

DPM_VARIANTS = {
    "heun": {"solver_type": "heun"},
    "sigma_min": {"final_sigmas_type": "sigma_min"},
    "sigma_min_heun": {"final_sigmas_type": "sigma_min", "solver_type": "heun"},
    "karras": {"use_karras_sigmas": True},
    "trailing": {"timestep_spacing": "trailing"},
    "leading": {"timestep_spacing": "leading", "steps_offset": 1},
    "v_prediction": {"prediction_type": "v_prediction"},
    "sample": {"prediction_type": "sample"},
    "flow_sigmas": {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0},
    "order1": {"solver_order": 1},
    "euler_at_final": {"final_sigmas_type": "sigma_min", "euler_at_final": True},
    "no_lower_order_final": {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
    "scaled_linear": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
    "deis_alias": {"algorithm_type": "deis", "final_sigmas_type": "sigma_min"},  # diffusers maps it to dpmsolver++
    "zero_snr_v": {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction", "timestep_spacing": "trailing"},
}

DDIM_VARIANTS = {
    "v_prediction": {"prediction_type": "v_prediction"},
    "sample_clip": {"prediction_type": "sample", "clip_sample": True, "clip_sample_range": 1.5},
    "linspace": {"timestep_spacing": "linspace"},
    "leading_offset": {"steps_offset": 1, "set_alpha_to_one": False},
    "zero_snr_v": {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction", "timestep_spacing": "trailing"},
}


MIX = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mix_channels(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x [B,4,h,w] -> (scale * MIX) @ x over channels. A broadcast sum, not einsum: a BLAS call on
    tensors this small is slow when its threads compete for the CPU (8 ms a call seen under load)."""
    return (scale * MIX[:, :, None, None] * x[:, None]).sum(2)


def fake_x0(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Bounded, nonlinear in x and t, mixes channels; x [B,4,h,w], t [B] or scalar -> [B,4,h,w]."""
    t = t.to(torch.float32).expand(x.shape[0]).view(-1, 1, 1, 1)
    return torch.tanh(mix_channels(x, 0.5) + 0.3 * x) + 0.1 * torch.sin(t / 100)


def denoiser(cls: str, config: dict) -> Model:
    """A fake model shaped like a trained one, so that its x0 prediction, and the latents, stay O(1).
    With f = fake_x0 and abar_t the schedule's alphas_cumprod at t: epsilon and v models output
    sqrt(1 - abar_t) x + sqrt(abar_t) f (as eps: x0 = sqrt(abar_t) x - sqrt(1 - abar_t) f; as v:
    x0 = (sqrt(abar_t) + abar_t - 1) x - ..., both O(1)); flow models output v = x - f, so
    x0 = (1 - sigma) x + sigma f; sample models output f."""
    s = getattr(diffusers, cls).from_config(config)
    kind = "flow_prediction" if cls == "FlowMatchEulerDiscreteScheduler" else s.config.prediction_type
    alphas_cumprod = getattr(s, "alphas_cumprod", None)

    def model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if kind == "sample":
            return fake_x0(x, t)
        if kind == "flow_prediction":
            return x - fake_x0(x, t)
        abar = alphas_cumprod[t.long().expand(x.shape[0])].view(-1, 1, 1, 1)
        return (1 - abar).sqrt() * x + abar.sqrt() * fake_x0(x, t)

    return model


def exploding_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """No denoiser: DPM epsilon trajectories grow to |x| ~ 3e3, where one float32 ulp is 2.4e-4."""
    t = t.to(torch.float32).expand(x.shape[0]).view(-1, 1, 1, 1)
    return 0.3 * torch.tanh(x) + 0.1 * torch.sin(t / 100) + mix_channels(x, 0.2)


def noise() -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def run_diffusers(cls: str, config: dict, steps: int, model: Model,
                  schedule: dict | None = None) -> tuple[torch.Tensor, list[float]]:
    s = getattr(diffusers, cls).from_config(config)
    s.set_timesteps(steps, **(schedule or {}))
    x = noise() * getattr(s, "init_noise_sigma", 1.0)  # FlowMatchEuler has neither attribute
    scale = getattr(s, "scale_model_input", lambda x, t: x)
    ts = []
    for t in s.timesteps:
        ts.append(float(t))
        x = s.step(model(scale(x, t), t), t, x).prev_sample
    return x, ts


def run_ours(sampler: Sampler, model: Model) -> tuple[torch.Tensor, list[float]]:
    x = noise() * sampler.init_noise_sigma
    prev = torch.zeros_like(x)
    ts = []
    for k in range(sampler.steps):
        i = torch.full((B,), k)
        t = sampler.timestep(i)
        assert t.dtype == torch.float32 and t.shape == (B,) and bool((t == t[0]).all())
        ts.append(float(t[0]))
        x, prev = sampler.step(i, x, model(x, t), prev)
    return x, ts


def compare(name: str, cls: str, config: dict, steps: int, ref_cls: str | None = None,
            schedule: dict | None = None) -> float:
    """Max abs difference of our final latents from those of diffusers' `ref_cls` (default: `cls`);
    `schedule`: set_timesteps keywords of the image size (Flux's sigmas and mu)."""
    ref_cls = ref_cls or cls
    model = denoiser(ref_cls, config)
    ref, ref_ts = run_diffusers(ref_cls, config, steps, model, schedule)
    out, ts = run_ours(make_sampler(name, cls, config, steps, "cpu", schedule), model)
    assert ts == ref_ts
    assert torch.isfinite(ref).all() and ref.abs().max() < 10  # the denoiser keeps latents O(1)
    diff = (out - ref).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g}"
    return diff


@pytest.mark.parametrize("steps", [1, 2, 20, 50])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers(case: str, steps: int):
    name, cls, config = CASES[case]
    compare(name, cls, config, steps)
    compare("default", cls, config, steps)


@pytest.mark.parametrize("steps", [5, 20])
@pytest.mark.parametrize("variant", list(DPM_VARIANTS))
def test_dpm_variants_match_diffusers(variant: str, steps: int):
    compare("dpmpp_2m", "DPMSolverMultistepScheduler", {**TINY, **DPM_VARIANTS[variant]}, steps)


@pytest.mark.parametrize("variant", list(DDIM_VARIANTS))
def test_ddim_variants_match_diffusers(variant: str):
    compare("ddim", "DDIMScheduler", DDIM_VARIANTS[variant], 20)


@pytest.mark.parametrize("config", [{**SD3, "shift": 1.0}, {**SD3, "use_karras_sigmas": True}])
def test_flow_variants_match_diffusers(config: dict):
    compare("flow_euler", "FlowMatchEulerDiscreteScheduler", config, 20)


FLUX_DEV = OmegaConf.to_container(OmegaConf.load(REPO / "conf/model/flux_dev.yaml").scheduler.config)


@pytest.mark.parametrize("side", [512, 1024])
def test_flux_schedule_of_each_resolution_matches_diffusers(side: int):
    """FluxPipeline's schedule: sigmas linspace(1, 1/steps, steps), shifted by the mu of the image's
    patch count; the tables differ per resolution."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    steps = 8
    schedule = {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": calculate_shift((side // 16) ** 2)}
    compare("flow_euler", "FlowMatchEulerDiscreteScheduler", FLUX_DEV, steps, schedule=schedule)
    other = {**schedule, "mu": calculate_shift(32**2 if side != 512 else 64**2)}
    tables = [make_sampler("default", "FlowMatchEulerDiscreteScheduler", FLUX_DEV, steps, "cpu", s).tables
              for s in (schedule, other)]
    assert not torch.equal(tables[0]["timestep"], tables[1]["timestep"])


def test_dynamic_shifting_needs_the_models_shift():
    with pytest.raises(ValueError, match="needs the shift of each resolution"):
        make_sampler("default", "FlowMatchEulerDiscreteScheduler", FLUX_DEV, 8, "cpu")
    with pytest.raises(ValueError, match=r"takes no \['sigmas'\]"):
        make_sampler("dpmpp_2m", "FlowMatchEulerDiscreteScheduler", TINY, 8, "cpu", {"sigmas": [1.0], "mu": 1.0})


def test_explicit_sampler_on_a_pixart_config():
    """sampler=ddim on a DPM checkpoint: DDIM's schedule from the same config keys."""
    compare("ddim", "DPMSolverMultistepScheduler", TINY, 20, ref_cls="DDIMScheduler")


@pytest.mark.parametrize("case", list(CASES))
def test_matches_diffusers_when_latents_explode(case: str):
    """Stress case: latents far from O(1). Checked relative to their scale, max(1, |ref|)."""
    name, cls, config = CASES[case]
    ref, _ = run_diffusers(cls, config, 50, exploding_model)
    out, _ = run_ours(make_sampler(name, cls, config, 50, "cpu"), exploding_model)
    assert torch.isfinite(ref).all()
    diff, scale = (out - ref).abs().max().item(), ref.abs().max().item()
    assert diff <= TOL * max(1.0, scale), f"max abs diff {diff:.3g} at |ref| max {scale:.3g}"


@pytest.mark.parametrize("cls", list(SAMPLERS.values()))
def test_scale_model_input_is_identity(cls: str):
    s = getattr(diffusers, cls).from_config(CASES[next(k for k, v in CASES.items() if v[1] == cls)][2])
    s.set_timesteps(10)
    x = noise()
    if hasattr(s, "scale_model_input"):  # FlowMatchEuler has none; its pipelines feed x as is
        for t in s.timesteps:
            assert torch.equal(s.scale_model_input(x, t), x)
    assert getattr(s, "init_noise_sigma", 1.0) == 1.0


UNSUPPORTED = [
    ("DPMSolverMultistepScheduler", {**TINY, "algorithm_type": "sde-dpmsolver++"}, "algorithm_type"),
    ("DPMSolverMultistepScheduler", {**TINY, "algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"},
     "algorithm_type"),
    ("DPMSolverMultistepScheduler", {**TINY, "algorithm_type": "bogus"}, "algorithm_type='bogus'"),
    ("DPMSolverMultistepScheduler", {**TINY, "solver_type": "bogus"}, "solver_type='bogus'"),
    ("DPMSolverMultistepScheduler", {**TINY, "solver_order": 3}, "solver_order"),
    ("DPMSolverMultistepScheduler", {**TINY, "thresholding": True}, "thresholding"),
    ("DPMSolverMultistepScheduler", {**TINY, "variance_type": "learned_range"}, "variance_type"),
    ("DPMSolverMultistepScheduler", {**TINY, "use_dynamic_shifting": True}, "use_dynamic_shifting"),
    ("FlowMatchEulerDiscreteScheduler", {**SD3, "use_dynamic_shifting": True}, "use_dynamic_shifting"),
    ("FlowMatchEulerDiscreteScheduler", {**SD3, "stochastic_sampling": True}, "stochastic_sampling"),
    ("DDIMScheduler", {"thresholding": True}, "thresholding"),
    ("DDIMScheduler", {"prediction_type": "flow_prediction"}, "prediction_type"),
]


@pytest.mark.parametrize("cls,config,option", UNSUPPORTED, ids=[f"{c[:4]}-{o}" for c, _, o in UNSUPPORTED])
def test_unsupported_options_raise(cls: str, config: dict, option: str):
    with pytest.raises(ValueError, match=option):
        make_sampler("default", cls, config, 20, "cpu")


def test_bad_names_and_steps_raise():
    with pytest.raises(ValueError, match="EulerDiscreteScheduler"):
        sampler_name_for("EulerDiscreteScheduler")
    with pytest.raises(ValueError, match="'unipc'"):
        make_sampler("unipc", "DPMSolverMultistepScheduler", TINY, 20, "cpu")
    with pytest.raises(ValueError, match="steps"):
        make_sampler("default", "DPMSolverMultistepScheduler", TINY, 0, "cpu")
    assert {sampler_name_for(c) for c in SAMPLERS.values()} == set(SAMPLERS)


@pytest.mark.parametrize("case", list(CASES))
def test_rows_are_independent(case: str):
    name, cls, config = CASES[case]
    sampler, model = make_sampler(name, cls, config, 20, "cpu"), denoiser(cls, config)
    g = torch.Generator().manual_seed(1)
    x, prev = noise(), torch.zeros(SHAPE)
    for k in range(sampler.steps):
        i = torch.full((B,), k)
        eps = model(x, sampler.timestep(i))
        x_next, x0 = sampler.step(i, x, eps, prev)
        # the other rows replaced by anything, including NaN and inf
        x2, eps2, prev2 = x.clone(), eps.clone(), prev.clone()
        x2[1:], eps2[1] = torch.randn((B - 1, *SHAPE[1:]), generator=g) * 50, float("nan")
        eps2[2], prev2[1:] = float("inf"), float("nan")
        y_next, y0 = sampler.step(i, x2, eps2, prev2)
        assert torch.equal(y_next[0], x_next[0]) and torch.equal(y0[0], x0[0])
        x, prev = x_next, x0


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
def test_prev_is_ignored_at_first_order_steps(case: str, garbage: float):
    name, cls, config = CASES[case]
    sampler, model = make_sampler(name, cls, config, 20, "cpu"), denoiser(cls, config)
    x = noise()
    # step 0 always; DPM's last step too (first order when the final sigma is zero, as in PixArt)
    for k in (0, sampler.steps - 1):
        i = torch.full((B,), k)
        eps = model(x, sampler.timestep(i))
        zero = sampler.step(i, x, eps, torch.zeros(SHAPE))
        junk = sampler.step(i, x, eps, torch.full(SHAPE, garbage))
        assert torch.equal(zero[0], junk[0]) and torch.equal(zero[1], junk[1])
        assert torch.isfinite(zero[0]).all()


def test_second_order_steps_of_dpm_use_prev():
    """The flags diffusers' state machine implies: 2M is first order at step 0 and, with a zero
    final sigma, at the last step, whatever the step count."""
    for steps, final in [(20, "zero"), (50, "zero"), (20, "sigma_min"), (10, "sigma_min")]:
        s = make_sampler("default", "DPMSolverMultistepScheduler", {**TINY, "final_sigmas_type": final}, steps, "cpu")
        second = s.tables["second_order"].tolist()
        last = final == "sigma_min" and steps >= 15
        assert second == [0.0] + [1.0] * (steps - 2) + [float(last)]


@pytest.mark.parametrize("case", list(CASES))
def test_tables_are_fixed_device_tensors(case: str):
    """Graphs read the tables at replay: they must be allocated once and never rebound or written."""
    name, cls, config = CASES[case]
    sampler = make_sampler(name, cls, config, 50, "cpu")
    before = {k: (v.data_ptr(), v.clone()) for k, v in sampler.tables.items()}
    assert all(v.dtype == torch.float32 and v.shape == (50,) for v in sampler.tables.values())
    assert all(torch.isfinite(v).all() for k, v in sampler.tables.items() if k != "clip")  # clip may be +inf
    run_ours(sampler, denoiser(cls, config))
    for k, (ptr, values) in before.items():
        assert sampler.tables[k].data_ptr() == ptr and torch.equal(sampler.tables[k], values)


@pytest.mark.parametrize("case", list(CASES))
def test_step_reads_no_values_on_the_host(case: str):
    """On the meta device tensors have shapes but no values, so any .item(), .tolist(), bool(t) or
    value-dependent shape inside timestep/step would raise."""
    name, cls, config = CASES[case]
    sampler = make_sampler(name, cls, config, 20, "meta")
    i = torch.zeros(B, dtype=torch.int64, device="meta")
    x = torch.empty(SHAPE, device="meta", dtype=torch.bfloat16)
    t = sampler.timestep(i)
    x_next, x0 = sampler.step(i, x, torch.empty(SHAPE, device="meta"), torch.empty(SHAPE, device="meta"))
    assert t.shape == (B,) and x_next.shape == SHAPE and x_next.dtype == torch.bfloat16
    assert x0.dtype == torch.float32


def test_low_precision_latents_keep_their_dtype():
    cls = "DPMSolverMultistepScheduler"
    sampler, model = make_sampler("default", cls, TINY, 20, "cpu"), denoiser(cls, TINY)
    x = noise().to(torch.bfloat16)
    i = torch.zeros(B, dtype=torch.int64)
    x_next, x0 = sampler.step(i, x, model(x.float(), sampler.timestep(i)).to(torch.bfloat16), torch.zeros(SHAPE))
    assert x_next.dtype == torch.bfloat16 and x0.dtype == torch.float32
