"""Eager sampling loop around the engine: the checkpoint's own diffusers scheduler between steps."""

from __future__ import annotations

import torch

from bcg.engine import BCGEngine


@torch.no_grad()
def denoise(
    adapter,
    engine: BCGEngine,
    noise: torch.Tensor,
    cond: dict[str, torch.Tensor],
    guidance: torch.Tensor,
    steps: int,
) -> torch.Tensor:
    """noise [n,C,h,w], cond {"emb": [n,2,L,D], "mask": [n,2,L]}, guidance [n] -> latents [n,C,h,w].

    Each step is one engine call (CFG forward, replayed from a graph when there is one); the
    scheduler update runs eagerly on the real rows only.
    """
    n, _, h, w = noise.shape
    f = adapter.vae_scale_factor
    key = (h * f, w * f)
    scheduler = adapter.new_scheduler()
    scheduler.set_timesteps(steps, device=noise.device)
    latents = noise * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        x = scheduler.scale_model_input(latents, t)
        inputs = {"x": x, "t": t.to(torch.float32).expand(n), "g": guidance, **cond}
        eps = engine.run(key, inputs, n)
        latents = scheduler.step(eps, t, latents, return_dict=False)[0]
    return latents


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[n,3,H,W] in [-1,1] -> [n,H,W,3] uint8 on the CPU, rounded as diffusers' postprocess does."""
    images = (images / 2 + 0.5).clamp(0, 1)
    return (images.permute(0, 2, 3, 1).float().cpu() * 255).round().to(torch.uint8)
