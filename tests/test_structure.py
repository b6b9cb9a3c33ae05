"""The repository's structure holds: the design card's layout (top-level passes/ and lowering/, installed as
fsdp_compile.passes and fsdp_compile.lowering only), no import cycle between library modules, torch
internals used in one package only, docs/architecture.md's module map lists every module, and each module
imports only from its own layer or the layers below it (the map's layer column)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "fsdp_compile": ROOT / "fsdp_compile",
    "fsdp_compile.passes": ROOT / "passes",
    "fsdp_compile.lowering": ROOT / "lowering",
}
"""Where each library package's files are (pyproject.toml's package-dir)."""
INTERNALS = "fsdp_compile._internals"
LAYERS = ("internals", "base", "runtime", "model", "passes", "lowering", "backend", "api", "testing")
"""The module map's layers, lowest first: a module may import from its own layer and the ones before it."""
FOLDERS = {"fsdp_compile/_internals/", "fsdp_compile/testing/"}
"""Folders the module map lists as one row (their modules share its layer)."""


def _library() -> dict[str, Path]:
    """Module name -> file, for every library module (the test helpers under fsdp_compile/testing too)."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


LIBRARY = _library()


def _imports(name: str, path: Path) -> Iterator[tuple[str, ast.AST]]:
    """Every module ``name`` imports (absolute names; relative imports resolved), with the node. A package
    whose submodule is imported is not counted (it is imported first, but that is no edge of the graph)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:  # a submodule, or a name defined in the module `base`
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in LIBRARY else base), node


def _library_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in LIBRARY}
    for name, path in LIBRARY.items():
        for imported, _ in _imports(name, path):
            if imported in LIBRARY and imported != name:
                edges[name].add(imported)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, if there is any (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_library_modules_import_each_other_without_a_cycle() -> None:
    edges = _library_edges()
    assert edges["fsdp_compile._backend"] >= {"fsdp_compile.passes.schedule_overlap"}, "the import scan sees nothing"
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in parts)


def _torch_internals_used(name: str, path: Path) -> list[str]:
    """Private torch modules ``name`` imports, and private attributes of torch it reads
    (``torch._C``, ``torch.ops._c10d_functional``, ``torch.distributed._symmetric_memory``; an op name
    such as ``torch.ops.aten._to_copy`` is not one)."""
    used = [
        imported
        for imported, _ in _imports(name, path)
        if imported.split(".")[0] == "torch" and _private(imported.split("."))
    ]
    aliases = {"torch": ["torch"]}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            aliases.update(
                {a.asname: a.name.split(".") for a in node.names if a.asname and a.name.startswith("torch.")}
            )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            aliases.update({a.asname or a.name: [*node.module.split("."), a.name] for a in node.names})
    for node in ast.walk(ast.parse(path.read_text())):
        chain: list[str] = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases and chain:
            parts = aliases[node.id] + chain
            checked = parts[1:3] if parts[1:2] == ["ops"] else parts[1:]
            if _private(checked):
                used.append(".".join(parts))
    return used


def test_the_internals_scan_sees_private_uses(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch\nimport torch.distributed as dist\nfrom torch._dynamo.utils import counters\n"
        "x = torch.ops._c10d_functional.wait_tensor\ny = dist._functional_collectives\nz = torch.ops.aten._to_copy\n"
    )
    found = _torch_internals_used("fsdp_compile.sample", sample)
    assert "torch._dynamo.utils" in found and "torch.ops._c10d_functional.wait_tensor" in found
    assert "torch.distributed._functional_collectives" in found
    assert not any("_to_copy" in f for f in found)


def test_only_the_internals_module_uses_torch_internals() -> None:
    offenders = {
        name: used
        for name, path in LIBRARY.items()
        if name != INTERNALS
        and not name.startswith((f"{INTERNALS}.", "fsdp_compile.testing"))
        and (used := _torch_internals_used(name, path))
    }
    assert not offenders, f"torch internals outside {INTERNALS}: {offenders}"
    assert _torch_internals_used(INTERNALS, LIBRARY[INTERNALS]), "the scan finds nothing in the internals module"


def _module_map() -> dict[str, str]:
    """docs/architecture.md's module map: file or folder (as the map writes it) -> layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Module map") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `")]
    return {path.strip().strip("`"): layer.strip() for layer, path in ((r[1], r[0]) for r in rows)}


def _file_of(name: str) -> str:
    """A module's file as the map writes it: ``passes/x.py`` for ``fsdp_compile.passes.x``."""
    return LIBRARY[name].relative_to(ROOT).as_posix()


def _layer_of(name: str, rows: dict[str, str]) -> str | None:
    path = _file_of(name)
    folder = next((f for f in FOLDERS if path.startswith(f)), None)
    return rows.get(folder or path)


def test_the_module_map_lists_every_module_once_and_nothing_else() -> None:
    rows = _module_map()
    files = {_file_of(name) for name in LIBRARY}
    listed = {path for path in rows if path not in FOLDERS}
    assert not files - listed - {f for f in files if f.startswith(tuple(FOLDERS))}, sorted(files - listed)
    assert not listed - files, f"the module map lists files that do not exist: {sorted(listed - files)}"
    assert set(rows.values()) <= set(LAYERS), f"layers not in {LAYERS}: {set(rows.values()) - set(LAYERS)}"
    assert len(rows) > 40, "the map's parser sees too few rows"


