"""Tiny Hugging Face causal LMs for the tests (needs ``transformers``; LoRA needs ``peft``), and their training side by
side with the unsharded model: the fine-tuning and gradient-checkpointing tests share them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile._state_dict import full_state_dict
from fsdp_compile.testing.reference import full_grads, micro_batch_step, rel_error

__all__ = ["VOCAB", "add_lora", "is_decoder_layer", "tiny_causal_lm", "train_side_by_side", "trainable"]

VOCAB = 64


def tiny_causal_lm(family: str = "llama", dtype: torch.dtype = torch.float64, *, hidden: int = 16,
                   layers: int = 2) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Phi3ForCausalLM`` or ``MixtralForCausalLM``
    (``family``): 2 heads sharing one key-value head, eager attention, untied embeddings; Mixtral with 8 experts, 2 a
    token (a loop over the experts a batch hits, which breaks the graph: the experts hit differ from rank to rank),
    run one by one (transformers' grouped matmul takes no float64). Seed before calling."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[family]
    experts = {"num_local_experts": 8, "num_experts_per_tok": 2, "experts_implementation": "eager"}
    cfg = config_class(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=5 * hidden // 2, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
        attn_implementation="eager", use_cache=False, pad_token_id=None, **(experts if family == "mixtral" else {}),
    )
    return model_class(cfg).to(dtype)


def add_lora(lm: nn.Module, adapter_dtype: torch.dtype | None = None) -> nn.Module:
    """peft's LoRA as its docs set it up (r=4 on the q and v projections); on a bf16 model, peft's default
    (``autocast_adapter_dtype=True``) makes the adapters float32: two dtypes in every decoder layer; ``adapter_dtype``:
    the adapters in that dtype whatever the base's (peft runs each adapter in its own dtype, its output added to the
    base's). peft's B starts at zero: here it is drawn, so that the adapters have a gradient to check."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(lm, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.02)
    if adapter_dtype is not None:
        for name, module in model.named_modules():
            if name.endswith(("lora_A.default", "lora_B.default")):
                module.to(adapter_dtype)
    return model


def is_decoder_layer(fqn: str, module: nn.Module) -> bool:
    """The ``units=`` predicate: Hugging Face's decoder layers."""
    return type(module).__name__.endswith("DecoderLayer")


def trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def train_side_by_side(
    run: Callable[..., torch.Tensor], run_ref: Callable[..., torch.Tensor], lm: nn.Module, ref_lm: nn.Module, *,
    steps: int, rank: int, world_size: int, after_backward: Callable[[int], None] = lambda step: None,
    batch: int = 2, seq: int = 8, vocab: int = VOCAB, worst_of: dict[str, str] | None = None, accumulate: int = 1,
) -> dict[str, float]:
    """``steps`` AdamW steps (lr 1e-2) of the sharded model (``run(inputs, targets) -> loss``, its model ``lm``) on this
    rank's micro-batch (``batch`` sequences of ``seq`` tokens below ``vocab``), and of the unsharded one (``run_ref``,
    ``ref_lm``) on every rank's micro-batch, gradients averaged (``micro_batch_step``); ``accumulate``: micro-batches a
    step, their gradients summed (each backward reduced, as FSDP2 does by default). Returns the worst relative errors of
    the mean loss, the trainable gradients and, after the steps, the parameters; ``worst_of``, if given, receives the
    name of the worst gradient and parameter. ``after_backward(step)`` runs after the sharded backward. Frozen
    parameters must get no gradient."""
    opt = torch.optim.AdamW(trainable(lm).values(), lr=1e-2)
    ref_opt = torch.optim.AdamW(trainable(ref_lm).values(), lr=1e-2)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    names = worst_of if worst_of is not None else {}
    for step in range(steps):
        for micro in range(accumulate):
            seed = torch.Generator().manual_seed(step * accumulate + micro)
            tokens = torch.randint(0, vocab, (batch * world_size, seq + 1), generator=seed)
            local = tokens[batch * rank : batch * (rank + 1)]
            loss = run(local[:, :-1], local[:, 1:])
            loss.backward()
            after_backward(step)
            ref_loss = micro_batch_step(run_ref, tokens, world_size)
            losses = [torch.zeros((), dtype=loss.dtype) for _ in range(world_size)]
            dist.all_gather(losses, loss.detach())
            worst["loss"] = max(worst["loss"], rel_error(torch.stack(losses).mean(), ref_loss))
        grads = full_grads(lm)
        for name, param in trainable(ref_lm).items():
            _note_worst(worst, names, "grad", name, rel_error(grads[name], param.grad))
        assert all(p.grad is None for p in lm.parameters() if not p.requires_grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    trained = full_state_dict(lm)
    for name, want in ref_lm.state_dict().items():
        _note_worst(worst, names, "param", name, rel_error(trained[name], want))
    return worst


def _note_worst(worst: dict[str, float], names: dict[str, str], kind: str, name: str, error: float) -> None:
    if error >= worst[kind]:
        worst[kind], names[kind] = error, name
