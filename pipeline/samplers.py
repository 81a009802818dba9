"""Graph-safe samplers: diffusers' schedules, our own stateless update rules.

diffusers' schedulers keep Python state between steps (a step counter, the previous model output)
and read values on the host (`.item()`), so they cannot live inside a CUDA graph. Here the schedule
still comes from diffusers, as the single source of truth: the scheduler class is built on the CPU
from the checkpoint's config and `set_timesteps(steps)` is called once. Everything a step needs is
precomputed from it (float64 math) into float32 tables on the device, one entry per step. A step is
then pure tensor math: gather the step's coefficients per row (`table[i]`, `i` an int64 device
tensor that the graph reads at replay), combine x, the model output and the previous x0 prediction.
No Python state between steps, no host sync, no allocation whose size depends on a value.

The one piece of state a multistep solver needs, the previous step's x0 prediction, is carried by
the caller: `x, prev = sampler.step(i, x, eps, prev)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import diffusers
import numpy as np
import torch

Tensors = dict[str, torch.Tensor]

SAMPLERS = {
    "dpmpp_2m": "DPMSolverMultistepScheduler",
    "flow_euler": "FlowMatchEulerDiscreteScheduler",
    "ddim": "DDIMScheduler",
}

# Config options that change the UPDATE RULE, with the values we implement. Every other option only
# shapes the schedule (timesteps, sigmas, alphas_cumprod), which diffusers computes for us.
# DDIM's `eta` is a step() argument, not a config option: we implement eta = 0 (what pipelines pass).
SUPPORTED_OPTIONS: dict[str, dict[str, tuple[Any, ...]]] = {
    "dpmpp_2m": {
        "algorithm_type": ("dpmsolver++",),
        "solver_order": (1, 2),
        "solver_type": ("midpoint", "heun"),
        "prediction_type": ("epsilon", "v_prediction", "sample", "flow_prediction"),
        "final_sigmas_type": ("zero", "sigma_min"),
        "thresholding": (False,),
        "variance_type": (None,),  # learned variance is split off by the pipeline, not the scheduler
        "use_dynamic_shifting": (False,),  # needs a per-resolution `mu` we are not given
    },
    "flow_euler": {
        "stochastic_sampling": (False,),
        "use_dynamic_shifting": (False,),
    },
    "ddim": {
        "prediction_type": ("epsilon", "v_prediction", "sample"),
        "thresholding": (False,),
    },
}


def sampler_name_for(scheduler_class: str) -> str:
    """The checkpoint's diffusers scheduler class -> our sampler name."""
    for name, cls in SAMPLERS.items():
        if cls == scheduler_class:
            return name
    raise ValueError(
        f"no graph-safe sampler for scheduler class {scheduler_class!r}; supported classes: "
        f"{sorted(SAMPLERS.values())} (or choose one with sampler={'|'.join(SAMPLERS)})"
    )


def _per_row(tables: Tensors, i: torch.Tensor, ndim: int, *keys: str) -> list[torch.Tensor]:
    """Each table's entry at step i[b], shaped [B, 1, ..., 1] to broadcast over one row's latents."""
    shape = (-1,) + (1,) * (ndim - 1)
    return [tables[k][i].view(shape) for k in keys]


# Update rules: tables (each float32 [steps]), i int64 [B], x / eps / prev float32 [B,C,h,w]
# -> (x_next, x0), both float32 [B,C,h,w].
def dpmpp_2m_update(tables: Tensors, i, x, eps, prev):
    """DPM-Solver++ (2M), data-prediction form, written as
    x_next = x_scale * x + x0_coef * x0 + d1_coef * (x0 - prev)
    where x0_coef and d1_coef fold in the step sizes h and the ratio r0 of the last two."""
    ax, ae, cx, c0, c1, second = _per_row(
        tables, i, x.dim(), "x0_from_x", "x0_from_eps", "x_scale", "x0_coef", "d1_coef", "second_order"
    )
    x0 = ax * x + ae * eps
    # First-order steps (step 0 among them) must not read prev at all: 0 * NaN would still be NaN.
    m1 = torch.where(second > 0, prev, x0)
    return cx * x + c0 * x0 + c1 * (x0 - m1), x0


def flow_euler_update(tables: Tensors, i, x, v, prev):
    """Rectified flow: x_next = x + (sigma_next - sigma) * v; x0 = x - sigma * v."""
    sigma, dt = _per_row(tables, i, x.dim(), "sigma", "dt")
    return x + dt * v, x - sigma * v


