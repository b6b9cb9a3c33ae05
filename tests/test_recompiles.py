"""Recompiles (gloo ranks, float64 against the unsharded model): a new batch size or sequence length,
train -> eval -> train, ``torch.no_grad()`` evaluation. Each case gives the reference's results and
compiles a bounded number of graphs (the counts docs/api.md's "Recompiles" documents); a long run on those graphs
then compiles no more and stays flat in memory (soak, slow)."""

from __future__ import annotations

import copy
import gc
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import fsdp_compile
from fsdp_compile.testing.dist import spawn_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import reference_step, rel_error


class _CountingBackend:
    """fsdp_compile's backend, counting the graphs Dynamo hands it."""

    def __init__(self, compiler: str) -> None:
        self.graphs = 0
        self.backend = fsdp_compile.backend(compiler=compiler)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return self.backend(gm, example_inputs)  # type: ignore[no-any-return]


class _Trainer:
    """The sharded model, compiled, beside the unsharded float64 reference on the global batch."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: str,
        compiler: str,
    ) -> None:
        torch.manual_seed(0)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.ref = Llama(LLAMA_TESTS).double().to(device)
        self.model = fsdp_compile.shard(copy.deepcopy(self.ref), units=[Block])
        self.backend = _CountingBackend(compiler)
        self.run = torch.compile(self.model, backend=self.backend)
        # SGD: AdamW turns float64 rounding differences of near-zero gradients into whole steps, and two exact
        # trainings drift apart exponentially (1e-14 to 1e-7 in 40 steps at lr 1e-2); SGD's stay within 2e-15
        # over 1,000 steps, so the comparison with the reference means something.
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=1e-2)
        self.steps = 0

    def batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch and this rank's part of it."""
        gen = torch.Generator().manual_seed(self.steps)
        tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (batch * self.world_size, seq + 1), generator=gen)
        tokens = tokens.to(self.device)
        return tokens, tokens[batch * self.rank : batch * (self.rank + 1)]

    def train(self, batch: int, seq: int) -> None:
        tokens, local = self.batch(batch, seq)
        self.steps += 1
        self.run(local[:, :-1], local[:, 1:]).backward()
        self.opt.step()
        self.opt.zero_grad()
        reference_step(self.ref, tokens, torch.float64, self.world_size)
        self.ref_opt.step()
        self.ref_opt.zero_grad()

    def evaluate(self, batch: int, seq: int) -> None:
        """Eval mode under no_grad: this rank's loss equals the reference's on the same tokens."""
        _, local = self.batch(batch, seq)
        self.model.eval()
        with torch.no_grad():
            got = self.run(local[:, :-1], local[:, 1:])
            want = self.ref(local[:, :-1], local[:, 1:])
        self.model.train()
        assert rel_error(got, want) <= 1e-12, (got.item(), want.item())

    def check_parameters(self, rtol: float = 1e-10) -> None:
        full, want = fsdp_compile.full_state_dict(self.model), self.ref.state_dict()
        worst = max(want, key=lambda k: rel_error(full[k], want[k]))
        assert rel_error(full[worst], want[worst]) <= rtol, (worst, rel_error(full[worst], want[worst]))


# (what the step does, batch, seq, graphs compiled so far): Dynamo compiles static shapes first, then one
# graph with the dimension that changed marked dynamic ("automatic dynamic shapes"), then one more per
# newly dynamic dimension; it specializes sizes 0 and 1, so a batch of one is a graph of its own. Eval mode
# under no_grad is one more graph, and going back to training reuses the training graph.
RECOMPILES = [
    ("train", 2, 8, 1),
    ("train", 2, 8, 1),
    ("train", 3, 8, 2),  # a new batch size: batch becomes dynamic
    ("train", 1, 8, 3),  # a batch of one: specialized
    ("train", 3, 6, 4),  # a new sequence length: sequence becomes dynamic too
    ("train", 2, 5, 4),
    ("evaluate", 2, 5, 5),  # eval + no_grad: an inference graph
    ("train", 2, 7, 5),  # back to training: the training graph again
    ("evaluate", 3, 4, 5),
    ("evaluate", 1, 4, 6),  # a batch of one again: specialized
]


