"""Layer 3: the configuration users run — ``torch.compile(model, backend="fsdp_compile")``: Inductor, every default
option, shared block bodies — trains as the unsharded model, every parameter trained, on 2 and 3 gloo ranks, one case
per model family (docs/architecture.md, "Testing numerics": no budget cut removes them), and the fine-tuning habits and
backend switches that change the graphs around the bodies.

Each case trains two AdamW steps in float64 against the unsharded model (the ranks' micro-batches' gradients averaged,
as the sharded model averages them: ``micro_batch_step``) and checks the loss, every trainable gradient and, after the
steps, every parameter. Several cases build the coincidence that once hid wrong gradients ([Note: shared bodies]): as
many tokens a rank as the vocabulary (or GPT-2's positions), so that a buffer the step needs later has exactly the size
of a body's input.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.hf import VOCAB, add_lora, is_decoder_layer, tiny_causal_lm, train_side_by_side
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import CausalLMLoss

pytest.importorskip("transformers")
pytest.importorskip("peft")

EXACT = (1e-12, 1e-12, 1e-10)
"""float64 throughout: only the order of the ranks' sums differs from the reference (rel. error of the mean loss, the
worst gradient, the worst parameter after the steps)."""
HF = (1e-8, 1e-4, 1e-4)
"""Hugging Face's float64 models compute parts in float32 (RMSNorm, the rotary tables, a mixture of experts' router:
they cast to float32, here down), which Inductor fuses and rounds otherwise than eager: float32's resolution (6e-8)
over a few operations, measured up to 2.9e-5 on a gradient (Qwen2's, the same with the whole step as one graph,
``regions=False``; under aot_eager 6e-15). What these cases catch is wrong by 1e-2 to 1e4."""


class Case(NamedTuple):
    build: Callable[[], nn.Module]
    """The unsharded model, ``model(inputs, targets) -> loss`` (seeded by the caller)."""
    units: Any
    """``shard(units=...)``."""
    tolerances: tuple[float, float, float] = EXACT
    shard: dict[str, Any] = {}
    """More ``shard()`` options."""
    backend: dict[str, Any] | None = None
    """``fsdp_compile.backend(**backend)``; None: ``backend="fsdp_compile"``, as users write it."""
    mode: str | None = None
    """``torch.compile(mode=...)``."""
    tokens: tuple[int, int] = (2, 8)
    """(sequences, tokens a sequence) a rank."""
    accumulate: int = 1
    """Micro-batches a step (gradient accumulation, each backward reduced)."""
    bodies: int = 1
    """Shared bodies the step's graphs call (each distinct block called more than once)."""


def _llama(**changes: Any) -> Callable[[], nn.Module]:
    return lambda: Llama(dataclasses.replace(LLAMA_TESTS, **changes)).double()


def _two_kinds() -> nn.Module:
    """Five blocks of three kinds, ``K A A M A``: ``K`` (first) and ``M`` (middle) called once, each written out where
    it is called, ``A`` three times (a shared body); untied embeddings."""
    model = Llama(dataclasses.replace(LLAMA_TESTS, n_layers=5, tie_embeddings=False))
    for index, ffn in ((0, 40), (3, 56)):
        model.layers[index] = Block(dataclasses.replace(LLAMA_TESTS, ffn_dim=ffn))
    return model.double()


def _hf(family: str, prepare: Callable[[nn.Module], nn.Module] = lambda lm: lm, layers: int = 2
        ) -> Callable[[], nn.Module]:
    return lambda: CausalLMLoss(prepare(tiny_causal_lm(family, layers=layers)))


def _frozen_embedding(lm: nn.Module) -> nn.Module:
    lm.model.embed_tokens.requires_grad_(False)
    return lm


def _lora_float32(lm: nn.Module) -> nn.Module:
    return add_lora(lm, torch.float32)


def _gpt2() -> nn.Module:
    """GPT-2 (tied embeddings, biases, learned positions), as many positions as a rank's tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    return CausalLMLoss(GPT2LMHeadModel(cfg).double())


def _gpt2_blocks(fqn: str, module: nn.Module) -> bool:
    return type(module).__name__ == "GPT2Block"


VOCAB_TOKENS = (4, 16)
"""A rank's tokens as many as the vocabulary (64)."""

