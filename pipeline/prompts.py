"""Prompt encoding ahead of denoising, in fixed-size chunks, with a bounded cache keyed by prompt text.

The text encoder always sees chunks of exactly `chunk` prompts (short chunks are padded with the
empty prompt), so a prompt's embedding is the same whichever prompts it was encoded with. Given
the order in which prompts will be asked for (`schedule`: the plan's batches, negative prompts
included), a miss encodes the prompts asked for plus the next ones not yet encoded, up to a full
chunk: the text encoder runs on full chunks, ahead of the batches that need them, and a prompt
repeated anywhere in the manifest (the shared negative prompt above all) is encoded once while
it stays in the cache.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Callable, Iterable, Sequence

import torch

from pipeline.errors import UserError
from pipeline.models.base import Adapter
from pipeline.transfer import to_device

# prompts (N) -> conditioning tensors by name, each [N, ...]
EncodeFn = Callable[[list[str]], dict[str, torch.Tensor]]
DEFAULT_NEGATIVE = ""  # a row without a negative prompt, as diffusers

log = logging.getLogger(__name__)


def negative_or_default(prompt: str | None) -> str:
    return prompt if prompt is not None else DEFAULT_NEGATIVE


class PromptCache:
    def __init__(
        self,
        encode: EncodeFn,
        chunk: int,
        capacity: int,
        store: torch.device | None = None,
        out: torch.device | None = None,
    ):
        """`store`: where cached tensors live (None: where `encode` puts them); `out`: where `get`
        returns them (None: where they are stored)."""
        if chunk < 1 or capacity < 1:
            raise UserError(f"prompt chunk ({chunk}) and cache capacity ({capacity}) must be >= 1")
        self.encode = encode
        self.chunk = chunk
        self.capacity = capacity
        self.store = store
        self.out = out
        self.cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.upcoming: deque[str] = deque()
        self.hits = 0
        self.encoded = 0
        self.calls = 0

    def schedule(self, prompts: Iterable[str]) -> None:
        """The order prompts will be asked for; misses encode ahead along it."""
        self.upcoming = deque(dict.fromkeys(prompts))

    def prefetch(self, prompts: Iterable[str]) -> None:
        """Encode every prompt not cached yet, now, in full chunks."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        for start in range(0, len(missing), self.chunk):
            self._encode_chunk(missing[start : start + self.chunk])

    def get(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...]."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        self.hits += len(prompts) - len(missing)
        if missing:
            self.prefetch(self._fill(missing))
        rows = [self.cache[p] for p in prompts]
        for p in prompts:
            self.cache.move_to_end(p)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        stacked = {name: torch.stack([r[name] for r in rows]) for name in rows[0]}
        if self.out is not None:
            stacked = {name: to_device(t, self.out) for name, t in stacked.items()}
        return stacked

    def _fill(self, missing: list[str]) -> list[str]:
        """`missing` plus upcoming uncached prompts up to a whole number of chunks."""
        wanted = dict.fromkeys(missing)
        room = min(self.capacity, -(-len(wanted) // self.chunk) * self.chunk)
        while self.upcoming and len(wanted) < room:
            p = self.upcoming.popleft()
            if p not in self.cache:
                wanted[p] = None
        return list(wanted)

    def _encode_chunk(self, prompts: list[str]) -> None:
        encoded = self.encode(prompts + [DEFAULT_NEGATIVE] * (self.chunk - len(prompts)))
        self.calls += 1
        for i, p in enumerate(prompts):
            row = {name: t[i] for name, t in encoded.items()}
            if self.store is not None:
                row = {name: t.to(self.store) for name, t in row.items()}
            self.cache[p] = row
        self.encoded += len(prompts)


def planned_prompts(batches: Iterable, negatives: bool = True) -> list[str]:
    """Every prompt the plan's batches ask for, in the order they ask: per batch its negative
    prompts (the default for a row without one; none for a model without CFG), then its prompts."""
    order = []
    for batch in batches:
        if negatives:
            order += [negative_or_default(it.negative_prompt) for it in batch.items]
        order += [it.prompt for it in batch.items]
    return order


def prompt_cache(adapter: Adapter, batches: list, chunk: int, capacity: int, offload: bool) -> PromptCache:
    """The job's prompt cache. With `offload`, every prompt of the plan is encoded now, kept in host
    memory, and the text encoders are released (a later new prompt raises a RuntimeError: the plan
    has none)."""
    order = planned_prompts(batches, adapter.uses_cfg)
    if not offload:
        cache = PromptCache(adapter.encode, chunk, capacity)
        cache.schedule(order)
        return cache
    cpu = torch.device("cpu")
    cache = PromptCache(adapter.encode, chunk, max(capacity, len(set(order))), store=cpu, out=adapter.device)
    cache.prefetch(order)
    adapter.release_text_encoders()
    log.info(
        "model.offload_text_encoder: %d prompts encoded ahead (kept in host memory); text encoders released",
        cache.encoded,
    )
    return cache
