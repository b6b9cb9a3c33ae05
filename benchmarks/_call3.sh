export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -q -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
S=$(date +%s)
timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_parity.py -k copy_engine >$OUT/pytest_ce.log 2>&1; echo "CE parity exit $? at $(( $(date +%s)-S )) s"
timeout 90 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_parity.py -k "fp32reduce-cudagraphs" >$OUT/pytest_cg.log 2>&1; echo "cudagraphs parity exit $? at $(( $(date +%s)-S )) s"
timeout $(( 560 - ($(date +%s)-S) )) torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens 4096 1024 --systems no_comm_bound fsdp2_eager fsdp_compile fsdp_compile_copy_engine fsdp_compile_copy_engine_cudagraphs --out $OUT/bench.json >$OUT/bench.log 2>&1; echo "bench exit $? at $(( $(date +%s)-S )) s"
grep -E "passed|failed|rror" $OUT/pytest_ce.log $OUT/pytest_cg.log | cut -c1-300 | tail -12
grep -E "^# |^\||^## |^loss guard|rror" $OUT/bench.log | cut -c1-330 | tail -45
