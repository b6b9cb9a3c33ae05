"""User-facing configuration: mixed precision for ``shard()`` and the backend's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["BackendConfig", "MixedPrecision"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Dtypes of the collectives; the shards (the optimizer's main weights) keep the model's dtype."""

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
    prefer it across many nodes, where NCCL's ring reduce-scatter scales better than an all-to-all)."""

    def __post_init__(self) -> None:
        if not isinstance(self.exchange_grads_in_param_dtype, bool):
            raise TypeError(
                f"MixedPrecision.exchange_grads_in_param_dtype must be a bool, got {self.exchange_grads_in_param_dtype!r}"
            )
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
    """Run the ``schedule_overlap`` pass (prefetch all-gathers, sink waits, overlap reduce-scatters).
    ``False`` keeps each collective where its result is first needed (for A/B measurements)."""

    prefetch: int = 1
    """How many units ahead an all-gather is issued (forward, and in reverse order in backward). Each unit
    of prefetch keeps one more gathered unit alive."""

    max_inflight_reduce_scatters: int = 2
    """Gradient reductions (reduce-scatters, or all-to-alls: see ``MixedPrecision``) allowed in flight at
    once in backward; each holds its unit's gradient buffer, in the dtype it travels in, until it is waited
    for."""

    all_gather: Literal["nccl", "copy_engine"] = "nccl"
    """How the units' all-gathers run on GPUs. ``"nccl"``: NCCL kernels (they hold SMs while they run).
    ``"copy_engine"``: peer-to-peer memcpys through symmetric memory, on the GPUs' copy engines, leaving
    the SMs to the matmuls they overlap with (``fsdp_compile/lowering/lower_to_symm_mem.py``). Needs CUDA
    tensors, a torch with symmetric memory, and GPUs with peer access (NVLink)."""

    cudagraphs: bool = False
    """Run the forward and backward graphs as CUDA graphs (Inductor's ``triton.cudagraphs``): one replay
    per graph instead of one launch per kernel and collective. For steps the host cannot enqueue as fast
    as the GPUs run them (small batches: a step is launch-bound when its host time is close to its GPU
    time). Call ``torch.compiler.cudagraph_mark_step_begin()`` at the start of every training step, and
    read a step's outputs (e.g. ``loss.item()``) before the next step, which reuses their memory. Graphs
    on CPU tensors run without (Inductor logs why). Needs ``compiler="inductor"``."""

    def __post_init__(self) -> None:
        if self.compiler not in ("inductor", "aot_eager"):
            raise ValueError(f"compiler must be 'inductor' or 'aot_eager', got {self.compiler!r}")
        if self.all_gather not in ("nccl", "copy_engine"):
            raise ValueError(f"all_gather must be 'nccl' or 'copy_engine', got {self.all_gather!r}")
        if not isinstance(self.cudagraphs, bool):
            raise TypeError(f"cudagraphs must be a bool, got {self.cudagraphs!r}")
        if self.cudagraphs and self.compiler != "inductor":
            raise ValueError(
                "cudagraphs=True needs compiler='inductor' (CUDA graphs are an Inductor feature), "
                f"got compiler={self.compiler!r}"
            )
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (units issued ahead), got {self.prefetch!r}")
        if not isinstance(self.max_inflight_reduce_scatters, int) or self.max_inflight_reduce_scatters < 1:
            raise ValueError(
                f"max_inflight_reduce_scatters must be an int >= 1, got {self.max_inflight_reduce_scatters!r}"
            )
