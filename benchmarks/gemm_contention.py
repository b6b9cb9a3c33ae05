"""The collectives of one 0.95B block on 2 (or 4) GPUs: their time alone, and how much each slows the block's
matmuls running beside it (the SMs NCCL takes). Optionally with SMs reserved for NCCL in the matmuls
(cuBLASLt SM count target, ``torch._C._set_sm_carveout_experimental``).

    torchrun --nproc_per_node 2 benchmarks/gemm_contention.py [--carveout 24]   # or NPROC=4 ... CONTENTION=1 gpu.sh

Collectives: all-gather bf16 (forward/backward), reduce-scatter fp32 (FSDP2's gradient reduction with an
fp32 reduce dtype) and all-to-all bf16 (the same reduction done as an exchange of bf16 gradients followed
by a local fp32 sum); all-gathers by copy engine: fsdp_compile's own op
(``fsdp_compile::all_gather_copy_engine``, what ``backend(all_gather="copy_engine")`` runs) and, for
reference, torch's ``_low_contention_all_gather`` from a symmetric input and from a plain one; and into a
slot of a symmetric slab, as the memory plan runs them (the default's copy-engine route): the all-gather that
pulls the peers' parts (``all_gather_into_slot_copy_engine`` + its wait), the same all-gather made of pushes
(each rank writes its part into every peer's slot: a prototype here, to learn whether NVLink writes by copy
engine beat reads) and the gradient exchange (``exchange_into_slot_copy_engine``, pushes); over more than 2
ranks, prototypes of both with the peers in rank order instead of ring order.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

SHAPES = {  # (M, K, N) of the block's matmuls at 4096 tokens/GPU
    "4096x2048x2048": (4096, 2048, 2048),
    "4096x2048x5632": (4096, 2048, 5632),
    "4096x5632x2048": (4096, 5632, 2048),
    "2048x4096x5632": (2048, 4096, 5632),
}
BLOCK_NUMEL = 51_380_224


def _time(fn: Callable[[], object], reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _beside(matmul: Callable[[], object], count: int, collective: Callable[[], object], comm: torch.cuda.Stream,
            reps: int) -> float:
    """Mean time of one matmul (compute-stream events) while ``collective`` runs on ``comm``."""
    events = []
    for _ in range(reps + 1):
        comm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comm):
            collective()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            matmul()
        end.record()
        torch.cuda.current_stream().wait_stream(comm)
        events.append((start, end))
    torch.cuda.synchronize()
    return sum(s.elapsed_time(e) for s, e in events[1:]) / reps / count


def _copy_engine_all_gathers(shard: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Copy-engine all-gathers of ``shard``: fsdp_compile's own op (what ``all_gather="copy_engine"`` lowers
    to) and, for reference, torch's ``_low_contention_all_gather`` from a symmetric input and from a plain
    one (empty where this torch lacks them)."""
    from fsdp_compile.runtime.copy_engine import all_gather_copy_engine, reserve_workspace

    group, world = dist.group.WORLD.group_name, dist.get_world_size()
    reserve_workspace(group, shard.nbytes)
    wait = torch.ops._c10d_functional.wait_tensor
    ours = {"all-gather bf16, fsdp_compile copy engine": lambda: wait(all_gather_copy_engine(shard, world, group, shard.nbytes))}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        gather = torch.ops.symm_mem._low_contention_all_gather
    except (ImportError, AttributeError):
        return ours
    symmetric = symm_mem.empty(shard.shape, dtype=shard.dtype, device=shard.device).copy_(shard)
    symm_mem.rendezvous(symmetric, group)
    return {
        **ours,
        "all-gather bf16, torch copy engine (reference)": lambda: wait(gather(symmetric, group)),
        "all-gather bf16, torch copy engine via workspace (reference)": lambda: wait(gather(shard, group)),
    }


