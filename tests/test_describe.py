"""describe(): units and the full parameter count of a sharded model; sync_buffers(): buffers (not sharded,
rank-local as with FSDP2) made equal across ranks, and full_state_dict returns the calling rank's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.dist import hsdp_mesh, run_ranks
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_describe_counts_the_whole_model(rank: int) -> None:
    torch.manual_seed(0)
    full = sum(p.numel() for p in Llama(LLAMA_TINY).parameters())  # a tied weight counts once
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=3)
    try:
        model = fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block])
        summary = fsdp_compile.describe(model)
    finally:
        dist.destroy_process_group()
    assert summary.num_parameters == full
    assert summary.num_local_parameters == sum(p.numel() for p in model.parameters()) < full
    assert summary.world_size == 3 and [u.fqn for u in summary.units] == ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert all(u.shard_numel * 3 == u.padded_numel >= u.num_parameters for u in summary.units)
    assert f"{full:,} parameters" in str(summary) and '"num_parameters"' in summary.to_json()


def test_describe_names_the_replicas_of_hsdp() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        summary = fsdp_compile.describe(fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block], mesh=hsdp_mesh((2, 2))))
    finally:
        dist.destroy_process_group()
    assert (summary.world_size, summary.replicas) == (2, 2)
    assert str(summary).startswith("5 units over 2 ranks x 2 replicas (HSDP): ")
    assert all(u.shard_numel * 2 == u.padded_numel for u in summary.units)


def _batchnorm(rank: int, world_size: int, average: bool, mesh: tuple[int, int] | None) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)), units=[nn.Linear], mesh=hsdp_mesh(mesh)
    )
    model(torch.randn(16, 4) + rank).sum().backward()  # each rank's own batch statistics
    mine = model[1].running_mean.clone()
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine)
    assert not torch.equal(everyone[0], everyone[1])
    # Buffers are rank-local: full_state_dict gives the caller's.
    torch.testing.assert_close(fsdp_compile.full_state_dict(model)["1.running_mean"], mine, rtol=0, atol=0)
    fsdp_compile.sync_buffers(model, average=average)
    want = torch.stack(everyone).mean(0) if average else everyone[0]
    torch.testing.assert_close(model[1].running_mean, want)
    assert model[1].num_batches_tracked.item() == 1


@pytest.mark.parametrize("average", [False, True], ids=["rank0", "average"])
@pytest.mark.parametrize("world_size, mesh", [(2, None), (4, (2, 2))], ids=["fsdp", "hsdp-2x2"])
def test_sync_buffers_makes_batchnorm_statistics_agree(average: bool, world_size: int, mesh: tuple | None) -> None:
    run_ranks(_batchnorm, world_size, average, mesh)
