"""User-facing configuration: mixed precision for ``shard()`` and the backend's options."""

from __future__ import annotations

import os
import warnings
from dataclasses import InitVar, dataclass
from typing import Literal

import torch

__all__ = ["BackendConfig", "MixedPrecision"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes of the collectives; the shards (the optimizer's main weights) keep the model's dtype. Applies to
    every floating-point parameter group (a unit holding float32 adapters beside a bf16 base casts both); integer
    and bool parameters are gathered in their own dtype."""

    param_dtype: torch.dtype | None = None
    """Dtype the unit's flat shard is cast to before its all-gather; the forward and backward compute in
    it. ``None``: the shard's own dtype (no cast)."""

    reduce_dtype: torch.dtype | None = None
    """Dtype the gradients are averaged over the ranks in. ``None``: ``param_dtype`` (or the shard's dtype
    when that is ``None`` too). The reduced gradient is cast back to the shard's dtype before it reaches the
    optimizer."""

    exchange_grads_in_param_dtype: bool = True
    """When ``reduce_dtype`` is wider than ``param_dtype`` (e.g. bf16 compute, fp32 reduce): the backward
    computes the gradients in ``param_dtype``, so they are exchanged as they are (an all-to-all: each rank
    receives every rank's part of its shard) and summed in ``reduce_dtype`` by the receiver. The sums are
    those of a reduce-scatter in ``reduce_dtype`` (bitwise for 2 ranks; summation order may differ for more)
    at half the bytes for bf16/fp32. ``False``: cast to ``reduce_dtype`` and reduce-scatter (FSDP2's way;
    prefer it across many nodes, where NCCL's ring reduce-scatter scales better than an all-to-all).
    Measured: docs/measurements.md."""

    def __post_init__(self) -> None:
        _check_bool("MixedPrecision.exchange_grads_in_param_dtype", self.exchange_grads_in_param_dtype)
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            if dtype is None:
                continue
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
                raise TypeError(
                    f"MixedPrecision.{field} must be None or a floating-point dtype of at least 16 bits "
                    f"(torch.bfloat16, torch.float16, torch.float32, torch.float64), got {dtype!r}"
                )


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Options of ``fsdp_compile.backend(**options)``."""

    compiler: Literal["inductor", "aot_eager"] = "inductor"
    """What compiles the forward and backward graphs after the passes: Inductor (the default), or
    ``"aot_eager"``, which runs the same AOT graphs op by op (fast to build; for debugging and tests)."""

    overlap: bool = True
    """Run the ``schedule_overlap`` pass (prefetch all-gathers, sink waits, overlap gradient reductions).
    ``False`` keeps each collective where its result is first needed (for A/B measurements)."""

    prefetch: int = 1
    """How many units ahead an all-gather is issued (forward, and in reverse order in backward). Each unit
    of prefetch keeps one more gathered unit alive."""

    max_inflight_grad_reductions: int = 2
    """Gradient reductions (reduce-scatters, or all-to-alls: see ``MixedPrecision``) allowed in flight at
    once in backward; each holds its unit's gradient buffer, in the dtype it travels in, until it is waited
    for."""

    all_gather: Literal["nccl", "copy_engine", "auto"] = "auto"
    """How the units' all-gathers run on GPUs. ``"nccl"``: NCCL kernels (they hold SMs while they run).
    ``"copy_engine"``: peer-to-peer memcpys through symmetric memory, on the GPUs' copy engines, leaving
    the SMs to the matmuls they overlap with (``lowering/lower_to_copy_engines.py``). Needs CUDA tensors, a
    torch with symmetric memory, and GPUs with peer access (NVLink). ``"auto"`` (the default): per compiled
    graph, the route measured faster for its groups' size (copy engines over 2 or 4 ranks on one host, NCCL
    otherwise: ``lowering/choose_route.py``), NCCL wherever the copy engines cannot run (CPU tensors: gloo);
    the choice and its reason are logged (logger ``fsdp_compile``, and the ``fsdp_compile_all_gather_route``
    artifact)."""

    grad_reduce: Literal["nccl", "copy_engine", "auto"] = "auto"
    """How the units' gradient exchanges run on GPUs (the all-to-alls of gradients in ``param_dtype``, summed in
    ``reduce_dtype`` by the receiver: ``MixedPrecision.exchange_grads_in_param_dtype``). ``"nccl"``: NCCL's
    all-to-all kernels. ``"copy_engine"``: each rank pushes each peer's part of its gradient into that peer's
    slot of the memory plan (peer-to-peer memcpys into symmetric memory, on the copy engines), so that no
    collective holds SMs in backward; needs ``memory_plan=True`` and what ``all_gather="copy_engine"`` needs,
    and refuses units that reduce-scatter instead (``reduce_dtype == param_dtype``, or the exchange switched
    off). ``"auto"`` (the default): per compiled graph, by its groups' size, copy engines over 2 or 4 ranks on
    one host, NCCL otherwise and without the memory plan (``lowering/choose_route.py``; reduce-scatters stay on
    NCCL); logged like ``all_gather``'s, the artifact ``fsdp_compile_grad_reduce_route``."""

    memory_plan: bool = True
    """Apply the memory plan (``passes/plan_memory.py``): every all-gather whose output does not outlive its
    graph, and every gradient exchange, writes into a persistent slot of its process group's slab, sized by
    the planner from the live ranges, instead of a buffer of its own. ``False``: planned and logged only (for
    A/B measurements)."""

    gradients_in_place: bool = True
    """Write each unit's parameter gradients straight into the flat gradient its reduction sends
    (``passes/write_gradients_in_place.py``): each weight gradient's matmul writes its slice, so no kernel
    copies the unit's gradient into place. ``False``: every gradient in a buffer of its own and one copy into
    the flat gradient (for A/B measurements)."""

    regions: bool = True
    """Compile each distinct unit body once: units whose code, parameter layout and inputs agree share one traced
    forward body and one backward body (``torch.compiler.nested_compile_region``), which each unit's call runs,
    while every unit's all-gather, gradient reduction, prefetch and memory plan stay in the step's graphs, unit by
    unit ([Note: shared bodies] in docs/architecture.md). The first step's compile then grows little with the
    model's depth. ``False``: the whole step as one graph, every unit's code written out (Inductor may fuse across
    the units' edges). A torch without nested compile regions compiles the whole step (logged once)."""

    cudagraphs: bool = False
    """Run the forward and backward graphs as CUDA graphs (Inductor's ``triton.cudagraphs``): one replay
    per graph instead of one launch per kernel and collective. For steps the host cannot enqueue as fast
    as the GPUs run them (small batches: a step is launch-bound when its host time is close to its GPU
    time). Call ``torch.compiler.cudagraph_mark_step_begin()`` at the start of every training step, and
    read a step's outputs (e.g. ``loss.item()``) before the next step, which reuses their memory. Graphs
    on CPU tensors run without (Inductor logs why). Needs ``compiler="inductor"``."""

    dump: str | os.PathLike[str] | None = None
    """A folder to write what each compile did into (the passes' graphs before and after, their plans, the
    unit table, the memory plan, Inductor's output code; ``fsdp_compile/_dump.py`` says where), for
    ``python -m fsdp_compile explain DIR``. The environment variable ``FSDP_COMPILE_DUMP=DIR`` does the same
    for every compile of the process. While dumping, Inductor's caches are skipped."""

    max_inflight_reduce_scatters: InitVar[int | None] = None
    """Deprecated name of ``max_inflight_grad_reductions`` (it counts all-to-alls too); still accepted,
    with a FutureWarning."""

    def __post_init__(self, max_inflight_reduce_scatters: int | None) -> None:
        if max_inflight_reduce_scatters is not None:
            if self.max_inflight_grad_reductions != 2:
                raise TypeError(
                    "give max_inflight_grad_reductions or its old name max_inflight_reduce_scatters, not both"
                )
            warnings.warn(
                "fsdp_compile: max_inflight_reduce_scatters is deprecated (it counts all-to-alls too): "
                "use max_inflight_grad_reductions",
                FutureWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "max_inflight_grad_reductions", max_inflight_reduce_scatters)
        _check_choice("compiler", self.compiler, ("inductor", "aot_eager"))
        _check_choice("all_gather", self.all_gather, ("nccl", "copy_engine", "auto"))
        _check_choice("grad_reduce", self.grad_reduce, ("nccl", "copy_engine", "auto"))
        for name in ("overlap", "memory_plan", "gradients_in_place", "regions", "cudagraphs"):
            _check_bool(name, getattr(self, name))
        _check_int("prefetch", self.prefetch, minimum=0, meaning="units issued ahead")
        _check_int(
            "max_inflight_grad_reductions", self.max_inflight_grad_reductions, minimum=1, meaning="reductions in flight"
        )
        if self.dump is not None and not isinstance(self.dump, (str, os.PathLike)):
            raise TypeError(f"dump must be a folder (a str or os.PathLike), got {self.dump!r}")
        if self.grad_reduce == "copy_engine" and not self.memory_plan:
            raise ValueError(
                "grad_reduce='copy_engine' pushes gradients into the peers' slots of the memory plan, which "
                "memory_plan=False does not apply: keep memory_plan=True, or use grad_reduce='nccl'"
            )
        if self.cudagraphs and self.compiler != "inductor":
            raise ValueError(
                "cudagraphs=True needs compiler='inductor' (CUDA graphs are an Inductor feature), "
                f"got compiler={self.compiler!r}"
            )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int, meaning: str) -> None:
    """An int option: a bool is refused too (``isinstance(True, int)`` holds, but ``prefetch=True`` is a
    mistake, not 1)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum} ({meaning}), got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum} ({meaning}), got {value!r}")
