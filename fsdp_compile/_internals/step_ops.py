"""The library's step ops (those compiled graphs call at every step): how they are defined with the dispatcher
(:func:`step_op`) and how Inductor lowers them. Lowerings are registered when the op is defined;
``GraphPass.uuid()`` hashes this file, so the FX graph cache never reuses code lowered another way."""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from fsdp_compile._internals import _need

__all__ = ["lower_with_persistent_output", "step_op"]

log = logging.getLogger(__name__)
_virtualized: Any = _need("torch._inductor.virtualized", "V")
"""Inductor's virtualized state: ``.graph`` is the graph being lowered."""
_libraries: dict[str, Any] = {}


def step_op(
    qualname: str, schema: str, fake: Callable[..., Any], device_type: str | None = None, *, python: str | None = None
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: the function becomes the op ``qualname`` (``"ns::name"``) with ``schema`` (its arguments and
    result, e.g. ``"(Tensor x, *, Tensor(a!) out) -> ()"``), for every device or ``device_type`` only, with
    ``fake`` computing its output's shape under FakeTensorMode; returns the op (``OpOverload``). For ops that
    compiled graphs call at every step: the function is registered straight with the dispatcher, without
    ``torch.library.custom_op``'s autograd and version-counter kernels, which double the host time of a call.
    The ops run inside compiled graphs only, on tensors that need no gradient. An op that writes an argument in
    place (``Tensor(a!)``) is lowered by Inductor after every read of that argument's old value
    (:func:`_lower_as_mutation`).

    ``python``: the line Inductor's Python wrapper code runs for a call instead of the op, a format string over
    the schema's argument names (``"extern_kernels.mm({a}, {b}, out={out})"``), for ops that run many times a
    step and whose body is one torch call: calling the op costs ~3-6 µs of host time more than that call (the
    dispatcher, then the function). The line must do what the function does; the function stays the op
    everywhere else (eager, FX graphs, Inductor's C++ wrapper, a torch that cannot replace the call:
    :func:`_write_as`)."""

    def define(impl: Callable[..., Any]) -> Any:
        namespace, name = qualname.split("::")
        if namespace not in _libraries:
            _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
        library = _libraries[namespace]
        library.define(name + schema)
        library.impl(name, impl, "CompositeExplicitAutograd" if device_type is None else device_type.upper())
        torch.library.register_fake(qualname, fake, lib=library)
        op = getattr(getattr(torch.ops, namespace), name).default
        written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        if written:
            _lower_as_mutation(op, written)
        if python is not None:
            _write_as(op, python)
        return op

    return define


def lower_with_persistent_output(op: Any) -> None:
    """Have Inductor run ``op`` as a fallback kernel whose output memory it never reuses for its own buffers
    nor writes in place: the op hands out persistent memory (a memory-plan slot) that outlives the graph."""

    def lower(fallback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = fallback(*args, **kwargs)
        _virtualized.graph.never_reuse_buffers.add(result.get_name())
        return result

    _register(op, lower)


def _lower_as_mutation(op: Any, written: list[str]) -> None:
    """Have Inductor run ``op``, which writes its arguments named ``written`` in place, as a fallback kernel after
    every read of their old values. Inductor's fallback for such an op marks an argument mutated only after it
    has registered the kernel; the mark computes the reads of the old value that Inductor had left lazy (a
    pointwise op to be fused into a later consumer), which then land after the kernel and read the new value
    (2.11 and 2.13; seen as a norm's weight read after the next all-gather into its slot under activation
    checkpointing). Inductor's own in-place collectives mark their buffers first; so does this lowering."""
    positions = {a.name: i for i, a in enumerate(op._schema.arguments)}

    def lower(fallback: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        for name in written:
            argument = kwargs[name] if name in kwargs else args[positions[name]]
            _virtualized.graph.mark_buffer_mutated(argument.get_name())
        return fallback(*args, **kwargs)

    _register(op, lower)


def _write_as(op: Any, line: str) -> None:
    """Have Inductor's Python wrapper write ``line``, formatted with the call's arguments as its code names them
    (by the schema's names), for each call of ``op`` (a fallback kernel): through Inductor's table of custom
    fallback codegen (2.11 and 2.13), keyed by the kernel's name as Inductor spells it. A torch without that table
    keeps calling the op."""
    try:
        module = importlib.import_module("torch._inductor.codegen.custom_extern_kernel_codegen")
        table, custom = module.CUSTOM_EXTERN_KERNEL_CODEGEN, module.CustomCodegen
    except (ImportError, AttributeError):
        log.info("this torch cannot replace a fallback kernel's call: %s stays a call of the op", op)
        return
    names = [a.name for a in op._schema.arguments]

    def write(node: Any, writeline: Callable[[str], None]) -> None:
        arguments = dict(zip(names, node.codegen_args()))  # the positional arguments (first in the schema)
        arguments.update(kwarg.split("=", 1) for kwarg in node.codegen_kwargs())  # "name=code"
        writeline(line.format(**arguments))

    table[f"{op.__module__.replace('._ops.', '.ops.')}.{op.__name__}"] = custom(python=write)


def _register(op: Any, lower: Callable[..., Any]) -> None:
    """``lower(fallback, *args, **kwargs)`` as Inductor's lowering of ``op``, ``fallback`` its fallback kernel."""
    lowering = importlib.import_module("torch._inductor.lowering")
    fallback = lowering.fallback_handler(op)
    lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(lower, fallback))
