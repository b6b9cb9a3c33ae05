"""Run a function on several ranks: gloo on CPU, or NCCL with one GPU a rank. :func:`run_ranks` keeps gloo
ranks alive for the next call (a test suite pays for the processes once a world size, a new process group each
call); :func:`spawn_ranks` starts new processes each call."""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

from fsdp_compile import debug
from fsdp_compile._regions import Regions
from fsdp_compile._internals import counters, gloo_one_worker_thread

__all__ = ["gloo_one_worker_thread", "hsdp_mesh", "run_ranks", "spawn_ranks"]


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
_SEED_AT_START = torch.initial_seed()  # torch's default seed: what a new process draws from


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


def _configure(rank: int, backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # torch's gloo races with its default two worker threads (heap corruption): see the function
        gloo_one_worker_thread()
        # One intra-op thread per rank: the ranks share the machine's cores, and with torch's default (a
        # thread per core) each rank's OpenMP threads spin, waiting for cores the other ranks hold. Measured
        # in the soak test's step on 2 cores: 0.78 CPU-s with 2 threads, 0.025 with 1.
        torch.set_num_threads(1)


def _master_store(world_size: int) -> dist.TCPStore:
    """The ranks' store, served by this process on a port the OS chose (see :func:`spawn_ranks`)."""
    return dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT)


def _store(port: int, world_size: int) -> dist.TCPStore:
    return dist.TCPStore(_HOST, port, world_size, is_master=False, timeout=_STORE_TIMEOUT)


