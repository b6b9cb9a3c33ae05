"""Shared bodies ([Note: shared bodies] in docs/architecture.md): the units alike share one traced body each way, the
units that differ get their own, and every collective stays in the step's graphs, unit by unit, scheduled and
planned as in the whole-step graph (graph structure: fake process group, one process); and the numbers are the
whole-step graph's, bitwise, on 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import operator
from unittest import mock

import pytest
import torch
import torch.fx as fx

import fsdp_compile
from fsdp_compile import _backend
from fsdp_compile._internals import INVOKE_SUBGRAPH
from fsdp_compile.config import BackendConfig
from fsdp_compile.passes._graph import ALL_GATHER, GRAD_REDUCTIONS, region_calls
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.graphs import compile_and_capture
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, LlamaConfig
from fsdp_compile.testing.reference import assert_bitwise

LAYERS = 3
INTO_SLOT = torch.ops.fsdp_compile.all_gather_into_slot.default


def _bodies(gm: fx.GraphModule) -> list[str]:
    """The body each region call of ``gm`` runs, in call order."""
    return [call.args[0].target for call in region_calls(gm)]


def _gathers(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target in (ALL_GATHER, INTO_SLOT)]


def test_identical_blocks_share_one_body_each_way_and_every_collective_stays_in_the_steps_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """And a body's schema is traced once, not at each call (``body_schemas_once``: the compile time of deep models)."""
    hop = type(INVOKE_SUBGRAPH)
    schemas: list[str] = []
    worked_out = hop.gen_schema
    monkeypatch.setattr(hop, "gen_schema", lambda self, body, name, *ops: schemas.append(name) or worked_out(
        self, body, name, *ops))
    graphs = compile_and_capture(cfg=dataclasses.replace(LLAMA_TESTS, n_layers=LAYERS),
                                 backend_options={"compiler": "aot_eager"})
    # The forward body for autograd's check, then functionalized with the backward body: each once (at every call, 8
    # on torch 2.13, 15 on 2.11, growing with the depth).
    assert len(schemas) <= 3 and len(set(schemas)) == len(schemas), schemas
    forward, backward = graphs["forward"], graphs["backward"]
    for gm in (forward, backward):
        calls = _bodies(gm)
        assert len(calls) == LAYERS and len(set(calls)) == 1, calls
        assert len(_gathers(gm)) == LAYERS + 1  # every unit, the root too, gathered once (again in backward)
        body = getattr(gm, calls[0]).graph
        assert not _gathers(getattr(gm, calls[0])) and not any(n.target in GRAD_REDUCTIONS for n in body.nodes)
    assert sum(n.target in GRAD_REDUCTIONS for n in backward.graph.nodes) == LAYERS + 1
    # The overlap schedule: each block's all-gather is issued before the previous block's body runs.
    order = {n: i for i, n in enumerate(forward.graph.nodes)}
    gathers, calls = _gathers(forward), region_calls(forward)
    blocks = gathers[1:]  # the root's first
    assert all(order[blocks[i + 1]] < order[calls[i]] for i in range(LAYERS - 1)), [n.name for n in forward.graph.nodes]


def test_a_body_called_once_is_written_out_where_it_is_called() -> None:
    """It saves nothing and costs a compile of its own. Torch 2.13's Dynamo writes such a body out itself; 2.11's
    gives every block that holds a custom autograd.Function (torchao's float8 matmul) a body of its own, which would
    compile slower than without regions (hand-built graph: two calls of one body, one of another)."""

    def body(scale: float) -> fx.GraphModule:
        graph = fx.Graph()
        graph.output((graph.call_function(torch.mul, (graph.placeholder("x"), scale)),))
        return fx.GraphModule({}, graph)

    root = torch.nn.Module()
    root.shared, root.alone = body(2.0), body(3.0)
    graph = fx.Graph()
    x = graph.placeholder("x")
    for name in ("shared", "alone", "shared"):
        call = graph.call_function(INVOKE_SUBGRAPH, (graph.get_attr(name), name, x))
        x = graph.call_function(operator.getitem, (call, 0))
    graph.output(x)
    gm, inputs = fx.GraphModule(root, graph), [torch.ones(3)]
    want = gm(*inputs)
    _backend._keep_shared_bodies(gm, inputs, BackendConfig(), cudagraphs=False)
    assert _bodies(gm) == ["shared", "shared"], gm.code
    assert_bitwise(gm(*inputs), want)


