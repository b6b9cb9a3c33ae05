"""``save_safetensors``: a sharded model's weights as a Hugging Face safetensors directory, written by one rank
one unit at a time, so that ``from_pretrained`` reads them and no rank holds more than one unit in full.

Loading goes the other way through DCP's own reader (``HuggingFaceStorageReader``; docs/checkpointing.md,
"Loading"). Saving does not go through DCP's ``HuggingFaceStorageWriter``: its files hold one block per
tensor per rank, and a rank's part of a parameter here is up to three blocks (a partial row, whole rows, a
partial row), which its consolidation merges wrongly.
"""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile._sharded_state_dict import local_state_dict
from fsdp_compile._state_dict import is_group_rank0
from fsdp_compile._unit import sharded_units

__all__ = ["save_safetensors"]

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"


@torch.no_grad()
def save_safetensors(module: nn.Module, directory: str | os.PathLike[str]) -> None:
    """Write the sharded ``module``'s full parameters and persistent buffers to ``directory`` as Hugging Face
    does: ``model-0000i-of-0000n.safetensors``, one file per unit (the buffers in the last), and
    ``model.safetensors.index.json``. A tied weight is written once, under its first name (``save_pretrained``
    keeps the same one). A collective: call it on every rank; rank 0 of the group writes, and every rank
    returns once the directory is complete. Write the config beside it yourself (a Hugging Face model:
    ``model.config.save_pretrained(directory)`` on that rank)."""
    from safetensors.torch import save_file

    units = sharded_units(module)
    writer = is_group_rank0(module)
    if writer:
        os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    sharded = {id(piece.param) for unit in units for piece in unit.pieces}
    with local_state_dict():
        buffers = {k: v.detach() for k, v in module.state_dict(keep_vars=True).items() if id(v) not in sharded}
    for i, unit in enumerate(units, start=1):
        values = unit.all_gather_params_nograd()
        if not writer:
            continue
        tensors = {piece.slot.names[0]: value.to("cpu").contiguous() for piece, value in zip(unit.pieces, values)}
        if i == len(units):
            tensors.update({k: v.to("cpu").contiguous() for k, v in buffers.items()})
        name = f"model-{i:05d}-of-{len(units):05d}.safetensors"
        save_file(tensors, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if writer:
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        log.info("fsdp_compile.save_safetensors: %d tensors, %d bytes, in %d files in %s", len(weight_map), total,
                 len(units), directory)
    for group in (units[0].group, units[0].replicate_group):
        if group is not None:
            dist.barrier(group=group)
