"""Graph-safe samplers: diffusers' schedules and arithmetic, without diffusers' state.

diffusers' schedulers keep Python state between steps (a step counter, the previous model output)
and read values on the host (`.item()`), so they cannot live inside a CUDA graph. Here the schedule
still comes from diffusers, as the single source of truth: the scheduler class is built on the CPU
from the checkpoint's config and `set_timesteps(steps)` is called once. Each step's scalars are then
computed on the CPU as float32 0-dim tensors by the same torch expressions, in the same order, as
diffusers' `step()` evaluates them, and stacked into float32 [steps] tables on the device. A step is
then pure tensor math: gather the step's coefficients per row (`table[i]`, `i` an int64 device
tensor that the graph reads at replay) and apply diffusers' elementwise float32 operations in
diffusers' order. No Python state between steps, no host sync, no allocation whose size depends on
a value. On the CPU the latents are bit-identical to diffusers' own loop: this matters because the
first step from t = 999 divides by alpha ~ 1 / 157, so a table rounded from float64 instead of
diffusers' float32 arithmetic is already 5e-5 away after one step.

The one piece of state a multistep solver needs, the previous step's x0 prediction, is carried by
the caller: `x, prev = sampler.step(i, x, eps, prev)`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.errors import UserError
from pipeline.models.source import library

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
        "use_dynamic_shifting": (False,),  # a per-resolution `mu` here is not implemented (flow_euler's is)
    },
    "flow_euler": {
        "stochastic_sampling": (False,),
        "use_dynamic_shifting": (False, True),  # True: the model gives the resolution's shift (Flux: mu)
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
    raise UserError(
        f"no graph-safe sampler for scheduler class {scheduler_class!r}; supported classes: "
        f"{sorted(SAMPLERS.values())} (or choose one with sampler={'|'.join(SAMPLERS)})"
    )


# what a transformer's output is, by the name its scheduler gives it
OUTPUTS = {"flow": "a flow-matching velocity", "epsilon": "the noise (epsilon)", "v_prediction": "a v-prediction",
           "sample": "the clean sample"}


def model_output(scheduler_class: str, config: dict[str, Any]) -> str:
    """What a checkpoint's transformer predicts, as its own scheduler reads it: `flow` under a
    flow-matching scheduler (SD3, Flux), else the config's prediction_type (epsilon by default)."""
    if scheduler_class.startswith("FlowMatch") or config.get("prediction_type") == "flow_prediction":
        return "flow"
    return config.get("prediction_type", "epsilon")


def sampler_reads(name: str, config: dict[str, Any]) -> str:
    """What sampler `name`, built from a checkpoint's scheduler config, takes the transformer's
    output to be (DDIM and DPM-Solver carry the config's prediction_type)."""
    return "flow" if name == "flow_euler" else model_output(SAMPLERS[name], config)


def check_sampler_fits(name: str, scheduler_class: str, config: dict[str, Any]) -> None:
    """`sampler=<name>` on a checkpoint whose scheduler is `scheduler_class`: refused where the named
    sampler would read the transformer's output as something it is not (a flow-matching sampler on
    a noise-predicting model, or the reverse), which makes noise, not images. From names and the
    config alone: checked before any weights load."""
    if name not in SAMPLERS:  # `default` is the checkpoint's own; an unknown name is refused elsewhere
        return
    predicts = model_output(scheduler_class, config)
    if sampler_reads(name, config) != predicts:
        fitting = "".join(f" or {other}" for other in SAMPLERS if sampler_reads(other, config) == predicts)
        raise UserError(f"sampler={name} reads the model's output as {OUTPUTS[sampler_reads(name, config)]}, but "
                        f"this model's transformer predicts {OUTPUTS.get(predicts, predicts)} (its scheduler: "
                        f"{scheduler_class}); choose sampler=default (the checkpoint's own){fitting}")


def _per_row(tables: Tensors, i: torch.Tensor, ndim: int, *keys: str) -> list[torch.Tensor]:
    """Each table's entry at step i[b], shaped [B, 1, ..., 1] to broadcast over one row's latents."""
    shape = (-1,) + (1,) * (ndim - 1)
    return [tables[k][i].view(shape) for k in keys]


