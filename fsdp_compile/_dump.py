"""The dump folder: ``FSDP_COMPILE_DUMP=DIR`` (read when fsdp_compile is imported) or
``fsdp_compile.backend(dump=DIR)`` writes what a compile logs as structured artifacts to files, so that
``python -m fsdp_compile explain DIR`` (and a person) can read them without code:

    DIR/rank<R>/graph_<frame>_<compile>/NN_<stage>_<name>.<json|py>   one compiled graph (frame and compile
                                                                       id as Dynamo numbers them, [0/1])
    DIR/rank<R>/events.jsonl                                          recompiles, graph breaks, metrics

A run replaces what an earlier run wrote for the same rank (its first write removes it).

``<stage>`` is ``dynamo`` (the Dynamo graph: the unit table, the collectives plan, the graph before and after
``insert_collectives``), ``joint`` (``unalias_body_outputs`` where the step calls shared bodies, then ``reshard_after_forward``, on
AOTAutograd's joint graph), ``forward`` or
``backward`` (each post-grad pass's graph before and after and its plan,
the memory plan, Inductor's post-grad graph and its output code); ``NN`` numbers the files of a graph in the
order they were logged. The same records are what ``TORCH_TRACE`` gives ``tlparse``: this is a sink for them
(a handler on torch's structured-trace logger), not a second logging path. While it is active, compiles skip
Inductor's caches (a cached graph runs no pass and logs nothing).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp_compile import debug
from fsdp_compile._internals import trace_log

__all__ = ["ENV", "active", "disable", "dumping", "enable", "from_environment"]

ENV = "FSDP_COMPILE_DUMP"
_CONTEXT = {"rank", "frame_id", "frame_compile_id", "attempt", "compiled_autograd_id", "stack", "has_payload"}
_GRAPH_FILES = {"inductor_output_code": None, "dynamo_output_graph": "dynamo", "inductor_post_grad_graph": None}
"""Torch's own records kept beside ours, one file each (the rest of a TORCH_TRACE is for tlparse), and their
stage where it is always the same (Dynamo logs its graph before the backend runs)."""
_EVENTS = {"compilation_metrics", "recompile_reasons", "dynamo_graph_break_reason"}
"""Records that go to ``events.jsonl`` (recompiles, graph breaks, what each compile cost)."""
_METRICS = ("compile_id", "co_name", "co_filename", "co_firstlineno", "graph_node_count", "num_graph_breaks",
            "recompile_reason", "fail_type", "fail_reason", "restart_reasons", "entire_frame_compile_time_s")
"""The fields of Dynamo's ``compilation_metrics`` kept (the rest is Dynamo's and Inductor's configuration)."""
_EVENT_PAYLOAD_CHARS = 4000


_numbers: dict[Path, int] = {}
"""Files written so far per graph folder (kept across sinks: a backward compiles later, in a sink of its own)."""
_ranks: set[Path] = set()
"""Rank folders this process writes: what an earlier run left in one is removed before the first write."""
_lock = threading.Lock()


