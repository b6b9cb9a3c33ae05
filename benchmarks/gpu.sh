#!/usr/bin/env bash
# Every GPU test and benchmark. Logs and JSON under $OUT; a short table last; exits non-zero when a GPU test,
# the contention benchmark or the training benchmark (its loss or gradient guard included) fails.
# Split it by the switches below (one 10-minute device call does not hold everything); the past splits, with
# what each took: benchmarks/NOTES.md, "Moved from gpu.sh (2026-12-05)".
#   TESTS=1 (default): the GPU tests (pytest -m gpu; PYTEST_K: their -k, TEST_TIMEOUT: seconds, default 540). On 4
#     GPUs the 2-GPU tests run on two GPU pairs side by side, then the tests with "4gpus" in their id; on 8 GPUs
#     those with "8gpus" last.
#   BENCH=1 (default): benchmarks/train_bench.py on NPROC (2) ranks, TOKENS ("1024 4096") tokens per GPU, REPEATS (1)
#     runs; SYSTEMS: its --system specs (family[:key=value,...], `python benchmarks/train_bench.py --help`), by
#     default the headline's, "no_comm_bound fsdp2_eager fsdp2_compile fsdp_compile"; BENCH_ARGS: more of its
#     options; TAG: the output files' name; TRACE=1 (host activity too) or TRACE=kernels: each system's profiler
#     trace kept, summarized into $OUT/trace_summary_<tag>.txt (benchmarks/trace_summary.py); TORCHRUN_ARGS: more
#     torchrun options, e.g. "--numa-binding node" (torch 2.9+, needs numactl).
#   COMPILE_TIME=1 (one GPU): compile_time.py, the first step's compile time of the default, regions=False and plain
#     torch.compile at the 0.95B shape and at 80 layers of dim 1024 (COMPILE_MODELS: which, default "0.95b 80x1024";
#     COMPILE_ARGS: more of its options, e.g. "--float8 tensorwise" with torchao carried as a wheel, or "--systems
#     default"; COMPILE_TAG: a suffix for the output files' names).
#   CONTENTION=1, HOST_COST=1, NCCL_BUFFERS=1: gemm_contention.py, ce_host_cost.py, nccl_buffers.py; META_INIT=1
#     (one GPU): meta_init_memory.py (the 70B shape on rank 0 of a fake 64), then examples/big_model.py at 8.8B.
#   OFFLOAD_COSTS=1 (one GPU): offload_costs.py, the host-device copies and host AdamW steps of CPU offload (0.95B).
# For example:
#   OUT=/tmp/out BENCH=0 PYTEST_K="not 4gpus" bash benchmarks/gpu.sh             # then "4gpus and not exchange",
#                                                                                 # "4gpus and exchange", "8gpus"
#   OUT=/tmp/out TESTS=0 TOKENS=4096 REPEATS=3 bash benchmarks/gpu.sh            # a headline
#   OUT=/tmp/out TESTS=0 TOKENS=4096 TRACE=kernels \
#     SYSTEMS="no_comm_bound fsdp2_eager fsdp_compile fsdp_compile:all_gather=copy_engine" bash benchmarks/gpu.sh
#   NPROC=4 OUT=/tmp/out TESTS=0 TOKENS=4096 SYSTEMS="no_comm_bound fsdp2_eager fsdp2_compile fsdp_compile
#     fsdp2_compile:hsdp=1 fsdp_compile:hsdp=1" bash benchmarks/gpu.sh          # HSDP 2 x 2 beside FSDP over 4
#   NPROC=4 OUT=/tmp/out TESTS=0 TOKENS=8192 TAG=8b SYSTEMS="fsdp2_compile fsdp_compile" \
#     BENCH_ARGS="--model 8.8b --checkpoint selective --seq-cap 8192" bash benchmarks/gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fsdp_compile_gpu}
TOKENS=${TOKENS:-1024 4096}
NPROC=${NPROC:-2}
REPEATS=${REPEATS:-1}
SYSTEMS=${SYSTEMS:-no_comm_bound fsdp2_eager fsdp2_compile fsdp_compile}
TRACE=${TRACE:-0}
case "$TRACE" in  # checked before the GPU tests, not after them
  0|1|kernels) ;;
  *) echo "TRACE=$TRACE: use TRACE=1 (host activity traced too) or TRACE=kernels (the GPU's activity only)"; exit 1 ;;
