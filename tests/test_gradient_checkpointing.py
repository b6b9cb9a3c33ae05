"""Hugging Face's gradient checkpointing (``gradient_checkpointing_enable``), which checkpoints each decoder layer's
``forward`` rather than its ``__call__``: the recompute in backward gathers the layer's unit once (the unit module's
own ``forward`` gathers it, [Note: eager gather and reshard]); eager and compiled (aot_eager: Hugging Face's logging
call breaks the graph at every checkpointed layer, which then runs from Python whatever the compiler; Inductor's code
for a LoRA unit of two dtypes: tests/test_default_path.py), Llama and Qwen2, a peft LoRA model, reentrant and not, CPU
offload, on real ranks against the unsharded model with the same switch (layer 3); frozen parameters stay bitwise. All
on 2 ranks (3, whose shards are padded: tests/test_finetune.py). A recompute of part of a unit is refused, naming the
fix."""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_compile
from fsdp_compile._internals import failures
from fsdp_compile._layout import UNIT, unit_label
from fsdp_compile.debug import capture_graphs
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.hf import VOCAB, add_lora, is_decoder_layer, tiny_causal_lm, train_side_by_side
from fsdp_compile.testing.reference import CausalLMLoss, assert_bitwise

pytest.importorskip("transformers")
pytest.importorskip("peft")
STEPS = 3
ALL_GATHERS = (torch.ops._c10d_functional.all_gather_into_tensor.default,
               torch.ops.fsdp_compile.all_gather_into_slot.default)
TOLERANCE = 1e-12
"""float64, as tests/test_finetune.py: only the order of the gradient sums could differ (measured: equal on 2
ranks; up to 5.6e-14 on 3)."""


class Case(NamedTuple):
    family: str
    compiler: str
    lora: bool = False
    reentrant: bool = False
    after_shard: bool = False
    """The switch turned on after ``shard()`` (Trainer's order: it enables checkpointing when training starts)."""
    offload: bool = False
    """CPU offload (FSDP2's ``CPUOffloadPolicy``): the shards in host memory, copied for each gather."""


CASES = [  # compiled with LoRA, as fine-tuning recipes checkpoint
    Case("llama", "eager"),
    Case("llama", "eager", reentrant=True),
    # Qwen2: LoRA on q and v projections with biases; the switch turned on after shard(); compiled, offloaded
    Case("qwen2", "eager", lora=True, reentrant=True, after_shard=True),
    Case("qwen2", "aot_eager", lora=True, reentrant=True, offload=True),
]


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
        frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
        lm = copy.deepcopy(base)
        ref = CausalLMLoss(_checkpointing_on(base, case))
        if not case.after_shard:
            _checkpointing_on(lm, case)
        fsdp_compile.shard(lm, units=is_decoder_layer, offload_policy=CPUOffloadPolicy() if case.offload else None)
        if case.after_shard:
            _checkpointing_on(lm, case)
        model = CausalLMLoss(lm)
        run = model if case.compiler == "eager" else torch.compile(model, backend=fsdp_compile.backend(
            compiler=case.compiler))
        groups = fsdp_compile.sharded_units(lm)
        layers = {unit_label(u.layout.name) for u in groups if u.layout.fqn}
        # Eager: backward's collectives are each group gathered once (every unit is resharded after forward: for its
        # recompute and the gradients it computes) and each trainable group's reduction. Compiled (the model runs in
        # several graphs, around Hugging Face's graph breaks): no backward graph gathers a layer twice.
        expected = len(groups) + sum(u.trainable for u in groups)
        before_backward: list[int] = []

        def forward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = run(inputs, targets)
            before_backward[:] = [_collectives()]
            return loss

        def recomputed_once(step: int) -> None:
            if case.compiler == "eager":
                assert _collectives() - before_backward[0] == expected, (case, step, _collectives() - before_backward[0])

        with capture_graphs() as graphs:
            worst = train_side_by_side(forward, ref, lm, ref.lm, steps=STEPS, rank=rank, world_size=world_size,
                                       after_backward=recomputed_once)
        if case.compiler != "eager":  # every layer gathered in a backward graph, none twice in one
            gathered = [[unit_label(n.meta["custom"][UNIT]) for n in g.gm.graph.nodes if n.target in ALL_GATHERS]
                        for g in graphs if g.stage == "backward"]
            in_layers = [[u for u in graph if u in layers] for graph in gathered]
            assert set().union(*in_layers) == layers and all(len(g) == len(set(g)) for g in in_layers), gathered
        trained = fsdp_compile.full_state_dict(lm)
        for name, want in frozen.items():
            assert_bitwise(trained[name], want, f"{case}: frozen {name}")
        if rank == 0:
            print(f"{case} world {world_size}: worst rel. errors "
                  + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + f"; {len(frozen)} frozen tensors bitwise")
        assert all(error <= TOLERANCE for error in worst.values()), (case, worst)


def _collectives() -> int:
    """The collectives this rank has issued over the default group (c10d's count)."""
    return failures.group_sequence_number(dist.group.WORLD)


@pytest.mark.slow
def test_hugging_face_gradient_checkpointing_trains_as_the_unsharded_model() -> None:
    """Three AdamW steps equal to the unsharded model with the same switch, and each decoder layer's unit (each of
    its groups, with LoRA) gathered once in backward, for its recompute: eager, by the layer's forward; compiled, by
    the backward graph (counted as the collectives backward issues)."""
    run_ranks(_checkpointed, 2, CASES)


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
