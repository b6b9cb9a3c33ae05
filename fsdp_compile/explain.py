"""``python -m fsdp_compile explain DIR``: what the compiler did, read from a dump folder (``FSDP_COMPILE_DUMP``,
``fsdp_compile/_dump.py``). It reads only text and JSON (never unpickles), prints the units, the collectives of
each graph in order with their prefetch distances, the gradient reductions in flight, which units' gradients are
written in place, the memory plan's slots
against the alternatives, the compiles (recompiles, graph breaks), and warnings; it writes ``timeline.svg``
(the planned step: compute, all-gather and gradient lanes, one box per unit) and ``memory.svg`` (slots and live
bytes over the step, the predicted peak) into DIR. ``--trace FILE`` (a profiler's Chrome trace) adds the
measured timeline to the picture and the exposed communication per unit to the report.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_compile import _pictures, debug
from fsdp_compile._describe import gathered
from fsdp_compile._layout import unit_label
from fsdp_compile._pictures import Measured, prefetch_of

__all__ = ["Dump", "GraphDump", "load", "pictures", "report", "warnings"]

_FILE = re.compile(rf"^(\d+)_({'|'.join(typing.get_args(debug.Stage))})_(.+)\.(json|py)$")
"""A dump file's name: its number, stage, artifact name and kind (``fsdp_compile/_dump.py``)."""
LARGE_UNIT = 4.0
"""A unit with more than this many times the median unit's parameters is called out (it bounds the slot
sizes and the overlap: its all-gather is the longest to hide)."""
LOOSE_SLOT = 2.0
"""A slot more than this many times its average occupant is called out (max-pool sizing wastes the rest)."""


