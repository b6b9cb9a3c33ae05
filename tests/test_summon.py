"""Full parameters outside forward are explicit and collective: ``summon_full_params`` on every rank gives them
(equal to ``full_state_dict``), ``writeback=True`` changes reach training; a read outside it raises at once, on one
rank or all, naming the way to read them, and the job goes on. What Hugging Face calls outside forward works or
fails with that error."""

from __future__ import annotations

import copy
import operator
import time

import pytest
import torch

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import assert_bitwise, reference_step, rel_error

READ_OUTSIDE = r"was read outside the sharded model's forward: .*summon_full_params\(model, writeback=...\)"


def _tokens(step: int, world_size: int) -> torch.Tensor:
    return torch.randint(0, LLAMA_TESTS.vocab_size, (2 * world_size, 9), generator=torch.Generator().manual_seed(step))


def _step(model: torch.nn.Module, ref: torch.nn.Module, step: int, rank: int, world_size: int) -> None:
    """One SGD step of the sharded model on this rank's micro-batch and of the reference on the global batch; then
    their weights agree."""
    tokens = _tokens(step, world_size)
    local = tokens[2 * rank : 2 * rank + 2]
    model(local[:, :-1], local[:, 1:]).backward()
    reference_step(ref, tokens, torch.float64, world_size)
    for module in (model, ref):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        module.zero_grad()
    full, want = fsdp_compile.full_state_dict(model), ref.state_dict()
    assert max(rel_error(full[k], v) for k, v in want.items()) < 1e-10


def _summon(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = Llama(LLAMA_TESTS).double()
    model = fsdp_compile.shard(copy.deepcopy(ref), units=[Block])
    full = fsdp_compile.full_state_dict(model)
    with fsdp_compile.summon_full_params(model):  # every rank: the full weights, read-only
        for name, _ in ref.named_parameters():
            assert_bitwise(operator.attrgetter(name)(model).detach(), full[name], name)
        with pytest.raises(RuntimeError, match=r"in-place write \(mul_\) to norm.weight inside fsdp_compile."
                                               r"summon_full_params\(writeback=False\).*writeback=True"):
            model.norm.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="the sharded model was called inside fsdp_compile.summon_full_params"):
            model(_tokens(0, 1)[:, :-1], _tokens(0, 1)[:, 1:])
    assert_bitwise(fsdp_compile.full_state_dict(model), full)
    # writeback=True: the same change on every rank reaches the shards, and training goes on from it.
    for module, summoned in ((model, fsdp_compile.summon_full_params(model, writeback=True)), (ref, torch.no_grad())):
        with summoned, torch.no_grad():
            module.norm.weight.mul_(2.0)
            module.layers[1].feed_forward.w2.weight.zero_()
    assert_bitwise(fsdp_compile.full_state_dict(model), ref.state_dict())
    _step(model, ref, 0, rank, world_size)
    # A read on rank 0 alone raises at once, and the job goes on.
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tok_embeddings.weight \(tied: output.weight\) " + READ_OUTSIDE):
            print(model.output.weight)
        assert time.monotonic() - start < 1.0
    _step(model, ref, 1, rank, world_size)
    # summon_full_params on rank 0 alone while rank 1 waits in the model's collective: rank 0 raises at once
    # (not after the group's timeout), and the job goes on when rank 0 calls the model too.
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(fsdp_compile.RanksDisagree, match=r"rank 1 waits in collective #\d+ of the group \(in the "
                                                             r"forward of step 3\), which this rank \(0\) has not"):
            with fsdp_compile.summon_full_params(model):
                pass
        assert time.monotonic() - start < 5.0
    _step(model, ref, 2, rank, world_size)


def test_summon_full_params_gives_the_full_weights_and_writes_back_and_a_read_outside_it_raises_at_once() -> None:
    run_ranks(_summon, 2)


def test_what_hugging_face_does_outside_forward_works_or_names_the_way(fake_pg: None, tmp_path) -> None:
    """Hugging Face's helpers on a sharded model outside forward: those that need no full values work (printing the
    model reads its norms' shapes only); those that read or replace full parameters raise the read error (or, for
    save_pretrained, say which state dict to pass); inside summon_full_params, a replaced parameter is refused."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    lm = fsdp_compile.shard(transformers.LlamaForCausalLM(config), units=[LlamaDecoderLayer])
    assert "(norm): FSDPLlamaRMSNorm((32,), eps=1e-06)" in repr(lm)
    assert type(lm.get_input_embeddings()).__name__ == "FSDPEmbedding" and lm.dtype == torch.float32
    assert lm.num_parameters() == sum(p.numel() for p in lm.parameters())  # this rank's: describe() has the model's
    assert lm.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False).shape == (1, 5)  # a forward
    for helper in (lm.tie_weights, lambda: lm.resize_token_embeddings(80), lm.init_weights, lambda: lm.lm_head.weight):
        with pytest.raises(RuntimeError, match=r"model.embed_tokens.weight \(tied: lm_head.weight\) " + READ_OUTSIDE):
            helper()
    with pytest.raises(RuntimeError, match=r"save_pretrained\(\) of a model sharded by fsdp_compile writes full "
                                           r"tensors: pass them, state_dict=fsdp_compile.full_state_dict"):
        lm.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / "model.safetensors").exists()
    lm.save_pretrained(tmp_path / "full", state_dict=fsdp_compile.full_state_dict(lm))
    assert (tmp_path / "full" / "model.safetensors").exists()
    with pytest.raises(RuntimeError, match=r"parameters \['lm_head.weight'\] were replaced inside fsdp_compile."
                                           r"summon_full_params\(\).*nothing was written back"):
        with fsdp_compile.summon_full_params(lm, writeback=True):
            lm.tie_weights()
    assert lm.lm_head._parameters["weight"] is lm.model.embed_tokens._parameters["weight"]  # the piece, back
