"""write_gradients_in_place: each unit's weight gradients' matmuls write straight into the flat gradient its
reduction reads (graph structure on CPU, fake process group; Inductor's code: ``test_codegen.py``), and the
gradients stay right where the flat gradient has gaps and padding (parameters whose sizes are not multiples of
the alignment, on 2 gloo ranks)."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import fsdp_compile
from fsdp_compile.passes._graph import GRAD_REDUCTIONS
from fsdp_compile.passes.write_gradients_in_place import COPY_INTO, MM_INTO, ZERO_INTO
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.graphs import compile_and_capture
from fsdp_compile.testing.llama import LLAMA_TESTS
from fsdp_compile.testing.reference import full_grads, rel_error

MP = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MATMULS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w2, w3; and two norms


def _writers(buffer: torch.fx.Node) -> list[torch.fx.Node]:
    """The in-place writes into ``buffer`` (through its views)."""
    found, views = [], [buffer]
    while views:
        node = views.pop()
        for user in node.users:
            if user.target in (MM_INTO, COPY_INTO, ZERO_INTO):
                found.append(user)
            elif user.target in (torch.ops.aten.slice.Tensor, torch.ops.aten.view.default):
                views.append(user)
    return found


def _flat_gradient(gm: torch.fx.GraphModule, reduced: torch.fx.Node) -> torch.fx.Node:
    """What a reduction reads: a node of the step's graph, or, where a shared backward body returns it, the node of
    the body's graph it returns."""
    if reduced.target is operator.getitem and reduced.args[0].target is torch.ops.higher_order.invoke_subgraph:
        body = getattr(gm, reduced.args[0].args[0].target)
        return body.graph.output_node().args[0][reduced.args[1]]
    return reduced


@pytest.mark.parametrize("regions", [True, False], ids=["shared_bodies", "whole_graph"])
def test_each_blocks_matmuls_write_into_the_flat_gradient_its_reduction_reads(regions: bool) -> None:
    """In the step's graph, or in the shared backward body, which returns the flat gradient its reduction reads."""
    backward = compile_and_capture(mp=MP, backend_options={"compiler": "aot_eager", "regions": regions})["backward"]
    flats = [_flat_gradient(backward, r.args[0]) for r in backward.graph.nodes if r.target in GRAD_REDUCTIONS]
    written = [f for f in flats if f.target == torch.ops.aten.empty.memory_format]
    assert len(written) == LLAMA_TESTS.n_layers  # the root's embedding is tied: two gradients summed, left alone
    for flat in written:
        targets = [w.target for w in _writers(flat)]
        assert targets.count(MM_INTO) == MATMULS_PER_BLOCK and targets.count(COPY_INTO) == 2, targets
    # The matmuls it replaced, and their views, are gone (aot_eager would still run them).
    pure = (torch.ops.aten.mm.default, torch.ops.aten.view.default)
    graphs = [backward.graph, *(m.graph for m in backward.children() if isinstance(m, torch.fx.GraphModule))]
    dead = [n for graph in graphs for n in graph.nodes if not n.users and n.target in pure]
    assert not dead, dead


def test_gradients_in_place_false_leaves_the_gradients_to_the_pack_copy() -> None:
    options = {"compiler": "aot_eager", "gradients_in_place": False}
    backward = compile_and_capture(mp=MP, backend_options=options)["backward"].graph
    assert not [n for n in backward.nodes if n.target in (MM_INTO, COPY_INTO, ZERO_INTO)]
    flats = [r.args[0] for r in backward.nodes if r.target in GRAD_REDUCTIONS]
    assert flats and not [f for f in flats if f.target == torch.ops.aten.empty.memory_format]


class _Odd(nn.Module):
    """Parameters whose sizes leave gaps in the flat buffer (offsets aligned to 16 elements) and padding."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(9, 7), nn.Tanh(), nn.Linear(7, 9)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.square().mean()


def _odd_parity(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = _Odd()
    torch.manual_seed(0)
    model = fsdp_compile.shard(_Odd(), units=[nn.Sequential])
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
    x = torch.randn(4 * world_size, 9, generator=torch.Generator().manual_seed(1))
    compiled(x.chunk(world_size)[rank]).backward()
    ref(x).backward()
    grads = full_grads(model)
    for name, param in ref.named_parameters():
        assert rel_error(grads[name], param.grad) < 1e-6, name


def test_gaps_and_padding_are_zero_and_the_gradients_right() -> None:
    run_ranks(_odd_parity, 2)


def test_zero_into_zeroes_only_the_gaps() -> None:
    out = torch.ones(10)
    torch.ops.fsdp_compile.zero_into(out, [1, 7], [3, 10])
    assert out.tolist() == [1, 0, 0, 1, 1, 1, 1, 0, 0, 0]
