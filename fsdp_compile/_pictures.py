"""The pictures of ``python -m fsdp_compile explain``, as plain SVG (no plotting library needed): the planned
step (``timeline.svg``), the memory plan (``memory.svg``), and what a profiler trace measured."""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from html import escape
from typing import Any

from fsdp_compile._intervals import Intervals, intersect, is_communication, length, union
from fsdp_compile._layout import unit_label

__all__ = ["Measured", "exposed_by_unit", "memory_svg", "prefetch_of", "read_trace", "timeline_svg"]

Schedules = dict[str, dict[str, Any]]
"""Stage (``forward``, ``backward``) -> that graph's ``schedule_overlap`` plan, as its JSON artifact."""
Event = tuple[str, float, float]
"""(name, start, end) of one trace event, in µs."""

WIDTH, LANE, LEFT = 1200, 34, 150
COLORS = {"compute": "#4e79a7", "gather": "#59a14f", "exposed": "#e15759", "reduce": "#f28e2b", "measured": "#b07aa1"}
_GATHER = re.compile(r"all_?gather|PtoP", re.IGNORECASE)
_REDUCE = re.compile(r"reduce_?scatter|all_?to_?all|sendrecv|all_?reduce", re.IGNORECASE)


def _svg(height: float, body: list[str], title: str) -> str:
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH + LEFT + 20}" height="{height:.0f}" '
            f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>'
            f'<text x="10" y="18" font-size="14">{escape(title)}</text>')
    return "\n".join([head, *body, "</svg>\n"])


def _box(x: float, y: float, w: float, color: str, label: str = "", tip: str = "") -> str:
    w = max(w, 1.5)
    fits = label and w > 7 * len(label)
    where = f'x="{LEFT + x + 2:.1f}" y="{y + LANE / 2 + 4:.1f}"'
    text = f'<text {where} fill="white">{escape(label)}</text>' if fits else ""
    return (f'<rect x="{LEFT + x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{LANE - 8}" fill="{color}" stroke="white">'
            f"<title>{escape(tip or label)}</title></rect>{text}")


def _lane(y: float, name: str) -> str:
    return f'<text x="10" y="{y + LANE / 2 + 4:.1f}">{escape(name)}</text>'


def prefetch_of(plan: dict[str, Any]) -> int:
    """How many units ahead the schedule issues its all-gathers (0 where it kept the original order)."""
    return 0 if plan.get("kept_original_order") else plan.get("prefetch", 0)


def timeline_svg(name: str, units: list[dict[str, Any]], schedules: Schedules, trace: Measured | None = None) -> str:
    """The planned step: compute boxes sized by the units' parameters (backward twice forward); each
    all-gather from where the schedule issues it to the compute that reads it (red: issued right before,
    nothing to hide behind); each gradient reduction from its issue to its wait. With a profiler trace, the
    measured compute and communication under it."""
    size = {unit_label(u["name"]): max(u["num_parameters"], 1) for u in units}
    fwd, bwd = schedules.get("forward", {}), schedules.get("backward", {})
    steps = [("forward", unit_label(fwd.get("units", {}).get(n, "?")), 1) for n in fwd.get("gathers", [])]
    steps += [("backward", unit_label(bwd.get("units", {}).get(n, "?")), 2) for n in bwd.get("gathers", [])]
    scale = WIDTH / sum(size.get(unit, 1) * k for _, unit, k in steps) if steps else 1.0
    starts, x = [], 0.0
    body = [_lane(40, "compute"), _lane(40 + LANE, "all-gathers"), _lane(40 + 2 * LANE, "gradient reductions")]
    for stage, unit, k in steps:
        w = size.get(unit, 1) * k * scale
        body.append(_box(x, 40, w, COLORS["compute"], unit, f"{stage} {unit}"))
        starts.append((x, x + w))
        x += w
    offset = 0
    for stage, plan in (("forward", fwd), ("backward", bwd)):
        ahead = prefetch_of(plan)
        for i, gather in enumerate(plan.get("gathers", [])):
            issue, use = starts[offset + max(i - ahead, 0)][0], starts[offset + i][0]
            exposed = issue >= use
            color = COLORS["exposed" if exposed else "gather"]
            body.append(_box(use - 3 if exposed else issue, 40 + LANE, use - issue, color,
                             unit_label(plan["units"].get(gather, "?")), f"{stage} all-gather {gather}"))
        offset += len(plan.get("gathers", []))
    ends = {unit: end for (stage, unit, _), (_, end) in zip(steps, starts) if stage == "backward"}
    limit, issues = bwd.get("max_inflight_grad_reductions", 1), []
    for reduction in bwd.get("grad_reductions", []):  # in graph order: complete at its unit's box's end
        issues.append(max(ends.get(unit_label(bwd["units"].get(reduction, "?")), x), issues[-1] if issues else 0.0))
    for j, reduction in enumerate(bwd.get("grad_reductions", [])):
        wait = issues[j + limit] if j + limit < len(issues) else x
        unit = unit_label(bwd["units"].get(reduction, "?"))
        body.append(_box(issues[j], 40 + 2 * LANE, wait - issues[j], COLORS["reduce"], unit,
                         f"reduction {reduction}: issued when its unit's gradient is complete, "
                         f"waited for {limit} later"))
    measured = _measured_lanes(trace, 60 + 3 * LANE + 30) if trace else []
    body += measured
    height = 60 + 3 * LANE + (2 * LANE + 20 if measured else 0)
    return _svg(height, body, f"{name}: the planned step (box widths: parameters; backward 2x forward)")


