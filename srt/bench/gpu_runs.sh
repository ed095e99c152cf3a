#!/usr/bin/env bash
# The GPU tests and the benchmarks behind the GPU tables of docs/results/, in named sections, each
# bounded in time:
#
#   bash srt/bench/gpu_runs.sh gemvt dp1off dp1on gemm sweep
#   bash srt/bench/gpu_runs.sh moetest moe     # MoE kernel, windows/soft-caps, the Qwen3-30B-A3B shape
#   DEADLINE=1000 bash srt/bench/gpu_runs.sh kvtest diskpath multiturn   # KV tiers (issue 40)
#   bash srt/bench/gpu_runs.sh kvcheck         # staged writes + restart vs no cache, in float32
#   bash srt/bench/gpu_runs.sh quanttest quant # FP8/int4 kernel tests, then bf16 vs FP8 vs int4 (8B shape)
#   bash srt/bench/gpu_runs.sh int4test int4tune int4quant  # int4 kernel tests, int4_mm vs the
#                                              # older kernels (projections, then the 8B step)
#   DEADLINE=450 bash srt/bench/gpu_runs.sh servemix   # chunks alone vs mixed vs bounded mixed steps
#   DEADLINE=420 bash srt/bench/gpu_runs.sh serveattn  # the serving run on triton vs flashinfer attention
#   bash srt/bench/gpu_runs.sh servepri        # high-priority TTFT under a saturating load vs idle
#   DEADLINE=570 bash srt/bench/gpu_runs.sh servepace  # prefill first vs --tpot-target-ms 50
#                                              # vs that and --schedule-policy spf
#                                              # (SERVEPACE_VARIANTS picks: default paced spf spfpaced)
#
# Runs the checkout it lives in without installing it (the top-level folders are linked into a
# `radixlm` package under /tmp). Optional environment: WHEELS (a folder of wheels installed with
# pip --no-index into /tmp/site first, for machines without a package index), SOURCE_TGZ (a
# `git archive` of the tree to run instead of this checkout), RESULTS (where logs and JSON go,
# default ./gpu-results; packed into RESULTS.tgz at the end), DEADLINE (seconds for all the
# sections, default 570).
set -u
T0=$(date +%s)
DEADLINE=${DEADLINE:-570}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RESULTS=$(mkdir -p "${RESULTS:-$ROOT/gpu-results}" && cd "${RESULTS:-$ROOT/gpu-results}" && pwd)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }

if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${SOURCE_TGZ:-}" ]; then
  rm -rf /tmp/radixlm-src && mkdir -p /tmp/radixlm-src && tar xzf "$SOURCE_TGZ" -C /tmp/radixlm-src
  ROOT=/tmp/radixlm-src
fi
rm -rf /tmp/radixlm-pkg && mkdir -p /tmp/radixlm-pkg/radixlm
for d in srt lang radix grammar hicache kernels; do ln -s "$ROOT/$d" /tmp/radixlm-pkg/radixlm/$d; done
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/radixlm-pkg
export RADIXLM_CACHE_DIR=${RADIXLM_CACHE_DIR:-/tmp/radixlm-cache}
cd "$ROOT" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

section() { # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local rest
  rest=$(left)
  if [ "$rest" -lt 20 ]; then echo "== $name skipped (no time left)"; return; fi
  [ "$limit" -gt $((rest - 10)) ] && limit=$((rest - 10))
  echo "== $name (up to ${limit} s) $(date +%T)"
  timeout -k 5 "$limit" "$@" >"$RESULTS/$name.log" 2>&1
  echo "== $name rc=$? at $(($(date +%s) - T0)) s"
  tail -40 "$RESULTS/$name.log"
}

PYTEST="python3 -m pytest -q -p no:cacheprovider"
PROFILE="python3 -m radixlm.srt.bench.decode_profile --backends triton --steps 64"
SERVING="python3 -m radixlm.srt.bench.bench_serving --dummy-8b --dataset-name sharegpt-like
  --num-prompts 200 --random-input-len 2048 --max-input-len 16384 --random-output-len 256
  --max-output-len 1024 --request-rates 8,16,32 --max-running-requests 256
  --attention-backend triton"
