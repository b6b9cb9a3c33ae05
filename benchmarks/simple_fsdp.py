"""SimpleFSDP, written from its description (the ``simplefsdp`` family): parameters as DTensor ``Shard(0)``, a
parametrization redistributes them to ``Replicate`` (bf16 forward, fp32 backward) under a MUST_RECOMPUTE
checkpoint policy (reshard after forward); the benchmark compiles the whole model with Inductor's overlap
scheduling and collective bucketing (on GPUs: ``overlap_config``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts



def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


class _ReplicateComputation(nn.Module):
    """SimpleFSDP's parametrization: a Shard(0) DTensor parameter -> the full local tensor, all-gathered
    in ``param_dtype``, its gradient reduce-scattered (avg) in ``reduce_dtype``; recomputed in backward, never
    saved."""

    def __init__(self, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        super().__init__()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def replicate(self, x: DTensor) -> torch.Tensor:
        full = x.redistribute(placements=(Replicate(),), forward_dtype=self.param_dtype,
                              backward_dtype=self.reduce_dtype)
        return full.to_local(grad_placements=(Partial("avg"),))

    def forward(self, x: DTensor) -> torch.Tensor:
        context = partial(create_selective_checkpoint_contexts, _must_recompute)
        return checkpoint(self.replicate, x, use_reentrant=False, context_fn=context)


def overlap_config() -> dict[str, Any]:
    """Inductor's own overlap scheduling and collective bucketing (needs triton's cost model: GPUs), under the
    settings' names of the torch at hand."""
    from torch._inductor import config

    if not torch.cuda.is_available():
        return {}
    if hasattr(config, "aten_distributed_optimizations"):
        return {
            "aten_distributed_optimizations.enable_overlap_scheduling": True,
            "aten_distributed_optimizations.collective_bucketing": True,
            "aten_distributed_optimizations.insert_overlap_deps": True,
        }
    return {"reorder_for_compute_comm_overlap": True, "bucket_all_gathers_fx": "all",
            "bucket_reduce_scatters_fx": "all"}


def shard(
    model: nn.Module, device_type: str, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> list[nn.Parameter]:
    """Every parameter (tied ones once) made a ``Shard(0)`` DTensor over all ranks and parametrized to be
    replicated where used; the sharded parameters (the optimizer's)."""
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    replicate = _ReplicateComputation(param_dtype, reduce_dtype)
    distributed: dict[nn.Parameter, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param not in distributed:
                distributed[param] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            module._parameters[name] = distributed[param]
            parametrize.register_parametrization(module, name, replicate, unsafe=True)
    return list(distributed.values())
