"""plan_layout: property-based checks of the flat-buffer layout (pure, no process group)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from fsdp_compile._layout import ALIGN_ELEMENTS, plan_layout

shapes = st.lists(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple), min_size=1, max_size=8)


@given(shapes=shapes, world_size=st.integers(1, 5))
def test_layout_is_aligned_disjoint_and_split_exactly(shapes: list[tuple[int, ...]], world_size: int) -> None:
    layout = plan_layout("u", [((f"p{i}",), s) for i, s in enumerate(shapes)], world_size)
    assert layout.padded_numel % world_size == 0
    end = 0
    for slot in layout.slots:
        assert slot.offset % ALIGN_ELEMENTS == 0 and slot.offset >= end
        end = slot.offset + slot.numel
    assert end <= layout.padded_numel < end + world_size + (end == 0) * world_size
    for slot in layout.slots:
        # Every element of every parameter is held by exactly one rank, in order.
        held = []
        for rank in range(world_size):
            lo, hi = layout.local_range(slot, rank)
            assert 0 <= lo <= hi <= layout.shard_numel
            held.extend(range(rank * layout.shard_numel + lo, rank * layout.shard_numel + hi))
        assert held == list(range(slot.offset, slot.offset + slot.numel))
        # The same parts as ranges of the flattened parameter: consecutive, covering it exactly.
        flat = [layout.flat_range(slot, rank) for rank in range(world_size)]
        assert [i for start, stop in flat for i in range(start, stop)] == list(range(slot.numel))
