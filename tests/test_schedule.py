"""schedule_overlap at graph level (CPU, fake process group, the AOT graphs under aot_eager): the pass's options
on copies of one compile's graphs, the default options through the whole pipeline."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

import fsdp_compile
from fsdp_compile.passes.schedule_overlap import apply_overlap, plan_overlap
from fsdp_compile.testing.graphs import compile_and_capture
from fsdp_compile.testing.llama import LLAMA_TINY

N_UNITS = LLAMA_TINY.n_layers + 1
_c10d = torch.ops._c10d_functional
AG, RS, WAIT = _c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default, _c10d.wait_tensor.default
A2A = _c10d.all_to_all_single.default
MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _graphs(
    rank: int = 0, mp: fsdp_compile.MixedPrecision | None = None, **options: object
) -> dict[str, fx.GraphModule]:
    """The scheduled graphs as the overlap pass leaves them (the memory plan, which runs next, not applied: it
    rewrites the all-gathers in place; ``test_codegen.py`` checks that the schedule survives it)."""
    options = {"compiler": "aot_eager", "memory_plan": False, **options}
    graphs = compile_and_capture(rank=rank, mp=mp, cfg=LLAMA_TINY, backend_options=options)
    return {stage: gm for stage, gm in graphs.items() if stage != "dynamo"}


@functools.cache
def _unscheduled() -> dict[str, fx.GraphModule]:
    """The graphs as the overlap pass gets them (no pass after it: gradients not written in place), compiled once."""
    return _graphs(overlap=False, gradients_in_place=False)


@functools.cache
def _scheduled(prefetch: int = 1, max_inflight_grad_reductions: int = 2) -> dict[str, fx.GraphModule]:
    """The overlap pass with these options applied to copies of ``_unscheduled()``'s graphs (tests only read them)."""
    graphs = {stage: copy.deepcopy(gm) for stage, gm in _unscheduled().items()}
    for gm in graphs.values():
        apply_overlap(gm, plan_overlap(gm.graph, prefetch=prefetch, max_inflight_grad_reductions=max_inflight_grad_reductions))
    return graphs


@pytest.fixture(scope="module")
def scheduled() -> dict[str, fx.GraphModule]:
    """The whole pipeline's graphs, default options (the schedule, then the gradients written in place)."""
    return _graphs()


def _units(gm: fx.GraphModule) -> list[dict[str, int]]:
    """Per all-gather, in the order the gathered units are first used: positions of the all-gather, of
    its wait, and of the unit's first and last matmul (reached through views of the wait)."""
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    units = []
    for ag in (n for n in gm.graph.nodes if n.target == AG):
        (wait,) = ag.users
        frontier, mms = [wait], []
        while frontier:
            node = frontier.pop()
            for user in node.users:
                if user.target in MM:
                    mms.append(pos[user])
                elif isinstance(user.target, torch._ops.OpOverload) and user.target.is_view:
                    frontier.append(user)
        first_use = min(pos[u] for u in wait.users)
        units.append({"ag": pos[ag], "wait": pos[wait], "first_use": first_use,
                      "first_mm": min(mms, default=-1), "last_mm": max(mms, default=-1)})
    return sorted(units, key=lambda u: u["first_use"])


def _gathers_in_flight(gm: fx.GraphModule) -> list[list[int]]:
    """Per unit i (in the order the units are first used): the units whose all-gathers have been issued and
    not yet waited for when unit i's gathered buffer is first used."""
    units = _units(gm)
    return [[j for j, other in enumerate(units) if j != i and other["ag"] < unit["first_use"] < other["wait"]]
            for i, unit in enumerate(units)]


