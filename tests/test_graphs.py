"""Layer 1: graph structure on CPU, one process, fake process group (values are garbage; shapes are real)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile._ops import gather_unit
from fsdp_compile.debug import CapturedGraph, capture_graphs
from fsdp_compile.passes.insert_collectives import is_marker
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama, LlamaConfig

N_UNITS = LLAMA_TINY.n_layers + 1  # one per block + the root (embedding tied with output, final norm)
_c10d = torch.ops._c10d_functional


def _count(gm: fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == target)


def _graphs(
    compiler: str, mp: fsdp_compile.MixedPrecision, cfg: LlamaConfig = LLAMA_TINY, gradient_sync: bool = True
) -> dict[str, fx.GraphModule]:
    torch._dynamo.reset()  # many compilations of Llama.forward in one process: stay under the recompile limit
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = fsdp_compile.shard(Llama(cfg), units=[Block], mp=mp)
        fsdp_compile.set_requires_gradient_sync(model, gradient_sync)
        compiled = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler), fullgraph=True)
        tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 8))
        with capture_graphs() as graphs:
            compiled(tokens, tokens).backward()
    finally:
        dist.destroy_process_group()
    by_stage: dict[str, CapturedGraph] = {g.stage: g for g in graphs}
    assert sorted(by_stage) == ["backward", "dynamo", "forward"], [g.stage for g in graphs]
    return {stage: g.gm for stage, g in by_stage.items()}


# (param_dtype, reduce_dtype) as given -> (all-gather dtype, reduce-scatter dtype) expected.
MIXED_PRECISION = {
    "fp32": ((None, None), (torch.float32, torch.float32)),
    "bf16-fp32reduce": ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.float32)),
    "bf16": ((torch.bfloat16, None), (torch.bfloat16, torch.bfloat16)),
}


@pytest.fixture(scope="module", params=sorted(MIXED_PRECISION))
def case(request: pytest.FixtureRequest) -> tuple[dict[str, fx.GraphModule], tuple[torch.dtype, torch.dtype]]:
    (param_dtype, reduce_dtype), expected = MIXED_PRECISION[request.param]
    mp = fsdp_compile.MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    return _graphs("aot_eager", mp), expected


@pytest.fixture
def graphs(case: tuple[dict[str, fx.GraphModule], tuple[torch.dtype, torch.dtype]]) -> dict[str, fx.GraphModule]:
    return case[0]


def test_dynamo_graph_has_one_gather_per_unit_and_no_marker(graphs: dict[str, fx.GraphModule]) -> None:
    dynamo = graphs["dynamo"]
    assert _count(dynamo, gather_unit) == N_UNITS
    assert not any(is_marker(n) for n in dynamo.graph.nodes)


def test_forward_has_one_all_gather_per_unit(graphs: dict[str, fx.GraphModule]) -> None:
    fwd = graphs["forward"]
    assert _count(fwd, _c10d.all_gather_into_tensor.default) == N_UNITS
    assert _count(fwd, _c10d.reduce_scatter_tensor.default) == 0


def test_backward_regathers_and_reduce_scatters_once_per_unit(graphs: dict[str, fx.GraphModule]) -> None:
    bwd = graphs["backward"]
    assert _count(bwd, _c10d.all_gather_into_tensor.default) == N_UNITS
    assert _count(bwd, _c10d.reduce_scatter_tensor.default) == N_UNITS


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


def _dtypes(gm: fx.GraphModule, target: object) -> set[torch.dtype]:
    return {n.meta["val"].dtype for n in gm.graph.nodes if n.target == target}


def test_collective_dtypes_follow_mixed_precision(
    case: tuple[dict[str, fx.GraphModule], tuple[torch.dtype, torch.dtype]],
) -> None:
    graphs, (gather_dtype, reduce_dtype) = case
    assert _dtypes(graphs["forward"], _c10d.all_gather_into_tensor.default) == {gather_dtype}
    assert _dtypes(graphs["backward"], _c10d.all_gather_into_tensor.default) == {gather_dtype}
    assert _dtypes(graphs["backward"], _c10d.reduce_scatter_tensor.default) == {reduce_dtype}
    reduce_ops = {n.args[1] for n in graphs["backward"].graph.nodes if n.target == _c10d.reduce_scatter_tensor.default}
    assert reduce_ops == {"avg"}


def test_activation_checkpointing_regathers_each_unit_once() -> None:
    cfg = dataclasses.replace(LLAMA_TINY, checkpoint_blocks=True)
    graphs = _graphs("aot_eager", fsdp_compile.MixedPrecision(), cfg)
    assert _count(graphs["forward"], _c10d.all_gather_into_tensor.default) == N_UNITS
    # The recomputed blocks and their gradients share one re-gather per unit.
    assert _count(graphs["backward"], _c10d.all_gather_into_tensor.default) == N_UNITS
    assert _count(graphs["backward"], _c10d.reduce_scatter_tensor.default) == N_UNITS
    test_no_gathered_parameter_is_saved_for_backward(graphs)


def test_without_gradient_sync_backward_has_no_reduce_scatter() -> None:
    graphs = _graphs("aot_eager", fsdp_compile.MixedPrecision(), gradient_sync=False)
    assert _count(graphs["backward"], _c10d.all_gather_into_tensor.default) == N_UNITS
    assert _count(graphs["backward"], _c10d.reduce_scatter_tensor.default) == 0
    test_no_gathered_parameter_is_saved_for_backward(graphs)
