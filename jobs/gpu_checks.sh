#!/usr/bin/env bash
# Every GPU check and benchmark for the engine, in one run on a CUDA machine, from the repo root:
#   bash jobs/gpu_checks.sh            (logs and JSON under $OUT, default outputs/gpu)
# Prints a short summary last.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"

# 1. The whole suite, GPU tests included (they skip only without CUDA).
python3 -m pytest -p no:cacheprovider -v -rs 2>&1 > "$OUT/pytest.log"
pytest_rc=$?

# 2. The engine benchmark (eager vs BCG per resolution and bucket, pools, capture, compile).
python3 jobs/bench_engine.py --out "$OUT/bench_engine.json" > "$OUT/bench_engine.log" 2>&1
bench_rc=$?

# 3. The demo job on the GPU with graphs on: its stats.json.
rm -rf /tmp/gpu-demo
python3 -m pipeline.run +job=demo runtime.device=cuda precision=bf16 runtime.progress=false \
    output.dir=/tmp/gpu-demo > "$OUT/demo.log" 2>&1
demo_rc=$?
cp /tmp/gpu-demo/stats.json "$OUT/demo_stats.json" 2>/dev/null

echo "== pytest (rc=$pytest_rc)"; grep -E "PASSED|FAILED|ERROR" "$OUT/pytest.log" | grep -i cuda; tail -3 "$OUT/pytest.log"
echo "== bench (rc=$bench_rc)"; tail -30 "$OUT/bench_engine.log"
echo "== demo (rc=$demo_rc)"; tail -3 "$OUT/demo.log"
python3 - "$OUT/demo_stats.json" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("no demo stats")
b = s["bcg"]
print(f"demo: {s['images']} {s['images_per_s']} img/s; graphs {b['graphs_captured']} hits {b['hits']} misses {b['misses']} "
      f"capture {b['capture_s']} s warmup {b['warmup_s']} s pool {b['pool_bytes']/2**20:.1f} MiB "
      f"predicted {b['predicted_pool_bytes']/2**20:.1f} MiB separate-predicted {b['predicted_separate_pools_bytes']/2**20:.1f} MiB")
PY
