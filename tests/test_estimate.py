"""``fsdp_compile.estimate``: one step's memory predicted on fake tensors, for a world size this process does not
have, equals what the step holds on real ranks (live tensor bytes counted on 2 gloo ranks, the same graphs, Inductor's
fusions not modelled on either side), and moves as the measurement moves when checkpointing changes what is saved.
(Against the GPU's allocator, with the fusions modelled: docs/big-models.md, "Before launch".)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile.estimate import count_step, estimate
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama

CONFIGS = {"saved": LLAMA_TESTS, "checkpointed": dataclasses.replace(LLAMA_TESTS, checkpoint_blocks=True)}


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
    return tokens[:, :-1], tokens[:, 1:]


def _measure(rank: int, world_size: int, predicted: dict[str, int]) -> None:
    """Each rank's step counted as the estimate counts it, on real tensors; rank 0's against the estimate (rank 1's
    shards differ: the padding)."""
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        model = Llama(cfg)
        fsdp_compile.shard(model, units=[Block])
        measured = count_step(model, torch.optim.AdamW(model.parameters(), foreach=True), _tokens)
        assert rank or measured.peak == predicted[name], (name, measured, predicted)
        dist.barrier()


@pytest.mark.ranks
def test_the_estimate_equals_what_two_gloo_ranks_hold_and_moves_with_checkpointing() -> None:
    predicted = {name: estimate(lambda cfg=cfg: Llama(cfg), _tokens, world_size=2, units=[Block], fusion=False)
                 for name, cfg in CONFIGS.items()}
    run_ranks(_measure, 2, {name: e.peak for name, e in predicted.items()})
    saved, checkpointed = predicted["saved"], predicted["checkpointed"]
    assert checkpointed.parts["saved for backward"] < saved.parts["saved for backward"], (saved, checkpointed)
    assert checkpointed.peak < saved.peak and saved.at.startswith("backward"), (saved, checkpointed)
    assert saved.parts["parameters"] == checkpointed.parts["parameters"] > 0


class _Breaking(Llama):
    """The loss computed after a graph break."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def test_a_forward_that_breaks_the_graph_is_refused_saying_how_to_find_the_break() -> None:
    with pytest.raises(ValueError, match=r"compiled as 2 graphs .*torch._dynamo.explain"):
        estimate(lambda: _Breaking(LLAMA_TESTS), _tokens, world_size=4, units=[Block])
    assert not dist.is_initialized()
