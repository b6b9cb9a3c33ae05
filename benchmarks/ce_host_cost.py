"""Host time of one copy-engine collective, and of its parts: what a step without CUDA graphs pays per
all-gather and gradient exchange on the copy-engine routes (the GPU barely works: 1 MiB parts).

    torchrun --nproc_per_node 2 benchmarks/ce_host_cost.py [--json results/ce_host_cost.json]

Rows: the whole collectives as a compiled graph calls them (the ops' functions, ``extern_kernels.fsdp_compile_*``,
then ``wait_copy_engine``'s) and as ops (``torch.ops.fsdp_compile.*``: through the dispatcher), NCCL's functional
all-gather for reference, each piece of the copy-engine ops' bodies alone (the rows run on the side stream
include switching to it: the ``with torch.cuda.stream(side)`` row), and the ops that write gradients in place
(``passes/write_gradients_in_place``, ~150 calls a step), op and function. Then a profiler table of one op's
calls: which CUDA runtime calls the host time goes to.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._inductor.select_algorithm import extern_kernels
from torch.profiler import ProfilerActivity, profile

from fsdp_compile.runtime import slots as _slots
from fsdp_compile._internals import cuda_driver, symm_mem
from fsdp_compile.runtime import streams as _streams

PART_NUMEL = 512 * 1024  # bf16: 1 MiB per rank


def _host_us(fn: Callable[[], object], reps: int) -> float:
    """Mean host time of ``fn`` in µs (the GPU kept from falling behind by a sync every 25 calls, not timed)."""
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for start in range(0, reps, 25):
        begin = time.perf_counter()
        for _ in range(min(25, reps - start)):
            fn()
        total += time.perf_counter() - begin
        torch.cuda.synchronize()
        dist.barrier()
    return total / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ce_host_cost.py times copy-engine collectives between GPUs: run it under torchrun on GPUs "
                         "with peer access (NVLink), e.g. torchrun --nproc_per_node 2 benchmarks/ce_host_cost.py")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    group = dist.group.WORLD.group_name
    device = torch.device("cuda", torch.cuda.current_device())
    numel = PART_NUMEL * world
    slab = _slots.reserve_slab(group, device, 2 * numel * 2, symmetric=True, keep_old=False)
    out = slab.memory[: numel * 2].view(torch.bfloat16)
    received = out[: numel - PART_NUMEL]  # an exchange's slot receives the peers' parts
    shard = torch.randn(PART_NUMEL, device=device, dtype=torch.bfloat16)
    gradient = torch.randn(numel, device=device, dtype=torch.bfloat16)
    ops, c10d = torch.ops.fsdp_compile, torch.ops._c10d_functional
    side, compute = symm_mem.backend_stream(), torch.cuda.current_stream()
    weight_grad = torch.empty(2, 64, 64, device=device, dtype=torch.bfloat16)[1]  # a slice of a flat gradient
    activation, grad_out = torch.randn(2, 64, 64, device=device, dtype=torch.bfloat16).unbind()
    pulls = slab.pulls(out, world)[1]
    pairs = [(out.view(world, -1)[peer], slab.handle.get_buffer(peer, (PART_NUMEL,), out.dtype, peer * PART_NUMEL))
             for peer in _slots.ring_order(rank, world)]  # the same copies as tensors

    functions = {name: getattr(extern_kernels, f"fsdp_compile_{name}") for name in (
        "all_gather_into_slot_copy_engine", "exchange_into_slot_copy_engine", "wait_copy_engine", "mm_into",
        "copy_into")}  # the ops' functions, as Inductor's code calls them

    def gather(call: dict[str, Callable[..., None]] = functions) -> None:
        call["all_gather_into_slot_copy_engine"](shard, world, group, out)
        call["wait_copy_engine"](out, None)

    def exchange(call: dict[str, Callable[..., None]] = functions) -> None:
        call["exchange_into_slot_copy_engine"](gradient, world, group, received)
        call["wait_copy_engine"](received, gradient)

    as_ops = {name: getattr(ops, name).default for name in functions}  # as Inductor's code called them before

    def nccl() -> None:
        c10d.wait_tensor(c10d.all_gather_into_tensor(shard, world, group))

    def barrier_kernel() -> None:
        with torch.cuda.stream(side):
            slab.handle.barrier()

    def barrier() -> None:
        slab.barrier(side)

    def driver_copies() -> None:
        for dst, src, nbytes in pulls:
            cuda_driver.copy(side.cuda_stream, dst, src, nbytes)
        compute.wait_stream(side)

    def torch_copies() -> None:
        with torch.cuda.stream(side):
            _streams.copy_in_turn(pairs)
        compute.wait_stream(side)

    def register() -> None:
        with torch.cuda.stream(side):
            symm_mem.register_work(out)
        c10d.wait_tensor(out)

    def fork_and_wait() -> None:
        _streams.record_done(out, _streams.fork_side(device.index))
        functions["wait_copy_engine"](out, None)

    def side_stream() -> None:
        with _streams.on_side_stream():
            pass

    rows = {
        "all_gather_into_slot_copy_engine + wait": gather,
        "exchange_into_slot_copy_engine + wait": exchange,
        "the same all-gather + wait, as ops (the dispatcher)": lambda: gather(as_ops),
        "the same exchange + wait, as ops": lambda: exchange(as_ops),
        "NCCL all_gather_into_tensor + wait": nccl,
        "barrier kernel (side stream)": barrier_kernel,
        "Slab.barrier (side stream; stream memory operations if the driver has them)": barrier,
        f"{world - 1} peer copies, cuda_driver.copy (side stream) + join": driver_copies,
        f"{world - 1} peer copies, Tensor.copy_ (side stream: copy_in_turn) + join": torch_copies,
        "register_work + wait_tensor (the workspace route's wait)": register,
        "fork_side, record_done + wait_copy_engine (the slots' fork and wait)": fork_and_wait,
        "on_side_stream(): pass": side_stream,
        "side.wait_stream(compute)": lambda: side.wait_stream(compute),
        "with torch.cuda.stream(side): pass": _stream_context(side),
        "local copy_ (1 MiB)": lambda: out[:PART_NUMEL].copy_(shard),
        "mm_into (64 x 64)": lambda: functions["mm_into"](grad_out, activation, out=weight_grad),
        "mm_into, as an op": lambda: as_ops["mm_into"](grad_out, activation, out=weight_grad),
        "torch.mm(out=)": lambda: torch.mm(grad_out, activation, out=weight_grad),
        "copy_into (64 x 64)": lambda: functions["copy_into"](grad_out, out=weight_grad),
        "copy_into, as an op": lambda: as_ops["copy_into"](grad_out, out=weight_grad),
    }
    results = {name: _host_us(fn, args.reps) for name, fn in rows.items()}
    gather()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        for _ in range(20):
            gather()
        torch.cuda.synchronize()
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"{world}x {name}, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}; host µs per call, "
              f"mean of {args.reps}")
        print("| call | host µs |\n|---|---|")
        for row, us in results.items():
            print(f"| {row} | {us:.1f} |")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"card": name, "world": world, "torch": torch.__version__, "host_us": results}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _stream_context(stream: torch.cuda.Stream) -> Callable[[], None]:
    def enter_and_leave() -> None:
        with torch.cuda.stream(stream):
            pass

    return enter_and_leave


if __name__ == "__main__":
    main()