def test_each_module_imports_only_from_its_layer_or_below() -> None:
    rows = _module_map()
    assert all(_layer_of(name, rows) in LAYERS for name in LIBRARY), "a module without a layer: see the map's test"
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = sorted(
        f"{name} ({_layer_of(name, rows)}) imports {imported} ({_layer_of(imported, rows)})"
        for name, imports in _library_edges().items()
        for imported in imports
        if rank[_layer_of(imported, rows)] > rank[_layer_of(name, rows)]
    )
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


@pytest.mark.slow
def test_the_wheel_installs_passes_and_lowering_inside_the_package(tmp_path: Path) -> None:
    """pyproject.toml maps the top-level folders into the package: nothing called passes or lowering may
    land at the top of site-packages."""
    source = tmp_path / "source"  # a copy of the tracked files: no stale build/ folder can leak into the wheel
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for name in filter(None, tracked.split("\0")):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = tmp_path.glob("fsdp_compile-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files if not f.split("/")[0].endswith(".dist-info")}
    assert tops == {"fsdp_compile"}, tops
    for module in (
        "fsdp_compile/passes/schedule_overlap.py",
        "fsdp_compile/lowering/lower_to_copy_engines.py",
        "fsdp_compile/_internals/__init__.py",
        "fsdp_compile/testing/llama.py",
        "fsdp_compile/lowering/route_measurements.json",
    ):
        assert module in files, module
    expected = {
        f"{name.replace('.', '/')}{'/__init__' if p.name == '__init__.py' else ''}.py" for name, p in LIBRARY.items()
    }
    assert expected <= set(files), sorted(expected - set(files))


@pytest.mark.parametrize("package", ["fsdp_compile.passes", "fsdp_compile.lowering"])
def test_the_mapped_packages_import_from_their_top_level_folders(package: str) -> None:
    module = __import__(package, fromlist=["_"])
    assert Path(module.__file__).resolve().parent == PACKAGES[package]


def test_a_missing_torch_feature_is_named_with_the_torch_version() -> None:
    import re

    import torch

    from fsdp_compile import _internals

    message = f"needs torch._dynamo.utils.no_such_thing, which torch {torch.__version__} lacks"
    with pytest.raises(_internals.MissingTorchFeature, match=re.escape(message)):
        _internals._need("torch._dynamo.utils", "no_such_thing")


def test_each_graph_pass_is_named_as_its_module_and_plans_into_a_plan_class() -> None:
    """A pass's artifacts, log lines and ``disabled_passes`` entry use its ``name``: its module's, so a dump's
    ``*_plan_memory_plan.json`` leads to ``passes/plan_memory.py``; its plan's class ends in ``Plan``."""
    import importlib
    import inspect
    import typing

    from fsdp_compile.passes._graph import GraphPass

    passes = []
    for name in LIBRARY:
        if name.startswith(("fsdp_compile.passes.", "fsdp_compile.lowering.")):
            module = importlib.import_module(name)
            classes = [c for c in vars(module).values() if inspect.isclass(c) and c.__module__ == name]
            passes += [c for c in classes if issubclass(c, GraphPass) and c is not GraphPass]
    assert len(passes) >= 6, passes
    for cls in passes:
        assert cls.name == cls.__module__.rsplit(".", 1)[-1], (cls, cls.name)
        plan = typing.get_type_hints(cls.plan)["return"]
        assert plan.__name__.endswith("Plan"), (cls, plan)


def test_the_budget_tool_reads_the_budget_docs_state_and_reports_a_run() -> None:
    """``tests/budget.py`` (not a test: it reads a timing) finds docs/testing.md's budgets and judges a full run, the
    quick subset and a selection by the budget that applies, from the record tests/conftest.py writes; a run that
    started with Inductor's cache warm gets no verdict."""
    import budget

    limits = budget.budgets()
    assert set(limits) == {"full", "quick"} and limits["quick"] < limits["full"]
    tests = {"tests/test_a.py::one": {"seconds": 5.0, "outcome": "passed", "worker": "gw0"},
             "tests/test_a.py::two": {"seconds": 3.0, "outcome": "passed", "worker": "gw0"},
             "tests/test_b.py::one": {"seconds": 1.0, "outcome": "failed", "worker": "gw1"}}
    record = {"wall_seconds": limits["full"] + 1.0, "args": [], "selection": None, "exit_status": 1,
              "date": "2026-12-05 12:00", "cpus": 2, "python": "3.11", "torch": "2.13.0", "tests": tests}
    text, within = budget.report(record, limits, top=1)
    assert not within and "OVER by 1 s" in text and "tests/test_a.py" in text and "tests/test_b.py" not in text
    assert "gw0 8 s, gw1 1 s (sum 9 s)" in text
    text, within = budget.report({**record, "inductor_cache_warm": True}, limits, top=1)
    assert within and "cache warm" in text and "no verdict" in text  # the budget is for empty caches
    quick = {**record, "selection": budget.QUICK, "wall_seconds": limits["quick"] - 1.0}
    assert budget.report(quick, limits, top=2)[1]
    some = {**record, "selection": "some"}
    text, within = budget.report(some, limits, top=2)
    assert within and "no budget applies" in text
