"""The denoising loop of one batch, in the configured `bcg.scope`, on the engine.

- `forward`: the engine runs one model forward per step (with CFG: over 2B rows, combined); the
  checkpoint's diffusers scheduler (or the one `sampler=<name>` names) updates the latents eagerly
  between replays. What other engines do.
- `step`: one engine call per step runs forward + CFG + our graph-safe sampler update
  (`pipeline.samplers`); the step position is a device tensor.
- `loop`: one engine call runs every step of the batch; its graphs are keyed by the step count too.

With graphs off, the same functions run eagerly, so scopes differ only in where the graph boundary
lies, not in what is computed (forward excepted: diffusers' scheduler does its own arithmetic).
"""

from __future__ import annotations

from typing import Callable

import torch

from bcg.buffers import InputSpec
from bcg.buckets import pick_bucket
from bcg.engine import BCGEngine, Output, ShapeKey
from pipeline.errors import UserError, not_accepted
from pipeline.models.source import library
from pipeline.models.base import Adapter
from pipeline.samplers import SAMPLERS, Sampler, check_sampler_fits, check_schedule, make_sampler, sampler_name_for

SCOPES = ("forward", "step", "loop")

Inputs = dict[str, torch.Tensor]


def sampler_label(scope: str, sampler: str, scheduler_class: str) -> str:
    """What updates the latents (output rows record it): in the step and loop scopes our sampler's
    name, in forward the diffusers scheduler class; `sampler` "default" is the checkpoint's own
    (`scheduler_class`). From names alone, so a job knows it before the model is built."""
    if scope != "forward":
        return sampler_name_for(scheduler_class) if sampler == "default" else sampler
    return scheduler_class if sampler == "default" else SAMPLERS[sampler]


# kernels.hoist_modulation (the only setting that gives each step its own conditioning), refused at
# the job's start and by the denoiser
LOOP_REFUSAL = ("kernels.hoist_modulation=true gives each step its own precomputed modulation input, and "
                "bcg.scope=loop runs every step of a batch in one graph with one set of inputs; set "
                "bcg.scope=step (or forward), or kernels.hoist_modulation=false")


