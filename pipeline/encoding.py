"""Image encoding: `output.format` png | jpeg | webp with its options, through Pillow.

An encoding is a pure function of the pixels and these options, so the same job gives the same
bytes. Every output row records `format` and `quality` (null for PNG and for lossless WebP: a
change of either is a resume conflict, since the committed images would differ), and per image
its `bytes` and `sha256`.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

EXTENSIONS = {"png": "png", "jpeg": "jpg", "webp": "webp"}


@dataclass(frozen=True)
class Encoding:
    """output.format with its options (checked by pipeline.config.check_output)."""

    format: str = "png"
    quality: int = 95  # JPEG and lossy WebP: 1 (smallest) to 100 (best)
    lossless: bool = False  # WebP only
    png_compress_level: int = 6  # PNG only: zlib effort, the pixels are the same at every level

    @property
    def ext(self) -> str:
        return EXTENSIONS[self.format]

    @property
    def row_quality(self) -> int | None:
        """What the rows record as `quality`: None where the pixels are stored exactly."""
        return None if self.format == "png" or self.lossless else self.quality

    def fields(self) -> dict[str, object]:
        """The columns every output row of this encoding holds (compared on resume)."""
        return {"format": self.format, "quality": self.row_quality}

    def encode(self, pixels: np.ndarray) -> bytes:
        """[H, W, 3] uint8 -> the encoded file. Pillow's encoders release the GIL."""
        buf = io.BytesIO()
        image = Image.fromarray(pixels, mode="RGB")
        if self.format == "png":
            image.save(buf, format="PNG", compress_level=self.png_compress_level)
        elif self.format == "jpeg":
            image.save(buf, format="JPEG", quality=self.quality)
        else:
            # Lossless WebP reads `quality` as effort; its default keeps the same bytes for a job.
            options = {"lossless": True} if self.lossless else {"quality": self.quality}
            image.save(buf, format="WEBP", **options)
        return buf.getvalue()


def encoding_of(output) -> Encoding:
    """The encoding an `OutputConfig` asks for."""
    return Encoding(output.format, output.quality, output.lossless, output.png_compress_level)


@dataclass(frozen=True)
class Encoded:
    data: bytes
    sha256: str


def encode_image(encoding: Encoding, pixels: np.ndarray) -> Encoded:
    data = encoding.encode(pixels)
    return Encoded(data, hashlib.sha256(data).hexdigest())


def encode_png(pixels: np.ndarray, compress_level: int = 6) -> bytes:
    """A PNG for files that are not dataset images (the contact sheet)."""
    return Encoding("png", png_compress_level=compress_level).encode(pixels)