def memory_svg(name: str, plan: dict[str, Any]) -> str:
    """The memory plan: one row per slot with its occupants' live ranges; above, the bytes live at each
    position of the step, against the predicted peak."""
    buffers = {b["name"]: b for b in plan["buffers"]}
    end = max((b["end"] for b in plan["buffers"]), default=1) or 1
    sx = WIDTH / end
    top, chart = 40, 120
    peak = max(plan["predicted_peak_bytes"], 1)
    events = sorted({p for b in plan["buffers"] for p in (b["start"], b["end"])})
    live = [(p, sum(b["nbytes"] for b in plan["buffers"] if b["start"] <= p < b["end"])) for p in events]
    points = " ".join(f"{LEFT + p * sx:.1f},{top + chart - v / peak * chart:.1f}" for p, v in live)
    body = [f'<polyline points="{points}" fill="none" stroke="{COLORS["compute"]}" stroke-width="1.5"/>',
            f'<line x1="{LEFT}" x2="{LEFT + WIDTH}" y1="{top}" y2="{top}" stroke="{COLORS["exposed"]}" '
            'stroke-dasharray="4"/>',
            f'<text x="10" y="{top + 4}">predicted peak</text>',
            f'<text x="10" y="{top + 16}">{peak / 2**20:,.2f} MiB</text>', _lane(top + chart - LANE / 2, "live bytes")]
    y = top + chart + 20
    for i, slot in enumerate(plan["slots"]):
        body.append(_lane(y, f"slot {i} ({slot['nbytes'] / 2**20:,.2f} MiB)"))
        for occupant in slot["occupants"]:
            b = buffers[occupant]
            color = COLORS["gather" if b["kind"] == "gathered" else "reduce"]
            body.append(_box(b["start"] * sx, y, (b["end"] - b["start"]) * sx, color,
                             "", f"{occupant}: {b['nbytes']:,} B, positions {b['start']}-{b['end']}"))
        y += LANE
    return _svg(y + 20, body, f"{name}: communication buffers over the step, {len(plan['slots'])} slots, pool "
                              f"{plan['pool_bytes'] / 2**20:,.2f} MiB (max-pool {plan['maxpool_bytes'] / 2**20:,.2f})")


@dataclass(frozen=True)
class Measured:
    """A profiler trace, read once: its GPU kernels and copies, or, in a trace without any (CPU), its host
    ops; of those, the collectives in start order (:func:`read_trace` says which), and the union of the rest
    (compute)."""

    path: str
    events: list[Event]
    device: bool
    comm: list[Event]
    compute: Intervals


