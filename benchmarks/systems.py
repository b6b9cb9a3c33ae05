"""The systems' set-up: ``build(spec, model, ...)`` turns a fresh model into what the harness steps (the
families and their options: ``specs.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import fsdp_compile
from fsdp_compile._internals import cuda_driver
from fsdp_compile.testing.dist import hsdp_mesh
from fsdp_compile.testing.llama import Llama

import simple_fsdp  # benchmarks/
from specs import FAMILIES, Spec

PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32


@dataclass
class Prepared:
    """A system ready to step."""

    module: nn.Module  # called as module(inputs, targets) -> loss
    params: list[nn.Parameter]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Entered around every step (Inductor settings must hold at the lazy backward compile too)."""
    replicas: int = 1
    """HSDP: ranks holding each gradient element (its norm's squares are summed over every rank)."""
    set_sync: Callable[[bool], None] | None = None
    """``sync_off``: switches gradient sync (off for the micro-batches before the last)."""
    stepping: Callable[[torch.optim.Optimizer], contextlib.AbstractContextManager[Any]] | None = None
    """``step_in_backward``: what the step's last backward runs inside (the optimizer steps there)."""


def _unit_modules(model: Llama) -> list[nn.Module]:
    """The FSDP units besides the root: every block, and the embedding and output projection unless tied."""
    separate = [] if model.cfg.tie_embeddings else [model.tok_embeddings, model.output]
    return [*model.layers, *separate]


def _last_unit(model: Llama) -> nn.Module:
    """The unit holding the output projection: the forward uses it last, the backward first."""
    return model if model.cfg.tie_embeddings else model.output


