"""A full parameter read outside its unit's forward, after ``shard()``: reads work (the unit is gathered for them),
in-place writes raise. FSDP2's habit of initialising after sharding (``nn.init.normal_(m.weight)``,
``m.weight.copy_(w)``) would otherwise change the gathered copy, not the shard, and be lost without a word."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_compile._internals import no_torch_function_subclass

__all__ = ["outside_forward"]


class _OutsideForward(torch.Tensor):
    fqn: str

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")  # nn.init's functions pass it by name
        written = kwargs.get("out") if isinstance(kwargs.get("out"), cls) else target if _writes(func) else None
        if isinstance(written, cls):
            raise RuntimeError(
                f"in-place write ({getattr(func, '__name__', func)}) to {written.fqn} after fsdp_compile.shard(), "
                "outside forward: it would change a gathered copy of the parameter, not this rank's shard, and be "
                "lost. Initialise the parameters with fsdp_compile.init_parameters(model, init_fn=...) (init_fn "
                "sees full parameters, and what it writes reaches the shards), or load values with "
                "fsdp_compile.load_full_state_dict(model, state_dict) or model.load_state_dict(...)"
            )
        with no_torch_function_subclass():
            result = func(*args, **kwargs)
        if isinstance(target, cls) and isinstance(result, torch.Tensor) and _aliases(result, target):
            return outside_forward(result, target.fqn)  # a view (.data, .t(), w[0], .detach()): its writes too
        return result


def outside_forward(full: torch.Tensor, fqn: str) -> torch.Tensor:
    """``full`` (parameter ``fqn``, gathered), as a tensor whose in-place writes, and its views', raise."""
    wrapped = full.as_subclass(_OutsideForward)
    wrapped.fqn = fqn
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
