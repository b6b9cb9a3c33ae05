"""The copy-engine ops' streams and events, made once per device: making them at every call costs host time
(``torch.cuda.Stream()``, the new event of ``Stream.wait_stream``, a c10d ``Work`` registered for the graph's
``wait_tensor``), and a step without CUDA graphs pays it per collective. Forks, records and waits are the
driver's calls on the raw handles (``_internals.cuda_driver``), cheaper than torch's Python stream and event APIs
(docs/measurements.md, "Host cost").

* :func:`fork_side`: symmetric memory's side stream, after the compute stream's work so far (not made current).
* :func:`on_side_stream`: the same, made current for torch's ops (the workspace route).
* :func:`copy_in_turn`: the peer copies, one after another on the side stream (torch's copies: the workspace route).
* :func:`record_done` ends a copy-engine collective into a slot (on the side stream); the op
  ``fsdp_compile::wait_copy_engine(out, keep)`` is the graph's wait for it: the compute stream waits for the event
  recorded last for ``out``'s place. One event per place (device, address): a collective into a slot is issued
  only after the wait of the slot's previous collective (the memory plan orders the slot's next write after the
  last read of its previous occupant, which comes after that wait), so no event is recorded again before the
  wait for its last record is enqueued. All of it is capturable by CUDA graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fsdp_compile._internals import cuda_driver, step_ops, symm_mem

__all__ = ["WAIT_COPY_ENGINE", "copy_in_turn", "fork_side", "on_side_stream", "record_done", "wait_copy_engine"]

_side: dict[int, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}
"""Per device: symmetric memory's backend stream, and the event that forks it from the compute stream."""
_done: dict[tuple[int, int], torch.cuda.Event] = {}
"""Per place (device, address) of a collective's output: the event its last collective recorded."""


def fork_side(device: int) -> torch.cuda.Stream:
    """Symmetric memory's side stream on ``device``, made to wait for the work the compute stream has so far."""
    if device not in _side:
        fork = torch.cuda.Event()
        fork.record(torch.cuda.current_stream(device))  # the event exists from its first record on
        _side[device] = (symm_mem.backend_stream(), fork)
    side, fork = _side[device]
    cuda_driver.record(fork.cuda_event, cuda_driver.current_stream(device))
    cuda_driver.wait_event(side.cuda_stream, fork.cuda_event)
    return side


@contextlib.contextmanager
def on_side_stream() -> Iterator[None]:
    """Symmetric memory's side stream made current, after the work the compute stream has so far; the compute
    stream current again at the end."""
    compute = torch.cuda.current_stream()
    torch.cuda.set_stream(fork_side(compute.device.index))
    try:
        yield
    finally:
        torch.cuda.set_stream(compute)


def copy_in_turn(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``dst.copy_(src)`` for every (dst, src) pair, one after another on the current (side) stream. The pairs
    come in ring order (``fsdp_compile.runtime.slots.ring_order``): at each step every rank copies from (or to) a peer
    that no other rank copies from (or to) at that step: faster than the copies at once on a stream per peer,
    which share the peers' links (docs/measurements.md, "Ring order"); and one stream costs no events to fork and
    join."""
    for dst, src in pairs:
        dst.copy_(src)


def record_done(out: torch.Tensor, side: torch.cuda.Stream) -> None:
    """Record, on ``side``, that the collective into ``out`` is done (``wait_copy_engine``)."""
    place = (out.device.index, out.data_ptr())
    if place not in _done:
        _done[place] = torch.cuda.Event()
        _done[place].record(side)  # the event exists from its first record on
        return
    cuda_driver.record(_done[place].cuda_event, side.cuda_stream)


def _wait_fake(out: torch.Tensor, keep: torch.Tensor | None) -> None:
    return None


@step_ops.step_op(
    "fsdp_compile::wait_copy_engine", "(Tensor(a!) out, Tensor? keep) -> ()", _wait_fake, device_type="cuda"
)
def wait_copy_engine(out: torch.Tensor, keep: torch.Tensor | None) -> None:
    """The graph's wait for the copy-engine collective into ``out``: the compute stream waits for it. ``out`` is
    "mutated" so that every read of it comes after; ``keep`` (an exchange's gradient, which the side stream reads
    until then) is an argument only so that the graph keeps it alive until here."""
    device = out.device.index
    cuda_driver.wait_event(cuda_driver.current_stream(device), _done[(device, out.data_ptr())].cuda_event)


WAIT_COPY_ENGINE = wait_copy_engine
