"""Write jobs/manifests/demo.parquet: 12 prompts over 3 resolutions (counts that leave remainders).

    python jobs/make_demo_manifest.py [out.parquet]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = [
    # id, prompt, width, height, seed, style
    ("cat-00", "a cat sitting on a windowsill", 64, 64, 0, "photo"),
    ("cat-01", "a cat sitting on a windowsill", 64, 64, 1, "photo"),
    ("dog-00", "a dog running on the beach", 64, 64, 2, "photo"),
    ("tree-00", "a lone tree on a hill at sunset", 64, 64, 3, "painting"),
    ("city-00", "a city street at night, neon lights", 64, 64, 4, "photo"),
    ("boat-00", "a sailing boat on a calm sea", 96, 64, 5, "painting"),
    ("boat-01", "a sailing boat on a calm sea", 96, 64, 6, "painting"),
    ("fox-00", "a red fox in the snow", 96, 64, 7, "photo"),
    ("cake-00", "a slice of chocolate cake", 96, 64, 8, "photo"),
    ("tower-00", "a lighthouse on a rocky coast", 64, 128, 9, "sketch"),
    ("tower-01", "a lighthouse on a rocky coast", 64, 128, 10, "sketch"),
    ("robot-00", "a small robot reading a book", 64, 128, 11, "sketch"),
]


def demo_table() -> pa.Table:
    cols = list(zip(*ROWS))
    return pa.table(
        {
            "id": pa.array(cols[0], pa.string()),
            "prompt": pa.array(cols[1], pa.string()),
            "width": pa.array(cols[2], pa.int64()),
            "height": pa.array(cols[3], pa.int64()),
            "seed": pa.array(cols[4], pa.int64()),
            "negative_prompt": pa.array(["blurry, low quality"] * len(ROWS), pa.string()),
            "style": pa.array(cols[5], pa.string()),
        }
    )


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "manifests" / "demo.parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(demo_table(), out)
    print(f"wrote {out} ({len(ROWS)} rows)")
