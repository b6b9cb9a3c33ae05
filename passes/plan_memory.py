"""Plan the communication buffers of one compiled step into a few persistent slots (max-pool sizing).

Precondition: the scheduled post-grad forward graph of a compiled step (after ``schedule_overlap``) and,
once it is compiled, its backward graph (live ranges: ``fsdp_compile.passes._liveness``).
Postcondition: the plan (``MemoryPlan``) says, per process group, dtype and kind, which slots the step
needs, their sizes and places in the group's slab, and which slot each collective's buffer takes; it is
logged as the structured artifact ``fsdp_compile_plan_memory_plan``. Applied (the default), each graph's
all-gathers write into their slots: ``fsdp_compile::all_gather_into_slot`` into a view of a
``fsdp_compile::slot`` node (``fsdp_compile.passes._write_slots``), and, with ``exchanges`` (the backend's
``grad_reduce="copy_engine"``: the peers push into them), so do the gradient exchanges
(``fsdp_compile::exchange_into_slot``: the peers' parts of its output); the rest of the graph is unchanged. Other
gradient buffers (NCCL's exchanges, reduce-scatter inputs) are planned, not applied: the reductions read the
gradients where Inductor put them. A collective of symbolic size (dynamic shapes) is not planned.

Buffers, in the step's order (the forward's nodes, then the backward's):
- ``gathered``: an all-gather's output. Live from the all-gather's issue to the last read of any alias of it
  (views, ``wait_tensor``, a forward output saved for backward and its reads there).
- ``gradient``: a reduce-scatter's input (the unit's whole gradient in the dtype it travels in), live from its
  producer to the ``wait_tensor`` (the peers read it until then); the peers' parts of an exchange's output
  (``world - 1`` of ``world``: they take the slot when applied, the sum reads this rank's own from the
  gradient), live from the exchange's issue to its wait or last read, whichever is later.
Two buffers may share a slot only if their live ranges do not meet (a range is inclusive: the next
collective into a slot comes strictly after the last reader of the previous occupant).

Colouring: the slots of each (group, dtype, kind) are made by first fit in decreasing size (ties by start,
then name): a buffer takes the first slot none of whose occupants it meets, else opens one of its own
size, so a slot's size is its first, largest occupant. Finding the fewest total bytes is NP-hard
(max-colouring of an interval graph); for buffers of one size this is the classic optimal interval
colouring (as many slots as buffers live at once). Every figure is in bytes:
``lower_bound_bytes`` (the most bytes live at once) <= ``pool_bytes`` (the plan) <= ``per_collective_bytes``
(one buffer per collective, Inductor's per-site allocation), and ``pool_bytes`` <= ``maxpool_bytes``
(Megatron-FSDP's MaxPoolAllocator: as many buffers per (group, dtype, kind) as the plan, each the size of
that kind's largest).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import torch.fx as fx

from fsdp_compile import _internals
from fsdp_compile.passes import _liveness, _write_slots
from fsdp_compile.passes._graph import GraphPass
from fsdp_compile.passes._liveness import Buffer, ForwardBuffers, Kind, forward_buffers, step_buffers
from fsdp_compile.passes._write_slots import SlotUse, write_into_slots
from fsdp_compile.runtime import slots

__all__ = [
    "SLOT_ALIGNMENT",
    "Buffer",
    "ForwardBuffers",
    "MemoryPlan",
    "PlanMemory",
    "Slot",
    "forward_buffers",
    "hazards",
    "plan_memory",
    "slot_uses",
    "step_buffers",
]


SLOT_ALIGNMENT = 256
"""Bytes: every slot starts at a multiple of this in its group's slab (what CUDA's allocator guarantees)."""


@dataclass(frozen=True)
class Slot:
    group: str
    dtype: str
    kind: Kind
    nbytes: int
    offset: int
    """Where it starts in its group's slab, in bytes (``_layout``)."""
    occupants: tuple[str, ...]
    """Its buffers, by name, in step order."""


