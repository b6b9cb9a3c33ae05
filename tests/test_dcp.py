"""Sharded state dicts with torch.distributed.checkpoint (DCP), FSDP2's way: save model.state_dict() and
fsdp_compile.sharded_optimizer_state_dict() on 2 gloo ranks, load on 2, 3 (through DCP's get/set_model_state_dict)
and 1 (DCP reshards), bitwise; DCP's helpers that cannot work are refused naming the way;
training goes on bitwise-identically; a save killed midway leaves the previous checkpoint loadable; HSDP 2 x 2 on 4
ranks saves and loads the same checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import assert_bitwise
from fsdp_compile.testing.train import train_step, trained


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": fsdp_compile.full_state_dict(model), "optim": fsdp_compile.full_optimizer_state_dict(model, opt)}


def _sharded(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": fsdp_compile.sharded_optimizer_state_dict(model, opt)}


def _save(rank: int, world_size: int, checkpoint: str, reference: str, mesh: tuple[int, int] | None = None) -> None:
    model, compiled, opt = trained(seed=0, steps=2, mesh=mesh, compiled=mesh is None)  # HSDP's: the state only
    sharded = _sharded(model, opt)
    assert type(sharded["model"]["layers.0.attention.wq.weight"]).__name__ == "ShardedTensor"
    assert sharded["model"]["layers.0.attention.wq.weight"].shape == (LLAMA_TESTS.dim, LLAMA_TESTS.dim)
    dcp.save(sharded, checkpoint_id=checkpoint)
    saved = _full(model, opt)
    train_step(compiled, opt, 7)
    after = _full(model, opt)  # a collective: on every rank
    if rank == 0:
        torch.save({"saved": saved, "after": after if mesh is None else None}, reference)


def _load(rank: int, world_size: int, checkpoint: str, reference: str, mesh: tuple[int, int] | None = None) -> None:
    next_step = world_size == 2 and mesh is None  # the saver's ranks and data: its next step, compiled
    model, compiled, opt = trained(seed=1, steps=1, mesh=mesh, compiled=next_step)  # other weights and optimizer state
    sharded = _sharded(model, opt)
    dcp_helpers = world_size == 3  # the model's part through DCP's own helpers (FSDP2's habit): the same
    if dcp_helpers:
        sharded["model"] = get_model_state_dict(model)
    dcp.load(sharded, checkpoint_id=checkpoint)
    if dcp_helpers:
        set_model_state_dict(model, sharded["model"])
    else:
        model.load_state_dict(sharded["model"])
    fsdp_compile.load_sharded_optimizer_state_dict(model, opt, sharded["optim"])
    ref = torch.load(reference, weights_only=True)
    assert_bitwise(_full(model, opt), ref["saved"])
    if next_step and ref["after"] is not None:
        train_step(compiled, opt, 7)
        assert_bitwise(_full(model, opt), ref["after"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("dcp")
    run_ranks(_save, 2, str(folder / "ckpt"), str(folder / "reference.pt"))
    return str(folder / "ckpt"), str(folder / "reference.pt")


@pytest.mark.parametrize("world_size", [2, 3, 1])
def test_dcp_round_trip_into_any_world_size_is_bitwise(checkpoint: tuple[str, str], world_size: int) -> None:
    run_ranks(_load, world_size, *checkpoint)


def test_dcp_between_hsdp_and_fsdp_is_bitwise(checkpoint: tuple[str, str], tmp_path: Path) -> None:
    """HSDP 2 x 2 (4 ranks: sharded over pairs, replicated across them) loads a checkpoint saved by FSDP over 2
    ranks, and saves one that FSDP over 2 ranks loads; each replica writes the same shards (DCP keeps one)."""
    run_ranks(_load, 4, *checkpoint, (2, 2))
    hsdp = str(tmp_path / "ckpt"), str(tmp_path / "reference.pt")
    run_ranks(_save, 4, *hsdp, (2, 2))
    run_ranks(_load, 2, *hsdp)


def _load_unsharded_state_dict(rank: int, world_size: int) -> None:
    torch.manual_seed(3)
    plain = Llama(LLAMA_TESTS)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    model.load_state_dict(plain.state_dict())
    assert_bitwise(fsdp_compile.full_state_dict(model), plain.state_dict())
    with pytest.raises(ValueError, match=r"assign=True\) would replace the sharded pieces"):
        model.load_state_dict(plain.state_dict(), assign=True)
    wrong = {**plain.state_dict(), "norm.weight": torch.ones(3)}
    with pytest.raises(ValueError, match=r"state_dict\['norm.weight'\] has shape \(3,\), the parameter's is \(32,\)"):
        model.load_state_dict(wrong)


def test_load_state_dict_takes_an_unsharded_models_state_dict() -> None:
    run_ranks(_load_unsharded_state_dict, 2)


def _killed_while_saving(rank: int, world_size: int, good: str, bad: str, reference: str) -> None:
    _save(rank, world_size, good, reference)  # then one more step: the state saved below is newer
    model, _, opt = trained(seed=0, steps=3, compiled=False)
    write_data = dcp.FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        write_data(self, plan, planner).wait()  # this rank's data is on disk, the checkpoint's metadata is not
        os._exit(17)

    dcp.FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]
    dcp.save(_sharded(model, opt), checkpoint_id=bad)


def _load_broken(rank: int, world_size: int, bad: str) -> None:
    model, _, opt = trained(seed=1, steps=1, compiled=False)
    with pytest.raises(CheckpointException, match="metadata"):  # (a BaseException, as DCP raises it)
        dcp.load(_sharded(model, opt), checkpoint_id=bad)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    good, bad, reference = str(tmp_path / "good"), str(tmp_path / "bad"), str(tmp_path / "reference.pt")
    with pytest.raises(Exception, match="exit code 17"):
        spawn_ranks(_killed_while_saving, 2, good, bad, reference)
    assert os.listdir(bad), "the killed save wrote nothing: no test"
    run_ranks(_load, 2, good, reference)
    run_ranks(_load_broken, 2, bad)


def test_dcp_helpers_that_would_save_the_optimizers_pieces_as_replicated_name_the_way(fake_pg: None) -> None:
    """DCP's get_state_dict / set_state_dict and its optimizer helpers (FSDP2's habit) would give the optimizer's state
    as this rank's 1-D pieces, which DCP saves as replicated ('Size mismatch' at load): refused, naming the
    functions to use. Its model helpers work (the round trip above on 3 ranks)."""
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    opt = torch.optim.AdamW(model.parameters())
    for call in (lambda: get_state_dict(model, opt), lambda: get_optimizer_state_dict(model, opt),
                 lambda: set_state_dict(model, opt, model_state_dict={}, optim_state_dict={})):
        with pytest.raises(RuntimeError, match=r"torch.distributed.checkpoint.state_dict.(get|set)_\w+\(\) does not "
                                               r"know fsdp_compile's sharding.*fsdp_compile.sharded_optimizer_state_dict"):
            call()
    assert type(get_model_state_dict(model)["layers.0.attention.wq.weight"]).__name__ == "ShardedTensor"
