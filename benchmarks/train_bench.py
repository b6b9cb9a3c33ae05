"""Compiled-training benchmark: fsdp_compile against its peers, side by side in ONE run.

    torchrun --nproc_per_node 2 benchmarks/train_bench.py                       # 0.95B, sweep 1024 and 4096 tokens/GPU
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens 2048 8192    # more points of the sweep
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --model tiny-untied --tokens 16 32   # CPU smoke test (gloo)
    torchrun --nproc_per_node 4 benchmarks/train_bench.py --model 8.8b --tokens 8192 --seq-cap 8192 --checkpoint selective

Systems (same model, initial weights, data and mixed precision: bf16 params/compute, fp32 reduce, fp32
main weights, AdamW; the same FSDP units, torchtitan's: every block, the embedding and the output
projection (when untied) each a unit, the final norm left to the root; the unit holding the output
projection, which backward needs first, is not resharded after forward):
- ``no_comm_bound``: the same per-GPU work with no collective: each rank trains the whole model on its
  own micro-batch (fsdp_compile over a group of one rank: bf16 casts, fp32 main weights, full optimizer
  step). Its loss differs from the others after step 0 (no gradient averaging), so the loss guard checks
  its step 0 only, and its gradients are not compared. ``no_comm_bound_cudagraphs``: the same with CUDA
  graphs (the bound for ``fsdp_compile_cudagraphs``).
- ``fsdp2_eager``: ``fully_shard`` per unit and on the root.
- ``fsdp2_compile``: each block ``torch.compile``d, then ``fully_shard`` (torchtitan's order).
- ``simplefsdp``: written from SimpleFSDP's description: parameters as DTensor ``Shard(0)``, a
  parametrization redistributes them to ``Replicate`` (bf16 forward, fp32 backward) under a
  MUST_RECOMPUTE checkpoint policy (reshard after forward), whole model compiled with Inductor's
  overlap scheduling and bucketing (on GPUs).
- ``fsdp_compile`` and its variants (``FSDP_COMPILE_VARIANTS``: one line each), among them
  ``fsdp_compile_cudagraphs`` (``backend(cudagraphs=True)``: no launch overhead) and
  ``fsdp_compile_copy_engine`` (``backend(all_gather="copy_engine")``: all-gathers off the SMs; GPU only) and
  ``fsdp_compile_nccl`` (``backend(all_gather="nccl", grad_reduce="nccl")``: every collective on NCCL; the
  defaults, ``"auto"``, choose copy engines over 2 or 4 ranks on one host) and
  ``fsdp_compile_copy_engine_exchange`` (``all_gather="copy_engine", grad_reduce="copy_engine"``: no collective
  on the SMs; GPU only) and ``fsdp_compile_keep_gathered`` (``reshard_after_forward=False`` for every unit: no
  all-gather in backward, the gathered parameters held from forward to backward).
- ``fsdp_compile_barrier_kernels``: the default with the copy-engine collectives' barriers as symmetric memory's
  barrier kernels, not the driver's stream memory operations (GPU only: their A/B).
- HSDP as on two nodes, on a ``(replicate, shard)`` mesh of shape (2, ranks / 2) (4 ranks or more; left out of
  the defaults below): ``fsdp2_compile_hsdp`` (``fsdp2_compile`` with ``fully_shard(mesh=...)``) and
  ``fsdp_compile_hsdp`` (``shard(mesh=...)``).

Per point of the sweep (tokens per GPU = batch x seq; seq up to 2048), each system run --repeats times,
interleaved (report.py aggregates: medians over the runs, and the range of the step time): median step
time over the steps after --warmup; its ratio to the **tight bound** (the headline: the bound's local
forward+backward plus an optimizer step over 1/world of the parameters, both timed in the bound's run),
to the **loose bound** (``no_comm_bound``'s whole step, with the full optimizer a sharded system never runs)
and to FSDP2 eager; forward+backward and optimizer times from --split-steps more steps synchronized
between the two; tokens/s/GPU; MFU (6 x matmul params + 12 x layers x dim x seq FLOPs per token, over the
card's dense bf16 peak); peak memory (``torch.cuda.max_memory_allocated`` over the measured steps, less
what the previous system left allocated: none, unless ``leftover_after_gib`` in the JSON says otherwise, plus
the memory-plan slabs in symmetric memory, the driver's memory, which the caching allocator does not count;
marked not comparable under CUDA graphs, whose pool it leaves out) and ``max_memory_reserved`` (which counts
that pool); the memory plan's slabs (``fsdp_compile.slab_bytes()``: what the planner sized, made afresh for
each system); host time to enqueue a step on the slowest rank (close to the step time: launch-bound; every
rank's in the JSON's ``host_ms_per_rank``); from a profiler trace of --profile-steps more steps
(``trace_steps``: after a barrier and one untraced warm-up step): communication (time NCCL kernels,
peer-to-peer copies or the copy-engine collectives' barriers run), exposed communication (of that, the time
no other kernel runs), compute (other kernels and copies), GPU idle time, and
the compute slowdown ((forward+backward - exposed communication) / the bound's forward+backward); compile time
(first step minus the median; the JSON's ``caches`` says how many of its graphs came from Inductor's and AOTAutograd's
caches). ``--trace-dir`` keeps each trace (``benchmarks/trace_summary.py`` reads them); it traces
host activity too, which slows the host, so the profile columns then come from slower, possibly host-bound
steps (the step times do not: they are timed untraced); ``--trace-kernels-only`` keeps the traces of the GPU's
activity alone, as the profile columns are measured without ``--trace-dir`` (where the GPU's time goes in steps
whose host runs at its own speed).
``--stall-dump-s S`` prints every thread's Python stack to stderr when one system's run takes longer than S
seconds (a hang shows where each rank waits; the run goes on).

Two guards, run after every sweep, each failing the run (exit 1): the losses of every step agree with
FSDP2 eager's, and every parameter's gradient norm after step 0 agrees with FSDP2's (``report.py``: the
loss alone cannot see a missing average). Writes JSON (``--out``, every run kept); ``benchmarks/plot.py``
turns it into plots.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import gc
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.nn.utils import parametrize
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import fsdp_compile
from fsdp_compile._internals import cuda_driver
from fsdp_compile.testing.dist import gloo_one_worker_thread, hsdp_mesh
from fsdp_compile.testing.llama import LLAMA_0_95B, LLAMA_8B, LLAMA_TESTS, LLAMA_TINY, Llama, LlamaConfig, save_matmuls
from fsdp_compile.testing.profile import communication_overlap, trace_steps

from report import (  # benchmarks/
    BOUNDS, GRAD_RTOL, LOSS_RTOL, REFERENCES, Result, check_gradients, check_losses, reference, table,
)

MODELS = {
    "0.95b": LLAMA_0_95B, "8.8b": LLAMA_8B, "tiny": LLAMA_TINY, "tests": LLAMA_TESTS,
    "tiny-untied": dataclasses.replace(LLAMA_TINY, tie_embeddings=False),
}
CHECKPOINTING = {
    "none": {},
    "full": {"checkpoint_blocks": True},
    "selective": {"checkpoint_blocks": True, "checkpoint_policy": save_matmuls},
}
"""``--checkpoint``: activation checkpointing of every block, the same for every system (the model does it)."""
PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}  # dense, per GPU

FSDP_COMPILE_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fsdp_compile": ({}, {}),
    "fsdp_compile_no_overlap": ({"overlap": False}, {}),
    "fsdp_compile_reduce_scatter": ({}, {"exchange_grads_in_param_dtype": False}),
    "fsdp_compile_cudagraphs": ({"cudagraphs": True}, {}),
    "fsdp_compile_copy_engine": ({"all_gather": "copy_engine"}, {}),
    "fsdp_compile_copy_engine_cudagraphs": ({"all_gather": "copy_engine", "cudagraphs": True}, {}),
    "fsdp_compile_unplanned": ({"memory_plan": False}, {}),
    "fsdp_compile_packed": ({"gradients_in_place": False}, {}),
    "fsdp_compile_copy_engine_unplanned": ({"all_gather": "copy_engine", "memory_plan": False}, {}),
    "fsdp_compile_nccl": ({"all_gather": "nccl", "grad_reduce": "nccl"}, {}),
    "fsdp_compile_nccl_cudagraphs": ({"all_gather": "nccl", "grad_reduce": "nccl", "cudagraphs": True}, {}),
    "fsdp_compile_copy_engine_exchange": ({"all_gather": "copy_engine", "grad_reduce": "copy_engine"}, {}),
    "fsdp_compile_copy_engine_exchange_cudagraphs": (
        {"all_gather": "copy_engine", "grad_reduce": "copy_engine", "cudagraphs": True}, {}
    ),
    "fsdp_compile_nccl_gather_copy_engine_exchange": ({"all_gather": "nccl", "grad_reduce": "copy_engine"}, {}),
    "fsdp_compile_nccl_gather_copy_engine_exchange_cudagraphs": (
        {"all_gather": "nccl", "grad_reduce": "copy_engine", "cudagraphs": True}, {}
    ),
    "fsdp_compile_keep_gathered": ({}, {"keep_gathered": True}),
    "fsdp_compile_keep_gathered_cudagraphs": ({"cudagraphs": True}, {"keep_gathered": True}),
}
"""fsdp_compile variants: name -> (``fsdp_compile.backend(**options)``, ``_shard(**options)``: ``keep_gathered``
(every unit stays gathered from forward to backward: ``reshard_after_forward=False``, no all-gather in
backward) and ``MixedPrecision(**options)`` beyond bf16/fp32). Add one line per new variant."""
GPU_ONLY = {name for name, (options, _) in FSDP_COMPILE_VARIANTS.items()
            if {"all_gather", "grad_reduce"} & set(options)} | {"fsdp_compile_barrier_kernels"}
"""Left out of the default systems on CPU: the variants that name a route (copy-engine collectives need GPUs; on
CPU the default, ``auto``, is gloo, so an ``nccl`` variant is the ``fsdp_compile`` row again)."""
KEEP_GATHERED = {name for name, (_, shard_options) in FSDP_COMPILE_VARIANTS.items()
                 if shard_options.get("keep_gathered")}
"""Another sharding policy than every other system's: left out of the defaults (name them in --systems)."""
CUDA_GRAPHS = {"no_comm_bound_cudagraphs"} | {name for name, (options, _) in FSDP_COMPILE_VARIANTS.items() if options.get("cudagraphs")}
"""Systems whose peak ``max_memory_allocated`` leaves out the CUDA graphs' memory pool (not comparable)."""


