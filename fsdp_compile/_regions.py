"""Whether a unit module's forward, traced by Dynamo, is a nested compile region (the units alike then share one body:
[Note: shared bodies] in docs/architecture.md), and what switches that off for the process: a unit's forward that
breaks the graph, which a region cannot hold (Dynamo refuses it instead of falling back). From then on each unit's
forward runs from Python, the unit gathered once per call, and is compiled in pieces that read it
(``_apply_shard._forward_in_pieces``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fsdp_compile import _internals
from fsdp_compile.debug import degraded

__all__ = ["Regions", "call_with_regions"]

T = TypeVar("T")


class Regions:
    """``on``: units' traced forwards are regions (read while Dynamo traces, so a change recompiles)."""

    on = True


def _call_with_regions(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``call(*args, **kwargs)`` (a sharded model's call, which torch.compile compiles); where Dynamo refused a unit's
    region because its forward breaks the graph, again with regions off. The refusal comes while Dynamo compiles a
    frame, the same on every rank; a frame compiled and run before it (a graph break before the first unit) runs
    again."""
    callback = _internals.frame_callback()
    try:
        return call(*args, **kwargs)
    except Exception as error:
        if not (Regions.on and _internals.is_region_break(error)):
            raise
        reason = _graph_break(str(error))
    Regions.on = False
    degraded("shared_bodies_off", f"a unit's forward breaks the graph ({reason}), and a forward traced in pieces "
             "cannot share a body, nor gather its unit in a graph (a piece may run a number of times that depends on "
             "the data, different on each rank): every unit is now gathered once per call, outside the graphs, as "
             "FSDP2's hooks do, and its forward compiled in pieces that read it")
    _internals.dynamo_reset()  # what was compiled before the refusal (with regions) compiles again, without
    _internals.set_frame_callback(callback)  # Dynamo dropped it with the refused compile
    return call(*args, **kwargs)


def _graph_break(message: str) -> str:
    """The line of Dynamo's refusal that says what broke the graph."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    found = next((line for line in lines if line.startswith(("Explanation:", "Graph break", "Unsupported"))), None)
    return (found or lines[min(2, len(lines) - 1)] if lines else "?")[:200]


call_with_regions = _internals.run_by_python(_call_with_regions)
"""Run by Python: the call it makes is what ``torch.compile(model)`` compiles."""