esac
status=0
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# An install, not PYTHONPATH: passes/ and lowering/ are top-level folders that only an install maps into the
# package (fsdp_compile.passes, fsdp_compile.lowering).
python3 -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 \
  || python3 -m pip install --no-deps -q -e . >>"$OUT/install.log" 2>&1 \
  || { echo "pip install -e . failed (see install.log)"; tail -n 20 "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c \
  "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } | tee "$OUT/env.log"

gpu_tests() {  # gpu_tests LOG EXTRA_K [FILES...]: the GPU tests (pytest -k "$PYTEST_K and EXTRA_K") of FILES
  local log=$1 k=${PYTEST_K:+($PYTEST_K) and }$2; shift 2
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -s -rs -m gpu -p no:cacheprovider -k "$k" "$@" >"$log" 2>&1
  local rc=$?; [ $rc = 0 ] || [ $rc = 5 ] || { echo "GPU tests exit $rc in $log (124: killed at TEST_TIMEOUT)"; return 1; }
}
if [ "${TESTS:-1}" = 1 ]; then
  if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
    # Four GPUs: the 2-GPU tests on two pairs side by side (split by file, about even), then the 4-GPU ones.
    # (the memory test, ~75 s, in pair b: pair a took ~475 s without it, session 19)
    memory=tests/test_gpu_overlap.py::test_copy_engine_exchange_takes_less_gpu_memory_than_nccl
    CUDA_VISIBLE_DEVICES=0,1 gpu_tests "$OUT/pytest_gpu_a.log" "not 4gpus and not less_gpu_memory" tests/test_parity.py \
      tests/test_gpu_overlap.py &
    a=$!
    CUDA_VISIBLE_DEVICES=2,3 gpu_tests "$OUT/pytest_gpu_b.log" "not 4gpus" tests/test_gpu_exit.py tests/test_lowering.py \
      tests/test_rank_consistency.py tests/test_recompiles.py "$memory" || status=1
    wait $a || status=1
    gpu_tests "$OUT/pytest_gpu_4.log" "4gpus" tests || status=1
    touch "$OUT/pytest_gpu_8.log"
    if [ "$(nvidia-smi -L | wc -l)" -ge 8 ]; then gpu_tests "$OUT/pytest_gpu_8.log" "8gpus" tests || status=1; fi
    cat "$OUT"/pytest_gpu_a.log "$OUT"/pytest_gpu_b.log "$OUT"/pytest_gpu_4.log "$OUT"/pytest_gpu_8.log >"$OUT/pytest_gpu.log"
  else
    gpu_tests "$OUT/pytest_gpu.log" "not 4gpus" tests || status=1
  fi
fi
if [ "${COMPILE_TIME:-0}" = 1 ]; then
  for name in ${COMPILE_MODELS:-0.95b 80x1024}; do
    case "$name" in
      0.95b) shape="--dim 2048 --layers 16" ;;
      80x1024) shape="--dim 1024 --layers 80" ;;
      *) echo "COMPILE_MODELS: $name is none of 0.95b 80x1024"; status=1; continue ;;
    esac
    timeout 540 python3 benchmarks/compile_time.py --device cuda --world 1 --head-dim 128 --vocab 32000 --seq 2048 \
      --dtype bfloat16 --systems default regions_off plain $shape ${COMPILE_ARGS:-} \
      --out "$OUT/compile_time_$name${COMPILE_TAG:-}.json" >"$OUT/compile_time_$name${COMPILE_TAG:-}.log" 2>&1 \
      || { echo "compile_time $name exit $?"; status=1; }
  done
fi
if [ "${CONTENTION:-0}" = 1 ]; then
  timeout 300 torchrun --nproc_per_node "$NPROC" benchmarks/gemm_contention.py >"$OUT/contention_$NPROC.log" 2>&1
  rc=$?; [ $rc = 0 ] || { echo "gemm_contention exit $rc"; status=1; }