@dataclass(frozen=True)
class MemoryPlan:
    graphs: tuple[str, ...]
    """The graphs the plan covers: ``("forward",)`` or ``("forward", "backward")``."""
    buffers: tuple[Buffer, ...]
    """Every collective's buffer, in step order."""
    slots: tuple[Slot, ...]
    assignment: tuple[tuple[str, int], ...]
    """(buffer name, slot index), in step order: the same slot for the same collective every step."""
    unslotted: tuple[str, ...]
    """Buffers read after their graph ends (``Buffer.escapes``): each keeps its collective's own allocation."""
    slabs: tuple[tuple[str, int], ...]
    """(group, bytes) of the allocation (slab) each group's applied slots live in: the gathered slots and the
    gradient exchanges' (reduce-scatter inputs are planned, not applied)."""
    pool_bytes: int
    per_collective_bytes: int
    maxpool_bytes: int
    lower_bound_bytes: int

    @property
    def predicted_peak_bytes(self) -> int:
        """The slots are persistent: the communication buffers' peak is the pool."""
        return self.pool_bytes

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "predicted_peak_bytes": self.predicted_peak_bytes})

    def summary(self) -> str:
        return (
            f"{len(self.buffers)} buffers in {len(self.slots)} slots over {'+'.join(self.graphs)}: pool "
            f"{self.pool_bytes} B (per collective {self.per_collective_bytes}, max-pool {self.maxpool_bytes}, "
            f"lower bound {self.lower_bound_bytes})"
        )


def plan_memory(buffers: Iterable[Buffer], graphs: Sequence[str] = ("forward", "backward")) -> MemoryPlan:
    """Assign ``buffers`` to slots (the module docstring's first fit in decreasing size) and lay the slots out
    in their groups' slabs. Pure and deterministic: the same buffers in any order give the same plan."""
    ordered = tuple(sorted(buffers, key=_by_start))
    names = [b.name for b in ordered]
    if len(set(names)) != len(names):
        raise ValueError(f"buffer names must be unique: {sorted(n for n in set(names) if names.count(n) > 1)}")
    slot_keys: list[tuple[str, str, str]] = []
    slot_sizes: list[int] = []
    slot_members: list[list[Buffer]] = []
    for buffer in sorted(ordered, key=lambda b: (b.klass, -b.nbytes, b.start, b.name)):
        if buffer.escapes:
            continue
        for index, key in enumerate(slot_keys):
            if key == buffer.klass and not any(buffer.meets(other) for other in slot_members[index]):
                slot_members[index].append(buffer)
                break
        else:
            slot_keys.append(buffer.klass)
            slot_sizes.append(buffer.nbytes)
            slot_members.append([buffer])
    offsets, slabs = _layout(slot_keys, slot_sizes, [any(b.in_slab for b in members) for members in slot_members])
    slots = tuple(
        Slot(*key, nbytes=size, offset=offset, occupants=tuple(b.name for b in sorted(members, key=_by_start)))  # type: ignore[arg-type]
        for key, size, offset, members in zip(slot_keys, slot_sizes, offsets, slot_members)
    )
    slot_of = {name: index for index, slot in enumerate(slots) for name in slot.occupants}
    largest: dict[tuple[str, str, str], int] = {}
    for buffer in ordered:
        largest[buffer.klass] = max(largest.get(buffer.klass, 0), buffer.nbytes)
    unslotted = tuple(b for b in ordered if b.escapes)
    own = sum(b.nbytes for b in unslotted)
    return MemoryPlan(
        graphs=tuple(graphs),
        buffers=ordered,
        slots=slots,
        assignment=tuple((name, slot_of[name]) for name in names if name in slot_of),
        unslotted=tuple(b.name for b in unslotted),
        slabs=slabs,
        pool_bytes=sum(slot_sizes) + own,
        per_collective_bytes=sum(b.nbytes for b in ordered),
        maxpool_bytes=sum(largest[key] for key in slot_keys) + own,
        lower_bound_bytes=_most_live_at_once(ordered),
    )


