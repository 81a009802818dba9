"""The demo: its manifest, and the digits vocabulary and data of the demo model (conf/model/digits.yaml).

The demo model is a tiny PixArt-Sigma pipeline trained (jobs/train_digits.py) to draw the digit a
prompt asks for. Its data is scikit-learn's digits (8x8, 17 gray levels): the first TRAIN_SHARE by
index train the generator; the rest (`held_out_digits`) are never seen by it and train the
classifier (`fit_classifier`) that reads generated digits back, so a quality check asks "is this
the digit the prompt named" with a reader the generator could not have fitted.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from pipeline.errors import UserError

TRAIN_SHARE = 0.8  # the first 80% of the digits by index train the generator; the rest never
# Every (H, W) the demo model draws and is trained at: each side a multiple of its granularity (8) up
# to its max_side (48, conf/model/digits.yaml), as the manifest's check allows.
SIDES = range(8, 49, 8)
SIZES = tuple(itertools.product(SIDES, SIDES))
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = (  # {d}: the numeral, {w}: the word
    "{d}", "{w}", "digit {d}", "digit {w}", "the number {w}", "the number {d}", "a handwritten digit {d}",
    "a handwritten {w}", "handwritten number {d}", "a drawing of the digit {w}",
)

# The demo manifest: 12 digit prompts over 3 resolutions, in counts that leave remainders at every
# ladder. The sizes are multiples of 16 up to 48 px, valid for the demo model (granularity 8, max
# side 48) and for the tests' random-weight tiny model (granularity 16).
DEMO_ROWS = [
    # id, prompt, width, height, seed, style (the phrasing)
    ("d0-0", "a handwritten digit 0", 32, 32, 0, "sentence"),
    ("d1-0", "the number one", 32, 32, 1, "word"),
    ("d2-0", "2", 32, 32, 2, "numeral"),
    ("d3-0", "digit three", 32, 32, 3, "word"),
    ("d4-0", "a handwritten digit 4", 32, 32, 4, "sentence"),
    ("d5-0", "the number five", 48, 48, 5, "word"),
    ("d6-0", "6", 48, 48, 6, "numeral"),
    ("d7-0", "a handwritten digit 7", 48, 48, 7, "sentence"),
    ("d8-0", "digit eight", 48, 48, 8, "word"),
    ("d9-0", "the number nine", 32, 48, 9, "word"),
    ("d3-1", "3", 32, 48, 10, "numeral"),
    ("d7-1", "a handwritten seven", 32, 48, 11, "sentence"),
]


def demo_table() -> pa.Table:
    """The demo manifest (jobs/manifests/demo.parquet) as a table; `style` is an extra column."""
    cols = list(zip(*DEMO_ROWS))
    return pa.table(
        {
            "id": pa.array(cols[0], pa.string()),
            "prompt": pa.array(cols[1], pa.string()),
            "width": pa.array(cols[2], pa.int64()),
            "height": pa.array(cols[3], pa.int64()),
            "seed": pa.array(cols[4], pa.int64()),
            "negative_prompt": pa.array([None] * len(DEMO_ROWS), pa.string()),  # "" (the trained unconditional prompt)
            "style": pa.array(cols[5], pa.string()),
        }
    )


def prompt_for(label: int, rng: random.Random) -> str:
    return rng.choice(PHRASINGS).format(d=label, w=WORDS[label])


def split_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held out) indices: the first TRAIN_SHARE of the digits by index, and the rest."""
    cut = int(n * TRAIN_SHARE)
    return np.arange(cut), np.arange(cut, n)


def digits() -> tuple[np.ndarray, np.ndarray]:
    """images [N, 8, 8] float in [0, 16], labels [N]."""
    try:
        from sklearn.datasets import load_digits  # here: the demo manifest and job need no scikit-learn
    except ModuleNotFoundError:
        raise UserError("the demo model's digits come from scikit-learn, which is not installed: "
                        "pip install -e '.[demo]'") from None

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


def held_out_digits() -> tuple[np.ndarray, np.ndarray]:
    images, labels = digits()
    _, held = split_indices(len(labels))
    return images[held], labels[held]


def to_pixels(images8: np.ndarray, height: int, width: int) -> torch.Tensor:
    """[N, 8, 8] in [0, 16] -> [N, 3, H, W] in [-1, 1] (ink light on black, gray replicated), bilinear."""
    x = torch.from_numpy(images8).float()[:, None] / 8.0 - 1.0
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    return x.expand(-1, 3, -1, -1).contiguous()


def features(images: np.ndarray) -> np.ndarray:
    """[N, H, W] gray in [0, 1] (any size) -> [N, 64]: area-averaged down to 8x8."""
    x = torch.from_numpy(np.asarray(images, np.float32))[:, None]
    return F.adaptive_avg_pool2d(x, 8).flatten(1).numpy()


def fit_classifier():
    """An RBF support-vector classifier (sklearn SVC) on the held-out digits only, resized up to
    32 px and back down, as a generated image is read. The two splits come from different writers:
    it misreads some real digits of the training split too, which bounds what a generated set can score."""
    images8, labels = held_out_digits()  # names the demo extra where scikit-learn is missing
    from sklearn.svm import SVC

    gray = (to_pixels(images8, 32, 32)[:, 0].numpy() + 1.0) / 2.0
    return SVC(gamma=0.5, C=10.0).fit(features(gray), labels)
