"""CPU offload's copies between host and device memory.

To the device (:func:`copy_to_device`): on a side stream of its own, so the copy overlaps compute the host has
already queued (the compute stream waits for it only where it reads the copy). A shard is copied in its own dtype
and cast on the device (FSDP2's order: the device's cast is free, the host's is not: benchmarks/NOTES.md), while a
host thread casts it into a *mirror* in the parameters' narrower dtype; the shard's next copies of the same values
(the other micro-batches of gradient accumulation, backward's re-gather) move the mirror: half the bytes over the
link for the same bits. A mirror is used while the shard's version counter (which every in-place write bumps: the
optimizer's, a load, ``copy_``) and a sample of its values still match; a write through ``.data`` that changes none
of the sampled elements is the one thing it cannot see (don't write offloaded shards through ``.data``).

To the host (:func:`copy_to_host`): a GPU gradient is copied to pinned host memory on a side stream of its own, so
the copy overlaps the rest of backward's compute, and :func:`copy_to_host` returns at once: the host tensor is
*pending* until its copy is done. Whoever reads one first waits for it (:func:`wait_for`: the flat shard's gradient
hook before autograd accumulates it, the step in backward); a backward graph after which autograd adds two of them
waits for all (``fsdp_compile._backend``); the backward pass that made the copies waits for all of them before it
returns (:func:`wait_for_all`, queued as the autograd engine's end-of-backward callback). On CPU (the copy stands for
the transfer) it is a plain copy.
"""

from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fsdp_compile import _internals
from fsdp_compile._internals import failures

__all__ = ["copy_to_device", "copy_to_host", "refresh_mirror", "wait_for", "wait_for_all"]

SAMPLES = 1024
"""Elements of a shard compared with its mirror at each use (evenly spaced): a cheap check for writes the version
counter does not count."""

_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
"""Per direction ("to_host", "to_device") and device: the stream the copies run on."""
AHEAD = 2
"""Copies to the device the host may issue before the compute stream has done the work queued ahead of them."""
_issued: dict[torch.cuda.Stream, collections.deque[torch.cuda.Event]] = {}
"""Per copy stream to a device: the compute stream's events recorded as each of the last copies was issued."""
_pending: dict[int, torch.cuda.Event] = {}
"""The host storage (its address) of each copy not waited for yet, and the event its copy recorded."""
_queued_for: list[int] = [-1]
"""The backward pass (graph task) whose end waits for every copy (queued once per backward)."""


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _stream(direction: str, device: torch.device) -> torch.cuda.Stream:
    key = (direction, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device)
    return _streams[key]


@dataclass
class _Mirror:
    """A shard's values in a narrower dtype, in pinned host memory."""

    tensor: torch.Tensor
    version: int
    """The shard's version counter when the cast began."""
    cast: concurrent.futures.Future[None]
    """The host thread's cast into ``tensor``."""
    read: torch.cuda.Event | None = None
    """Recorded after the last copy that read ``tensor`` (a new cast waits for it)."""


_mirrors: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Per offloaded shard (the host tensor a graph or eager step passes): its mirror."""
_caster: list[concurrent.futures.ThreadPoolExecutor] = []
"""The host thread that casts shards into their mirrors (made at the first cast)."""


def copy_to_device(host: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``host`` on ``device`` in ``dtype``: from the shard's mirror where it is current, else copied in its own dtype
    and cast there, a new mirror cast meanwhile on the host (module docstring). From pageable memory or to a CPU
    device: the plain copy and cast."""
    if device.type != "cuda" or not host.is_pinned():
        return host.to(device, non_blocking=True, copy=True).to(dtype)
    mirror = _mirrors.get(host) if dtype != host.dtype else None
    if mirror is not None and _current(mirror, host):
        out = _on_side_stream(mirror.tensor, device, dtype)
        mirror.read = torch.cuda.Event()
        mirror.read.record(_stream("to_device", device))
        _internals.counters["fsdp_compile"]["offload_copies_from_mirror"] += 1
        return out
    out = _on_side_stream(host, device, dtype)
    if dtype != host.dtype and (mirror is None or mirror.cast.done()):  # stale or new; not while a cast into it runs
        _start_cast(host, dtype, mirror)
    return out


