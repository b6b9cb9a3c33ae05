"""What must happen before ``destroy_process_group()``, which torch gives no hook for."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fsdp_compile._internals import _need

__all__ = ["before_destroy", "release_cuda_graphs"]


class _BeforeDestroy:
    """Rides on ``_world.comms``: ``destroy_process_group()`` of the default group calls ``finalize()`` on each
    of those (torchcomms communicators) before it shuts the process groups down, then empties the list."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[], None]] = {}

    def finalize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # nothing in flight still uses what the callbacks free
        for callback in self.callbacks.values():
            callback()


def before_destroy(name: str, callback: Callable[[], None]) -> bool:
    """Have the next ``destroy_process_group()`` of the default group (as a script ends) call ``callback``
    first, once per ``name``, in the order first asked; False where this torch has no place for it. torch has
    no hook there; the list of communicators it finalizes first is the one place that runs."""
    comms = getattr(_need("torch.distributed.distributed_c10d", "_world"), "comms", None)
    if not isinstance(comms, list):
        return False
    hook = next((comm for comm in comms if isinstance(comm, _BeforeDestroy)), None)
    if hook is None:
        hook = _BeforeDestroy()
        comms.append(hook)
    hook.callbacks.setdefault(name, callback)
    return True


def release_cuda_graphs() -> None:
    """Free Inductor's CUDA graphs. Before ``destroy_process_group()`` (``before_destroy``): NCCL's teardown of a
    communicator waits for every live CUDA graph that captured its kernels, so every rank hung there after
    training with CUDA graphs (pytorch#115388; docs/measurements.md)."""
    _need("torch._inductor.cudagraph_trees", "reset_cudagraph_trees")()
