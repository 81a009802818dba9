#!/usr/bin/env bash
# Every GPU check and benchmark, on a CUDA machine, from the repo root. Logs and JSON under $OUT
# (default outputs/gpu); a short summary per stage. Stages run in the order given:
#   bash jobs/gpu_checks.sh tests    # the whole suite, cuda tests included; scope benchmark; GPU demo
#   bash jobs/gpu_checks.sh bench    # cuda tests, GPU demo, diffusers speed and parity (bench_engine.py: run it alone)
#   KERNELS="kernels.compile=true kernels.compile_scope=blocks bcg/ladder=pow2_16" bash jobs/gpu_checks.sh issue8
#        # issue 8: +job=bench on 200 rows with those overrides; then fp8 vs bf16 (PSNR, images/s) on 60 rows
#        # with eager cuDNN kernels (float8 under torch.compile did not compile within 5 minutes; fp8 excludes fuse_gelu)
#   bash jobs/gpu_checks.sh kernels      # issue 8: the kernel table at 1024 px, 8 prompts, time by kernel category and
#                                        # top kernels (KERNEL_VARIANTS="cudnn cudnn+fuse ..." for others; TEXT_TOKENS=64:
#                                        # captions of 64 tokens, as kernels.trim_text_padding fits them)
#   bash jobs/gpu_checks.sh kernels512   # the same at 512 px, 16 prompts (the bench manifest's most common shape)
#   bash jobs/gpu_checks.sh bench200     # +job=bench (its own kernels and ladder; KERNELS overrides them) on 200 rows
#   bash jobs/gpu_checks.sh baseline1000 # the 1,000-row baseline alone (about 350 s), saved as $OUT/baseline1000.tar;
#                                        # unpack the fetched tar into outputs/ here, then in the next command
#   bash jobs/gpu_checks.sh ours1000     # (carry outputs/baseline1000) our job on the same rows against that baseline,
#                                        # compiling from an empty inductor cache (COMPILE_CACHE=dir: that cache)
#   bash jobs/gpu_checks.sh cache        # the 60-row job twice with one fresh kernels.compile_cache_dir: compile cold, then warm
#   bash jobs/gpu_checks.sh micro        # SDPA as the step calls it (views, masked cross-attention), GELU epilogue
#   DECODE_ARGS="--variants nchw compile chunked" bash jobs/gpu_checks.sh decode  # VAE decode per image, 512/768/1024 px
#                                        # (chunked: kernels.compile_decoder's one compilation for every side)
#   KERNELS=... bash jobs/gpu_checks.sh warmup   # our job alone on 60 rows with TORCH_LOGS=recompiles: graphs, compile s
#   bash jobs/gpu_checks.sh shards       # issue 9, on nvidia-h200-x2: the 1,000-row manifest as one process, then
#                                        # through the README's multi-GPU command; ids, images, images/s each way
#                                        # (about 480 s; SHARDS_MANIFEST=jobs/manifests/bench_small.parquet: about 190 s;
#                                        # SHARDS_ARGS=--shared-cache: the shards load the first run's tuned kernels)
# Every step has its own hard time limit (a compile can outlast a polite SIGTERM: the job finishes its step first).
# KERNELS is split on spaces: each override must be one word (no spaces inside, e.g. bcg.ladder=[1,2,4]).
# Each step's exit code is printed with its summary; the script exits 1 if any step failed.
set -uo pipefail
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
fail=0
rc() { echo "rc=$1"; [ "$1" -eq 0 ] || fail=1; }  # print a step's exit code; remember a failure
# bench_summary TITLE RC LOG: a +job=bench step's exit code and table, or its last lines if it failed
# stats_summary LABEL STATS_JSON: a job's images/s, warm-up, wall time, GPU busy and kernels (compile figures included)
stats_summary() { [ -f "$2" ] && python3 -c "import sys; from pipeline.report import RunReport; s=RunReport.read(sys.argv[2]); print(sys.argv[1], 'generate img/s', s.images_per_s, 'stage_s', s.stage_s, 'warmup_s', s.bcg.warmup_s, 'wall_s', s.wall_s, 'gpu_busy', s.gpu_busy and s.gpu_busy.fraction, 'kernels', s.kernels)" "$1" "$2"; true; }
bench_summary() { echo "== $1"; rc $2; grep -A10 "^| system" "$3" | cut -c1-400; [ $2 -ne 0 ] && tail -4 "$3" | cut -c1-300; true; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
read -r -a kernels <<< "${KERNELS:-}"

for what in "${@:-tests}"; do
  if [ "$what" = issue8 ]; then
    rm -rf /tmp/bench
    timeout -s KILL 330 python3 -m pipeline.run +job=bench manifest.path=jobs/manifests/bench_small.parquet output.dir=/tmp/bench "${kernels[@]}" > "$OUT/bench_job.log" 2>&1; bench_rc=$?
    cp /tmp/bench/bench.json "$OUT/bench_job.json" 2>/dev/null
    for fp8 in false true; do
      rm -rf /tmp/fp8-$fp8
      timeout -s KILL 150 python3 -m pipeline.run +job=bench bench.baseline=false kernels=default kernels.attention=cudnn kernels.trim_text_padding=false bcg/ladder=pow2_8 kernels.fp8=$fp8 manifest.path=jobs/manifests/bench_tiny.parquet output.dir=/tmp/fp8-$fp8 > "$OUT/fp8_$fp8.log" 2>&1; eval "fp8_${fp8}_rc=$?"
      cp /tmp/fp8-$fp8/stats.json "$OUT/fp8_$fp8.json" 2>/dev/null
    done
    python3 jobs/compare_images.py /tmp/fp8-false /tmp/fp8-true --json "$OUT/fp8_vs_bf16.json" > "$OUT/fp8_vs_bf16.log" 2>&1; compare_rc=$?
    bench_summary "bench ${KERNELS:-}" $bench_rc "$OUT/bench_job.log"
    echo "== fp8 vs bf16"; rc $fp8_false_rc; rc $fp8_true_rc; rc $compare_rc; cat "$OUT/fp8_vs_bf16.log"; for f in "$OUT"/fp8_false.json "$OUT"/fp8_true.json; do stats_summary "$f" "$f"; done; tail -n2 "$OUT"/fp8_true.log | cut -c1-300
  elif [ "$what" = kernels ]; then
    timeout -s KILL ${KERNELS_LIMIT:-200} python3 jobs/bench_kernels.py --iters 8 --no-scopes --profile ${TEXT_TOKENS:+--text-tokens $TEXT_TOKENS} --variants ${KERNEL_VARIANTS:-cudnn cudnn+compile+blocks cudnn+compile+static} --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1; kernels_rc=$?
    echo "== kernels"; rc $kernels_rc; grep -E "^\||TFLOP|Error|^Top|^  " "$OUT/bench_kernels.log" | cut -c1-160
  elif [ "$what" = kernels512 ]; then
    timeout -s KILL ${K512_LIMIT:-100} python3 jobs/bench_kernels.py --side 512 --bucket 16 --iters 8 --no-scopes --profile --variants cudnn cudnn+compile+blocks --out "$OUT/bench_kernels_512.json" > "$OUT/bench_kernels_512.log" 2>&1; k512_rc=$?
    echo "== kernels 512 px, 16 prompts"; rc $k512_rc; grep -E "^\||TFLOP|Error|^  " "$OUT/bench_kernels_512.log" | cut -c1-160
  elif [ "$what" = bench200 ]; then
    rm -rf /tmp/bench200
    timeout -s KILL ${BENCH_LIMIT:-360} python3 -m pipeline.run +job=bench manifest.path=jobs/manifests/bench_small.parquet output.dir=/tmp/bench200 "${kernels[@]}" > "$OUT/bench200.log" 2>&1; b200_rc=$?
    cp /tmp/bench200/bench.json "$OUT/bench200.json" 2>/dev/null; cp /tmp/bench200/stats.json "$OUT/bench200_stats.json" 2>/dev/null
    bench_summary "bench 200 rows ${KERNELS:-}" $b200_rc "$OUT/bench200.log"
  elif [ "$what" = baseline1000 ]; then
    timeout -s KILL ${BENCH_LIMIT:-560} python3 -m pipeline.run +job=bench bench.baseline_only=true output.dir="$OUT/baseline1000" > "$OUT/baseline1000.log" 2>&1; base_rc=$?
    echo "== baseline, 1,000 rows"; rc $base_rc; grep -E "diffusers baseline|baseline saved" "$OUT/baseline1000.log" | cut -c1-300
    # one file: the device tool brings back only a few files per command
    tar -C "$OUT" -cf "$OUT/baseline1000.tar" baseline1000 && rm -rf "$OUT/baseline1000"
  elif [ "$what" = ours1000 ]; then
    rm -rf /tmp/ours1000
    cache=${COMPILE_CACHE:-$(mktemp -d /tmp/inductor-cold.XXXX)}  # default: compile from nothing, as a first run does
    timeout -s KILL ${BENCH_LIMIT:-560} python3 -m pipeline.run +job=bench bench.baseline_from=${BASELINE_FROM:-outputs/baseline1000} output.dir=/tmp/ours1000 kernels.compile_cache_dir=$cache "${kernels[@]}" > "$OUT/ours1000.log" 2>&1; ours_rc=$?
    cp /tmp/ours1000/bench.json "$OUT/bench1000.json" 2>/dev/null; cp /tmp/ours1000/stats.json "$OUT/bench1000_stats.json" 2>/dev/null
    bench_summary "ours against the saved baseline, 1,000 rows ${KERNELS:-}" $ours_rc "$OUT/ours1000.log"
  elif [ "$what" = cache ]; then
    cache=$(mktemp -d /tmp/inductor-cache.XXXX)
    for run in cold warm; do
      rm -rf /tmp/cache-$run
      timeout -s KILL ${WARMUP_LIMIT:-180} python3 -m pipeline.run +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet output.dir=/tmp/cache-$run kernels.compile_cache_dir=$cache "${kernels[@]}" > "$OUT/cache_$run.log" 2>&1; eval "cache_${run}_rc=$?"
      cp /tmp/cache-$run/stats.json "$OUT/cache_${run}_stats.json" 2>/dev/null
    done
    echo "== compile cache: the 60-row job twice, one inductor cache ${KERNELS:-}"; rc $cache_cold_rc; rc $cache_warm_rc
    for run in cold warm; do stats_summary $run "$OUT/cache_${run}_stats.json"; done
    du -sh "$cache"
  elif [ "$what" = micro ]; then
    timeout -s KILL 90 python3 jobs/bench_kernels.py --micro-only --iters 10 --out "$OUT/bench_micro.json" > "$OUT/bench_micro.log" 2>&1; micro_rc=$?
    echo "== micro"; rc $micro_rc; grep -vE "warn|^\s*$|\"\"\"" "$OUT/bench_micro.log" | tail -14 | cut -c1-250
  elif [ "$what" = decode ]; then
    timeout -s KILL ${DECODE_LIMIT:-60} python3 jobs/bench_decode.py ${DECODE_ARGS:-} --out "$OUT/bench_decode.json" > "$OUT/bench_decode.log" 2>&1; decode_rc=$?
    echo "== decode"; rc $decode_rc; grep -E "^\||VAE|Error" "$OUT/bench_decode.log"
  elif [ "$what" = shards ]; then
    rm -rf /tmp/bench-shards
    timeout -s KILL ${SHARDS_LIMIT:-540} python3 jobs/bench_shards.py --model pixart_sigma --manifest ${SHARDS_MANIFEST:-jobs/manifests/bench_mixed.parquet} --launcher local_gpus --work /tmp/bench-shards --out "$OUT/shards.json" ${SHARDS_ARGS:-} -- kernels=fast kernels.trim_text_padding=true bcg/ladder=pow2_16 bcg.scope=step "${kernels[@]}" > "$OUT/shards.log" 2>&1; shards_rc=$?
    echo "== shards: one process, then the README's multi-GPU command ${SHARDS_ARGS:-} ${KERNELS:-}"; rc $shards_rc; grep -E "^\| (ids|success|single|sharded|speedup|per_shard|images_vs)" "$OUT/shards.log" | tail -7 | cut -c1-700
    [ $shards_rc -ne 0 ] && tail -4 "$OUT/shards.log" | cut -c1-300
  elif [ "$what" = warmup ]; then
    rm -rf /tmp/warmup
    TORCH_LOGS=recompiles timeout -s KILL ${WARMUP_LIMIT:-180} python3 -m pipeline.run +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet output.dir=/tmp/warmup "${kernels[@]}" > "$OUT/warmup.log" 2>&1; warmup_rc=$?
    cp /tmp/warmup/stats.json "$OUT/warmup_stats.json" 2>/dev/null
    echo "== warmup ${KERNELS:-}"; rc $warmup_rc; echo "recompile lines: $(grep -c 'Recompiling function' "$OUT/warmup.log")"; grep -A3 "Recompiling function" "$OUT/warmup.log" | head -12 | cut -c1-250
    stats_summary warmup "$OUT/warmup_stats.json"
    [ $warmup_rc -ne 0 ] && tail -4 "$OUT/warmup.log" | cut -c1-300
  elif [ "$what" = tests ]; then
    python3 -m pytest -p no:cacheprovider -v -rs -s -m cuda > "$OUT/pytest_cuda.log" 2>&1; cuda_rc=$?
    python3 -m pytest -p no:cacheprovider -q -m "not cuda" > "$OUT/pytest_cpu.log" 2>&1; cpu_rc=$?
    python3 jobs/bench_scopes.py --out "$OUT/bench_scopes.json" > "$OUT/bench_scopes.log" 2>&1; scopes_rc=$?
    rm -rf /tmp/gpu-demo
    python3 -m pipeline.run +job=demo runtime.device=cuda precision=bf16 output.dir=/tmp/gpu-demo > "$OUT/demo.log" 2>&1; demo_rc=$?
    echo "== pytest cuda"; rc $cuda_rc; grep -E "PASSED|FAILED|ERROR|forward vs step" "$OUT/pytest_cuda.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150; tail -2 "$OUT/pytest_cuda.log"
    echo "== pytest not-cuda"; rc $cpu_rc; tail -2 "$OUT/pytest_cpu.log"
    echo "== scopes"; rc $scopes_rc; tail -12 "$OUT/bench_scopes.log"
    echo "== demo"; rc $demo_rc; grep -E "BCG|summary" "$OUT/demo.log" | cut -c1-300
  elif [ "$what" = bench ]; then
    python3 -m pytest -p no:cacheprovider -v -rs -s -m cuda > "$OUT/pytest_cuda.log" 2>&1; cuda_rc=$?
    rm -rf /tmp/gpu-demo
    python3 -m pipeline.run +job=demo runtime.device=cuda precision=bf16 output.dir=/tmp/gpu-demo > "$OUT/demo.log" 2>&1; demo_rc=$?
    cp /tmp/gpu-demo/stats.json "$OUT/demo_stats.json"
    echo "== pytest cuda"; rc $cuda_rc; grep -E "PASSED|FAILED|ERROR|forward vs step" "$OUT/pytest_cuda.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150; tail -2 "$OUT/pytest_cuda.log"
    echo "== demo"; rc $demo_rc; grep -E "BCG|summary" "$OUT/demo.log" | cut -c1-300
    python3 jobs/bench_diffusers.py --scopes forward loop --graph-warmup 1 --out "$OUT/bench_diffusers.json" > "$OUT/bench_diffusers.log" 2>&1; diff_rc=$?
    echo "== diffusers speed"; rc $diff_rc; tail -14 "$OUT/bench_diffusers.log"
    python3 jobs/bench_diffusers.py --parity --out "$OUT/parity_diffusers.json" > "$OUT/parity_diffusers.log" 2>&1; parity_rc=$?
    echo "== diffusers parity"; rc $parity_rc; tail -16 "$OUT/parity_diffusers.log"
  else
    echo "== unknown stage $what: choose one named at the top of $0"; fail=1
  fi
done
exit $fail
