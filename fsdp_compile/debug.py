"""See what the backend did: capture the graphs it builds.

    with fsdp_compile.debug.capture_graphs() as graphs:
        loss = compiled(x).sum(); loss.backward()
    for g in graphs: print(g.stage, g.gm.graph)

Stages: ``"dynamo"`` (the Dynamo graph after ``insert_collectives``), ``"forward"`` and ``"backward"`` (the
AOTAutograd graphs after partitioning, as the compiler receives them). The backward graph is compiled at
the first backward call, so run it inside the ``with`` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

__all__ = ["CapturedGraph", "capture_graphs"]

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