for s in "$@"; do
  case $s in
    gemvt) section gemvt 200 $PYTEST tests/kernels/test_gemv.py tests/srt/engine/test_gpu_streaming_layers.py ;;
    wu) section wu 150 $PYTEST tests/srt/engine/test_gpu_weight_update.py ;;
    ktest) section ktest 300 $PYTEST -m gpu tests/kernels ;;
    attntest) section attntest 400 $PYTEST -m gpu ${ATTNTEST_K:+-k "$ATTNTEST_K"} tests/kernels/test_attention_backends.py ;;
    # -x --tb=short: the first failure's traceback is printed before a timeout can cut the log;
    # the speculative GPU tests need the default model, which GPU machines do not have
    etest) section etest "${ETEST_LIMIT:-420}" $PYTEST -x --tb=short -m gpu tests/srt \
      --ignore=tests/srt/speculative/test_speculative_gpu.py ${ETEST_K:+-k "$ETEST_K"} ;;
    gemm) section gemm 150 python3 -m radixlm.srt.bench.gemm_blas --batch-sizes 1,2,4 --json "$RESULTS/gemm.json" ;;
    sweep) section sweep 200 python3 -m radixlm.srt.bench.gemm_blas --batch-sizes 1 --sweep --json "$RESULTS/sweep.json" ;;
    dp1off) RADIXLM_GEMV=0 section dp1off 200 $PROFILE --kv-cache-dtypes auto --batch-sizes 1 --json "$RESULTS/dp1off.json" ;;
    dp1on) RADIXLM_GEMV=1 section dp1on 200 $PROFILE --kv-cache-dtypes auto --batch-sizes 1 --json "$RESULTS/dp1on.json" ;;
    dp) section dp 300 $PROFILE --kv-cache-dtypes auto,fp8_e4m3 --batch-sizes 256 --json "$RESULTS/dp.json" ;;
    # the Triton window/soft-cap cases of the attention tests only (FlashInfer's JIT builds: ktest)
    moetest) section moetest 300 $PYTEST --durations=12 -m gpu -k "not attention_backends or (window_and_softcap and triton)" tests/kernels/test_fused_moe.py tests/srt/executor/test_moe_runner.py tests/kernels/test_attention_backends.py tests/srt/models/test_models_greedy_families.py ;;
    moe) section moe 540 python3 -m radixlm.srt.bench.bench_moe --json "$RESULTS/moe.json" ${MOE_PHASES:+--phases $MOE_PHASES} ;;
    # the same with the weight-streaming kernels (attention half and router of each MoE layer)
    moeon) RADIXLM_GEMV=1 section moeon 300 python3 -m radixlm.srt.bench.bench_moe --json "$RESULTS/moe_gemv.json" --phases ${MOE_PHASES:-calib,engine} ;;
    moetune) section moetune 400 python3 -m radixlm.srt.bench.tune_moe --json "$RESULTS/moe_tiles.json" ;;
    quanttest) section quanttest 300 $PYTEST -m gpu tests/kernels/test_quant_gemm.py tests/srt/models/test_quant_checkpoints.py ;;
    # the int4 kernels' GPU tests, then int4_mm's sweep against the older int4 kernels and bf16
    # (rows 1-256; candidates until TUNE_DEADLINE s, then heuristics only)
    int4test) section int4test 170 $PYTEST -m gpu tests/kernels/test_int4_mm.py tests/kernels/test_quant_gemm.py ;;
    int4tune) section int4tune 400 python3 -m radixlm.srt.bench.tune_quant --kernels "${TUNE_KERNELS:-bf16,int4_mm,int4_gemv,int4_tiled,int4_dequant}" \
      --rows "${TUNE_ROWS:-1,4,16,64,256}" --sweep "${TUNE_SWEEP:-int4_mm}" --deadline-s "${TUNE_DEADLINE:-200}" --json "$RESULTS/int4_tune.json" ;;
    # the 8B step with int4 weights: the dispatch (int4_mm) against the older kernels, bf16 alongside
    int4quant) section int4quant 300 python3 -m radixlm.srt.bench.bench_quant --variants bf16,int4,int4_older --json "$RESULTS/int4_quant.json" ;;
    # launch-parameter sweep of the FP8/int4 kernels (bench/tune_quant.py)
    tunequant) section tunequant 560 python3 -m radixlm.srt.bench.tune_quant --json "$RESULTS/tune_quant.json" ;;
    quant) section quant 300 python3 -m radixlm.srt.bench.bench_quant --json "$RESULTS/quant.json"
      section quantengine 400 python3 -m radixlm.srt.bench.bench_gpu --sections calib,decode,prefill \
        --backends triton --graphs on --overlap on --quantization fp8 --json "$RESULTS/quantengine.json" ;;
    serve) section serve 560 $SERVING ;;
    # the serving issue's figures: goodput at 8 and 12 req/s, saturation at 32, the step timeline
    servecap) section servecap 560 $SERVING --request-rates 8,12,32 --step-timeline "$RESULTS/steps.jsonl" --plot "$RESULTS/serving.png" --output-file "$RESULTS/serving.jsonl" --parts ;;
    # chunks alone (the GPU default) vs mixed 8,192-token chunks vs mixed steps of about
    # MIX_TARGET_MS (default 50) ms sized from the measured prefill rate, at 8 and 12 req/s
    # (SERVEMIX_RATES), each with the step timeline; one comparison table. ~120 s a variant.
    servemix)
      rm -f "$RESULTS/servemix.jsonl"
      for v in default mixed bounded; do
        case $v in
          default) flags="" ;;
          mixed) flags="--enable-mixed-chunk" ;;
          bounded) flags="--mixed-step-target-ms ${MIX_TARGET_MS:-50}" ;;
        esac
        section "servemix-$v" 140 $SERVING --request-rates "${SERVEMIX_RATES:-8,12}" $flags \
          --label "$v" --output-file "$RESULTS/servemix.jsonl" --step-timeline "$RESULTS/steps-$v.jsonl"
      done
      python3 -m radixlm.srt.bench.serving_compare "$RESULTS/servemix.jsonl" | tee "$RESULTS/servemix.txt" ;;
    # the same serving run on the triton and the flashinfer attention backends (SERVEATTN_RATES,
    # default 12,32), each with the step timeline; one comparison table. ~150 s a variant
    # (SERVEATTN_LIMIT: seconds a variant may take, default 200; SERVEATTN_PARTS=1: --parts).
    # SERVEATTN_VARIANTS picks among triton, flashinfer (its defaults: mixed steps), fialone
    # (flashinfer, chunks alone), fimixed (flashinfer, mixed steps asked for) and fispf
    # (flashinfer, shortest prompt first).
    serveattn)
      rm -f "$RESULTS/serveattn.jsonl"
      for v in ${SERVEATTN_VARIANTS:-triton flashinfer}; do
        case $v in
          triton) flags="--attention-backend triton" ;;
          flashinfer) flags="--attention-backend flashinfer" ;;
          fialone) flags="--attention-backend flashinfer --disable-mixed-chunk" ;;
          fimixed) flags="--attention-backend flashinfer --enable-mixed-chunk" ;;
          fispf) flags="--attention-backend flashinfer --schedule-policy spf" ;;
          *) echo "unknown serveattn variant $v"; continue ;;
        esac
        section "serveattn-$v" "${SERVEATTN_LIMIT:-200}" $SERVING --request-rates "${SERVEATTN_RATES:-12,32}" \
          $flags --label "$v" --output-file "$RESULTS/serveattn.jsonl" \
          --step-timeline "$RESULTS/steps-attn-$v.jsonl" ${SERVEATTN_PARTS:+--parts}
      done
      python3 -m radixlm.srt.bench.serving_compare "$RESULTS/serveattn.jsonl" | tee "$RESULTS/serveattn.txt" ;;
    # the priority figure: an idle server's TTFT (16 prompts at 0.5 req/s), then 300 at 32 req/s
    # (saturating) with 5% of them high priority; TTFT per class (SERVEPRI_FLAGS: more flags)
    servepri) section servepri "${SERVEPRI_LIMIT:-240}" $SERVING --attention-backend flashinfer \
      --enable-priority-scheduling --request-rates 0.5,32 --rate-prompts 16,300 \
      --high-priority-share 0.05 --output-file "$RESULTS/servepri.jsonl" \
      --step-timeline "$RESULTS/steps-pri.jsonl" ${SERVEPRI_FLAGS:-} ;;
    # a mixed step (8,000 prompt tokens + 32 decode rows of 2,048-token contexts) against a
    # prefill-only one, kernel by kernel: what makes mixed steps prefill 1.3-1.5x slower
    # (MIXPROF_CHUNKS: other chunk sizes, e.g. 2048u,4096u,8192u for a prefill step's fixed cost;
    # MIXPROF_BACKEND: the attention backend, triton by default as in the serving sections)
    mixprof) section mixprof 240 python3 -m radixlm.srt.bench.bench_chunked_prefill --dummy-8b --prompt-len 8000 \
      --num-decodes 32 --decode-prompt-len 2048 --chunk-sizes=${MIXPROF_CHUNKS:-8192,8192u} --profile \
      --attention-backend "${MIXPROF_BACKEND:-triton}" --json "$RESULTS/mixprof.json" ;;
    servepace) # prefill first (the default) vs prefill paced for the running requests' TPOT,
      # then paced with shortest prompt first (bounded)
      rm -f "$RESULTS/servepace.jsonl"
      for v in ${SERVEPACE_VARIANTS:-default paced spfpaced}; do
        case $v in
          default) flags="" ;;
          paced) flags="--tpot-target-ms ${TPOT_TARGET_MS:-50}" ;;
          spf) flags="--schedule-policy spf" ;;
          spfpaced) flags="--tpot-target-ms ${TPOT_TARGET_MS:-50} --schedule-policy spf" ;;
        esac
        section "servepace-$v" 180 $SERVING --request-rates "${SERVEPACE_RATES:-8,12,32}" $flags \
          --label "$v" --output-file "$RESULTS/servepace.jsonl" --step-timeline "$RESULTS/steps-pace-$v.jsonl"
      done
      python3 -m radixlm.srt.bench.serving_compare "$RESULTS/servepace.jsonl" | tee "$RESULTS/servepace.txt" ;;
    kvtest) section kvtest 300 $PYTEST tests/hicache tests/radix/test_hiradix_restart.py tests/srt/executor/test_layer_loads.py ;;
    # the disk tier's read path against a raw read of its folder and the copy into host pages
    # (pool), quiet, then beside a thread of pure Python (as the scheduler thread is in a server);
    # each read as the server does (one preadv a page) and in 256 KiB chunks hashed in the cache
    diskpath) # the path against the bare copy into the pool, quiet and beside a busy thread, with
      # the path's time split on its reader threads (--phases: reads, preadv, checksum, waits)
      section diskpath 60 python3 -m radixlm.srt.bench.bench_disk_path --num-pages 512 --phases
      section diskpath-busy 60 python3 -m radixlm.srt.bench.bench_disk_path --num-pages 512 --phases --busy-thread
      section diskpath-t8 60 python3 -m radixlm.srt.bench.bench_disk_path --num-pages 512 --phases --threads 8
      # the Python read path (the fallback where the native helper cannot be built) as the baseline
      section diskpath-py 60 python3 -m radixlm.srt.bench.bench_disk_path --num-pages 512 --phases --python-path
      section diskpath-busy-py 60 python3 -m radixlm.srt.bench.bench_disk_path --num-pages 512 --phases --busy-thread --python-path ;;
    kvcheck) # staged writes and a restart against no cache: float32 (differences are then real)
      section kvcheck-test 150 $PYTEST tests/srt/scheduler/test_hicache_staged_restart.py
      section kvcheck 450 python3 -m radixlm.srt.bench.bench_multiturn --dummy-8b --attention-backend triton --replies fixed --dtype float32 --num-conversations 20 --modes off,disk,restart ;;
    multiturn) section multiturn 570 python3 -m radixlm.srt.bench.bench_multiturn --dummy-8b --attention-backend triton \
      --replies fixed --modes "${MULTITURN_MODES:-off,device,host,disk,restart}" ${MULTITURN_FLAGS:-} ;;
    serveoff) section serveoff 560 $SERVING --chunked-prefill-size -1 ;;
    *) echo "unknown section $s (see the case list in $0)" ;;
  esac
done
tar czf "$RESULTS.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
echo "results: $RESULTS.tgz"
