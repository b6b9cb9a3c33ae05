"""GPU memory NCCL takes outside the caching allocator at the first call of each collective: what a route that
uses NCCL's all-to-all holds on the GPU that ``torch.cuda.max_memory_allocated()`` does not show (the
copy-engine exchange never makes these buffers; its slots are in the memory plan's symmetric slab).

    torchrun --nproc_per_node 2 benchmarks/nccl_buffers.py [--mib 98] [--json results/nccl_buffers_2gpu.json]

Per row, memory outside the allocator (the driver's used memory less what the allocator reserves, after a
synchronize and ``empty_cache``) after the first call of each collective, on a tensor of ``--mib`` MiB of bf16
(default: a block's flat gradient in ``test_gpu_overlap.py``'s model), then after three more of each.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from fsdp_compile.testing.profile import outside_allocator_mib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=98.0)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ or not torch.cuda.is_available():
        parser.error("run it under torchrun on GPUs: torchrun --nproc_per_node 2 benchmarks/nccl_buffers.py")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    numel = int(args.mib * 2**20 / 2) // world * world
    full = torch.ones(numel, dtype=torch.bfloat16, device="cuda")
    part = full[: numel // world].clone()
    collectives = {
        "all_gather": lambda: dist.all_gather_into_tensor(torch.empty_like(full), part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty_like(part), full),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(full), full),
    }
    rows = [("CUDA context", outside_allocator_mib())]
    dist.all_reduce(torch.ones(1, device="cuda"))
    rows.append(("communicator (an all-reduce of 4 B)", outside_allocator_mib()))
    for name, run in collectives.items():
        run()
        rows.append((f"first {name} of {args.mib:g} MiB", outside_allocator_mib()))
    for _ in range(3):
        for run in collectives.values():
            run()
    rows.append(("three more of each", outside_allocator_mib()))
    if dist.get_rank() == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        print(f"{world} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, NCCL {nccl}")
        print("| after | outside the allocator MiB | added MiB |\n|---|---|---|")
        for (name, mib), (_, before) in zip(rows, [("", 0.0), *rows]):
            print(f"| {name} | {mib:.1f} | {mib - before:+.1f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world_size": world, "card": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "nccl": nccl, "mib": args.mib,
                           "rows": [{"after": n, "outside_allocator_mib": m} for n, m in rows]}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
