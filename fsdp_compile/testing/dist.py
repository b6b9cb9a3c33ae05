"""Run a function on several ranks, one new process each: gloo on CPU, or NCCL with one GPU a rank."""

from __future__ import annotations

import datetime
import gc
import os
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

# gloo ranks are forked from a server process that imported this module once (and with it torch, Dynamo,
# Inductor's compiler and fsdp_compile), instead of each rank importing them afresh: ~5-10 s of CPU a rank on a
# 2-core machine, which was most of a multi-rank CPU test's time.
_PRELOAD = [__name__]
# Variables those modules (and the libraries they load) read when imported: a rank forked from the server has
# the values the server started with, so where the caller's differ, its ranks are spawned afresh instead.
_READ_AT_IMPORT = ("TORCH", "PYTORCH", "FSDP_COMPILE", "OMP_", "MKL_", "OPENBLAS_")
_server_environ: dict[str, str] | None = None  # those variables when the fork server was first asked for


def _start_method(backend: str) -> str:
    """``"forkserver"`` for gloo ranks, unless a variable read at import differs from the server's start;
    ``"spawn"`` otherwise, and always for NCCL (a fork must not inherit CUDA state)."""
    global _server_environ
    if backend != "gloo":
        return "spawn"
    read_at_import = {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_IMPORT)}
    if _server_environ is None:
        mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)  # the server starts with the first ranks
        _server_environ = read_at_import
    return "forkserver" if read_at_import == _server_environ else "spawn"


def _run(
    rank: int, world_size: int, port: int, backend: str, environ: dict[str, str], fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    os.environ.clear()  # the caller's environment, as a spawned process has it (a forked one has the server's)
    os.environ.update(environ)
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

    Each rank is a new process with this process's environment. gloo ranks are forked from a server that
    imported torch and fsdp_compile once for this process (the first call starts it); where a variable those
    read when imported (``TORCH*``, ``PYTORCH*``, ``FSDP_COMPILE*``, thread counts) has changed since, the ranks
    are spawned as NCCL's always are.

    The ranks meet at a store whose server this process holds, on a port the OS chose when it bound it, for
    the whole run. (Choosing a free port here and binding it later in rank 0 could lose the port to another
    process meanwhile: with test runs side by side, one's gloo connections.)"""
    store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)
    mp.start_processes(
        _run, args=(world_size, store.port, backend, dict(os.environ), fn, args), nprocs=world_size,
        start_method=_start_method(backend),
    )