CASES_2 = {
    # testing.llama, tied: the README's model; the size coincidence; gradients accumulated over two micro-batches.
    "llama_tied": Case(_llama(), [Block], tokens=VOCAB_TOKENS, accumulate=2),
    # peft's LoRA on a Hugging Face Llama, base frozen: every LoRA fine-tune. Its adapters in float32 over the float64
    # base, as peft makes them over a bf16 one (Inductor's code for units of two dtypes; the same code on 1 rank).
    # Three layers: the first gets a body of its own (called once: written out), the others share one.
    "hf_llama_lora": Case(_hf("llama", _lora_float32, layers=3), is_decoder_layer, HF),
    # Qwen2 with its embedding frozen (the blocks fine-tuned): the first layer's input asks for no gradient, so it gets
    # a body of its own (written out), the others share one; the coincidence.
    "hf_qwen2_frozen_embedding": Case(_hf("qwen2", _frozen_embedding, layers=3), is_decoder_layer, HF,
                                      tokens=VOCAB_TOKENS),
    # Phi-3 (fused projections): the coincidence.
    "hf_phi3": Case(_hf("phi3"), is_decoder_layer, HF, tokens=VOCAB_TOKENS),
    # GPT-2: as many positions as a rank's tokens.
    "hf_gpt2": Case(_gpt2, _gpt2_blocks, HF),
    # Each backend switch that changes the graphs around the bodies, on the tied Llama with the coincidence.
    "no_overlap_not_resharded": Case(_llama(), [Block], shard={"reshard_after_forward": False},
                                     backend={"overlap": False}, tokens=VOCAB_TOKENS),
    # ... and the root (embedding, norm, output) alone kept gathered from forward to backward, and torch.compile's
    # mode= (its settings reach Inductor beside the passes': tests/test_codegen.py; "max-autotune" would turn CUDA
    # graphs on, under which the bodies are written out: [Note: shared bodies]).
    "no_memory_plan_no_gradients_in_place_no_prefetch_root_kept_max_autotune": Case(
        _llama(), [Block], backend={"memory_plan": False, "gradients_in_place": False, "prefetch": 0},
        shard={"reshard_after_forward": lambda fqn, module: fqn != ""}, mode="max-autotune-no-cudagraphs",
        tokens=VOCAB_TOKENS),
}
CASES_3 = {
    # testing.llama, untied, blocks of three kinds: two called once (first, middle), one shared; padded shards.
    "llama_untied_two_kinds_called_once": Case(_two_kinds, [Block], tokens=VOCAB_TOKENS),
    # Mixtral: the experts' loop breaks the graph (every unit then gathered from Python, its forward compiled in pieces)
    # and runs as often as a rank's tokens hit experts (the 3-rank crash).
    "hf_mixtral": Case(_hf("mixtral"), is_decoder_layer, HF, bodies=0),
}
CASES_1 = {
    # peft's LoRA on one rank (shared bodies with nothing to reduce), offloaded: as on 2 ranks.
    "hf_llama_lora_offloaded": Case(_hf("llama", _lora_float32, layers=3), is_decoder_layer, HF,
                                    shard={"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
}


CASES = {1: CASES_1, 2: CASES_2, 3: CASES_3}


def _train(rank: int, world_size: int) -> None:
    for name, case in CASES[world_size].items():
        torch._dynamo.reset()  # several models from the same code: stay under the recompile limit
        counters.clear()
        fsdp_compile.release_slabs()  # the last case's: each case's own counted
        torch.manual_seed(0)
        ref = case.build()
        model = copy.deepcopy(ref)
        hf = isinstance(model, CausalLMLoss)  # the Hugging Face model is what is sharded and compiled, as users do
        lm, ref_lm = (model.lm, ref.lm) if hf else (model, ref)
        fsdp_compile.shard(lm, units=case.units, **case.shard)
        backend = "fsdp_compile" if case.backend is None else fsdp_compile.backend(**case.backend)
        compiled = torch.compile(lm, backend=backend, mode=case.mode)
        run = CausalLMLoss(compiled) if hf else compiled
        worst_of: dict[str, str] = {}
        batch, seq = case.tokens
        worst = train_side_by_side(run, ref, lm, ref_lm, steps=2, rank=rank, world_size=world_size, batch=batch,
                                   seq=seq, worst_of=worst_of, accumulate=case.accumulate)
        said = f"{name} world {world_size}: " + ", ".join(
            f"{k} {v:.1e}" + (f" ({worst_of[k]})" if k in worst_of else "") for k, v in worst.items())
        if rank == 0:
            print(said)
        assert all(worst[k] <= tol for k, tol in zip(worst, case.tolerances)), said
        assert counters["fsdp_compile"]["shared_bodies"] >= case.bodies, (name, dict(counters["fsdp_compile"]))
        if case.shard.get("reshard_after_forward") is False:  # every unit saved for backward as gathered: no slot
            assert fsdp_compile.slab_bytes() == 0, (name, fsdp_compile.slab_bytes())  # may hold one
        assert not counters["fsdp_compile"]["shared_body_output_copied"], name


@pytest.mark.slow
@pytest.mark.parametrize("world_size", CASES, ids=[f"world{w}" for w in CASES])
def test_the_default_configuration_trains_as_the_unsharded_model(world_size: int) -> None:
    run_ranks(_train, world_size)
