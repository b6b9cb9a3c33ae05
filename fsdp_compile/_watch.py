"""What a sharded model tells its process groups' failure channels (``fsdp_compile.runtime.channel``): each call of the
model (its step), the exceptions that leave its forward or backward, a forward whose backward never completed.
The sharded root's ``__call__`` runs outside Dynamo (every call, compiled or not, passes through it) and checks
the channels before the model issues a collective: [Note: failures] in docs/architecture.md."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile._departure import RankFailed, describe, root_cause
from fsdp_compile._internals import failures
from fsdp_compile._regions import call_with_regions
from fsdp_compile.runtime.channels import channel_of

__all__ = ["ModelWatch", "WatchedGraph", "call_watched", "watch_of"]

WATCH_ATTR = "_fsdp_compile_watch"
"""On the module shard() was called on: its :class:`ModelWatch`."""
_MESSAGE_CHARS = 300


class ModelWatch:
    """One sharded model on this rank, as its failure channels see it: ``step`` (its steps so far: a step is the
    model's forwards up to the backward that completes them, so two forwards then one backward are one step, and a
    forward under ``no_grad`` is one), whether a forward runs (``depth``), and ``pending``: the step whose forwards
    gave outputs that require a gradient and whose backward has not completed yet."""

    def __init__(self, groups: Iterable[dist.ProcessGroup], device: torch.device, units: dict[int, str]) -> None:
        self.channels = [channel_of(g, device) for g in dict.fromkeys(groups) if dist.get_backend(g) != "fake"]
        for channel in self.channels:
            channel.models.add(self)
        self.units = units
        """id(unit module) -> the unit's name: where an exception was raised."""
        self.step = 0
        self.depth = 0
        self.pending: int | None = None
        self.backward_started = False
        self._callback_for = -1
        """The backward pass (graph task) whose end ``_backward_done`` is queued for: a backward that raises drops
        its callbacks, so each backward pass queues its own."""
        self.thread = threading.get_ident()
        self.summoned = False
        """Inside ``summon_full_params``: a forward would read shards that the summoned parameters may change."""
        self.summons = 0

    # -- the calling thread ------------------------------------------------------------------------------------

    @torch.compiler.disable  # called by the watched __call__, whose callees Dynamo would otherwise look into
    def enter(self) -> None:
        """Before the forward: the channels agree that this rank may go on (or raise :class:`RankFailed`)."""
        if self.summoned:
            raise RuntimeError(
                "the sharded model was called inside fsdp_compile.summon_full_params(): the forward reads the shards, "
                "which the summoned parameters may change at the exit. Call the model outside the with-block"
            )
        if self.depth == 0:
            if self.pending is None:
                self.step += 1
            else:  # another forward of the step: legal where every rank makes it (checked through the store)
                self._depart(self._without_backward(), quiet=True)
                _internals.counters["fsdp_compile"]["forwards_checked_with_peers"] += 1
            self.settle()
            self.thread = threading.get_ident()
        self.depth += 1

    def settle(self) -> None:
        """Before the model's next collectives: raise :class:`RankFailed` if a group is poisoned; if this rank left
        a step early, wait for the others (``Channel.settle``)."""
        for channel in self.channels:
            channel.settle()

    @torch.compiler.disable
    def leave(self, error: BaseException | None, output: Any = None) -> None:
        """After the forward: it raised ``error`` (the other ranks are told), or gave ``output``."""
        self.depth -= 1
        if self.depth:
            return
        if error is not None:
            self.pending = None
            self.failed(error, "forward")
        elif any(isinstance(t, torch.Tensor) and t.requires_grad for t in failures.tree_leaves(output)):
            self.pending = self.step  # (a forward under no_grad leaves the step's earlier forwards pending)
            self.backward_started = False

    def failed(self, error: BaseException, phase: str) -> None:
        """``error`` left this rank's ``phase`` ("forward", "backward"): tell the other ranks (not for an error that
        a failure elsewhere caused)."""
        if phase == "backward":
            self.pending = None
        cause = root_cause(error)
        if isinstance(cause, RankFailed) or any(c.cause is not None for c in self.channels):
            return
        unit = _unit_of(error.__traceback__, self.units)
        wrapped = f", raised as {type(error).__name__}" if cause is not error else ""
        self._depart(
            f"raised {describe(cause, _MESSAGE_CHARS)} (in the {phase} of step {self.step}"
            + (f", unit {unit!r}" if unit else "") + wrapped + f"; {_STEPS})"
        )

    def _depart(self, reason: str, quiet: bool = False) -> None:
        for channel in self.channels:
            channel.depart(reason, quiet)

    def _without_backward(self) -> str:
        if self.backward_started:
            return (f"did not complete a backward after the forward of step {self.pending}: it raised in the backward "
                    f"(outside fsdp_compile's code: this rank's own error says which; {_STEPS})")
        return (f"did not complete a backward after the forward of step {self.pending}: it called the model again "
                "instead, while the others went on to the backward (an exception before the backward, which this "
                f"rank's own error names, or a rank-dependent forward; {_STEPS})")

    # -- inside the backward -------------------------------------------------------------------------------------

    def backward_ran(self) -> None:
        """A unit's backward ran (called inside the autograd engine): completing this backward settles the step."""
        self.backward_started = True
        task = _internals.backward_task()
        if task != self._callback_for:
            self._callback_for = task
            failures.queue_backward_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.pending = None
        self.backward_started = False

    # -- the channels' watcher -----------------------------------------------------------------------------------

    def where(self) -> str | None:
        if self.depth:
            return f"in the forward of step {self.step}"
        if self.pending is not None and self.backward_started:
            return f"in the backward of step {self.pending}"
        return None

    def poll(self) -> None:
        """A backward that started and is no longer running without having completed raised: say so now, not at
        the next forward (which may never come)."""
        if self.pending is None or not self.backward_started or failures.in_backward(self.thread):
            return
        if self.pending is not None and self.backward_started:  # read again: it may have completed meanwhile
            self._depart(self._without_backward())


