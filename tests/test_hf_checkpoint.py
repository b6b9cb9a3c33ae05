"""Hugging Face checkpoints, shard by shard: a safetensors directory loaded into a model built on meta and sharded
(DCP's ``HuggingFaceStorageReader``, each rank reading its slices only), trained, and saved back with
``save_safetensors`` where ``from_pretrained`` reads it."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.reference import CausalLMLoss, assert_bitwise, micro_batch_step, rel_error

transformers = pytest.importorskip("transformers")
HuggingFaceStorageReader = pytest.importorskip("torch.distributed.checkpoint").HuggingFaceStorageReader
VOCAB = 64


def _config(tied: bool) -> "transformers.LlamaConfig":
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied, attn_implementation="sdpa",
    )


class CountingReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` that counts the bytes it reads from the files."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.bytes_read = 0

    def _process_read_request(self, f, req, planner) -> None:  # type: ignore[no-untyped-def]
        super()._process_read_request(f, req, planner)
        self.bytes_read += math.prod(req.lengths) * planner.resolve_tensor(req).element_size()


def _checkpoint(tied: bool, path: pathlib.Path) -> pathlib.Path:
    """``save_pretrained`` (safetensors) of a tiny float64 ``LlamaForCausalLM``."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config(tied)).to(torch.float64).save_pretrained(path)
    return path


def _round_trip(rank: int, world_size: int, path: pathlib.Path, tied: bool, out: pathlib.Path) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    want = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(_config(tied), dtype=torch.float64)
    fsdp_compile.shard(lm, units=[LlamaDecoderLayer])
    lm.to_empty(device="cpu")
    fsdp_compile.init_parameters(lm, lm._init_weights)  # the buffers no checkpoint holds (the rotary table)
    reader = CountingReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    state_dict = {key: value for key, value in lm.state_dict().items() if key in saved}  # a tied copy is not saved
    dcp.load(state_dict, storage_reader=reader)
    lm.load_state_dict(state_dict)

    assert_bitwise(fsdp_compile.full_state_dict(lm), want.state_dict())
    assert_bitwise(dict(lm.named_buffers()), dict(want.named_buffers()))
    mine = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert reader.bytes_read == mine, (reader.bytes_read, mine)  # this rank's pieces, nothing else
    everyone = torch.tensor(reader.bytes_read)
    dist.all_reduce(everyone)
    assert everyone.item() == sum(math.prod(md.size) * md.properties.dtype.itemsize for md in saved.values())

    model, ref = CausalLMLoss(lm), CausalLMLoss(want)
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"))
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2 * world_size, 9), generator=torch.Generator().manual_seed(step))
        local = tokens[2 * rank : 2 * rank + 2]
        loss = run(local[:, :-1], local[:, 1:])
        loss.backward()
        ref_loss = micro_batch_step(ref, tokens, world_size)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses = [torch.zeros((), dtype=torch.float64) for _ in range(world_size)]
        dist.all_gather(losses, loss.detach())
        assert rel_error(torch.stack(losses).mean(), ref_loss) < 1e-10, step
    trained = fsdp_compile.full_state_dict(lm)
    for name, value in want.state_dict().items():
        assert rel_error(trained[name], value) < 1e-10, name

    fsdp_compile.save_safetensors(lm, out)
    if rank == 0:
        lm.config.save_pretrained(out)
    dist.barrier()
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float64)
    assert_bitwise(back.state_dict(), trained)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied


@pytest.mark.parametrize("tied, world_size", [(True, 3), (False, 2)], ids=["tied-3", "untied-2"])
def test_a_hugging_face_checkpoint_loads_into_a_model_built_on_meta_trains_and_saves_back(
    tied: bool, world_size: int, tmp_path: pathlib.Path
) -> None:
    """Equal to ``from_pretrained`` bitwise, each rank reading only its slices; three AdamW steps equal to the
    unsharded model's (float64); ``save_safetensors`` gives a directory ``from_pretrained`` loads. Tied embeddings
    on 3 ranks (shards padded), untied on 2."""
    run_ranks(_round_trip, world_size, _checkpoint(tied, tmp_path / "hf"), tied, tmp_path / "saved")
