"""``fsdp_compile.estimate``: one step's memory predicted on fake tensors, for a world size this process does not
have, equals what the step holds on real ranks (live tensor bytes counted on 2 gloo ranks, the same graphs, Inductor's
fusions not modelled on either side), and moves as the measurement moves when checkpointing changes what is saved;
the step time's FLOPs are the model's, recomputation included. (Against the GPU's allocator, with the fusions
modelled, and the step time against measured steps: docs/big-models.md, "Before launch".)"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import fsdp_compile
from torch.distributed.fsdp import CPUOffloadPolicy

from fsdp_compile.estimate import Hardware, count_step, estimate
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama

CONFIGS = {"saved": LLAMA_TESTS, "checkpointed": dataclasses.replace(LLAMA_TESTS, checkpoint_blocks=True)}
HARDWARE = {"saved": Hardware(card="H100"), "checkpointed": Hardware(fwd_bwd_ms=5.0)}
TOKENS = 2 * 8
"""A rank's tokens in a step (``_tokens``)."""


def _flops(cfg: fsdp_compile.testing.llama.LlamaConfig) -> tuple[int, int]:
    """A step's FLOPs on one rank as torch.utils.flop_counter counts them, and the blocks' forward's: each matmul
    weight 2 FLOPs a token forward and 4 backward (input and weight gradients; the output projection's too: its weight
    is the tied embedding), each block's attention 4 x seq x head dim a token and head forward, 2.5 times that
    backward."""
    block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    attention = 4 * TOKENS * 8 * cfg.dim  # 4 x tokens x seq x (heads x head dim)
    step = 6 * TOKENS * (cfg.n_layers * block + cfg.vocab_size * cfg.dim) + cfg.n_layers * 3.5 * attention
    return int(step), cfg.n_layers * (2 * TOKENS * block + attention)


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
    predicted = {name: estimate(lambda cfg=cfg: Llama(cfg), _tokens, world_size=2, units=[Block], fusion=False,
                                hardware=HARDWARE[name]) for name, cfg in CONFIGS.items()}
    run_ranks(_measure, 2, {name: e.peak for name, e in predicted.items()})
    saved, checkpointed = predicted["saved"], predicted["checkpointed"]
    assert checkpointed.parts["saved for backward"] < saved.parts["saved for backward"], (saved, checkpointed)
    assert checkpointed.peak < saved.peak and saved.at.startswith("backward"), (saved, checkpointed)
    assert saved.parts["parameters"] == checkpointed.parts["parameters"] > 0
    # The step time: fed the FLOPs the step does (the recomputation counted), on the card or from the time given.
    assert saved.step and checkpointed.step, predicted
    # Checkpointed, the blocks' forward again, less what backward does not read (the partitioner's choice: on this
    # model one block's last two matmuls).
    step, forward_blocks = _flops(LLAMA_TESTS)
    assert saved.step.flops == step < checkpointed.step.flops <= step + forward_blocks, (saved.step, checkpointed.step)
    assert saved.step.basis == "H100" and saved.step.step_ms > saved.step.compute_ms > 0, saved.step
    assert checkpointed.step.basis == "measured" and checkpointed.step.compute_ms == 5.0, checkpointed.step
    assert checkpointed.step.step_ms > checkpointed.step.fwd_bwd_ms >= 5.0, checkpointed.step


