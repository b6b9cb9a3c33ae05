"""What the failure channels (``fsdp_compile.runtime.channel``, ``fsdp_compile._watch``) use of torch's internals: a process
group's count of collectives, its registration and abort, and the autograd engine's callbacks and thread."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from fsdp_compile._internals import _need

__all__ = [
    "abort_group", "group_alive", "group_sequence_number", "in_backward", "queue_backward_callback", "tree_leaves",
]

tree_leaves: Callable[[Any], list[Any]] = _need("torch.utils._pytree", "tree_leaves")
"""The tensors (and other leaves) of a nested output: tuples, dicts, dataclasses Hugging Face registers."""


def group_sequence_number(group: Any) -> int:
    """How many collectives this process has issued over ``group`` (c10d's sequence number). Ranks that run the
    same program issue the same collectives: equal numbers are the same place in it."""
    return group._get_sequence_number_for_group()  # type: ignore[no-any-return]


def group_alive(group: Any) -> bool:
    """Whether ``group`` is still registered (``destroy_process_group`` has not removed it)."""
    return group in _need("torch.distributed.distributed_c10d", "_world").pg_names


def abort_group(group: Any) -> bool:
    """Abort ``group``'s pending collectives where its backend can (NCCL: the communicators abort, kernels waiting
    for a peer return); False where it cannot (gloo: an operation in flight waits on)."""
    if not hasattr(group, "abort"):
        return False
    group.abort()
    return True


_ENGINE_RUN_BACKWARD = _need("torch.autograd.graph", "_engine_run_backward").__code__


def in_backward(thread_id: int) -> bool:
    """Whether the thread ``thread_id`` is inside an autograd backward pass (``backward()``, ``autograd.grad``)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is _ENGINE_RUN_BACKWARD:
            return True
        frame = frame.f_back
    return False


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Have the autograd engine call ``callback`` once the backward pass now running completes (not if it
    raises). Call it from inside a backward pass (a hook, an autograd function)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