def _layout(
    keys: Sequence[tuple[str, str, str]], sizes: Sequence[int], in_slab: Sequence[bool]
) -> tuple[list[int], tuple[tuple[str, int], ...]]:
    """Each slot's offset in its group's slab (each aligned to ``SLOT_ALIGNMENT``): the slots the plan applies
    (gathered, then gradient), then those it does not (reduce-scatter inputs: their offsets lie past the
    slab's end); and each group's slab: the end of the slots it applies."""
    offsets = [0] * len(keys)
    ends: dict[str, int] = {}
    slabs: dict[str, int] = {}
    for applied, kind in ((True, "gathered"), (True, "gradient"), (False, "gathered"), (False, "gradient")):
        for index, ((group, _, slot_kind), size) in enumerate(zip(keys, sizes)):
            if slot_kind == kind and in_slab[index] == applied:
                offsets[index] = ends.get(group, 0)
                ends[group] = offsets[index] + -(-size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        if applied:
            slabs.update(ends)
    return offsets, tuple(sorted(slabs.items()))


def _by_start(b: Buffer) -> tuple[int, int, str]:
    return (b.start, b.end, b.name)


def _most_live_at_once(buffers: Sequence[Buffer]) -> int:
    events = sorted([(b.start, 0, b.nbytes) for b in buffers] + [(b.end, 1, -b.nbytes) for b in buffers])
    live = most = 0
    for _, _, delta in events:  # at one position, starts (0) before ends (1): inclusive ranges
        live += delta
        most = max(most, live)
    return most


def hazards(plan: MemoryPlan) -> list[str]:
    """What would make the plan unsafe, in words (empty if none): two buffers that meet in one slot, a
    buffer larger than its slot or of another group, dtype or kind, a buffer in no slot or in two, an escaping
    buffer in a slot, slots that overlap in their slab."""
    found: list[str] = []
    by_name = {b.name: b for b in plan.buffers}
    placed = [name for slot in plan.slots for name in slot.occupants]
    slotted = {name for name, b in by_name.items() if not b.escapes}
    if set(plan.unslotted) != set(by_name) - slotted:
        escaping = sorted(set(by_name) - slotted)
        found.append(f"unslotted {sorted(plan.unslotted)} are not the escaping buffers {escaping}")
    for name in sorted(slotted ^ set(placed)):
        found.append(f"{name}: in no slot" if name in slotted else f"{name}: in a slot but not a slotted buffer")
    for name in sorted({n for n in placed if placed.count(n) > 1}):
        found.append(f"{name}: in several slots")
    if dict(plan.assignment) != {name: i for i, slot in enumerate(plan.slots) for name in slot.occupants}:
        found.append("the assignment disagrees with the slots' occupants")
    for index, slot in enumerate(plan.slots):
        members = [by_name[name] for name in slot.occupants if name in by_name]
        for b in members:
            if b.nbytes > slot.nbytes:
                found.append(f"{b.name}: {b.nbytes} bytes in slot {index} of {slot.nbytes}")
            if b.klass != (slot.group, slot.dtype, slot.kind):
                found.append(f"{b.name}: {b.klass} in slot {index} of {(slot.group, slot.dtype, slot.kind)}")
        for i, a in enumerate(members):
            for b in members[i + 1 :]:
                if a.meets(b):
                    found.append(
                        f"{a.name} [{a.start}, {a.end}] and {b.name} [{b.start}, {b.end}] meet in slot {index}"
                    )
        for other_index, other in enumerate(plan.slots[:index]):
            overlap = slot.offset < other.offset + other.nbytes and other.offset < slot.offset + slot.nbytes
            if other.group == slot.group and overlap:
                found.append(f"slots {other_index} and {index} overlap in group {slot.group}'s slab")
    return found


class PlanMemory(GraphPass):
    """The planner as part of Inductor's ``post_grad_custom_post_pass`` (after ``schedule_overlap``): a forward
    graph is planned alone and kept for its backward; a backward graph is planned with its forward (the
    step). One object per compiled step (the backend makes one per compile): it keeps its forward's buffers
    for its backward, and nothing outlives it. With
    ``apply``, each graph's all-gathers (and, with ``exchanges``, gradient exchanges; else those are planned,
    not applied, like reduce-scatter inputs) then write into their slots (``fsdp_compile.passes._write_slots``)."""

    name = "plan_memory"

    def __init__(
        self,
        *,
        apply: bool = True,
        symmetric: bool = False,
        cudagraphs: bool = False,
        exchanges: bool = False,
        ranks: Mapping[str, int] | None = None,
    ) -> None:
        self.write_slots, self.cudagraphs, self.exchanges = apply, cudagraphs, exchanges
        self.symmetric = symmetric
        """Slabs on GPUs in symmetric memory (the copy-engine routes read or write the peers' slots)."""
        self.ranks = dict(ranks or {})
        """This process's rank in each process group of the step's collectives, by group name."""
        self._forward: ForwardBuffers | None = None
        """The step's forward graph's buffers, kept from its forward until its backward is planned."""

    def options(self) -> str:  # applied exchanges: each rank's graph is its own (``_write_slots._write_exchange``)
        ranks = tuple(sorted(self.ranks.items())) if self.exchanges and self.write_slots else ()
        return f"{self.write_slots=} {self.symmetric=} {self.cudagraphs=} {self.exchanges=} {ranks=}"

    def plan(self, graph: fx.Graph) -> MemoryPlan:
        if not _is_backward(graph):
            return plan_memory(forward_buffers(graph).buffers, graphs=("forward",))
        # No forward kept: it came from a cache, so the backward is planned alone.
        forward = self._forward or ForwardBuffers((), 0, ())
        buffers = step_buffers(forward, graph)
        if not self.exchanges:
            buffers = tuple(replace(b, in_slab=False) if b.kind == "gradient" else b for b in buffers)
        return plan_memory(buffers, graphs=("forward", "backward") if forward.length else ("backward",))

    def sources(self) -> Sequence[str]:
        return (*super().sources(), _liveness.__file__, slots.__file__, _write_slots.__file__)

    def apply(self, gm: fx.GraphModule, plan: MemoryPlan) -> None:
        """Keeps a forward's buffers for its backward (and lets them go once it is planned), then writes the
        graph's all-gathers into their slots."""
        stage = "backward" if _is_backward(gm.graph) else "forward"
        self._forward = forward_buffers(gm.graph) if stage == "forward" else None
        if self.write_slots:
            uses = slot_uses(plan, stage)
            write_into_slots(gm, uses, symmetric=self.symmetric, keep_old=self.cudagraphs, ranks=self.ranks)
            _internals.counters["fsdp_compile"]["slotted_collectives"] += sum(len(u.collectives) for u in uses)


def slot_uses(plan: MemoryPlan, stage: str) -> tuple[SlotUse, ...]:
    """The plan's applied slots that hold buffers of the graph ``stage`` (``"forward"``/``"backward"``)."""
    slabs = dict(plan.slabs)
    in_slab = {b.name for b in plan.buffers if b.in_slab}
    uses = []
    for slot in plan.slots:
        names = (n for n in slot.occupants if n.startswith(f"{stage}/") and n in in_slab)
        collectives = tuple(name.split("/", 1)[1] for name in names)
        if collectives:
            uses.append(SlotUse(slot.group, slot.offset, slot.nbytes, slabs[slot.group], collectives))
    return tuple(uses)


def _is_backward(graph: fx.Graph) -> bool:
    """AOTAutograd names a backward graph's incoming gradients ``tangents_<i>``."""
    return any(n.name.startswith("tangents") for n in graph.find_nodes(op="placeholder"))
