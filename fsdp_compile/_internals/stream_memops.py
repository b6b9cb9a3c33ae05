"""The CUDA driver's stream memory operations, for barriers that hold no SM while they wait: a stream writes a
64-bit value to (its own or a peer's mapped) device memory, or waits until a value there is at least some number,
and the GPU's front end does it, with no kernel. A barrier kernel that waits for a late rank spins on an SM, and a
persistent matmul beside it (cuBLAS's, one CTA per SM) then runs slower: 1.10x on the 3 ranks that waited
for a late one over 4 H200s (benchmarks/NOTES.md, runs 56-57).

Found once in the driver (``libcuda.so.1``, through ctypes; ``cuStream{Write,Wait}Value64_v2``, CUDA 12+):
:func:`available` is False where they are missing (a CPU-only machine, an older driver), and the callers keep
their barrier kernels.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["available", "wait_at_least", "write"]

_WAIT_VALUE_GEQ = 0x0
_WRITE_VALUE_DEFAULT = 0x0
"""A memory barrier before the write: the stream's earlier work (its copies) is visible before the value is."""


@functools.cache
def _driver() -> tuple[Any, Any] | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        write, wait = lib.cuStreamWriteValue64_v2, lib.cuStreamWaitValue64_v2
    except (OSError, AttributeError):
        return None
    for function in (write, wait):
        function.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint)
        function.restype = ctypes.c_int
    return write, wait


def available() -> bool:
    """Whether this process can use stream memory operations (the driver has them)."""
    return _driver() is not None


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"fsdp_compile: {what} failed with CUDA driver error {result}")


def write(stream: int, address: int, value: int) -> None:
    """On ``stream`` (a ``cudaStream_t``, e.g. ``torch.cuda.current_stream().cuda_stream``), after its earlier
    work: write the 64-bit ``value`` at device ``address``."""
    _check(_driver()[0](stream, address, value, _WRITE_VALUE_DEFAULT), "cuStreamWriteValue64")  # type: ignore[index]


def wait_at_least(stream: int, address: int, value: int) -> None:
    """``stream``'s later work waits until the 64-bit value at device ``address`` is at least ``value``."""
    _check(_driver()[1](stream, address, value, _WAIT_VALUE_GEQ), "cuStreamWaitValue64")  # type: ignore[index]
