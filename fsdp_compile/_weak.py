"""Methods handed to tensors' hooks and to eager state without keeping their object alive."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["weak_method"]

P = ParamSpec("P")
R = TypeVar("R")


def weak_method(method: Callable[P, R]) -> Callable[P, R | None]:
    """``method``, called without keeping its object alive (None once the object is gone). For what a unit
    hands to its tensors' hooks and to its own eager state: strong references would make cycles that only
    the garbage collector breaks, late, and a deleted model's shards and process group would outlive it
    (see ``fsdp_compile._unit._units_by_shard``)."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> R | None:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call
