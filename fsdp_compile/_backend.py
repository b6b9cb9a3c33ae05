"""The ``fsdp_compile`` torch.compile backend: the pass pipeline, then AOTAutograd and Inductor.

Pipeline ([Note: pass order] in docs/architecture.md): ``map_unit_inputs`` -> ``insert_collectives`` on the
Dynamo graph; AOTAutograd with ``reshard_after_forward`` on the joint graph before partitioning;
``schedule_overlap``, ``plan_memory``, then (with a ``"copy_engine"`` route) ``lower_to_copy_engines``, on the
forward and backward graphs (Inductor's post-grad graphs, or the AOT graphs under ``aot_eager``); Inductor
(or ``aot_eager``) compiles them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from fsdp_compile import _dump, _internals, debug
from fsdp_compile._agree import MODEL_HINT, agree
from fsdp_compile._apply_shard import unsharded_parameter_message
from fsdp_compile._describe import units_json
from fsdp_compile._internals import PassPipeline, counters, inductor_config, lifetime
from fsdp_compile._layout import unit_label
from fsdp_compile._unit import UnitState, unit_of_shard
from fsdp_compile._watch import ModelWatch, WatchedGraph
from fsdp_compile.config import BackendConfig
from fsdp_compile.lowering.choose_route import Collective, Routes, resolve_routes
from fsdp_compile.lowering.interrupt_waits import InterruptWaits
from fsdp_compile.lowering.lower_to_copy_engines import LowerToCopyEngines
from fsdp_compile.passes.copy_body_aliases import CopyBodyAliases
from fsdp_compile.passes.insert_collectives import (
    CollectivesPlan,
    UnitGather,
    apply_collectives,
    plan_collectives,
)
from fsdp_compile.passes._graph import holds_collectives, inline_region_calls, region_calls
from fsdp_compile.passes.map_unit_inputs import UnitInputsPlan, iter_graphs, plan_unit_inputs
from fsdp_compile.passes.plan_memory import PlanMemory
from fsdp_compile.passes.reshard_after_forward import ReshardAfterForward
from fsdp_compile.passes.schedule_overlap import ScheduleOverlap
from fsdp_compile.passes.unalias_body_outputs import UnaliasBodyOutputs
from fsdp_compile.passes.write_gradients_in_place import WriteGradientsInPlace
from fsdp_compile.runtime import host_copies
from fsdp_compile.runtime.copy_engine import reserve_workspace, workspace_nbytes

__all__ = ["backend", "fsdp_compile_backend"]

log = logging.getLogger(__name__)


def _post_grad_passes(
    config: BackendConfig, routes: Routes, ranks: Mapping[str, int] | None = None, gloo: bool = False
) -> PassPipeline:
    """The passes on one compiled step's forward and backward graphs (one pipeline per compile: the memory plan
    keeps its forward's buffers for its backward); ``ranks``: this process's rank in each group, by name;
    ``gloo``: the graph's collectives run over gloo."""
    passes: list[Any] = [CopyBodyAliases()]
    if config.overlap:
        passes.append(
            ScheduleOverlap(prefetch=config.prefetch, max_inflight_grad_reductions=config.max_inflight_grad_reductions)
        )
    if config.gradients_in_place:  # after the schedule: it moves reductions by their inputs' producers
        passes.append(WriteGradientsInPlace())
    gathers, exchanges = routes.all_gather == "copy_engine", routes.grad_reduce == "copy_engine"
    passes.append(PlanMemory(  # NCCL's exchanges stay in Inductor's buffers: slotted, a CUDA-graph run hung
        apply=config.memory_plan, symmetric=gathers or exchanges, cudagraphs=config.cudagraphs, exchanges=exchanges,
        ranks=ranks,
    ))
    if gathers or exchanges:
        passes.append(LowerToCopyEngines(all_gather=gathers, grad_reduce=exchanges))
    if gloo:
        passes.append(InterruptWaits())
    bodies = [CopyBodyAliases()]  # a graph over one rank holds no collectives but calls bodies
    if config.gradients_in_place:  # a backward body returns its gradient
        bodies.append(WriteGradientsInPlace())
    return PassPipeline(passes, bodies, is_body=lambda graph: not holds_collectives(graph))


