"""A tiny sharded Llama trained a few steps (compiled with aot_eager), for state-dict and checkpoint tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile.testing.dist import hsdp_mesh
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama

__all__ = ["train_step", "trained"]


def trained(
    seed: int, steps: int, mesh: tuple[int, int] | None = None, compiled: bool = True
) -> tuple[Llama, torch.nn.Module, torch.optim.Optimizer]:
    """A tiny Llama (every Block a unit) with weights from ``seed``, sharded (HSDP on a (replicate, shard) mesh
    of shape ``mesh`` if given), compiled (aot_eager; else eager: no compile, where only the state matters), and
    trained ``steps`` steps with AdamW: (model, the model to call, optimizer)."""
    torch.manual_seed(seed)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block], mesh=hsdp_mesh(mesh))
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        train_step(run, opt, step)
    return model, run, opt


def train_step(compiled: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's batch, which depends on ``step`` and the rank only."""
    gen = torch.Generator().manual_seed(100 + step + dist.get_rank())
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9), generator=gen)
    compiled(tokens[:, :-1], tokens[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
