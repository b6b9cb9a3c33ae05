"""Hugging Face's gradient checkpointing (``gradient_checkpointing_enable``), which checkpoints each decoder layer's
``forward`` rather than its ``__call__``: the recompute in backward gathers the layer's unit once (the unit module's
own ``forward`` gathers it, [Note: eager gather and reshard]); eager, aot_eager and Inductor, Llama and Qwen2, a peft
LoRA model, reentrant and not, on real ranks against the unsharded model with the same switch (layer 3). A recompute
of part of a unit is refused, naming the fix."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.hf import VOCAB, add_lora, is_decoder_layer, tiny_causal_lm, train_side_by_side
from fsdp_compile.testing.reference import CausalLMLoss

pytest.importorskip("transformers")
pytest.importorskip("peft")
STEPS = 3
TOLERANCE = 1e-12
"""float64, as tests/test_finetune.py: only the order of the gradient sums differs (measured below 1e-15)."""


class Case(NamedTuple):
    family: str
    compiler: str
    lora: bool = False
    reentrant: bool = False
    after_shard: bool = False
    """The switch turned on after ``shard()`` (Trainer's order: it enables checkpointing when training starts)."""


CASES = {  # by world size: Llama on 2 ranks, Qwen2 on 3
    2: [Case("llama", "eager"), Case("llama", "aot_eager"), Case("llama", "inductor"),
        Case("llama", "eager", reentrant=True), Case("llama", "aot_eager", lora=True)],
    3: [Case("qwen2", "eager"), Case("qwen2", "aot_eager"), Case("qwen2", "eager", lora=True, reentrant=True, after_shard=True),
        Case("qwen2", "aot_eager", reentrant=True)],
}


def _prepared(case: Case) -> nn.Module:
    """The model as Hugging Face's fine-tuning recipe prepares it: LoRA's adapters (and, as peft's docs say for
    checkpointing, inputs that require a gradient: the embedding is frozen)."""
    lm = tiny_causal_lm(case.family)
    if case.lora:
        lm = add_lora(lm)
        lm.enable_input_require_grads()
    return lm


def _checkpointing_on(lm: nn.Module, case: Case) -> nn.Module:
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.reentrant})
    return lm


def _checkpointed(rank: int, world_size: int, cases: list[Case]) -> None:
    for case in cases:
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = _prepared(case)
        lm = copy.deepcopy(base)
        ref = CausalLMLoss(_checkpointing_on(base, case))
        if not case.after_shard:
            _checkpointing_on(lm, case)
        fsdp_compile.shard(lm, units=is_decoder_layer)
        if case.after_shard:
            _checkpointing_on(lm, case)
        model = CausalLMLoss(lm)
        run = model if case.compiler == "eager" else torch.compile(model, backend=fsdp_compile.backend(
            compiler=case.compiler))
        run_ref = torch.compile(ref) if case.compiler == "inductor" else ref
        layer_groups = [u for u in fsdp_compile.sharded_units(lm) if u.layout.fqn]
        gathers = counters["fsdp_compile"]
        before_backward: list[int] = []

        def forward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = run(inputs, targets)
            before_backward[:] = [gathers["eager_forward_gathers"]]
            return loss

        def recomputed_once(step: int) -> None:  # each layer's groups gathered once for its recompute, no more
            assert gathers["eager_forward_gathers"] - before_backward[0] == len(layer_groups), (case, dict(gathers))

        worst = train_side_by_side(forward, run_ref, lm, ref.lm, steps=STEPS, rank=rank, world_size=world_size,
                                   after_backward=recomputed_once)
        if rank == 0:
            print(f"{case} world {world_size}: worst rel. errors "
                  + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
        assert all(error <= TOLERANCE for error in worst.values()), (case, worst)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(CASES))
def test_hugging_face_gradient_checkpointing_trains_as_the_unsharded_model(world_size: int) -> None:
    """Three AdamW steps equal to the unsharded model with the same switch, and each decoder layer's unit (each of
    its groups, with LoRA) gathered once in backward, for its recompute."""
    run_ranks(_checkpointed, world_size, CASES[world_size])


def test_a_recompute_of_part_of_a_unit_is_refused_naming_the_fix(fake_pg: Any) -> None:
    """Units coarser than the checkpointed layers: the recompute reads a unit's parameters outside the unit's forward,
    where nothing gathers them."""
    torch.manual_seed(0)
    lm = tiny_causal_lm()
    lm.gradient_checkpointing_enable()
    fsdp_compile.shard(lm, units=lambda fqn, module: fqn == "model")  # the decoder, layers and all
    tokens = torch.randint(0, VOCAB, (2, 8))
    loss = CausalLMLoss(lm)(tokens, tokens)
    with pytest.raises(RuntimeError, match=r"model.layers.1.input_layernorm.weight was read in backward outside the "
                                           r"forward of its unit 'model': activation checkpointing .* shard with "
                                           r"units= naming the checkpointed module's class"):
        loss.backward()
