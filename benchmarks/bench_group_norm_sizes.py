"""The fused decoder's group norms at a new size: what their first call costs once the model's native
size (1024 px) has been decoded, as in a job (pipeline.kernels.decoder decodes it at kernel setup).

For each size, the decoder's group norms (channels and scales of the real VAEs' levels, 32 groups, bf16,
with and without SiLU) are called once, whose time holds any Triton compile, then `AGAIN` times more,
whose median is the kernels' own. Run each version in a fresh process on an empty Triton cache:

    TRITON_CACHE_DIR=$(mktemp -d) python3 benchmarks/bench_group_norm_sizes.py [--source FILE] [--out x.json]

`--source`: another version of pipeline/kernels/group_norm.py (`git show REV:pipeline/kernels/group_norm.py`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

# (channels, scale over the latent's side, SiLU after): the decoder's group norms, one call per kind
LEVELS = ((512, 1, True), (512, 1, False), (512, 2, True), (512, 4, True), (256, 4, True), (256, 8, True),
          (128, 8, True))
SIZES = ((1024, 1024), (512, 512), (768, 768), (1152, 896), (1344, 768))
AGAIN = 5


def load(source: Path):
    spec = importlib.util.spec_from_file_location("group_norm_under_test", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decode_norms(group_norm, width: int, height: int) -> float:
    """Seconds for one call of each level's group norm at this image size."""
    inputs = []
    for channels, scale, silu in LEVELS:
        x = torch.randn(1, channels, height // 8 * scale, width // 8 * scale, device="cuda", dtype=torch.bfloat16)
        inputs.append((x, torch.randn(channels, device="cuda", dtype=torch.bfloat16), silu))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, affine, silu in inputs:
        group_norm.group_norm(x, 32, affine, affine, 1e-6, silu)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "pipeline/kernels/group_norm.py")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    module = load(args.source)
    rows = []
    for width, height in SIZES:
        first = decode_norms(module, width, height)
        again = statistics.median(decode_norms(module, width, height) for _ in range(AGAIN))
        rows.append({"size": f"{width}x{height}", "first_ms": round(first * 1e3, 1), "again_ms": round(again * 1e3, 2)})
    print(f"{args.source}: " + " | ".join(f"{r['size']} {r['first_ms']:.0f} / {r['again_ms']:.1f} ms" for r in rows))
    if args.out:
        args.out.write_text(json.dumps({"source": str(args.source), "setting": getattr(module, "SETTING", None),
                                        "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
