"""Train a small Llama-style model with fsdp_compile, and check it against the unsharded model.

    python examples/train.py                          # CPU: spawns 2 gloo ranks by itself (~1 min)
    torchrun --nproc_per_node 2 examples/train.py     # GPUs: NCCL, bf16 params, fp32 gradient sums
    torchrun --nproc_per_node 2 examples/train.py --cudagraphs --all-gather copy_engine --grad-reduce copy_engine
    python examples/train.py --replicas 2             # HSDP: 4 CPU ranks, sharded over pairs, 2 replicas
    torchrun --nproc_per_node 4 examples/train.py --replicas 2   # HSDP 2 x 2 on 4 GPUs

The data are counting sequences (each token is the previous one plus one, from a random start): the loss falls.
Expected output on CPU (torch 2.13; the last digits may differ on another CPU):

    rank 0: 5 units, 18576 of 37152 parameters on this rank
    step 0 loss 4.15...
    ...
    step 9 loss 2.3...
    parity vs unsharded single-process model: max rel. param error ...e-06 (tolerance 1e-05): OK
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compile
from fsdp_compile.testing.dist import gloo_one_worker_thread, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama
from fsdp_compile.testing.reference import reference_step, rel_error

BATCH_PER_RANK, SEQ, LR = 4, 16, 1e-2


def train(rank: int, world_size: int, steps: int, options: dict[str, object], replicas: int = 1) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # Mixed precision on GPUs: gather and compute in bf16, reduce gradients in fp32, keep fp32 shards.
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tolerance = 3e-2 if param_dtype == torch.bfloat16 else 1e-5

    torch.manual_seed(0)  # same initial weights on every rank
    model = Llama(LLAMA_TINY).to(device)
    reference = copy.deepcopy(model)  # unsharded, trained on the global batch for the parity line

    # HSDP with replicas > 1: a (replicate, shard) mesh, as FSDP2's; gradients are averaged over all ranks.
    shape = (replicas, world_size // replicas)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard")) if replicas > 1 else None
    mp = fsdp_compile.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32)
    fsdp_compile.shard(model, units=[Block], mesh=mesh, mp=mp)
    compiled = torch.compile(model, backend=fsdp_compile.backend(**options))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    if rank == 0:
        local = sum(p.numel() for p in model.parameters())
        total = sum(p.numel() for p in reference.parameters())
        units = len(fsdp_compile.sharded_units(model))
        hsdp = f" (HSDP: {replicas} replicas)" if replicas > 1 else ""
        print(f"rank 0: {units} units, {local} of {total} parameters on this rank{hsdp}")

    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        start = torch.randint(0, LLAMA_TINY.vocab_size, (world_size * BATCH_PER_RANK, 1), generator=gen)
        tokens = ((start + torch.arange(SEQ + 1)) % LLAMA_TINY.vocab_size).to(device)  # counting sequences
        mine = tokens.chunk(world_size)[rank]
        if options.get("cudagraphs"):
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten
        loss = compiled(mine[:, :-1], mine[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        reference_step(reference, tokens, param_dtype, world_size)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        global_loss = loss.detach()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {global_loss.item():.5f}")

    full = fsdp_compile.full_state_dict(model)  # a collective: every rank calls it
    error = max(rel_error(full[name], value) for name, value in reference.state_dict().items())
    if rank == 0:
        verdict = "OK" if error <= tolerance else "MISMATCH"
        print(f"parity vs unsharded single-process model: max rel. param error {error:.1e} "
              f"(tolerance {tolerance:.0e}): {verdict}")
    if error > tolerance:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description="Train a small Llama-style model with fsdp_compile.")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cudagraphs", action="store_true", help="Inductor's CUDA graphs (GPUs)")
    parser.add_argument("--all-gather", choices=["nccl", "copy_engine", "auto"], default="auto",
                        help="the all-gathers' route")
    parser.add_argument("--grad-reduce", choices=["nccl", "copy_engine", "auto"], default="auto",
                        help="the gradient exchanges' route")
    parser.add_argument("--replicas", type=int, default=1, help="HSDP: shard over world size / replicas ranks")
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="inductor",
                        help="what compiles the graphs after fsdp_compile's passes (aot_eager: quick, for tests)")
    args = parser.parse_args()
    options = {"cudagraphs": args.cudagraphs, "all_gather": args.all_gather, "grad_reduce": args.grad_reduce,
               "compiler": args.compiler}
    world_size = int(os.environ.get("WORLD_SIZE", 2 * args.replicas))
    if args.replicas < 1 or world_size % args.replicas:
        parser.error(f"--replicas must divide the number of ranks ({world_size}), got {args.replicas}")
    if "RANK" not in os.environ:  # plain `python examples/train.py`: spawn 2 CPU ranks per replica
        spawn_ranks(train, world_size, args.steps, options, args.replicas)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # torch's gloo corrupts its heap, rarely, with its default two worker threads: use one
        gloo_one_worker_thread()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        train(dist.get_rank(), dist.get_world_size(), args.steps, options, args.replicas)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