_STEPS = "a step: the model's forwards up to their backward, counted on this rank from 1"
"""What a step's number counts, for messages."""


def _unit_of(traceback: TracebackType | None, units: dict[int, str]) -> str | None:
    """The innermost unit whose code the traceback passes through (eager code, or a compiled model's graph
    breaks); None inside a compiled graph. Not the first frame, which handles the exception: reading its locals
    (frozen into a dict the frame keeps) would tie the exception to itself, a cycle only the garbage collector
    frees, and with it the failed forward's saved activations and gathered units."""
    found = None
    traceback = None if traceback is None else traceback.tb_next
    while traceback is not None:
        owner = traceback.tb_frame.f_locals.get("self")
        if id(owner) in units:
            found = units[id(owner)]
        traceback = traceback.tb_next
    return found


class WatchedGraph:
    """A compiled forward or backward graph whose exceptions the models' failure channels hear of: a backward
    raises from inside the autograd engine, past no other code of the library, and a model's call may be part of a
    larger compiled function. Called as AOTAutograd calls compiled graphs (boxed: one list of arguments); anything
    else is the wrapped graph's."""

    def __init__(
        self, compiled: Any, watches: Iterable[ModelWatch], phase: str, after: Callable[[], None] | None = None
    ) -> None:
        self.__wrapped__ = compiled
        self._watches = weakref.WeakSet(watches)
        self._phase = phase
        self._after = after
        """Called when the graph has run (the backward's wait for its copies to the host, where needed)."""
        self._boxed_call = True  # an instance's: AOTAutograd's wrappers copy the __dict__ (functools.wraps)

    def __call__(self, args: list[Any]) -> Any:
        for watch in list(self._watches):
            if self._phase == "backward":
                watch.backward_ran()
            else:  # before the graph's collectives (a model traced into a larger function has no call of its own)
                watch.settle()
        compiled = self.__wrapped__
        try:
            out = compiled(args) if getattr(compiled, "_boxed_call", False) else compiled(*args)
        except BaseException as error:
            for watch in list(self._watches):
                watch.failed(error, self._phase)
            raise
        if self._after is not None:
            self._after()
        return out

    def __getattr__(self, name: str) -> Any:
        if name == "__wrapped__":  # not set yet
            raise AttributeError(name)
        return getattr(self.__wrapped__, name)


def watch_of(module: nn.Module) -> ModelWatch | None:
    return getattr(module, WATCH_ATTR, None)


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of a sharded root: the model's call, watched. Traced as part of a larger compiled function, it
    is the model's call alone (the compiled graphs tell the channels of their exceptions)."""
    if torch.compiler.is_compiling():
        return nn.Module.__call__(module, *args, **kwargs)
    watch: ModelWatch = getattr(module, WATCH_ATTR)
    watch.enter()
    try:
        output = call_with_regions(nn.Module.__call__, module, *args, **kwargs)
    except BaseException as error:
        watch.leave(error)
        ours = _wrapped_by_compile(error)
        try:
            if ours is not None:  # torch.compile wrapped it (BackendCompilerFailed): raised as itself
                raise ours from None
            raise
        finally:
            del ours  # no cycle through this frame (the traceback holds it): the failed forward is freed with its error
    watch.leave(None, output)
    return output


def _wrapped_by_compile(error: BaseException) -> BaseException | None:
    """fsdp_compile's own exception (``RanksDisagree``, ``RankFailed``) that torch.compile wrapped in ``error``, or
    None: the caller catches it by its class."""
    cause = root_cause(error)
    return cause if cause is not error and type(cause).__module__.startswith("fsdp_compile") else None


call_watched = _internals.run_by_python(_call)
"""Run by Python: the call it makes (``Module.__call__``) is what ``torch.compile(model)`` compiles."""
