"""shard(): sharded storage, names, ties, sizes (fake process group, one process per rank in turn)."""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile._plan_shard import plan_shard
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama

ALIGN = 16  # elements; each parameter starts aligned in its unit's flat buffer


def _fake_rank(rank: int, world_size: int) -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


@pytest.fixture
def sharded(request: pytest.FixtureRequest) -> Iterator[tuple[Llama, Llama, int, int]]:
    rank, world_size = request.param
    _fake_rank(rank, world_size)
    torch.manual_seed(0)
    original = Llama(LLAMA_TINY)
    model = Llama(LLAMA_TINY)
    model.load_state_dict(original.state_dict())
    fsdp_compile.shard(model, units=[Block])
    yield original, model, rank, world_size
    dist.destroy_process_group()


RANKS = [(r, w) for w in (2, 3) for r in range(w)]


def _expected_local_numel(original: Llama, rank: int, world_size: int) -> int:
    """Independent count: each unit's parameters packed at ALIGN-aligned offsets, padded to the world size;
    this rank holds elements [rank * shard, (rank + 1) * shard) of each unit."""
    units: dict[str, list[int]] = {}
    for name, p in original.named_parameters():
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else ""
        units.setdefault(unit, []).append(p.numel())
    total = 0
    for numels in units.values():
        offset, spans = 0, []
        for n in numels:
            offset = -(-offset // ALIGN) * ALIGN
            spans.append((offset, offset + n))
            offset += n
        shard = -(-offset // world_size)
        lo, hi = rank * shard, (rank + 1) * shard
        total += sum(max(0, min(e, hi) - max(s, lo)) for s, e in spans)
    return total


@pytest.mark.parametrize("sharded", RANKS, indirect=True, ids=[f"rank{r}of{w}" for r, w in RANKS])
def test_parameters_hold_exactly_this_ranks_shard(sharded: tuple[Llama, Llama, int, int]) -> None:
    original, model, rank, world_size = sharded
    local = sum(p.numel() for p in model.parameters())
    full = sum(p.numel() for p in original.parameters())
    assert local == _expected_local_numel(original, rank, world_size)
    assert abs(local - full / world_size) <= 0.02 * full / world_size
    assert all(p.dim() == 1 for p in model.parameters())


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_element_is_held_by_exactly_one_rank(world_size: int) -> None:
    """The pieces of all ranks' sharded models tile every original parameter: each element held once, with
    its value."""
    torch.manual_seed(0)
    original = Llama(LLAMA_TINY)
    held = {name: torch.zeros(p.numel(), dtype=torch.int64) for name, p in original.named_parameters()}
    for rank in range(world_size):
        _fake_rank(rank, world_size)
        try:
            model = Llama(LLAMA_TINY)
            model.load_state_dict(original.state_dict())
            fsdp_compile.shard(model, units=[Block])
            for state in fsdp_compile.sharded_units(model):
                for piece, slot, lo, hi in state.pieces:
                    start = rank * state.layout.shard_numel + lo - slot.offset
                    held[slot.names[0]][start : start + hi - lo] += 1
                    want = original.get_parameter(slot.names[0]).detach().reshape(-1)[start : start + hi - lo]
                    torch.testing.assert_close(piece.detach(), want, rtol=0, atol=0)
        finally:
            dist.destroy_process_group()
    assert {name: (int(c.min()), int(c.max())) for name, c in held.items()} == dict.fromkeys(held, (1, 1))


@pytest.mark.parametrize("sharded", [(1, 2)], indirect=True)
def test_names_ties_and_values_are_kept(sharded: tuple[Llama, Llama, int, int]) -> None:
    original, model, _, _ = sharded
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert list(model.state_dict()) == list(original.state_dict())
    assert model.output._parameters["weight"] is model.tok_embeddings._parameters["weight"]
    assert isinstance(model.layers[0], Block) and isinstance(model.output, nn.Linear)
    # Each piece is a view of its unit's flat shard holding the right values.
    for state in fsdp_compile.sharded_units(model):
        for piece, slot, lo, hi in state.pieces:
            assert piece.untyped_storage().data_ptr() == state.flat.untyped_storage().data_ptr()
            start = state.layout.shard_numel + lo - slot.offset  # rank 1
            want = original.get_parameter(slot.names[0]).detach().reshape(-1)[start : start + hi - lo]
            torch.testing.assert_close(piece.detach(), want, rtol=0, atol=0)


@pytest.mark.parametrize("sharded", [(0, 2)], indirect=True)
def test_units_and_layout(sharded: tuple[Llama, Llama, int, int]) -> None:
    _, model, _, world_size = sharded
    units = fsdp_compile.sharded_units(model)
    assert [u.layout.fqn for u in units] == ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    root = units[0].layout
    assert [s.names for s in root.slots] == [("tok_embeddings.weight", "output.weight"), ("norm.weight",)]
    for u in units:
        assert u.layout.padded_numel % world_size == 0
        assert all(s.offset % ALIGN == 0 for s in u.layout.slots)
        assert u.flat.requires_grad and u.flat.is_leaf and u.flat.numel() == u.layout.shard_numel


def test_backend_is_registered_by_name() -> None:
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "fsdp_compile" in list_backends(exclude_tags=())
    assert lookup_backend("fsdp_compile").__name__ == "fsdp_compile_backend"


def test_a_deleted_model_frees_its_shards() -> None:
    import gc
    import weakref

    _fake_rank(0, 2)
    try:
        model = fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block])
        shards = [weakref.ref(u.flat) for u in fsdp_compile.sharded_units(model)]
        compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
        tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 9))
        compiled(tokens[:, :-1], tokens[:, 1:]).backward()
        del model, compiled
        torch._dynamo.reset()
        gc.collect()
        assert not any(ref() is not None for ref in shards), "a unit's shard outlived its model"
    finally:
        dist.destroy_process_group()


