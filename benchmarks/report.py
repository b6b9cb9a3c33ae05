"""The benchmark's results, its two guards and its tables (``train_bench.py`` measures, this module judges
and prints; ``plot.py`` draws the same aggregates).

Bounds. ``no_comm_bound`` trains the whole model on one GPU with no collective: its step is the **loose**
bound (local forward+backward plus the optimizer step over ALL parameters, which a sharded system never
runs). The **tight** bound, the headline: the same local forward+backward plus an optimizer step over
1/world of the parameters, both timed in the bound's own run (``fwd_bwd_ms`` + ``sharded_opt_ms``).

Guards. A system that computes the wrong gradients must not pass: the loss guard alone cannot see a
missing average (AdamW's first steps are invariant to a constant gradient scale), so the gradient guard
compares every parameter's gradient norm after step 0 with FSDP2's. The bounds never average over ranks
(each rank trains alone): they are compared at step 0 of the loss only and labelled so.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

BOUNDS = ("no_comm_bound", "no_comm_bound_cudagraphs")
"""Systems without communication: no gradient averaging, compared at step 0 of the loss only."""
ROUTES = ("nccl", "copy_engine", "copy_engine_exchange", "nccl_gather_copy_engine_exchange")
"""The fixed routes: their systems are ``fsdp_compile_<route>`` (``_cudagraphs`` with CUDA graphs), each beside
``fsdp_compile`` (``_cudagraphs``), the default: ``all_gather="auto"`` and ``grad_reduce="auto"``."""
REFERENCES = ("fsdp2_eager", "fsdp2_compile", "fsdp2_eager_offload", "fsdp2_compile_offload", "fsdp2_eager_offload_sync_off",
              "fsdp2_compile_offload_sync_off")
"""The guards' reference and the tables' "vs FSDP2" column: FSDP2 eager, or FSDP2 + compile in a run that
leaves eager out (the 8.8B model, where eager takes minutes and the bound does not fit one GPU), or FSDP2 with CPU
offload in a run of a model that fits no GPU without it."""
LOSS_RTOL = 2e-2
"""bf16 compute: the systems' losses agree to ~3e-4 on the 0.95B model; 2e-2 flags a diverging run (the
gradient guard is the one that sees a wrong average)."""
GRAD_RTOL = 2e-2
"""Per-parameter gradient norms after step 0 vs FSDP2's. Measured agreement on CPU (tiny model, 2 ranks,
bf16 compute): 4.3e-3 (fsdp_compile, SimpleFSDP-style) and 5.7e-3 (FSDP2 + compiled blocks): Inductor's
fused kernels keep fp32 intermediates where eager rounds to bf16. The mistakes it must catch move a norm
by tens of percent (one unit not averaged) to 100% (gradients summed over 2 ranks, not averaged)."""
GRAD_RTOL_FLOAT8 = 5e-2
"""The same with torchao's float8 training (``--float8``): float8's rounding of the activations and weights moves
per-parameter gradient norms by a few percent between any two ways of computing the step; measured on the 0.95B on
one H100: FSDP2 eager with and without torchao's float8 all-gather 2.3e-2 apart, fsdp_compile against FSDP2 eager
2.8e-2. The mistakes above still move a norm by far more."""


def grad_rtol(float8: str) -> float:
    """The gradient guard's tolerance for a run with ``--float8 float8``."""
    return GRAD_RTOL if float8 == "none" else GRAD_RTOL_FLOAT8