def _aliasing_step() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A step that calls one body twice; the body returns ``x + w``, its input ``x`` as it is and a view of its input
    ``w`` (what a body's partition saves for its backward: the block's input, its weights); the step adds the
    outputs up, as a backward would read them. Values in ``meta["val"]``, as the joint graph has them."""
    body_graph = fx.Graph()
    x, w = body_graph.placeholder("x"), body_graph.placeholder("w")
    body_graph.output((body_graph.call_function(torch.ops.aten.add.Tensor, (x, w)), x,
                       body_graph.call_function(torch.ops.aten.t.default, (w,))))
    root = torch.nn.Module()
    root.body = fx.GraphModule({}, body_graph)
    graph = fx.Graph()
    inputs = [torch.randn(3, 3), torch.randn(3, 3)]
    x, w = (graph.placeholder(name) for name in ("x", "w"))
    x.meta["val"], w.meta["val"] = inputs
    saved = []
    for _ in range(2):
        call = graph.call_function(INVOKE_SUBGRAPH, (graph.get_attr("body"), "body", x, w))
        out, through, view = (graph.call_function(operator.getitem, (call, i)) for i in range(3))
        saved += [through, view]
        x = out
    graph.output((x, *saved))
    for node, value in zip(root.body.graph.find_nodes(op="placeholder"), inputs):
        node.meta["val"] = value
    for node in [n for n in root.body.graph.nodes if n.op == "call_function"]:
        node.meta["val"] = node.target(*fx.node.map_arg(node.args, lambda a: a.meta["val"]))
    return fx.GraphModule(root, graph), inputs


def test_a_body_returns_none_of_its_inputs_the_step_takes_them_from_the_operands() -> None:
    """``unalias_body_outputs`` on a hand-built joint graph: Inductor lowers every output of a body call as a buffer of
    its own, so one that is the call's operand, or a view of it, would be overwritten where the step reuses the
    operand's storage ([Note: shared bodies])."""
    from fsdp_compile.passes.unalias_body_outputs import apply_unalias, plan_unalias

    gm, inputs = _aliasing_step()
    want = gm(*inputs)
    plan = plan_unalias(gm.graph)
    assert [(a.body, a.output, a.placeholder, a.views) for a in plan.aliases] == [
        ("body", 1, "x", ()), ("body", 2, "w", ("t_default",))]
    apply_unalias(gm, plan)
    assert not plan_unalias(gm.graph).aliases and len(gm.body.graph.output_node().args[0]) == 1
    assert all(len(call.users) == 1 for call in region_calls(gm))  # each call's only output: x + w
    torch.testing.assert_close(gm(*inputs), want, rtol=0, atol=0)


def test_a_body_output_aliasing_an_input_on_a_compiled_graph_is_copied_and_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard behind the pass, on the graphs Inductor compiles (``copy_body_aliases``): an alias made after the joint
    graph (a future torch, another pass) costs a copy, never a wrong gradient, and is said (``degraded``)."""
    from fsdp_compile.passes.copy_body_aliases import CopyBodyAliases

    gm, inputs = _aliasing_step()
    want = gm(*inputs)
    monkeypatch.setattr(fsdp_compile.debug, "_said", set())
    torch._dynamo.utils.counters.clear()
    with mock.patch.object(fsdp_compile.debug.log, "warning") as warning:
        CopyBodyAliases()(gm.graph)
    assert torch._dynamo.utils.counters["fsdp_compile"]["shared_body_output_copied"] == 2
    (said,) = warning.call_args_list
    assert "the shared body body returns its input x (operand 0) as output 1" in said.args[0] % said.args[1:]
    outputs = gm.body.graph.output_node().args[0]
    assert [o.target for o in outputs[1:]] == [torch.ops.aten.clone.default] * 2
    got = gm(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got[1].untyped_storage().data_ptr() != inputs[0].untyped_storage().data_ptr()  # a copy, not the input


class _Plain(Block):
    """Another class with the same code and shapes as Block: no reason for a body of its own."""


def test_two_block_kinds_get_two_bodies_each_way_and_alike_classes_share_one() -> None:
    """Every other block with a wider feed-forward (other shapes: another body); a subclass with the same code and
    shapes shares the first body."""
    cfg = dataclasses.replace(LLAMA_TESTS, n_layers=4)
    for wider, kinds in ((True, 2), (False, 1)):
        graphs = _mixed_graphs(cfg, wider)
        for stage in ("forward", "backward"):
            calls = _bodies(graphs[stage])
            assert len(calls) == 4 and len(set(calls)) == kinds, (wider, stage, calls)


def _mixed_graphs(cfg: LlamaConfig, wider: bool) -> dict[str, fx.GraphModule]:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile.debug import capture_graphs

    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = Llama(cfg)
        for index in range(1, len(model.layers), 2):
            if wider:
                model.layers[index] = Block(dataclasses.replace(cfg, ffn_dim=2 * cfg.ffn_dim))
            else:
                model.layers[index].__class__ = _Plain
        fsdp_compile.shard(model, units=[Block])
        compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
        tokens = torch.randint(0, 64, (2, 8))
        with capture_graphs() as captured:
            compiled(tokens, tokens).backward()
    finally:
        dist.destroy_process_group()
    return {g.stage: g.gm for g in captured}


def _three_steps(rank: int, regions: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(dataclasses.replace(LLAMA_TESTS, n_layers=LAYERS)), units=[Block])
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager", regions=regions))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
        run(tokens[:, :-1], tokens[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return fsdp_compile.full_state_dict(model)


def _compare(rank: int, world_size: int) -> None:
    shared = _three_steps(rank, True)
    torch._dynamo.reset()
    whole = _three_steps(rank, False)
    assert_bitwise(shared, whole)


def test_three_adamw_steps_equal_the_whole_step_graphs_bitwise() -> None:
    """aot_eager runs the same ops on the same values in both: the bodies' only difference is where the code is."""
    run_ranks(_compare, 2)
