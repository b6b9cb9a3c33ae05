"""On 2 GPUs: with schedule_overlap, all-gather and reduce-scatter kernels run concurrently with compute
kernels (profiler trace), where without the pass they do not. (How much time that saves is the
benchmark's business: tests assert behaviour, not timings.)"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import fsdp_compile
from fsdp_compile.testing.dist import spawn_ranks
from fsdp_compile.testing.llama import Block, Llama, LlamaConfig
from fsdp_compile.testing.profile import communication_overlap, trace_steps

STEPS = 3
MEDIUM = LlamaConfig(vocab_size=8192, dim=1024, n_layers=8, n_heads=8, ffn_dim=2816, max_seq_len=2048)


def _profile(rank: int, world_size: int, out: str) -> None:
    results = {}
    for overlap in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Llama(MEDIUM)
        mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fsdp_compile.shard(model, units=[Block], mp=mp)
        compiled = torch.compile(model, backend=fsdp_compile.backend(overlap=overlap), fullgraph=True)
        tokens = torch.randint(0, MEDIUM.vocab_size, (2, 1025), device="cuda")
        for _ in range(3):
            compiled(tokens[:, :-1], tokens[:, 1:]).backward()
        with tempfile.NamedTemporaryFile(suffix=".json") as trace:
            trace_steps(lambda i: compiled(tokens[:, :-1], tokens[:, 1:]).backward(), STEPS, trace.name)
            results[overlap] = communication_overlap(trace.name, steps=STEPS)
    if rank == 0:
        with open(out, "w") as f:
            f.write(repr(results))
        print(f"overlap on: {results[True]}\noverlap off: {results[False]}")
    print(f"rank {rank}: overlap on {results[True]}, off {results[False]}")
    on, off = results[True], results[False]
    assert on["comm"] > 0 and off["comm"] > 0
    # NCCL kernels run while compute kernels run; without the pass, every one runs alone. (A NCCL kernel's
    # duration includes waiting for the other rank, so "comm" differs between ranks.)
    assert on["overlapped"] > 0, on
    assert on["overlapped"] > off["overlapped"], (on, off)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_collectives_run_concurrently_with_compute(tmp_path: "os.PathLike[str]") -> None:
    out = os.path.join(tmp_path, "overlap.txt")
    spawn_ranks(_profile, 2, out, backend="nccl")
    print(open(out).read())