@dataclass
class Prepared:
    module: nn.Module  # called as module(inputs, targets) -> loss
    params: list[nn.Parameter]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Entered around every step (Inductor settings must hold at the lazy backward compile too)."""
    replicas: int = 1
    """HSDP: ranks holding each gradient element (its norm's squares are summed over every rank)."""


def _mp_fsdp_compile(**options: Any) -> fsdp_compile.MixedPrecision:
    return fsdp_compile.MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE, **options)


def _unit_modules(model: Llama) -> list[nn.Module]:
    """The FSDP units besides the root: every block, and the embedding and output projection unless tied."""
    separate = [] if model.cfg.tie_embeddings else [model.tok_embeddings, model.output]
    return [*model.layers, *separate]


def _last_unit(model: Llama) -> nn.Module:
    """The unit holding the output projection: the forward uses it last, the backward first."""
    return model if model.cfg.tie_embeddings else model.output


def _shard(
    model: Llama, group: dist.ProcessGroup | None = None, mesh: DeviceMesh | None = None, keep_gathered: bool = False,
    **mp_options: Any,
) -> None:
    """Shard as torchtitan does: every unit resharded after forward but the last (``keep_gathered``: none)."""
    units = {id(m) for m in _unit_modules(model)}
    last = _last_unit(model)
    fsdp_compile.shard(model, units=lambda fqn, m: id(m) in units, group=group, mesh=mesh,
                       mp=_mp_fsdp_compile(**mp_options),
                       reshard_after_forward=False if keep_gathered else lambda fqn, m: m is not last)