@dataclass
class Result:
    system: str
    tokens_per_gpu: int
    batch: int
    seq: int
    repeat: int
    losses: list[float]
    step_ms: list[float]
    median_step_ms: float = 0.0
    fwd_bwd_ms: float | None = None
    """Median forward+backward of the split steps (synchronized before and after)."""
    opt_ms: float | None = None
    """Median optimizer step (+ zero_grad) of the split steps."""
    sharded_opt_ms: float | None = None
    """Bounds only: the same optimizer over 1/world of every parameter (the tight bound's optimizer)."""
    grad_norms: dict[str, float] = field(default_factory=dict)
    """After step 0's backward: parameter name (as in the unsharded model) -> norm of its full gradient."""
    compile_s: float = 0.0
    peak_gib: float | None = None
    peak_comparable: bool = True
    """False under CUDA graphs: ``max_memory_allocated`` does not count the graphs' memory pool."""
    reserved_gib: float | None = None
    slab_mib: float | None = None
    """The memory plan's slabs (``fsdp_compile.slab_bytes()``) after the measured steps: what the planner sized."""
    exposed_comm_ms: float | None = None
    comm_ms: float | None = None
    compute_ms: float | None = None
    idle_ms: float | None = None
    host_copy_ms: float | None = None
    """From the profiled steps: time a copy between host and device runs (CPU offload's), and of that the time no
    kernel runs."""
    exposed_host_copy_ms: float | None = None
    host_peak_gib: float | None = None
    """The process's peak resident host memory (pinned included) while the system was built and stepped, sampled;
    ``extra["host_start_gib"]``: at its start (what earlier systems left resident)."""
    cpu_ms: float | None = None
    """Host time to enqueue a step (median over the timed steps), on the slowest rank: the one every collective
    waits for (each rank's in ``extra["host_ms_per_rank"]``)."""
    tokens_per_s_per_gpu: float = 0.0
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _runs(results: list[Result]) -> dict[tuple[int, int], dict[str, Result]]:
    """(tokens per GPU, repeat) -> system -> result: one side-by-side run of every system."""
    runs: dict[tuple[int, int], dict[str, Result]] = {}
    for r in results:
        runs.setdefault((r.tokens_per_gpu, r.repeat), {})[r.system] = r
    return runs


