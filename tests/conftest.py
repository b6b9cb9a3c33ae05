import inspect
import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# Tests assert behaviour, never a timing: no per-example deadline and no "input generation is slow" health check,
# which failed a property test on a busy 2-core machine (one draw stalled 2.2 s; CI's machine is as small).
settings.register_profile("fsdp_compile", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fsdp_compile")

# One Inductor cache for the whole session, inherited by spawned ranks: identical graphs compile once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fsdp_compile_test_inductor"))


@pytest.fixture(autouse=True)
def _regions_on() -> None:
    """Every test starts with units traced as shared bodies (a unit whose forward broke the graph switches them off
    for the rest of the process: fsdp_compile._regions)."""
    from fsdp_compile._regions import Regions

    Regions.on = True


@pytest.fixture
def fake_pg():
    """A one-process fake process group of world size 2 (rank 0): traces and compiles, values are garbage."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


# The files that take longest (most compiles), first: the two workers take a file at a time in this order, and a
# long file started last would run alone at the end while the other worker idles.
LONGEST_FIRST = ("test_finetune.py", "test_parity.py", "test_codegen.py", "test_benchmark.py", "test_graphs.py",
                 "test_schedule.py", "test_plan_memory.py", "test_dcp.py", "test_recompiles.py")


RANK_RUNNERS = ("run_ranks(", "spawn_ranks(", "run_faulty(")
"""How a test that runs ranks of its own starts them."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``ranks`` every test that runs ranks of its own (``RANK_RUNNERS``), as read from its source:
    ``tests/repeat_ranks.sh`` runs them again and again, to find the flaky ones. Order the files ``LONGEST_FIRST``
    (a file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and any(call in inspect.getsource(function) for call in RANK_RUNNERS):
            item.add_marker(pytest.mark.ranks)
