#!/usr/bin/env bash
# Every GPU test and benchmark (2 GPUs). Logs and JSON under $OUT; a short table last. Everything at once
# takes longer than one 10-minute device call (the GPU tests several minutes, each system ~45 s a sweep point):
# split it, e.g. BENCH=0 (tests) then TESTS=0 with a SYSTEMS subset. Measured split (2x H100):
#   OUT=/tmp/out BENCH=0 bash benchmarks/gpu.sh                 # the GPU tests (TEST_TIMEOUT, default 540 s)
#   OUT=/tmp/out TESTS=0 SYSTEMS="no_comm_bound fsdp2_eager fsdp_compile fsdp_compile_copy_engine fsdp_compile_copy_engine_cudagraphs" bash benchmarks/gpu.sh
#   OUT=/tmp/out bash benchmarks/gpu.sh                         # GPU tests + every system at 1024 and 4096 tokens/GPU
#   OUT=/tmp/out TESTS=0 TOKENS="2048 8192" bash benchmarks/gpu.sh   # more sweep points only
#   SYSTEMS="no_comm_bound fsdp2_eager fsdp_compile" bash benchmarks/gpu.sh    # a subset of the systems
#   OUT=/tmp/out BENCH=0 CONTENTION=1 bash benchmarks/gpu.sh      # GPU tests + gemm_contention.py, no benchmark
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fsdp_compile_gpu}
TOKENS=${TOKENS:-1024 4096}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# An install, not PYTHONPATH: passes/ and lowering/ are top-level folders that only an install maps into the
# package (fsdp_compile.passes, fsdp_compile.lowering).
python3 -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 \
  || python3 -m pip install --no-deps -q -e . >>"$OUT/install.log" 2>&1 \
  || { echo "pip install -e . failed (see install.log)"; tail -n 20 "$OUT/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; python3 -c \
  "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } | tee "$OUT/env.log"

if [ "${TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -s -m gpu -p no:cacheprovider tests >"$OUT/pytest_gpu.log" 2>&1 \
    || echo "GPU tests exit $? (124: killed at TEST_TIMEOUT)"
fi
if [ "${CONTENTION:-0}" = 1 ]; then
  timeout 120 torchrun --nproc_per_node 2 benchmarks/gemm_contention.py >"$OUT/contention.log" 2>&1
fi
tag=$(echo "$TOKENS" | tr ' ' '_')
if [ "${BENCH:-1}" = 1 ]; then
  torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens $TOKENS ${SYSTEMS:+--systems $SYSTEMS} --out "$OUT/bench_$tag.json" \
    >"$OUT/bench_$tag.log" 2>&1; echo "train_bench exit $?"
fi

echo "== summary =="
[ -f "$OUT/pytest_gpu.log" ] && grep -E "^overlap o|passed|failed|skipped|rror" "$OUT/pytest_gpu.log" | tail -n 8
[ -f "$OUT/contention.log" ] && grep -E "alone|^\| |rror" "$OUT/contention.log" | tail -n 40
[ -f "$OUT/bench_$tag.log" ] && { grep -E "^\||^## |^loss guard|^[0-9]+ tokens/GPU" "$OUT/bench_$tag.log" || tail -n 60 "$OUT/bench_$tag.log"; }
