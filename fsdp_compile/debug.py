"""See what the backend did: capture the graphs it builds.

    with fsdp_compile.debug.capture_graphs() as graphs:
        loss = compiled(x).sum(); loss.backward()
    for g in graphs: print(g.stage, g.gm.graph)

Stages: ``"dynamo"`` (the Dynamo graph after ``insert_collectives``), ``"forward"`` and ``"backward"`` (the
AOTAutograd graphs after partitioning, as the compiler receives them). The backward graph is compiled at
the first backward call, so run it inside the ``with`` block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from fsdp_compile._internals import trace_structured

__all__ = ["CapturedGraph", "artifact", "capture_graphs"]

Stage = Literal["dynamo", "forward", "backward"]


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
        yield graphs
    finally:
        _active.remove(graphs)


def record(stage: Stage, gm: fx.GraphModule) -> None:
    for graphs in _active:
        graphs.append(CapturedGraph(stage=stage, gm=gm))


def artifact(name: str, payload: Callable[[], str]) -> None:
    """A JSON plan as a structured artifact ``fsdp_compile_<name>`` (tlparse shows it under TORCH_TRACE);
    ``payload`` runs only when structured tracing is on."""
    trace_structured("artifact", metadata_fn=lambda: {"name": f"fsdp_compile_{name}", "encoding": "json"}, payload_fn=payload)
