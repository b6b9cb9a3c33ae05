"""Layer 1: graph structure on CPU, one process, fake process group (values are garbage; shapes are real)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_compile
from fsdp_compile import explain
from fsdp_compile._internals import is_view_op
from fsdp_compile.passes._graph import CASTS
from fsdp_compile.passes.insert_collectives import is_marker
from fsdp_compile.passes.schedule_overlap import ScheduleOverlap, apply_overlap, plan_overlap
from fsdp_compile.runtime.ops import cast_all_gather_differentiable
from fsdp_compile.testing.graphs import compile_and_capture, count_calls
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, LlamaConfig, save_matmuls

N_UNITS = LLAMA_TESTS.n_layers + 1  # one per block + the root (embedding tied with output, final norm)
_c10d = torch.ops._c10d_functional
RS, A2A = _c10d.reduce_scatter_tensor.default, _c10d.all_to_all_single.default
AG, INTO_SLOT = _c10d.all_gather_into_tensor.default, torch.ops.fsdp_compile.all_gather_into_slot.default
ALL_GATHERS = (AG, INTO_SLOT)
"""An all-gather into a buffer of its own, or (the memory plan applied) into its slot."""


_count = count_calls


def _graphs(
    compiler: str,
    mp: fsdp_compile.MixedPrecision,
    cfg: LlamaConfig = LLAMA_TESTS,
    gradient_sync: bool = True,
    **shard_options: object,
) -> dict[str, fx.GraphModule]:
    return compile_and_capture(
        mp=mp, cfg=cfg, gradient_sync=gradient_sync, backend_options={"compiler": compiler}, **shard_options
    )


Expected = tuple[torch.dtype, object, torch.dtype]
# MixedPrecision as given -> (all-gather dtype, gradient reduction op, dtype it sends) expected.
MIXED_PRECISION: dict[str, tuple[fsdp_compile.MixedPrecision, Expected]] = {
    "fp32": (fsdp_compile.MixedPrecision(), (torch.float32, RS, torch.float32)),
    # bf16 gradients, fp32 sums: exchanged in bf16 (all-to-all), summed in fp32 by the receiver.
    "bf16-fp32reduce": (
        fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        (torch.bfloat16, A2A, torch.bfloat16),
    ),
    "bf16-fp32reduce-scatter": (
        fsdp_compile.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, exchange_grads_in_param_dtype=False
        ),
        (torch.bfloat16, RS, torch.float32),
    ),
    "bf16": (fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16), (torch.bfloat16, RS, torch.bfloat16)),
}


@pytest.fixture(scope="module", params=sorted(MIXED_PRECISION))
def case(request: pytest.FixtureRequest) -> tuple[dict[str, fx.GraphModule], Expected]:
    mp, expected = MIXED_PRECISION[request.param]
    return _graphs("aot_eager", mp), expected


@pytest.fixture
def graphs(case: tuple[dict[str, fx.GraphModule], Expected]) -> dict[str, fx.GraphModule]:
    return case[0]


def _reductions(gm: fx.GraphModule) -> list[fx.Node]:
    """The gradient reductions: reduce-scatters and all-to-alls."""
    return [n for n in gm.graph.nodes if n.target in (RS, A2A)]


def test_dynamo_graph_has_one_gather_per_unit_and_no_marker(graphs: dict[str, fx.GraphModule]) -> None:
    dynamo = graphs["dynamo"]
    assert _count(dynamo, cast_all_gather_differentiable) == N_UNITS
    assert not any(is_marker(n) for n in dynamo.graph.nodes)


def test_forward_has_one_all_gather_per_unit(graphs: dict[str, fx.GraphModule]) -> None:
    fwd = graphs["forward"]
    assert _count(fwd, ALL_GATHERS) == N_UNITS
    assert not _reductions(fwd)


def test_backward_regathers_and_reduces_once_per_unit(graphs: dict[str, fx.GraphModule]) -> None:
    bwd = graphs["backward"]
    assert _count(bwd, ALL_GATHERS) == N_UNITS
    assert len(_reductions(bwd)) == N_UNITS


def test_cpu_offload_copies_each_unit_to_the_device_with_its_gather_and_its_gradient_back() -> None:
    """FSDP2's ``CPUOffloadPolicy``, bf16 compute: each all-gather reads its unit's shard copied to the device in
    bf16 (the copy casts: from the host's bf16 mirror where current, fsdp_compile.runtime.host_copies), the copy
    right before the all-gather, so the schedule moves (prefetches) both together; backward copies again for its
    re-gather and copies each reduced gradient, in the shard's dtype, to the host: the graph's outputs."""
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    graphs = _graphs("aot_eager", mp, offload_policy=CPUOffloadPolicy())
    h2d, d2h = torch.ops.fsdp_compile.copy_to_device.default, torch.ops.fsdp_compile.copy_to_host.default
    for stage in ("forward", "backward"):
        nodes = list(graphs[stage].graph.nodes)
        copies = [n for n in nodes if n.target is h2d]
        assert len(copies) == _count(graphs[stage], ALL_GATHERS) == N_UNITS, stage
        for copy in copies:
            (gather,) = copy.users
            assert copy.args[0].op == "placeholder" and copy.args[0].meta["val"].dtype == torch.float32
            assert copy.meta["val"].dtype == torch.bfloat16, copy.format_node()
            assert gather.target in ALL_GATHERS and 0 < nodes.index(gather) - nodes.index(copy) <= 2, stage  # a slot's slice between
        waits = [n for n in nodes if n.target == _c10d.wait_tensor.default]
        assert all(nodes.index(copies[k]) < nodes.index(waits[k - 1]) for k in range(1, N_UNITS)), stage  # prefetch
    back = [n for n in graphs["backward"].graph.nodes if n.target is d2h]
    assert len(back) == N_UNITS and all(n.meta["val"].dtype == torch.float32 for n in back)
    assert all(user.op == "output" for n in back for user in n.users)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "kept"])
def test_cpu_offload_on_one_rank_copies_each_unit_again_in_backward_unless_kept(reshard: bool) -> None:
    """One rank, offloaded: no all-gather, each unit's copy to the device is the gathered unit. Resharded after
    forward (the default) it is copied again in backward, never saved (the device holds one unit's copy at a time,
    as on several ranks: a frozen base offloaded costs the GPU no more than its largest unit); kept
    (``reshard_after_forward=False``) it is saved for backward and not copied again."""
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16)
    graphs = _graphs("aot_eager", mp, world_size=1, offload_policy=CPUOffloadPolicy(), reshard_after_forward=reshard)
    h2d = torch.ops.fsdp_compile.copy_to_device.default
    fwd, bwd = graphs["forward"], graphs["backward"]
    assert _count(fwd, ALL_GATHERS) == _count(bwd, ALL_GATHERS) == 0
    assert _count(fwd, (h2d,)) == N_UNITS and _count(bwd, (h2d,)) == (N_UNITS if reshard else 0)
    (output,) = fwd.graph.find_nodes(op="output")
    saved = {a for a in output.args[0] if isinstance(a, fx.Node)}
    copies = [n for n in fwd.graph.nodes if n.target is h2d]
    assert not reshard or not saved & {*copies, *(u for n in copies for u in n.users if is_view_op(u.target))}


def _gathered_aliases(gm: fx.GraphModule) -> set[fx.Node]:
    """The all-gather results and every view of them (tensors sharing the gathered storage)."""
    frontier = [n for n in gm.graph.nodes if n.target == _c10d.wait_tensor.default]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        seen.add(node)
        frontier.extend(
            u for u in node.users if isinstance(u.target, torch._ops.OpOverload) and u.target.is_view and u not in seen
        )
    return seen


def test_no_gathered_parameter_is_saved_for_backward(graphs: dict[str, fx.GraphModule]) -> None:
    fwd = graphs["forward"]
    (output,) = fwd.graph.find_nodes(op="output")
    saved = [a for a in output.args[0] if isinstance(a, fx.Node)]
    leaked = _gathered_aliases(fwd) & set(saved)
    assert not leaked, f"gathered parameters saved for backward: {sorted(n.name for n in leaked)}"
    # What is saved instead: the flat shards themselves (placeholders), to be re-gathered in backward.
    assert sum(1 for a in saved if a.op == "placeholder") >= N_UNITS


def _dtypes(gm: fx.GraphModule, targets: tuple[object, ...]) -> set[torch.dtype]:
    """The dtypes the collectives produce (an all-gather into a slot: its slot's)."""
    return {(n.kwargs.get("out") or n).meta["val"].dtype for n in gm.graph.nodes if n.target in targets}


def test_collective_dtypes_follow_mixed_precision(case: tuple[dict[str, fx.GraphModule], Expected]) -> None:
    graphs, (gather_dtype, reduction, wire_dtype) = case
    assert _dtypes(graphs["forward"], ALL_GATHERS) == {gather_dtype}
    assert _dtypes(graphs["backward"], ALL_GATHERS) == {gather_dtype}
    reductions = _reductions(graphs["backward"])
    assert {n.target for n in reductions} == {reduction}
    assert {n.meta["val"].dtype for n in reductions} == {wire_dtype}
    if reduction == RS:
        assert {n.args[1] for n in reductions} == {"avg"}
    else:  # the receiver sums the exchanged parts in reduce_dtype (fp32)
        for a2a in reductions:
            chain = [a2a]
            while chain[-1].target != torch.ops.aten.sum.dim_IntList:
                (user,) = chain[-1].users  # wait, view, cast to fp32, divide by the world size, sum
                chain.append(user)
            assert [n.meta["val"].dtype for n in chain[-3:]] == [torch.float32] * 3, chain


def test_activation_checkpointing_regathers_each_unit_once() -> None:
    cfg = dataclasses.replace(LLAMA_TESTS, checkpoint_blocks=True)
    graphs = _graphs("aot_eager", fsdp_compile.MixedPrecision(), cfg)
    assert _count(graphs["forward"], ALL_GATHERS) == N_UNITS
    # The recomputed blocks and their gradients share one re-gather per unit.
    assert _count(graphs["backward"], ALL_GATHERS) == N_UNITS
    assert len(_reductions(graphs["backward"])) == N_UNITS
    test_no_gathered_parameter_is_saved_for_backward(graphs)


def test_without_gradient_sync_backward_has_no_reduce_scatter() -> None:
    graphs = _graphs("aot_eager", fsdp_compile.MixedPrecision(), gradient_sync=False)
    assert _count(graphs["backward"], ALL_GATHERS) == N_UNITS
    assert not _reductions(graphs["backward"])
    test_no_gathered_parameter_is_saved_for_backward(graphs)


def test_a_unit_not_resharded_is_saved_for_backward_instead_of_regathered() -> None:
    """The graphs after every pass (the memory plan applied: aot_eager runs the post-grad passes too); under
    Inductor the same unit kept gathered trains as the reference (``test_parity_inductor[...-root_kept-...]``)."""
    keep_root = {"reshard_after_forward": lambda fqn, module: fqn != ""}
    graphs = _graphs("aot_eager", fsdp_compile.MixedPrecision(), **keep_root)
    assert _count(graphs["forward"], ALL_GATHERS) == N_UNITS
    assert _count(graphs["forward"], AG) == 1  # the root's, read in backward: never in a slot
    assert _count(graphs["backward"], ALL_GATHERS) == N_UNITS - 1
    fwd = graphs["forward"]
    (output,) = fwd.graph.find_nodes(op="output")
    saved = {a for a in output.args[0] if isinstance(a, fx.Node)}
    # Saved: views of ONE gathered buffer, the root's (its embedding/output weight and final norm).
    leaked = _gathered_aliases(fwd) & saved
    sources = set()
    for node in leaked:
        while node.target != _c10d.wait_tensor.default:
            node = node.args[0]
        sources.add(node)
    assert len(sources) == 1, sorted(n.name for n in leaked)


AR, WAIT = _c10d.all_reduce.default, _c10d.wait_tensor.default


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with a graph of its own (the schedule reorders nodes), sharing the rest (its bodies, the nodes' meta)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _scheduled_hsdp_backward(backward: fx.GraphModule) -> dict[str, tuple[str]]:
    """Checks a backward graph of the HSDP step as scheduled; returns each reduce-scatter's all-reduce."""
    gathers = [n for n in backward.graph.nodes if n.target in ALL_GATHERS]
    scatters = [n for n in backward.graph.nodes if n.target == RS]
    reduces = [n for n in backward.graph.nodes if n.target == AR]
    assert len(gathers) == len(scatters) == len(reduces) == N_UNITS
    order = {n: i for i, n in enumerate(backward.graph.nodes)}
    overlapped, stages = 0, {}
    for reduce in reduces:
        source = reduce.args[0]
        while source.target != WAIT:  # the reduced shard: a view of the reduce-scatter's result
            source = source.args[0]
        assert source.args[0].target == RS
        stages[source.args[0].name] = (reduce.name,)
        (wait,) = reduce.users
        between = [n for n in backward.graph.nodes if order[reduce] < order[n] < order[wait]]
        overlapped += any(n.op == "call_function" and n.target not in (RS, AR, WAIT) for n in between)
    assert overlapped >= N_UNITS - 2, overlapped
    return stages


def test_hsdp_reduces_within_the_replica_then_averages_across_replicas_overlapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HSDP 2 x 2 (rank 0 of 4): per unit, the all-gathers and reduce-scatters run over the shard dimension's
    group, then ONE all-reduce of the reduced shard over the replicate dimension's group; the schedule issues
    each all-reduce once its reduce-scatter is waited for and waits for it later, past backward compute,
    whatever the bound on reductions in flight: the step compiled once (the default bound, 2, every pass after
    the schedule applied too), and the schedule planned and applied again to the backward graph as it reached the
    schedule, for bounds 1, 2 and 3 (rather than a compile per bound)."""
    counters.clear()
    unscheduled: list[fx.GraphModule] = []  # the graphs the schedule got, copied (it reorders their nodes)
    schedule = ScheduleOverlap.__call__

    def keep_a_copy(self: ScheduleOverlap, graph: fx.Graph) -> None:
        unscheduled.append(_copy(graph.owning_module))
        schedule(self, graph)

    monkeypatch.setattr(ScheduleOverlap, "__call__", keep_a_copy)
    options = {"compiler": "aot_eager"}
    graphs = compile_and_capture(mp=fsdp_compile.MixedPrecision(), backend_options=options, mesh=(2, 2))
    assert not counters["fsdp_compile"]["schedule_overlap_kept_original_order"]
    forward, backward = graphs["forward"], graphs["backward"]
    gathers = [n for g in (forward, backward) for n in g.graph.nodes if n.target in ALL_GATHERS]
    scatters = [n for n in backward.graph.nodes if n.target == RS]
    reduces = [n for n in backward.graph.nodes if n.target == AR]
    assert len(gathers) == 2 * N_UNITS and len(scatters) == N_UNITS and len(reduces) == N_UNITS
    shard_groups = {n.args[2] for n in gathers} | {n.args[3] for n in scatters}
    replicate_groups = {n.args[2] for n in reduces}
    assert len(shard_groups) == 1 and len(replicate_groups) == 1 and shard_groups != replicate_groups
    assert {n.args[1] for n in gathers} == {n.args[2] for n in scatters} == {2}  # the shard dimension's size
    stages = _scheduled_hsdp_backward(backward)
    (before,) = [gm for gm in unscheduled if any(n.target == AR for n in gm.graph.nodes)]
    for limit in (1, 2, 3):
        gm = _copy(before)
        plan = plan_overlap(gm.graph, prefetch=1, max_inflight_grad_reductions=limit)
        apply_overlap(gm, plan)
        assert not plan.kept_original_order and _scheduled_hsdp_backward(gm) == stages, limit
        # The schedule's plan names each reduction's all-reduce, and explain prints it.
        assert plan.replica_all_reduces == stages
        lines = explain._schedule_lines("backward", json.loads(plan.to_json()))
        assert "each then averaged over the replicas" in lines[0]
        assert sum(f"then {ar} over the replicas" in line for (ar,) in stages.values() for line in lines) == N_UNITS


def test_selective_checkpointing_saves_the_matmuls_not_the_gathered_parameters() -> None:
    """``save_matmuls`` keeps every matmul's output for backward (its backward graph has the matmuls of a
    model without checkpointing, no recomputed one); the all-gathers and their views stay recomputed
    (re-gathered in backward), as without a policy. (A unit checkpointed from outside is written out in the step's
    graph, [Note: shared bodies]: compared with the model without checkpointing written out too.)"""
    cfg = dataclasses.replace(LLAMA_TESTS, checkpoint_blocks=True, checkpoint_policy=save_matmuls)
    selective = _graphs("aot_eager", fsdp_compile.MixedPrecision(), cfg)
    test_no_gathered_parameter_is_saved_for_backward(selective)
    assert _count(selective["backward"], ALL_GATHERS) == N_UNITS
    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
    plain = compile_and_capture(mp=fsdp_compile.MixedPrecision(), backend_options={"compiler": "aot_eager",
                                                                                "regions": False})
    assert _count(selective["backward"], matmuls) == _count(plain["backward"], matmuls) > 0


def _plans_of_steps(orders: tuple[str, ...]) -> dict[str, list[tuple[str, str]]]:
    """Each named model's pass plans (artifact name, JSON) when the models' steps interleave in one process: every
    forward (in ``orders``' order), then every backward (AOTAutograd compiles a backward at its first call)."""
    import logging

    from fsdp_compile._internals import COMPILE_AFRESH, inductor_config, trace_log

    configs = {"tests": LLAMA_TESTS, "tiny": dataclasses.replace(LLAMA_TESTS, dim=48, n_layers=1, ffn_dim=64)}
    plans: dict[str, list[tuple[str, str]]] = {name: [] for name in orders}
    current: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            name = getattr(record, "metadata", {}).get("artifact", {}).get("name", "")
            if name.endswith("_plan"):
                plans[current[-1]].append((name, record.payload))  # type: ignore[attr-defined]

    torch._dynamo.reset()
    losses = {}
    handler = Collect()
    trace_log.addHandler(handler)
    try:
        with inductor_config.patch(COMPILE_AFRESH):
            for name in orders:
                torch.manual_seed(0)
                cfg = configs[name]
                mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                model = fsdp_compile.shard(Llama(cfg), units=[Block], mp=mp)
                compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), dynamic=False)
                tokens = torch.randint(0, cfg.vocab_size, (2, 8))
                current.append(name)
                losses[name] = compiled(tokens, tokens)
            for name in orders:
                current.append(name)
                losses[name].backward()
    finally:
        trace_log.removeHandler(handler)
    return plans


def test_two_models_compiled_in_one_process_get_the_plans_each_gets_alone(fake_pg: None) -> None:
    """No pass keeps state between compiles (the memory plan keeps a forward's buffers for its backward in the
    step's own pass object): two models whose forwards and backwards interleave get the plans each gets alone. The
    one order covers both ways state could leak: the second model's forward compiles while the first's backward is
    pending, and the first's backward compiles after the second's forward."""
    alone = {name: _plans_of_steps((name,))[name] for name in ("tests", "tiny")}
    assert all(len({n for n, _ in plans}) >= 4 for plans in alone.values()), alone  # overlap, memory, ... plans
    assert alone["tests"] != alone["tiny"]
    together = _plans_of_steps(("tests", "tiny"))
    assert together == alone
