"""Layer 2: what Inductor generates (fake process group, one process): the collectives survive as
one all-gather per unit in the forward code and one all-gather + one reduce-scatter per unit in backward."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama

N_UNITS = LLAMA_TINY.n_layers + 1


@pytest.fixture(scope="module")
def code() -> list[str]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = fsdp_compile.shard(
            Llama(LLAMA_TINY),
            units=[Block],
            mp=fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        compiled = torch.compile(model, backend="fsdp_compile", fullgraph=True)
        tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 8))
        _, code = run_and_get_code(lambda: compiled(tokens, tokens).backward())
    finally:
        dist.destroy_process_group()
    return code


@pytest.mark.slow
def test_forward_and_backward_code(code: list[str]) -> None:
    forward, backward = code
    FileCheck().check_count("torch.ops._c10d_functional.all_gather_into_tensor.default(", N_UNITS, exactly=True).run(
        forward
    )
    FileCheck().check_not("reduce_scatter_tensor").run(forward)
    FileCheck().check_count("torch.ops._c10d_functional.all_gather_into_tensor.default(", N_UNITS, exactly=True).run(
        backward
    )
    FileCheck().check_count(
        "torch.ops._c10d_functional.reduce_scatter_tensor.default(", N_UNITS, exactly=True
    ).run(backward)
    # Each all-gather is waited on before its parameters are read.
    FileCheck().check("all_gather_into_tensor").check("wait_tensor").check("extern_kernels.mm").run(forward)