class _Sink(logging.Handler):
    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._write(getattr(record, "metadata", {}), getattr(record, "payload", None))
        except Exception:  # a debugging aid must never break a compile
            self.handleError(record)

    def _write(self, metadata: dict[str, Any], payload: str | None) -> None:
        kind = next((k for k in metadata if k not in _CONTEXT), None)
        if kind is None:
            return
        name = metadata[kind].get("name", kind) if kind == "artifact" and isinstance(metadata[kind], dict) else kind
        rank_dir = self.root / f"rank{metadata.get('rank', 0)}"
        graph = _graph_folder(metadata)
        if name in _EVENTS:
            fields = metadata[kind]
            if name == "compilation_metrics":
                fields = {k: fields.get(k) for k in _METRICS}
            event = {"event": name, "graph": graph, "metadata": fields,
                     "payload": (payload or "")[:_EVENT_PAYLOAD_CHARS]}
            with _lock:
                _start(rank_dir)
                with open(rank_dir / "events.jsonl", "a") as f:
                    f.write(json.dumps(event, default=str) + "\n")
            return
        if payload is None or graph is None or not (name.startswith("fsdp_compile_") or name in _GRAPH_FILES):
            return
        folder = rank_dir / graph
        encoding = metadata[kind].get("encoding", "string") if kind == "artifact" else "string"
        suffix = ".json" if encoding == "json" else ".py"
        with _lock:
            _start(rank_dir)
            folder.mkdir(parents=True, exist_ok=True)
            number = _numbers[folder] = _numbers.get(folder, 0) + 1
        stem = name.removeprefix("fsdp_compile_")
        stage = _GRAPH_FILES.get(name) or debug.current_stage()
        (folder / f"{number:02d}_{stage}_{stem}{suffix}").write_text(payload)


def _start(rank_dir: Path) -> None:
    """Before this process's first write to ``rank_dir``: remove an earlier run's dump of that rank (its
    graphs would be numbered the same, and explain would mix the runs)."""
    if rank_dir not in _ranks:
        _ranks.add(rank_dir)
        for old in rank_dir.glob("graph_*"):
            shutil.rmtree(old)
        (rank_dir / "events.jsonl").unlink(missing_ok=True)
    rank_dir.mkdir(parents=True, exist_ok=True)


def _graph_folder(metadata: dict[str, Any]) -> str | None:
    if metadata.get("frame_id") is None:
        return None
    attempt = metadata.get("attempt") or 0
    return f"graph_{metadata['frame_id']}_{metadata['frame_compile_id']}" + (f"_attempt{attempt}" if attempt else "")


_sinks: dict[Path, _Sink] = {}
_users: dict[Path, int] = {}
"""Compiles dumping to each folder right now (``backend(dump=...)``)."""
_held: set[Path] = set()
"""Folders :func:`enable` opened: they stay open until :func:`disable`."""


def enable(path: str | os.PathLike[str]) -> Path:
    """Write every compile's structured artifacts under ``path`` from now on, until :func:`disable`
    (idempotent per folder). ``FSDP_COMPILE_DUMP=DIR`` calls it when fsdp_compile is imported."""
    root = _open(Path(path).resolve())
    _held.add(root)
    return root


def disable(path: str | os.PathLike[str]) -> None:
    """Stop writing under ``path`` (what ``enable`` or the environment variable started)."""
    root = Path(path).resolve()
    _held.discard(root)
    _close_if_unused(root)


@contextmanager
def dumping(path: str | os.PathLike[str] | None) -> Iterator[None]:
    """Write under ``path`` while the block runs (``backend(dump=...)``: around each of its compiles); None:
    nothing."""
    if path is None:
        yield
        return
    root = _open(Path(path).resolve())
    _users[root] = _users.get(root, 0) + 1
    try:
        yield
    finally:
        _users[root] -= 1
        _close_if_unused(root)


def _open(root: Path) -> Path:
    if root not in _sinks:
        root.mkdir(parents=True, exist_ok=True)
        _sinks[root] = _Sink(root)
        trace_log.addHandler(_sinks[root])
        trace_log.propagate = False  # structured records are for their sinks, never for the root logger's handlers
        if trace_log.level == logging.NOTSET or trace_log.level > logging.DEBUG:
            trace_log.setLevel(logging.DEBUG)  # torch's own setting; a logger left at NOTSET would drop them
        logging.getLogger(__name__).info("fsdp_compile: dumping compiles to %s", root)
    return root


def _close_if_unused(root: Path) -> None:
    if root in _sinks and root not in _held and not _users.get(root):
        trace_log.removeHandler(_sinks.pop(root))


def active() -> bool:
    return bool(_sinks)


def from_environment() -> None:
    if os.environ.get(ENV):
        enable(os.environ[ENV])
