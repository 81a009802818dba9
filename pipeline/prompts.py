"""Prompt encoding with a bounded cache keyed by prompt text.

The text encoder always sees chunks of exactly `chunk` prompts (short chunks are padded with the
empty prompt), so a prompt's embedding is the same whichever prompts it was encoded with.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch

# prompts (N) -> conditioning tensors by name, each [N, ...]
EncodeFn = Callable[[list[str]], dict[str, torch.Tensor]]


class PromptCache:
    def __init__(self, encode: EncodeFn, chunk: int, capacity: int):
        if chunk < 1 or capacity < 1:
            raise ValueError(f"prompt chunk ({chunk}) and cache capacity ({capacity}) must be >= 1")
        self.encode = encode
        self.chunk = chunk
        self.capacity = capacity
        self.cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.hits = 0
        self.encoded = 0

    def get(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...]."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        self.hits += len(prompts) - len(missing)
        for start in range(0, len(missing), self.chunk):
            self._encode_chunk(missing[start : start + self.chunk])
        rows = [self.cache[p] for p in prompts]
        for p in prompts:
            self.cache.move_to_end(p)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        return {name: torch.stack([r[name] for r in rows]) for name in rows[0]}

    def _encode_chunk(self, prompts: list[str]) -> None:
        encoded = self.encode(prompts + [""] * (self.chunk - len(prompts)))
        for i, p in enumerate(prompts):
            self.cache[p] = {name: t[i] for name, t in encoded.items()}
        self.encoded += len(prompts)
