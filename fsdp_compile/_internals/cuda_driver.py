"""The CUDA driver's stream calls, through ctypes (``libcuda.so.1``), for the copy-engine collectives' host path.

* Stream memory operations (``cuStreamBatchMemOp_v2``, CUDA 12+): a stream writes 64-bit values to (its own or a
  peer's mapped) device memory, or waits until values there are at least some number, and the GPU's front end does
  it, with no kernel; one call enqueues a whole barrier (:class:`MemOps`). A barrier kernel that waits for a late
  rank spins on an SM, and a persistent matmul beside it (cuBLAS's, one CTA per SM) then runs slower
  (docs/measurements.md, "Barriers"). :func:`has_stream_memops` is
  False where they are missing (an older driver); the callers keep their barrier kernels.
* Peer copies and events on raw streams (``cuMemcpyDtoDAsync_v2``, ``cuEventRecord``, ``cuStreamWaitEvent``):
  torch's ``Tensor.copy_``, ``Event.record``, ``Stream.wait_event`` and stream switches cost several times more
  host time a call (docs/measurements.md, "Host cost"), and a step without CUDA graphs makes many of them per
  collective. The same GPU work: ``copy_`` of contiguous bytes on one device (a peer's mapped memory
  is an address on this device) is ``cudaMemcpyAsync``, device to device. Captured by CUDA graphs like torch's.

Streams and events are the raw handles torch's expose (``Stream.cuda_stream``, ``Event.cuda_event``); the
calling thread has torch's device context current (it ran CUDA work before).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["MemOps", "copy", "current_stream", "has_stream_memops", "record", "wait_event"]

_WAIT_VALUE_64, _WRITE_VALUE_64 = 4, 5
"""``CUstreamBatchMemOpType``'s ``CU_STREAM_MEM_OP_WAIT_VALUE_64`` and ``CU_STREAM_MEM_OP_WRITE_VALUE_64``; their
flags are 0: ``CU_STREAM_WAIT_VALUE_GEQ`` (wait until at least the value) and ``CU_STREAM_WRITE_VALUE_DEFAULT`` (a
memory barrier before the write: the stream's earlier work, its copies, is visible before the value is)."""
_POINTER, _U64 = ctypes.c_void_p, ctypes.c_uint64


@functools.cache
def _function(name: str, *argtypes: Any) -> Any:
    """The driver's function ``name`` (None where this driver, or this machine, lacks it)."""
    try:
        function = getattr(ctypes.CDLL("libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


def _required(name: str, *argtypes: Any) -> Any:
    """The driver's function ``name``, which every CUDA driver has: missing, the copy-engine routes cannot run."""
    function = _function(name, *argtypes)
    if function is None:
        raise RuntimeError(f"fsdp_compile: the CUDA driver (libcuda.so.1) has no {name}, which the copy-engine "
                           "collectives need: use all_gather='nccl' and grad_reduce='nccl'")
    return function


class _MemOp(ctypes.Structure):
    """The wait-value and write-value members of ``CUstreamBatchMemOpParams`` (they share one layout)."""

    _fields_ = [("operation", ctypes.c_uint), ("address", _U64), ("value64", _U64), ("flags", ctypes.c_uint),
                ("alias", _U64)]


class _MemOpParams(ctypes.Union):
    """``CUstreamBatchMemOpParams``: 48 bytes."""

    _fields_ = [("op", _MemOp), ("pad", _U64 * 6)]


def _batch_memop() -> Any:
    return _function("cuStreamBatchMemOp_v2", _POINTER, ctypes.c_uint, ctypes.POINTER(_MemOpParams), ctypes.c_uint)


def has_stream_memops() -> bool:
    """Whether this process can use stream memory operations (the driver has them)."""
    return _batch_memop() is not None


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"fsdp_compile: {what} failed with CUDA driver error {result}")


class MemOps:
    """One ``cuStreamBatchMemOp`` made once: write a value at each of ``writes``, then wait until the value at each
    of ``waits`` is at least as high (device addresses, 64-bit values). Each :meth:`enqueue` only sets the value: one
    driver call, not one per address."""

    def __init__(self, writes: list[int], waits: list[int]) -> None:
        self.writes, self.waits, self._call = writes, waits, _batch_memop()
        self._params = (_MemOpParams * (len(writes) + len(waits)))()
        operations = [_WRITE_VALUE_64] * len(writes) + [_WAIT_VALUE_64] * len(waits)
        for param, operation, address in zip(self._params, operations, writes + waits, strict=True):
            param.op.operation, param.op.address = operation, address

    def enqueue(self, stream: int, value: int) -> None:
        """On ``stream``, after its earlier work: the writes of ``value``, then the waits for it (nothing without
        addresses)."""
        if not self._params:
            return
        for param in self._params:
            param.op.value64 = value
        _check(self._call(stream, len(self._params), self._params, 0), "cuStreamBatchMemOp")


def copy(stream: int, dst: int, src: int, nbytes: int) -> None:
    """On ``stream``: copy ``nbytes`` from device address ``src`` to ``dst`` (either may be a peer's, mapped)."""
    _check(_required("cuMemcpyDtoDAsync_v2", _U64, _U64, ctypes.c_size_t, _POINTER)(dst, src, nbytes, stream),
           "cuMemcpyDtoDAsync")


def record(event: int, stream: int) -> None:
    """Record ``event`` on ``stream`` (after its work so far)."""
    _check(_required("cuEventRecord", _POINTER, _POINTER)(event, stream), "cuEventRecord")


def wait_event(stream: int, event: int) -> None:
    """``stream``'s later work waits for ``event``'s last record."""
    _check(_required("cuStreamWaitEvent", _POINTER, _POINTER, ctypes.c_uint)(stream, event, 0), "cuStreamWaitEvent")


def current_stream(device: int) -> int:
    """torch's current stream on ``device``, as a raw handle, without making a ``torch.cuda.Stream`` (as Inductor's
    generated code gets it)."""
    return torch._C._cuda_getCurrentRawStream(device)  # type: ignore[attr-defined,no-any-return]