def _joint_passes() -> PassPipeline:
    """The passes on the joint graph, before the partitioner: bodies' outputs that alias their inputs taken from the
    calls' operands, then the all-gathers tagged to be recomputed."""
    return PassPipeline([UnaliasBodyOutputs(), ReshardAfterForward()])


def _inductor_settings(config: BackendConfig, post_grad: PassPipeline) -> dict[str, Any]:
    """Inductor settings for the forward and backward compiles: our joint and post-grad passes; when the
    overlap schedule runs, no peak-memory reordering after it (that reordering would issue each all-gather
    at its use again); CUDA graphs when asked for."""
    settings: dict[str, Any] = {"joint_custom_pre_pass": _joint_passes()}
    if _dump.active():  # a graph from Inductor's caches would run no pass and log nothing to dump
        settings.update(_internals.COMPILE_AFRESH)
    if config.cudagraphs:
        settings["triton.cudagraphs"] = True
    settings["post_grad_custom_post_pass"] = post_grad
    if config.overlap:
        settings["reorder_for_peak_memory"] = False
    return settings


def _user_settings(config: BackendConfig, mode: str | None, options: dict[str, Any] | None) -> dict[str, Any]:
    """``torch.compile(..., mode=..., options=...)`` as Inductor settings (``options`` win over ``mode``), checked
    against Inductor's settings and against those fsdp_compile makes itself."""
    if mode in (None, "default") and not options:
        return {}
    if config.compiler != "inductor":
        raise ValueError(
            f"torch.compile's mode= and options= are Inductor settings, but this backend runs compiler="
            f"{config.compiler!r}: leave them out, or use fsdp_compile.backend(compiler='inductor')"
        )
    settings = {**(_internals.list_mode_options(mode) if mode not in (None, "default") else {}), **(options or {})}
    unknown = sorted(set(settings) - set(inductor_config.get_config_copy()))
    if unknown:
        raise ValueError(f"torch.compile(options=...) names settings Inductor does not have: {unknown}")
    ours = _inductor_settings(config, _post_grad_passes(config, _fixed_routes(config)))
    clash = sorted(k for k in settings if k in ours and settings[k] != ours[k])
    if clash:
        raise ValueError(
            f"torch.compile(mode=..., options=...) sets {clash}, which fsdp_compile sets itself for these options "
            f"({ {k: ours[k] for k in clash} }): leave them out (CUDA graphs: fsdp_compile.backend(cudagraphs=...))"
        )
    return settings


def _inductor_inner_compile(
    settings: dict[str, Any], dump: Any, watches: set[ModelWatch], after_backward: Callable[[], None]
) -> Callable[..., Any]:
    """compile_fx_inner for both graphs. The backward graph is compiled lazily, at the first backward,
    outside ``_compile``'s settings and dump folder, so they are patched in again here. Both are watched (their
    exceptions reach the models' failure channels)."""

    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        backward = _internals.is_backward_compile(kwargs)
        debug.record("backward" if backward else "forward", gm)
        with inductor_config.patch(settings), _dump.dumping(dump), _internals.bodies_donate_nothing():
            compiled = _internals.compile_fx_inner(gm, example_inputs, **kwargs)  # backward: at its first call
        if backward:
            return WatchedGraph(compiled, watches, "backward", after_backward)
        return WatchedGraph(compiled, watches, "forward")

    return inner_compile


GraphRunner = Callable[[debug.Stage, fx.GraphModule], Callable[[list[Any]], Any]]
"""How an aot_eager graph runs, given its stage and module: a boxed function (``fsdp_compile.estimate`` walks the
graphs node by node); by default the graph module's own code."""


def _eager_compiler(
    stage: debug.Stage, config: BackendConfig, post_grad: PassPipeline, watches: set[ModelWatch],
    after: Callable[[], None] | None = None, runner: GraphRunner | None = None,
) -> Callable:
    def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        debug.record(stage, gm)
        with _dump.dumping(config.dump):
            for body in dict.fromkeys(getattr(gm, call.args[0].target) for call in region_calls(gm)):
                post_grad(body.graph)  # as Inductor does: the bodies first
            post_grad(gm.graph)
        run = _internals.make_boxed_func(gm.forward) if runner is None else runner(stage, gm)
        return WatchedGraph(run, watches, stage, after)

    return compiler