def _hsdp_mesh(device: torch.device) -> DeviceMesh | None:
    """HSDP as on two nodes: 2 replicas, each sharded over half the ranks (FSDP2's (replicate, shard) mesh)."""
    return hsdp_mesh((2, dist.get_world_size() // 2), device.type)


def _compiled(model: Llama, compiler: str, backend_options: dict[str, Any]) -> Prepared:
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler=compiler, **backend_options), fullgraph=True)
    if not backend_options.get("cudagraphs"):
        return Prepared(compiled, list(model.parameters()))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(inputs, targets)

    return Prepared(step, list(model.parameters()))  # type: ignore[arg-type]


def no_comm_bound(model: Llama, device: torch.device, compiler: str, **backend_options: Any) -> Prepared:
    alone, _ = dist.new_subgroups(group_size=1)
    _shard(model, alone)
    return _compiled(model, compiler, backend_options)


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


def fsdp2_eager(
    model: Llama, device: torch.device, compiler: str, compile_blocks: bool = False, hsdp: bool = False
) -> Prepared:
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    mesh = _hsdp_mesh(device) if hsdp else None
    if compile_blocks:
        _checkpoint_inside(model)
    for i, layer in enumerate(model.layers):
        if compile_blocks:
            model.layers.register_module(str(i), torch.compile(layer, backend=compiler, fullgraph=True))
    for unit in _unit_modules(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=unit is not _last_unit(model))
    fully_shard(model, mesh=mesh, mp_policy=policy)  # FSDP2 does not reshard the root after forward
    return Prepared(model, list(model.parameters()), replicas=2 if hsdp else 1)


