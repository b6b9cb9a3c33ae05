"""The failure channels of this process (``runtime.channel``): one per process group a sharded model runs over,
found by the group or by its name; and what the process does when it ends: an uncaught exception departs its
groups' steps (the other ranks then raise at once, naming it), and a process that ends says so in its heartbeat
(it is not taken for dead)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile._departure import describe, root_cause
from fsdp_compile._internals import failures
from fsdp_compile.runtime.channel import Channel, helper_waits, watchers

__all__ = ["channel_named", "channel_of"]

log = logging.getLogger(__name__)


_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, Channel] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_hooked = False
"""Whether the exit hooks are installed (once a process, with the first channel)."""


def channel_of(group: dist.ProcessGroup, device: torch.device) -> Channel:
    """The channel of ``group`` (a group of more than one rank with a store), made and watched at the first call."""
    global _hooked
    with _lock:
        if not _hooked:
            _install_exit_hooks()
            _hooked = True
        channel = _channels.get(group)
        if channel is None:
            channel = _channels[group] = Channel(group, device)
        return channel


def channel_named(group_name: str) -> Channel | None:
    """The channel of the live group named ``group_name``, if it has one."""
    with _lock:
        return next((c for g, c in _channels.items() if c.group_name == group_name and failures.group_alive(g)), None)


def _live_channels() -> list[Channel]:
    with _lock:
        return [c for g, c in _channels.items() if failures.group_alive(g)]


def _install_exit_hooks() -> None:
    """An uncaught exception ending the process departs its groups' steps (the others then raise at once, naming
    it); a process that ends says so in its heartbeat (it is not taken for dead)."""
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        for channel in _live_channels():
            with contextlib.suppress(RuntimeError):  # the store may be gone too
                channel.depart(f"exited: an uncaught {describe(root_cause(value), 300)}")
        previous(kind, value, traceback)

    def goodbye() -> None:
        for channel in _live_channels():
            with contextlib.suppress(RuntimeError):
                channel.close()
        for thread in list(watchers):  # of destroyed groups: ending
            thread.join(timeout=1.0)
        if helper_waits:
            _end_now(sorted(helper_waits))

    sys.excepthook = excepthook
    atexit.register(goodbye)


def _end_now(group_names: list[str]) -> None:
    """End the process now, with exit code 1: a helper thread waits in gloo for a collective that the failure left
    unfinished, and when a peer's process ends that wait returns; during the interpreter's shutdown, a thread coming
    back from C++ code aborts the process (Python before 3.14: "terminate called without an active exception").
    The exit handlers registered before fsdp_compile's (registered by the first ``shard()`` of a
    multi-rank model) do not
    run."""
    log.warning("fsdp_compile: ending the process (exit code 1) without the rest of the interpreter's shutdown: a "
                "collective of process group %s is unfinished (docs/failures.md)", ", ".join(group_names))
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or replaced by an object without flush
            stream.flush()
    os._exit(1)
