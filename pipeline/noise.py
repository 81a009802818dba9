"""Initial noise, drawn per item from its own seed, outside any graph.

The contract (DESIGN.md): item with seed s starts from exactly what diffusers'
`randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(s))` gives for its latent shape, so
an image is reproducible from its row alone, on any device, in any batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pipeline.transfer import to_device


def item_noise(seed: int, latent_shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """[1, C, h, w] on the CPU."""
    from diffusers.utils.torch_utils import randn_tensor  # the contract's own function, imported when first drawn

    generator = torch.Generator("cpu").manual_seed(seed)
    return randn_tensor((1, *latent_shape), generator=generator, device=torch.device("cpu"), dtype=dtype)


def batch_noise(
    seeds: Sequence[int], latent_shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[n, C, h, w] on `device`, row i from seeds[i]."""
    return to_device(torch.cat([item_noise(s, latent_shape, dtype) for s in seeds]), device)
