"""CPU offload's copies of gradients to host memory, off the compute stream.

A GPU gradient is copied to pinned host memory on a side stream of its own, so the copy overlaps the rest of
backward's compute, and :func:`copy_to_host` returns at once: the host tensor is *pending* until its copy is done.
Whoever reads one first waits for it (:func:`wait_for`: the step in backward, the accumulation of a gradient into
an earlier one); the backward pass that made the copies waits for all of them before it returns
(:func:`wait_for_all`, queued as the autograd engine's end-of-backward callback), so what ``backward()`` leaves in
``.grad`` is ready, as with a blocking copy. On CPU (the copy stands for the transfer) it is a plain copy.
"""

from __future__ import annotations

import torch

from fsdp_compile import _internals

__all__ = ["copy_to_host", "is_pending", "wait_for", "wait_for_all"]

_streams: dict[int, torch.cuda.Stream] = {}
"""Per device: the stream the copies to the host run on."""
_pending: dict[int, torch.cuda.Event] = {}
"""The host storage (its address) of each copy not waited for yet, and the event its copy recorded."""
_queued_for: list[int] = [-1]
"""The backward pass (graph task) whose end waits for every copy (queued once per backward)."""


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to (pinned) host memory; from a GPU, pending until its copy is done (module docstring).
    The copy reads a clone made on the compute stream (a device-side copy, cheap beside the host link): the
    caller's buffer is free for reuse when this returns (Inductor reuses buffers after their last reader)."""
    if not tensor.is_cuda:
        return tensor.to("cpu", copy=True)
    compute = torch.cuda.current_stream(tensor.device)
    side = _streams.get(tensor.device.index)
    if side is None:
        side = _streams[tensor.device.index] = torch.cuda.Stream(tensor.device)
    source = tensor.detach().clone()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        host.copy_(source, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    source.record_stream(side)  # the allocator reuses the clone only after the copy
    _pending[_key(host)] = done
    task = _internals.backward_task()
    if task == -1:  # not inside a backward pass: nothing would wait for it
        wait_for(host)
    elif _queued_for[0] != task:
        _queued_for[0] = task
        _internals.queue_backward_callback(wait_for_all)
    return host


def is_pending(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a view of it) is a host copy not waited for yet."""
    return _key(tensor) in _pending


def wait_for(tensor: torch.Tensor) -> None:
    """Block until the copy that made ``tensor`` (or the tensor it is a view of) is done; at once if none is
    pending."""
    wait_for_key(_key(tensor))


def wait_for_key(key: int) -> None:
    done = _pending.pop(key, None)  # atomic: the step in backward's thread waits too
    if done is not None:
        done.synchronize()


def wait_for_all() -> None:
    """Block until every pending copy is done."""
    for key in list(_pending):
        wait_for_key(key)