def read_trace(path: str) -> Measured:
    """A Chrome trace (``.json``, or ``.json.gz`` as the profiler writes it for such a name). Collectives:
    on a GPU trace NCCL's kernels and peer copies, on a CPU trace the host ops named after a collective; the
    events of one kind that overlap count as one (host ops nest; a copy-engine all-gather's peer copies may
    run side by side)."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    chosen = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
              for e in device or [e for e in events if e.get("cat") == "cpu_op"]]
    collectives: list[Event] = []
    others: Intervals = []
    for e in chosen:
        if _is_collective(e[0], bool(device)):
            collectives.append(e)
        elif "wait" not in e[0]:
            others.append((e[1], e[2]))
    comm: list[Event] = []
    for e in sorted(collectives, key=lambda e: (e[1], -e[2])):
        if comm and e[1] < comm[-1][2] and _kind(e[0]) == _kind(comm[-1][0]):
            comm[-1] = (comm[-1][0], comm[-1][1], max(comm[-1][2], e[2]))
        else:
            comm.append(e)
    return Measured(path, chosen, bool(device), comm, union(others))


def _is_collective(name: str, device: bool) -> bool:
    named = bool(_GATHER.search(name) or _REDUCE.search(name)) and "wait" not in name
    return named and (not device or is_communication(name))


def _kind(name: str) -> str:
    return "gather" if _GATHER.search(name) else "reduce"


def exposed_by_unit(trace: Measured, schedules: Schedules) -> list[str]:
    """Per unit: its collectives' time in the trace and the part no compute ran beside (exposed). The k-th
    all-gather (reduction) of the trace is the plan's k-th, step after step."""
    plans = [schedules.get(s, {}) for s in ("forward", "backward")]
    gather_units = [p["units"].get(n, "?") for p in plans for n in p.get("gathers", [])]
    reduce_units = [p["units"].get(n, "?") for p in plans for n in p.get("grad_reductions", [])]
    per_unit: dict[str, list[float]] = {}
    seen = {"gather": 0, "reduce": 0}
    for name, start, end in trace.comm:
        kind = _kind(name)
        units = gather_units if kind == "gather" else reduce_units
        unit = unit_label(units[seen[kind] % len(units)]) if units else "?"
        seen[kind] += 1
        exposed = (end - start) - length(intersect([(start, end)], trace.compute))
        row = per_unit.setdefault(unit, [0.0, 0.0, 0.0, 0.0])
        row[0 if kind == "gather" else 2] += (end - start) / 1e3
        row[1 if kind == "gather" else 3] += exposed / 1e3
    host = "host ops (a CPU trace: exposure means little without kernels)"
    source = "GPU kernels and copies" if trace.device else host
    lines = [f"trace {trace.path}: {len(trace.comm)} collectives among {len(trace.events)} {source}"]
    for kind, units in (("gather", gather_units), ("reduce", reduce_units)):
        if units and seen[kind] % len(units):
            what = "all-gathers" if kind == "gather" else "reductions"
            lines.append(f"  (the trace's {seen[kind]} {what} are not whole steps of the plan's {len(units)}: "
                         "the units below are matched by order, and may be off)")
    lines += ["| unit | all-gather ms | exposed ms | reduction ms | exposed ms |", "|---|---|---|---|---|"]
    return lines + [f"| {u} | {a:.3f} | {b:.3f} | {c:.3f} | {d:.3f} |" for u, (a, b, c, d) in per_unit.items()]


def _measured_lanes(trace: Measured, y: float) -> list[str]:
    if not trace.events:
        return []
    t0, t1 = min(s for _, s, _ in trace.events), max(t for _, _, t in trace.events)
    sx = WIDTH / max(t1 - t0, 1e-9)
    body = [f'<text x="10" y="{y - 6:.0f}">measured ({(t1 - t0) / 1e3:,.2f} ms)</text>', _lane(y, "compute"),
            _lane(y + LANE, "communication")]
    body += [_box((s - t0) * sx, y, (t - s) * sx, COLORS["measured"]) for s, t in trace.compute]
    body += [_box((s - t0) * sx, y + LANE, (t - s) * sx, COLORS[_kind(n)], "", n)
             for n, s, t in trace.comm]
    return body
