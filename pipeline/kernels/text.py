"""kernels.trim_text_padding: prompts padded to the longest prompt the job may encode (rounded up),
not to max_sequence_length. For families that mask the padding out of the text encoder and of
cross-attention, the images are the same up to rounding, and cross-attention and text encoding
do less work."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

from pipeline.plans import KernelSettings

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelSettings, adapter: Adapter, texts: Iterable[str] | None) -> dict:
    """The adapter's text length fitted to `texts` (every prompt the job may encode) -> {"text_length": n}
    when on, else {}."""
    if not kernels.trim_text_padding:
        return {}
    if texts is None:
        raise ValueError("kernels.trim_text_padding: apply_kernels needs every text the job will encode (texts=...)")
    length = adapter.fit_text_length(texts)
    log.info("kernels: prompts padded to %d tokens (the longest prompt, rounded up), not %d",
             length, adapter.max_sequence_length)
    return {"text_length": length}
