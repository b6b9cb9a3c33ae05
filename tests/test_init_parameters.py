"""Models bigger than one device: built on the meta device, sharded, ``to_empty``, ``init_parameters``; in-place
writes after ``shard()`` reach the shard or raise; ranks that start from different weights are caught."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile._agree import fingerprint
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, init_weights
from fsdp_compile.testing.reference import assert_bitwise, reference_step, rel_error
from fsdp_compile.testing.scripts import run_script_main
from fsdp_compile.testing.snapshot import assert_unchanged, module_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIED = dataclasses.replace(LLAMA_TESTS, tie_embeddings=True)
UNTIED = dataclasses.replace(LLAMA_TESTS, tie_embeddings=False)


def _on_meta(cfg=LLAMA_TESTS, dtype: torch.dtype = torch.float32) -> Llama:
    with torch.device("meta"):
        return Llama(cfg).to(dtype)


def _reference(cfg=LLAMA_TESTS, dtype: torch.dtype = torch.float32, seed: int = 0) -> Llama:
    """The unsharded model built on CPU, then given ``init_weights`` on each submodule in ``modules()`` order."""
    model = Llama(cfg).to(dtype)
    torch.manual_seed(seed)
    for module in model.modules():
        init_weights(module)
    return model


def _sharded_on_meta(cfg=LLAMA_TESTS, dtype: torch.dtype = torch.float32, seed: int = 0) -> Llama:
    model = fsdp_compile.shard(_on_meta(cfg, dtype), units=[Block])
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    fsdp_compile.init_parameters(model, init_weights)
    return model


def test_under_the_fake_process_group_the_ranks_weights_are_not_compared_and_the_log_says_so(
    fake_pg: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="fsdp_compile._agree"):
        fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    assert "the ranks' weights are not compared under the fake process group" in caplog.text


def test_a_model_sharded_on_meta_holds_its_shards_on_meta_until_to_empty(fake_pg: None) -> None:
    model = fsdp_compile.shard(_on_meta(), units=[Block])
    units = fsdp_compile.sharded_units(model)
    assert all(u.flat.is_meta for u in units) and all(p.is_meta for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"still on the meta device.*to_empty\(device=...\), then"):
        fsdp_compile.init_parameters(model, init_weights)
    with pytest.raises(RuntimeError, match=r"layers.0.attention.wq.weight is on the meta device: allocate"):
        model.layers[0].attention.wq.weight
    with pytest.raises(RuntimeError, match="call it on the model shard\\(\\) was called on"):
        model.layers[0].to_empty(device="cpu")
    stale = torch.optim.AdamW(model.parameters())
    model.to_empty(device="cpu")
    assert not any(u.flat.is_meta for u in units) and not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    # Each piece views its unit's new shard, of this rank's size (1/2 of the unit).
    for unit in units:
        assert unit.flat.numel() * 2 == unit.layout.padded_numel
        assert all(p.param.untyped_storage().data_ptr() == unit.flat.untyped_storage().data_ptr() for p in unit.pieces)
    assert {id(p) for p in model.parameters()} == {id(p.param) for u in units for p in u.pieces}
    with pytest.raises(RuntimeError, match=r"as it was before to_empty\(\) replaced it.*build the optimizer after to_empty"):
        stale.step()
    with pytest.raises(TypeError, match="converting it would move its flat shards"):
        model.to(torch.float64)  # the other conversions stay refused


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2), (2, 3)])
def test_init_parameters_keeps_this_ranks_part_of_the_unsharded_initialisation_bitwise(rank: int, world_size: int) -> None:
    """On any rank of any world size, every piece equals its part of the unsharded model initialised alike (tied
    weights included), and the buffers are recomputed."""
    want = _reference(TIED)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        model = _sharded_on_meta(TIED)
        for unit in fsdp_compile.sharded_units(model):
            for piece in unit.pieces:
                assert_bitwise(piece.param.detach(), unit.local_part(piece.slot, want.get_parameter(piece.slot.names[0])),
                               piece.slot.names[0])
        assert_bitwise(dict(model.named_buffers()), dict(want.named_buffers()))
    finally:
        dist.destroy_process_group()


def test_the_default_init_fn_is_reset_parameters_and_a_module_without_one_is_named(fake_pg: None) -> None:
    model = fsdp_compile.shard(_on_meta(), units=[Block])
    model.to_empty(device="cpu")
    with pytest.raises(TypeError, match=r"the model itself \(FSDPLlama\) has parameters or buffers of its own and no "
                                        r"reset_parameters\(\).*init_parameters\(model, init_fn=fn\)"):
        fsdp_compile.init_parameters(model)

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4)), nn.Embedding(5, 4))

    torch.manual_seed(3)
    want = build()
    torch.manual_seed(4)
    for module in want.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    with torch.device("meta"):
        model = build()
    fsdp_compile.shard(model, units=[nn.Sequential])
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    fsdp_compile.init_parameters(model)
    for unit in fsdp_compile.sharded_units(model):
        for piece in unit.pieces:
            assert_bitwise(piece.param.detach(), unit.local_part(piece.slot, want.get_parameter(piece.slot.names[0])))


def test_an_init_fn_that_writes_the_pieces_themselves_is_refused(fake_pg: None) -> None:
    model = fsdp_compile.shard(_on_meta(), units=[Block])
    model.to_empty(device="cpu")

    def through_the_container(module: nn.Module) -> None:
        if isinstance(module, Block):  # parameters() of a module other than the one given: 1-D pieces
            for p in module.parameters():
                nn.init.zeros_(p)

    with pytest.raises(RuntimeError, match=r"wrote this rank's sharded pieces of unit .*directly"):
        fsdp_compile.init_parameters(model, through_the_container)


def _copy_under_no_grad(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.copy_(torch.ones(weight.shape))


def _item_assignment(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight[0] = 1.0


HABITS = {
    "nn.init": lambda model: nn.init.normal_(model.layers[0].attention.wq.weight),
    "copy_ under no_grad": lambda model: _copy_under_no_grad(model.layers[0].attention.wq.weight),
    "init_weights of the model": lambda model: [init_weights(m) for m in model.modules()],
    ".data": lambda model: model.layers[0].attention.wq.weight.data.fill_(1.0),
    "item assignment": lambda model: _item_assignment(model.layers[0].attention.wq.weight),
    ".data assignment": lambda model: setattr(model.layers[0].attention.wq.weight, "data", torch.ones(32, 32)),
}


def _refused(model: nn.Module, habit: str) -> None:
    """``HABITS[habit]`` on the sharded ``model`` raises, outside ``summon_full_params`` and inside it without
    writeback, each naming the fix, and leaves every parameter as it was."""
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # Outside forward a full parameter is not even read (it would be an all-gather on this rank alone).
    with pytest.raises(RuntimeError, match=r"was read outside the sharded model's forward.*summon_full_params.*"
                                           r"fsdp_compile.init_parameters\(model, init_fn=...\)"):
        HABITS[habit](model)
    assert_bitwise({name: p.detach() for name, p in model.named_parameters()}, before)
    # Inside summon_full_params the reads work, and without writeback the same writes raise, naming writeback=True.
    with fsdp_compile.summon_full_params(model):
        assert model.layers[0].attention.wq.weight.shape == (LLAMA_TESTS.dim, LLAMA_TESTS.dim)
        with pytest.raises(RuntimeError, match=r"in-place write .* inside fsdp_compile.summon_full_params\("
                                               r"writeback=False\).*writeback=True"):
            HABITS[habit](model)
    assert_bitwise({name: p.detach() for name, p in model.named_parameters()}, before)


@pytest.mark.parametrize("habit", list(HABITS))
def test_an_in_place_write_after_shard_raises_naming_init_parameters(fake_pg: None, habit: str) -> None:
    """FSDP2's habits of writing parameters after sharding: the write would change a gathered copy and be lost."""
    torch.manual_seed(0)
    _refused(fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block]), habit)


