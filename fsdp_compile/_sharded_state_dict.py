"""Sharded state dicts, FSDP2's contract: ``model.state_dict()`` holds, for every sharded parameter, a
``ShardedTensor`` of the parameter's full shape whose local shards are views of this rank's piece;
``torch.distributed.checkpoint`` (DCP) saves and loads them, resharding to any world size, and
``model.load_state_dict()`` accepts them (and full tensors, e.g. an unsharded model's ``state_dict()``).
:func:`sharded_optimizer_state_dict` / :func:`load_sharded_optimizer_state_dict` do the same for the
optimizer.

A rank's piece is a contiguous range of the row-major flattened parameter: it is cut into boxes (a
partial first row, whole rows, a partial last row, recursively), each a contiguous view of the piece.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile._callers import caller
from fsdp_compile._layout import ParamSlot
from fsdp_compile._unit import UnitState, sharded_units

__all__ = [
    "install_state_dict_hooks",
    "load_sharded_optimizer_state_dict",
    "local_state_dict",
    "sharded_optimizer_state_dict",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a block of a tensor."""

_raw = threading.local()


@contextmanager
def local_state_dict() -> Iterator[None]:
    """Within it, ``state_dict()`` of a sharded module gives the pieces themselves (1-D, this rank's)."""
    _raw.on = True
    try:
        yield
    finally:
        _raw.on = False


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Cut the elements ``[start, stop)`` of a row-major tensor of ``shape`` into blocks, in order, each of
    them contiguous in memory."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    first, end = start // inner, -(-stop // inner)  # rows touched: [first, end)
    if start % inner == 0 and stop % inner == 0:
        return [((first, *rest), (end - first, *shape[1:]))]
    if end - first == 1:
        return [((first, *o), (1, *s)) for o, s in boxes(shape[1:], start - first * inner, stop - first * inner)]
    out = []
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in boxes(shape[1:], start % inner, inner)]
        first += 1
    full_end = stop // inner
    if full_end > first:
        out.append(((first, *rest), (full_end - first, *shape[1:])))
    if stop % inner:
        out += [((full_end, *o), (1, *s)) for o, s in boxes(shape[1:], 0, stop % inner)]
    return out


def _sharded(unit: UnitState, slot: ParamSlot, local: torch.Tensor) -> Any:
    """A ShardedTensor of ``slot``'s shape whose local shards are views of ``local`` (this rank's piece)."""
    if not slot.shape:
        raise NotImplementedError(f"sharded state dicts of 0-dimensional parameters ({slot.names[0]}): use full_state_dict")
    metadata, shards = [], []
    for rank in range(unit.world_size):
        start, stop = unit.layout.flat_range(slot, rank)
        placement = f"rank:{dist.get_global_rank(unit.group, rank)}/{local.device}"
        offset = 0
        for offsets, sizes in boxes(slot.shape, start, stop):
            meta = _internals.ShardMetadata(shard_offsets=list(offsets), shard_sizes=list(sizes), placement=placement)
            metadata.append(meta)
            if rank == unit.rank:
                numel = math.prod(sizes)
                shards.append(_internals.Shard(local[offset : offset + numel].view(sizes), meta))
                offset += numel
    return _internals.sharded_tensor(shards, metadata, slot.shape, local.dtype, unit.group)


def _local(unit: UnitState, slot: ParamSlot, key: str, value: Any) -> torch.Tensor:
    """This rank's piece of ``value``: a ShardedTensor laid out as this model is, or a full tensor."""
    if _internals.is_sharded_tensor(value):
        start, stop = unit.layout.flat_range(slot, unit.rank)
        got = [(tuple(s.metadata.shard_offsets), tuple(s.metadata.shard_sizes)) for s in value.local_shards()]
        if got != boxes(slot.shape, start, stop):
            raise ValueError(
                f"state_dict[{key!r}] is sharded for another world size or layout: load it with "
                "torch.distributed.checkpoint.load(model.state_dict(), ...) (which reshards), then load_state_dict"
            )
        parts = [s.tensor.reshape(-1) for s in value.local_shards()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=value.dtype, device=unit.flat.device)
    if tuple(value.shape) != slot.shape:
        raise ValueError(f"state_dict[{key!r}] has shape {tuple(value.shape)}, the parameter's is {slot.shape}")
    return unit.local_part(slot, value)


def _slots_by_name(module: nn.Module, prefix: str = "") -> dict[str, tuple[UnitState, ParamSlot]]:
    return {prefix + name: (unit, p.slot) for unit in sharded_units(module) for p in unit.pieces for name in p.slot.names}


