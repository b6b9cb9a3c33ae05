"""The ``fsdp_compile`` torch.compile backend: the pass pipeline, then AOTAutograd and Inductor.

Pipeline (see DESIGN.md): ``map_units`` -> ``insert_collectives`` on the Dynamo graph; AOTAutograd with
``reshard_after_forward`` on the joint graph before partitioning; ``schedule_overlap``, then (with
``all_gather="copy_engine"``) ``lower_to_symm_mem``, on the forward and backward graphs (Inductor's
post-grad graphs, or the AOT graphs under ``aot_eager``); Inductor (or ``aot_eager``) compiles them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor import config as inductor_config
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass

from fsdp_compile import debug
from fsdp_compile.config import BackendConfig
from fsdp_compile.lowering.lower_to_symm_mem import LowerToSymmMem, reserve_workspace
from fsdp_compile.passes.insert_collectives import CollectivesPlan, apply_collectives, plan_collectives
from fsdp_compile.passes.map_units import plan_unit_inputs
from fsdp_compile.passes.reshard_after_forward import ReshardAfterForward
from fsdp_compile.passes.schedule_overlap import ScheduleOverlap

__all__ = ["backend", "fsdp_compile_backend"]

log = logging.getLogger(__name__)


class _PostGradPasses(CustomGraphPass):
    """Our passes over the forward and backward graphs, in order, as Inductor's one
    ``post_grad_custom_post_pass`` (torch 2.11 takes a single pass)."""

    def __init__(self, passes: Sequence[CustomGraphPass]) -> None:
        self.passes = tuple(passes)

    def __call__(self, graph: fx.Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(b"".join(p.uuid() for p in self.passes)).digest()


def _post_grad_passes(config: BackendConfig) -> _PostGradPasses | None:
    passes: list[CustomGraphPass] = []
    if config.overlap:
        passes.append(
            ScheduleOverlap(prefetch=config.prefetch, max_inflight_reduce_scatters=config.max_inflight_reduce_scatters)
        )
    if config.all_gather == "copy_engine":
        passes.append(LowerToSymmMem())
    return _PostGradPasses(passes) if passes else None


def _inductor_settings(config: BackendConfig) -> dict[str, Any]:
    """Inductor settings for the forward and backward compiles: our post-grad passes; when the overlap
    schedule runs, no peak-memory reordering after it (that reordering would issue each all-gather at its
    use again); CUDA graphs when asked for."""
    settings: dict[str, Any] = {"triton.cudagraphs": True} if config.cudagraphs else {}
    passes = _post_grad_passes(config)
    if passes is not None:
        settings["post_grad_custom_post_pass"] = passes
    if config.overlap:
        settings["reorder_for_peak_memory"] = False
    return settings


def _inductor_inner_compile(config: BackendConfig) -> Callable[..., Any]:
    """compile_fx_inner for both graphs. The backward graph is compiled lazily, at the first backward,
    outside ``_compile``'s settings, so they are patched in again here."""

    def inner_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        debug.record("backward" if kwargs.get("is_backward") else "forward", gm)
        with inductor_config.patch(_inductor_settings(config)):
            return compile_fx_inner(gm, example_inputs, **kwargs)

    return inner_compile


def _eager_compiler(stage: debug.Stage, config: BackendConfig) -> Callable[..., Any]:
    def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        passes = _post_grad_passes(config)
        if passes is not None:
            passes(gm.graph)
            gm.recompile()
        debug.record(stage, gm)
        return make_boxed_func(gm.forward)

    return compiler


def _partition_resharded(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
    ReshardAfterForward()(joint.graph)
    joint.recompile()
    return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def _reserve_workspaces(gm: fx.GraphModule, plan: CollectivesPlan) -> None:
    """Size each group's copy-engine workspace to its largest shard, in param_dtype, before any graph runs."""
    shards = {n.name: n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")}
    needed: dict[str, int] = {}
    for gather in plan.gathers:
        shard = shards[gather.shard]
        if gather.world_size > 1 and shard.device.type == "cuda":  # others: lower_to_symm_mem refuses them
            nbytes = shard.numel() * gather.param_dtype.itemsize
            needed[gather.group_name] = max(needed.get(gather.group_name, 0), nbytes)
    for group_name, nbytes in sorted(needed.items()):
        reserve_workspace(group_name, nbytes)


def _compile(gm: fx.GraphModule, example_inputs: Sequence[Any], *, config: BackendConfig) -> Callable[..., Any]:
    unit_inputs = plan_unit_inputs(gm, example_inputs)
    plan = plan_collectives(gm, unit_inputs)
    debug.artifact("collectives_plan", plan.to_json)
    apply_collectives(gm, plan)
    counters["fsdp_compile"]["all_gathers"] += len(plan.gathers)
    log.info("fsdp_compile: %d units gathered in a graph of %d nodes", len(plan.gathers), len(gm.graph.nodes))
    debug.record("dynamo", gm)
    if config.all_gather == "copy_engine":
        _reserve_workspaces(gm, plan)
    if config.compiler == "aot_eager":
        return aot_autograd(
            fw_compiler=_eager_compiler("forward", config),
            bw_compiler=_eager_compiler("backward", config),
            partition_fn=_partition_resharded,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    # The passes are also patched around compile_fx so that they are part of the cache keys (FX graph and
    # AOTAutograd caches): a graph compiled with other options is never reused.
    with inductor_config.patch(joint_custom_pre_pass=ReshardAfterForward(), **_inductor_settings(config)):
        return compile_fx(gm, example_inputs, inner_compile=_inductor_inner_compile(config))


def backend(**options: Any) -> Callable[..., Any]:
    """A configured backend: ``torch.compile(model, backend=fsdp_compile.backend(**options))``.

    ``options`` are the fields of :class:`fsdp_compile.BackendConfig`.
    """
    config = BackendConfig(**options)
    return functools.partial(_compile, config=config)


def fsdp_compile_backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """The backend registered as ``"fsdp_compile"`` (default options)."""
    return _compile(gm, example_inputs, config=BackendConfig())
