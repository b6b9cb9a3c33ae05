"""plan_memory: property-based checks of the slot planner on synthetic live ranges (pure), then the plans of
real compiled steps (graph structure on CPU, fake process group)."""

from __future__ import annotations

import dataclasses
import json
import logging
import random

import pytest
import torch
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fsdp_compile
from fsdp_compile.passes._graph import ALL_GATHER, EXCHANGE, nbytes, wait_of
from fsdp_compile.passes._write_slots import slot_hazards
from fsdp_compile.passes.plan_memory import (
    SLOT_ALIGNMENT,
    Buffer,
    MemoryPlan,
    PlanMemory,
    Slot,
    forward_buffers,
    hazards,
    plan_memory,
    slot_uses,
    step_buffers,
)
from fsdp_compile.passes.write_gradients_in_place import MM_INTO
from fsdp_compile.runtime.slots import EXCHANGE_INTO_SLOT, INTO_SLOT, SLOT, WAIT_EXCHANGE
from fsdp_compile.testing.graphs import memory_plans, slotted_exchanges
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama

LLAMA_TINY_UNITS = range(LLAMA_TESTS.n_layers + 1)  # the blocks and the root


@st.composite
def buffer_sets(draw: st.DrawFn) -> list[Buffer]:
    buffers = []
    for i in range(draw(st.integers(0, 24))):
        start = draw(st.integers(0, 60))
        buffers.append(
            Buffer(
                name=f"c{i}",
                group=draw(st.sampled_from(["0", "1"])),
                dtype=draw(st.sampled_from(["torch.float32", "torch.bfloat16"])),
                kind=draw(st.sampled_from(["gathered", "gradient"])),
                nbytes=draw(st.sampled_from([0, 256, 512, 1024, 4096])) + draw(st.integers(0, 3)) * 16,
                start=start,
                end=start + draw(st.integers(0, 30)),
                escapes=draw(st.integers(0, 5)) == 0,
                in_slab=draw(st.integers(0, 2)) > 0,
            )
        )
    return buffers


@given(buffers=buffer_sets(), seed=st.integers(0, 2**16))
def test_the_plan_is_safe_bounded_and_deterministic(buffers: list[Buffer], seed: int) -> None:
    plan = plan_memory(buffers)
    assert hazards(plan) == []
    by_name = {b.name: b for b in buffers}
    for name, index in plan.assignment:
        slot = plan.slots[index]
        assert by_name[name].nbytes <= slot.nbytes
        assert by_name[name].klass == (slot.group, slot.dtype, slot.kind)
    for slot in plan.slots:  # max-pool sizing: a slot is as large as its largest occupant
        assert slot.nbytes == max(by_name[name].nbytes for name in slot.occupants)
        assert slot.offset % SLOT_ALIGNMENT == 0
    assert set(plan.unslotted) == {b.name for b in buffers if b.escapes}  # read after their graph: no slot
    slabs = dict(plan.slabs)
    for slot in plan.slots:  # a group's slab holds the slots applied (an occupant in the slab); the others lie past it
        if any(by_name[name].in_slab for name in slot.occupants):
            assert slot.offset + slot.nbytes <= slabs[slot.group]
        else:
            assert slot.offset >= slabs.get(slot.group, 0)
    assert plan.lower_bound_bytes <= plan.pool_bytes <= plan.per_collective_bytes
    assert plan.pool_bytes <= plan.maxpool_bytes
    shuffled = list(buffers)
    random.Random(seed).shuffle(shuffled)
    assert plan_memory(shuffled) == plan
    assert json.loads(plan.to_json())["pool_bytes"] == plan.pool_bytes


@given(lengths=st.lists(st.integers(1, 8), min_size=1, max_size=20), starts=st.lists(st.integers(0, 40), min_size=20))
def test_buffers_of_one_size_take_as_many_slots_as_are_live_at_once(lengths: list[int], starts: list[int]) -> None:
    buffers = [
        Buffer(f"c{i}", "0", "torch.float32", "gathered", 1024, start, start + n)
        for i, (n, start) in enumerate(zip(lengths, starts))
    ]
    plan = plan_memory(buffers)
    assert plan.pool_bytes == plan.lower_bound_bytes  # optimal: the greatest number live at once