def _combine(tables: Tensors, i: torch.Tensor, prefix: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(c_x * x + c_out * out) / div, tables `{prefix}_x`, `{prefix}_out`, `{prefix}_div`.
    Every prediction-type conversion in diffusers is this expression up to rewrites that are exact in
    floating point (1 * x = x, y / 1 = y, a - b = a + (-b), a + b = b + a), so it rounds as they do."""
    cx, co, div = _per_row(tables, i, x.dim(), f"{prefix}_x", f"{prefix}_out", f"{prefix}_div")
    return (cx * x + co * out) / div


# Update rules: tables (each float32 [steps]), i int64 [B], x / out / prev float32 [B,C,h,w]
# -> (x_next, x0), both float32 [B,C,h,w]. Each one evaluates diffusers' expression, op for op.
def dpmpp_2m_update(tables: Tensors, i, x, out, prev):
    """DPM-Solver++ (2M), data-prediction form:
    x_next = (sigma_t / sigma_s) x - (alpha_t (e^-h - 1)) x0 - d1_coef * (1 / r0) (x0 - prev)
    with d1_coef = 0.5 alpha_t (e^-h - 1) (midpoint) or -alpha_t ((e^-h - 1) / h + 1) (heun), and
    1 / r0 = d1_coef = 0 at first-order steps."""
    x_scale, x0_coef, inv_r0, d1_coef, second = _per_row(
        tables, i, x.dim(), "x_scale", "x0_coef", "inv_r0", "d1_coef", "second_order"
    )
    x0 = _combine(tables, i, "x0", x, out)
    # First-order steps (step 0 among them) must not read prev at all: 0 * NaN would still be NaN.
    # There D1 = 0 * (x0 - x0) = 0 and x - 0 * 0 = x, so the result is diffusers' first-order update.
    m1 = torch.where(second > 0, prev, x0)
    d1 = inv_r0 * (x0 - m1)
    return x_scale * x - x0_coef * x0 - d1_coef * d1, x0


def flow_euler_update(tables: Tensors, i, x, v, prev):
    """Rectified flow: x_next = x + (sigma_next - sigma) * v; x0 = x - sigma * v."""
    sigma, dt = _per_row(tables, i, x.dim(), "sigma", "dt")
    return x + dt * v, x - sigma * v


def ddim_update(tables: Tensors, i, x, out, prev):
    """DDIM with eta = 0: x_next = sqrt(a_prev) * clip(x0) + sqrt(1 - a_prev) * eps_pred, where the
    predicted eps comes from the unclipped x0, as in diffusers."""
    clip, x0_scale, eps_scale = _per_row(tables, i, x.dim(), "clip", "x0_scale", "eps_scale")
    x0 = torch.clamp(_combine(tables, i, "x0", x, out), min=-clip, max=clip)  # clip = +inf when off
    return x0_scale * x0 + eps_scale * _combine(tables, i, "eps", x, out), x0


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


# Per-step scalars. Each *_rows function returns, for every step, a dict of float32 0-dim CPU tensors
# computed from the scheduler's own float32 sigmas / alphas_cumprod by the expressions diffusers'
# step() evaluates for that step: same ops, same order, so the same roundings.
Row = dict[str, torch.Tensor]
_ZERO, _ONE = torch.tensor(0.0), torch.tensor(1.0)


def _alpha_sigma(sigma: torch.Tensor, flow: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DPM's sigma -> (alpha_t, sigma_t): sigma = sigma_t / alpha_t, or flow's sigma_t itself."""
    if flow:
        return 1 - sigma, sigma
    alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
    return alpha_t, sigma * alpha_t


def _log_snr(alpha_t: torch.Tensor, sigma_t: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha_t) - log(sigma_t); +inf at a zero final sigma."""
    return torch.log(alpha_t) - torch.log(sigma_t)


def _terms(prefix: str, c_x: torch.Tensor, c_out: torch.Tensor, div: torch.Tensor) -> Row:
    """The three scalars of `_combine`: value = (c_x * x + c_out * out) / div."""
    return {f"{prefix}_x": c_x, f"{prefix}_out": c_out, f"{prefix}_div": div}


def dpmpp_2m_rows(s, steps: int) -> list[Row]:
    cfg = s.config
    flow = cfg.use_flow_sigmas
    sig = s.sigmas  # float32 [S+1]; the last is 0 ("zero") or the smallest training sigma
    # Which steps are second order, exactly as diffusers decides (its lower_order_nums / final flags):
    # never step 0; the last step is first order with euler_at_final, with lower_order_final below
    # 15 steps, and always when the final sigma is zero.
    last_first = cfg.euler_at_final or (cfg.lower_order_final and steps < 15) or cfg.final_sigmas_type == "zero"
    rows = []
    for k in range(steps):
        second = cfg.solver_order == 2 and k > 0 and not (k == steps - 1 and last_first)
        alpha_t, sigma_t = _alpha_sigma(sig[k + 1], flow)
        alpha_s0, sigma_s0 = _alpha_sigma(sig[k], flow)
        lambda_s0 = _log_snr(alpha_s0, sigma_s0)
        h = _log_snr(alpha_t, sigma_t) - lambda_s0
        x0_coef = alpha_t * (torch.exp(-h) - 1.0)
        inv_r0, d1_coef = _ZERO, _ZERO  # first order: D1 = 0 * (x0 - x0) = 0
        if second:
            lambda_s1 = _log_snr(*_alpha_sigma(sig[k - 1], flow))
            inv_r0 = 1.0 / ((lambda_s0 - lambda_s1) / h)
            if cfg.solver_type == "midpoint":
                d1_coef = 0.5 * x0_coef
            else:  # heun adds its D1 term; the update subtracts, and negation is exact
                d1_coef = -(alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0))
        x0 = {  # the x0 prediction at the step's own sigma
            "epsilon": lambda: _terms("x0", _ONE, -sigma_s0, alpha_s0),  # (x - sigma_t out) / alpha_t
            "sample": lambda: _terms("x0", _ZERO, _ONE, _ONE),  # out
            "v_prediction": lambda: _terms("x0", alpha_s0, -sigma_s0, _ONE),  # alpha_t x - sigma_t out
            "flow_prediction": lambda: _terms("x0", _ONE, -sig[k], _ONE),  # x - sigma out, the raw sigma
        }[cfg.prediction_type]()
        rows.append({
            **x0,
            "x_scale": sigma_t / sigma_s0,
            "x0_coef": x0_coef,
            "inv_r0": inv_r0,
            "d1_coef": d1_coef,
            "second_order": _ONE if second else _ZERO,
        })
    return rows


def flow_euler_rows(s, steps: int) -> list[Row]:
    sig = s.sigmas  # float32 [S+1], ends at 0 (or 1 with invert_sigmas)
    return [{"sigma": sig[k], "dt": sig[k + 1] - sig[k]} for k in range(steps)]


def ddim_rows(s, steps: int) -> list[Row]:
    cfg = s.config
    clip = torch.tensor(cfg.clip_sample_range if cfg.clip_sample else math.inf)
    rows = []
    for t in s.timesteps:
        # diffusers steps to t - N // S whatever the spacing, not to the next listed timestep.
        prev_t = t - cfg.num_train_timesteps // s.num_inference_steps
        a = s.alphas_cumprod[t]
        a_prev = s.alphas_cumprod[prev_t] if prev_t >= 0 else s.final_alpha_cumprod
        b = 1 - a
        x0, eps = {
            "epsilon": lambda: (  # x0 = (x - b**0.5 out) / a**0.5; eps = out
                _terms("x0", _ONE, -(b**0.5), a**0.5), _terms("eps", _ZERO, _ONE, _ONE)
            ),
            "sample": lambda: (  # x0 = out; eps = (x - a**0.5 out) / b**0.5
                _terms("x0", _ZERO, _ONE, _ONE), _terms("eps", _ONE, -(a**0.5), b**0.5)
            ),
            "v_prediction": lambda: (  # x0 = a**0.5 x - b**0.5 out; eps = a**0.5 out + b**0.5 x
                _terms("x0", a**0.5, -(b**0.5), _ONE), _terms("eps", b**0.5, a**0.5, _ONE)
            ),
        }[cfg.prediction_type]()
        # eta = 0, yet diffusers still forms std_dev_t = 0.0 * variance**0.5 and subtracts its square
        variance = ((1 - a_prev) / b) * (1 - a / a_prev)
        std_dev_t = 0.0 * variance**0.5
        rows.append({
            **x0,
            **eps,
            "clip": clip,  # +inf when clip_sample is off
            "x0_scale": a_prev**0.5,
            "eps_scale": (1 - a_prev - std_dev_t**2) ** 0.5,
        })
    return rows


_UPDATES: dict[str, Callable] = {"dpmpp_2m": dpmpp_2m_update, "flow_euler": flow_euler_update, "ddim": ddim_update}
_ROWS: dict[str, Callable] = {"dpmpp_2m": dpmpp_2m_rows, "flow_euler": flow_euler_rows, "ddim": ddim_rows}


def build_scheduler(name: str, scheduler_class: str, scheduler_config: dict[str, Any]):
    """The diffusers scheduler on the CPU. Options are checked on the built scheduler's config,
    after diffusers' own aliases (algorithm_type deis -> dpmsolver++, solver_type logrho/bh1/bh2 ->
    midpoint); values diffusers refuses outright become ValueErrors naming the option."""
    try:
        scheduler = getattr(library("diffusers"), scheduler_class).from_config(dict(scheduler_config))
    except NotImplementedError as e:
        check_supported(name, scheduler_class, scheduler_config)
        raise UserError(f"{scheduler_class} rejects this config: {e}") from e
    check_supported(name, scheduler_class, scheduler.config)
    return scheduler


def check_supported(name: str, scheduler_class: str, config: dict[str, Any]) -> None:
    for option, allowed in SUPPORTED_OPTIONS[name].items():
        value = config.get(option, allowed[0])  # a raw config may leave an option at its default
        if value not in allowed:
            raise UserError(
                f"{scheduler_class} option {option}={value!r} is not supported by the graph-safe "
                f"{name!r} sampler; supported: {list(allowed)}"
            )


def check_schedule(scheduler_class: str, schedule: dict[str, Any]) -> None:
    """The model's schedule keywords (Flux: sigmas and the shift mu) must be ones this scheduler's
    set_timesteps takes."""
    cls = getattr(library("diffusers"), scheduler_class)
    unknown = sorted(set(schedule) - set(inspect.signature(cls.set_timesteps).parameters))
    if unknown:
        raise UserError(f"{scheduler_class} cannot run this model's schedule: its set_timesteps takes no {unknown}; "
                        "use the checkpoint's own sampler (sampler=default)")


def make_sampler(
    name: str, scheduler_class: str, scheduler_config: dict[str, Any], steps: int, device: torch.device | str,
    schedule: dict[str, Any] | None = None,
) -> Sampler:
    """name "default" -> the checkpoint's own scheduler; an explicit name builds SAMPLERS[name]
    from the same config (diffusers ignores keys it does not know). `schedule`: the model's
    set_timesteps keywords at the image size (Adapter.schedule_kwargs; {} for a fixed schedule)."""
    if name == "default":
        name = sampler_name_for(scheduler_class)
    if name not in SAMPLERS:
        raise UserError(f"unknown sampler {name!r}; choose 'default' or one of {list(SAMPLERS)}")
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"steps must be a positive int, got {steps!r}")
    cls = SAMPLERS[name]
    schedule = schedule or {}
    scheduler = build_scheduler(name, cls, scheduler_config)
    check_schedule(cls, schedule)
    if scheduler.config.get("use_dynamic_shifting") and "mu" not in schedule:
        raise UserError(f"{cls} option use_dynamic_shifting=True needs the shift of each resolution (mu), which only "
                        "the flux family gives; set it false in the scheduler config")
    scheduler.set_timesteps(steps, **schedule)  # on the CPU, as float32: the arithmetic below is diffusers' own
    rows = _ROWS[name](scheduler, steps)
    assert len(rows) == steps == len(scheduler.timesteps), (len(rows), steps, len(scheduler.timesteps))
    tables = {k: torch.stack([row[k] for row in rows]) for k in rows[0]}
    tables["timestep"] = scheduler.timesteps.to(torch.float32, copy=True)  # what diffusers hands the model
    # NaN anywhere (inf is legitimate: DDIM's "no clipping" bound) means diffusers' own schedule broke.
    broken = sorted(k for k, v in tables.items() if torch.isnan(v).any())
    if broken:
        raise UserError(
            f"{cls} with this config gives NaN in its schedule at {steps} steps ({broken}); "
            "use more steps or check the scheduler config"
        )
    assert all(v.dtype == torch.float32 and v.shape == (steps,) for v in tables.values()), {
        k: (v.dtype, v.shape) for k, v in tables.items()
    }
    return Sampler(
        name=name,
        steps=steps,
        tables={k: v.to(device) for k, v in tables.items()},
        init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)),  # FlowMatch has none: 1
    )
