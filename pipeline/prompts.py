"""Prompt encoding ahead of denoising, in fixed-size chunks, with a bounded cache keyed by prompt text.

The text encoder always sees chunks of exactly one number of prompts for their text length (short
chunks are padded with the empty prompt), all of one text length (`lengths`: the family's per-prompt
lengths, with kernels.trim_text_padding; else one length), so a prompt's embedding is the same
whichever prompts it was encoded with. That number is runtime.encode_batch_size, or by default as
many prompts as make ENCODE_TOKENS text tokens (`prompts_per_call`): the encoder's matmuls run at
full rate from about there, and a small job does not encode a large chunk of padding. Rows of
different lengths asked for together are padded with zeros (mask 0) to the longest. Given the order
in which prompts will be asked for (`schedule`: the plan's batches, negative prompts
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
from pipeline.manifest import show_text
from pipeline.models.base import Adapter
from pipeline.transfer import to_device

# prompts (N)[, their text length] -> conditioning tensors by name, each [N, ...]
EncodeFn = Callable[..., dict[str, torch.Tensor]]
# texts -> the text length each is encoded at (None: all at the family's one length)
LengthsFn = Callable[[Sequence[str]], "list[int] | None"]
DEFAULT_NEGATIVE = ""  # a row without a negative prompt, as diffusers
ENCODE_TOKENS = 4096  # text tokens per text-encoder call by default
MOST_PER_CALL = 64  # prompts per call by default at most (short texts; a family without text encoder)
# a text length (None: the family's one) -> prompts per text-encoder call
ChunkFn = Callable[["int | None"], int]
# texts -> per text encoder, its token limit and the indexes of the texts it cuts (Adapter.text_cuts)
CutsFn = Callable[[list], "dict[str, tuple[int, list[int]]]"]

log = logging.getLogger(__name__)


def negative_or_default(prompt: str | None) -> str:
    return prompt if prompt is not None else DEFAULT_NEGATIVE


def prompts_per_call(tokens: int | None, fixed: int | None = None) -> int:
    """Prompts per text-encoder call for prompts of `tokens` text tokens (None: no text encoder):
    `fixed` (runtime.encode_batch_size) where given, else as many as make ENCODE_TOKENS tokens, at
    least 1 and at most MOST_PER_CALL."""
    if fixed is not None:
        return fixed
    if not tokens:
        return MOST_PER_CALL
    return max(1, min(MOST_PER_CALL, ENCODE_TOKENS // tokens))


def encoding_digest(fixed: int | None, tokens: int | None) -> dict:
    """What of the prompts' encoding a job's images depend on beyond the model config (its settings
    digest's part): {} where every text-encoder call holds MOST_PER_CALL prompts, as every job's did
    before the count followed the text length (their outputs still resume); else the count (`fixed`,
    runtime.encode_batch_size) or the rule. `tokens`: the config's T5 tokens per prompt, the longest a
    prompt is encoded at (None: the checkpoint's own, not known before it is loaded)."""
    known = fixed is not None or tokens is not None
    if known and prompts_per_call(tokens, fixed) == MOST_PER_CALL:
        return {}
    return {"prompts_per_call": fixed if fixed is not None else f"{ENCODE_TOKENS} tokens"}


class PromptCache:
    def __init__(
        self,
        encode: EncodeFn,
        chunk: int | ChunkFn,
        capacity: int,
        store: torch.device | None = None,
        out: torch.device | None = None,
        lengths: LengthsFn | None = None,
        cuts: CutsFn | None = None,
    ):
        """`chunk`: prompts per encoder call, or a function of their text length giving it; `store`:
        where cached tensors live (None: where `encode` puts them); `out`: where `get` returns them
        (None: where they are stored); `lengths`: the text length of each prompt (None: one for all);
        `cuts`: which texts a text encoder cuts to its token limit (counted in `cut`, the first said)."""
        if capacity < 1 or (isinstance(chunk, int) and chunk < 1):
            raise UserError(f"prompt chunk ({chunk}) and cache capacity ({capacity}) must be >= 1")
        self.encode = encode
        self.chunk_of: ChunkFn = chunk if callable(chunk) else (lambda length: chunk)
        self.capacity = capacity
        self.store = store
        self.out = out
        self.lengths = lengths
        self.length: dict[str, int | None] = {}  # prompt -> its text length, once asked (with `lengths`)
        self.cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self.upcoming: dict[int | None, deque[str]] = {}  # per text length
        self.hits = 0
        self.encoded = 0
        self.calls = 0
        self.padding = 0  # empty prompts that filled short chunks
        self.cuts = cuts
        self.cut: dict[str, int] = {}  # text encoder -> texts encoded that it cut to its token limit

    def encode_length(self, prompt: str) -> int | None:
        """The text tokens `prompt` is encoded at (None: the family's one length)."""
        if self.lengths is None:
            return None
        if prompt not in self.length:
            self._learn([prompt])
        return self.length[prompt]

    def _learn(self, prompts: Sequence[str]) -> None:
        """Remember the text lengths of those `prompts` not known yet (one tokenizer call)."""
        new = [p for p in dict.fromkeys(prompts) if p not in self.length]
        if new and self.lengths is not None:
            found = self.lengths(new)
            self.length.update(zip(new, found if found is not None else [None] * len(new)))

    def _by_length(self, prompts: Iterable[str]) -> dict[int | None, list[str]]:
        groups: dict[int | None, list[str]] = {}
        for p in prompts:
            groups.setdefault(self.encode_length(p), []).append(p)
        return groups

    def schedule(self, prompts: Iterable[str]) -> None:
        """The order prompts will be asked for; misses encode ahead along it."""
        order = list(dict.fromkeys(prompts))
        self._learn(order)
        self.upcoming = {length: deque(group) for length, group in self._by_length(order).items()}

    def prefetch(self, prompts: Iterable[str]) -> None:
        """Encode every prompt not cached yet, now, in full chunks."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        for length, group in self._by_length(missing).items():
            chunk = self.chunk_of(length)
            for start in range(0, len(group), chunk):
                self._encode_chunk(group[start : start + chunk], length)

    def encode_ahead(self, prompts: Sequence[str]) -> int:
        """Encode now what a `get` of `prompts` would (the prompts not cached, with those `_fill` adds,
        in the same calls), so that a text encoder's first call and its one-time costs can fall
        before the batches; how many of `prompts` were not cached."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self.cache))
        if missing:
            self.prefetch(self._fill(missing))
        return len(missing)

    def get(self, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...]."""
        self.hits += len(prompts) - self.encode_ahead(prompts)
        rows = [self.cache[p] for p in prompts]
        for p in prompts:
            self.cache.move_to_end(p)
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)
        stacked = {name: stack_padded([r[name] for r in rows]) for name in rows[0]}
        if self.out is not None:
            stacked = {name: to_device(t, self.out) for name, t in stacked.items()}
        return stacked

    def _fill(self, missing: list[str]) -> list[str]:
        """`missing` plus, per text length, upcoming uncached prompts of it up to a whole number of chunks."""
        wanted = dict.fromkeys(missing)
        for length, group in self._by_length(missing).items():
            chunk = self.chunk_of(length)
            room = min(self.capacity, -(-len(group) // chunk) * chunk) - len(group)
            upcoming = self.upcoming.get(length, deque())
            while upcoming and room > 0:
                p = upcoming.popleft()
                if p not in self.cache and p not in wanted:
                    wanted[p] = None
                    room -= 1
        return list(wanted)

    def _encode_chunk(self, prompts: list[str], length: int | None) -> None:
        padded = prompts + [DEFAULT_NEGATIVE] * (self.chunk_of(length) - len(prompts))
        encoded = self.encode(padded) if length is None else self.encode(padded, length)
        self.calls += 1
        self.padding += len(padded) - len(prompts)
        for i, p in enumerate(prompts):
            row = {name: t[i] for name, t in encoded.items()}
            if self.store is not None:
                row = {name: t.to(self.store) for name, t in row.items()}
            self.cache[p] = row
        self.encoded += len(prompts)
        self._count_cuts(prompts)

    def _count_cuts(self, prompts: list[str]) -> None:
        """Count the texts each text encoder cut; say so the first time one does (diffusers does too)."""
        for encoder, (limit, cut) in (self.cuts(prompts) if self.cuts is not None else {}).items():
            if cut and encoder not in self.cut:
                log.warning("prompts: texts longer than %s's %d tokens are cut to them, as diffusers' pipeline cuts "
                            "them (the first: %s); stats.json's prompt_cache.cut counts them per text encoder",
                            encoder, limit, show_text(prompts[cut[0]]))
            if cut:
                self.cut[encoder] = self.cut.get(encoder, 0) + len(cut)


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked, each padded with zeros along its first dimension to the longest (text tokens:
    an embedding's padding positions, which a zero mask hides)."""
    longest = max(r.shape[0] for r in rows) if rows[0].dim() else 0
    if all(r.dim() == 0 or r.shape[0] == longest for r in rows):
        return torch.stack(rows)
    return torch.stack([torch.nn.functional.pad(r, (0, 0) * (r.dim() - 1) + (0, longest - r.shape[0])) for r in rows])


def planned_prompts(batches: Iterable, negatives: bool = True) -> list[str]:
    """Every prompt the plan's batches ask for, in the order they ask: per batch its negative
    prompts (the default for a row without one; none for a model without CFG), then its prompts."""
    order = []
    for batch in batches:
        if negatives:
            order += [negative_or_default(it.negative_prompt) for it in batch.items]
        order += [it.prompt for it in batch.items]
    return order


def prompt_cache(adapter: Adapter, batches: list, fixed: int | None, capacity: int, offload: bool) -> PromptCache:
    """The job's prompt cache, `fixed` prompts per encoder call (runtime.encode_batch_size; None: by
    their text length, `prompts_per_call`). The first batch's prompts are encoded now, as its `get`
    would (the text encoders' first call, with its one-time costs, falls in the job's start-up, not
    in its first batch). With `offload`, every prompt of the plan is encoded now, kept in host
    memory, and the text encoders are released (a later new prompt raises a RuntimeError: the plan
    has none)."""
    order = planned_prompts(batches, adapter.uses_cfg)
    chunk = lambda length: prompts_per_call(adapter.text_tokens(length), fixed)  # noqa: E731
    # with offload: every prompt kept, in host memory, handed out on the device
    cache = PromptCache(adapter.encode, chunk, max(capacity, len(set(order))) if offload else capacity,
                        store=torch.device("cpu") if offload else None, out=adapter.device if offload else None,
                        lengths=adapter.prompt_lengths, cuts=adapter.text_cuts)
    cache.schedule(order)  # learns every prompt's length (before the tokenizer goes with the text encoder)
    sizes = sorted({chunk(length) for length in cache.upcoming})
    log.info("prompts: %s per text-encoder call%s", ", ".join(map(str, sizes)),
             "" if fixed is None else " (runtime.encode_batch_size)")
    if not offload:
        cache.encode_ahead(planned_prompts(batches[:1], adapter.uses_cfg))
        return cache
    cache.prefetch(order)
    adapter.release_text_encoders()
    log.info(
        "model.offload_text_encoder: %d prompts encoded ahead (kept in host memory); text encoders released",
        cache.encoded,
    )
    return cache
