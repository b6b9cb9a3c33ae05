"""How Inductor lowers the library's ops: an op that hands out persistent memory, an op that writes an argument in
place. Lowerings are registered when the op's module is imported; ``GraphPass.uuid()`` hashes this file, so the FX
graph cache never reuses code lowered another way."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from fsdp_compile._internals import _need

__all__ = ["lower_as_mutation", "lower_with_persistent_output"]

_virtualized: Any = _need("torch._inductor.virtualized", "V")
"""Inductor's virtualized state: ``.graph`` is the graph being lowered."""


def lower_with_persistent_output(op: Any) -> None:
    """Have Inductor run ``op`` as a fallback kernel whose output memory it never reuses for its own buffers
    nor writes in place: the op hands out persistent memory (a memory-plan slot) that outlives the graph."""

    def lower(fallback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = fallback(*args, **kwargs)
        _virtualized.graph.never_reuse_buffers.add(result.get_name())
        return result

    _register(op, lower)


def lower_as_mutation(op: Any, argument: str = "out") -> None:
    """Have Inductor run ``op``, which writes its ``argument`` in place, as a fallback kernel after every read of
    that argument's old value. Inductor's fallback for such an op marks the argument mutated only after it has
    registered the kernel; the mark computes the reads of the old value that Inductor had left lazy (a pointwise
    op to be fused into a later consumer), which then land after the kernel and read the new value (2.11 and
    2.13; seen as a norm's weight read after the next all-gather into its slot under activation checkpointing).
    Inductor's own in-place collectives mark their buffers first; so does this lowering."""
    position = [a.name for a in op._schema.arguments].index(argument)

    def lower(fallback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        written = kwargs[argument] if argument in kwargs else args[position]
        _virtualized.graph.mark_buffer_mutated(written.get_name())
        return fallback(*args, **kwargs)

    _register(op, lower)


def _register(op: Any, lower: Callable[..., Any]) -> None:
    """``lower(fallback, *args, **kwargs)`` as Inductor's lowering of ``op``, ``fallback`` its fallback kernel."""
    lowering = importlib.import_module("torch._inductor.lowering")
    fallback = lowering.fallback_handler(op)
    lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(lower, fallback))