def test_plan_shard_is_pure_frozen_and_what_shard_applies() -> None:
    """plan_shard reads the module and changes nothing; its plan (rank-independent) is what shard() builds."""
    import dataclasses
    import json


    torch.manual_seed(0)
    model = Llama(LLAMA_TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = plan_shard(model, units=[Block], world_size=3, mp=mp, reshard_after_forward=lambda fqn, m: fqn != "")
    assert type(model) is Llama and not hasattr(model, "_fsdp_compile_units")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.world_size = 2  # type: ignore[misc]
    units = json.loads(plan.to_json())["units"]
    assert [u["fqn"] for u in units] == ["", "layers.0", "layers.1", "layers.2", "layers.3"]
    assert units[0]["params"][0]["names"] == ["tok_embeddings.weight", "output.weight"]
    assert [u["reshard_after_forward"] for u in units] == [False] + [True] * 4
    assert {u["grad_reduction"] for u in units} == {"exchange"} and {u["param_dtype"] for u in units} == {"torch.bfloat16"}

    _fake_rank(1, 3)
    try:
        fsdp_compile.shard(model, units=[Block], mp=mp, reshard_after_forward=lambda fqn, m: fqn != "")
        assert [u.layout for u in fsdp_compile.sharded_units(model)] == [u.layout for u in plan.units]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sharded", [(0, 2)], indirect=True, ids=["rank0of2"])
def test_module_hooks_are_bound_methods_in_insertion_order(sharded: tuple[Llama, Llama, int, int]) -> None:
    """Dynamo traces a unit's hooks (and the root's, when a parent module is compiled). torch 2.11 guards a
    traced hook as ``hooks[list(dict.keys(hooks))[i]].__func__``: a callable object or a ``functools.partial``
    has no ``__func__``, and a hook moved by ``prepend=True`` is not where ``dict.keys`` puts it. Either fails
    every compilation there (seen on the GPUs: ``'_BeforeGather' object has no attribute '__func__'``)."""
    _, model, _, _ = sharded
    dicts = [d for module in model.modules() for d in (module._forward_pre_hooks, module._forward_hooks) if d]
    hooks = [hook for d in dicts for hook in d.values()]
    assert len(hooks) == 2 + 3 * len(fsdp_compile.sharded_units(model))
    for d in dicts:
        assert list(d) == list(dict.keys(d)), d
    for hook in hooks:
        assert isinstance(hook, types.FunctionType | types.MethodType), hook
    # The checks run before the unit's own pre-hook, which gathers.
    pre_hooks = [hook.__name__ for hook in model.layers[0]._forward_pre_hooks.values()]
    assert pre_hooks == ["hook", "pre_forward"]


def test_units_may_be_one_class_or_a_list_of_classes() -> None:
    """``units=Block`` (a class, not a list) means ``units=[Block]``, as FSDP2 users write it."""
    model = Llama(LLAMA_TINY)
    one, many = (plan_shard(model, units=units, world_size=2) for units in (Block, [Block]))
    assert one == many and [u.layout.fqn for u in one.units] == ["", "layers.0", "layers.1", "layers.2", "layers.3"]


@pytest.mark.parametrize("sharded", [(0, 2)], indirect=True, ids=["rank0-of-2"])
def test_weight_decay_by_dimension_reaches_the_matrices_through_their_full_shape(
    sharded: tuple[Llama, Llama, int, int],
) -> None:
    """The ``p.dim() >= 2`` habit (nanoGPT's weight-decay groups): every piece is 1-D, so it would decay nothing. Each
    piece's whole shape is reachable, ``decay_groups`` builds the groups the unsharded model gets, and the habit's
    groups are warned about at the first step."""
    original, model, _, _ = sharded
    assert [tuple(fsdp_compile.full_shape(p)) for p in model.parameters()] == [
        tuple(p.shape) for p in original.parameters()]
    assert all(p.dim() == 1 for p in model.parameters())
    groups = fsdp_compile.decay_groups(model, 0.1)
    want = fsdp_compile.decay_groups(original, 0.1)  # the unsharded model's own shapes
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(len(g["params"]), g["weight_decay"]) for g in want]
    assert len(groups[0]["params"]) == 1 + 7 * LLAMA_TINY.n_layers  # the (tied) embedding and each block's linears
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.optim.AdamW(groups).step()  # no warning
    by_dim = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    with pytest.warns(UserWarning, match=r"AdamW decays none of the 29 weight matrices .* p\.dim\(\) >= 2 .* "
                                         r"fsdp_compile\.full_shape\(p\) .* fsdp_compile\.decay_groups"):
        torch.optim.AdamW(by_dim).step()