def _after_backward(states: list[UnitState]) -> Callable[[], None]:
    """What a backward graph does once it has run: wait for the gradients' copies to the host if an offloaded unit
    it gathers had a gradient from a graph earlier in this backward pass (a graph break inside the unit, a unit
    called twice): autograd now adds the two on the host, which must not read a copy still in flight. Otherwise
    the copies stay in flight past the graph (fsdp_compile.runtime.host_copies)."""
    offloaded = weakref.WeakSet(state for state in states if state.offload_to is not None)

    def after() -> None:
        task = _internals.backward_task()
        again = False
        for state in offloaded:
            again |= state.backward_pass == task
            state.backward_pass = task
        if again:
            host_copies.wait_for_all()

    return after


def _partition_resharded(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    _joint_passes()(joint.graph)
    return _internals.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _sharded_gathers(gm: fx.GraphModule, plan: CollectivesPlan) -> list[tuple[UnitGather, torch.Tensor]]:
    """The graph's all-gathers over more than one rank, each with its flat shard's example value."""
    shards = {n.name: n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")}
    return [(g, shards[g.shard]) for g in plan.gathers if g.world_size > 1]


def _fixed_routes(config: BackendConfig) -> Routes:
    """The routes as the options give them (``"auto"`` taken for NCCL): for checks made before a graph exists."""
    fixed = {option: "nccl" if getattr(config, option) == "auto" else getattr(config, option)
             for option in ("all_gather", "grad_reduce")}
    return Routes(**fixed)


def _resolve_routes(gm: fx.GraphModule, plan: CollectivesPlan, config: BackendConfig) -> Routes:
    """The routes of this graph's collectives (``lowering/choose_route.py``), what ``"auto"`` chose logged."""
    collectives = [Collective(g.unit, g.world_size, g.grad_reduction, shard.device) for g, shard in
                   _sharded_gathers(gm, plan)]
    routes = resolve_routes(config.all_gather, config.grad_reduce, config.memory_plan, collectives)
    for option, chosen in routes.chosen:
        debug.artifact(f"{option}_route", chosen.to_json, encoding="json")
        counters["fsdp_compile"][f"{option}_auto_{chosen.route}"] += 1
        log.info("fsdp_compile: %s='auto' chose %r: %s", option, chosen.route, chosen.reason)
    return routes


def _reserve_workspaces(gm: fx.GraphModule, plan: CollectivesPlan) -> None:
    """Size each group's copy-engine workspace to its largest shard, in param_dtype, before any graph runs."""
    by_group: dict[str, list[tuple[int, Any]]] = {}
    for gather, shard in _sharded_gathers(gm, plan):
        if shard.device.type == "cuda":  # others: lower_to_copy_engines refuses them
            by_group.setdefault(gather.group_name, []).append((shard.numel(), gather.param_dtype))
    for group_name, group_shards in sorted(by_group.items()):
        reserve_workspace(group_name, workspace_nbytes(group_shards))


def _check_parameters_sharded(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Refuse a parameter Dynamo lifted as a graph input: sharded parameters are never read (their class's
    property reads the unit), so it belongs to no unit and nothing would average its gradient."""
    for node, value in zip(gm.graph.find_nodes(op="placeholder"), example_inputs):
        if isinstance(value, nn.Parameter):
            raise RuntimeError(unsharded_parameter_message(_internals.placeholder_source(node)))


def _agree_on_gathers(plan: CollectivesPlan, unit_inputs: UnitInputsPlan, route: str) -> None:
    """Before the graph runs, check that every rank compiled the same all-gathers (per process group; HSDP:
    within the replica and across the replicas), by the same routes where ``"auto"`` chose them (a rank on
    NCCL and one on copy engines would wait for each other forever)."""
    chosen = f" by {route} ('auto')" if route else ""
    by_group: dict[str, tuple[dist.ProcessGroup, torch.device, list[str]]] = {}
    for gather in plan.gathers:
        state = unit_inputs.units[(gather.graph, gather.shard)]
        for group in state.groups:
            entry = by_group.setdefault(group.group_name, (group, state.flat.device, []))
            entry[2].append(state.describe_gather() + chosen)
    hint = MODEL_HINT + (
        "; with all_gather='auto' or grad_reduce='auto', ranks whose GPUs or environment differ may choose "
        "different routes: set 'nccl' (or 'copy_engine') to choose for them" if route else "")
    for group, device, gathers in by_group.values():
        agree(group, device, f"the compiled graph {_internals.current_compile_id()}", gathers, hint)


def _keep_shared_bodies(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: BackendConfig, cudagraphs: bool
) -> None:
    """The region calls the units' bodies are shared through, top-level calls only: a region inside another or inside
    a checkpointed region is written out where it is called, and with ``regions=False`` every one is (the whole step as
    one graph, as Dynamo traces it without regions); so is a unit whose flat shard has a symbolic size (another
    unit's could not be passed to its body), and a body called once: sharing it saves nothing and its own compile
    costs (torch 2.11 gives every block that holds a custom ``autograd.Function``, torchao's float8 matmul, a body of
    its own). Under Inductor's CUDA graphs too: its code for a body call computed wrong gradients there (torch 2.13,
    on CPU, where the graphs are skipped). [Note: shared bodies]"""
    placeholders = list(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    symbolic = {node for node, value in placeholders
                if unit_of_shard(value) is not None and not isinstance(node.meta["example_value"].numel(), int)}
    regions = config.regions and not cudagraphs
    if config.regions and cudagraphs and region_calls(gm):
        debug.degraded("shared_bodies_cuda_graphs", "with CUDA graphs (cudagraphs=True, or a mode that turns them on) "
                       "every unit is compiled where it is called: the whole step as one graph")
    for _, graph_module in reversed(list(iter_graphs(gm))):  # innermost first: a body's own calls, then the body's
        calls = region_calls(graph_module)
        if graph_module is gm and regions:
            uses = collections.Counter(call.args[0].target for call in calls)
            calls = [call for call in calls if symbolic.intersection(call.args[2:]) or uses[call.args[0].target] == 1]
        if calls:
            inline_region_calls(graph_module, calls)
    counters["fsdp_compile"]["shared_bodies"] += len({call.args[0].target for call in region_calls(gm)})


def _bodies_json(gm: fx.GraphModule, plan: CollectivesPlan) -> str:
    """Each shared body and the units whose calls run it, in call order (explain's "shared bodies")."""
    body_of = {call.name: call.args[0].target for call in region_calls(gm)}
    bodies: dict[str, list[str]] = {}
    for gather in plan.gathers:
        if gather.call is not None:
            units = bodies.setdefault(body_of[gather.call], [])
            units.extend([] if unit_label(gather.unit) in units else [unit_label(gather.unit)])
    return json.dumps(bodies)


def _insert_collectives(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: BackendConfig, cudagraphs: bool = False
) -> tuple[CollectivesPlan, Routes, list[UnitState]]:
    """The collectives inserted, their routes (resolved here, once, before the ranks agree), and the units the
    graph gathers."""
    debug.record("dynamo", gm)
    _check_parameters_sharded(gm, example_inputs)
    _keep_shared_bodies(gm, example_inputs, config, cudagraphs)
    unit_inputs = plan_unit_inputs(gm, example_inputs)
    plan = plan_collectives(gm, unit_inputs)
    debug.artifact("units", lambda: units_json(unit_inputs.units.values()))
    debug.artifact("collectives_plan", plan.to_json)
    if plan.bodies:
        debug.artifact("shared_bodies", lambda: _bodies_json(gm, plan))
    debug.graph_artifact("insert_collectives_before", gm)
    routes = _resolve_routes(gm, plan, config)
    _agree_on_gathers(plan, unit_inputs, routes.describe())

    def insert(graph: fx.Graph) -> CollectivesPlan:
        apply_collectives(gm, plan)
        return plan

    if _internals.run_observed(gm, "fsdp_compile.insert_collectives", insert) is None:
        raise ValueError(
            "torch._inductor.config.disabled_passes names fsdp_compile.insert_collectives: it cannot be switched off"
        )
    counters["fsdp_compile"]["all_gathers"] += len(plan.gathers)
    counters["fsdp_compile"]["float8_all_gathers"] += sum(1 for gather in plan.gathers if gather.float8)
    debug.graph_artifact("insert_collectives_after", gm)
    log.info("fsdp_compile: %d units gathered in a graph of %d nodes", len(plan.gathers), len(gm.graph.nodes))
    return plan, routes, list(unit_inputs.units.values())


def _compile(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: BackendConfig,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
    runner: GraphRunner | None = None,
) -> Callable[..., Any]:
    with _dump.dumping(config.dump):
        return _compile_dumped(gm, example_inputs, config, _user_settings(config, mode, options), runner)


def _compile_dumped(
    gm: fx.GraphModule, example_inputs: Sequence[Any], config: BackendConfig, user_settings: dict[str, Any],
    runner: GraphRunner | None = None,
) -> Callable[..., Any]:
    cudagraphs = config.cudagraphs or bool(user_settings.get("triton.cudagraphs"))
    plan, routes, states = _insert_collectives(gm, example_inputs, config, cudagraphs)
    groups = {group.group_name: group for state in states for group in state.groups}
    gloo = any(dist.get_backend(group) == "gloo" for group in groups.values())
    watches = {state.watch for state in states}
    post_grad = _post_grad_passes(config, routes, {name: group.rank() for name, group in groups.items()}, gloo)
    settings = {**user_settings, **_inductor_settings(config, post_grad)}
    if settings.get("triton.cudagraphs") and not lifetime.before_destroy("cuda_graphs", lifetime.release_cuda_graphs):
        debug.degraded(
            "cuda_graphs_hold_destroy",
            "this torch gives fsdp_compile no way to free Inductor's CUDA graphs before destroy_process_group(), "
            "which then waits for them forever: call torch._dynamo.reset() before destroy_process_group()",
        )
    if routes.all_gather == "copy_engine" and not config.memory_plan:  # else: only what the plan leaves unslotted
        _reserve_workspaces(gm, plan)
    after_backward = _after_backward(states)
    if config.compiler == "aot_eager":
        # A runner (fsdp_compile.estimate) walks the graphs Inductor would lower: its decompositions applied.
        decompositions = _internals.inductor_decompositions() if runner is not None else None
        with _internals.body_schemas_once():
            return _internals.aot_autograd(
                fw_compiler=_eager_compiler("forward", config, post_grad, watches, runner=runner),
                bw_compiler=_eager_compiler("backward", config, post_grad, watches, after_backward, runner),
                partition_fn=_partition_resharded,
                keep_inference_input_mutations=True,
                decompositions=decompositions,
            )(gm, example_inputs)
    # The passes are also patched around compile_fx so that they are part of the cache keys (FX graph and
    # AOTAutograd caches): a graph compiled with other options is never reused.
    with inductor_config.patch(settings), _internals.body_schemas_once(), _donations(gm):
        inner_compile = _inductor_inner_compile(settings, config.dump, watches, after_backward)
        return _internals.compile_fx(gm, example_inputs, inner_compile=inner_compile)


def _donations(gm: fx.GraphModule) -> Any:
    """Where the graph calls shared bodies and this torch gives no way to keep Inductor from donating a body's inputs
    (``_internals.bodies_donate_nothing``): no donated inputs in the step's backward at all. [Note: shared bodies]"""
    if not region_calls(gm) or _internals.BODY_DONATION_HOOK:
        return contextlib.nullcontext()
    debug.degraded("shared_bodies_no_donated_buffers", (
        "this torch lowers shared bodies in a way fsdp_compile does not know, so it cannot keep Inductor from "
        "overwriting a body's inputs that the step's backward donates: the backward of a step with shared bodies "
        "donates none (torch._functorch.config.donated_buffer=False for it; a little more memory)"))
    return _internals.no_donated_buffers()


def backend(**options: Any) -> Callable[..., Any]:
    """A configured backend: ``torch.compile(model, backend=fsdp_compile.backend(**options))``.

    ``options`` are the fields of :class:`fsdp_compile.BackendConfig`. ``torch.compile``'s own ``mode=`` and
    ``options=`` reach Inductor too, beside fsdp_compile's passes.
    """
    return functools.partial(_compile, config=BackendConfig(**options))


def fsdp_compile_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None, options: dict[str, Any] | None = None
) -> Callable[..., Any]:
    """The backend registered as ``"fsdp_compile"`` (default options; ``torch.compile``'s ``mode=`` and
    ``options=`` reach Inductor)."""
    return _compile(gm, example_inputs, config=BackendConfig(), mode=mode, options=options)