def _to_sharded(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of the sharded root: pieces -> ShardedTensors of the parameters' shapes. Refused to
    Hugging Face's and peft's ``save_pretrained``, which would write ShardedTensors as tensors."""
    if getattr(_raw, "on", False):
        return
    saver = caller(("transformers",), "save_pretrained".__eq__) or caller(("peft",), "save_pretrained".__eq__)
    if saver is not None:
        raise RuntimeError(
            "save_pretrained() of a model sharded by fsdp_compile writes full tensors: pass them, "
            "state_dict=fsdp_compile.full_state_dict(model, rank0_only=True) (on every rank, then save_pretrained on "
            "rank 0; trainable_only=True for peft's adapters), or write the model with "
            "fsdp_compile.save_safetensors(model, directory) on every rank"
        )
    for key, (unit, slot) in _slots_by_name(module, prefix).items():
        if key in state_dict:
            state_dict[key] = _sharded(unit, slot, state_dict[key])


def _from_sharded(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any, *args: Any) -> None:
    """Load-state-dict pre-hook of the sharded root: ShardedTensors or full tensors -> this rank's pieces. A
    tied weight loads from any one of its names (Hugging Face checkpoints hold only one)."""
    if local_metadata.get("assign_to_params_buffers"):
        raise ValueError(
            "load_state_dict(..., assign=True) would replace the sharded pieces by new tensors, cut off from the "
            "flat shards the model reads: load with assign=False (the default)"
        )
    slots = _slots_by_name(module, prefix)
    for key, (_, slot) in slots.items():
        given = [prefix + name for name in slot.names if prefix + name in state_dict]
        if key not in state_dict and given:
            state_dict[key] = state_dict[given[0]]
    for key, (unit, slot) in slots.items():
        if key in state_dict:
            state_dict[key] = _local(unit, slot, key, state_dict[key])


def install_state_dict_hooks(module: nn.Module) -> None:
    """Make ``module.state_dict()`` sharded and ``module.load_state_dict()`` accept it (``shard()`` calls this)."""
    module.register_state_dict_post_hook(_to_sharded)
    module.register_load_state_dict_pre_hook(_from_sharded)


def _per_element(unit: UnitState, slot: ParamSlot, value: Any) -> bool:
    """An optimizer state shaped like the parameter's piece (exp_avg, ...), not a scalar (step)."""
    start, stop = unit.layout.flat_range(slot, unit.rank)
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == stop - start


def sharded_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state for ``torch.distributed.checkpoint``, flat (``"state.<param>.<key>"``,
    ``"param_groups.<param>.<key>"``, as ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``
    gives it), with every state shaped like its parameter as a ShardedTensor of the parameter's full shape.
    An optimizer without state yet gets one first (a step with zero gradients and learning rate 0), so that
    ``dcp.load`` has tensors to fill."""
    slots = _slots_by_name(module)
    with _reads_give_pieces(module):
        osd = _internals.get_optimizer_state_dict(module, optimizer, options=_internals.flat_optimizer_state())
    return {key: _sharded(*slots[name], v) if (name := _state_param(key)) and _per_element(*slots[name], v) else v
            for key, v in osd.items()}


def load_sharded_optimizer_state_dict(
    module: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]
) -> None:
    """Load what :func:`sharded_optimizer_state_dict` gave (after ``torch.distributed.checkpoint.load`` filled
    it, from a checkpoint of any world size) into ``optimizer``."""
    slots = _slots_by_name(module)
    local = {key: _local(*slots[name], key, v) if (name := _state_param(key)) and _internals.is_sharded_tensor(v) else v
             for key, v in state_dict.items()}
    with _reads_give_pieces(module):
        _internals.set_optimizer_state_dict(module, optimizer, local, options=_internals.flat_optimizer_state())


@contextmanager
def _reads_give_pieces(module: nn.Module) -> Iterator[None]:
    """DCP's state-dict helpers read every parameter by name, only to map the names: within, a read gives the piece
    (no all-gather)."""
    states = sharded_units(module)
    for state in states:
        state.outside = lambda slot, state=state: state.piece(slot).param
    try:
        yield
    finally:
        for state in states:
            state.outside = None


def _state_param(key: str) -> str | None:
    """The parameter of a flat optimizer-state key ``state.<param>.<key>``, or None (``param_groups...``)."""
    return key.removeprefix("state.").rpartition(".")[0] if key.startswith("state.") else None
