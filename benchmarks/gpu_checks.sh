#!/usr/bin/env bash
# Every GPU check and benchmark, on a CUDA machine, from the repo root. Logs and JSON go under
# $BENCH_OUT (default outputs/benchmarks); each stage prints a short summary. Stages run in the order given
# (default: cuda-tests):
#   bash benchmarks/gpu_checks.sh bytecode       # first, where the packages lack bytecode (a job warns so at start): the
#                                                # imports timed, the bytecode compiled (compileall), timed again; every
#                                                # later figure then counts the imports of an installed package
#   bash benchmarks/gpu_checks.sh cuda-tests     # the whole suite, cuda tests included; bench_scopes.py (bcg.scope
#                                                # per-image denoise times); the demo job on the GPU
#   bash benchmarks/gpu_checks.sh diffusers      # the cuda tests, the GPU demo, then bench_diffusers.py: end-to-end
#                                                # images/s against diffusers' pipeline, and bf16 image parity with it
#   bash benchmarks/gpu_checks.sh engine         # bench_engine.py: one CFG step eager vs replayed, per resolution and
#                                                # bucket; capture time and graph pool bytes
#   bash benchmarks/gpu_checks.sh bench-200      # +job=bench (its own kernels and ladder; KERNELS overrides them)
#                                                # on the 200-row manifest: our job against diffusers' pipeline
#   bash benchmarks/gpu_checks.sh flux           # the Flux cuda tests, then bench_flux.py: FLUX.1-dev's transformer step at
#                                                # 1024 and 512 px, batch 1: eager, our graph, the fastest bf16 and fp8
#                                                # kernels; then diffusers' FluxPipeline against ours (those kernels,
#                                                # under our graphs) in the same run: FLUX.1-dev 1024 px batch 1
#                                                # and 4, 512 px batch 1, FLUX.1-schnell 1024 px batch 1: s/image, fp8
#                                                # against bf16 images (PSNR), ours against diffusers', peak memory
#                                                # (FLUX_ARGS="--variants flux+compile_decoder=false ..." for others)
#   bash benchmarks/gpu_checks.sh flux-job       # the product's command, +job=bench model=flux_dev, on the 8 rows of
#                                                # jobs/manifests/flux_1024.parquet: diffusers' FluxPipeline saved once
#                                                # per batch size, then our job against it: bf16 and precision=fp8 at
#                                                # batch 1, precision=fp8 at batch 4; float8 images against bf16's
#                                                # (FLUX_RUNS="fp8-1 fp8-1-triton": float8 attention's kernel named)
#   bash benchmarks/gpu_checks.sh sd3-job        # the same for SD3 Medium (model=sd3_medium), SD3_RUNS default
#                                                # "bf16-1 fp8-1 bf16-8 fp8-8"
#   bash benchmarks/gpu_checks.sh families       # the SD3 and PixArt-float8 cuda tests, then bench_families.py (FAMILIES_PLANS: plans by name, default auto's), one process
#                                                # per family (FAMILIES="sd3_medium sd35_large ..."; FAMILIES_ARGS="--batches 1"
#                                                # etc.): the seed's table, diffusers' pipeline and our job at batch 1 and 8,
#                                                # native size, bf16 and precision=fp8: img/s, ratio, peak memory, PSNR
#   bash benchmarks/gpu_checks.sh kernels-1024   # bench_kernels.py at 1024 px, 8 prompts: a CFG step's ms and share of
#                                                # the matmul rate per kernel variant, time by kernel category, top
#                                                # kernels (KERNEL_VARIANTS="cudnn cudnn+fuse ..." for others;
#                                                # TEXT_TOKENS=64: captions of 64 tokens, as kernels.trim_text_padding fits them)
#   bash benchmarks/gpu_checks.sh kernels-512    # the same at 512 px, 16 prompts (the bench manifest's most common shape)
#   bash benchmarks/gpu_checks.sh baseline-1000  # diffusers' pipeline alone on the 1,000-row manifest, saved under
#                                                # $BENCH_OUT/baseline_1000 for bench-1000
#   bash benchmarks/gpu_checks.sh bench-1000     # our job on the same rows against that saved baseline
#                                                # (BASELINE_FROM=dir: another), building its kernels into an empty
#                                                # cache (COMPILE_CACHE=dir: that cache)
#   bash benchmarks/gpu_checks.sh compile-cache  # the 60-row job twice with one fresh kernels.compile_cache_dir:
#                                                # cold, then warm (KERNELS with kernels.compile=true for a compile)
#   bash benchmarks/gpu_checks.sh startup        # tests/test_startup_cuda.py (default plans: resumed and sharded jobs give
#                                                # one process's bytes), then bench_startup.py on the 60-row manifest:
#                                                # start-up stages cold and warm (a resumed job), the resumed job's and
#                                                # two concurrent shards' images against one process's, and two jobs
#                                                # under compile_tuning=timed compared (images, tuned block sizes)
#                                                # (STARTUP_ARGS="--limit 200" etc. replace "--timed")
#   bash benchmarks/gpu_checks.sh norm           # bench_norm.py: kernels.fuse_residual's layer norm per kernel (its Triton
#                                                # kernel's block sizes, inductor's fixed and timed) at PixArt-Sigma's row counts
#   bash benchmarks/gpu_checks.sh fp8-rows       # bench_fp8_rows.py: PixArt's float8 row functions (fast-fp8's residual adds,
#                                                # norms, quantizations) per kernel, Triton's block sizes against inductor's
#                                                # compile, at PixArt-Sigma's row counts (FP8_ROWS_ARGS="--bandwidth 3350" on an H100)
#   bash benchmarks/gpu_checks.sh fp8-1000       # PixArt-Sigma's 1,000-row bench without the baseline, precision=fp8 (fast-fp8)
#                                                # then bf16 (fast), one per-user cache: generate phase and wall images/s,
#                                                # float8 images against bf16's
#   bash benchmarks/gpu_checks.sh micro          # SDPA as the step calls it (views, masked cross-attention), GELU and
#                                                # residual epilogues, matmul rates
#   DECODE_ARGS="--variants nchw compile chunked" bash benchmarks/gpu_checks.sh decode
#                                                # bench_decode.py: VAE decode ms per image at 512/768/1024 px per
#                                                # variant (chunked: kernels.compile_decoder's one compilation)
#   bash benchmarks/gpu_checks.sh decoder-warm   # bench_decoder_warm.py: the compiled decoder's first pass in a new
#                                                # process, cold then warm (one inductor cache); warm bytes == cold
#   KERNELS=... bash benchmarks/gpu_checks.sh recompiles  # our job alone on 60 rows with TORCH_LOGS=recompiles:
#                                                # recompiles, graphs, compile and warm-up seconds
#   bash benchmarks/gpu_checks.sh writer-formats # +job=bench without the baseline on the 200-row manifest, with
#                                                # output.format=jpeg, then output.layout=webdataset: GPU busy
#                                                # (gpu_busy.fraction) and image bytes per format, each way
#   bash benchmarks/gpu_checks.sh cache-200      # the 200-row bench's baseline saved once, then our job against it on an
#                                                # empty per-user kernel cache (BCG_CACHE_DIR: cold) and on one a job on
#                                                # bench_tiny's 60 other rows wrote (warm); cold against warm images
#   bash benchmarks/gpu_checks.sh flux-aspects   # FLUX.1-dev float8 on the 24 rows of jobs/manifests/flux_aspects.parquet
#                                                # (four aspect ratios), as +job=bench runs it: diffusers' FluxPipeline
#                                                # saved once, then our job warm (a per-user cache written by a job on
#                                                # flux_1024.parquet's rows) and cold (an empty one); warm vs cold images
#   bash benchmarks/gpu_checks.sh profile        # the product's command on flux_1024.parquet's 1024 px rows, batch 1, per model
#                                                # (PROFILE_MODELS, default sd3_medium sd35_large flux_dev) and precision
#                                                # (PROFILE_PRECISIONS, default bf16 fp8), two batches under runtime.profile_batches:
#                                                # kernel time per image by category, the slowest kernels
#                                                # (PROFILE_MANIFEST=path, PROFILE_LADDER="[16]": other rows, batches)
#   bash benchmarks/gpu_checks.sh sweep          # PixArt-Sigma, 60 rows: one job, then a 3-job one-process sweep over
#                                                # bcg/ladder (the later jobs keep the model), on one warm per-user cache
#                                                # (SWEEP_ROWS=8: its first 8 rows, a job whose fixed costs dominate;
#                                                # SWEEP_CACHE=cold: the job and the sweep each on an empty cache)
#   bash benchmarks/gpu_checks.sh shards         # on 2 GPUs: the 1,000-row manifest as one process, then through the
#                                                # README's multi-GPU command; ids, images, images/s each way
#                                                # (SHARDS_MANIFEST=jobs/manifests/bench_small.parquet: 200 rows;
#                                                # SHARDS_ARGS=--shared-cache: the shards load the first run's tuned kernels;
#                                                # SHARDS_ARGS="--launcher ray": cluster=ray, a Ray task per GPU, needs .[ray])
#   bash benchmarks/gpu_checks.sh alone          # jobs run alone in a venv of the package's requirements only
#                                                # (benchmarks/lean_venv.py: a user's fresh venv): PixArt-Sigma's 200 rows
#                                                # cold, then warm (a cache bench_tiny's 60 rows wrote); FLUX.1-dev float8
#                                                # on flux_1024's 8 rows cold, then the 24 aspect rows warm: each job's start-up stages
#                                                # (after the stage bytecode where the packages lack it; ALONE_MODELS=pixart: those only;
#                                                # after the stage baseline-200, PixArt's jobs against its saved diffusers run)
#   bash benchmarks/gpu_checks.sh startup-profile  # where a warm start goes: the warm PixArt and Flux jobs of `alone`
#                                                # (on its caches, else filled here) under cProfile, stopped after their
#                                                # first batch; NAME.prof and NAME.prof.txt, the heaviest calls
#                                                # (PROFILE_JOBS="a b": any one_job jobs of those names under cProfile)
# The benchmark steps run under a hard time limit (timeout -s KILL: a compile can outlast a polite SIGTERM,
# the job finishes its step first); the *_LIMIT variables below change them.
# KERNELS is split on spaces: each override must be one word (no spaces inside, e.g. bcg.ladder=[1,2,4]).
# Each step's exit code is printed with its summary; the script exits 1 if any step failed.
set -uo pipefail
BENCH_OUT=${BENCH_OUT:-outputs/benchmarks}
mkdir -p "$BENCH_OUT"
export PYTHONUNBUFFERED=1
fail=0
rc() { echo "rc=$1"; [ "$1" -eq 0 ] || fail=1; }  # print a step's exit code; remember a failure
# bench_summary TITLE RC LOG: a +job=bench step's exit code and table, or its last lines if it failed
bench_summary() { echo "== $1"; rc $2; grep -A10 "^| system" "$3" | cut -c1-400; tail_if_failed $2 "$3"; }
# tail_if_failed RC LOG: the last lines of a failed step's log
tail_if_failed() { [ $1 -ne 0 ] && tail -4 "$2" | cut -c1-300; true; }
# since START (a `date +%s.%N` reading): the seconds to a tenth, as a process's wall time is compared between steps
since() { awk -v start="$1" -v end="$(date +%s.%N)" 'BEGIN { printf "%.1f", end - start }'; }
# stats_summary LABEL STATS_JSON: a job's images/s, warm-up, wall time, GPU busy and kernels (compile figures included)
stats_summary() { [ -f "$2" ] && python3 -c "import sys; from pipeline.report import RunReport; s=RunReport.read(sys.argv[2]); print(sys.argv[1], 'generate img/s', s.images_per_s, 'stage_s', s.stage_s, 'warmup_s', s.bcg.warmup_s, 'wall_s', s.wall_s, 'gpu_busy', s.gpu_busy and s.gpu_busy.fraction, 'kernels', s.kernels)" "$1" "$2"; true; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$BENCH_OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$BENCH_OUT/gpu.txt"
read -r -a kernels <<< "${KERNELS:-}"

pytest_cuda() {  # the cuda-marked tests, each one's result
  python3 -m pytest -p no:cacheprovider -v -rs -s -m cuda > "$BENCH_OUT/pytest_cuda.log" 2>&1; local code=$?
  echo "== pytest cuda"; rc $code; grep -E "PASSED|FAILED|ERROR|forward vs step" "$BENCH_OUT/pytest_cuda.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150; tail -2 "$BENCH_OUT/pytest_cuda.log"
}

gpu_demo() {  # +job=demo on the GPU in bf16
  rm -rf /tmp/gpu-demo
  python3 -m pipeline.run +job=demo runtime.device=cuda precision=bf16 output.dir=/tmp/gpu-demo > "$BENCH_OUT/demo.log" 2>&1; local code=$?
  cp /tmp/gpu-demo/stats.json "$BENCH_OUT/demo_stats.json" 2>/dev/null
  echo "== demo"; rc $code; grep -E "BCG|summary" "$BENCH_OUT/demo.log" | cut -c1-300
}

cuda_tests() {
  pytest_cuda
  python3 -m pytest -p no:cacheprovider -q -m "not cuda" > "$BENCH_OUT/pytest_cpu.log" 2>&1; cpu_rc=$?
  echo "== pytest not-cuda"; rc $cpu_rc; tail -2 "$BENCH_OUT/pytest_cpu.log"
  python3 benchmarks/bench_scopes.py --out "$BENCH_OUT/bench_scopes.json" > "$BENCH_OUT/bench_scopes.log" 2>&1; scopes_rc=$?
  echo "== scopes"; rc $scopes_rc; tail -12 "$BENCH_OUT/bench_scopes.log"
  gpu_demo
}

diffusers() {
  pytest_cuda
  gpu_demo
  python3 benchmarks/bench_diffusers.py --scopes forward loop --graph-warmup 1 --out "$BENCH_OUT/bench_diffusers.json" > "$BENCH_OUT/bench_diffusers.log" 2>&1; diff_rc=$?
  echo "== diffusers speed"; rc $diff_rc; tail -14 "$BENCH_OUT/bench_diffusers.log"
  python3 benchmarks/bench_diffusers.py --parity --out "$BENCH_OUT/parity_diffusers.json" > "$BENCH_OUT/parity_diffusers.log" 2>&1; parity_rc=$?
  echo "== diffusers parity"; rc $parity_rc; tail -16 "$BENCH_OUT/parity_diffusers.log"
}

engine() {
  timeout -s KILL ${ENGINE_LIMIT:-600} python3 benchmarks/bench_engine.py --out "$BENCH_OUT/bench_engine.json" > "$BENCH_OUT/bench_engine.log" 2>&1; engine_rc=$?
  echo "== engine"; rc $engine_rc; grep -E "^\||graphs captured|capture total|torch.compile|skipped" "$BENCH_OUT/bench_engine.log" | cut -c1-300
  tail_if_failed $engine_rc "$BENCH_OUT/bench_engine.log"
}

bench_200() {
  rm -rf /tmp/bench-200
  timeout -s KILL ${BENCH_LIMIT:-360} python3 -m pipeline.run +job=bench manifest.path=jobs/manifests/bench_small.parquet output.dir=/tmp/bench-200 "${kernels[@]}" > "$BENCH_OUT/bench_200.log" 2>&1; b200_rc=$?
  cp /tmp/bench-200/bench.json "$BENCH_OUT/bench_200.json" 2>/dev/null; cp /tmp/bench-200/stats.json "$BENCH_OUT/bench_200_stats.json" 2>/dev/null
  bench_summary "bench 200 rows ${KERNELS:-}" $b200_rc "$BENCH_OUT/bench_200.log"
}


flux() {
  timeout -s KILL ${FLUX_TESTS_LIMIT:-120} python3 -m pytest -p no:cacheprovider -v -rs -m cuda tests/test_models_cuda.py > "$BENCH_OUT/pytest_flux_cuda.log" 2>&1; flux_tests_rc=$?
  echo "== flux cuda tests"; rc $flux_tests_rc; grep -E "PASSED|FAILED|ERROR|SKIPPED" "$BENCH_OUT/pytest_flux_cuda.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150; tail -1 "$BENCH_OUT/pytest_flux_cuda.log"
  rm -f "$BENCH_OUT/bench_flux.json"
  timeout -s KILL ${FLUX_LIMIT:-420} python3 benchmarks/bench_flux.py ${FLUX_ARGS:-} --out "$BENCH_OUT/bench_flux.json" > "$BENCH_OUT/bench_flux.log" 2>&1; flux_rc=$?
  echo "== flux: FLUX.1-dev transformer step per variant; FLUX.1-dev and schnell against diffusers' FluxPipeline"; rc $flux_rc
  [ -f "$BENCH_OUT/bench_flux.json" ] && python3 benchmarks/bench_flux.py --report "$BENCH_OUT/bench_flux.json" | cut -c1-300
  tail_if_failed $flux_rc "$BENCH_OUT/bench_flux.log"
}

product_job() {  # product_job MODEL TAG RUNS: the product's command (+job=bench model=MODEL, no kernels.* key) on the
  # 8 rows at 1024 px of flux_1024.parquet: the model's default plans, bf16 and precision=fp8, against diffusers.
  # RUNS: "precision-batch[-kernel]" words (kernel: kernels.fp8_attention_kernel, e.g. fp8-1-triton); each batch's
  # baseline is saved once, under /tmp/TAG-base-b<batch> (JOB_KEEP=1: a baseline already there is reused, with the
  # compile cache); files and logs are named TAG_*
  local model=$1 tag=$2 runs=$3 manifest=jobs/manifests/flux_1024.parquet run precision batch fp8k code common cache
  cache=/tmp/$tag-cache
  common=(+job=bench model=$model manifest.path=$manifest kernels.compile_cache_dir=$cache)
  [ -n "${JOB_KEEP:-${FLUX_KEEP:-}}" ] || rm -rf /tmp/$tag-base-* $cache
  for run in $runs; do
    precision=${run%%-*}; batch=${run#*-}; fp8k=
    [[ $batch == *-* ]] && { fp8k=${batch#*-}; batch=${batch%%-*}; }
    if [ ! -f /tmp/$tag-base-b$batch/bench.json ]; then  # diffusers' pipeline alone, its timing and images saved
      timeout -s KILL ${JOB_LIMIT:-${FLUX_LIMIT:-240}} python3 -m pipeline.run "${common[@]}" precision=bf16 bench.baseline_only=true bench.baseline_batch=$batch output.dir=/tmp/$tag-base-b$batch > "$BENCH_OUT/${tag}_base_b$batch.log" 2>&1; code=$?
      cp /tmp/$tag-base-b$batch/bench.json "$BENCH_OUT/${tag}_base_b${batch}.json" 2>/dev/null
      echo "== $tag baseline, batch $batch"; rc $code; tail_if_failed $code "$BENCH_OUT/${tag}_base_b$batch.log"
    fi
    rm -rf /tmp/$tag-ours-$run
    timeout -s KILL ${JOB_LIMIT:-${FLUX_LIMIT:-240}} python3 -m pipeline.run "${common[@]}" precision=$precision bcg.ladder=[$batch] bench.baseline_batch=$batch bench.baseline_from=/tmp/$tag-base-b$batch output.dir=/tmp/$tag-ours-$run ${fp8k:+kernels.fp8_attention_kernel=$fp8k} "${kernels[@]}" > "$BENCH_OUT/${tag}_$run.log" 2>&1; code=$?
    cp /tmp/$tag-ours-$run/bench.json "$BENCH_OUT/${tag}_${run}_bench.json" 2>/dev/null
    cp /tmp/$tag-ours-$run/stats.json "$BENCH_OUT/${tag}_${run}_stats.json" 2>/dev/null
    bench_summary "$tag job, 8 rows at 1024 px, precision=$precision, batch $batch ${KERNELS:-}" $code "$BENCH_OUT/${tag}_$run.log"
  done
  if [ -d /tmp/$tag-ours-bf16-1/images ] && [ -d /tmp/$tag-ours-fp8-1/images ]; then
    python3 -m pipeline.compare /tmp/$tag-ours-bf16-1 /tmp/$tag-ours-fp8-1 --json "$BENCH_OUT/${tag}_fp8_vs_bf16.json" > "$BENCH_OUT/${tag}_fp8_vs_bf16.log" 2>&1; code=$?
    echo "== $tag fp8 vs bf16 images"; rc $code; tail -6 "$BENCH_OUT/${tag}_fp8_vs_bf16.log" | cut -c1-300
  fi
}

families() {  # the seed's table: every family's diffusers pipeline and our job, batch 1 and 8, its native size
  timeout -s KILL ${FAMILIES_TESTS_LIMIT:-300} python3 -m pytest -p no:cacheprovider -v -rs -s -m cuda tests/test_models_cuda.py tests/test_kernels_cuda.py -k "sd3 or float8_residual" > "$BENCH_OUT/pytest_families_cuda.log" 2>&1; local code=$?
  echo "== SD3 and PixArt float8 cuda tests"; rc $code; grep -E "PASSED|FAILED|ERROR|SKIPPED|relative error" "$BENCH_OUT/pytest_families_cuda.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-150; tail -1 "$BENCH_OUT/pytest_families_cuda.log"
  for family in ${FAMILIES:-pixart_sigma sd3_medium sd35_large flux_dev dit_xl_2_256}; do
    rm -f "$BENCH_OUT/families_$family.json"
    timeout -s KILL ${FAMILIES_LIMIT:-540} python3 benchmarks/bench_families.py --families $family ${FAMILIES_PLANS:+--plans $FAMILIES_PLANS} ${FAMILIES_ARGS:-} --work /tmp/bench-families --out "$BENCH_OUT/families_$family.json" > "$BENCH_OUT/families_$family.log" 2>&1; code=$?
    echo "== families: $family ${FAMILIES_ARGS:-}"; rc $code
    [ -f "$BENCH_OUT/families_$family.json" ] && python3 benchmarks/bench_families.py --report "$BENCH_OUT/families_$family.json" | cut -c1-400
    tail_if_failed $code "$BENCH_OUT/families_$family.log"
  done
}

kernels_1024() {
  timeout -s KILL ${KERNELS_LIMIT:-200} python3 benchmarks/bench_kernels.py --iters 8 --no-scopes --profile ${TEXT_TOKENS:+--text-tokens $TEXT_TOKENS} --variants ${KERNEL_VARIANTS:-cudnn cudnn+compile+blocks cudnn+compile+static} --out "$BENCH_OUT/bench_kernels.json" > "$BENCH_OUT/bench_kernels.log" 2>&1; kernels_rc=$?
  echo "== kernels 1024 px, 8 prompts"; rc $kernels_rc; grep -E "^\||TFLOP|Error|^Top|^  " "$BENCH_OUT/bench_kernels.log" | cut -c1-160
}

kernels_512() {
  timeout -s KILL ${K512_LIMIT:-100} python3 benchmarks/bench_kernels.py --side 512 --bucket 16 --iters 8 --no-scopes --profile --variants cudnn cudnn+compile+blocks --out "$BENCH_OUT/bench_kernels_512.json" > "$BENCH_OUT/bench_kernels_512.log" 2>&1; k512_rc=$?
  echo "== kernels 512 px, 16 prompts"; rc $k512_rc; grep -E "^\||TFLOP|Error|^  " "$BENCH_OUT/bench_kernels_512.log" | cut -c1-160
}

baseline_1000() {
  rm -rf "$BENCH_OUT/baseline_1000"
  timeout -s KILL ${BENCH_LIMIT:-560} python3 -m pipeline.run +job=bench bench.baseline_only=true output.dir="$BENCH_OUT/baseline_1000" > "$BENCH_OUT/baseline_1000.log" 2>&1; base_rc=$?
  echo "== baseline, 1,000 rows"; rc $base_rc; grep -E "diffusers baseline|baseline saved" "$BENCH_OUT/baseline_1000.log" | cut -c1-300
}

bench_1000() {
  rm -rf /tmp/bench-1000
  local cache=${COMPILE_CACHE:-$(mktemp -d /tmp/inductor-cold.XXXX)}  # default: compile from nothing, as a first run does
  timeout -s KILL ${BENCH_LIMIT:-560} python3 -m pipeline.run +job=bench bench.baseline_from=${BASELINE_FROM:-$BENCH_OUT/baseline_1000} output.dir=/tmp/bench-1000 kernels.compile_cache_dir=$cache "${kernels[@]}" > "$BENCH_OUT/bench_1000.log" 2>&1; b1000_rc=$?
  cp /tmp/bench-1000/bench.json "$BENCH_OUT/bench_1000.json" 2>/dev/null; cp /tmp/bench-1000/stats.json "$BENCH_OUT/bench_1000_stats.json" 2>/dev/null
  bench_summary "ours against the saved baseline, 1,000 rows ${KERNELS:-}" $b1000_rc "$BENCH_OUT/bench_1000.log"
}

compile_cache() {
  local cache
  cache=$(mktemp -d /tmp/inductor-cache.XXXX)
  for run in cold warm; do
    rm -rf /tmp/compile-cache-$run
    timeout -s KILL ${WARMUP_LIMIT:-180} python3 -m pipeline.run +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet output.dir=/tmp/compile-cache-$run kernels.compile_cache_dir=$cache "${kernels[@]}" > "$BENCH_OUT/compile_cache_$run.log" 2>&1; eval "cache_${run}_rc=$?"
    cp /tmp/compile-cache-$run/stats.json "$BENCH_OUT/compile_cache_${run}_stats.json" 2>/dev/null
  done
  echo "== compile cache: the 60-row job twice, one inductor cache ${KERNELS:-}"; rc $cache_cold_rc; rc $cache_warm_rc
  for run in cold warm; do stats_summary $run "$BENCH_OUT/compile_cache_${run}_stats.json"; done
  du -sh "$cache"
}

bytecode() {
  python3 benchmarks/bench_startup.py --imports-only --compile-bytecode --out "$BENCH_OUT/imports.json" > "$BENCH_OUT/imports.log" 2>&1; local code=$?
  echo "== bytecode: the imports, the missing bytecode compiled, the imports again"; rc $code; grep -E "^imports" "$BENCH_OUT/imports.log" | cut -c1-300
  tail_if_failed $code "$BENCH_OUT/imports.log"
}

startup() {
  python3 -m pytest -p no:cacheprovider -v -rs -m cuda tests/test_startup_cuda.py > "$BENCH_OUT/startup_tests.log" 2>&1; st_rc=$?
  echo "== startup cuda tests"; rc $st_rc; grep -E "PASSED|FAILED|ERROR|SKIPPED" "$BENCH_OUT/startup_tests.log" | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-200; tail_if_failed $st_rc "$BENCH_OUT/startup_tests.log"
  rm -rf /tmp/bench-startup
  timeout -s KILL ${STARTUP_LIMIT:-420} python3 benchmarks/bench_startup.py --work /tmp/bench-startup --out "$BENCH_OUT/startup.json" ${STARTUP_ARGS:---timed} -- "${kernels[@]}" > "$BENCH_OUT/startup.log" 2>&1; startup_rc=$?
  echo "== startup: cold, stopped, warm (resumed), 2 shards at once${STARTUP_ARGS:- --timed} ${KERNELS:-}"; rc $startup_rc
  grep -E "^\||^[a-z-]+: exit|^timed tuning" "$BENCH_OUT/startup.log" | cut -c1-400
  tail_if_failed $startup_rc "$BENCH_OUT/startup.log"
}

micro() {
  timeout -s KILL ${MICRO_LIMIT:-90} python3 benchmarks/bench_kernels.py --micro-only --iters 10 --out "$BENCH_OUT/bench_micro.json" > "$BENCH_OUT/bench_micro.log" 2>&1; micro_rc=$?
  echo "== micro"; rc $micro_rc; grep -vE "warn|^\s*$|\"\"\"" "$BENCH_OUT/bench_micro.log" | tail -14 | cut -c1-250
}

norm() {
  timeout -s KILL ${NORM_LIMIT:-150} python3 benchmarks/bench_norm.py --out "$BENCH_OUT/bench_norm.json" > "$BENCH_OUT/bench_norm.log" 2>&1; norm_rc=$?
  echo "== norm"; rc $norm_rc; grep -A20 "^| variant" "$BENCH_OUT/bench_norm.log" | cut -c1-250; tail_if_failed $norm_rc "$BENCH_OUT/bench_norm.log"
}

fp8_rows() {
  timeout -s KILL ${NORM_LIMIT:-150} python3 benchmarks/bench_fp8_rows.py ${FP8_ROWS_ARGS:-} --out "$BENCH_OUT/bench_fp8_rows.json" > "$BENCH_OUT/bench_fp8_rows.log" 2>&1; local code=$?
  echo "== fp8 rows"; rc $code; grep -A24 "^| variant" "$BENCH_OUT/bench_fp8_rows.log" | cut -c1-250; tail_if_failed $code "$BENCH_OUT/bench_fp8_rows.log"
}

decode() {
  timeout -s KILL ${DECODE_LIMIT:-60} python3 benchmarks/bench_decode.py ${DECODE_ARGS:-} --out "$BENCH_OUT/bench_decode.json" > "$BENCH_OUT/bench_decode.log" 2>&1; decode_rc=$?
  echo "== decode"; rc $decode_rc; grep -E "^\||VAE|Error" "$BENCH_OUT/bench_decode.log"
}

decoder_warm() {
  timeout -s KILL ${DECODER_WARM_LIMIT:-240} python3 benchmarks/bench_decoder_warm.py --out "$BENCH_OUT/decoder_warm.json" > "$BENCH_OUT/decoder_warm.log" 2>&1; local code=$?
  echo "== decoder first pass, cold then warm"; rc $code; grep -E "^\||torch" "$BENCH_OUT/decoder_warm.log"; tail_if_failed $code "$BENCH_OUT/decoder_warm.log"
}

recompiles() {
  rm -rf /tmp/recompiles
  TORCH_LOGS=recompiles timeout -s KILL ${WARMUP_LIMIT:-180} python3 -m pipeline.run +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet output.dir=/tmp/recompiles "${kernels[@]}" > "$BENCH_OUT/recompiles.log" 2>&1; recompiles_rc=$?
  cp /tmp/recompiles/stats.json "$BENCH_OUT/recompiles_stats.json" 2>/dev/null
  echo "== recompiles ${KERNELS:-}"; rc $recompiles_rc; echo "recompile lines: $(grep -c 'Recompiling function' "$BENCH_OUT/recompiles.log")"; grep -A3 "Recompiling function" "$BENCH_OUT/recompiles.log" | head -12 | cut -c1-250
  stats_summary recompiles "$BENCH_OUT/recompiles_stats.json"
  tail_if_failed $recompiles_rc "$BENCH_OUT/recompiles.log"
}

writer_formats() {
  for variant in output.format=jpeg output.layout=webdataset; do
    local name=${variant#output.}; name=${name/=/-}
    rm -rf /tmp/writer-$name
    timeout -s KILL ${BENCH_LIMIT:-360} python3 -m pipeline.run +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_small.parquet output.dir=/tmp/writer-$name $variant "${kernels[@]}" > "$BENCH_OUT/writer_$name.log" 2>&1; local code=$?
    cp /tmp/writer-$name/stats.json "$BENCH_OUT/writer_${name}_stats.json" 2>/dev/null
    echo "== writer: +job=bench bench.baseline=false, 200 rows, $variant ${KERNELS:-}"; rc $code
    [ -f "$BENCH_OUT/writer_${name}_stats.json" ] && python3 -c "import sys; from pipeline.report import RunReport; s=RunReport.read(sys.argv[1]); print('gpu_busy.fraction', s.gpu_busy and s.gpu_busy.fraction, 'between_batches', s.gpu_busy and s.gpu_busy.between_batches, 'writer_busy_s', s.writer_busy_s, 'generate img/s', s.images_per_s, 'output', s.output)" "$BENCH_OUT/writer_${name}_stats.json"
    tail_if_failed $code "$BENCH_OUT/writer_$name.log"
  done
}

baseline_200() {  # diffusers' pipeline on the 200-row manifest, saved in /tmp/baseline-200
  rm -rf /tmp/baseline-200
  timeout -s KILL ${BENCH_LIMIT:-240} python3 -m pipeline.run +job=bench bench.baseline_only=true manifest.path=jobs/manifests/bench_small.parquet output.dir=/tmp/baseline-200 > "$BENCH_OUT/baseline_200.log" 2>&1; local code=$?
  echo "== baseline, 200 rows"; rc $code; grep -E "diffusers baseline" "$BENCH_OUT/baseline_200.log" | cut -c1-300; tail_if_failed $code "$BENCH_OUT/baseline_200.log"
}

cache_200() {
  baseline_200
  local cold warm ours=(+job=bench bench.baseline_from=/tmp/baseline-200 manifest.path=jobs/manifests/bench_small.parquet)
  cold=$(mktemp -d /tmp/kernels-200-cold.XXXX); warm=$(mktemp -d /tmp/kernels-200-warm.XXXX)
  one_job bench_200_cold $cold "${ours[@]}" "${kernels[@]}"
  # warm: a cache written by a job on other rows and sizes (bench_tiny's 60), as a later night's job finds it
  one_job bench_200_fill $warm +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet "${kernels[@]}"
  one_job bench_200_warm $warm "${ours[@]}" "${kernels[@]}"
  python3 -m pipeline.compare /tmp/bench-bench_200_cold /tmp/bench-bench_200_warm 2>&1 | tail -1 | cut -c1-200
}



# one_job NAME BCG_CACHE_DIR JOB-ARGS...: one job in a process of its own (of JOB_PYTHON, default python3), on that
# per-user kernel cache, into /tmp/bench-NAME; its table, start-up stages and decoder figures, its log and JSON under $BENCH_OUT
one_job() {
  local name=$1 cache=$2 code start; start=$(date +%s.%N); shift 2
  rm -rf /tmp/bench-$name
  local prof=(); [[ " ${PROFILE_JOBS:-} " == *" $name "* ]] && prof=(-m cProfile -o "$BENCH_OUT/$name.prof")
  BCG_CACHE_DIR=$cache timeout -s KILL ${BENCH_LIMIT:-300} ${JOB_PYTHON:-python3} "${prof[@]}" -m pipeline.run output.dir=/tmp/bench-$name "$@" > "$BENCH_OUT/$name.log" 2>&1; code=$?
  cp /tmp/bench-$name/stats.json "$BENCH_OUT/${name}_stats.json" 2>/dev/null; cp /tmp/bench-$name/bench.json "$BENCH_OUT/${name}_bench.json" 2>/dev/null
  bench_summary "$name: the process took $(since $start) s" $code "$BENCH_OUT/$name.log"
  python3 -c "import sys; from pipeline.report import RunReport; s=RunReport.read(sys.argv[1]); print('startup_s', s.startup_s, 'decoder_first_pass_s', s.kernels.get('decoder_first_pass_s'), 'cache_hits', s.kernels.get('cache_hits'))" /tmp/bench-$name/stats.json 2>/dev/null
  [ ${#prof[@]} = 0 ] || python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1])
s.sort_stats('cumulative').print_stats(r'pipeline|bcg|diffusers|transformers|torch/(cuda|_dynamo/aot|_inductor/codecache)', 50)
s.sort_stats('tottime').print_stats(30)" "$BENCH_OUT/$name.prof" 2>&1 | grep -E '^ +[0-9]' | cut -c1-200 > "$BENCH_OUT/$name.prof.txt"
}

fp8_1000() {  # the 1,000-row bench's images/s in float8 against the fast plan's, and the images' PSNR
  local cache precision
  cache=$(mktemp -d /tmp/kernels-1000.XXXX)
  for precision in fp8 bf16; do
    one_job pixart_1000_$precision $cache +job=bench bench.baseline=false precision=$precision
    stats_summary $precision "$BENCH_OUT/pixart_1000_${precision}_stats.json"
  done
  python3 -m pipeline.compare /tmp/bench-pixart_1000_bf16 /tmp/bench-pixart_1000_fp8 --json "$BENCH_OUT/pixart_1000_fp8_vs_bf16.json" 2>&1 | tail -1 | cut -c1-200
}

flux_aspects() {
  local flux=(+job=bench model=flux_dev manifest.path=jobs/manifests/flux_aspects.parquet)
  rm -rf /tmp/flux-aspects-cache-*
  one_job flux_aspects_baseline /tmp/flux-aspects-cache-base "${flux[@]}" precision=bf16 bench.baseline_only=true
  one_job flux_aspects_fill /tmp/flux-aspects-cache-warm +job=bench model=flux_dev precision=fp8 manifest.path=jobs/manifests/flux_1024.parquet bench.baseline=false
  one_job flux_aspects_warm /tmp/flux-aspects-cache-warm "${flux[@]}" precision=fp8 bench.baseline_from=/tmp/bench-flux_aspects_baseline
  one_job flux_aspects_cold /tmp/flux-aspects-cache-cold "${flux[@]}" precision=fp8 bench.baseline_from=/tmp/bench-flux_aspects_baseline
  python3 -m pipeline.compare /tmp/bench-flux_aspects_warm /tmp/bench-flux_aspects_cold 2>&1 | tail -1 | cut -c1-200
}

alone() {  # jobs run alone, as a user's fresh venv runs them: process start to first commit, cold and warm
  rm -rf /tmp/lean
  python3 benchmarks/lean_venv.py /tmp/lean > "$BENCH_OUT/lean_venv.log" 2>&1; local code=$?
  echo "== alone: a venv of the package's requirements"; rc $code; tail -2 "$BENCH_OUT/lean_venv.log" | cut -c1-200
  [ $code = 0 ] || return
  local pixart=(+job=bench manifest.path=jobs/manifests/bench_small.parquet bench.baseline=false)
  [ -d /tmp/baseline-200 ] && pixart[2]=bench.baseline_from=/tmp/baseline-200  # after the stage baseline-200
  local flux=(+job=bench bench.baseline=false model=flux_dev precision=fp8)
  rm -rf /tmp/alone-cache-*
  export JOB_PYTHON="env -u PYTHONPATH /tmp/lean/bin/python"  # python -m finds the package in the repository root
  if [[ " ${ALONE_MODELS:-pixart flux} " == *" pixart "* ]]; then
    one_job alone_pixart_cold /tmp/alone-cache-pixart-cold "${pixart[@]}"
    # warm: a cache written by a job on other rows and sizes (bench_tiny's 60), as a later night's job finds it
    one_job alone_pixart_fill /tmp/alone-cache-pixart +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet
    one_job alone_pixart_warm /tmp/alone-cache-pixart "${pixart[@]}"
  fi
  if [[ " ${ALONE_MODELS:-pixart flux} " == *" flux "* ]]; then
    one_job alone_flux_cold /tmp/alone-cache-flux "${flux[@]}" manifest.path=jobs/manifests/flux_1024.parquet
    one_job alone_flux_warm /tmp/alone-cache-flux "${flux[@]}" manifest.path=jobs/manifests/flux_aspects.parquet
  fi
  unset JOB_PYTHON
}

startup_profile() {
  [ -x /tmp/lean/bin/python ] || python3 benchmarks/lean_venv.py /tmp/lean > "$BENCH_OUT/lean_venv.log" 2>&1
  local pixart=(+job=bench bench.baseline=false manifest.path=jobs/manifests/bench_small.parquet)
  local flux=(+job=bench bench.baseline=false model=flux_dev precision=fp8)
  export JOB_PYTHON="env -u PYTHONPATH /tmp/lean/bin/python"
  [ -d /tmp/alone-cache-pixart ] || one_job alone_pixart_fill /tmp/alone-cache-pixart +job=bench bench.baseline=false manifest.path=jobs/manifests/bench_tiny.parquet
  [ -d /tmp/alone-cache-flux ] || one_job alone_flux_cold /tmp/alone-cache-flux "${flux[@]}" manifest.path=jobs/manifests/flux_1024.parquet
  PROFILE_JOBS="prof_pixart_warm prof_flux_warm" BCG_STOP_AFTER_BATCHES=1 one_job prof_pixart_warm /tmp/alone-cache-pixart "${pixart[@]}"
  PROFILE_JOBS="prof_pixart_warm prof_flux_warm" BCG_STOP_AFTER_BATCHES=1 one_job prof_flux_warm /tmp/alone-cache-flux "${flux[@]}" manifest.path=jobs/manifests/flux_aspects.parquet
  local f; for f in "$BENCH_OUT"/prof_*.prof.txt; do echo "== $f"; head -30 "$f" | cut -c1-150; done
  unset JOB_PYTHON
}

profile() {
  local m p
  for m in ${PROFILE_MODELS:-sd3_medium sd35_large flux_dev}; do
    for p in ${PROFILE_PRECISIONS:-bf16 fp8}; do
      one_job profile_${m}_$p /tmp/profile-cache +job=bench model=$m precision=$p bench.baseline=false \
        manifest.path=${PROFILE_MANIFEST:-jobs/manifests/flux_1024.parquet} bcg.ladder=${PROFILE_LADDER:-[1]} runtime.profile_batches=2
      python3 -c "import json, sys; k=json.load(open(sys.argv[1]))['kernels']; p=k.get('profile') or {}
print('  plan', k['plan'], 'ms per image', p.get('ms_per_image')); [print('   ', *row) for row in p.get('slowest_ms_per_image', [])[:8]]" /tmp/bench-profile_${m}_$p/stats.json 2>&1 | tail -9
    done
  done
}

sweep() {
  local cache=/tmp/sweep-cache start manifest=jobs/manifests/bench_tiny.parquet rows
  if [ -n "${SWEEP_ROWS:-}" ]; then  # a smaller job: the manifest's first SWEEP_ROWS rows
    python3 -c "import sys, pyarrow.parquet as pq; pq.write_table(pq.read_table(sys.argv[1]).slice(0, int(sys.argv[2])), sys.argv[3])" $manifest $SWEEP_ROWS /tmp/sweep-rows.parquet
    manifest=/tmp/sweep-rows.parquet
  fi
  rows=(+job=bench bench.baseline=false manifest.path=$manifest)
  rm -rf $cache $cache-one /tmp/bench-sweep
  if [ "${SWEEP_CACHE:-warm}" = cold ]; then  # each run on an empty per-user cache of its own
    one_job sweep_one $cache-one "${rows[@]}" bcg/ladder=pow2_8
  else
    one_job sweep_fill $cache "${rows[@]}" bcg/ladder=pow2_16   # the per-user cache written first: both runs below are warm
    one_job sweep_one $cache "${rows[@]}" bcg/ladder=pow2_8
  fi
  start=$(date +%s.%N)
  BCG_CACHE_DIR=$cache timeout -s KILL ${BENCH_LIMIT:-300} python3 -m pipeline.run -m "${rows[@]}" bcg/ladder=pow2_8,pow2_16,one_8 hydra.sweep.dir=/tmp/bench-sweep > "$BENCH_OUT/sweep.log" 2>&1; local code=$?
  echo "== sweep of 3 jobs: the process took $(since $start) s"; rc $code; tail_if_failed $code "$BENCH_OUT/sweep.log"
  grep -E "^\|" /tmp/bench-sweep/summary.md 2>/dev/null | cut -c1-200
}

shards() {
  rm -rf /tmp/bench-shards
  timeout -s KILL ${SHARDS_LIMIT:-540} python3 benchmarks/bench_shards.py --model pixart_sigma --manifest ${SHARDS_MANIFEST:-jobs/manifests/bench_mixed.parquet} --launcher local_gpus --work /tmp/bench-shards --out "$BENCH_OUT/shards.json" ${SHARDS_ARGS:-} -- kernels.plan=fast kernels.trim_text_padding=true bcg/ladder=pow2_16 bcg.scope=step "${kernels[@]}" > "$BENCH_OUT/shards.log" 2>&1; shards_rc=$?
  echo "== shards: one process, then the README's multi-GPU command ${SHARDS_ARGS:-} ${KERNELS:-}"; rc $shards_rc; grep -E "^\| (ids|success|single|sharded|speedup|per_shard|images_vs)" "$BENCH_OUT/shards.log" | tail -7 | cut -c1-700
  tail_if_failed $shards_rc "$BENCH_OUT/shards.log"
}

for what in "${@:-cuda-tests}"; do
  case "$what" in
    bytecode) bytecode ;;
    cuda-tests) cuda_tests ;;
    diffusers) diffusers ;;
    engine) engine ;;
    bench-200) bench_200 ;;
    flux) flux ;;
    flux-job) product_job flux_dev flux "${FLUX_RUNS:-bf16-1 fp8-1 fp8-4}" ;;
    sd3-job) product_job sd3_medium sd3 "${SD3_RUNS:-bf16-1 fp8-1 bf16-8 fp8-8}" ;;
    families) families ;;
    kernels-1024) kernels_1024 ;;
    kernels-512) kernels_512 ;;
    baseline-1000) baseline_1000 ;;
    bench-1000) bench_1000 ;;
    compile-cache) compile_cache ;;
    startup) startup ;;
    micro) micro ;;
    norm) norm ;;
    fp8-rows) fp8_rows ;;
    decode) decode ;;
    decoder-warm) decoder_warm ;;
    recompiles) recompiles ;;
    writer-formats) writer_formats ;;
    cache-200) cache_200 ;;
    baseline-200) baseline_200 ;;
    flux-aspects) flux_aspects ;;
    fp8-1000) fp8_1000 ;;
    sweep) sweep ;;
    profile) profile ;;
    alone) alone ;;
    startup-profile) startup_profile ;;
    shards) shards ;;
    *) echo "== unknown stage $what: choose one named at the top of $0"; fail=1 ;;
  esac
done
exit $fail