def _worst(got: dict[Any, float], want: dict[Any, float]) -> tuple[Any, float]:
    """The key whose values differ most (relative to ``want``), and that difference."""
    diffs = {k: abs(got[k] - v) / max(abs(v), 1e-30) for k, v in want.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return worst, diffs[worst]


def reference(systems: Iterable[str], system: str = "") -> str:
    """The first of ``REFERENCES`` among ``systems`` (``train_bench.py`` refuses a run without one); for a ``system``
    that gathers torchao's float8 weights as float8, that reference with ``float8_gather`` if the run has it (the
    weights are cast from the fp32 main weights there, from bf16 ones otherwise: 1-3% of them a float8 step apart)."""
    present = set(systems)
    wanted = [f"{name}_float8_gather" for name in REFERENCES] if system.endswith("float8_gather") else []
    return next(name for name in (*wanted, *REFERENCES) if name in present)


def check_losses(results: list[Result]) -> list[str]:
    """Every system's losses against the reference's in the same run (the bounds: step 0 only)."""
    problems = []
    for (tokens, repeat), systems in _runs(results).items():
        for name, r in systems.items():
            ref_name = reference(systems, name)
            ref = systems[ref_name].losses
            steps = 1 if name in BOUNDS else len(ref)
            _, worst = _worst(dict(enumerate(r.losses[:steps])), dict(enumerate(ref[:steps])))
            r.extra[f"loss_max_rel_diff_vs_{ref_name}"] = worst
            if worst > LOSS_RTOL:
                problems.append(f"{tokens} tokens/GPU, run {repeat}: {name} loss differs from {ref_name} by "
                                f"{worst:.2e}")
    return problems


def check_gradients(results: list[Result], rtol: float = GRAD_RTOL) -> list[str]:
    """Every system's per-parameter gradient norms after step 0 against the reference's, within ``rtol`` (not the
    bounds: they do not average over ranks)."""
    problems = []
    for (tokens, repeat), systems in _runs(results).items():
        for name, r in systems.items():
            ref_name = reference(systems, name)
            ref = systems[ref_name].grad_norms
            if name in BOUNDS:
                r.extra["grad_check"] = "not compared: no averaging over ranks"
                continue
            if set(r.grad_norms) != set(ref):
                missing, extra = sorted(set(ref) - set(r.grad_norms)), sorted(set(r.grad_norms) - set(ref))
                problems.append(f"{tokens} tokens/GPU, run {repeat}: {name} has gradients for other parameters than "
                                f"{ref_name} (missing {missing[:3]}, extra {extra[:3]})")
                continue
            param, worst = _worst(r.grad_norms, ref)
            r.extra[f"grad_norm_max_rel_diff_vs_{ref_name}"] = worst
            if worst > rtol:
                problems.append(f"{tokens} tokens/GPU, run {repeat}: {name} gradient of {param} differs from "
                                f"{ref_name}'s by {worst:.2e} (norm after step 0)")
    return problems


@dataclass(frozen=True)
class Row:
    """One system at one point, over its repeats: medians, and the range of the step time."""

    system: str
    runs: tuple[Result, ...]

    def median(self, attr: str) -> float | None:
        values = [getattr(r, attr) for r in self.runs if getattr(r, attr) is not None]
        return statistics.median(values) if values else None

    @property
    def step_ms(self) -> float:
        return statistics.median(r.median_step_ms for r in self.runs)

    @property
    def step_range(self) -> tuple[float, float]:
        steps = [r.median_step_ms for r in self.runs]
        return min(steps), max(steps)


@dataclass(frozen=True)
class Point:
    tokens_per_gpu: int
    batch: int
    seq: int
    rows: tuple[Row, ...]

    def row(self, system: str) -> Row | None:
        return next((r for r in self.rows if r.system == system), None)

    def tight_bound_ms(self, bound: str = "no_comm_bound") -> float | None:
        """Median over the repeats of the bound's forward+backward plus its 1/world optimizer step."""
        row = self.row(bound)
        tight = [r.fwd_bwd_ms + r.sharded_opt_ms for r in (row.runs if row else ())
                 if r.fwd_bwd_ms is not None and r.sharded_opt_ms is not None]
        return statistics.median(tight) if tight else None

    def bound_for(self, system: str) -> str:
        """The bound a system is compared with: the one with CUDA graphs for a system with CUDA graphs (where
        the run has it), else the plain one."""
        graphs = system.endswith("_cudagraphs") and self.row("no_comm_bound_cudagraphs") is not None
        return "no_comm_bound_cudagraphs" if graphs else "no_comm_bound"


def points(results: list[Result]) -> list[Point]:
    by_point: dict[int, dict[str, list[Result]]] = {}
    for r in results:
        by_point.setdefault(r.tokens_per_gpu, {}).setdefault(r.system, []).append(r)
    out = []
    for tokens, systems in sorted(by_point.items()):
        first = next(iter(systems.values()))[0]
        out.append(Point(tokens, first.batch, first.seq, tuple(Row(s, tuple(rs)) for s, rs in systems.items())))
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _ratio(value: float | None, ref: float | None) -> str:
    return "n/a" if value is None or not ref else f"{value / ref:.2f}x"


def table(results: list[Result]) -> Iterator[str]:
    """Per point: every system's median step time over the repeats (and its range), its ratio to the tight
    bound (the headline), the loose bound and the reference (FSDP2), and where the time goes. A system with
    CUDA graphs is compared with the bound with CUDA graphs where the run has it. A run without the bound (a
    model too big for one GPU) says n/a for the bound's columns."""
    for point in points(results):
        ref_name = reference(r.system for r in point.rows)
        ref = point.row(ref_name).step_ms
        repeats = max(len(r.runs) for r in point.rows)
        bounds = ", ".join(
            f"{name}: tight {_fmt(point.tight_bound_ms(name), '.1f')} ms (local forward+backward "
            f"{_fmt(row.median('fwd_bwd_ms'), '.1f')} + optimizer over 1/world "
            f"{_fmt(row.median('sharded_opt_ms'), '.1f')}), loose {row.step_ms:.1f} ms"
            for name in BOUNDS if (row := point.row(name))
        )
        yield (f"\n{point.tokens_per_gpu} tokens/GPU (batch {point.batch} x seq {point.seq}), {repeats} run(s); "
               f"{bounds or 'no bound in this run'}\n")
        yield (f"| system | step ms (range) | vs tight bound | vs loose bound | vs {ref_name} | fwd+bwd ms "
               "| optimizer ms | exposed comm ms | compute slowdown | tokens/s/GPU | MFU | peak GiB | slabs MiB "
               "| reserved GiB | host ms | compile s |")
        yield "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        for row in point.rows:
            bound = point.row(point.bound_for(row.system))
            tight, loose_ms = point.tight_bound_ms(bound.system) if bound else None, bound.step_ms if bound else None
            bound_fwd_bwd = bound.median("fwd_bwd_ms") if bound else None
            low, high = row.step_range
            fwd_bwd, exposed, mfu = row.median("fwd_bwd_ms"), row.median("exposed_comm_ms"), row.median("mfu")
            mfu_text = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
            slowdown = None if None in (fwd_bwd, exposed, bound_fwd_bwd) else (fwd_bwd - exposed) / bound_fwd_bwd
            peak = _fmt(row.median("peak_gib"), ".2f")
            if not all(r.peak_comparable for r in row.runs):
                peak += " (n/c)"
            yield (
                f"| {row.system} | {row.step_ms:.1f} ({low:.1f}-{high:.1f}) | {_ratio(row.step_ms, tight)} | "
                f"{_ratio(row.step_ms, loose_ms)} | {_ratio(row.step_ms, ref)} | {_fmt(fwd_bwd, '.1f')} | "
                f"{_fmt(row.median('opt_ms'), '.1f')} | {_fmt(exposed, '.1f')} | {_fmt(slowdown, '.2f')} | "
                f"{row.median('tokens_per_s_per_gpu'):,.0f} | {mfu_text} | {peak} | "
                f"{_fmt(row.median('slab_mib'), '.1f')} | {_fmt(row.median('reserved_gib'), '.2f')} | "
                f"{_fmt(row.median('cpu_ms'), '.1f')} | {row.median('compile_s'):.1f} |"
            )
        yield from _auto_against_fixed_routes(point)
        yield from _step_split(point)
    yield ("\nstep ms: median over the runs of each run's median step (range: min-max over the runs). Tight bound: "
           "the headline; rows with CUDA graphs against the bound with CUDA graphs where the run has it. Compute "
           "slowdown: (fwd+bwd - exposed comm) / the bound's fwd+bwd. peak GiB: the allocator's peak plus symmetric "
           "slabs; (n/c): not comparable, CUDA graphs' pool not counted; reserved GiB counts it. slabs MiB: the "
           "memory plan's (what the planner sized). host ms: the slowest rank's time to enqueue a step.")


def _step_split(point: Point) -> Iterator[str]:
    """Where the step's time goes in the rows that copy between host and device (CPU offload's, whose optimizer
    steps on the host): GPU compute and the copies (their exposed part: no kernel beside them) from the profiled
    steps, the optimizer step (timed apart), and the rest of the step (launch gaps, host waits); the host's peak
    memory."""
    offloaded = [row for row in point.rows if row.median("host_copy_ms")]
    if not offloaded:
        return
    yield ("\n| system | step ms | GPU compute ms | host-device copies ms | of which exposed | optimizer ms "
           "| rest ms | host peak GiB (at start) |")
    yield "|---|---|---|---|---|---|---|---|"
    for row in offloaded:
        parts = [row.median(name) for name in ("compute_ms", "exposed_host_copy_ms", "opt_ms")]
        rest = None if None in parts else row.step_ms - sum(parts)
        start = statistics.median(r.extra.get("host_start_gib", 0.0) for r in row.runs)
        yield (f"| {row.system} | {row.step_ms:.1f} | {_fmt(parts[0], '.1f')} | "
               f"{_fmt(row.median('host_copy_ms'), '.1f')} | {_fmt(parts[1], '.1f')} | {_fmt(parts[2], '.1f')} | "
               f"{_fmt(rest, '.1f')} | {_fmt(row.median('host_peak_gib'), '.1f')} ({start:.1f}) |")
    yield ("GPU compute: time any kernel or device copy runs; host-device copies: time any copy between them runs, "
           "exposed: no kernel beside it (both per profiled step); rest: the step less compute, exposed copies and "
           "the optimizer (launch gaps, host waits; the profiled and timed steps differ by a few ms).")


def _auto_against_fixed_routes(point: Point) -> Iterator[str]:
    """Per point, without and with CUDA graphs where the run has them: the default (``auto``) against the fastest
    fixed route of the same run (``auto`` should never be slower beyond the runs' spread)."""
    for graphs in ("", "_cudagraphs"):
        auto = point.row(f"fsdp_compile{graphs}")
        fixed = [row for route in ROUTES if (row := point.row(f"fsdp_compile_{route}{graphs}"))]
        if auto and fixed:
            best = min(fixed, key=lambda row: row.step_ms)
            yield (f"auto{' with CUDA graphs' if graphs else ''}: {auto.system} {auto.step_ms:.1f} ms against the "
                   f"fastest fixed route, {best.system} {best.step_ms:.1f} ms ({auto.step_ms / best.step_ms:.2f}x)")
