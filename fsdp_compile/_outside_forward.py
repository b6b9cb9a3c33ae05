"""Full parameters read outside their unit's forward, after ``shard()``. Outside the model's forward a read raises
(:func:`read_outside_forward_message`): it would be an all-gather on this rank alone. Inside the model's forward
(another unit's code) and in ``summon_full_params(writeback=False)`` reads work and in-place writes raise
(:func:`outside_forward`): FSDP2's habit of initialising after sharding (``nn.init.normal_(m.weight)``,
``m.weight.copy_(w)``) would otherwise change a gathered copy, not the shard, and be lost without a word."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from fsdp_compile._callers import caller
from fsdp_compile._internals import no_torch_function_subclass

__all__ = ["metadata_reads", "outside_forward", "read_in_backward_message", "read_outside_forward"]

_INIT_FIX = (
    "Initialise the parameters with fsdp_compile.init_parameters(model, init_fn=...) (init_fn sees full parameters, "
    "and what it writes reaches the shards), load values with fsdp_compile.load_full_state_dict(model, state_dict) "
    "or model.load_state_dict(...), or change them inside `with fsdp_compile.summon_full_params(model, "
    "writeback=True):` on every rank"
)


_reads = threading.local()


@contextlib.contextmanager
def metadata_reads() -> Iterator[None]:
    """Within it (a sharded module's ``extra_repr``), a read outside forward gives a meta tensor of the parameter's
    shape and dtype: printing a model (``RMSNorm((4096,))``) needs no values, nor the other ranks."""
    _reads.metadata = True
    try:
        yield
    finally:
        _reads.metadata = False


def read_outside_forward(piece: torch.Tensor, shape: tuple[int, ...], names: tuple[str, ...]) -> torch.Tensor:
    """A read of the full parameter ``names`` (tied: several; of ``shape``) outside the model's forward: raise, saying
    how to read it.
    Except where no value is needed: in ``metadata_reads``, a meta tensor; in ``torch.distributed.checkpoint``'s
    model state-dict helpers, which read every parameter only to map names (the values come from ``state_dict()``,
    sharded), and in torchao's ``precompute_float8_dynamic_scale_for_fsdp`` (torchtitan calls it after each optimizer
    step; it looks for FSDP2's float8 weights), this rank's ``piece``."""
    if getattr(_reads, "metadata", False):
        return torch.empty(shape, dtype=piece.dtype, device="meta")
    dcp = caller(("distributed", "checkpoint", "state_dict.py"), lambda name: name.startswith(("get_", "set_")))
    if dcp in ("get_model_state_dict", "set_model_state_dict"):
        return piece
    if caller(("torchao", "float8", "fsdp_utils.py"), lambda name: name == "precompute_float8_dynamic_scale_for_fsdp"):
        return piece  # a plain tensor, not FSDP2's DTensor: nothing to precompute (each float8 gather computes its own)
    if dcp is not None:
        raise RuntimeError(
            f"torch.distributed.checkpoint.state_dict.{dcp}() does not know fsdp_compile's sharding: it would give "
            "the optimizer's state as this rank's 1-D pieces, which DCP saves as if every rank held the same tensor "
            "(and fails to load: 'Size mismatch'). Use model.state_dict() / model.load_state_dict() (or DCP's "
            "get_model_state_dict / set_model_state_dict) for the model and fsdp_compile.sharded_optimizer_state_dict"
            "(model, optimizer) / fsdp_compile.load_sharded_optimizer_state_dict(model, optimizer, state_dict) for the "
            "optimizer; fsdp_compile.full_state_dict / full_optimizer_state_dict for full tensors"
        )
    tied = f" (tied: {', '.join(names[1:])})" if len(names) > 1 else ""
    raise RuntimeError(
        f"{names[0]}{tied} was read outside the sharded model's forward: its full value is gathered from every "
        "rank, and a read on one rank alone would wait for the others forever. Read or change full parameters "
        "inside `with fsdp_compile.summon_full_params(model, writeback=...):` entered on every rank; save them with "
        "fsdp_compile.full_state_dict(model); initialise them with fsdp_compile.init_parameters(model, init_fn=...) "
        "(init_fn sees full parameters); load them with fsdp_compile.load_full_state_dict(model, state_dict) or "
        "model.load_state_dict(...)"
    )


def read_in_backward_message(name: str, unit: str) -> str:
    """The error for a full parameter read in backward outside its unit's ``forward``: activation checkpointing that
    recomputes a part of a unit (fsdp_compile gathers a unit around its module's whole forward only)."""
    return (
        f"{name} was read in backward outside the forward of its unit {unit!r}: activation checkpointing recomputes a "
        "part of the unit (a submodule's forward, or a function), and a unit is gathered for a recompute only around "
        "its module's own forward. Checkpoint whole units: shard with units= naming the checkpointed module's class "
        "(Hugging Face's gradient checkpointing: the decoder layer's), or checkpoint the unit's call "
        "(torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper(unit))"
    )


class _OutsideForward(torch.Tensor):
    fqn: str
    where: str
    fix: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
        written = kwargs.get("out") if isinstance(kwargs.get("out"), cls) else target if _writes(func) else None
        if isinstance(written, cls):
            raise RuntimeError(
                f"in-place write ({getattr(func, '__name__', func)}) to {written.fqn} {written.where}: it would change "
                f"a gathered copy of the parameter, not this rank's shard, and be lost. {written.fix}"
            )
        with no_torch_function_subclass():
            result = func(*args, **kwargs)
        if isinstance(target, cls) and isinstance(result, torch.Tensor) and _aliases(result, target):
            return outside_forward(result, target.fqn, target.where, target.fix)  # a view (.data, .t(), w[0]): too
        return result


def outside_forward(
    full: torch.Tensor,
    fqn: str,
    where: str = "after fsdp_compile.shard(), outside its unit's forward",
    fix: str = _INIT_FIX,
) -> torch.Tensor:
    """``full`` (parameter ``fqn``, gathered), as a tensor whose in-place writes, and its views', raise, saying
    ``where`` the write happened and how to ``fix`` it."""
    wrapped = full.as_subclass(_OutsideForward)
    wrapped.fqn, wrapped.where, wrapped.fix = fqn, where, fix
    return wrapped


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    with no_torch_function_subclass():
        return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_"}
_WRITING_DUNDERS = {"__setitem__"} | {f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")}


def _writes(func: Any) -> bool:
    """Whether ``func`` writes its first argument: an in-place method (``normal_``, ``copy_``, ``nn.init.*_``),
    an augmented or item assignment, an assignment to ``.data``."""
    name = getattr(func, "__name__", "")
    if name == "__set__":  # a property's setter: Tensor.data's writes the values
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    if name.startswith("__"):
        return name in _WRITING_DUNDERS
    return name.endswith("_") and name not in _NOT_WRITES
