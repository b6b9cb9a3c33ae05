"""The runtime state of one FSDP unit on this rank (:class:`UnitState`), and how to find it: from the
sharded module (:func:`sharded_units`) or from its flat shard (:func:`unit_of_shard`).

Flat shard, pieces, gradients and weak references: [Note: flat shards, pieces and gradients] in
docs/architecture.md."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile._eager import EagerUnit
from fsdp_compile._internals import counters
from fsdp_compile._layout import ParamSlot, UnitLayout, unit_label
from fsdp_compile._outside_forward import outside_forward, read_in_backward_message, read_outside_forward
from fsdp_compile._weak import weak_method
from fsdp_compile.runtime import host_copies
from fsdp_compile.runtime.float8 import Float8Weight
from fsdp_compile.runtime.ops import (
    GradReduction,
    all_gather_nograd,
    all_reduce_avg,
    cast_all_gather_differentiable,
    copy_to_host,
    reduce_scatter_avg,
    unshard,
)

if TYPE_CHECKING:
    from fsdp_compile._watch import ModelWatch

__all__ = [
    "Piece", "UnitState", "cut_pieces", "full_shape", "is_sharded", "register_units", "host_empty", "sharded_units",
    "unit_of_shard",
]

UNITS_ATTR = "_fsdp_compile_units"
"""On the module shard() was called on: its units, in order."""
SLOTS_ATTR = "_fsdp_compile_slots"
"""On every module owning a sharded parameter: name -> (unit, slot)."""

_units_by_shard: weakref.WeakValueDictionary[int, UnitState] = weakref.WeakValueDictionary()
"""id(flat shard) -> its unit. Weak, like every reference from a tensor back to its unit: a cycle through a
tensor's hooks is invisible to Python's garbage collector, and would keep a deleted model's shards alive."""


class Piece(NamedTuple):
    """One parameter's part of this rank's flat shard: the ``nn.Parameter`` the optimizer sees (a 1-D view,
    possibly empty), its slot in the unit's layout, and where it lies in the shard (``[lo, hi)``)."""

    param: nn.Parameter
    slot: ParamSlot
    lo: int
    hi: int


SHAPE_ATTR = "_fsdp_compile_shape"
"""On each piece: the shape of its whole parameter."""


def cut_pieces(flat: torch.Tensor, layout: UnitLayout, rank: int, requires_grad: list[bool]) -> list[Piece]:
    """One ``nn.Parameter`` per slot, a view of its part of this rank's flat shard ``flat``."""
    pieces = []
    for slot, grad in zip(layout.slots, requires_grad):
        lo, hi = layout.local_range(slot, rank)
        pieces.append(Piece(nn.Parameter(flat.detach()[lo:hi], requires_grad=grad), slot, lo, hi))
        setattr(pieces[-1].param, SHAPE_ATTR, torch.Size(slot.shape))
    return pieces


def full_shape(param: torch.Tensor) -> torch.Size:
    """The shape of the whole parameter a sharded piece is part of (every piece is 1-D: ``p.dim()`` says nothing of
    the parameter); any other tensor's own shape. FSDP2's DTensor parameters keep theirs."""
    return getattr(param, SHAPE_ATTR, param.shape)


def host_empty(like: torch.Tensor, pin_memory: bool) -> torch.Tensor:
    """CPU offload: an uninitialised tensor of ``like``'s shape and dtype in host memory, pinned where asked and a
    GPU can read it (copies from pinned memory are asynchronous, and much faster)."""
    return torch.empty(like.shape, dtype=like.dtype, pin_memory=pin_memory and torch.cuda.is_available())