def _on_side_stream(source: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``source`` copied to ``device`` and cast to ``dtype`` on the device's copy stream; the compute stream waits
    for it before its next kernel. Allocated on the copy stream (no wait for the compute stream's earlier work, so
    the copy may run ahead of it) and marked used by the compute stream (freed only once its readers are done).
    At most ``AHEAD`` copies ahead: the host waits until the compute stream has done what it was given before the
    copy ``AHEAD`` back (a host far ahead of the GPU would otherwise hold every unit's copy at once: the allocator
    reuses a copy's memory only once the compute that read it is done)."""
    compute = torch.cuda.current_stream(device)
    side = _stream("to_device", device)
    issued = _issued.setdefault(side, collections.deque())
    issued.append(compute.record_event())
    while len(issued) > AHEAD:
        issued.popleft().synchronize()
    with torch.cuda.stream(side):
        out = source.to(device, non_blocking=True).to(dtype)
    compute.wait_stream(side)
    out.record_stream(compute)
    return out


def refresh_mirror(host: torch.Tensor, dtype: torch.dtype) -> None:
    """Start casting ``host`` (a pinned shard) into its mirror in ``dtype`` on the host thread, unless the mirror is
    current or a cast into it runs (the step in backward calls it once it has stepped a unit)."""
    if dtype == host.dtype or not host.is_pinned():
        return
    mirror = _mirrors.get(host)
    if mirror is None or (mirror.cast.done() and mirror.version != host._version):
        _start_cast(host, dtype, mirror)


def _current(mirror: _Mirror, host: torch.Tensor) -> bool:
    if mirror.version != host._version or not mirror.cast.done():
        return False
    step = max(1, host.numel() // SAMPLES)
    return torch.equal(host[::step].to(mirror.tensor.dtype), mirror.tensor[::step])


def _start_cast(host: torch.Tensor, dtype: torch.dtype, old: _Mirror | None) -> None:
    """Cast ``host`` into its mirror (``old``'s memory, once the copies that read it are done) on the host thread."""
    tensor = torch.empty(host.shape, dtype=dtype, pin_memory=True) if old is None else old.tensor
    read = None if old is None else old.read
    version = host._version

    def cast() -> None:
        if read is not None:
            read.synchronize()
        tensor.copy_(host)

    if not _caster:
        _caster.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fsdp_compile mirror"))
    _mirrors[host] = _Mirror(tensor, version, _caster[0].submit(cast))


def copy_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied to (pinned) host memory; from a GPU, pending until its copy is done (module docstring).
    The copy reads a clone made on the compute stream (a device-side copy, cheap beside the host link): the
    caller's buffer is free for reuse when this returns (Inductor reuses buffers after their last reader)."""
    if not tensor.is_cuda:
        return tensor.to("cpu", copy=True)
    compute = torch.cuda.current_stream(tensor.device)
    side = _stream("to_host", tensor.device)
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
        failures.queue_backward_callback(wait_for_all)
    return host


def wait_for(tensor: torch.Tensor) -> None:
    """Block until the copy that made ``tensor`` (or the tensor it is a view of) is done; at once if none is
    pending."""
    if _pending:  # (else no address is read: a fake tensor's, under fsdp_compile.estimate, has none)
        _wait_for_key(_key(tensor))


def _wait_for_key(key: int) -> None:
    done = _pending.pop(key, None)  # atomic: the step in backward's thread waits too
    if done is not None:
        done.synchronize()


def wait_for_all() -> None:
    """Block until every pending copy is done."""
    for key in list(_pending):
        _wait_for_key(key)
