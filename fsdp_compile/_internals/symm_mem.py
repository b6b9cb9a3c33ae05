"""Symmetric memory (``torch.distributed._symmetric_memory``, a CUDA build's), detected once, when first used:
a CPU build, or a torch without a function used here, raises :class:`MissingTorchFeature` naming what is missing
and the route that needs none (``all_gather="nccl"``).

Shim: ``enable_symm_mem_for_group`` is deprecated (FutureWarning) on 2.11 and 2.13, but Inductor still gates
its symmetric-memory features on ``is_symm_mem_enabled_for_group``: :func:`_enabled`.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType
from typing import Any

import torch

from fsdp_compile._internals import _missing
from fsdp_compile._internals import register_work as _register_work

__all__ = ["backend_stream", "module", "register_work", "slab", "workspace"]


@functools.cache
def module() -> ModuleType:
    """torch's symmetric-memory module, checked (once) for what the copy-engine all-gather uses."""
    try:
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as e:
        raise _missing("torch.distributed._symmetric_memory (a CUDA build of torch)", "use all_gather='nccl'") from e
    needed = ("_SymmetricMemory", "rendezvous", "get_symm_mem_workspace", "_get_backend_stream", "Work")
    missing = [n for n in needed if not hasattr(symm_mem, n)]
    if not hasattr(torch._C._distributed_c10d, "_register_work"):
        missing.append("torch._C._distributed_c10d._register_work")
    if missing:
        raise _missing(f"symmetric-memory functions ({', '.join(missing)})", "use all_gather='nccl'")
    return symm_mem


def _enabled(group_name: str) -> ModuleType:
    """The symmetric-memory module, with ``group_name`` enabled where 2.11/2.13 still check it (Inductor's
    features check ``is_symm_mem_enabled_for_group``; ``enable_symm_mem_for_group`` warns it is deprecated)."""
    symm_mem = module()
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    is_enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", None)
    if enable is not None and is_enabled is not None and not is_enabled(group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)
    return symm_mem


def workspace(group_name: str, nbytes: int) -> Any:
    """The group's symmetric workspace of at least ``nbytes`` (a ``_SymmetricMemory``; a collective)."""
    return _enabled(group_name).get_symm_mem_workspace(group_name, nbytes)


def slab(group_name: str, device: torch.device, nbytes: int) -> tuple[torch.Tensor, Any]:
    """A symmetric allocation of ``nbytes`` on ``device`` and its handle (``rendezvous``: a collective). Not from
    the implicit pool ``symm_mem.empty`` allocates from (2.11, 2.13): a segment freed into it comes back at the
    same address, and ``rendezvous`` of that address returns the handle cached for the earlier allocation, with
    no collective and the peers' mappings of the time (a process group made again under the same name included);
    ranks that disagree on whether they hit that cache hang. Freed, this allocation is released (unmapped)."""
    symm_mem = _enabled(group_name)
    memory = symm_mem._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
    return memory, symm_mem.rendezvous(memory, group_name)


def backend_stream() -> torch.cuda.Stream:
    """The side stream symmetric memory's own operations run on."""
    return module()._get_backend_stream()


def register_work(output: torch.Tensor) -> None:
    """Register a symmetric-memory work object (its CUDA event recorded on the current stream) for
    ``output``: the graph's ``wait_tensor(output)`` then makes the compute stream wait for it."""
    _register_work(output, module().Work())