def _hsdp_mesh(device: torch.device) -> DeviceMesh | None:
    """HSDP as on two nodes: 2 replicas, each sharded over half the ranks (FSDP2's (replicate, shard) mesh)."""
    return hsdp_mesh((2, dist.get_world_size() // 2), device.type)


def _shard(model: Llama, spec: Spec, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    """fsdp_compile.shard as torchtitan shards: every unit resharded after forward but the last
    (``keep_gathered``: none)."""
    units = {id(m) for m in _unit_modules(model)}
    last = _last_unit(model)
    mp = fsdp_compile.MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE,
                                     exchange_grads_in_param_dtype=spec.exchange_grads_in_param_dtype)
    fsdp_compile.shard(model, units=lambda fqn, m: id(m) in units, group=group,
                       mesh=_hsdp_mesh(device) if spec.hsdp else None, mp=mp,
                       reshard_after_forward=False if spec.keep_gathered else lambda fqn, m: m is not last,
                       offload_policy=_offload(spec))


def _offload(spec: Spec) -> OffloadPolicy:
    return CPUOffloadPolicy(pin_memory=True) if spec.offload else OffloadPolicy()


def _compiled(model: Llama, compiler: str, spec: Spec) -> Prepared:
    """The whole model compiled with fsdp_compile's backend; under CUDA graphs each step marks its start."""
    backend = fsdp_compile.backend(compiler=compiler, **spec.backend_options())
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    if not spec.cudagraphs:
        return Prepared(compiled, list(model.parameters()))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(inputs, targets)

    return Prepared(step, list(model.parameters()))  # type: ignore[arg-type]


def _no_comm_bound(spec: Spec, model: Llama, device: torch.device, compiler: str) -> Prepared:
    """fsdp_compile over a group of one rank: the same per-GPU work, no collective."""
    alone, _ = dist.new_subgroups(group_size=1)
    _shard(model, spec, device, group=alone)
    return _compiled(model, compiler, spec)


def _fsdp_compile(spec: Spec, model: Llama, device: torch.device, compiler: str) -> Prepared:
    """fsdp_compile.shard, then the whole model compiled with the spec's backend options; ``barriers=kernels``:
    the copy-engine barriers as symmetric memory's barrier kernels (which spin on an SM while they wait)
    instead of the driver's stream memory operations (``Slab.barrier``), for their A/B."""
    _shard(model, spec, device)
    prepared = dataclasses.replace(_compiled(model, compiler, spec), replicas=2 if spec.hsdp else 1)
    if spec.sync_off:
        prepared.set_sync = partial(fsdp_compile.set_requires_gradient_sync, model)
    if spec.step_in_backward:
        prepared.stepping = partial(fsdp_compile.step_in_backward, model)
    if spec.barriers == "kernels":
        prepared.context = partial(mock.patch.object, cuda_driver, "has_stream_memops", lambda: False)
    return prepared


def _checkpoint_inside(model: Llama) -> None:
    """torchtitan's order for compiled blocks: each block checkpoint-wrapped, then compiled, so Dynamo traces
    the checkpoint and its policy. (The model's own ``checkpoint(block)`` around a compiled block re-runs the
    whole compiled forward in backward: selective checkpointing would silently become full.)"""
    cfg = model.cfg
    if not cfg.checkpoint_blocks:
        return
    policy = cfg.checkpoint_policy
    context = {"context_fn": partial(create_selective_checkpoint_contexts, policy)} if policy else {}
    for i, layer in enumerate(model.layers):
        model.layers.register_module(str(i), checkpoint_wrapper(layer, preserve_rng_state=False, **context))
    model.cfg = dataclasses.replace(cfg, checkpoint_blocks=False, checkpoint_policy=None)


def _fsdp2(spec: Spec, model: Llama, device: torch.device, compiler: str) -> Prepared:
    """FSDP2: ``fully_shard`` per unit and on the root; ``fsdp2_compile``: each block compiled first."""
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    mesh = _hsdp_mesh(device) if spec.hsdp else None
    if spec.family == "fsdp2_compile":
        _checkpoint_inside(model)
        for i, layer in enumerate(model.layers):
            model.layers.register_module(str(i), torch.compile(layer, backend=compiler, fullgraph=True))
    for unit in _unit_modules(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=unit is not _last_unit(model),
                    offload_policy=_offload(spec))
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=_offload(spec))  # the root: not resharded
    return Prepared(model, list(model.parameters()), replicas=2 if spec.hsdp else 1,
                    set_sync=model.set_requires_gradient_sync if spec.sync_off else None)  # type: ignore[operator]


def _simplefsdp(spec: Spec, model: Llama, device: torch.device, compiler: str) -> Prepared:
    """SimpleFSDP's sharding (``simple_fsdp.py``), the whole model compiled, Inductor's overlap settings held."""
    from torch._inductor import config

    params = simple_fsdp.shard(model, device.type, PARAM_DTYPE, REDUCE_DTYPE)
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    overlap = simple_fsdp.overlap_config() if compiler == "inductor" else {}
    return Prepared(compiled, params, partial(config.patch, overlap))


BUILDERS: dict[str, Callable[[Spec, Llama, torch.device, str], Prepared]] = {
    "no_comm_bound": _no_comm_bound, "fsdp2_eager": _fsdp2, "fsdp2_compile": _fsdp2, "simplefsdp": _simplefsdp,
    "fsdp_compile": _fsdp_compile,
}
assert BUILDERS.keys() == FAMILIES.keys()


def build(spec: Spec, model: Llama, device: torch.device, compiler: str) -> Prepared:
    """Set ``model`` (fresh, on ``device``) up as ``spec`` says, every compiled part by ``compiler``."""
    return BUILDERS[spec.family](spec, model, device, compiler)


def grad_norms(model: nn.Module, replicas: int) -> dict[str, float]:
    """Parameter name, as in the unsharded model -> the norm of its full gradient. Every system holds each
    gradient element on exactly ``replicas`` ranks (fsdp_compile's pieces, FSDP2's and SimpleFSDP's
    ``Shard(0)`` DTensors; HSDP: one replica's), so the squares of the local parts sum over ranks to
    ``replicas`` times the full gradient's. For one rank's model (the bounds) the sum is over unrelated
    gradients: not compared."""
    names, squares = [], []
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            assert sum(p.is_shard() for p in grad.placements) == 1, (name, grad.placements)
            grad = grad.to_local()
        name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        names.append(re.sub(r"parametrizations\.(\w+)\.original", r"\1", name))
        squares.append(grad.detach().float().pow(2).sum())
    total = torch.stack(squares).to("cuda" if torch.cuda.is_available() else "cpu")  # offload: host gradients
    dist.all_reduce(total)
    return dict(zip(names, (total / replicas).sqrt().tolist()))