def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


class _ReplicateComputation(nn.Module):
    """SimpleFSDP's parametrization: a Shard(0) DTensor parameter -> the full local tensor, all-gathered
    in bf16, its gradient reduce-scattered (avg) in fp32; recomputed in backward, never saved."""

    def replicate(self, x: DTensor) -> torch.Tensor:
        full = x.redistribute(placements=(Replicate(),), forward_dtype=PARAM_DTYPE, backward_dtype=REDUCE_DTYPE)
        return full.to_local(grad_placements=(Partial("avg"),))

    def forward(self, x: DTensor) -> torch.Tensor:
        context = partial(create_selective_checkpoint_contexts, _must_recompute)
        return checkpoint(self.replicate, x, use_reentrant=False, context_fn=context)


def _overlap_config() -> dict[str, Any]:
    """Inductor's own overlap scheduling and collective bucketing (needs triton's cost model: GPUs)."""
    from torch._inductor import config

    if not torch.cuda.is_available():
        return {}
    if hasattr(config, "aten_distributed_optimizations"):
        return {
            "aten_distributed_optimizations.enable_overlap_scheduling": True,
            "aten_distributed_optimizations.collective_bucketing": True,
            "aten_distributed_optimizations.insert_overlap_deps": True,
        }
    return {"reorder_for_compute_comm_overlap": True, "bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}


def simplefsdp(model: Llama, device: torch.device, compiler: str) -> Prepared:
    from torch._inductor import config

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    replicate = _ReplicateComputation()
    distributed: dict[nn.Parameter, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param not in distributed:
                distributed[param] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            module._parameters[name] = distributed[param]
            parametrize.register_parametrization(module, name, replicate, unsafe=True)
    compiled = torch.compile(model, backend=compiler, fullgraph=True)
    overlap = _overlap_config() if compiler == "inductor" else {}
    return Prepared(compiled, list(distributed.values()), partial(config.patch, overlap))


def _fsdp_compile(
    options: tuple[dict[str, Any], dict[str, Any]], model: Llama, device: torch.device, compiler: str
) -> Prepared:
    backend_options, shard_options = options
    _shard(model, **shard_options)
    return _compiled(model, compiler, backend_options)


def fsdp_compile_barrier_kernels(model: Llama, device: torch.device, compiler: str) -> Prepared:
    """The default, with the copy-engine collectives' barriers as symmetric memory's barrier kernels (which spin on
    an SM while they wait) instead of stream memory operations (``fsdp_compile._slots.Slab.barrier``): their A/B."""
    prepared = _fsdp_compile(FSDP_COMPILE_VARIANTS["fsdp_compile"], model, device, compiler)
    no_memops = partial(mock.patch.object, cuda_driver, "has_stream_memops", lambda: False)
    return dataclasses.replace(prepared, context=no_memops)


def fsdp_compile_hsdp(model: Llama, device: torch.device, compiler: str) -> Prepared:
    _shard(model, mesh=_hsdp_mesh(device))
    return dataclasses.replace(_compiled(model, compiler, {}), replicas=2)


SYSTEMS: dict[str, Callable[[Llama, torch.device, str], Prepared]] = {
    "no_comm_bound": no_comm_bound,
    "no_comm_bound_cudagraphs": partial(no_comm_bound, cudagraphs=True),
    "fsdp2_eager": fsdp2_eager,
    "fsdp2_compile": partial(fsdp2_eager, compile_blocks=True),
    "simplefsdp": simplefsdp,
    **{name: partial(_fsdp_compile, options) for name, options in FSDP_COMPILE_VARIANTS.items()},
    "fsdp_compile_barrier_kernels": fsdp_compile_barrier_kernels,
    "fsdp2_compile_hsdp": partial(fsdp2_eager, compile_blocks=True, hsdp=True),
    "fsdp_compile_hsdp": fsdp_compile_hsdp,
}
HSDP = {"fsdp2_compile_hsdp", "fsdp_compile_hsdp"}
"""Systems on a (2, world size / 2) mesh: 4 ranks or more, left out of the defaults below."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg: LlamaConfig, batch: int, seq: int, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)


def _flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    per_block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    matmul_params = cfg.n_layers * per_block + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq


class _Collections:
    """A ``gc.callbacks`` entry: Python's garbage collections while it is registered, how many of each generation
    and their time (the host's, inside the steps it pauses)."""

    def __init__(self) -> None:
        self.count, self.ms, self._start = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3


@contextlib.contextmanager
def _garbage_collection(mode: str) -> Iterator[None]:
    """``auto``: Python's automatic collections. ``manual``: torchtitan's practice, none during the steps (one of
    the young generations before them), automatic again after."""
    if mode == "auto":
        yield
        return
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _release(device: torch.device) -> int:
    """Drop compiled code, memory-plan slabs and garbage from the previous system (each system reserves slabs of
    its own, and its peak counts them); the bytes still allocated after that."""
    torch._dynamo.reset()
    fsdp_compile.release_slabs()
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def _grad_norms(model: nn.Module, replicas: int) -> dict[str, float]:
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
    total = torch.stack(squares)
    dist.all_reduce(total)
    return dict(zip(names, (total / replicas).sqrt().tolist()))


def _sharded_optimizer_ms(params: list[nn.Parameter], reps: int, device: torch.device) -> float:
    """Median time of the benchmark's AdamW over 1/world of every parameter (zero gradients): the optimizer
    step of a sharded system, without its sharding."""
    world = dist.get_world_size()
    shards = [torch.zeros(-(-p.numel() // world), device=device, requires_grad=True) for p in params]
    opt = _optimizer(shards, device)
    times = []
    for _ in range(reps + 1):
        for shard in shards:  # what backward leaves; opt.zero_grad() drops it again, as in the systems' steps
            shard.grad = torch.zeros_like(shard)
        _sync(device)
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def _optimizer(params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


def run(name: str, cfg: LlamaConfig, batch: int, seq: int, repeat: int, args: argparse.Namespace,
        device: torch.device) -> Result:
    resident = _release(device)
    caches = _cache_counts()
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    model_ref = weakref.ref(model)
    prepared = SYSTEMS[name](model, device, args.compiler)
    opt = _optimizer(prepared.params, device)
    result = Result(system=name, tokens_per_gpu=batch * seq, batch=batch, seq=seq, repeat=repeat, losses=[], step_ms=[])
    enqueue_ms, split_ms, marks, phases_ms = [], [], [], []

    def forward_backward(i: int) -> torch.Tensor:
        tokens = _batch(cfg, batch, seq, i, device)
        loss = prepared.module(tokens[:, :-1], tokens[:, 1:])
        marks.append(time.perf_counter())
        loss.backward()
        marks.append(time.perf_counter())
        return loss.detach().clone()  # a CUDA graph's next replay overwrites its outputs

    def step(i: int) -> torch.Tensor:
        loss = forward_backward(i)
        if i == 0:
            result.grad_norms = _grad_norms(model, prepared.replicas)
        opt.step()
        opt.zero_grad()
        return loss

    collections = _Collections()
    with prepared.context(), _garbage_collection(args.gc):
        with contextlib.ExitStack() as counting:  # the collections during the timed steps only
            for i in range(args.steps):
                if i == args.warmup:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    gc.callbacks.append(collections)
                    counting.callback(gc.callbacks.remove, collections)
                _sync(device)
                marks.clear()
                start = time.perf_counter()
                loss = step(i)
                enqueue_ms.append((time.perf_counter() - start) * 1e3)
                phases_ms.append(((marks[0] - start) * 1e3, (marks[1] - marks[0]) * 1e3))
                _sync(device)
                result.step_ms.append((time.perf_counter() - start) * 1e3)
                global_loss = loss.float()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                result.losses.append(global_loss.item())
        result.slab_mib = fsdp_compile.slab_bytes() / 2**20
        if device.type == "cuda":
            symmetric = fsdp_compile.slab_bytes(symmetric=True)  # the driver's memory: not in the allocator's peak
            result.peak_gib = (torch.cuda.max_memory_allocated(device) - resident + symmetric) / 2**30
            result.reserved_gib = torch.cuda.max_memory_reserved(device) / 2**30
        for i in range(args.split_steps):  # forward+backward and the optimizer timed apart
            _sync(device)
            start = time.perf_counter()
            forward_backward(args.steps + i)
            _sync(device)
            middle = time.perf_counter()
            opt.step()
            opt.zero_grad()
            _sync(device)
            split_ms.append(((middle - start) * 1e3, (time.perf_counter() - middle) * 1e3))
        if device.type == "cuda" and args.profile_steps:
            first = args.steps + args.split_steps
            with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                trace_steps(lambda i: step(first + i), args.profile_steps, trace.name,
                            host=bool(args.trace_dir) and not args.trace_kernels_only)
                overlap = communication_overlap(trace.name, args.profile_steps)
                if args.trace_dir:
                    _keep_trace(trace.name, args.trace_dir, f"{name}_{batch * seq}_run{repeat}_rank{dist.get_rank()}")
            result.comm_ms, result.exposed_comm_ms = overlap["comm"], overlap["exposed"]
            result.compute_ms, result.idle_ms = overlap["compute"], overlap["idle"]
    if split_ms:
        result.fwd_bwd_ms = statistics.median(f for f, _ in split_ms)
        result.opt_ms = statistics.median(o for _, o in split_ms)
    if name in BOUNDS and args.split_steps:
        result.sharded_opt_ms = _sharded_optimizer_ms(prepared.params, args.split_steps, device)
    result.peak_comparable = name not in CUDA_GRAPHS
    result.median_step_ms = statistics.median(result.step_ms[args.warmup :])
    timed = args.steps - args.warmup
    host = [None] * dist.get_world_size()  # the slowest rank's host paces every collective
    dist.all_gather_object(host, {
        "host_ms_per_rank": statistics.median(enqueue_ms[args.warmup :]),
        "host_forward_ms_per_rank": statistics.median(f for f, _ in phases_ms[args.warmup :]),
        "host_backward_ms_per_rank": statistics.median(b for _, b in phases_ms[args.warmup :]),
        "gc_ms_per_step_per_rank": collections.ms / timed,
        "gc_collections_per_step_per_rank": [n / timed for n in collections.count],
    })
    result.extra.update({key: [rank[key] for rank in host] for key in host[0]})
    result.cpu_ms = max(result.extra["host_ms_per_rank"])
    result.compile_s = max(0.0, (result.step_ms[0] - result.median_step_ms) / 1e3)
    result.tokens_per_s_per_gpu = batch * seq / (result.median_step_ms / 1e3)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    if peak:
        result.mfu = _flops_per_token(cfg, seq) * result.tokens_per_s_per_gpu / peak
    del prepared, model, opt, step, forward_backward, loss
    leftover = _release(device) - resident
    result.extra.update(resident_before_gib=resident / 2**30, leftover_after_gib=leftover / 2**30,
                        model_freed=model_ref() is None,
                        caches={k: v - caches.get(k, 0) for k, v in _cache_counts().items() if v != caches.get(k, 0)})
    return result


def _cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache: hits, misses, bypasses so far in this process (a
    system's compile time is short only where its graphs come from the cache)."""
    counters = torch._dynamo.utils.counters
    return {f"{group}.{key}": n for group in ("inductor", "aot_autograd") for key, n in counters[group].items()
            if "cache" in key}


def _keep_trace(path: str, trace_dir: str, stem: str) -> None:
    os.makedirs(trace_dir, exist_ok=True)
    with open(path, "rb") as src, gzip.open(os.path.join(trace_dir, f"{stem}.json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)


def _points(tokens: list[int], max_seq: int, seq_cap: int) -> list[tuple[int, int]]:
    """tokens per GPU -> (batch, seq): seq as long as the model allows (up to ``seq_cap``), batch for the rest."""
    seq_cap = min(max_seq, seq_cap)
    return [(max(1, t // seq_cap), min(t, seq_cap)) for t in tokens]


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    use_cuda = device.type == "cuda"
    return {
        "model": args.model,
        "checkpoint": args.checkpoint,
        "world_size": dist.get_world_size(),
        "card": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "split_steps": args.split_steps,
        "repeats": args.repeats,
        "compiler": args.compiler,
        "gc": args.gc,
        "loss_rtol": LOSS_RTOL,
        "grad_rtol": GRAD_RTOL,
    }


def _write(path: str | None, meta: dict[str, Any], results: list[Result]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    """The program (``argv``: its arguments, default ``sys.argv``); its own process group, or, called in ranks whose
    default group exists (the tests'), that one."""
    parser = argparse.ArgumentParser(description="fsdp_compile vs FSDP2, SimpleFSDP-style and the bounds, in one run.")
    parser.add_argument("--model", choices=sorted(MODELS), default="0.95b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per GPU (sweep points)")
    parser.add_argument("--seq-cap", type=int, default=2048, help="longest sequence; more tokens go to the batch")
    parser.add_argument("--checkpoint", choices=sorted(CHECKPOINTING), default="none",
                        help="activation checkpointing of every block (selective: save the matmuls)")
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS),
                        help="default: all but KEEP_GATHERED (on CPU: and GPU_ONLY; with --compiler aot_eager: and CUDA_GRAPHS)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="the compiler of every compiled system (aot_eager: the same graphs run by eager kernels, "
                             "a quick check of the systems' results; leaves out the CUDA-graph systems)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system per point, interleaved (headlines: 3)")
    parser.add_argument("--gc", choices=("auto", "manual"), default="auto",
                        help="Python's garbage collection during the steps: automatic, or none (torchtitan's gc_freq)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of timing and peak memory")
    parser.add_argument("--split-steps", type=int, default=3,
                        help="extra steps with forward+backward and the optimizer timed apart (the tight bound)")
    parser.add_argument("--profile-steps", type=int, default=2, help="extra steps traced for exposed communication")
    parser.add_argument("--out", help="write the JSON results to this file")
    parser.add_argument("--stall-dump-s", type=float, default=0,
                        help="print every thread's Python stack (stderr) when one system's run takes longer (0: off)")
    parser.add_argument("--trace-dir", help="keep each system's profiler trace (CPU and CUDA) here, per rank")
    parser.add_argument("--trace-kernels-only", action="store_true",
                        help="with --trace-dir: trace the GPU's activity only (the host runs at its own speed)")
    args = parser.parse_args(argv)
    if args.trace_kernels_only and not args.trace_dir:
        parser.error("--trace-kernels-only needs --trace-dir (where to keep the traces)")
    if args.systems and not set(REFERENCES) & set(args.systems):
        parser.error(f"--systems must include one of {', '.join(REFERENCES)} (the guards' reference)")
    if args.split_steps < 1 or args.repeats < 1 or not 0 < args.warmup < args.steps:
        parser.error("--split-steps and --repeats must be >= 1, and 0 < --warmup < --steps")
    if args.systems and args.compiler != "inductor" and CUDA_GRAPHS & set(args.systems):
        parser.error(f"{sorted(CUDA_GRAPHS & set(args.systems))} need --compiler inductor (CUDA graphs are Inductor's)")
    cfg = dataclasses.replace(MODELS[args.model], **CHECKPOINTING[args.checkpoint])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    own_group = not dist.is_initialized()  # else: called in a job's ranks (the tests'), in their default group
    if own_group:
        if not use_cuda:
            gloo_one_worker_thread()  # torch's gloo races with two worker threads (heap corruption)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    hsdp_ok = dist.get_world_size() >= 4 and dist.get_world_size() % 2 == 0
    if args.systems and not hsdp_ok and HSDP & set(args.systems):
        parser.error(f"{sorted(HSDP & set(args.systems))} need an even number of ranks, at least 4")
    leave_out = (set() if use_cuda else GPU_ONLY) | (set() if hsdp_ok else HSDP) | KEEP_GATHERED
    leave_out |= CUDA_GRAPHS if args.compiler != "inductor" else set()
    args.systems = args.systems or [s for s in SYSTEMS if s not in leave_out]
    results = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64):
        for batch, seq in _points(args.tokens, cfg.max_seq_len, args.seq_cap):
            for repeat in range(args.repeats):
                for name in args.systems:
                    if args.stall_dump_s:
                        faulthandler.dump_traceback_later(args.stall_dump_s)
                    results.append(run(name, cfg, batch, seq, repeat, args, device))
                    faulthandler.cancel_dump_traceback_later()
                    if dist.get_rank() == 0:
                        _write(args.out, _meta(args, device), results)  # kept if a later run dies
                        r = results[-1]
                        brief = {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(r).items()
                                 if k not in ("system", "losses", "step_ms", "extra", "grad_norms")}
                        print(f"# {name} {batch}x{seq} run {repeat}: {r.median_step_ms:.1f} ms, losses "
                              f"{[round(x, 4) for x in r.losses]}, {brief}, {r.extra}", flush=True)
    loss_problems, grad_problems = check_losses(results), check_gradients(results)
    meta = _meta(args, device)
    if dist.get_rank() == 0:
        print(f"\n## {meta}")
        for line in table(results):
            print(line)
        ref = reference(r.system for r in results)
        print(f"\nloss guard (all systems vs {ref}, rtol {LOSS_RTOL}; bounds at step 0 only): "
              + ("; ".join(loss_problems) or "OK"))
        print(f"gradient guard (per-parameter gradient norms after step 0 vs {ref}, rtol {GRAD_RTOL}; "
              f"{', '.join(BOUNDS)} not compared: no averaging over ranks): " + ("; ".join(grad_problems) or "OK"))
        _write(args.out, meta, results)
    if own_group:
        dist.destroy_process_group()
    if loss_problems or grad_problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
