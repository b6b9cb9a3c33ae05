"""Where each parameter of a unit lives in the unit's flat buffer, and which part of it a rank holds.

Pure planning: no tensors are touched here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["UNIT", "ParamSlot", "UnitLayout", "plan_layout", "unit_label"]


def unit_label(name: str) -> str:
    """How messages, tables and pictures name a unit (a :attr:`UnitLayout.name`): its fully qualified name,
    ``<root>`` for the root's (""), then ``[part]`` for one parameter group of a unit that has several."""
    return "<root>" + name if name[:1] in ("", "[") else name


UNIT = "fsdp_compile.unit"
"""Key in ``meta["custom"]`` of the nodes ``insert_collectives`` adds (tracing copies it onto the collectives
they become, in forward and backward): the unit's fully qualified name, for graph dumps and plans."""


ALIGN_ELEMENTS = 16
"""Each parameter starts at a multiple of this many elements of the flat buffer (32 bytes in bf16), so
the views the all-gather hands to compute kernels stay aligned for vectorised loads."""


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of a unit: its names (several for a tied weight) and its place in the flat buffer."""

    names: tuple[str, ...]
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class UnitLayout:
    """The flat buffer of one unit: ``padded_numel`` elements, split evenly over ``world_size`` ranks."""

    fqn: str
    """The unit's module ("" for the root)."""
    slots: tuple[ParamSlot, ...]
    padded_numel: int
    world_size: int
    part: str = ""
    """Which parameter group of the unit this buffer holds, e.g. ``"bfloat16 frozen"``: "" when the unit has one.
    A unit whose parameters differ in dtype or ``requires_grad`` has one buffer per (dtype, requires_grad)."""

    @property
    def name(self) -> str:
        """The unit's name in plans, graphs and messages: its fqn, then ``[part]`` if it has one."""
        return f"{self.fqn}[{self.part}]" if self.part else self.fqn

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def local_range(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """The part of ``slot`` that ``rank`` holds, as ``[lo, hi)`` offsets into its shard (may be empty)."""
        start = rank * self.shard_numel
        lo = min(max(slot.offset - start, 0), self.shard_numel)
        hi = min(max(slot.offset + slot.numel - start, 0), self.shard_numel)
        return lo, max(lo, hi)

    def flat_range(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """The same part as ``[start, stop)`` offsets into the flattened parameter."""
        lo, hi = self.local_range(slot, rank)
        start = rank * self.shard_numel - slot.offset
        return start + lo, start + hi


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan_layout(
    fqn: str, params: list[tuple[tuple[str, ...], tuple[int, ...]]], world_size: int, part: str = ""
) -> UnitLayout:
    """Lay out ``params`` (names, shape), in the order given, in one buffer padded to a multiple of
    ``world_size``."""
    slots = []
    offset = 0
    for names, shape in params:
        numel = 1
        for size in shape:
            numel *= size
        offset = _round_up(offset, ALIGN_ELEMENTS)
        slots.append(ParamSlot(names=names, offset=offset, numel=numel, shape=shape))
        offset += numel
    padded = _round_up(max(offset, 1), world_size)
    return UnitLayout(fqn=fqn, slots=tuple(slots), padded_numel=padded, world_size=world_size, part=part)
