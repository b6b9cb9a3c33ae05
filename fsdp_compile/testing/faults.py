"""Fault injection for the failure tests: a :class:`Fault` armed on one rank strikes at a step, in a unit's forward
or backward (an exception, an out-of-memory error, the process killed by SIGKILL), or the rank stops calling the
model; :func:`run_faulty` runs ranks in fresh processes and waits for them a bounded time, killing what is left.

The fault strikes from inside an op (:func:`fault_point`), as an out-of-memory error does: the compiled graphs are
the same on every rank and no recompilation happens when it is armed."""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile.testing import dist as _dist

__all__ = ["Fault", "FaultyBlock", "Outcome", "arm", "fault_point", "mark_struck", "run_faulty", "set_step"]

Kind = Literal["exception", "oom", "sigkill", "stop"]


@dataclasses.dataclass(frozen=True)
class Fault:
    """``kind`` on global rank ``rank`` (None: every rank) at the training loop's ``step`` (see :func:`set_step`), in
    ``phase``. "stop": the rank's training loop stops calling the model at that step (see :meth:`stops`)."""

    rank: int | None
    step: int
    phase: Literal["forward", "backward"] = "forward"
    kind: Kind = "exception"

    def stops(self, step: int) -> bool:
        """Whether this rank's loop must stop calling the model at ``step``."""
        return self.kind == "stop" and self.step == step and self.rank in (None, dist.get_rank())


_armed: list[Fault] = []
_step = [0]
_store: list[dist.Store] = []
"""The store :func:`run_faulty` gave this rank: a fault says there when it struck."""
STRUCK_KEY = "fsdp_compile_testing/struck"


def arm(fault: Fault | None) -> None:
    """Arm ``fault`` in this process (None: disarm)."""
    _armed[:] = [] if fault is None else [fault]


def set_step(step: int) -> None:
    """The training loop's step, which faults strike at."""
    _step[0] = step


def mark_struck() -> None:
    """Record now as the moment the fault struck, for a fault the test causes itself (``Outcome.after``)."""
    if _store:
        _store[0].set(STRUCK_KEY, repr(time.time()))


def _strike(phase: str) -> None:
    fault = _armed[0] if _armed else None
    if fault is None or (fault.phase, fault.step) != (phase, _step[0]) or fault.rank not in (None, dist.get_rank()):
        return
    where = f"rank {dist.get_rank()}, step {fault.step}, {phase}"
    mark_struck()
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "oom":
        raise torch.OutOfMemoryError(f"injected: out of memory, tried to allocate 2.00 GiB ({where})")
    if fault.kind == "exception":
        raise ValueError(f"injected: a bad batch ({where})")


@torch.library.custom_op("fsdp_compile_testing::fault_point", mutates_args=())
def fault_point(x: torch.Tensor) -> torch.Tensor:
    """``x``, or the armed fault if it strikes in the forward now; its gradient is ``grad``, or the fault if it
    strikes in the backward."""
    _strike("forward")
    return x.clone()


@fault_point.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fsdp_compile_testing::fault_point_backward", mutates_args=())
def _fault_point_backward(grad: torch.Tensor) -> torch.Tensor:
    _strike("backward")
    return grad.clone()


@_fault_point_backward.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


fault_point.register_autograd(lambda ctx, grad: _fault_point_backward(grad))


class FaultyBlock(nn.Module):
    """A tiny unit whose forward and backward pass a :func:`fault_point`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(fault_point(self.linear(x)))


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a rank did: ``error`` (the type of what it raised, None if it finished) and its ``message``, ``after``
    how many seconds since the fault struck (on any rank), or ``exit`` (its exit code where it died or was killed at
    the deadline). ``blamed``: the rank a ``RankFailed`` names."""

    rank: int
    error: str | None = None
    message: str = ""
    at: float = 0.0
    exit: int | None = None
    blamed: int | None = None
    after: float | None = None


def report(outcomes: Any, error: BaseException | None) -> None:
    """Send this rank's outcome to :func:`run_faulty` and leave at once: after a failure the process group may hold
    a collective that never completes, which a teardown would wait for."""
    message = "" if error is None else "".join(traceback.format_exception_only(error)).strip()
    kind = None if error is None else type(error).__name__
    outcomes.put(Outcome(dist.get_rank(), kind, message, time.time(), blamed=getattr(error, "rank", None)))
    time.sleep(0.2)  # the queue's feeder thread sends it
    os._exit(0)


def _rank(
    rank: int, world_size: int, port: int, backend: str, environ: dict[str, str], timeout_s: float,
    fn: Callable[..., Any], args: tuple[Any, ...], outcomes: Any,
) -> None:
    os.environ.clear()  # the caller's environment (a process forked from the server has the server's)
    os.environ.update(environ)
    _dist._configure(rank, backend)
    _store[:] = [_dist._store(port, world_size)]
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=_store[0], rank=rank, world_size=world_size, timeout=timeout)
    try:
        fn(rank, world_size, *args)
    except BaseException as error:  # the rank's outcome
        report(outcomes, error)
    report(outcomes, None)


def run_faulty(
    fn: Callable[..., Any], world_size: int, *args: Any, limit_s: float = 180.0, timeout_s: float = 1800.0,
    backend: Literal["gloo", "nccl"] = "gloo",
) -> dict[int, Outcome]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks (gloo, or NCCL with GPU r for rank r; process group
    timeout ``timeout_s``), each a new process (gloo: forked from the fork server); each rank's :class:`Outcome`:
    what ``fn`` raised and when, or that it finished; a rank still running after ``limit_s`` seconds is killed and
    reported with its exit code, as is one that died."""
    store = _dist._master_store(world_size)
    context = multiprocessing.get_context(_dist._start_method(backend))
    outcomes = context.SimpleQueue()
    processes = [
        context.Process(
            target=_rank,
            args=(rank, world_size, store.port, backend, dict(os.environ), timeout_s, fn, args, outcomes),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Outcome] = {}
    deadline = time.monotonic() + limit_s
    while len(results) < world_size and time.monotonic() < deadline:
        while not outcomes.empty():
            outcome = outcomes.get()
            results[outcome.rank] = outcome
        if all(not p.is_alive() for p in processes) and outcomes.empty():
            break
        time.sleep(0.05)
    for rank, process in enumerate(processes):
        if process.is_alive():
            process.kill()
        process.join()
        if rank not in results:
            results[rank] = Outcome(rank, exit=process.exitcode)
    struck = float(store.get(STRUCK_KEY)) if store.check([STRUCK_KEY]) else None
    return {r: dataclasses.replace(o, after=None if struck is None or not o.at else o.at - struck)
            for r, o in sorted(results.items())}
