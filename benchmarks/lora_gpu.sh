#!/usr/bin/env bash
# examples/lora.py on one GPU: the 8.8B shape (bf16 base, float32 LoRA adapters) sharded, beside the same LoRA
# model without shard() under torch.compile (LORA_ARGS: the example's options, default --compare; "--offload" for
# the sharded model beside it offloaded to the host). Logs and JSON under $OUT. peft (and accelerate, which it imports)
# come from wheels in build/wheels when the machine has none: the GPU machine has no network.
set -euo pipefail
OUT=${OUT:-/tmp/lora_gpu}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e .
python3 -c "import peft" 2>/dev/null || python3 -m pip install -q --no-deps --no-index build/wheels/*.whl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/card.txt"
torchrun --nproc_per_node 1 examples/lora.py --model 8.8b ${LORA_ARGS:---compare} --seq "${SEQ:-2048}" \
    --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" --json "$OUT/lora_8b.json" 2>&1 | tee "$OUT/lora_8b.log" | grep -v Warning
