"""A model bigger than one device: build it on the meta device, shard it, allocate this rank's shards only, and
initialise them (or load a checkpoint), then train a few steps.

    python examples/big_model.py                              # CPU: spawns 2 gloo ranks, tiny shape (~1 min)
    python examples/big_model.py --checkpoint /tmp/ckpt       # the same, loading /tmp/ckpt if it exists, else saving it
    torchrun --nproc_per_node 8 examples/big_model.py --model 8b   # GPUs: Llama 3.1 8B's shape, bf16 compute

Each rank prints its peak memory during set-up beside the model's full size: the route never holds the whole
model, only this rank's shards and one submodule's full parameters at a time.
"""

from __future__ import annotations

import argparse
import os
import resource

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_compile
from fsdp_compile.testing.dist import gloo_one_worker_thread, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_8B, LLAMA_TINY, Block, Llama, init_weights

MODELS = {"tiny": LLAMA_TINY, "8b": LLAMA_8B}


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(rank: int, world_size: int, model_name: str, checkpoint: str | None, steps: int, compiler: str) -> None:
    cfg = MODELS[model_name]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    before = _peak_bytes(device)

    with torch.device("meta"):
        model = Llama(cfg)  # nothing allocated
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16) if device.type == "cuda" else None  # fp32 shards
    fsdp_compile.shard(model, units=[Block], mp=mp)  # plans the units; the shards stay on meta
    model.to_empty(device=device)  # this rank's shards and the buffers
    if checkpoint and os.path.exists(checkpoint):
        state_dict = model.state_dict()  # DCP's ShardedTensors: each rank reads its own slices
        dcp.load(state_dict, checkpoint_id=checkpoint)
        model.load_state_dict(state_dict)
        init_weights(model)  # the root's rotary tables: non-persistent buffers, in no checkpoint
        source = f"loaded from {checkpoint}"
    else:
        torch.manual_seed(0)  # the same on every rank: each keeps its part of the same initialisation
        fsdp_compile.init_parameters(model, init_weights)
        source = "initialised by init_parameters"
    full_bytes = sum(u.layout.padded_numel * u.flat.element_size() for u in fsdp_compile.sharded_units(model))
    print(f"rank {rank}: {source}; set-up peak {(_peak_bytes(device) - before) / 2**30:.2f} GiB beyond the start "
          f"for a model of {full_bytes / 2**30:.2f} GiB ({fsdp_compile.describe(model).num_local_parameters:,} "
          "parameters on this rank)", flush=True)
    if checkpoint and not os.path.exists(checkpoint):
        dcp.save(model.state_dict(), checkpoint_id=checkpoint)

    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
    parser.add_argument("--checkpoint", help="a DCP checkpoint folder: loaded if it exists, else written after init")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            gloo_one_worker_thread()
        dist.init_process_group("nccl" if use_cuda else "gloo")
        main(dist.get_rank(), dist.get_world_size(), args.model, args.checkpoint, args.steps, args.compiler)
        dist.destroy_process_group()
    else:
        spawn_ranks(main, 2, args.model, args.checkpoint, args.steps, args.compiler)