@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_exactly_prefetch_next_units_are_gathering_when_a_unit_starts(stage: str, prefetch: int) -> None:
    gm = _scheduled(prefetch=prefetch)[stage]
    units = _units(gm)
    assert len(units) == N_UNITS
    in_flight = _gathers_in_flight(gm)
    assert in_flight == [list(range(i + 1, min(i + prefetch, N_UNITS - 1) + 1)) for i in range(N_UNITS)], in_flight
    for unit in units:  # each wait sits right before the first use of the gathered buffer
        assert unit["wait"] == unit["first_use"] - 1, unit


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_next_units_all_gather_runs_beside_this_units_matmuls(scheduled: dict, stage: str) -> None:
    units = _units(scheduled[stage])
    for this, nxt in zip(units, units[1:]):
        # This unit's compute starts at its first matmul; the root in forward starts with the embedding
        # (no matmul) and comes back for the output projection at the very end.
        start = this["first_mm"] if 0 <= this["first_mm"] < nxt["first_use"] else this["first_use"]
        assert nxt["ag"] < start < nxt["wait"], (stage, this, nxt)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_without_the_pass_each_all_gather_is_issued_at_its_use(stage: str) -> None:
    gm = _unscheduled()[stage]
    assert _gathers_in_flight(gm) == [[]] * N_UNITS
    units = _units(gm)
    for this, nxt in zip(units, units[1:]):
        start = this["first_mm"] if 0 <= this["first_mm"] < nxt["first_use"] else this["first_use"]
        assert nxt["ag"] > start


def _reductions(gm: fx.GraphModule, op: object) -> tuple[list[fx.Node], list[fx.Node], dict[fx.Node, int]]:
    nodes = list(gm.graph.nodes)
    scatters = [n for n in nodes if n.target == op]
    return scatters, [next(iter(rs.users)) for rs in scatters], {n: i for i, n in enumerate(nodes)}


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_exactly_limit_gradient_reductions_in_flight(limit: int) -> None:
    """Right after gradient reduction j is issued, reductions j-limit+1 .. j are in flight: each wait sinks
    until just before the reduction ``limit`` later is issued, and no further."""
    gm = _scheduled(max_inflight_grad_reductions=limit)["backward"]
    scatters, waits, pos = _reductions(gm, RS)
    assert len(scatters) == N_UNITS
    for j, rs in enumerate(scatters):
        in_flight = [i for i in range(N_UNITS) if pos[scatters[i]] <= pos[rs] < pos[waits[i]]]
        assert in_flight == list(range(max(0, j - limit + 1), j + 1)), (limit, j, in_flight)


@pytest.mark.parametrize("exchange", [False, True], ids=["reduce_scatter", "exchange"])
def test_what_only_the_output_needs_follows_the_reduction_wait(scheduled: dict, exchange: bool) -> None:
    if exchange:  # bf16 gradients exchanged with an all-to-all and summed in fp32 after the wait
        mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        scheduled = _graphs(mp=mp)
    scatters, waits, pos = _reductions(scheduled["backward"], A2A if exchange else RS)
    assert len(scatters) == N_UNITS
    end = len(pos) - 1
    for j, wait in enumerate(waits):
        later = pos[scatters[j + 2]] if j + 2 < len(scatters) else end
        assert pos[scatters[j + 1] if j + 1 < len(scatters) else wait] <= pos[wait] < later
        # what only the output needs from it (the fp32 sum of an exchange, casts) follows its wait down
        frontier = list(wait.users)
        while frontier:
            node = frontier.pop()
            if node.op != "output":
                assert pos[wait] < pos[node] < later, node
                frontier.extend(node.users)


def _order(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes]


def test_order_is_identical_across_compilations_and_ranks(scheduled: dict) -> None:
    again, rank1 = _graphs(), _graphs(rank=1)
    for stage in ("forward", "backward"):
        assert _order(again[stage]) == _order(scheduled[stage])
        assert _order(rank1[stage]) == _order(scheduled[stage])


def _max_alive(gm: fx.GraphModule) -> int:
    """Most gathered units alive at once; a unit lives from its all-gather to its last matmul."""
    units = _units(gm)
    return max(sum(u["ag"] <= p <= max(u["last_mm"], u["wait"]) for u in units) for p in range(len(gm.graph.nodes)))


@pytest.mark.parametrize("prefetch", [1, 2])
def test_prefetch_keeps_prefetch_more_units_alive(prefetch: int) -> None:
    baseline, graphs = _unscheduled(), _scheduled(prefetch=prefetch)
    for stage, gm in graphs.items():
        # Without prefetch: the unit being computed (and, in forward, the root, used again at the end).
        assert _max_alive(gm) == _max_alive(baseline[stage]) + prefetch, stage


