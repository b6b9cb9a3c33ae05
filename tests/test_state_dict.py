"""Full state dicts of model and optimizer: bitwise round trips, other world sizes, rank0_only/cpu_offload."""

from __future__ import annotations

import os

import pytest
import torch

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS
from fsdp_compile.testing.reference import assert_bitwise
from fsdp_compile.testing.train import train_step, trained


def _round_trip(rank: int, world_size: int) -> None:
    model, compiled, opt = trained(seed=0, steps=2)
    sd = fsdp_compile.full_state_dict(model)
    osd = fsdp_compile.full_optimizer_state_dict(model, opt)
    assert sd["output.weight"] is sd["tok_embeddings.weight"]  # tied, as nn.Module.state_dict gives them
    assert set(osd["state"]["layers.0.attention.wq.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    assert osd["state"]["layers.0.attention.wq.weight"]["exp_avg"].shape == (LLAMA_TESTS.dim, LLAMA_TESTS.dim)

    other, other_compiled, other_opt = trained(seed=1, steps=1)  # different weights and optimizer state
    fsdp_compile.load_full_state_dict(other, sd)
    fsdp_compile.load_full_optimizer_state_dict(other, other_opt, osd)
    assert_bitwise(fsdp_compile.full_state_dict(other), sd)
    assert_bitwise(fsdp_compile.full_optimizer_state_dict(other, other_opt), osd)
    # Training goes on identically from the loaded state.
    train_step(compiled, opt, 7)
    train_step(other_compiled, other_opt, 7)
    assert_bitwise(fsdp_compile.full_state_dict(other), fsdp_compile.full_state_dict(model))

    gathered_on_rank0 = fsdp_compile.full_state_dict(model, rank0_only=True, cpu_offload=True)
    assert (gathered_on_rank0 == {}) == (rank != 0)
    if rank == 0:
        assert all(t.device.type == "cpu" for t in gathered_on_rank0.values())
        assert not any(t.untyped_storage().data_ptr() == u.flat.untyped_storage().data_ptr()
                       for t in gathered_on_rank0.values() for u in fsdp_compile.sharded_units(model))


def test_round_trip_is_bitwise() -> None:
    run_ranks(_round_trip, 2)


def _save(rank: int, world_size: int, path: str) -> None:
    model, _, opt = trained(seed=0, steps=2, compiled=False)
    sd = fsdp_compile.full_state_dict(model, rank0_only=True, cpu_offload=True)
    osd = fsdp_compile.full_optimizer_state_dict(model, opt, rank0_only=True, cpu_offload=True)
    if rank == 0:
        torch.save({"model": sd, "optim": osd}, path)


def _load(rank: int, world_size: int, path: str) -> None:
    saved = torch.load(path, weights_only=True)
    model, _, opt = trained(seed=1, steps=1, compiled=False)
    fsdp_compile.load_full_state_dict(model, saved["model"])
    fsdp_compile.load_full_optimizer_state_dict(model, opt, saved["optim"])
    assert_bitwise(fsdp_compile.full_state_dict(model), saved["model"])
    assert_bitwise(fsdp_compile.full_optimizer_state_dict(model, opt), saved["optim"])


def test_load_into_another_world_size(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(tmp_path, "ckpt.pt")
    run_ranks(_save, 2, path)
    run_ranks(_load, 3, path)
    run_ranks(_load, 1, path)


def _bad_loads(rank: int, world_size: int) -> None:
    model, _, opt = trained(seed=0, steps=1, compiled=False)
    sd = fsdp_compile.full_state_dict(model)
    before = fsdp_compile.full_state_dict(model)
    with pytest.raises(KeyError, match="missing keys \\['norm.weight'\\]"):
        fsdp_compile.load_full_state_dict(model, {k: v for k, v in sd.items() if k != "norm.weight"})
    wrong = dict(sd, **{"layers.1.attention.wq.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="layers.1.attention.wq.weight.*shape \\(3, 3\\)"):
        fsdp_compile.load_full_state_dict(model, {k: v + 1 if k == "norm.weight" else w for k, v, w in
                                                  ((k, sd[k], wrong[k]) for k in sd)})
    assert_bitwise(fsdp_compile.full_state_dict(model), before)  # nothing half-loaded
    # An optimizer state that differs across ranks: refused on every rank before any state is gathered.
    if rank == 1:
        unit = next(u for u in fsdp_compile.sharded_units(model) if u.layout.fqn == "layers.0")
        for piece in unit.pieces:
            del opt.state[piece.param]["exp_avg_sq"]
    with pytest.raises(fsdp_compile.RanksDisagree) as error:
        fsdp_compile.full_optimizer_state_dict(model, opt)
    for part in ("collective #4", "state 'exp_avg_sq' (torch.float32) of unit 'layers.0'",
                 "state 'exp_avg' (torch.float32) of unit 'layers.1'", "step it on every rank"):
        assert part in str(error.value), (part, str(error.value))


def test_bad_state_dicts_and_rank_dependent_optimizer_states_are_refused() -> None:
    run_ranks(_bad_loads, 2)


def _rank0_of_a_subgroup(rank: int, world_size: int) -> None:
    """Sharded over ranks 1 and 2 only: ``rank0_only`` means rank 0 of that group, global rank 1."""
    import torch.distributed as dist

    from fsdp_compile.testing.llama import Block, Llama

    group = dist.new_group([1, 2])
    if rank == 0:  # not in the group: takes no part
        return
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block], group=group)
    model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    sd = fsdp_compile.full_state_dict(model, rank0_only=True)
    osd = fsdp_compile.full_optimizer_state_dict(model, opt, rank0_only=True)
    everywhere = fsdp_compile.full_state_dict(model)  # a collective of the group: both ranks call it
    if rank == 1:
        assert_bitwise(sd, everywhere)
        assert set(osd["state"]) == {name for name, _ in model.named_parameters()}
    else:
        assert sd == {} and osd == {}, (list(sd)[:3], list(osd)[:3])


def test_rank0_only_is_rank_0_of_the_modules_group() -> None:
    run_ranks(_rank0_of_a_subgroup, 3)