def test_a_slot_is_never_shared_by_buffers_that_meet_even_at_one_position() -> None:
    a = Buffer("a", "0", "torch.float32", "gathered", 100, 0, 5)
    b = Buffer("b", "0", "torch.float32", "gathered", 100, 5, 9)  # issued where a is last read
    c = Buffer("c", "0", "torch.float32", "gathered", 60, 6, 9)
    plan = plan_memory([a, b, c])
    assert plan.slots == (
        Slot("0", "torch.float32", "gathered", 100, 0, ("a", "c")),
        Slot("0", "torch.float32", "gathered", 100, SLOT_ALIGNMENT, ("b",)),
    )
    assert plan.slabs == (("0", 2 * SLOT_ALIGNMENT),)
    figures = (plan.pool_bytes, plan.per_collective_bytes, plan.maxpool_bytes, plan.lower_bound_bytes)
    assert figures == (200, 260, 200, 200)


def test_the_verifier_names_each_hazard() -> None:
    a = Buffer("a", "0", "torch.float32", "gathered", 100, 0, 5)
    b = Buffer("b", "0", "torch.float32", "gathered", 200, 3, 9)
    c = Buffer("c", "0", "torch.float32", "gathered", 100, 0, 9, escapes=True)
    slots = (
        Slot("0", "torch.float32", "gathered", 100, 0, ("a", "b")),
        Slot("0", "torch.float32", "gathered", 100, 64, ("c",)),
    )
    bad = MemoryPlan(
        graphs=("forward",), buffers=(a, b, c), slots=slots, assignment=(("a", 0), ("b", 0), ("c", 1)), unslotted=(),
        slabs=(("0", 256),), pool_bytes=100, per_collective_bytes=400, maxpool_bytes=200, lower_bound_bytes=400,
    )
    assert hazards(bad) == [
        "unslotted [] are not the escaping buffers ['c']",
        "c: in a slot but not a slotted buffer",
        "b: 200 bytes in slot 0 of 100",
        "a [0, 5] and b [3, 9] meet in slot 0",
        "slots 0 and 1 overlap in group 0's slab",
    ]
    with pytest.raises(ValueError, match="unique"):
        plan_memory([a, a])


def test_empty() -> None:
    plan = plan_memory([])
    assert (plan.slots, plan.pool_bytes, plan.lower_bound_bytes) == ((), 0, 0)
    assert hazards(plan) == []


# Real compiled steps (fake process group of 2 ranks): the plan the backend logs.


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + self.out(torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Hybrid(nn.Module):
    """Units of different sizes: attention-only (1,024 elements), MLP (2,096) and wide MLP (8,336) blocks; the
    root holds a big embedding and the output head (16,384)."""

    def __init__(self, vocab: int = 512, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            block for _ in range(2) for block in (_Attention(dim), _Mlp(dim, 64), _Mlp(dim, 256))
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _figures(plan: dict) -> str:
    names = ("lower_bound_bytes", "pool_bytes", "maxpool_bytes", "per_collective_bytes")
    return ", ".join(f"{name} {plan[name]}" for name in names)


def _step(
    model: nn.Module, units: list[type[nn.Module]], compiler: str, memory_plan: bool = True, exchange: bool = False
) -> tuple[list[dict], dict[str, fx.Graph]]:
    """One compiled training step (never from Inductor's caches): its memory plans, its graphs. ``exchange``:
    bf16 parameters, fp32 gradient sums (the gradients are exchanged: all-to-alls)."""
    torch._dynamo.reset()  # each step a new model: compiled afresh, not a recompile against Dynamo's limit
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if exchange else None
    fsdp_compile.shard(model, units=units, mp=mp)
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler, memory_plan=memory_plan))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with fsdp_compile.debug.capture_graphs() as graphs, memory_plans() as plans:
        compiled(tokens, tokens).backward()
    return plans, {g.stage: g.gm.graph for g in graphs}


def _model(name: str) -> tuple[nn.Module, list[type[nn.Module]]]:
    torch.manual_seed(0)
    return (Llama(LLAMA_TESTS), [Block]) if name == "llama" else (Hybrid(), [_Attention, _Mlp])


