#!/usr/bin/env bash
# Every GPU test and benchmark in one call (2 GPUs). Logs and JSON under $OUT; a short table last.
#   OUT=/tmp/out bash benchmarks/gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fsdp_compile_gpu}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
python3 -m pip install --no-deps --no-build-isolation -q -e . >"$OUT/install.log" 2>&1 \
  || { echo "pip install -e . failed (see install.log); using PYTHONPATH"; export PYTHONPATH=$PWD; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c \
  "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"; } | tee "$OUT/env.log"

python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 15
torchrun --nproc_per_node 2 benchmarks/compare_fsdp2.py --json "$OUT/compare_0.95b.json" "$@" \
  >"$OUT/compare_0.95b.log" 2>&1; echo "compare_fsdp2 exit $?"

echo "== summary =="
grep -E "passed|failed|skipped" "$OUT/pytest_gpu.log" | tail -n 1
grep -E "^\||^#|^loss curves" "$OUT/compare_0.95b.log" || tail -n 40 "$OUT/compare_0.95b.log"