class Denoiser:
    """Owns the sampler and the engine for one job; `denoise` runs one batch."""

    def __init__(self, adapter: Adapter, scope: str, sampler: str, steps: int, engine_factory: Callable[..., BCGEngine] | None = None):
        if scope not in SCOPES:
            raise not_accepted("bcg.scope", scope, SCOPES)
        if scope == "loop" and adapter.conditioning_varies_per_step:
            raise UserError(LOOP_REFUSAL)
        check_sampler_fits(sampler, adapter.scheduler_class, adapter.scheduler_config)
        self.adapter = adapter
        self.scope = scope
        self.steps = steps
        self.sampler_name = sampler
        # step and loop run our graph-safe sampler, one per resolution (the schedule may depend on it:
        # Flux's shift); forward runs diffusers' own scheduler. Either way its options and the
        # model's schedule are checked here, at start.
        self.samplers: dict[tuple[int, int], Sampler] = {}
        side = adapter.granularity
        if scope == "forward":
            check_schedule(self.sampler_label, adapter.schedule_kwargs(side, side, steps))
        else:
            self._make_sampler(side, side, torch.device("cpu"))
        self.engine: BCGEngine | None = None
        if engine_factory is not None:
            self.attach(engine_factory)

    def attach(self, engine_factory: Callable[..., BCGEngine]) -> None:
        """The engine, once the ladder is known (bcg.ladder=auto calibrates `one_step` first)."""
        fn, specs = {"forward": (self.adapter.guided_eps, self._forward_specs),
                     "step": (self._step, self._step_specs),
                     "loop": (self._loop, self._loop_specs)}[self.scope]
        self.engine = engine_factory(fn, specs)

    def one_step(self) -> tuple[Callable, Callable]:
        """(fn, specs) of one denoising step in this scope, keyed by (height, width): the CFG
        forward in `forward` (diffusers' scheduler runs outside it), forward + sampler update in
        `step` and `loop` (a loop is `steps` of them)."""
        if self.scope == "forward":
            return self.adapter.guided_eps, self._forward_specs
        return self._step, self._step_specs

    def key(self, height: int, width: int, text_length: int | None = None) -> ShapeKey:
        """(height, width), the batch's text length where the adapter gives one, the step count in
        the loop scope."""
        key = (height, width) if text_length is None else (height, width, text_length)
        return (*key, self.steps) if self.scope == "loop" else key

    def capture_all(self, shapes: list[tuple[int, ...]], buckets: dict[tuple[int, ...], set[int]] | None = None) -> None:
        """Graphs for `shapes`, each (height, width) or (height, width, text length): at the ladder
        buckets `buckets` names per shape (None: all)."""
        keys = {shape: self.key(*shape) for shape in shapes}
        if self.scope != "forward":  # the tables a graph reads exist before it is captured
            for shape in shapes:
                self.sampler_at(shape[0], shape[1])
        self.engine.capture_all(keys.values(), None if buckets is None else {keys[s]: b for s, b in buckets.items()})

    @torch.no_grad()
    def denoise(self, noise: torch.Tensor, cond: Inputs, guidance: torch.Tensor, height: int, width: int,
                text_length: int | None = None) -> torch.Tensor:
        """noise [n,C,h,w], cond {name: [n,K,...]} (K = 2 with CFG, else 1; text_length tokens of
        text where given), guidance [n] -> final latents [n,C,h,w]."""
        n = noise.shape[0]
        key = self.key(height, width, text_length)
        if self.scope == "forward":
            return self._denoise_forward(key, noise, cond, guidance)
        sampler = self.sampler_at(height, width)
        x = noise * sampler.init_noise_sigma
        if self.scope == "loop":
            return self.engine.run(key, {"x": x, "g": guidance, **cond}, n)
        prev = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        step_cond = self._step_conditioning(cond, guidance, lambda: sampler.timestep(torch.arange(self.steps, device=x.device)), n)
        for k in range(self.steps):
            i = torch.full((n,), k, dtype=torch.int64, device=x.device)
            x, prev = self.engine.run(key, {"x": x, "i": i, "prev": prev, "g": guidance, **step_cond(k)}, n)
        return x

    def _denoise_forward(self, key: ShapeKey, noise: torch.Tensor, cond: Inputs, guidance: torch.Tensor) -> torch.Tensor:
        n = noise.shape[0]
        scheduler = self._diffusers_scheduler()
        scheduler.set_timesteps(self.steps, device=noise.device, **self.adapter.schedule_kwargs(key[0], key[1], self.steps))
        # Flow-matching schedulers have neither (diffusers' SD3 pipeline uses neither).
        x = noise * getattr(scheduler, "init_noise_sigma", 1.0)
        scale = getattr(scheduler, "scale_model_input", lambda sample, t: sample)
        step_cond = self._step_conditioning(cond, guidance, lambda: scheduler.timesteps.to(torch.float32), n)
        for k, t in enumerate(scheduler.timesteps):
            model_x = scale(x, t)
            eps = self.engine.run(key, {"x": model_x, "t": t.to(torch.float32).expand(n), "g": guidance, **step_cond(k)}, n)
            x = scheduler.step(eps, t, x, return_dict=False)[0]
        return x

    def _step_conditioning(self, cond: Inputs, guidance: torch.Tensor, timesteps: Callable[[], torch.Tensor],
                           n: int) -> Callable[[int], Inputs]:
        """step -> that step's conditioning of these n rows: `cond` at every step, or the adapter's
        per-step conditioning made over the bucket they run in from the steps' timesteps (`timesteps()`,
        asked for only then)."""
        if not self.adapter.conditioning_varies_per_step:
            return lambda step: cond
        return self.adapter.per_step_conditioning(cond, guidance, timesteps(), pick_bucket(self.engine.ladder, n))

    @property
    def sampler_label(self) -> str:
        return sampler_label(self.scope, self.sampler_name, self.adapter.scheduler_class)

    def sampler_at(self, height: int, width: int) -> Sampler:
        """Our graph-safe sampler for images of this size, made once: a captured graph reads its tables."""
        if (height, width) not in self.samplers:
            self.samplers[(height, width)] = self._make_sampler(height, width, self.adapter.device)
        return self.samplers[(height, width)]

    def _make_sampler(self, height: int, width: int, device: torch.device) -> Sampler:
        a = self.adapter
        return make_sampler(self.sampler_name, a.scheduler_class, a.scheduler_config, self.steps, device,
                            a.schedule_kwargs(height, width, self.steps))

    def _diffusers_scheduler(self):
        """A fresh scheduler per batch: diffusers' schedulers keep per-run state."""
        return getattr(library("diffusers"), self.sampler_label).from_config(self.adapter.scheduler_config)

    # ---- graph bodies: graph-safe, batch-first ------------------------------------------------

    def _step(self, inputs: Inputs) -> Output:
        """x, i [B] int64, prev [B,C,h,w] f32, g, cond -> (x_next, x0 prediction f32)."""
        i, x, prev = inputs["i"], inputs["x"], inputs["prev"]
        f = self.adapter.vae_scale_factor  # the image size from the latents' shape (a graph is per size)
        sampler = self.sampler_at(x.shape[-2] * f, x.shape[-1] * f)
        model_inputs = {k: v for k, v in inputs.items() if k not in ("i", "prev")}
        model_inputs["t"] = sampler.timestep(i)
        eps = self.adapter.guided_eps(model_inputs)
        return sampler.step(i, x, eps, prev)

    def _loop(self, inputs: Inputs) -> torch.Tensor:
        """x (initial latents), g, cond -> final latents; every step of the schedule, unrolled."""
        x = inputs["x"]
        prev = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for k in range(self.steps):
            i = torch.full((x.shape[0],), k, dtype=torch.int64, device=x.device)
            x, prev = self._step({**inputs, "x": x, "i": i, "prev": prev})
        return x

    # ---- inputs per scope ---------------------------------------------------------------------

    def _forward_specs(self, key: ShapeKey) -> dict[str, InputSpec]:
        return self.adapter.input_specs(*key)

    def _step_specs(self, key: ShapeKey) -> dict[str, InputSpec]:
        specs = {k: v for k, v in self._forward_specs(key).items() if k != "t"}
        latent = self.adapter.latent_shape(key[0], key[1])
        return {**specs, "i": InputSpec((), torch.int64), "prev": InputSpec(latent, torch.float32)}

    def _loop_specs(self, key: ShapeKey) -> dict[str, InputSpec]:
        """A loop's key ends with its step count."""
        return {k: v for k, v in self._forward_specs(key[:-1]).items() if k != "t"}

