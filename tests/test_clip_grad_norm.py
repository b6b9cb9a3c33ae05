"""fsdp_compile.clip_grad_norm_: the total norm and the clipped gradients of the unsharded model (gloo ranks,
float64), where torch.nn.utils.clip_grad_norm_(model.parameters()) would see only this rank's shard."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fsdp_compile
from fsdp_compile.testing.dist import hsdp_mesh, run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import full_grads, reference_step, rel_error


def _clip_and_compare(
    rank: int, world_size: int, norm_type: float, compiled: bool, mesh: tuple[int, int] | None = None
) -> None:
    torch.manual_seed(0)
    ref = Llama(LLAMA_TESTS).double()
    model = fsdp_compile.shard(copy.deepcopy(ref), units=[Block], mesh=hsdp_mesh(mesh))
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True) if compiled else model
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2 * world_size, 9), generator=torch.Generator().manual_seed(1))
    local = tokens[2 * rank : 2 * rank + 2]
    run(local[:, :-1], local[:, 1:]).backward()
    reference_step(ref, tokens, torch.float64, world_size)

    norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type)
    max_norm = norm.item() / 3  # clipping must change the gradients
    local_only = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.numel()], norm_type)
    if world_size > 1 and norm_type != math.inf:  # (the max norm is right on the rank that holds the max)
        assert rel_error(local_only, norm) > 1e-3, "this rank's shard alone gave the model's norm: no test"
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    got = fsdp_compile.clip_grad_norm_(model, max_norm, norm_type)
    assert rel_error(got, want) <= 1e-12, (got.item(), want.item())
    assert want.item() > max_norm
    grads = full_grads(model)
    errors = {name: rel_error(grads[name], p.grad) for name, p in ref.named_parameters()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 1e-10, (worst, errors[worst])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0], ids=["l2", "inf", "l1"])
def test_clip_grad_norm_matches_the_unsharded_model(world_size: int, norm_type: float) -> None:
    run_ranks(_clip_and_compare, world_size, norm_type, False)


def test_clip_grad_norm_after_a_compiled_step() -> None:
    run_ranks(_clip_and_compare, 2, 2.0, True)


def test_clip_grad_norm_with_hsdp() -> None:
    """HSDP 2 x 2: the norm is summed within a replica (the replicas hold the same averaged gradients)."""
    run_ranks(_clip_and_compare, 4, 2.0, True, (2, 2))


def test_clip_grad_norm_refuses_a_norm_it_cannot_sum(fake_pg: None) -> None:
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    with pytest.raises(ValueError, match="norm_type must be a positive number or inf, got -1.0"):
        fsdp_compile.clip_grad_norm_(model, 1.0, norm_type=-1)