def test_after_a_compiled_step_every_in_place_write_habit_is_refused_as_before(fake_pg: None) -> None:
    """The same habits after a compiled training step (one compile for all of them)."""
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 8))
    torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"))(tokens, tokens).backward()
    for habit in HABITS:
        _refused(model, habit)


def _train_like_the_reference(rank: int, world_size: int, cfg) -> None:
    dtype, tolerance = torch.float64, 1e-10
    want = _reference(cfg, dtype)
    model = _sharded_on_meta(cfg, dtype)
    assert_bitwise(fsdp_compile.full_state_dict(model), want.state_dict())
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(want.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, cfg.vocab_size, (2 * world_size, 9), generator=torch.Generator().manual_seed(step))
        local = tokens[2 * rank : 2 * rank + 2]
        loss = run(local[:, :-1], local[:, 1:])
        loss.backward()
        ref_loss = reference_step(want, tokens, dtype, world_size)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses = [torch.zeros((), dtype=dtype) for _ in range(world_size)]
        dist.all_gather(losses, loss.detach())
        assert rel_error(torch.stack(losses).mean(), ref_loss) < tolerance, step
    for name, value in fsdp_compile.full_state_dict(model).items():
        assert rel_error(value, want.state_dict()[name]) < tolerance, name


@pytest.mark.parametrize("world_size, cfg", [(1, TIED), (2, UNTIED), (3, TIED)],
                         ids=["world1-tied", "world2-untied", "world3-tied"])
