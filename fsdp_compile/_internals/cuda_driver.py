"""The CUDA driver's stream calls, through ctypes (``libcuda.so.1``), for the copy-engine collectives' host path.

* Stream memory operations (``cuStream{Write,Wait}Value64_v2``, CUDA 12+): a stream writes a 64-bit value to (its
  own or a peer's mapped) device memory, or waits until a value there is at least some number, and the GPU's front
  end does it, with no kernel. A barrier kernel that waits for a late rank spins on an SM, and a persistent matmul
  beside it (cuBLAS's, one CTA per SM) then runs slower: 1.10x on the 3 ranks that waited for a late one over 4
  H200s (benchmarks/NOTES.md, runs 56-57). :func:`has_stream_memops` is False where they are missing (an older
  driver); the callers keep their barrier kernels.
* Peer copies and events on raw streams (``cuMemcpyDtoDAsync_v2``, ``cuEventRecord``, ``cuStreamWaitEvent``):
  torch's ``Tensor.copy_``, ``Event.record``, ``Stream.wait_event`` and stream switches cost 5-16 µs of host time a
  call, these about 1 (``benchmarks/ce_host_cost.py``), and a step without CUDA graphs makes ~15 of them per
  collective over 4 ranks. The same GPU work: ``copy_`` of contiguous bytes on one device (a peer's mapped memory
  is an address on this device) is ``cudaMemcpyAsync``, device to device. Captured by CUDA graphs like torch's.

Streams and events are the raw handles torch's expose (``Stream.cuda_stream``, ``Event.cuda_event``); the
calling thread has torch's device context current (it ran CUDA work before).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["copy", "current_stream", "has_stream_memops", "record", "wait_at_least", "wait_event", "write"]

_WAIT_VALUE_GEQ = 0x0
_WRITE_VALUE_DEFAULT = 0x0
"""A memory barrier before the write: the stream's earlier work (its copies) is visible before the value is."""
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


def _memops() -> tuple[Any, Any]:
    return (_function("cuStreamWriteValue64_v2", _POINTER, _U64, _U64, ctypes.c_uint),
            _function("cuStreamWaitValue64_v2", _POINTER, _U64, _U64, ctypes.c_uint))


def has_stream_memops() -> bool:
    """Whether this process can use stream memory operations (the driver has them)."""
    return None not in _memops()


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"fsdp_compile: {what} failed with CUDA driver error {result}")


def write(stream: int, address: int, value: int) -> None:
    """On ``stream``, after its earlier work: write the 64-bit ``value`` at device ``address``."""
    _check(_memops()[0](stream, address, value, _WRITE_VALUE_DEFAULT), "cuStreamWriteValue64")


def wait_at_least(stream: int, address: int, value: int) -> None:
    """``stream``'s later work waits until the 64-bit value at device ``address`` is at least ``value``."""
    _check(_memops()[1](stream, address, value, _WAIT_VALUE_GEQ), "cuStreamWaitValue64")


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