def _recompiles(trainer: _Trainer) -> None:
    compiled = []
    for what, batch, seq, _ in RECOMPILES:
        getattr(trainer, what)(batch, seq)
        compiled.append(trainer.backend.graphs)
    assert compiled == [graphs for *_, graphs in RECOMPILES], compiled
    trainer.check_parameters()


def _live_tensors(at_most: int | None = None, samples: int = 3, pause_s: float = 0.02) -> dict[int, tuple[Any, ...]]:
    """id -> (shape, dtype, is a view) of every live tensor: the smallest of a few counts a moment apart.

    A gloo worker thread marks a collective done (the wait returns) and only then drops it, with the input tensor
    it holds (freeing that tensor's Python object needs the GIL, which the counting thread holds): a count taken in
    between sees one tensor more, a view of a unit's flat shard (a few counts in a hundred right after a wait).
    Such a tensor goes while this thread sleeps; what accumulates is in every count. A count of no more than
    ``at_most`` (the first tenth's) needs no other (each is ~0.3 s of a rank's time).
    """
    counts = []
    for sample in range(samples):
        if sample:
            time.sleep(pause_s)
        gc.collect()
        counts.append({id(o): (tuple(o.shape), o.dtype, o._base is not None) for o in gc.get_objects()
                       if isinstance(o, torch.Tensor)})
        if at_most is not None and len(counts[-1]) <= at_most:
            break
    return min(counts, key=len)


def _soak(rank: int, world_size: int, steps: int, device: str, recompiles_first: bool) -> None:
    """``steps`` steps of three sequence lengths, an evaluation every tenth; ``recompiles_first``: after
    ``RECOMPILES``, whose graphs serve them all (none compiled during the soak)."""
    trainer = _Trainer(rank, world_size, device, "inductor" if device == "cuda" else "aot_eager")
    if recompiles_first:
        _recompiles(trainer)
    graphs = trainer.backend.graphs
    memory: dict[int, tuple[int, ...]] = {}
    first_live: dict[int, tuple[Any, ...]] = {}  # id -> shape, dtype, is a view: the first count's tensors
    tenth = steps // 10
    for step in range(steps):
        trainer.train(2, 8 - step % 3)  # three shapes: a dynamic graph, compiled in the first steps
        if step % tenth == tenth - 1:
            trainer.evaluate(2, 8)
        if step in (tenth - 1, steps - 1):  # after the first tenth and the last (a count of live tensors is slow)
            tensors = _live_tensors(len(first_live) if first_live else None)
            first_live = first_live or tensors
            memory[step] = (
                len(tensors),
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,  # peak resident MiB (Linux: KiB)
                *((torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()) if device == "cuda" else ()),
            )
    first, last = memory[min(memory)], memory[max(memory)]
    # From the first tenth on, nothing accumulates: the same live tensors (and CUDA memory, allocated and
    # peak), the peak resident memory within 64 MiB.
    new = [v for k, v in tensors.items() if k not in first_live]  # named in the failure: what stayed alive
    assert (first[0], *first[2:]) == (last[0], *last[2:]) and last[1] - first[1] < 64, (memory, new[:8])
    assert trainer.backend.graphs <= (graphs if recompiles_first else 4), trainer.backend.graphs
    trainer.check_parameters(rtol=1e-12 if device == "cpu" else 1e-10)


@pytest.mark.slow
def test_new_shapes_and_eval_recompile_a_bounded_number_of_times_then_100_steps_stay_flat() -> None:
    """``RECOMPILES`` (the graphs compiled after each step, the reference's parameters after them), then a 100-step
    soak on the graphs they compiled: flat memory, the reference's results. New processes: the peak resident memory
    is measured from each rank's start."""
    spawn_ranks(_soak, 2, 100, "cpu", True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_soak_200_steps_on_2_gpus_flat_memory_and_the_reference_results() -> None:
    spawn_ranks(_soak, 2, 200, "cuda", False, backend="nccl")
