"""Fine-tuning: frozen units, a frozen embedding, peft's LoRA adapters and mixed dtypes in one unit, on real ranks
against the unsharded reference (layer 3) and in the graphs (layer 1): only trainable parameters take part in the
gradient reduction, and frozen ones stay bitwise as they were."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.debug import capture_graphs
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.reference import CausalLMLoss, assert_bitwise, full_grads, micro_batch_step, rel_error

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
VOCAB = 64
LAYERS = 4
STEPS = 2
RS, A2A = torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default
AG = (torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops.fsdp_compile.all_gather_into_slot.default)

# rel. error of (loss, trainable gradients, parameters after the steps), the worst tensor. float64: only the
# reduction order differs, and Hugging Face's RMSNorm computes in float32 (the reference averages the ranks'
# gradients as the sharded model does: micro_batch_step). bf16 base with float32 adapters: the base's bf16 matmuls
# are the same ops on both sides under aot_eager; Inductor fuses bf16 ops and keeps float32 intermediates where
# eager rounds to bf16 (resolution 2**-8 = 3.9e-3), so gradients differ at that level and AdamW's normalized update
# of an element whose gradient is within that noise can move differently: the tolerances of test_parity's bf16 case.
TOLERANCES = {
    (torch.float64, "aot_eager"): (1e-10, 1e-9, 1e-10),
    (torch.float64, "inductor"): (1e-10, 1e-9, 1e-10),
    (torch.bfloat16, "aot_eager"): (1e-6, 1e-6, 1e-6),
    (torch.bfloat16, "inductor"): (1e-3, 5e-2, 3e-2),
}


def _llama(dtype: torch.dtype, family: str = "llama") -> nn.Module:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    cfg = config_class(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False, attn_implementation="eager",
    )
    return model_class(cfg).to(dtype)


def _lora(lm: nn.Module) -> nn.Module:
    """peft's LoRA as its docs set it up (r=4 on the q and v projections); on a bf16 model, peft's default
    (``autocast_adapter_dtype=True``) makes the adapters float32: two dtypes in every decoder layer."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(lm, config)
    for name, param in model.named_parameters():  # peft's B starts at zero: give the adapters a gradient to check
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    return model


def _first_half_frozen() -> nn.Module:
    lm = _llama(torch.float64)
    for layer in lm.model.layers[: LAYERS // 2]:
        layer.requires_grad_(False)
    return lm


def _frozen_embedding() -> nn.Module:
    lm = _llama(torch.float64)
    lm.model.embed_tokens.requires_grad_(False)
    return lm


CASES: dict[str, tuple[Callable[[], nn.Module], torch.dtype]] = {
    "first_half_frozen": (_first_half_frozen, torch.float64),
    "frozen_embedding": (_frozen_embedding, torch.float64),
    "lora_llama": (lambda: _lora(_llama(torch.float64)), torch.float64),
    "lora_qwen2": (lambda: _lora(_llama(torch.float64, "qwen2")), torch.float64),
    "lora_bf16_base_fp32_adapters": (lambda: _lora(_llama(torch.bfloat16)), torch.bfloat16),
}


def _decoder_layers(fqn: str, module: nn.Module) -> bool:
    return type(module).__name__.endswith("DecoderLayer")


def _trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _finetune(rank: int, world_size: int, compiler: str, names: list[str]) -> None:
    for name in names:
        build, dtype = CASES[name]
        torch.manual_seed(0)
        ref = CausalLMLoss(build())
        frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
        model = fsdp_compile.shard(copy.deepcopy(ref), units=_decoder_layers)
        run = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler), fullgraph=True)
        opt = torch.optim.AdamW(_trainable(model).values(), lr=1e-2)
        ref_opt = torch.optim.AdamW(_trainable(ref).values(), lr=1e-2)
        loss_tol, grad_tol, param_tol = TOLERANCES[(dtype, compiler)]
        for step in range(STEPS):
            tokens = torch.randint(0, VOCAB, (2 * world_size, 9), generator=torch.Generator().manual_seed(step))
            local = tokens[2 * rank : 2 * rank + 2]
            loss = run(local[:, :-1], local[:, 1:])
            loss.backward()
            ref_loss = micro_batch_step(ref, tokens, world_size)
            losses = [torch.zeros((), dtype=loss.dtype) for _ in range(world_size)]
            dist.all_gather(losses, loss.detach())
            assert rel_error(torch.stack(losses).mean(), ref_loss) <= loss_tol, (name, step)
            grads = full_grads(model)
            for n, p in ref.named_parameters():
                if p.requires_grad:
                    assert rel_error(grads[n], p.grad) <= grad_tol, (name, step, n, rel_error(grads[n], p.grad))
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad), name
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        trained = fsdp_compile.full_state_dict(model)
        for n, want in ref.state_dict().items():
            if n in frozen:
                assert_bitwise(trained[n], frozen[n], f"{name}: frozen {n}")
            else:
                assert rel_error(trained[n], want) <= param_tol, (name, n, rel_error(trained[n], want))
        if rank == 0:
            print(f"{name} {compiler} world {world_size}: loss {loss.item():.6f}, {len(frozen)} frozen bitwise")


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_finetuning_matches_the_unsharded_model(world_size: int, compiler: str) -> None:
    """Each case trains two AdamW steps, sharded over the decoder layers, as the unsharded model does; frozen
    parameters are bitwise as they were and get no gradient."""
    run_ranks(_finetune, world_size, compiler, list(CASES))
