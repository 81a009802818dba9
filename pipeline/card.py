"""The dataset card, `<output.dir>/README.md`: its YAML header names the data files, so that
`datasets.load_dataset("<output.dir>")` reads exactly the samples (not stats.json, the contact
sheet, errors.parquet or failed.parquet). Written by `pipeline.merge` when a job completes; a
README.md that this tool did not write is left as it is.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.fsutil import atomic_write_text
from pipeline.layouts import SHARDS_DIR

log = logging.getLogger(__name__)

CARD = "README.md"
MARK = "<!-- written by bcg-datagen (pipeline.merge rewrites this file) -->"
DATA_FILES = {"files": f"{SHARDS_DIR}/*.parquet", "webdataset": f"{SHARDS_DIR}/*.tar", "parquet": f"{SHARDS_DIR}/*.parquet"}
WHAT = {
    "files": "one row of metadata per image; the image is the file at `path`, relative to this directory",
    "webdataset": "WebDataset tar shards: per sample `<key>.<ext>` (the image), `<key>.txt` (the prompt), "
                  "`<key>.json` (its metadata row)",
    "parquet": "Parquet shards: one row per image, its metadata and an `image` column (the `datasets` Image feature)",
}


def card_text(layout: str, images: int) -> str:
    return "\n".join([
        "---",
        "configs:",
        "- config_name: default",
        "  data_files:",
        "  - split: train",
        f"    path: {DATA_FILES[layout]}",
        "---",
        MARK,
        "",
        "# Generated images",
        "",
        f"{images} images, output.layout={layout}: {WHAT[layout]}. `stats.json` says how they were made;",
        "`failed.parquet` lists the rows that failed, if any.",
        "",
    ])


def write_card(out_dir: Path, layout: str, images: int) -> None:
    path = Path(out_dir) / CARD
    if path.exists() and MARK not in path.read_text(errors="replace"):
        log.warning("%s is not this tool's dataset card: left as it is (datasets.load_dataset reads the data with "
                    "data_files=%r)", path, DATA_FILES[layout])
        return
    atomic_write_text(path, card_text(layout, images))
