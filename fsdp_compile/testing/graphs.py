"""The graphs fsdp_compile builds for a tiny Llama, for graph-level tests (one process, fake process group:
shapes are real, values are garbage)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile._internals import COMPILE_AFRESH, inductor_config, trace_log
from fsdp_compile.debug import capture_graphs
from fsdp_compile.testing.dist import hsdp_mesh
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, LlamaConfig

__all__ = ["BF16_FP32_REDUCE", "compile_and_capture", "count_calls", "memory_plans", "slotted_exchanges"]

BF16_FP32_REDUCE = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
"""The Inductor tests' mixed precision: tests/test_codegen.py's whole-step code and tests/test_explain.py's dump
compile the same graphs with it, so Inductor builds their C++ kernels once."""


def count_calls(gm: fx.GraphModule, targets: object) -> int:
    """The calls of ``targets`` (an op, or a tuple of ops) that running ``gm`` makes: its own, and those of the shared
    bodies it calls, once per call."""
    targets = targets if isinstance(targets, tuple) else (targets,)
    count = 0
    for node in gm.graph.nodes:
        if node.target in targets:
            count += 1
        elif node.target is torch.ops.higher_order.invoke_subgraph:
            count += count_calls(getattr(gm, node.args[0].target), targets)
    return count


def compile_and_capture(
    *,
    rank: int = 0,
    mp: fsdp_compile.MixedPrecision | None = None,
    cfg: LlamaConfig = LLAMA_TESTS,
    gradient_sync: bool = True,
    backend_options: dict[str, Any] | None = None,
    mesh: tuple[int, int] | None = None,
    world_size: int = 2,
    **shard_options: Any,
) -> dict[str, fx.GraphModule]:
    """Shard a tiny Llama (every ``Block`` a unit) as ``rank`` of ``world_size`` (or, HSDP, on a (replicate, shard)
    mesh of shape ``mesh``), compile it with ``fsdp_compile.backend(**backend_options)``, run one forward and
    backward, and return the graphs by stage: ``"dynamo"`` (after the Dynamo-graph passes), ``"forward"``,
    ``"backward"``."""
    torch._dynamo.reset()  # many compilations of Llama.forward in one process: stay under the recompile limit
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh[0] * mesh[1] if mesh else world_size)
    try:
        if mesh:
            shard_options["mesh"] = hsdp_mesh(mesh)
        torch.manual_seed(0)
        model = fsdp_compile.shard(Llama(cfg), units=[Block], mp=mp, **shard_options)
        fsdp_compile.set_requires_gradient_sync(model, gradient_sync)
        compiled = torch.compile(model, backend=fsdp_compile.backend(**(backend_options or {})), fullgraph=True)
        tokens = torch.randint(0, cfg.vocab_size, (2, 8))
        with capture_graphs() as graphs:
            compiled(tokens, tokens).backward()
    finally:
        dist.destroy_process_group()
    by_stage = {g.stage: g.gm for g in graphs}
    assert sorted(by_stage) == ["backward", "dynamo", "forward"], [g.stage for g in graphs]
    return by_stage


@contextmanager
def memory_plans() -> Iterator[list[dict]]:
    """The ``fsdp_compile_plan_memory_plan`` artifacts logged meanwhile, parsed. Graphs compiled meanwhile skip
    Inductor's caches (a cached graph runs no pass and logs no plan)."""
    plans: list[dict] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            artifact = getattr(record, "metadata", {}).get("artifact", {})
            if artifact.get("name") == "fsdp_compile_plan_memory_plan":
                plans.append(json.loads(record.payload))  # type: ignore[attr-defined]

    handler = Collect()
    trace_log.addHandler(handler)
    try:
        with inductor_config.patch(COMPILE_AFRESH):
            yield plans
    finally:
        trace_log.removeHandler(handler)


@contextmanager
def slotted_exchanges() -> Iterator[None]:
    """Graphs compiled meanwhile put their gradient exchanges in the memory plan's slots too, as
    ``grad_reduce="copy_engine"`` has them, but on the route any device runs (``exchange_into_slot``): the
    copy engines themselves need GPUs."""
    from fsdp_compile import _backend
    from fsdp_compile.passes.plan_memory import PlanMemory

    original = _backend.PlanMemory
    _backend.PlanMemory = lambda **options: PlanMemory(**{**options, "exchanges": True})  # type: ignore[assignment]
    try:
        yield
    finally:
        _backend.PlanMemory = original  # type: ignore[misc]