def _check_logged_plan(model: str, n_units: int, plans: list[dict], graphs: dict[str, fx.Graph]) -> None:
    """The plans a compiled step logged (forward's, then the step's) are the planner's for its graphs, safe and
    within their bounds; each of the ``n_units`` gathered in forward and again in backward (resharded after
    forward), and reduced once."""
    forward, step = plans
    print(f"{model}: {_figures(step)}")
    assert forward["graphs"] == ["forward"] and step["graphs"] == ["forward", "backward"]
    plan = plan_memory(step_buffers(forward_buffers(graphs["forward"]), graphs["backward"]))
    assert json.loads(plan.to_json()) == step
    assert hazards(plan) == []
    kinds = [b.kind for b in plan.buffers]
    assert (kinds.count("gathered"), kinds.count("gradient")) == (2 * n_units, n_units)
    assert plan.lower_bound_bytes <= plan.pool_bytes < plan.per_collective_bytes
    if model == "hybrid":
        assert plan.pool_bytes < plan.maxpool_bytes
    else:  # uniform blocks, and a root that is smaller
        assert plan.pool_bytes <= plan.maxpool_bytes


@pytest.mark.parametrize("model, exchange", [("llama", False), ("hybrid", False), ("llama", True)],
                         ids=["llama", "hybrid", "llama-exchange"])
