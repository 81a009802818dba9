"""kernels.trim_text_padding: each prompt encoded at its own length and each batch's text cut to its
longest prompt (rounded up), not max_sequence_length. For families that mask the padding out of
cross-attention, the images are the untrimmed ones up to rounding, and the text encoder and
cross-attention do less work. An image is then a function of its batch's texts, which the plan
fixes: the same in a resumed job, in a shard, in another process."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pipeline.plans import KernelSettings

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

MULTIPLE = 64  # a batch's text length is its longest text's tokens rounded up to this


def apply(kernels: KernelSettings, adapter: Adapter) -> dict:
    """Turn the adapter's per-batch text length on, or off (an adapter that ran another plan before)
    -> {"text_multiple": tokens} when on, else {}."""
    adapter.text_multiple = MULTIPLE if kernels.trim_text_padding else None
    if not kernels.trim_text_padding:
        return {}
    log.info("kernels: each batch's prompts cut to its longest, rounded up to %d tokens (at most %d)",
             MULTIPLE, adapter.max_sequence_length)
    return {"text_multiple": MULTIPLE}
