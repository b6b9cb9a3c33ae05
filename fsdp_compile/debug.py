"""See what the backend did: capture the graphs it builds.

    with fsdp_compile.debug.capture_graphs() as graphs:
        loss = compiled(x).sum(); loss.backward()
    for g in graphs: print(g.stage, g.gm.graph)

Stages: ``"dynamo"`` (the Dynamo graph after ``insert_collectives``), ``"forward"`` and ``"backward"`` (the
AOTAutograd graphs after partitioning, as the compiler receives them; with Inductor, as its post-grad passes
leave them: the memory plan and the lowering included). The backward graph is compiled at the first backward
call, so run it inside the ``with`` block. Inside the block graphs are compiled, never loaded from Inductor's
caches: a cached graph would skip the passes and be captured as they found it (its kernels still come from
the cache folder: ``_internals.COMPILE_AFRESH``).

When the library falls back to something slower or heavier than asked for, it says so: :func:`degraded`
counts every occurrence in ``torch._dynamo.utils.counters["fsdp_compile"][key]`` and logs a warning with
the reason once per key and process (logger ``fsdp_compile.debug``). The keys:

- ``schedule_overlap_unscheduled_all_gathers`` / ``..._grad_reductions``: a collective the overlap pass
  does not recognise stays where it is (not prefetched, not overlapped);
- ``schedule_overlap_kept_original_order``: no valid order found, the graph keeps its order;
- ``copy_engine_mid_step_syncs``: a copy-engine all-gather had to grow the symmetric workspace, which
  waits for the GPU (``torch.cuda.synchronize``) in the middle of a step;
- ``cuda_graphs_hold_destroy``: with CUDA graphs, this torch offers no way to free them before
  ``destroy_process_group()``, which then hangs: call ``torch._dynamo.reset()`` before it;
- ``eager_saved_whole``: eager mode saved a tensor without a plain storage (a subclass, sparse) for
  backward as it is, so its unit's memory is not released after forward.

Passes run when Inductor compiles a graph: a graph served from Inductor's FX graph cache counts nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from fsdp_compile._internals import COMPILE_AFRESH, counters, inductor_config, trace_structured
from fsdp_compile._layout import UNIT, unit_label

__all__ = ["CapturedGraph", "artifact", "capture_graphs", "current_stage", "degraded", "graph_artifact", "set_stage"]

log = logging.getLogger(__name__)

Stage = Literal["dynamo", "joint", "forward", "backward"]
"""Where a graph is in the pipeline: Dynamo's graph, AOTAutograd's joint graph (before partitioning; never
captured), the forward and backward graphs."""


@dataclass(frozen=True)
class CapturedGraph:
    stage: Stage
    gm: fx.GraphModule


_active: list[list[CapturedGraph]] = []


@contextmanager
def capture_graphs() -> Iterator[list[CapturedGraph]]:
    graphs: list[CapturedGraph] = []
    _active.append(graphs)
    try:
        with inductor_config.patch(COMPILE_AFRESH):
            yield graphs
    finally:
        _active.remove(graphs)


_stage: Stage = "dynamo"
_COLLECTIVE = re.compile("all_gather|reduce_scatter|all_to_all|all_reduce")


def record(stage: Stage, gm: fx.GraphModule) -> None:
    """``gm`` is the graph of ``stage`` from now on (its passes run next): captured, and the stage the
    structured artifacts logged meanwhile belong to (:func:`current_stage`, for the dump folder)."""
    set_stage(stage)
    for graphs in _active:
        graphs.append(CapturedGraph(stage=stage, gm=gm))


def set_stage(stage: Stage) -> None:
    """The structured artifacts logged from now on belong to ``stage`` (without capturing a graph)."""
    global _stage
    _stage = stage


def current_stage() -> Stage:
    return _stage


def artifact(name: str, payload: Callable[[], str], encoding: Literal["json", "string"] = "json") -> None:
    """A plan (JSON) or a graph's code (string) as a structured artifact ``fsdp_compile_<name>`` (tlparse
    shows it under TORCH_TRACE; ``FSDP_COMPILE_DUMP`` writes it to a file); ``payload`` runs only when
    structured tracing is on."""
    trace_structured(
        "artifact", metadata_fn=lambda: {"name": f"fsdp_compile_{name}", "encoding": encoding}, payload_fn=payload
    )


def graph_artifact(name: str, gm: fx.GraphModule) -> None:
    """``gm``'s code, with shapes, dtypes and each collective's unit, as the artifact ``fsdp_compile_<name>``."""

    def readable() -> str:
        units = [f"#   {n.name}: {unit_label(n.meta['custom'][UNIT])}" for n in gm.graph.nodes
                 if UNIT in n.meta.get("custom", {}) and n.op == "call_function" and _COLLECTIVE.search(str(n.target))]
        code = gm.print_readable(print_output=False, include_stride=False, include_device=True)
        return "\n".join(["# The unit of each collective:", *units, "", code]) if units else code

    artifact(name, readable, encoding="string")


_said: set[str] = set()


def degraded(key: str, reason: str) -> None:
    """Count a fallback under ``counters["fsdp_compile"][key]``; log ``reason`` the first time per ``key``."""
    counters["fsdp_compile"][key] += 1
    if key not in _said:
        _said.add(key)
        log.warning("%s [counted in torch._dynamo.utils.counters['fsdp_compile'][%r]; said once]", reason, key)