def test_applied_every_collective_writes_into_its_slot(fake_pg: None, model: str, exchange: bool) -> None:
    """The plan logged for the graphs as planned (``memory_plan=False``) is the planner's and safe
    (``_check_logged_plan``); applied (the default): the same plans are logged, each graph holds one slot node per
    slot it uses, every all-gather and gradient exchange writes into a view of its own slot (an exchange is waited
    for by ``wait_exchange``, which keeps its gradient alive), and no slot is written before the last read of its
    previous occupant."""
    net, units = _model(model)
    n_units = 1 + len(net.layers)  # the root is a unit too
    with slotted_exchanges():  # as grad_reduce="copy_engine" has them
        unapplied, planned = _step(net, units, "aot_eager", memory_plan=False, exchange=exchange)
        plans, graphs = _step(*_model(model), "aot_eager", exchange=exchange)
    if not exchange:  # (exchanges' buffers in the plan: test_an_exchange_is_live_from_its_issue_not_from_its_gradient)
        _check_logged_plan(model, n_units, unapplied, planned)
    assert plans == unapplied
    dtype = torch.bfloat16 if exchange else torch.float32
    for stage, plan in zip(("forward", "backward"), plans):
        graph = graphs[stage]
        slots = {f"{stage}/{n.name}": n for n in graph.find_nodes(op="call_function", target=SLOT)}
        fields = {k: v for k, v in plan.items() if k != "predicted_peak_bytes"}
        uses = slot_uses(MemoryPlan(**{**fields, "slots": tuple(Slot(**s) for s in plan["slots"]),
                                       "buffers": tuple(Buffer(**b) for b in plan["buffers"])}), stage)
        assert len(slots) == len(uses) > 0
        assert not graph.find_nodes(op="call_function", target=ALL_GATHER)
        writes = [*graph.find_nodes(op="call_function", target=INTO_SLOT),
                  *graph.find_nodes(op="call_function", target=EXCHANGE_INTO_SLOT)]
        assert sorted(w.name for w in writes) == sorted(name for use in uses for name in use.collectives)
        for use in uses:
            (slot_node,) = {w.kwargs["out"].args[0] for w in writes if w.name in use.collectives}
            assert slot_node.args[2:4] == (use.offset, use.nbytes // dtype.itemsize)
        exchanges = graph.find_nodes(op="call_function", target=EXCHANGE_INTO_SLOT)
        assert len(exchanges) == (len(LLAMA_TINY_UNITS) if exchange and stage == "backward" else 0)
        assert not graph.find_nodes(op="call_function", target=EXCHANGE)  # every exchange in a slot
        waits = graph.find_nodes(op="call_function", target=WAIT_EXCHANGE)
        assert [(w.args[0], w.args[1]) for w in waits] == [(e.kwargs["out"], e.args[0]) for e in exchanges]
        assert slot_hazards(graph) == []


def test_an_exchange_is_live_from_its_issue_not_from_its_gradient(fake_pg: None) -> None:
    """An exchange's buffer is the peers' parts of its output (they take the slot; this rank's own part is
    read from the gradient): live from the exchange's issue (no peer writes into it before this rank reaches
    the exchange) to its wait or the output's last read, not from the node that produced the gradient (which
    stays where Inductor put it): a longer range kept one more slot."""
    _, graphs = _step(*_model("llama"), "aot_eager", memory_plan=False, exchange=True)
    forward = forward_buffers(graphs["forward"])
    position = {n: forward.length + i for i, n in enumerate(graphs["backward"].nodes)}
    exchanges = {f"backward/{n.name}": n for n in graphs["backward"].find_nodes(op="call_function", target=EXCHANGE)}
    buffers = [b for b in step_buffers(forward, graphs["backward"]) if b.name in exchanges]
    assert len(buffers) == len(exchanges) == len(LLAMA_TINY_UNITS)
    for b in buffers:
        node = exchanges[b.name]
        assert b.start == position[node] > position[node.args[0]], (b, node.args[0])
        assert b.end >= position[wait_of(node)], b
        assert b.nbytes == nbytes(node) // 2, b  # 2 ranks: one peer's part


def test_with_exchanges_in_slots_the_ranks_key_inductors_caches_apart() -> None:
    """Applied exchanges make each rank's graph its own (where its own part lies is a constant of the graph):
    a cache directory, which the ranks of a host share, must not hand one rank's graph to another."""
    uuids = []
    for rank in (0, 1):
        ranks = {"0": rank}  # the backend gives each pass this process's rank in the graph's groups
        uuids.append([PlanMemory(exchanges=True, ranks=ranks).uuid(),
                      PlanMemory(exchanges=True, apply=False, ranks=ranks).uuid(), PlanMemory(ranks=ranks).uuid()])
    assert uuids[0][0] != uuids[1][0] and uuids[0][1:] == uuids[1][1:]


def test_write_into_slots_when_the_graph_starts_with_a_cast_it_removes() -> None:
    """The 0.95B benchmark's forward starts with a unit's cast to bf16, which the all-gather into a slot takes
    over (and removes): every slot node must still land in the graph (a slot inserted before the removed cast
    left the graph's node list broken backwards: Inductor's topological sort, walking it back, lost nodes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fsdp_compile.passes._graph import WAIT
    from fsdp_compile.passes._write_slots import SlotUse, write_into_slots

    graph = fx.Graph()
    with FakeTensorMode():
        shards = [graph.placeholder(f"shard_{i}") for i in range(2)]
        for shard in shards:
            shard.meta["val"] = torch.empty(8)
        reads = []
        for shard in shards:
            cast = graph.call_function(torch.ops.prims.convert_element_type.default, (shard, torch.bfloat16))
            cast.meta["val"] = shard.meta["val"].to(torch.bfloat16)
            gather = graph.call_function(ALL_GATHER, (cast, 2, "0"))
            gather.meta["val"] = torch.empty(16, dtype=torch.bfloat16)
            wait = graph.call_function(WAIT, (gather,))
            wait.meta["val"] = gather.meta["val"]
            reads.append(graph.call_function(torch.ops.aten.sum.default, (wait,)))
    graph.output(tuple(reads))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    gathers = [n.name for n in graph.nodes if n.target == ALL_GATHER]
    uses = tuple(SlotUse("0", offset, 32, 512, (name,)) for offset, name in zip((0, 256), gathers))
    write_into_slots(gm, uses, symmetric=False, keep_old=False, ranks={"0": 0})
    assert list(reversed(gm.graph.nodes)) == list(gm.graph.nodes)[::-1]  # Inductor's topological sort walks back
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(SLOT) == 2 and targets.count(INTO_SLOT) == 2
    assert torch.ops.prims.convert_element_type.default not in targets  # each cast writes into its slot
    assert slot_hazards(gm.graph) == []


def _release_and_step_again(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Llama(LLAMA_TESTS)
    fsdp_compile.shard(model, units=[Block])
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    losses = []
    for _ in range(2):
        losses.append(compiled(tokens, tokens).detach())
        held = fsdp_compile.slab_bytes()
        assert held > 0 and fsdp_compile.slab_bytes(symmetric=False) == held  # CPU: plain memory
        assert fsdp_compile.slab_bytes(symmetric=True) == 0
        fsdp_compile.release_slabs()
        assert fsdp_compile.slab_bytes() == 0
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)


def test_release_slabs_frees_them_and_a_later_step_reserves_them_again() -> None:
    """``fsdp_compile.release_slabs()`` (a process done with a model): the slabs are freed, and a compiled graph
    that runs again reserves its slab again and computes what it did (2 gloo ranks)."""
    from fsdp_compile.testing.dist import run_ranks

    run_ranks(_release_and_step_again, 2)


def test_destroy_process_group_frees_the_slabs() -> None:
    """``destroy_process_group()`` frees the slabs first (a symmetric slab's handle dies with its group, and
    groups made later reuse the names); a model compiled in the next group gets slabs of its own."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for _ in range(2):
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            _step(*_model("llama"), "aot_eager")
            assert fsdp_compile.slab_bytes() > 0
        finally:
            torch.distributed.destroy_process_group()
        assert fsdp_compile.slab_bytes() == 0


@pytest.mark.slow
def test_another_model_compiled_in_the_same_process_is_planned_as_the_first(
    fake_pg: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Models of one class and other sizes compiled one after another in a process (a sweep, a
    notebook, a benchmark): Dynamo recompiles ``Llama.forward`` and would make the sizes that changed symbolic
    ("automatic dynamic shapes"). ``shard()`` marks each unit's shard static, so the next model's sizes stay
    constants and the memory plan covers all its collectives, as the first model's. A shard whose size is
    symbolic anyway (not marked, here) still compiles, forward and backward, with nothing logged above INFO: its
    collectives keep buffers of their own, its gradient stays packed. (Before: the second model's shard sizes
    were symbolic, so its collectives went unplanned; with Inductor, its backward failed to compile at an
    AssertionError of the plan, and logging a plan that held a symbolic size failed. aot_eager runs the same passes
    on the same graphs, the plans come from the shapes Dynamo gives, and each of those two faults fails this test
    under it: the symbolic gradient written in place counts as many writes as the planned models', and the plan's
    log raises.)"""
    from fsdp_compile import _internals

    torch._dynamo.reset()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    gathered, written = [], []
    for dim, static in ((32, True), (64, True), (96, False)):
        torch.manual_seed(0)
        if not static:
            monkeypatch.setattr(_internals, "mark_static", lambda tensor: None)
        model = fsdp_compile.shard(Llama(dataclasses.replace(LLAMA_TESTS, dim=dim)), units=[Block])
        with caplog.at_level(logging.WARNING), memory_plans() as plans, fsdp_compile.debug.capture_graphs() as graphs:
            backend = fsdp_compile.backend(compiler="aot_eager", regions=False)  # in-place gradients: the step's graphs
            torch.compile(model, backend=backend)(tokens, tokens).backward()
        gathered.append([sum(b["kind"] == "gathered" for b in plan["buffers"]) for plan in plans])
        (backward,) = (g.gm.graph for g in graphs if g.stage == "backward")
        written.append(len(backward.find_nodes(op="call_function", target=MM_INTO)))
    n_units = len(LLAMA_TINY_UNITS)
    # Forward: each unit's all-gather; the step: forward's and backward's (every unit resharded after forward).
    # The unmarked model's blocks have symbolic shard sizes: not planned, their gradients left packed.
    assert gathered[:2] == [[n_units, 2 * n_units]] * 2 and gathered[2][0] < n_units, gathered
    assert written[0] == written[1] > written[2], written
    # Dynamo's, AOT's, Inductor's and the library's loggers (not, say, torch.utils.cpp_extension's "No CUDA runtime
    # is found", which a CUDA build of torch with no GPU visible logs at Inductor's first C++ compile).
    compile_stack = ("torch._", "fsdp_compile")
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(compile_stack)]
    assert not [r.getMessage() for r in warned]