@dataclass(frozen=True)
class GraphDump:
    """One compiled graph with FSDP units, as one rank dumped it."""

    rank: int
    name: str
    units: list[dict[str, Any]]
    schedules: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Stage (``forward``, ``backward``) -> the ``schedule_overlap`` plan."""
    memory: dict[str, Any] | None = None
    """The last memory plan (after backward: the whole step's)."""
    routes: dict[str, dict[str, str]] = field(default_factory=dict)
    """Option (``all_gather``, ``grad_reduce``) -> the route ``"auto"`` chose for it, and why
    (``lowering/choose_route.py``); a fixed route is not listed."""
    in_place: dict[str, Any] | None = None
    """The backward's ``write_gradients_in_place`` plan (None when the pass was off)."""
    bodies: dict[str, list[str]] = field(default_factory=dict)
    """Each shared body (compiled once for forward and once for backward) -> the units whose calls run it."""

    @property
    def fingerprint(self) -> str:
        """What must agree across ranks: units and schedules (not group names, which HSDP replicas differ in)."""
        return hashlib.sha1(json.dumps([self.units, self.schedules], sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Dump:
    root: Path
    graphs: dict[int, list[GraphDump]]
    events: dict[int, list[dict[str, Any]]]


def load(root: str | Path) -> Dump:
    """Read a dump folder (text and JSON only). Raises ``FileNotFoundError`` naming what is missing."""
    root = Path(root)
    ranks = sorted(root.glob("rank*"), key=lambda p: int(p.name[4:]) if p.name[4:].isdigit() else -1)
    if not ranks:
        raise FileNotFoundError(
            f"{root} holds no dump (no rank*/ folder): compile with FSDP_COMPILE_DUMP={root} in the environment, "
            "or fsdp_compile.backend(dump=...), then run explain on that folder"
        )
    graphs: dict[int, list[GraphDump]] = {}
    events: dict[int, list[dict[str, Any]]] = {}
    for rank_dir in ranks:
        rank = int(rank_dir.name[4:])
        events[rank] = [json.loads(line) for line in _lines(rank_dir / "events.jsonl")]
        graphs[rank] = [g for d in sorted(rank_dir.glob("graph_*")) if (g := _graph(rank, d)) is not None]
    return Dump(root, graphs, events)


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _graph(rank: int, folder: Path) -> GraphDump | None:
    units: list[dict[str, Any]] | None = None
    schedules, memory, routes, in_place, bodies = {}, None, {}, None, {}
    files = [(match, path) for path in folder.iterdir() if (match := _FILE.match(path.name)) and match[4] == "json"]
    for match, path in sorted(files, key=lambda f: int(f[0][1])):  # in the order logged: the last memory plan wins
        stage, name = match[2], match[3]
        if name == "units":
            units = json.loads(path.read_text())
        elif name == "schedule_overlap_plan":
            schedules[stage] = json.loads(path.read_text())
        elif name == "plan_memory_plan":
            memory = json.loads(path.read_text())
        elif name in ("all_gather_route", "grad_reduce_route"):
            routes[name.removesuffix("_route")] = json.loads(path.read_text())
        elif name == "write_gradients_in_place_plan" and stage == "backward":  # the step's, and its bodies'
            plan = json.loads(path.read_text())
            in_place = plan if in_place is None else {
                "units": in_place["units"] + plan["units"], "left": in_place["left"] + plan["left"],
                "matmuls": in_place["matmuls"] + plan["matmuls"]}
        elif name == "shared_bodies":
            bodies = json.loads(path.read_text())
    return None if units is None else GraphDump(rank, folder.name, units, schedules, memory, routes, in_place, bodies)


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB" if nbytes >= 2**20 else f"{nbytes:,.0f} B"


def _units_table(units: list[dict[str, Any]]) -> list[str]:
    lines = ["| unit | parameters | elements | per rank | padding | param dtype | gathered as | reduce dtype "
             "| gradient reduction | reshard after forward |", "|---|---|---|---|---|---|---|---|---|---|"]
    for u in units:
        lines.append(f"| {unit_label(u['name'])} | {len(u['parameters'])} | {u['num_parameters']:,} | {u['shard_numel']:,} | "
                     f"{u['padded_numel'] - u['num_parameters']:,} | {u['param_dtype']} | {gathered(u)} | "
                     f"{u['reduce_dtype']} | {u['grad_reduction']} | {u['reshard_after_forward']} |")
    return lines


def _schedule_lines(stage: str, plan: dict[str, Any]) -> list[str]:
    units, gathers, reductions = plan["units"], plan["gathers"], plan["grad_reductions"]
    kept = plan["kept_original_order"]
    head = f"{stage}: {len(gathers)} all-gathers (prefetch {prefetch_of(plan)})"
    if reductions:
        head += f", {len(reductions)} gradient reductions (at most {plan['max_inflight_grad_reductions']} in flight)"
    stages = plan.get("replica_all_reduces", {})
    if stages:
        head += ", each then averaged over the replicas (HSDP: an all-reduce issued one reduction later)"
    lines = [head + (": ORIGINAL ORDER KEPT (no valid schedule)" if kept else "")]
    for i, name in enumerate(gathers):
        ahead = min(i, prefetch_of(plan))
        unit = unit_label(units.get(name, "?"))
        lines.append(f"  all-gather {i + 1:>3}  {unit:<24} {name:<28} issued {ahead} unit(s) ahead")
    for j, name in enumerate(reductions):
        then = f"  then {', '.join(stages[name])} over the replicas" if name in stages else ""
        lines.append(f"  reduction  {j + 1:>3}  {unit_label(units.get(name, '?')):<24} {name}{then}")
    lines += [f"  unscheduled: {name} ({why})" for name, why in plan["unscheduled"]]
    return lines


def _in_place_lines(plan: dict[str, Any], units: dict[str, str]) -> list[str]:
    pieces = sum(len(p) for _, p in plan["units"])
    text = (f"  gradients written in place: {len(plan['units'])} of {len(plan['units']) + len(plan['left'])} units "
            f"({pieces} pieces, {plan['matmuls']} written by their matmul)")
    if plan["left"]:
        text += "; packed by a copy: " + ", ".join(unit_label(units.get(name, "?")) for name in plan["left"])
    return [text]


def _memory_lines(plan: dict[str, Any]) -> list[str]:
    pool = plan["pool_bytes"]
    lines = [f"memory plan over {'+'.join(plan['graphs'])}: {len(plan['slots'])} slots, pool {_mib(pool)}; one "
             f"buffer per collective {_mib(plan['per_collective_bytes'])}, max-pool {_mib(plan['maxpool_bytes'])}, "
             f"lower bound {_mib(plan['lower_bound_bytes'])}; predicted peak of communication buffers "
             f"{_mib(plan['predicted_peak_bytes'])}"]
    for i, slot in enumerate(plan["slots"]):
        lines.append(f"  slot {i}: group {slot['group']} {slot['dtype']} {slot['kind']} {_mib(slot['nbytes'])}, "
                     f"{len(slot['occupants'])} occupants")
    return lines


def warnings(dump: Dump) -> list[str]:
    """What deserves a look, each once with the ranks it holds for."""
    ranks: dict[str, list[int]] = {}
    for rank, graphs in dump.graphs.items():
        for text in _graph_warnings(graphs):
            ranks.setdefault(text, []).append(rank)
    out = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {text}" for text, r in ranks.items()]
    by_graph: dict[str, dict[str, list[int]]] = {}
    for rank, graphs in dump.graphs.items():
        for g in graphs:
            by_graph.setdefault(g.name, {}).setdefault(g.fingerprint, []).append(rank)
    out += [f"{name}: the ranks compiled different graphs ({'; '.join(f'ranks {r}: {fp}' for fp, r in fps.items())})"
            for name, fps in by_graph.items() if len(fps) > 1]
    return out


def _graph_warnings(graphs: list[GraphDump]) -> list[str]:
    out = []
    for g in graphs:
        where = g.name
        for stage, plan in g.schedules.items():
            if plan["kept_original_order"]:
                out.append(f"{where} {stage}: no valid overlap schedule, the collectives stay where they are")
            out += [f"{where} {stage}: {name} cannot overlap: {why}" for name, why in plan["unscheduled"]]
            if stage == "forward" and plan["gathers"]:
                first = unit_label(plan["units"].get(plan["gathers"][0], "?"))
                out.append(f"{where} forward: the first all-gather ({first}) has no compute before it to hide behind")
        sizes = [u["num_parameters"] for u in g.units]
        median = statistics.median(sizes) if sizes else 0
        out += [f"{where}: unit {unit_label(u['name'])} has {u['num_parameters'] / median:.1f}x the median unit's "
                f"parameters ({u['num_parameters']:,} vs {median:,.0f})"
                for u in g.units if median and u["num_parameters"] > LARGE_UNIT * median]
        sizes_by_name = {b["name"]: b["nbytes"] for b in (g.memory or {}).get("buffers", [])}
        for i, slot in enumerate((g.memory or {}).get("slots", [])):
            mean = statistics.mean(sizes_by_name[o] for o in slot["occupants"]) if slot["occupants"] else 0
            if mean and slot["nbytes"] > LOOSE_SLOT * mean:
                out.append(f"{where}: slot {i} ({_mib(slot['nbytes'])}) is {slot['nbytes'] / mean:.1f}x its average "
                           f"occupant: max-pool sizing holds the difference")
    return out


def _compile_lines(events: list[dict[str, Any]]) -> list[str]:
    lines, empty = [], 0
    for e in events:
        if e["event"] != "compilation_metrics":
            continue
        m = e["metadata"]
        if not m.get("graph_node_count") and not m.get("recompile_reason") and not m.get("fail_reason"):
            empty += 1  # a frame Dynamo compiled to no graph (e.g. the library's module hooks)
            continue
        text = (f"  [{m.get('compile_id')}] {m.get('co_name')}: {m.get('graph_node_count')} nodes, "
                f"{m.get('num_graph_breaks') or 0} graph breaks")
        if m.get("recompile_reason"):
            text += f"; recompiled because {m['recompile_reason']}"
        if m.get("fail_reason"):
            text += f"; FAILED: {m['fail_type']}: {m['fail_reason']}"
        lines.append(text)
    breaks = [e["payload"].strip().splitlines()[0] for e in events
              if e["event"] == "dynamo_graph_break_reason" and e["payload"].strip()]
    if empty:
        lines.append(f"  (and {empty} frames compiled to no graph)")
    return lines + [f"  graph break: {b}" for b in breaks]


def report(dump: Dump, trace: Measured | None = None) -> str:
    rank = min(dump.graphs)
    lines = [f"fsdp_compile dump {dump.root}: ranks {sorted(dump.graphs)}; rank {rank} shown, the others compared"]
    for g in dump.graphs[rank]:
        world, replicas = g.units[0]["world_size"], g.units[0]["replicas"]
        hsdp = f" x {replicas} replicas" if replicas > 1 else ""
        lines += ["", f"{g.name}: {len(g.units)} units over {world} ranks{hsdp}"]
        lines += _units_table(g.units)
        for body, body_units in g.bodies.items():
            lines.append(f"shared body {body}: compiled once for forward and once for backward, run by "
                         f"{len(body_units)} units ({', '.join(body_units)})")
        for option, choice in g.routes.items():
            what = {"all_gather": "all-gather", "grad_reduce": "gradient exchange"}[option]
            lines.append(f"{what} route chosen by 'auto': {choice['route']} ({choice['reason']})")
        for stage in ("forward", "backward"):
            if stage in g.schedules:
                lines += _schedule_lines(stage, g.schedules[stage])
        if g.in_place is not None:
            lines += _in_place_lines(g.in_place, g.schedules.get("backward", {}).get("units", {}))
        if g.memory:
            lines += _memory_lines(g.memory)
    lines += ["", "compiles:", *(_compile_lines(dump.events.get(rank, [])) or ["  (none recorded)"])]
    scheduled = next((g for g in dump.graphs[rank] if g.schedules), None)
    if trace and scheduled:
        lines += ["", *_pictures.exposed_by_unit(trace, scheduled.schedules)]
    lines += ["", "warnings:", *(f"  - {w}" for w in warnings(dump) or ["none"])]
    return "\n".join(lines)


def pictures(dump: Dump, trace: Measured | None = None) -> dict[str, str]:
    """File name -> SVG: ``timeline.svg`` (with the measured lanes under it when given a trace) and
    ``memory.svg``, of the first rank's first graph that has a schedule (a memory plan)."""
    graphs, out = dump.graphs[min(dump.graphs)], {}
    if (g := next((g for g in graphs if g.schedules), None)) is not None:
        out["timeline.svg"] = _pictures.timeline_svg(g.name, g.units, g.schedules, trace)
    if (g := next((g for g in graphs if g.memory), None)) is not None:
        out["memory.svg"] = _pictures.memory_svg(g.name, g.memory)
    return out
