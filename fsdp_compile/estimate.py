"""Know before launch: one training step's peak memory per rank, for any world size, from the compiled graphs, on
fake tensors (nothing allocated, no GPU) — ``fsdp_compile.estimate(...)`` and ``python -m fsdp_compile estimate``.

How: the model is built on the meta device, sharded over a fake process group of ``world_size`` ranks (this process is
rank 0), its shards made fake tensors, and the step compiled as the backend compiles it (the same passes, partition,
memory plan; aot_eager's graphs, not Inductor's kernels). A second step then runs node by node on the fake tensors
while every storage is counted from the op that makes it to the moment nothing holds it: the peak, what is live then
(each storage named by what made it) and where the step is. docs/big-models.md ("Before launch") says what it leaves
out (Inductor's fusions keep some temporaries of the graphs from ever existing; the allocator's slack).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import flop_registry

from fsdp_compile import _backend, _step_time
from fsdp_compile._internals import (
    FakeTensorMode,
    OpOverload,
    TorchDispatchMode,
    c10d_functional,
    fake_store,
    is_view_op,
    tree_leaves,
)
from fsdp_compile._layout import UNIT
from fsdp_compile._shard import shard
from fsdp_compile._unit import sharded_units
from fsdp_compile.config import BackendConfig
from fsdp_compile.runtime import slots

__all__ = ["Hardware", "MemoryEstimate", "StepEstimate", "estimate"]

ROUND = 512
"""The CUDA caching allocator rounds every block up to a multiple of 512 bytes."""

_WAIT = c10d_functional.wait_tensor.default
_SLOT = torch.ops.fsdp_compile.slot.default
_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_COPY_TO_HOST = torch.ops.fsdp_compile.copy_to_host.default
_SCATTERS = {getattr(torch.ops.aten, name) for name in (
    "scatter", "scatter_add", "scatter_reduce", "index_put", "_unsafe_index_put", "slice_scatter", "select_scatter",
    "as_strided_scatter", "diagonal_scatter", "index_add")}
_FUSED_KERNELS = {torch.ops.aten.sum, torch.ops.aten.mean, torch.ops.aten.amax, torch.ops.aten.amin,
                  torch.ops.aten.var_mean, torch.ops.aten.prod, torch.ops.aten.gather, torch.ops.aten.index,
                  torch.ops.aten.embedding, torch.ops.aten.slice_scatter, torch.ops.aten.select_scatter}
"""Besides pointwise ops, what Inductor lowers into kernels that fuse with what they read: reductions, indexed
loads (gather, index, embedding), and a slice or row written into a tensor (each element from one or the other)."""
_FLOPS = {**flop_registry,  # the CPU's attention kernels (fake tensors live on the CPU): the flash kernels' counts
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
              flop_registry[torch.ops.aten._scaled_dot_product_flash_attention],
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
              flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward],
          torch.ops.fsdp_compile.mm_into:  # a weight's gradient written into the unit's flat gradient
              lambda a, b, *, out, out_val: 2 * a.shape[0] * a.shape[1] * b.shape[1]}
"""FLOPs an op does, from its arguments' shapes (torch.utils.flop_counter's formulas: matmuls, convolutions,
attention)."""
PARTS = ("parameters", "gradients", "optimizer states", "communication slots", "gathered units",
         "saved for backward", "activations and temporaries", "other")
"""What a live storage at the peak is, in the order ``MemoryEstimate.parts`` lists them."""


def _pinned(nbytes: int) -> int:
    """CUDA's pinned host allocator rounds every block up to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """What the step time is estimated for: a card whose compute rate was measured (``card``), or this model's own
    measured local forward+backward without communication (``fwd_bwd_ms``, e.g. the benchmark's ``no_comm_bound``
    on one GPU at the same tokens per GPU); ``inter_node_gbps``: each GPU's network bandwidth across nodes (GB/s),
    needed where ``world_size`` spans more than ``gpus_per_node``."""

    card: str = "H100"
    fwd_bwd_ms: float | None = None
    gpus_per_node: int = 8
    inter_node_gbps: float | None = None


STEP_ERROR = ("+0.6 to +3.3% against the 0.95B's measured steps on 1 H100 and 1, 2, 4 H200s at 4096 tokens/GPU "
              "(docs/big-models.md); a model's compute rate comes from two (0.95B, 8.8B: the 8.8B at the 0.95B's rate "
              "was +20%); host-bound steps (~1024 tokens/GPU: 13-34% low) and networks across nodes unchecked")
"""The step time's stated error."""


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """One step's time on rank 0 from the step-time model (docs/scaling.md), fed the units' parameters and the
    FLOPs the compiled step does, counted per unit."""

    step_ms: float
    fwd_bwd_ms: float
    """Forward and backward with the communication the compute does not hide."""
    exposed_ms: float
    optimizer_ms: float
    compute_ms: float
    """Local forward+backward without communication: the step's FLOPs at ``tflops`` (or the measured time)."""
    tflops: float
    flops: float
    """This rank's FLOPs in the step (matmuls and attention, recomputation included)."""
    basis: str
    """The card, or "measured"."""
    error: str = STEP_ERROR


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """One step's memory on one rank (rank 0) of ``world_size``: ``peak`` bytes (each storage rounded as the CUDA
    allocator rounds it), what is live then by part (:data:`PARTS`), where the step is then (``at``: the graph, the
    node, its unit), and what lives between steps (``steady``: parameters, gradients, optimizer states, slots)."""

    world_size: int
    peak: int
    parts: dict[str, int]
    at: str
    steady: int
    host_peak: int = 0
    """CPU offload: the host memory the step's tensors reach (the shards, the optimizer's states, the gradients copied
    back, the shards' mirrors in the parameters' dtype, the optimizer's temporaries; pinned blocks rounded up to a
    power of two, as CUDA's pinned allocator rounds them); the process itself not counted."""
    step: StepEstimate | None = None
    """The step's time, where ``estimate(hardware=...)`` asked for it."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def table(self) -> str:
        rows = [f"rank 0 of {self.world_size}: peak {_gib(self.peak)} ({self.peak:,} B), at {self.at}"]
        rows += [f"  {part:<28} {_gib(size):>12}" for part, size in self.parts.items() if size]
        rows.append(f"  {'(between steps)':<28} {_gib(self.steady):>12}")
        if self.host_peak:
            rows.append(f"host (CPU offload): peak {_gib(self.host_peak)}")
        if self.step is not None:
            step = self.step
            rows.append(f"step {step.step_ms:.1f} ms ({step.basis}: {step.flops / 1e12:.2f} TFLOP at "
                        f"{step.tflops:.0f} TFLOP/s = {step.compute_ms:.1f} ms of compute, {step.exposed_ms:.1f} ms of "
                        f"communication exposed, AdamW {step.optimizer_ms:.1f} ms)")
            rows.append(f"  error: {step.error}")
        return "\n".join(rows)


def _gib(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size / 2**10:.1f} KiB"


@dataclass
class _Block:
    key: int
    nbytes: int
    part: str
    where: str
    host: bool = False


class _LiveBytes(TorchDispatchMode):  # type: ignore[misc, valid-type]
    """Every storage an op makes, counted (rounded to :data:`ROUND`) until nothing holds it; the peak and the
    storages live at it. ``where``: what runs now (``_Walk`` sets it)."""

    supports_higher_order_operators = True  # (rng state around a recomputed op: its output counted as an op's)

    def __init__(self, fusion: bool = False) -> None:
        super().__init__()
        self.fusion = fusion
        """Inductor's fusion: a value made by a pointwise op (or a reduction) and read only by such ops, never kept
        (not an output of its graph), is computed inside its readers' kernel: no storage (``_fused``)."""
        self._inputs_of: dict[int, torch.Tensor] = {}
        """An output made in its input's memory (``_reinplaced``) -> that input, kept until the output dies."""
        self.live: dict[int, _Block] = {}
        self.now = self.peak = self.host_now = self.host_peak = 0
        self.host_stage = False
        """What is made now is host memory (CPU offload's optimizer step)."""
        self.pinned = False
        """The gradients copied to the host are pinned (``CPUOffloadPolicy(pin_memory=True)``)."""
        self.mirrors = 0
        """Host bytes of the offloaded shards' mirrors in their parameters' dtype (made by a host thread, kept)."""
        self.at_peak: list[_Block] = []
        self.peak_where = ""
        self.stage = "outside"
        self.node: fx.Node | None = None
        self.forward_graphs = 0
        """Forward graphs compiled: more than one, the model's forward broke Dynamo's graph."""
        self.caller: fx.Node | None = None
        """The call of the shared body that runs now (its nodes name the body's first caller's modules)."""
        self.flops: collections.Counter[tuple[str, str]] = collections.Counter()
        """(forward or backward, module path) -> FLOPs (``_FLOPS``) in the measured step."""
        self.modules: dict[str, None] = {}
        """The module paths the forward ran, in the order it first ran each."""
        self.on = False
        """Counting (the measured step); Dynamo runs no compiled code under a dispatch mode, so the mode is entered
        inside each graph's run and around the optimizer's step, not around the model's call."""

    def add(self, storage: torch.UntypedStorage, part: str, where: str, counted: bool = True,
            host: bool = False, pinned: bool = False) -> None:
        """Count ``storage`` from now until nothing holds it, on the device (or the host: CPU offload; ``pinned``,
        in page-locked memory)."""
        key = storage._cdata
        if key in self.live:
            return
        nbytes = _pinned(storage.nbytes()) if pinned else -(-storage.nbytes() // ROUND) * ROUND
        block = _Block(key, nbytes if counted else 0, part, where, host)
        self.live[key] = block
        weakref.finalize(storage, self._free, key)
        if host:
            self.host_now += block.nbytes
            self.host_peak = max(self.host_peak, self.host_now)
            return
        self.now += block.nbytes
        if self.now > self.peak:
            self.peak, self.at_peak, self.peak_where = self.now, list(self.live.values()), self._where()

    def _free(self, key: int) -> None:
        block = self.live.pop(key)
        if block.host:
            self.host_now -= block.nbytes
        else:
            self.now -= block.nbytes
        self._inputs_of.pop(key, None)

    def _where(self) -> str:
        if self.node is None:
            return self.stage
        unit = self.node.meta.get("custom", {}).get(UNIT)
        graph = self.stage if self.stage.endswith(":") else f"{self.stage} graph,"
        return f"{graph} node {self.node.name}" + (f" (unit {unit})" if unit else "")

    def _part(self) -> str:
        if self.node is not None and UNIT in self.node.meta.get("custom", {}):
            return "gathered units"
        return "activations and temporaries" if self.stage.startswith(("forward", "backward")) else "other"

    def _count_flops(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        stage = self.stage.split(" ")[0]
        if self.node is None or stage not in ("forward", "backward"):
            return
        path = _module_path(self.caller or self.node)
        if stage == "forward":
            self.modules.setdefault(path)
        formula = _FLOPS.get(getattr(func, "overloadpacket", None))
        if formula is not None:
            self.flops[stage, path] += formula(*args, **kwargs, out_val=out)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._count_flops(func, args, kwargs or {}, out)
        if func is _WAIT:  # a fake wait returns a new tensor; a real one its input
            return args[0]
        if func is _SLOT:  # a view of its slab (counted before the step), made a storage of its own
            self.add(out.untyped_storage(), "communication slots", self._where(), counted=False)
            return out
        fused = self.fusion and self.node is not None and _fused(self.node)
        counted = not fused
        if self.fusion and not fused and self.node is not None and _reinplaced(self.node, func):  # in its input
            self.add(out.untyped_storage(), self._part(), self._where(), counted=False)
            self._inputs_of[out.untyped_storage()._cdata] = args[0]
        host = self.host_stage or func is _COPY_TO_HOST
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.add(value.untyped_storage(), self._part(), self._where(), counted, host,
                         pinned=func is _COPY_TO_HOST and self.pinned)
        return out


def _module_path(node: fx.Node) -> str:
    """The module a node of the compiled step runs in (its forward's, for a backward node), as a dotted path from
    the compiled module ("" for it): Dynamo's ``nn_module_stack``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    if not stack:
        return ""
    path = re.sub(r"^\w+\[['\"][^'\"]*['\"]\]", "", str(next(reversed(stack.values()))[0]))  # L['self']
    return re.sub(r"\._modules\[['\"]([^'\"]*)['\"]\]|\[['\"]?([^'\"\]]*)['\"]?\]", r".\1\2", path).lstrip(".")


def _fusible(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, OpOverload) and (
        torch.Tag.pointwise in target.tags or target.overloadpacket in _FUSED_KERNELS or is_view_op(target)
        or _constant(node) or _scatter_upon_constant(node))


def _constant(node: fx.Node) -> bool:
    """A tensor of one value (``full``): Inductor computes it where it is read."""
    return node.target is torch.ops.aten.full.default


def _scatter_upon_constant(node: fx.Node) -> bool:
    """A value scattered into a tensor of one value along a dimension the index has one of (cross-entropy's
    backward): Inductor's ``optimize_scatter_upon_const_tensor`` makes it pointwise (the index compared with an
    iota)."""
    if node.target is not torch.ops.aten.scatter.value:
        return False
    source, dim, index = node.args[:3]
    return (isinstance(source, fx.Node) and _constant(source) and isinstance(index, fx.Node)
            and index.meta["val"].shape[dim] == 1)


def _fused(node: fx.Node) -> bool:
    """Whether Inductor would compute ``node``'s value inside the kernels that read it: made by a pointwise op (or
    one of :data:`_FUSED_KERNELS`), read only by such ops and views of it read so, and not an output of its graph."""
    if not _fusible(node) or is_view_op(node.target):
        return False
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        if user.op == "output" or not _fusible(user):
            return False
        if is_view_op(user.target):
            frontier.extend(user.users)
    return True


def _reinplaced(node: fx.Node, func: Any) -> bool:
    """Whether Inductor writes this scatter-like op's result into its input (its reinplacing pass): the input is an
    intermediate of the graph read by nothing else."""
    source = node.args[0] if node.args else None
    return (getattr(func, "overloadpacket", None) in _SCATTERS and isinstance(source, fx.Node)
            and source.op == "call_function" and len(source.users) == 1 and not _fused(source))


class _Walk(fx.Interpreter):
    """A graph run node by node (each value dropped after its last use, as the graph's code drops it), telling the
    counter which node runs; a shared body's call runs its body so, inside."""

    def __init__(self, gm: fx.GraphModule, stage: str, counter: _LiveBytes) -> None:
        super().__init__(gm)
        self.stage, self.counter = stage, counter

    def run_node(self, n: fx.Node) -> Any:
        self.counter.stage, self.counter.node = self.stage, n
        try:
            return super().run_node(n)
        finally:
            self.counter.node = None

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is _INVOKE_SUBGRAPH:
            body, _, *operands = args
            caller = self.counter.node
            self.counter.caller = caller
            try:
                return tuple(_Walk(body, f"{self.stage} graph, {caller.name}'s body:", self.counter).run(*operands))
            finally:
                self.counter.caller = None
        return super().call_function(target, args, kwargs)


def _runner(counter: _LiveBytes) -> _backend.GraphRunner:
    def run(stage: str, gm: fx.GraphModule) -> Callable[[list[Any]], Any]:
        counter.forward_graphs += stage == "forward"

        def boxed(args: list[Any]) -> Any:
            with counter if counter.on else contextlib.nullcontext():
                return _Walk(gm, stage, counter).boxed_run(args)

        boxed._boxed_call = True  # type: ignore[attr-defined]
        return boxed

    return run


@contextmanager
def _fake_group(world_size: int) -> Iterator[None]:
    """A fake process group of ``world_size`` ranks, this process rank 0 (or the one already made so)."""
    if dist.is_initialized():
        if dist.get_backend() == "fake" and dist.get_world_size() == world_size:
            yield
            return
        raise RuntimeError(
            f"estimate() makes a fake process group of {world_size} ranks, but this process already has a "
            f"{dist.get_backend()!r} group of {dist.get_world_size()}: call it in a process that has none (before "
            "init_process_group, or `python -m fsdp_compile estimate`)")
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _storages(tensors: Iterator[torch.Tensor | None]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}


def estimate(
    build: Callable[[], nn.Module],
    step_inputs: Callable[[], Sequence[Any]],
    *,
    world_size: int,
    units: Any,
    shard_options: dict[str, Any] | None = None,
    backend_options: dict[str, Any] | None = None,
    optimizer: Callable[[Any], torch.optim.Optimizer] = functools.partial(torch.optim.AdamW, foreach=True),
    loss: Callable[[Any], torch.Tensor] = lambda out: out,
    fusion: bool = True,
    hardware: Hardware | None = None,
) -> MemoryEstimate:
    """Rank 0's peak memory in a training step of ``build()``'s model sharded over ``world_size`` ranks.

    ``build()`` is called under ``torch.device("meta")``; ``step_inputs()`` (called inside the fake mode: make its
    tensors there, any values) gives one step's arguments, ``loss(model(*step_inputs()))`` the loss; ``units``,
    ``shard_options`` (``shard()``'s others: ``mp``, ``reshard_after_forward``, ``offload_policy``...) and
    ``backend_options`` (``fsdp_compile.backend``'s; the graphs run as aot_eager runs them) as for training.
    ``fusion``: leave out what Inductor's fusions never store (False: count the graphs as aot_eager runs them).
    ``hardware``: estimate the step's time too (:class:`StepEstimate`), on that card or from a measured
    forward+backward."""
    with _fake_group(world_size):
        with torch.device("meta"):
            model = build()
        shard(model, units=units, **(shard_options or {}))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, slots.fake_slabs(mode):
            model.to_empty(device="cpu")
            return count_step(model, optimizer(model.parameters()), step_inputs, backend_options=backend_options,
                              loss=loss, fusion=fusion, hardware=hardware)


def count_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    step_inputs: Callable[[], Sequence[Any]],
    *,
    backend_options: dict[str, Any] | None = None,
    loss: Callable[[Any], torch.Tensor] = lambda out: out,
    fusion: bool = False,
    hardware: Hardware | None = None,
) -> MemoryEstimate:
    """Compile ``model`` (sharded) with the backend under aot_eager, run two steps and count the second's memory.
    ``estimate`` runs it on fake tensors; on real ranks it counts what the step holds."""
    config = BackendConfig(**{**(backend_options or {}), "compiler": "aot_eager"})
    counter = _LiveBytes(fusion)
    offloaded = any(unit.offload_to is not None for unit in sharded_units(model))
    if hardware is not None:
        _check_hardware(hardware, offloaded)
    compiled = torch.compile(model, backend=functools.partial(_backend._compile, config=config,
                                                              runner=_runner(counter)))
    steps = (step_inputs(), step_inputs())  # the first compiles; by the second the optimizer's states exist
    shapes = [[(tuple(t.shape), t.dtype) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
              for inputs in steps]
    if shapes[1] != shapes[0]:
        raise ValueError(
            f"step_inputs() gave tensors of {shapes[0]}, then of {shapes[1]}: Dynamo would compile again with dynamic "
            "shapes, and the estimate counts one step of static shapes. Give the same shapes at every call (for "
            "several sequence lengths, estimate each)")
    for step, inputs in enumerate(steps):
        if step:
            _count_persistent(counter, model, opt, offloaded)
            counter.on = True
        loss(compiled(*inputs)).backward()
        if step and counter.forward_graphs > 1:
            raise ValueError(
                "the second step compiled its forward again (Dynamo's guards failed on something that changed "
                "between the steps): the estimate counts one step of the graphs the first compiled. Find what "
                "changed with TORCH_LOGS=recompiles")
        if counter.forward_graphs > 1:
            raise ValueError(
                f"the model's forward compiled as {counter.forward_graphs} graphs (Dynamo broke it): what runs between "
                "them is not in any graph, so the estimate cannot count it. Find the breaks with "
                "torch._dynamo.explain(model)(*inputs) (or TORCH_LOGS=graph_breaks) and remove them, then estimate")
        grads = _storages(p.grad for p in model.parameters())
        for block in counter.live.values():
            block.part = "gradients" if block.key in grads else block.part
        counter.stage, counter.node, counter.host_stage = "optimizer", None, offloaded
        with counter if step else contextlib.nullcontext():
            opt.step()
        counter.host_stage = False
        opt.zero_grad(set_to_none=True)
    counter.on = False
    parts = dict.fromkeys(PARTS, 0)
    peak_stage = counter.peak_where.split(" ")[0]
    for block in (block for block in counter.at_peak if not block.host):
        part = block.part
        if part == "activations and temporaries" and peak_stage == "backward" and block.where.startswith("forward"):
            part = "saved for backward"
        parts[part] += block.nbytes
    return MemoryEstimate(world_size=dist.get_world_size(), peak=counter.peak, parts=parts, at=counter.peak_where,
                          steady=counter.now, host_peak=counter.host_peak,
                          step=None if hardware is None else _step_time_of(counter, model, hardware, config))


def _check_hardware(hardware: Hardware, offloaded: bool) -> None:
    """Refuse, before compiling, a step time the model cannot give."""
    if offloaded:
        raise ValueError("estimate(hardware=...): a CPU-offloaded step's time is the host's (the optimizer steps on "
                         "the CPU, the copies cross PCIe), which the step-time model does not know: estimate the "
                         "memory alone (no hardware=, no --card), and time the step with benchmarks/train_bench.py "
                         "--system fsdp_compile:offload=1")
    if hardware.fwd_bwd_ms is None and hardware.card not in _step_time.CARDS:
        raise ValueError(f"estimate(hardware=Hardware(card={hardware.card!r})): no compute rate measured for that "
                         f"card; name one of {_step_time.CARDS}, or pass fwd_bwd_ms= (--fwd-bwd-ms) measured on it")
    if dist.get_world_size() > hardware.gpus_per_node and hardware.inter_node_gbps is None:
        raise ValueError(f"estimate(hardware=...): {dist.get_world_size()} ranks span nodes of "
                         f"{hardware.gpus_per_node} GPUs; pass inter_node_gbps= (--inter-node-gbps): each GPU's "
                         "network bandwidth in GB/s, 50 for a 400 Gb/s NIC per GPU")


def _step_time_of(counter: _LiveBytes, model: nn.Module, hardware: Hardware, config: BackendConfig) -> StepEstimate:
    """The step-time model fed this step: the units in the order the forward first runs them, each with its
    parameters, its gathered dtype and the FLOPs counted in its modules (forward, backward, recomputation); the
    contention of the routes the step takes within a node (the copy engines', unless NCCL is asked for)."""
    states: dict[str, list[Any]] = {"": []}
    for state in sharded_units(model):
        states.setdefault(state.layout.fqn, []).append(state)

    def unit_of(path: str) -> str:
        return max((fqn for fqn in states if fqn == "" or path == fqn or path.startswith(fqn + ".")), key=len)

    flops: collections.Counter[str] = collections.Counter()
    for (_, path), count in counter.flops.items():
        flops[unit_of(path)] += count
    forward = sum(count for (stage, _), count in counter.flops.items() if stage == "forward")
    total = sum(flops.values())
    if not total:
        raise ValueError("estimate(hardware=...): the step does no matmul or attention that the FLOP count knows "
                         "(torch.utils.flop_counter), so its compute time is unknown")
    order = dict.fromkeys([*(unit_of(path) for path in counter.modules), *states])
    units = []
    for fqn in order:
        parts = states[fqn]
        params = sum(state.layout.padded_numel for state in parts)
        nbytes = sum(state.layout.padded_numel * state.param_dtype.itemsize for state in parts)
        units.append(_step_time.Unit(
            params, flops[fqn], nbytes / params if params else _step_time.BF16,
            sum(state.layout.padded_numel for state in parts if state.trainable)))
    if hardware.fwd_bwd_ms is not None:
        compute_ms, basis = hardware.fwd_bwd_ms, "measured"
    else:
        blocks = [unit.params for fqn, unit in zip(order, units) if fqn] or [unit.params for unit in units]
        float32 = all(state.param_dtype == torch.float32 for parts in states.values() for state in parts)
        compute_ms = total / _step_time.compute_rate(hardware.card, max(blocks), float32) * 1e3
        basis = hardware.card
    topology = _step_time.Topology(dist.get_world_size(), "fsdp", hardware.gpus_per_node)
    network = _step_time.Network(hardware.inter_node_gbps or 0.0)
    copy_engines = topology.nodes == 1 and config.all_gather != "nccl" and config.grad_reduce != "nccl"
    contention = _step_time.COPY_ENGINE_CONTENTION if copy_engines else _step_time.CONTENTION
    time = _step_time.predict(units, topology, network, compute_ms, forward / total, contention, hardware.card)
    return StepEstimate(step_ms=time.step_ms, fwd_bwd_ms=time.fwd_bwd_ms, exposed_ms=time.exposed_ms,
                        optimizer_ms=time.optimizer_ms, compute_ms=compute_ms, tflops=total / compute_ms / 1e9,
                        flops=total, basis=basis)


def _count_persistent(counter: _LiveBytes, model: nn.Module, opt: torch.optim.Optimizer, offloaded: bool) -> None:
    """What lives before the measured step: the units' shards (and their gradient accumulators, sync off), the other
    parameters and buffers, the optimizer's states (under CPU offload the shards and states on the host) and the
    slots' slabs (a slot is a view of its slab)."""
    units = sharded_units(model)
    offloaded = [u for u in units if u.offload_to is not None]
    host = {u.flat.untyped_storage()._cdata: u.pin_memory for u in offloaded}
    counter.pinned = any(u.pin_memory for u in offloaded)
    for tensor in (*model.parameters(), *model.buffers(), *(u.flat for u in units)):
        storage = tensor.untyped_storage()
        counter.add(storage, "parameters", "before the step", host=storage._cdata in host,
                    pinned=host.get(storage._cdata, False))
    for unit in offloaded:  # the mirrors (fsdp_compile.runtime.host_copies), outside any op the step runs
        if unit.param_dtype.itemsize < unit.flat.element_size():
            nbytes = unit.flat.numel() * unit.param_dtype.itemsize
            counter.mirrors += _pinned(nbytes) if unit.pin_memory else nbytes
    counter.host_now += counter.mirrors
    counter.host_peak = max(counter.host_peak, counter.host_now)
    for unit in units:
        if unit.accum is not None:
            counter.add(unit.accum.untyped_storage(), "gradients", "before the step")
    for state in opt.state.values():
        for tensor in state.values():
            if isinstance(tensor, torch.Tensor):
                counter.add(tensor.untyped_storage(), "optimizer states", "before the step", host=offloaded)
    for slab in slots.every_slab():
        counter.add(slab.memory.untyped_storage(), "communication slots", "before the step")
        for view in slab.slots.values():
            counter.add(view.untyped_storage(), "communication slots", "before the step", counted=False)
