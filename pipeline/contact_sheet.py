"""A contact sheet: every image of an output directory in one PNG grid, its prompt under it.

`output.contact_sheet=true` writes `<output.dir>/contact_sheet.png` at the end of a job (the demo
does), from the shard files' samples. PIL only, default font.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pipeline.completion import CONTACT_SHEET
from pipeline.committed import read_committed
from pipeline.encoding import encode_png
from pipeline.fsutil import atomic_write_bytes
from pipeline.layouts import SHARDS_DIR, read_samples

CELL = 96  # pixels per image cell, square; images are scaled by a whole factor (nearest) to fit
CAPTION_LINES = 2
LINE = 12  # pixels per caption line
PAD = 4
BACKGROUND, INK = (255, 255, 255), (0, 0, 0)


def contact_sheet(images: list[Image.Image], captions: list[str], columns: int = 6) -> Image.Image:
    """images and their captions (same length) -> one RGB grid, row-major, `columns` wide."""
    if len(images) != len(captions):
        raise ValueError(f"contact_sheet: {len(images)} images but {len(captions)} captions")
    columns = max(1, min(columns, len(images)))
    rows = max(1, -(-len(images) // columns))
    cell_w, cell_h = CELL + 2 * PAD, CELL + 2 * PAD + CAPTION_LINES * LINE
    sheet = Image.new("RGB", (columns * cell_w, rows * cell_h), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell_w + PAD, (i // columns) * cell_h + PAD
        scale = max(1, CELL // max(image.size))
        shown = image.convert("RGB").resize((image.width * scale, image.height * scale), Image.NEAREST)
        shown.thumbnail((CELL, CELL))  # only shrinks: images larger than a cell
        sheet.paste(shown, (x + (CELL - shown.width) // 2, y + (CELL - shown.height) // 2))
        for j, line in enumerate(wrap(caption, draw, font, CELL)[:CAPTION_LINES]):
            draw.text((x, y + CELL + PAD + j * LINE), line, fill=INK, font=font)
    return sheet


def wrap(text: str, draw: ImageDraw.ImageDraw, font, width: int) -> list[str]:
    """Greedy word wrap to `width` pixels; a word longer than a line is cut."""
    lines, line = [], ""
    for word in text.split():
        candidate = f"{line} {word}".strip()
        if draw.textlength(candidate, font=font) <= width or not line:
            line = candidate
        else:
            lines.append(line)
            line = word
    lines.append(line)
    return [fit(l, draw, font, width) for l in lines]


def fit(line: str, draw: ImageDraw.ImageDraw, font, width: int) -> str:
    while line and draw.textlength(line, font=font) > width:
        line = line[:-1]
    return line


def write_contact_sheet(out_dir: str | Path, columns: int = 6) -> Path:
    """`<out_dir>/contact_sheet.png` from the shard files' samples (any output.layout), sorted by id."""
    out_dir = Path(out_dir)
    committed = read_committed(out_dir)
    layouts = {b.source: b.layout for b in committed.batches.values() if not b.staged}
    samples = [(row["id"], row["prompt"], data) for meta in committed.shards()
               for row, data in read_samples(out_dir, layouts[meta], meta)]
    if not samples:
        raise ValueError(f"output.contact_sheet: no images under {out_dir / SHARDS_DIR}")
    samples.sort(key=lambda s: s[0])
    images = [Image.open(io.BytesIO(data)) for _, _, data in samples]
    sheet = contact_sheet(images, [prompt for _, prompt, _ in samples], columns)
    path = out_dir / CONTACT_SHEET
    atomic_write_bytes(path, encode_png(np.asarray(sheet), compress_level=6))
    return path
