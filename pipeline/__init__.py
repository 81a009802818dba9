"""Offline dataset generation for diffusion transformers: manifest in, images and metadata out."""

import logging


class _ImageProcessorFallbackNotice(logging.Filter):
    """Drops transformers' notice that an image processor class falls back to its PIL version
    without torchvision. diffusers' Flux pipeline and IP-adapter loader name those classes when
    they are imported; no model family here uses an image processor, so the notice is nothing a
    user of this tool can act on (every other transformers message passes)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed); falling back to" not in record.getMessage()


# on the logger that emits it (a filter on a parent would not see it), before anything imports transformers
logging.getLogger("transformers.utils.import_utils").addFilter(_ImageProcessorFallbackNotice())