class UnitState:
    """One FSDP unit on this rank: its layout, flat shard, parameter pieces and collective settings."""

    def __init__(
        self,
        *,
        layout: UnitLayout,
        flat: torch.Tensor,
        pieces: list[Piece],
        group: dist.ProcessGroup,
        replicate_group: dist.ProcessGroup | None = None,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        grad_reduction: GradReduction,
        reshard_after_forward: bool,
        watch: ModelWatch,
        offload_to: torch.device | None = None,
        pin_memory: bool = False,
        float8: tuple[Float8Weight, ...] = (),
    ) -> None:
        self.layout = layout
        self.float8 = float8
        """torchao float8 weights (every slot), gathered as float8 under compile (``fsdp_compile.runtime.float8``);
        empty: gathered in ``param_dtype``."""

        self.offload_to = offload_to
        """CPU offload: the device the unit computes on (its shard, gradient and optimizer state live in host
        memory; on the meta device until ``to_empty`` says where). None: not offloaded."""
        self.pin_memory = pin_memory
        self._slot_index = {slot.offset: i for i, slot in enumerate(layout.slots)}
        self.flat = flat
        self.pieces = pieces
        self.group = group
        self.group_name: str = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        """HSDP: the unit is replicated over ``replicate_group`` (None: not replicated)."""
        self.replicate_group = replicate_group if self.replicas > 1 else None
        self.replicate_group_name = None if self.replicate_group is None else self.replicate_group.group_name
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.grad_reduction: GradReduction = grad_reduction
        self.reshard_after_forward = reshard_after_forward
        """False: the gathered unit is kept from forward to backward instead of gathered again."""
        self.requires_gradient_sync = True
        self.accum: torch.Tensor | None = None
        """Gradient sync off: a full-size leaf in reduce_dtype whose .grad accumulates the unreduced gradient."""
        self.eager = EagerUnit(
            weak_method(self.cast_all_gather_differentiable),
            weak_method(self.shard_version),
            weak_method(watch.backward_ran),
            reshard=(self.world_size > 1 or offload_to is not None) and reshard_after_forward,
        )
        """Eager mode (the unit's forward hooks and saved-tensor hooks). It calls back into this unit weakly: no
        cycle, so a deleted model is freed by reference counting ([Note: eager gather and reshard])."""
        self.outside: Callable[[ParamSlot], torch.Tensor] | None = None
        """Inside ``init_parameters`` or ``summon_full_params``: what reading a parameter gives (its full value)."""
        self.watch = watch
        self.backward_pass = -1
        """CPU offload: the backward pass in which a compiled graph last gave the unit a gradient
        (``fsdp_compile._backend._after_backward``)."""
        self.on_gradient: Callable[[UnitState, torch.Tensor], None] | None = None
        """Inside ``fsdp_compile.step_in_backward``: called with the unit and its gradient once it has landed (it steps
        the unit's parameters)."""
        """The model's :class:`~fsdp_compile._watch.ModelWatch` (whether its forward runs; its backward's progress)."""
        self._hook_gradients()
        self._place_start()

    def __repr__(self) -> str:
        name = unit_label(self.layout.name)
        return f"UnitState({name!r}, params={len(self.layout.slots)}, shard={self.layout.shard_numel})"

    @property
    def trainable(self) -> bool:
        """Whether the unit's parameters train: only then has its flat shard a gradient (and a reduction)."""
        return self.flat.requires_grad

    def shard_version(self) -> int:
        """The flat shard's tensor version: an in-place update (an optimizer step) changes it."""
        return self.flat._version

    def describe_gather(self) -> str:
        """The unit's all-gather and gradient reduction, as the ranks compare them (``fsdp_compile._agree``; with
        HSDP also across the replicas, whose groups have names of their own: no group names here)."""
        gradients = f"gradients by {self.grad_reduction} in {self.reduce_dtype}" if self.trainable else "frozen"
        replicas = "" if self.replicate_group is None else f" x {self.replicas} replicas"
        offload = "" if self.offload_to is None else ", its shard in host memory"
        return (
            f"all-gather of unit {unit_label(self.layout.name)!r} ({self.layout.padded_numel} elements in "
            f"{self.gather_dtype}; {gradients}) over {self.world_size} ranks{replicas}{offload}"
        )

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype the unit travels in under compile: float8 for torchao's float8 weights, else ``param_dtype``."""
        return self.float8[0].float8_dtype if self.float8 else self.param_dtype

    @property
    def compute_device(self) -> torch.device:
        """Where the unit's gathered parameters, activations and gradients are: the shard's device, or (CPU
        offload) the device it is copied to."""
        return self.flat.device if self.offload_to is None else self.offload_to

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        """The groups of more than one rank the unit's gradients are averaged over: its group, then (HSDP) the
        replicas'."""
        return [g for g, n in ((self.group, self.world_size), (self.replicate_group, self.replicas)) if n > 1]

    def cast_all_gather_differentiable(self) -> torch.Tensor:
        """All-gather the whole unit in ``param_dtype`` in eager mode, differentiable like the compiled graphs."""
        return cast_all_gather_differentiable(
            self.flat,
            self.accum,
            self.param_dtype,
            self.reduce_dtype,
            self.grad_reduction,
            self.world_size,
            self.group_name,
            self.replicas,
            self.replicate_group_name,
            self.offload_to,
        )

    def start(self) -> torch.Tensor:
        """Where this rank's shard begins in the unit, as a 0-d tensor on the device the unit computes on: the input
        that lets a float8 gather's graph be the same on every rank (``fsdp_compile.runtime.float8``)."""
        start = self._start  # made where the unit's shard is given storage (traced, it would be a constant)
        if start is None or start.device != self.compute_device:
            raise AssertionError(f"{self!r}: its start is {start}, not on {self.compute_device}")
        return start

    def _place_start(self) -> None:
        start = self.rank * self.layout.shard_numel
        self._start = torch.tensor(start, device=self.compute_device) if self.float8 else None

    def unshard_param(self, slot: ParamSlot) -> torch.Tensor:
        """The full parameter ``slot``: a marker op under compile; in eager, a view of the gathered unit (inside the
        model's forward but outside the unit's, gathered for the read, one whose in-place writes raise); inside
        ``init_parameters`` or ``summon_full_params``, what they give. Outside the model's forward, a read raises: it
        would be a collective on this rank alone. A parameter frozen at ``shard()`` that asks for a gradient now is
        refused (Dynamo guards on it)."""
        if not self.trainable and self.piece(slot).param.requires_grad:
            raise RuntimeError(
                f"{slot.names[0]} was frozen (requires_grad=False) when fsdp_compile.shard() ran and now requires a "
                "gradient: it lives in a buffer without one and would never train. Set requires_grad before shard()"
            )
        if torch.compiler.is_compiling():
            if self.eager.gathered is not None:  # a piece of a forward compiled apart: gathered around it, in Python
                return self.eager.param(slot.offset, slot.numel, slot.shape)
            return unshard(self.flat, self.accum, slot.offset, slot.numel, list(slot.shape), self.param_dtype,
                           self.compute_device, self.start() if self.float8 else None)
        if self.outside is not None:
            return self.outside(slot)
        if self.flat.is_meta:
            raise RuntimeError(
                f"{slot.names[0]} is on the meta device: allocate the shards with model.to_empty(device=...), then "
                "fsdp_compile.init_parameters(model) (or load a checkpoint)"
            )
        if self.eager.gathered is not None:
            return self.eager.param(slot.offset, slot.numel, slot.shape)
        if not self.watch.depth and _internals.running_backward():
            raise RuntimeError(read_in_backward_message(slot.names[0], unit_label(self.layout.name)))
        if not self.watch.depth:  # raises (DCP's model state-dict helpers, which read to map names, get the piece)
            return read_outside_forward(self.piece(slot).param, slot.shape, slot.names)
        return outside_forward(self.eager.param(slot.offset, slot.numel, slot.shape), slot.names[0])

    def gathered_for_forward(self, *, resharded: bool = False) -> contextlib.AbstractContextManager[None]:
        """Around the unit module's ``forward`` (its sharded class's): the unit gathered in eager mode when the forward
        runs inside the model's forward or backward but not through the module's ``__call__`` (Hugging Face's gradient
        checkpointing recomputes ``forward`` in backward), or is compiled in pieces; elsewhere nothing (reads raise as
        they would). ``resharded``: see ``EagerUnit.gathered_for_forward``."""
        if self.outside is not None or self.flat.is_meta or not (self.watch.depth or _internals.running_backward()):
            return contextlib.nullcontext()
        return self.eager.gathered_for_forward(resharded=resharded)

    def piece(self, slot: ParamSlot) -> Piece:
        return self.pieces[self._slot_index[slot.offset]]

    @torch.no_grad()
    def write_local_parts(self, full: Mapping[int, torch.Tensor]) -> None:
        """Write this rank's part of each full parameter in ``full`` (by slot offset) to the shard."""
        for piece in self.pieces:
            if piece.slot.offset in full:
                self.flat.detach()[piece.lo : piece.hi].copy_(self.local_part(piece.slot, full[piece.slot.offset]))

    def materialize(self, empty: Callable[[torch.Tensor], torch.Tensor]) -> list[Piece]:
        """Give a flat shard on the meta device storage, ``empty(flat)`` (``module.to_empty``), and cut new
        pieces of it; return the old pieces (their owners must be given the new ones)."""
        old, replaced = self.flat, self.pieces
        if self.offload_to is None:
            new = empty(old.detach())
        else:  # to_empty's device is where the unit computes; the shard is allocated on the host
            self.offload_to = empty(old.detach()[:0]).device
            new = host_empty(old, self.pin_memory)
        self.flat = new.zero_().requires_grad_(old.requires_grad)  # the padding zero, as shard()'s
        _internals.mark_static(self.flat)
        self.pieces = cut_pieces(self.flat, self.layout, self.rank, [p.param.requires_grad for p in replaced])
        self._hook_gradients()
        self._place_start()
        _units_by_shard.pop(id(old), None)
        _units_by_shard[id(self.flat)] = self
        return replaced

    @torch.no_grad()
    def all_gather_params_nograd(self, local: torch.Tensor | None = None) -> list[torch.Tensor]:
        """All-gather a shard-shaped tensor (default: the flat shard itself), without autograd and without a
        cast, and return the full value of every parameter, in slot order. A collective: every rank calls it."""
        local = (self.flat if local is None else local).detach().to(self.compute_device)
        full = local if self.world_size == 1 else all_gather_nograd(local, self.world_size, self.group_name)
        return [full[s.offset : s.offset + s.numel].view(s.shape) for s in self.layout.slots]

    def all_gather_pieces_nograd(
        self, per_piece: Callable[[nn.Parameter], torch.Tensor | None], like: torch.Tensor
    ) -> list[torch.Tensor]:
        """``all_gather_params_nograd`` of a shard assembled from one tensor per piece (its gradient, an
        optimizer state, ...; zeros where ``per_piece`` gives None), in ``like``'s dtype and device."""
        local = like.new_zeros(self.layout.shard_numel)
        for piece in self.pieces:
            value = per_piece(piece.param)
            if value is not None:
                local[piece.lo : piece.hi] = value
        return self.all_gather_params_nograd(local)

    def local_part(self, slot: ParamSlot, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a full parameter-shaped tensor ``full`` (a 1-D view)."""
        start, stop = self.layout.flat_range(slot, self.rank)
        return full.reshape(-1)[start:stop]

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.requires_gradient_sync = requires
        if not requires and self.accum is None and self.trainable and (self.groups or self.offload_to is not None):
            # a unit with a reduction, or offloaded (its gradient is not copied to the host each micro-batch)
            # A stride-0 view of one element: a leaf of full shape that costs no memory until it has a grad.
            zero = torch.zeros((), dtype=self.reduce_dtype, device=self.compute_device)
            self.accum = zero.expand(self.layout.padded_numel).requires_grad_()
            self.accum.register_post_accumulate_grad_hook(weak_method(self._reduce_accumulated))

    def _reduce_accumulated(self, accum: torch.Tensor) -> None:
        """Post-accumulate hook of ``accum``: on the micro-batch that syncs, reduce-scatter once (and average
        over the replicas)."""
        self.watch.backward_ran()
        if not self.requires_gradient_sync or accum.grad is None:
            return
        reduced = accum.grad
        if self.world_size > 1:
            reduced = reduce_scatter_avg(reduced, self.world_size, self.group_name)
        if self.replicate_group_name is not None:
            reduced = all_reduce_avg(reduced, self.replicate_group_name)
        accum.grad = None
        self.accum = None
        counters["fsdp_compile"]["accumulated_reduce_scatters"] += 1
        reduced = reduced.to(self.flat.dtype)
        self._deliver(reduced if self.offload_to is None else copy_to_host(reduced))

    def _hook_gradients(self) -> None:
        """The flat shard's gradient hooks: its pieces get their slices once it has accumulated; offloaded, autograd
        waits first for the copy to the host it got (autograd keeps or copies it: a host read)."""
        if not self.trainable:
            return
        if self.offload_to is not None:
            self.flat.register_hook(_landed)
        self.flat.register_post_accumulate_grad_hook(weak_method(self.distribute_grad))

    def distribute_grad(self, flat: torch.Tensor) -> None:
        """Post-accumulate hook of the flat shard: hand each piece its slice, then clear ``flat.grad``."""
        self.watch.backward_ran()
        grad = flat.grad
        flat.grad = None
        if grad is not None:
            self._deliver(grad)

    def _deliver(self, grad: torch.Tensor) -> None:
        """Hand each trainable piece its slice of ``grad`` (added to the piece's gradient if it has one); then, inside
        ``step_in_backward``, have the unit's parameters stepped."""
        for piece in self.pieces:
            if not piece.param.requires_grad:
                continue
            if piece.param.grad is None:
                piece.param.grad = grad[piece.lo : piece.hi]
            else:
                host_copies.wait_for(grad)
                piece.param.grad.add_(grad[piece.lo : piece.hi])
        if self.on_gradient is not None:
            self.on_gradient(self, grad)


def _landed(grad: torch.Tensor | None) -> None:
    """Gradient hook of an offloaded flat shard: its copy to the host done (None: a graph gave it none)."""
    if grad is not None:
        host_copies.wait_for(grad)


def register_units(module: nn.Module, states: list[UnitState]) -> None:
    """Record ``states`` as the units of ``module`` and of their flat shards."""
    for state in states:
        _units_by_shard[id(state.flat)] = state
    object.__setattr__(module, UNITS_ATTR, states)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules has been sharded."""
    return getattr(module, UNITS_ATTR, None) is not None or any(hasattr(m, SLOTS_ATTR) for m in module.modules())


def sharded_units(module: nn.Module) -> list[UnitState]:
    """The units of a module that ``shard()`` has sharded (root unit first, then in module order)."""
    states = getattr(module, UNITS_ATTR, None)
    if states is None:
        raise ValueError(f"{type(module).__name__} is not sharded: call fsdp_compile.shard(module, units=...) first")
    return list(states)


def unit_of_shard(tensor: object) -> UnitState | None:
    """The unit whose flat shard ``tensor`` is, or None."""
    state = _units_by_shard.get(id(tensor))
    return state if state is not None and state.flat is tensor else None