def test_a_model_initialised_on_meta_equals_and_trains_as_the_unsharded_reference(world_size: int, cfg) -> None:
    """float64, aot_eager: bitwise at init, then three AdamW steps as the reference (1e-10). Inductor sees the same
    flat shards as on any sharded model: its parity is test_parity_inductor's."""
    run_ranks(_train_like_the_reference, world_size, cfg)


def _different_seeds(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    model = Llama(LLAMA_TESTS)
    before = module_snapshot(model)
    with pytest.raises(ValueError, match=r"rank 1 .* other values than rank 0 in unit '<root>'.*sync_module_states=True"):
        fsdp_compile.shard(model, units=[Block])
    assert_unchanged(before, module_snapshot(model))  # checked before touched
    fsdp_compile.shard(model, units=[Block], sync_module_states=True)
    torch.manual_seed(0)
    assert_bitwise(fsdp_compile.full_state_dict(model), Llama(LLAMA_TESTS).state_dict())  # rank 0's model


def test_ranks_that_start_from_different_weights_are_caught_or_synced_from_rank_0() -> None:
    run_ranks(_different_seeds, 2)


def test_a_fingerprint_reads_the_last_element_of_a_tensor_whose_positions_floats_cannot_hold() -> None:
    """Past 2**24 a float32 position rounds: the last one, 2**24 + 3, to 2**24 + 4, past the end (on a GPU, a
    device-side assert in shard())."""
    weight = torch.zeros(2**24 + 4)
    before = fingerprint([weight])
    weight[-1] = 1.0
    assert fingerprint([weight]) != before


LLAMA_7B_SCRIPT = """
import json, resource, sys
import torch, torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
import fsdp_compile
from fsdp_compile.testing.llama import Block, Llama, LlamaConfig

cfg = LlamaConfig(vocab_size=32000, dim=4096, n_layers=8, n_heads=32, ffn_dim=11008, max_seq_len=2048,
                  tie_embeddings=False)  # Llama 2 7B's shapes, 8 of its 32 layers
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=64)
with torch.device("meta"):
    model = Llama(cfg)
fsdp_compile.shard(model, units=[Block])
before = rss()
model.to_empty(device="cpu")
fsdp_compile.init_parameters(model, lambda m: [nn.init.constant_(p, 0.01) for p in m.parameters(recurse=False)])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
summary = fsdp_compile.describe(model)
print(json.dumps({"growth": peak - before, "params": summary.num_parameters, "local": summary.num_local_parameters,
                  "units": [(u.shard_numel, u.padded_numel) for u in summary.units],
                  "set": all(bool((p == 0.01).all()) for p in model.parameters())}))
"""


@pytest.mark.slow
def test_a_7b_shaped_model_built_on_meta_is_initialised_on_rank_0_of_64_in_under_2_gib() -> None:
    """Llama 2 7B's layers and embeddings, 8 of its 32 layers (1.9B parameters, 7.5 GB in fp32: nearly 4x the bound;
    all 32 layers took 4x the time to fill for the same claim) on a fake group of 64 ranks: the process grows by
    this rank's shards (1/64: 0.1 GB) and one submodule's full parameters at a time (the largest: the 0.5 GB
    embedding), not by the model."""
    proc = subprocess.run([sys.executable, "-c", LLAMA_7B_SCRIPT], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"peak RSS growth {result['growth'] / 2**30:.2f} GiB for {result['params'] / 1e9:.2f}B parameters "
          f"({result['local'] / 1e6:.0f}M on this rank)")
    assert result["params"] > 1.8e9 and result["set"]
    assert all(shard * 64 == padded for shard, padded in result["units"])
    assert result["growth"] < 2 * 2**30


@pytest.mark.slow
def test_the_big_model_example_initialises_saves_and_loads_the_same_model(tmp_path: "pathlib.Path") -> None:
    """The first run as docs/big-models.md runs it (it spawns its ranks); the second, which loads what the first
    saved, calls the example's ``main`` on the suite's ranks (no new processes to import torch)."""
    checkpoint = str(tmp_path / "ckpt")
    run = [sys.executable, "examples/big_model.py", "--checkpoint", checkpoint, "--steps", "2", "--compiler", "aot_eager"]
    first = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    out = str(tmp_path / "second")
    run_ranks(run_script_main, 2, os.path.join(ROOT, "examples", "big_model.py"), out, "tiny", checkpoint, 2,
              "aot_eager", "meta", "adamw")
    second = [pathlib.Path(f"{out}.{rank}").read_text() for rank in (0, 1)]
    assert "rank 0: initialised by init_parameters; set-up peak" in first.stdout
    assert f"rank 1: loaded from {checkpoint}; set-up peak" in second[1]
    losses = [[line for line in text.splitlines() if line.startswith("step ")] for text in (first.stdout, second[0])]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses
