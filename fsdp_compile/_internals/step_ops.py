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
    qualname: str, schema: str, fake: Callable[..., Any], device_type: str | None = None
) -> Callable[[Callable[..., Any]], Any]:
    """Decorator: the function becomes the op ``qualname`` (``"ns::name"``) with ``schema`` (its arguments and
    result, e.g. ``"(Tensor x, *, Tensor(a!) out) -> ()"``), for every device or ``device_type`` only, with
    ``fake`` computing its output's shape under FakeTensorMode; returns the op (``OpOverload``). For ops that
    compiled graphs call at every step: the function is registered straight with the dispatcher, without
    ``torch.library.custom_op``'s autograd and version-counter kernels, which double the host time of a call;
    and Inductor's code calls the function of an op that returns nothing itself, not the op
    (:func:`_call_directly`). The ops run inside compiled graphs only, on tensors that need no gradient. An op
    that writes an argument in place (``Tensor(a!)``) is lowered by Inductor after every read of that argument's
    old value (:func:`_lower_as_mutation`)."""

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
        if not op._schema.returns:
            _call_directly(op, f"{namespace}_{name}", impl)
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


def _call_directly(op: Any, name: str, impl: Callable[..., Any]) -> None:
    """Have Inductor's Python wrapper call ``impl``, ``op``'s function, for each call of ``op`` (a fallback kernel
    that returns nothing), with the same arguments: ``extern_kernels.<name>(...)``, ``impl`` put in Inductor's
    namespace of extern kernels, which every wrapper imports: the dispatcher's cost per call, paid about 200 times
    a step, is saved (docs/measurements.md, "Host cost"). Through Inductor's table of custom fallback codegen (2.11
    and 2.13), keyed by the kernel's name as Inductor spells it; a torch without it keeps calling the op, as do
    Inductor's C++ wrapper, eager code and FX graphs."""
    try:
        table = importlib.import_module("torch._inductor.codegen.custom_extern_kernel_codegen")
        extern_kernels = importlib.import_module("torch._inductor.select_algorithm").extern_kernels
        codegen, custom = table.CUSTOM_EXTERN_KERNEL_CODEGEN, table.CustomCodegen
    except (ImportError, AttributeError):
        log.info("this torch cannot replace a fallback kernel's call: %s stays a call of the op", op)
        return
    setattr(extern_kernels, name, impl)

    def write(node: Any, writeline: Callable[[str], None]) -> None:
        writeline(f"extern_kernels.{name}({', '.join([*node.codegen_args(), *node.codegen_kwargs()])})")

    codegen[f"{op.__module__.replace('._ops.', '.ops.')}.{op.__name__}"] = custom(python=write)


def _register(op: Any, lower: Callable[..., Any]) -> None:
    """``lower(fallback, *args, **kwargs)`` as Inductor's lowering of ``op``, ``fallback`` its fallback kernel."""
    lowering = importlib.import_module("torch._inductor.lowering")
    fallback = lowering.fallback_handler(op)
    lowering.register_lowering(op, type_promotion_kind=None)(functools.partial(lower, fallback))