def _in_group(
    rank: int, world_size: int, store: dist.Store, backend: str, environ: dict[str, str], fn: Callable[..., Any],
    args: tuple[Any, ...], report: Callable[[str], None] | None = None,
) -> None:
    """``fn(rank, world_size, *args)`` in a new default group on ``store``, with the caller's environment. What it
    raises goes to ``report`` (as a traceback) before the group does: the peers' errors that follow (a
    connection reset) come after the cause."""
    os.environ.clear()  # the caller's environment, as a spawned process has it (a forked one has the server's)
    os.environ.update(environ)
    try:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
        # Everything that holds the group goes before it: compiled code (CUDA graphs hold the group's
        # captured collectives; a rank stopped in teardown after a CUDA-graph test, twice, with them alive),
        # then whatever reference cycles `fn` left. Otherwise destroy_process_group() only unregisters the
        # group, and its C++ object, with gloo's worker and socket threads, lives on into the interpreter's
        # shutdown, where tearing it down aborted a rank ("terminate called without an active exception").
        torch._dynamo.reset()
        gc.collect()
        dist.barrier()
    except BaseException:
        if report is not None:
            report(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(
    rank: int, world_size: int, port: int, backend: str, environ: dict[str, str], fn: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    _configure(rank, backend)
    _in_group(rank, world_size, _store(port, world_size), backend, environ, fn, args)


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
    store = _master_store(world_size)
    mp.start_processes(
        _run, args=(world_size, store.port, backend, dict(os.environ), fn, args), nprocs=world_size,
        start_method=_start_method(backend),
    )


def _serve(rank: int, world_size: int, port: int, jobs: Connection) -> None:
    """A pooled gloo rank: for each ``(fn, args, environ)`` received, ``fn`` in a new group (on a store prefix of
    its own: nothing a job leaves in the store meets the next one) and the process as a new one would have it;
    answer None, or the traceback of what ``fn`` raised and stop (its peers may wait in a collective forever: the
    caller ends the pool). Stop at None too, or when the caller is gone."""
    _configure(rank, "gloo")
    store = _store(port, world_size)
    for number in itertools.count():
        job = _receive(jobs)
        if job is None:
            return
        fn, args, environ = job
        try:
            _in_group(rank, world_size, dist.PrefixStore(f"job{number}/", store), "gloo", environ, fn, args, jobs.send)
        except BaseException:
            return
        counters.clear()  # what a new process would not have: Dynamo's counters, the warnings given once a
        debug._said.clear()  # process (fsdp_compile.debug.degraded), the random state, regions switched off
        torch.manual_seed(_SEED_AT_START)
        Regions.on = True
        jobs.send(None)


def _receive(jobs: Connection) -> Any:
    try:
        return jobs.recv()
    except EOFError:  # the caller is gone
        return None


class _Pool:
    """``world_size`` gloo ranks forked from the fork server, each a :func:`_serve` loop at one end of a pipe."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.store = _master_store(world_size)
        context = mp.get_context("forkserver")
        self.jobs: list[Connection] = []
        self.processes = []
        for rank in range(world_size):
            mine, theirs = context.Pipe()
            process = context.Process(target=_serve, args=(rank, world_size, self.store.port, theirs))
            process.start()
            theirs.close()
            self.jobs.append(mine)
            self.processes.append(process)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        for jobs in self.jobs:
            jobs.send((fn, args, dict(os.environ)))
        waiting, errors = set(range(self.world_size)), {}
        deadline = None  # after a first error, the others' for a moment (the cause may not be the first to arrive)
        while waiting and (deadline is None or time.monotonic() < deadline):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait([self.jobs[r] for r in waiting] + [self.processes[r].sentinel for r in waiting], timeout)
            for rank in sorted(waiting):
                jobs, process = self.jobs[rank], self.processes[rank]
                if jobs.poll() or not process.is_alive():
                    waiting.remove(rank)
                    answer = _answer(jobs)
                    if answer is not None:
                        errors[rank] = answer
                        deadline = deadline or time.monotonic() + _PEERS_ERRORS_S
        if errors:
            self._raise(errors)

    def _raise(self, errors: dict[int, Any]) -> None:
        exited = {r: self.processes[r] for r, e in errors.items() if e is _GONE}
        for process in exited.values():
            process.join()
        raised = "".join(f"\n\n-- Rank {r} raised:\n{e}" for r, e in sorted(errors.items()) if e is not _GONE)
        if raised:
            first = min(r for r, e in errors.items() if e is not _GONE)
            raise ProcessRaisedException(raised, first, self.processes[first].pid)
        rank, process = min(exited.items())
        raise ProcessExitedException(
            f"rank {rank} exited with code {process.exitcode} before its job returned", rank, process.pid,
            process.exitcode,
        )

    def close(self, finish: bool) -> None:
        """Let the ranks leave their group (``finish``), or kill them (a rank may wait in a collective)."""
        for jobs, process in zip(self.jobs, self.processes):
            if finish:
                jobs.send(None)
            else:
                process.kill()
        for jobs, process in zip(self.jobs, self.processes):
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
                process.join()
            jobs.close()


_GONE = object()
_PEERS_ERRORS_S = 2.0


def _answer(jobs: Connection) -> Any:
    """What a rank sent back: None (done) or a traceback; ``_GONE`` where it exited first."""
    try:
        return jobs.recv() if jobs.poll() else _GONE
    except EOFError:
        return _GONE


_pools: dict[int, _Pool] = {}


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> None:
    """``spawn_ranks(fn, world_size, *args)`` on gloo ranks kept alive for the next call of this world size: the
    processes (their start, imports and warmed-up caches) are paid for once. Each call sees the caller's
    environment and finds the ranks as new ones would be: a new default group on a store prefix of its own,
    Dynamo reset and its counters cleared, torch's default seed. A rank's exception, or exit, ends the pool (its
    peers may wait in a collective) and the next call starts another. Tests that exit a rank, or read what a
    process holds since its start (peak memory), use :func:`spawn_ranks`. The ranks end with this process."""
    if _start_method("gloo") != "forkserver":  # a variable read at import differs from the fork server's
        spawn_ranks(fn, world_size, *args)
        return
    if world_size not in _pools:
        _pools[world_size] = _Pool(world_size)
    pool = _pools[world_size]
    try:
        pool.run(fn, args)
    except BaseException:
        del _pools[world_size]
        pool.close(finish=False)
        raise


@atexit.register
def _close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close(finish=True)