def ddim_update(tables: Tensors, i, x, eps, prev):
    """DDIM with eta = 0: x_next = sqrt(a_prev) * clip(x0) + sqrt(1 - a_prev) * eps_pred."""
    ax, ae, ex, ee, clip, sa, sb = _per_row(
        tables, i, x.dim(), "x0_from_x", "x0_from_eps", "eps_from_x", "eps_from_eps", "clip", "x0_scale", "eps_scale"
    )
    x0 = torch.clamp(ax * x + ae * eps, min=-clip, max=clip)  # clip = +inf when clip_sample is off
    return sa * x0 + sb * (ex * x + ee * eps), x0


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, never compared by tensor values
class Sampler:
    """One per (config, steps, device). `tables` are float32 [steps] device tensors, allocated once
    here; a captured graph reads them at replay, so nothing may reallocate or rebind them."""

    name: str
    steps: int
    tables: Tensors
    init_noise_sigma: float

    def timestep(self, i: torch.Tensor) -> torch.Tensor:
        """i: int64 [B] step positions -> the model's timestep input, float32 [B]."""
        return self.tables["timestep"][i]

    def step(
        self, i: torch.Tensor, x: torch.Tensor, eps: torch.Tensor, prev: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """i int64 [B]; x [B,C,h,w] any float dtype; eps the (guided) model output [B,C,h,w];
        prev float32 [B,C,h,w], the previous step's x0 prediction (ignored at first-order steps,
        step 0 among them). -> (x_next in x.dtype, x0 prediction float32). Math in float32."""
        x_next, x0 = _UPDATES[self.name](self.tables, i, x.float(), eps.float(), prev.float())
        return x_next.to(x.dtype), x0


def dpmpp_2m_tables(s, steps: int) -> dict[str, np.ndarray]:
    cfg = s.config
    raw = s.sigmas.double().numpy()  # [S+1]; the last is 0 ("zero") or the smallest training sigma
    if cfg.use_flow_sigmas:
        alpha, sigma = 1.0 - raw, raw
    else:  # raw sigma is sqrt((1 - a) / a); alpha_t = sqrt(a), sigma_t = sqrt(1 - a)
        alpha = 1.0 / np.sqrt(raw**2 + 1.0)
        sigma = raw * alpha
    with np.errstate(divide="ignore"):
        lam = np.log(alpha) - np.log(sigma)  # [S+1] log-SNR, +inf at a zero final sigma
    h = lam[1:] - lam[:-1]  # [S]
    a_t = alpha[1:]  # alpha at the step's target
    step_coef = -a_t * np.expm1(-h)  # first-order weight of x0: alpha_t * (1 - e^-h)

    # Which steps are second order, exactly as diffusers decides (its lower_order_nums / final flags):
    # never step 0; the last step is first order with euler_at_final, with lower_order_final below
    # 15 steps, and always when the final sigma is zero.
    k = np.arange(steps)
    last_first = cfg.euler_at_final or (cfg.lower_order_final and steps < 15) or cfg.final_sigmas_type == "zero"
    second = (cfg.solver_order == 2) & (k > 0) & ~((k == steps - 1) & last_first)
    d1_coef = np.zeros(steps)
    j = np.nonzero(second)[0]
    r0 = (lam[j] - lam[j - 1]) / h[j]  # previous step size over this one
    if cfg.solver_type == "midpoint":
        d1_coef[j] = 0.5 * step_coef[j] / r0
    else:  # heun
        d1_coef[j] = a_t[j] * (np.expm1(-h[j]) / h[j] + 1.0) / r0

    a_s, s_s, zero, one = alpha[:-1], sigma[:-1], np.zeros(steps), np.ones(steps)
    x0_from = {  # x0 = x0_from_x * x + x0_from_eps * model_output, at the step's own sigma
        "epsilon": lambda: (1.0 / a_s, -s_s / a_s),
        "sample": lambda: (zero, one),
        "v_prediction": lambda: (a_s, -s_s),
        "flow_prediction": lambda: (one, -raw[:-1]),
    }[cfg.prediction_type]()
    return {
        "x0_from_x": x0_from[0],
        "x0_from_eps": x0_from[1],
        "x_scale": sigma[1:] / sigma[:-1],
        "x0_coef": step_coef,
        "d1_coef": d1_coef,
        "second_order": second.astype(np.float64),
    }


def flow_euler_tables(s, steps: int) -> dict[str, np.ndarray]:
    sig = s.sigmas.double().numpy()  # [S+1], ends at 0 (or 1 with invert_sigmas)
    return {"sigma": sig[:-1], "dt": sig[1:] - sig[:-1]}


def ddim_tables(s, steps: int) -> dict[str, np.ndarray]:
    cfg = s.config
    ac = s.alphas_cumprod.double().numpy()  # [num_train_timesteps]
    t = s.timesteps.numpy()
    # diffusers steps to t - N // S whatever the spacing, not to the next listed timestep.
    t_prev = t - cfg.num_train_timesteps // steps
    a = ac[t]
    a_prev = np.where(t_prev >= 0, ac[np.maximum(t_prev, 0)], float(s.final_alpha_cumprod))
    b = 1.0 - a
    ra, rb, zero, one = np.sqrt(a), np.sqrt(b), np.zeros(steps), np.ones(steps)
    x0_from, eps_from = {  # (x0, eps) = (coef_x * x + coef_out * model_output) for each
        "epsilon": lambda: ((1.0 / ra, -rb / ra), (zero, one)),
        "sample": lambda: ((zero, one), (1.0 / rb, -ra / rb)),
        "v_prediction": lambda: ((ra, -rb), (rb, ra)),
    }[cfg.prediction_type]()
    clip = cfg.clip_sample_range if cfg.clip_sample else math.inf
    return {
        "x0_from_x": x0_from[0],
        "x0_from_eps": x0_from[1],
        "eps_from_x": eps_from[0],
        "eps_from_eps": eps_from[1],
        "clip": np.full(steps, clip),
        "x0_scale": np.sqrt(a_prev),
        "eps_scale": np.sqrt(1.0 - a_prev),  # eta = 0: no variance term
    }


_UPDATES: dict[str, Callable] = {"dpmpp_2m": dpmpp_2m_update, "flow_euler": flow_euler_update, "ddim": ddim_update}
_TABLES: dict[str, Callable] = {"dpmpp_2m": dpmpp_2m_tables, "flow_euler": flow_euler_tables, "ddim": ddim_tables}


def build_scheduler(name: str, scheduler_class: str, scheduler_config: dict[str, Any]):
    """The diffusers scheduler on the CPU. Options are checked on the built scheduler's config,
    after diffusers' own aliases (algorithm_type deis -> dpmsolver++, solver_type logrho/bh1/bh2 ->
    midpoint); values diffusers refuses outright become ValueErrors naming the option."""
    try:
        scheduler = getattr(diffusers, scheduler_class).from_config(dict(scheduler_config))
    except NotImplementedError as e:
        check_supported(name, scheduler_class, scheduler_config)
        raise ValueError(f"{scheduler_class} rejects this config: {e}") from e
    check_supported(name, scheduler_class, scheduler.config)
    return scheduler


def check_supported(name: str, scheduler_class: str, config: dict[str, Any]) -> None:
    for option, allowed in SUPPORTED_OPTIONS[name].items():
        value = config.get(option, allowed[0])  # a raw config may leave an option at its default
        if value not in allowed:
            raise ValueError(
                f"{scheduler_class} option {option}={value!r} is not supported by the graph-safe "
                f"{name!r} sampler; supported: {list(allowed)}"
            )


def make_sampler(
    name: str, scheduler_class: str, scheduler_config: dict[str, Any], steps: int, device: torch.device | str
) -> Sampler:
    """name "default" -> the checkpoint's own scheduler; an explicit name builds SAMPLERS[name]
    from the same config (diffusers ignores keys it does not know)."""
    if name == "default":
        name = sampler_name_for(scheduler_class)
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}; choose 'default' or one of {list(SAMPLERS)}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    cls = SAMPLERS[name]
    scheduler = build_scheduler(name, cls, scheduler_config)
    scheduler.set_timesteps(steps)
    tables = _TABLES[name](scheduler, steps)
    tables["timestep"] = scheduler.timesteps.double().numpy()  # what diffusers hands the model
    assert all(v.shape == (steps,) for v in tables.values()), {k: v.shape for k, v in tables.items()}
    return Sampler(
        name=name,
        steps=steps,
        tables={k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in tables.items()},
        init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)),  # FlowMatch has none: 1
    )
