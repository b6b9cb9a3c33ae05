"""A model bigger than one device: build it on the meta device, shard it, allocate this rank's shards only, and
initialise them (or load a safetensors directory), then train a few steps.

    python examples/big_model.py                              # CPU: spawns 2 gloo ranks, tiny shape (~1 min)
    python examples/big_model.py --checkpoint /tmp/ckpt       # the same, loading /tmp/ckpt if it exists, else saving it
    torchrun --nproc_per_node 8 examples/big_model.py --model 8b   # GPUs: Llama 3.1 8B's shape, bf16 compute
    python examples/big_model.py --route build-then-shard     # for comparison: the whole model first, then shard()
    torchrun --nproc_per_node 1 examples/big_model.py --model 8b --optimizer sgd   # one GPU: no optimizer state

Each rank prints its peak memory during set-up beside the model's full size: the meta route never holds the
whole model, only this rank's shards and one submodule's full parameters at a time.
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader

import fsdp_compile
from fsdp_compile.testing.dist import gloo_one_worker_thread, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_8B, LLAMA_TINY, Block, Llama, LlamaConfig, init_weights

MODELS = {"tiny": LLAMA_TINY, "8b": LLAMA_8B}


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _on_meta(cfg: LlamaConfig, device: torch.device, mp: fsdp_compile.MixedPrecision | None,
             checkpoint: str | None) -> tuple[Llama, str]:
    """The meta route: shards allocated, then loaded from ``checkpoint`` (a safetensors folder) or initialised."""
    with torch.device("meta"):
        model = Llama(cfg)  # nothing allocated
    fsdp_compile.shard(model, units=[Block], mp=mp)  # plans the units; the shards stay on meta
    model.to_empty(device=device)  # this rank's shards and the buffers
    if checkpoint:
        reader = HuggingFaceStorageReader(checkpoint)
        saved = reader.read_metadata().state_dict_metadata
        state_dict = {k: v for k, v in model.state_dict().items() if k in saved}  # a tied copy is saved once
        dcp.load(state_dict, storage_reader=reader)  # DCP's ShardedTensors: each rank reads its own slices
        model.load_state_dict(state_dict)
        init_weights(model)  # the root's rotary tables: non-persistent buffers, in no checkpoint
        return model, f"loaded from {checkpoint}"
    torch.manual_seed(0)  # the same on every rank: each keeps its part of the same initialisation
    fsdp_compile.init_parameters(model, init_weights)
    return model, "initialised by init_parameters"


def _build_then_shard(cfg: LlamaConfig, device: torch.device,
                      mp: fsdp_compile.MixedPrecision | None) -> tuple[Llama, str]:
    """What shard() needed before the meta route: the whole model on every rank, then sharded."""
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    fsdp_compile.shard(model, units=[Block], mp=mp)
    return model, "built whole, then sharded"


def main(rank: int, world_size: int, model_name: str, checkpoint: str | None, steps: int, compiler: str,
         route: str, optimizer_name: str) -> None:
    cfg = MODELS[model_name]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    before = _peak_bytes(device)

    load = [bool(checkpoint) and os.path.exists(checkpoint)]  # rank 0 decides: its save creates the folder
    dist.broadcast_object_list(load, src=0)
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16) if device.type == "cuda" else None  # fp32 shards
    if route == "build-then-shard":
        model, source = _build_then_shard(cfg, device, mp)
    else:
        model, source = _on_meta(cfg, device, mp, checkpoint if load[0] else None)
    full_bytes = sum(u.layout.padded_numel * u.flat.element_size() for u in fsdp_compile.sharded_units(model))
    print(f"rank {rank}: {source}; set-up peak {(_peak_bytes(device) - before) / 2**30:.2f} GiB beyond the start "
          f"for a model of {full_bytes / 2**30:.2f} GiB ({fsdp_compile.describe(model).num_local_parameters:,} "
          "parameters on this rank)", flush=True)
    if checkpoint and not load[0]:
        fsdp_compile.save_safetensors(model, checkpoint)  # rank 0 writes, one unit at a time

    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler))
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if optimizer_name == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=1e-3))
    for step in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, min(cfg.max_seq_len, 128) + 1),
                               generator=torch.Generator().manual_seed(step * world_size + rank)).to(device)
        loss = compiled(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--checkpoint", help="a safetensors folder: loaded if it exists, else written after init")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--route", choices=("meta", "build-then-shard"), default="meta")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw",
                        help="sgd: no optimizer state (the 8b shape on one GPU: fp32 weights, gradients and AdamW's "
                        "two states would take 140 GB)")
    args = parser.parse_args()
    options = (args.model, args.checkpoint, args.steps, args.compiler, args.route, args.optimizer)
    if "RANK" in os.environ:  # torchrun
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            gloo_one_worker_thread()
        dist.init_process_group("nccl" if use_cuda else "gloo")
        main(dist.get_rank(), dist.get_world_size(), *options)
        dist.destroy_process_group()
    else:
        spawn_ranks(main, 2, *options)
