"""A script's ``main`` on the suite's ranks: a script run as a program spawns ranks that import torch afresh (seconds
of CPU each), so the suite runs each example's command line once at most and calls ``main`` on its kept ranks."""

from __future__ import annotations

import contextlib
import importlib.util
import pathlib
from types import ModuleType

__all__ = ["load_script", "run_script_main"]


def load_script(path: str | pathlib.Path) -> ModuleType:
    """The script at ``path`` as a module (its ``if __name__ == "__main__"`` block not run)."""
    spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script_main(rank: int, world_size: int, path: str, out: str, *args: object) -> None:
    """``main(rank, world_size, *args)`` of the script at ``path`` (a :func:`~fsdp_compile.testing.dist.run_ranks`
    function), what it prints written into ``out.<rank>``."""
    main = load_script(path).main
    with open(f"{out}.{rank}", "w") as f, contextlib.redirect_stdout(f):
        main(rank, world_size, *args)
