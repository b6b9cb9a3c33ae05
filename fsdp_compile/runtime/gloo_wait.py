"""Waits for gloo collectives that a failure on another rank ends. Gloo cannot abort an operation in flight, and
``wait_tensor`` blocks its thread until the operation completes; so a helper thread per group calls it, while the
waiting thread watches the group's failure channel and raises ``RankFailed`` as soon as the group is poisoned
([Note: failures] in docs/architecture.md). The helper stays behind in a wait that will not end."""

from __future__ import annotations

import queue
import threading
import weakref

import torch

from fsdp_compile import _internals
from fsdp_compile.runtime.channel import Channel, helper_waits
from fsdp_compile.runtime.channels import channel_named

__all__ = ["wait"]

_POLL_S = 0.05
_Job = tuple[torch.Tensor, threading.Event, list[BaseException]]
_queues: weakref.WeakKeyDictionary[Channel, queue.SimpleQueue[_Job]] = weakref.WeakKeyDictionary()


def wait(tensor: torch.Tensor, group_name: str) -> bool:
    """Wait for the gloo collective whose output is ``tensor`` (over the group ``group_name``) if that group has a
    failure channel, then return True; False, without waiting, if it has none."""
    channel = channel_named(group_name)
    if channel is None or channel.backend != "gloo":
        return False
    channel.check()
    if channel not in _queues:
        _queues[channel] = queue.SimpleQueue()
        threading.Thread(target=_wait_loop, args=(weakref.ref(channel), _queues[channel], group_name), daemon=True,
                         name=f"fsdp_compile-wait-{group_name}").start()
    done, error = threading.Event(), []
    channel.waiting = waited_for = channel.seq()
    _queues[channel].put((tensor, done, error))
    try:
        while not done.wait(_POLL_S):
            channel.check()
    finally:
        channel.waiting = None
    if error:
        channel.explain(error[0], waited_for)
    return True


def _wait_loop(channel: weakref.ref[Channel], jobs: queue.SimpleQueue[_Job], group_name: str) -> None:
    """The helper thread: ``wait_tensor`` of each job, until the group is gone. While it waits, the group is in
    ``helper_waits``: a process that ends then ends at once (``fsdp_compile.runtime.channels``)."""
    while (alive := channel()) is not None and alive.alive():
        del alive
        try:
            tensor, done, error = jobs.get(timeout=1.0)
        except queue.Empty:
            continue
        helper_waits.add(group_name)
        try:
            _internals.c10d_functional.wait_tensor(tensor)
        except BaseException as e:  # handed to the waiting thread
            error.append(e)
        helper_waits.discard(group_name)
        del tensor  # not kept until the next job: a gathered unit is freed when its forward ends
        done.set()
