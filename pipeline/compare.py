"""Compare the images of two output directories of the same manifest (e.g. kernels.fp8=true vs bf16).

    python -m pipeline.compare OUT_A OUT_B [--json result.json]

Per image id present in both (any output.layout and format): max absolute difference (levels of
255) and PSNR (dB, peak 255); prints the mean, the worst PSNR and the worst max difference. Images
with equal bytes are not decoded (identical outputs are the common case), and the rest decode on
threads (Pillow's decoders release the GIL). Both directories' images are read into memory.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.committed import read_images
from pipeline.errors import UserError


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def compare_one(row_id: str, data_a: bytes, data_b: bytes) -> dict:
    if data_a == data_b:
        return {"id": row_id, "psnr_db": math.inf, "max_levels": 0}
    a, b = (np.asarray(Image.open(io.BytesIO(d)).convert("RGB")) for d in (data_a, data_b))
    return {"id": row_id, "psnr_db": psnr(a, b), "max_levels": int(np.abs(a.astype(int) - b.astype(int)).max())}


def compare(dir_a: Path, dir_b: Path, per_image: bool = False) -> dict:
    """The summary; with `per_image`, each image's row too (under "per_image")."""
    for directory in (dir_a, dir_b):
        if not Path(directory).is_dir():
            raise UserError(f"{directory}: no such directory (give two jobs' output.dir)")
    images_a, images_b = read_images(dir_a), read_images(dir_b)
    ids = sorted(set(images_a) & set(images_b))
    if not ids:
        raise UserError(f"no image id is in both {dir_a} and {dir_b}")
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        rows = list(pool.map(lambda i: compare_one(i, images_a[i], images_b[i]), ids))
    finite = [r["psnr_db"] for r in rows if math.isfinite(r["psnr_db"])]
    result = {"images": len(rows), "identical": len(rows) - len(finite),
              "mean_psnr_db": round(float(np.mean(finite)), 2) if finite else math.inf,
              "min_psnr_db": round(min(finite), 2) if finite else math.inf,
              "max_levels": max(r["max_levels"] for r in rows)}
    return {**result, "per_image": rows} if per_image else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    try:
        result = compare(args.a, args.b)
    except UserError as err:
        parser.exit(2, f"{err}\n")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