class _Breaking(Llama):
    """The loss computed after a graph break."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        torch._dynamo.graph_break()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def test_what_the_estimate_cannot_know_is_refused_saying_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"compiled as 2 graphs .*torch._dynamo.explain"):
        estimate(lambda: _Breaking(LLAMA_TESTS), _tokens, world_size=4, units=[Block])
    lengths = iter((8, 6))
    with pytest.raises(ValueError, match=r"gave tensors of .*then of .*Give the same shapes at every call"):
        estimate(lambda: Llama(LLAMA_TESTS), lambda: (torch.zeros(2, next(lengths), dtype=torch.long),) * 2,
                 world_size=2, units=[Block])
    with pytest.raises(ValueError, match=r"CPU-offloaded step.s time is the host.s.*no hardware=, no --card"):
        estimate(lambda: Llama(LLAMA_TESTS), _tokens, world_size=2, units=[Block], hardware=Hardware(),
                 shard_options={"offload_policy": CPUOffloadPolicy(pin_memory=False)})
    with pytest.raises(ValueError, match=r"16 ranks span nodes of 8 GPUs; pass inter_node_gbps= \(--inter-node-gbps\)"):
        estimate(lambda: Llama(LLAMA_TESTS), _tokens, world_size=16, units=[Block], hardware=Hardware())
    with pytest.raises(ValueError, match=r"no compute rate measured for that card; name one of \('H100', 'H200'\)"):
        estimate(lambda: Llama(LLAMA_TESTS), _tokens, world_size=2, units=[Block], hardware=Hardware(card="A100"))
    assert not dist.is_initialized()



def test_the_losss_scattered_zeros_are_computed_in_their_kernel_as_inductor_computes_them() -> None:
    """Cross-entropy's backward scatters into zeros the size of the float32 logits, which Inductor never stores
    (``optimize_scatter_upon_const_tensor``): the estimate leaves them out, as it leaves out what the kernels that
    read a pointwise value compute (on this CPU Inductor's own code for a model whose peak is at the loss peaked 5.6%
    above the estimate, 2x below it with the zeros counted: docs/big-models.md). Likewise a unit's flat gradient
    made as zeros with a slice written in: one buffer, the zeros computed where it is written."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fsdp_compile._internals import inductor_decompositions
    from fsdp_compile.estimate import _fused, _reinplaced

    def backward(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(logits, targets)
        return torch.autograd.grad(loss, logits)[0].to(torch.bfloat16)

    logits = torch.randn(16, 64, requires_grad=True)
    graph = make_fx(backward, decomposition_table=inductor_decompositions())(logits, torch.zeros(16, dtype=torch.long))
    made = {node.target: node for node in graph.graph.nodes}
    zeros, scattered = made[torch.ops.aten.full.default], made[torch.ops.aten.scatter.value]
    assert _fused(zeros) and _fused(scattered), graph.code

    def flat_gradient(weight_gradient: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        return torch.zeros(128).slice_scatter(weight_gradient.flatten(), 0, 0, 64).view(16, 8) @ other

    graph = make_fx(flat_gradient, decomposition_table=inductor_decompositions())(torch.ones(8, 8), torch.ones(8, 8))
    made = {node.target: node for node in graph.graph.nodes}
    zeros, written = made[torch.ops.aten.full.default], made[torch.ops.aten.slice_scatter.default]
    assert _fused(zeros) and not _fused(written), graph.code  # the matmul reads the flat gradient: stored once
    assert not _reinplaced(written, written.target), graph.code  # in a buffer of its own, not in the zeros'


def test_the_command_line_estimates_a_hugging_face_config_and_refuses_what_it_cannot_know(
    tmp_path: "os.PathLike[str]", capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m fsdp_compile estimate CONFIG.json``: a Hugging Face causal LM from its config alone, the step's
    time on a card, as JSON; a question it cannot answer exits 2 with the reason, nothing printed on stdout."""
    import json
    import pathlib

    from fsdp_compile.__main__ import main

    config = pathlib.Path(tmp_path) / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}))
    common = [str(config), "--units", "LlamaDecoderLayer", "--world-size", "2", "--tokens", "16", "--card", "H100"]
    assert main(["estimate", *common, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 2 and result["peak"] > result["steady"] > 0 and result["step"]["flops"] > 0, result
    assert main(["estimate", *common, "--offload"]) == 2
    out, err = capsys.readouterr()
    assert not out and "CPU-offloaded step's time is the host's" in err, err
    assert not dist.is_initialized()