def test_unmatched_collectives_are_counted_and_said(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective the pass does not recognise stays in place, and the user hears of it (once)."""
    graph = fx.Graph()
    flat = graph.placeholder("flat")
    computed = graph.call_function(torch.ops.aten.mul.Tensor, (flat, 2))  # not a shard input: not movable
    gathered = graph.call_function(AG, (computed, 2, "0"))
    graph.output((graph.call_function(WAIT, (gathered,)),))
    plan = plan_overlap(graph, prefetch=1, max_inflight_grad_reductions=2)
    assert plan.unscheduled == ((gathered.name, "all-gather of a tensor computed in the graph, not of a flat shard input"),)
    counters.clear()
    monkeypatch.setattr(fsdp_compile.debug, "_said", set())
    with caplog.at_level("WARNING", logger="fsdp_compile.debug"):
        apply_overlap(fx.GraphModule({}, graph), plan)
        apply_overlap(fx.GraphModule({}, graph), plan)
    assert counters["fsdp_compile"]["schedule_overlap_unscheduled_all_gathers"] == 2
    assert [r.getMessage() for r in caplog.records if "left" in r.getMessage()] == [
        f"schedule_overlap left {gathered.name} unscheduled (not overlapped with compute): all-gather of a tensor "
        "computed in the graph, not of a flat shard input [counted in torch._dynamo.utils.counters['fsdp_compile']"
        "['schedule_overlap_unscheduled_all_gathers']; said once]"
    ]


def test_the_pass_runs_in_inductors_observer_and_can_be_switched_off_by_name() -> None:
    """Each pass runs through Inductor's GraphTransformObserver under ``fsdp_compile.<pass>``, so
    ``torch._inductor.config.disabled_passes`` reaches it (and a graph dump can show it)."""
    with inductor_config.patch(disabled_passes="fsdp_compile.schedule_overlap"):
        disabled = _graphs(gradients_in_place=False)
    unscheduled = _unscheduled()
    for stage in ("forward", "backward"):
        assert _order(disabled[stage]) == _order(unscheduled[stage])


def test_insert_collectives_cannot_be_switched_off() -> None:
    with inductor_config.patch(disabled_passes="fsdp_compile.insert_collectives"):
        with pytest.raises(Exception, match="names fsdp_compile.insert_collectives: it cannot be switched off"):
            _graphs()


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        fsdp_compile.backend(prefetch=-1)
    with pytest.raises(ValueError, match="max_inflight_grad_reductions must be an int >= 1"):
        fsdp_compile.backend(max_inflight_grad_reductions=0)


def test_an_all_reduce_of_the_models_own_stays_put_and_the_units_are_still_scheduled() -> None:
    """Only an all-reduce of a gradient reduction's result (HSDP's second stage) is scheduled with it; one the
    model computes itself (e.g. a norm over a tensor-parallel group) stays where it is, and the units'
    all-gathers are still prefetched around it."""
    graph = fx.Graph()
    shards = [graph.placeholder(f"shard{i}") for i in range(3)]
    x = graph.placeholder("x")
    for i, shard in enumerate(shards):
        gathered = graph.call_function(WAIT, (graph.call_function(AG, (shard, 2, "0")),))
        x = graph.call_function(torch.ops.aten.mul.Tensor, (x, gathered))
        x = graph.call_function(WAIT, (graph.call_function(_c10d.all_reduce.default, (x, "sum", "1")),))
    graph.output((x,))
    plan = plan_overlap(graph, prefetch=1, max_inflight_grad_reductions=2)
    assert not plan.kept_original_order and not plan.unscheduled and len(plan.gathers) == 3
    order = list(plan.order)
    reduces = [n.name for n in graph.nodes if n.target == _c10d.all_reduce.default]
    muls = [n.name for n in graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    for mul, reduce in zip(muls, reduces):  # each all-reduce right after the compute it reduces, as before
        assert order.index(reduce) == order.index(mul) + 1
    gathers = [n.name for n in graph.nodes if n.target == AG]
    assert order.index(gathers[1]) < order.index(muls[0])  # the next unit is prefetched
