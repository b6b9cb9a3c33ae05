import importlib.metadata
import inspect
import json
import os
import platform
import tempfile
import time

import pytest
import torch
from budget import RECORD  # where the last run's durations go: tests/budget.py reads them
from hypothesis import HealthCheck, settings

# Tests assert behaviour, never a timing: no per-example deadline and no "input generation is slow" health check,
# which failed a property test on a busy 2-core machine (one draw stalled 2.2 s; CI's machine is as small).
settings.register_profile("fsdp_compile", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("fsdp_compile")

# One Inductor cache for the whole session, inherited by spawned ranks: identical graphs compile once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "fsdp_compile_test_inductor"))
# One intra-op thread, as every rank has (fsdp_compile.testing.dist): the two workers share the cores, and
# Inductor writes a kernel for the threads it will run on, so the workers' kernels are the ranks' (one build each).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_compiles() -> None:
    """Every test starts with units traced as shared bodies (a unit whose forward broke the graph switches them off
    for the rest of the process: fsdp_compile._regions) and with Dynamo reset: a worker's earlier tests compiled
    ``Llama.forward`` too, and the files a worker runs change with the order (past Dynamo's recompile limit, 8, a
    test that compiled it in-process once more failed)."""
    import torch

    from fsdp_compile._regions import Regions

    Regions.on = True
    torch._dynamo.reset()


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
LONGEST_FIRST = ("test_default_path.py", "test_codegen.py", "test_benchmark.py", "test_parity.py", "test_examples.py",
                 "test_failures.py", "test_graphs.py", "test_recompiles.py", "test_init_parameters.py",
                 "test_finetune.py", "test_gradient_checkpointing.py", "test_plan_memory.py", "test_shared_bodies.py",
                 "test_rank_consistency.py", "test_dcp.py", "test_schedule.py", "test_explain.py", "test_lowering.py")
"""From tests/budget.py's table of a fresh run (keep it in that order when a file's time changes a lot)."""


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


_run: dict = {}


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers have it; the run's own process does not


def pytest_sessionstart(session: pytest.Session) -> None:
    if _controller(session.config):
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]  # warm: the budget's cold compiles were paid by an earlier run
        _run.update(start=time.monotonic(), tests={}, cache_warm=os.path.isdir(cache) and bool(os.listdir(cache)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "tests" in _run:
        test = _run["tests"].setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed",
                                                        "worker": getattr(report, "worker_id", "main")})
        test["seconds"] += report.duration
        if report.outcome != "passed" and test["outcome"] == "passed":
            test["outcome"] = report.outcome


def _selection(config: pytest.Config) -> str | None:
    """What part of the suite the run chose: None for all of it, else its marker expression or "some"."""
    if config.option.markexpr:
        return config.option.markexpr
    chose = config.args_source != pytest.Config.ArgsSource.TESTPATHS or config.option.keyword
    return "some" if chose or config.getoption("lf", False) or config.getoption("deselect", None) else None


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "tests" not in _run or session.config.option.collectonly:
        return
    record = {
        "wall_seconds": round(time.monotonic() - _run["start"], 1),
        "args": list(session.config.invocation_params.args),
        "selection": _selection(session.config),
        "inductor_cache_warm": _run["cache_warm"],
        "exit_status": int(exitstatus),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "tests": {k: {**v, "seconds": round(v["seconds"], 2)} for k, v in _run["tests"].items()},
    }
    with open(RECORD, "w") as f:
        json.dump(record, f, indent=1)