fi
if [ "${HOST_COST:-0}" = 1 ]; then
  timeout 120 torchrun --nproc_per_node "$NPROC" benchmarks/ce_host_cost.py --json "$OUT/ce_host_cost_$NPROC.json" \
    >"$OUT/ce_host_cost_$NPROC.log" 2>&1
  rc=$?; [ $rc = 0 ] || { echo "ce_host_cost exit $rc"; status=1; }
fi
if [ "${NCCL_BUFFERS:-0}" = 1 ]; then
  timeout 120 torchrun --nproc_per_node "$NPROC" benchmarks/nccl_buffers.py --json "$OUT/nccl_buffers_$NPROC.json" \
    >"$OUT/nccl_buffers_$NPROC.log" 2>&1
  rc=$?; [ $rc = 0 ] || { echo "nccl_buffers exit $rc"; status=1; }
fi
if [ "${OFFLOAD_COSTS:-0}" = 1 ]; then
  timeout 400 python3 benchmarks/offload_costs.py --json "$OUT/offload_costs.json" >"$OUT/offload_costs.log" 2>&1 \
    || { echo "offload_costs exit $?"; status=1; }
fi
if [ "${META_INIT:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/meta_init_memory.py --model 70b --world-size 64 --device cuda \
    --out "$OUT/meta_init_70b.json" >"$OUT/meta_init_70b.log" 2>&1 || { echo "meta_init_memory exit $?"; status=1; }
  for route in meta build-then-shard; do
    timeout 300 torchrun --nproc_per_node 1 examples/big_model.py --model 8b --optimizer sgd --steps 3 --route "$route" \
      >"$OUT/big_model_8b_$route.log" 2>&1 || { echo "big_model $route exit $?"; status=1; }
  done
fi
tag=${TAG:-${NPROC}gpu_$(echo "$TOKENS" | tr ' ' '_')}
if [ "${BENCH:-1}" = 1 ]; then
  # TRACE=1 (or kernels): keep each system's profiler trace (host activity too, or the GPU's only) outside $OUT
  # (too large to bring back) and write their summary (benchmarks/trace_summary.py: GPU time by kernel class,
  # host ops) into $OUT.
  traces=/tmp/fsdp_compile_traces_$tag
  if [ "$TRACE" != 0 ]; then
    rm -rf "$traces"; BENCH_ARGS="${BENCH_ARGS:-} --trace-dir $traces"
    [ "$TRACE" = kernels ] && BENCH_ARGS="$BENCH_ARGS --trace-kernels-only"
  fi
  torchrun --nproc_per_node "$NPROC" ${TORCHRUN_ARGS:-} benchmarks/train_bench.py --tokens $TOKENS --repeats "$REPEATS" \
    --system $SYSTEMS ${BENCH_ARGS:-} --out "$OUT/bench_$tag.json" >"$OUT/bench_$tag.log" 2>&1
  rc=$?; [ $rc = 0 ] || { echo "train_bench exit $rc (1: a guard failed, see the log)"; status=1; }
  if [ "$TRACE" != 0 ]; then
    python3 benchmarks/trace_summary.py "$traces" >"$OUT/trace_summary_$tag.txt" 2>&1 || { echo "trace_summary failed"; status=1; }
  fi
fi

echo "== summary =="
[ -f "$OUT/pytest_gpu.log" ] && grep -E "^overlap o|passed|failed|skipped|SKIPPED|rror" "$OUT/pytest_gpu.log" | tail -n 8
for log in "$OUT"/compile_time_*.log; do [ -f "$log" ] && grep -E "^\||^first|rror" "$log"; done
[ -f "$OUT/contention_$NPROC.log" ] && grep -E "alone|^\| |rror" "$OUT/contention_$NPROC.log" | tail -n 60
[ -f "$OUT/ce_host_cost_$NPROC.log" ] && grep -E "^\| |rror" "$OUT/ce_host_cost_$NPROC.log"
[ -f "$OUT/nccl_buffers_$NPROC.log" ] && grep -E "^\| |ranks|rror" "$OUT/nccl_buffers_$NPROC.log"
[ -f "$OUT/bench_$tag.log" ] && { grep -E "^\||^## |guard|^[0-9]+ tokens/GPU|^auto|^step ms" "$OUT/bench_$tag.log" || tail -n 60 "$OUT/bench_$tag.log"; }
exit $status