def _into_slot(shard: torch.Tensor, full: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The copy-engine collectives into slots of a symmetric slab, each waited for: the all-gather of ``shard``
    by pulls and the exchange of ``full`` by pushes (the default's ops: the peers in ring order, one copy after
    another), and prototypes: the all-gather made of pushes, and over more than 2 ranks both default ops with the
    peers in rank order (every rank starts with rank 0; prototypes with a stream per peer: commit a083f49)."""
    from fsdp_compile.runtime.copy_engine import (
        all_gather_into_slot_copy_engine,
        copy_between_slabs,
        exchange_into_slot_copy_engine,
    )
    from fsdp_compile.runtime.slots import reserve_slab, ring_order
    from fsdp_compile.runtime.streams import wait_copy_engine

    group, world, rank = dist.group.WORLD.group_name, dist.get_world_size(), dist.get_rank()
    part, gathered_bytes = shard.numel(), shard.nbytes * world
    slab = reserve_slab(group, shard.device, 2 * gathered_bytes, symmetric=True, keep_old=False)
    gathered = slab.memory[:gathered_bytes].view(shard.dtype)
    received = slab.memory[gathered_bytes:2 * gathered_bytes].view(shard.dtype)[: part * (world - 1)]
    mine = gathered.view(world, part)[rank]
    sent = full.view(world, -1)

    def theirs(peer: int, offset: int) -> torch.Tensor:  # a part at ``offset`` elements in the peer's slab
        return slab.handle.get_buffer(peer, (part,), shard.dtype, offset)

    def prototype(local: torch.Tensor | None, out: torch.Tensor, pairs: list) -> Callable[[], None]:
        copies = [(dst.data_ptr(), src.data_ptr(), src.nbytes) for dst, src in pairs]

        def run() -> None:  # the default's ops with other copies (``pairs``: destination, source)
            if local is not None:
                mine.copy_(local)
            copy_between_slabs(slab, copies, out)
            wait_copy_engine(out, local if local is not None else full)
        return run

    def pulls() -> None:
        all_gather_into_slot_copy_engine(shard, world, group, out=gathered)
        wait_copy_engine(gathered, None)

    def exchange() -> None:
        exchange_into_slot_copy_engine(full, world, group, out=received)
        wait_copy_engine(received, full)

    ring, rank_order = ring_order(rank, world), sorted(set(range(world)) - {rank})
    variants = {
        "all-gather bf16, copy engine into a slot (pulls: the default's)": pulls,
        "exchange bf16, copy engine into a slot (pushes: the default's)": exchange,
        "all-gather bf16, copy engine into a slot (pushes: prototype)": prototype(
            shard, gathered, [(theirs(p, rank * part), mine) for p in ring]),
    }
    if world > 2:  # 2 ranks: one peer, no order
        variants |= {
            "all-gather by pulls, rank order (prototype)": prototype(
                shard, gathered, [(gathered.view(world, part)[p], theirs(p, p * part)) for p in rank_order]),
            "exchange by pushes, rank order (prototype)": prototype(
                None, received, [(theirs(p, (rank - (rank > p)) * part), sent[p]) for p in rank_order]),
        }
    return variants


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--carveout", type=int, nargs="*", default=[])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    n = BLOCK_NUMEL // world * world
    shard16 = torch.randn(n // world, device="cuda", dtype=torch.bfloat16)
    full16 = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    full32 = torch.randn(n, device="cuda", dtype=torch.float32)
    shard32 = torch.empty(n // world, device="cuda", dtype=torch.float32)
    out16 = torch.empty(n, device="cuda", dtype=torch.bfloat16)

    def a2a_and_sum() -> None:
        dist.all_to_all_single(out16, full16)
        torch.sum(out16.view(world, -1).float(), 0, out=shard32)

    collectives = {
        "all-gather bf16": lambda: dist.all_gather_into_tensor(out16, shard16),
        "reduce-scatter fp32": lambda: dist.reduce_scatter_tensor(shard32, full32, op=dist.ReduceOp.AVG),
        "all-to-all bf16": lambda: dist.all_to_all_single(out16, full16),
        "all-to-all bf16 + fp32 sum": a2a_and_sum,
        **_copy_engine_all_gathers(shard16),
        **_into_slot(shard16, full16),
    }
    comm = torch.cuda.Stream()
    alone = {name: _time(fn, args.reps) for name, fn in collectives.items()}
    rows = []
    for carveout in [None, *args.carveout]:
        torch.backends.cuda.preferred_blas_library("cublas" if carveout is None else "cublaslt")
        torch._C._set_sm_carveout_experimental(carveout)
        for shape, (m, k, nn) in SHAPES.items():
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, nn, device="cuda", dtype=torch.bfloat16)
            mm_alone = _time(lambda: a @ b, args.reps)
            for name, fn in collectives.items():
                count = max(1, round(alone[name] / mm_alone))
                rows.append((shape, carveout, name, mm_alone, _beside(lambda: a @ b, count, fn, comm, args.reps)))
    torch._C._set_sm_carveout_experimental(None)
    torch.backends.cuda.preferred_blas_library("cublas")
    if rank == 0:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {world} ranks, one block = {n:,} elements")
        for name, ms in alone.items():
            print(f"{name}: {ms:.3f} ms alone")
        print("| matmul | SMs reserved | beside | alone ms | beside ms | slowdown |")
        print("|---|---|---|---|---|---|")
        for shape, carveout, name, mm_alone, together in rows:
            print(f"| {shape} | {carveout or 0} | {name} | {mm_alone:.3f} | {together:.3f} | {together / mm_alone:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
