"""Run a function on several ranks, one spawned process each: gloo on CPU, or NCCL with one GPU a rank."""

from __future__ import annotations

import datetime
import gc
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_compile._internals import gloo_one_worker_thread

__all__ = ["gloo_one_worker_thread", "hsdp_mesh", "spawn_ranks"]


def hsdp_mesh(shape: tuple[int, int] | None, device_type: str = "cpu") -> DeviceMesh | None:
    """FSDP2's HSDP mesh of ``shape`` (replicas, ranks each unit is sharded over), dimensions named
    ``("replicate", "shard")``, for ``shard(mesh=...)``; None for no shape. A collective: every rank calls it."""
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")) if shape else None

_HOST = "127.0.0.1"
_STORE_TIMEOUT = datetime.timedelta(minutes=10)


def _run(rank: int, world_size: int, port: int, backend: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # torch's gloo races with its default two worker threads (heap corruption): see the function
        gloo_one_worker_thread()
        # One intra-op thread per rank: the ranks share the machine's cores, and with torch's default (a
        # thread per core) each rank's OpenMP threads spin, waiting for cores the other ranks hold. Measured
        # in the soak test's step on 2 cores: 0.78 CPU-s with 2 threads, 0.025 with 1.
        torch.set_num_threads(1)
    store = dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=_STORE_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        # Everything that holds the group goes before it: compiled code (CUDA graphs hold the group's
        # captured collectives; a rank stopped in teardown after a CUDA-graph test, twice, with them alive),
        # then whatever reference cycles `fn` left. Otherwise destroy_process_group() only unregisters the
        # group, and its C++ object, with gloo's worker and socket threads, lives on into the interpreter's
        # shutdown, where tearing it down aborted a rank ("terminate called without an active exception").
        torch._dynamo.reset()
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: Literal["gloo", "nccl"] = "gloo"
) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; a rank's exception is re-raised here with
    its traceback. ``fn`` must be importable (defined at module level). With NCCL, rank r uses cuda:r.

    The ranks meet at a store whose server this process holds, on a port the OS chose when it bound it, for
    the whole run. (Choosing a free port here and binding it later in rank 0 could lose the port to another
    process meanwhile: with test runs side by side, one's gloo connections.)"""
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
    mp.spawn(_run, args=(world_size, store.port, backend, fn, args), nprocs=world_size, join=True)
