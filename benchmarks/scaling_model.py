"""The step-time model of fsdp_compile on N GPUs (``fsdp_compile._step_time``, which ``fsdp_compile.estimate`` also
uses), checked against the 2- and 4-GPU benchmark runs, and its predictions for FSDP over all GPUs vs HSDP (shard
within a node, replicate across nodes); docs/scaling.md explains it.

    python benchmarks/scaling_model.py                      # CHECK, COMM, PREDICTION, BREAK-EVEN, ONE HOST
    python benchmarks/scaling_model.py --json scaling.json  # the same tables (markdown), and as JSON with the inputs

The units of a Llama shape: the embedding, every block, the output projection.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fsdp_compile._step_time import (
    CONTENTION,
    INTRA_NODE_GBPS,
    LLAMA_0_95B,
    LLAMA_8B,
    OPT_FIXED_MS,
    OPT_SHARDED_MS,
    ModelShape,
    Network,
    StepTime,
    Topology,
    fwd_bwd_ms_at,
    measured_8b_step_ms,
    predict,
    rate_0_95b,
    rate_8b,
    unit_times,
    units,
)
from fsdp_compile import _step_time

RESULTS = Path(__file__).parent / "results"


def comm_per_step_ms(shape: ModelShape, topo: Topology, net: Network) -> float:
    """Every collective of a step back to back (what the traces without the overlap pass measure)."""
    times = unit_times(units(shape), topo, net, 0.0)
    gathers = sum(2 * t.gather_ms for t in times) - times[-1].gather_ms  # the output unit is gathered once
    return gathers + sum(t.reduce_ms + t.replicate_ms for t in times)


@dataclass(frozen=True)
class CheckRow:
    case: str
    gpus: int
    tokens: int
    runs: int
    bound_fwd_bwd_ms: float
    """The model's compute input: the same run's no-communication forward+backward."""
    measured_step_ms: float
    """fsdp_compile's median over the runs, as the other measured columns."""
    measured_fwd_bwd_ms: float | None
    measured_exposed_ms: float | None
    host_ms: float | None
    model: StepTime


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def check_rows() -> list[CheckRow]:
    """Every 2- and 4-GPU run of the 0.95B model (FSDP, and HSDP 2 x 2 on one host where the run has it), and
    the 8.8B on 4 GPUs at the 0.95B compute rate."""
    rows = []
    for path in sorted(RESULTS.glob("bench_[24]gpu_*.json")):
        data = json.loads(path.read_text())
        gpus = data["meta"]["world_size"]
        for tokens in sorted({r["tokens_per_gpu"] for r in data["results"]}):
            bound = [r for r in data["results"] if r["tokens_per_gpu"] == tokens and r["system"] == "no_comm_bound"]
            fwd_bwd, shape = _median(bound, "fwd_bwd_ms"), replace(LLAMA_0_95B, seq=bound[0]["seq"])
            for system, label, topo, net in (
                ("fsdp_compile", "", Topology(gpus, "fsdp"), Network()),
                ("fsdp_compile_hsdp", " HSDP", Topology(gpus, "hsdp", gpus_per_node=gpus // 2), Network(INTRA_NODE_GBPS)),
            ):
                ours = [r for r in data["results"] if r["tokens_per_gpu"] == tokens and r["system"] == system]
                if not ours:
                    continue
                rows.append(CheckRow(
                    f"0.95B run {path.stem.rsplit('run', 1)[-1]}{label}", gpus, tokens, len(ours), fwd_bwd,
                    _median(ours, "median_step_ms"), _median(ours, "fwd_bwd_ms"), _median(ours, "exposed_comm_ms"),
                    _median(ours, "cpu_ms"), predict(units(shape), topo, net, fwd_bwd)))
    fwd_bwd = fwd_bwd_ms_at(LLAMA_8B, 4096, rate_0_95b())
    rows.append(CheckRow("8.8B, 0.95B rate", 4, 4096, 1, fwd_bwd, measured_8b_step_ms(), None, None, None,
                         predict(units(LLAMA_8B), Topology(4, "fsdp"), Network(), fwd_bwd)))
    return rows


@dataclass(frozen=True)
class PredictionRow:
    model: str
    tokens: int
    nodes: int
    inter_gbps: float
    fsdp: StepTime
    hsdp: StepTime

    @property
    def hsdp_speedup(self) -> float:
        return self.fsdp.step_ms / self.hsdp.step_ms


def workloads() -> list[tuple[ModelShape, int, float]]:
    """(model, tokens per GPU, compute FLOP/s) of the predictions."""
    return [(LLAMA_0_95B, 4096, rate_0_95b()), (LLAMA_8B, 4096, rate_8b()), (LLAMA_8B, 8192, rate_8b())]


def fsdp_and_hsdp(shape: ModelShape, nodes: int, net: Network, fwd_bwd_ms: float) -> tuple[StepTime, StepTime]:
    fsdp, hsdp = (predict(units(shape), Topology(8 * nodes, layout), net, fwd_bwd_ms) for layout in ("fsdp", "hsdp"))
    return fsdp, hsdp


def prediction_rows() -> list[PredictionRow]:
    rows = []
    for shape, tokens, rate in workloads():
        fwd_bwd = fwd_bwd_ms_at(shape, tokens, rate)
        for nodes in (1, 2, 4, 8, 16):
            for net in [Network(bw) for bw in (25.0, 50.0, 100.0)] if nodes > 1 else [Network()]:
                fsdp, hsdp = fsdp_and_hsdp(shape, nodes, net, fwd_bwd)
                rows.append(PredictionRow(shape.name, tokens, nodes, net.inter_gbps, fsdp, hsdp))
    return rows


@dataclass(frozen=True)
class OneHostRow:
    """FSDP over all GPUs of one host vs HSDP (2 replicas, each sharded over half the host; NVLink both ways):
    what benchmarks/train_bench.py's fsdp_compile and fsdp_compile_hsdp measure on 4 or 8 GPUs."""

    model: str
    tokens: int
    gpus: int
    fsdp: StepTime
    hsdp: StepTime


def one_host_rows() -> list[OneHostRow]:
    rows = []
    for shape, tokens, rate in workloads()[:2]:
        fwd_bwd = fwd_bwd_ms_at(shape, tokens, rate)
        for gpus in (4, 8):
            fsdp = predict(units(shape), Topology(gpus, "fsdp"), Network(), fwd_bwd)
            hsdp = predict(units(shape), Topology(gpus, "hsdp", gpus_per_node=gpus // 2), Network(INTRA_NODE_GBPS),
                           fwd_bwd)
            rows.append(OneHostRow(shape.name, tokens, gpus, fsdp, hsdp))
    return rows


def break_even_gbps(shape: ModelShape, tokens: int, rate: float, nodes: int) -> float | None:
    """The inter-node bandwidth per GPU above which FSDP's step is shorter than HSDP's (bisection on a log scale:
    FSDP gains more from it), or None if HSDP stays faster up to 10 TB/s."""
    fwd_bwd = fwd_bwd_ms_at(shape, tokens, rate)

    def hsdp_faster(gbps: float) -> bool:
        fsdp, hsdp = fsdp_and_hsdp(shape, nodes, Network(gbps), fwd_bwd)
        return hsdp.step_ms < fsdp.step_ms

    low, high = 1.0, 1e4
    if hsdp_faster(high):
        return None
    for _ in range(40):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if hsdp_faster(mid) else (low, mid)
    return high


NO_OVERLAP_COMM_MS = {"run 5": 12.33, "run 6": 12.91, "run 7": 12.45}
"""fsdp_compile_no_overlap's `comm_ms` (every collective exposed), 0.95B, 2 GPUs, 4096 tokens/GPU (files as in
COMM_STRETCH): a check of the communication model alone."""


def _err(model: float, measured: float) -> str:
    return f"{100 * (model - measured) / measured:+.0f}%"


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _header(title: str, columns: str) -> None:
    """A table's title and its Markdown header (``columns``: separated by ``|``)."""
    names = [c.strip() for c in columns.split("|")]
    print(title)
    print("| " + " | ".join(names) + " |")
    print("|" + "---|" * len(names))


def print_check(rows: list[CheckRow]) -> None:
    _header("CHECK: fsdp_compile (FSDP, default options) measured vs the model fed the same run's bound "
            "forward+backward",
            "case | GPUs | tokens/GPU | runs | bound fwd+bwd ms | step ms meas / model | err | "
            "fwd+bwd ms meas / model | exposed ms meas / model | host ms")
    for r in rows:
        print(f"| {r.case} | {r.gpus} | {r.tokens} | {r.runs} | {r.bound_fwd_bwd_ms:.1f} | "
              f"{r.measured_step_ms:.1f} / {r.model.step_ms:.1f} | {_err(r.model.step_ms, r.measured_step_ms)} | "
              f"{_f(r.measured_fwd_bwd_ms)} / {r.model.fwd_bwd_ms:.1f} | "
              f"{_f(r.measured_exposed_ms)} / {r.model.exposed_ms:.1f} | {_f(r.host_ms)} |")
    print(f"\nCompute rate: 0.95B bound (run 15) {rate_0_95b() / 1e12:.0f} TFLOP/s; 8.8B fitted to its 4-GPU step "
          f"({measured_8b_step_ms():.0f} ms) {rate_8b() / 1e12:.0f} TFLOP/s. Contention {CONTENTION:.3f} ms per ms "
          f"overlapped. AdamW {OPT_FIXED_MS:.2f} + {OPT_SHARDED_MS:.2f} x (params / 0.95B) / shard ranks ms.")


def print_comm() -> None:
    model = comm_per_step_ms(LLAMA_0_95B, Topology(2, "fsdp"), Network())
    _header("\nCOMM: every collective of one step back to back, 0.95B, 2 GPUs, 4096 tokens/GPU (no-overlap traces)",
            "run | measured ms | model ms | err")
    for run, measured in NO_OVERLAP_COMM_MS.items():
        print(f"| {run} | {measured:.1f} | {model:.1f} | {_err(model, measured)} |")


def print_prediction(rows: list[PredictionRow]) -> None:
    _header("\nPREDICTION: 8 GPUs per node; FSDP shards over all GPUs, HSDP shards within a node, all-reduces across",
            "model | tokens/GPU | nodes | GPUs | inter-node GB/s per GPU | FSDP step ms (exposed) | "
            "HSDP step ms (exposed) | tight bound ms FSDP / HSDP | faster")
    for r in rows:
        winner = "HSDP" if r.hsdp_speedup > 1 else "FSDP"
        faster = "same" if r.nodes == 1 else f"{winner} {max(r.hsdp_speedup, 1 / r.hsdp_speedup):.2f}x"
        inter = f"{r.inter_gbps:.0f}" if r.inter_gbps else "-"
        print(f"| {r.model} | {r.tokens} | {r.nodes} | {8 * r.nodes} | {inter} | "
              f"{r.fsdp.step_ms:.1f} ({r.fsdp.exposed_ms:.1f}) | {r.hsdp.step_ms:.1f} ({r.hsdp.exposed_ms:.1f}) | "
              f"{r.fsdp.tight_bound_ms:.1f} / {r.hsdp.tight_bound_ms:.1f} | {faster} |")


@dataclass(frozen=True)
class BreakEvenRow:
    model: str
    tokens: int
    gbps: dict[int, float | None]
    """Nodes -> break_even_gbps."""


def break_even_rows() -> list[BreakEvenRow]:
    return [BreakEvenRow(shape.name, tokens, {n: break_even_gbps(shape, tokens, rate, n) for n in (2, 4, 8, 16)})
            for shape, tokens, rate in workloads()]


def print_break_even(rows: list[BreakEvenRow]) -> None:
    _header("\nBREAK-EVEN: inter-node GB/s per GPU above which FSDP beats HSDP (8 GPUs per node)",
            "model | tokens/GPU | 2 nodes | 4 nodes | 8 nodes | 16 nodes")
    for r in rows:
        cells = ["> 10000" if gbps is None else f"{gbps:.0f}" for gbps in r.gbps.values()]
        print(f"| {r.model} | {r.tokens} | {' | '.join(cells)} |")


def print_one_host(rows: list[OneHostRow]) -> None:
    _header("\nONE HOST: FSDP over all GPUs vs HSDP 2 x (GPUs / 2), the all-reduce over NVLink too",
            "model | tokens/GPU | GPUs | FSDP step ms (fwd+bwd, exposed) | HSDP step ms (fwd+bwd, exposed)")
    for r in rows:
        print(f"| {r.model} | {r.tokens} | {r.gpus} | {r.fsdp.step_ms:.1f} ({r.fsdp.fwd_bwd_ms:.1f}, "
              f"{r.fsdp.exposed_ms:.1f}) | {r.hsdp.step_ms:.1f} ({r.hsdp.fwd_bwd_ms:.1f}, {r.hsdp.exposed_ms:.1f}) |")


def inputs() -> dict[str, float]:
    names = ("INTRA_NODE_GBPS", "RING_STEP_NVLINK_US", "RING_STEP_NET_US", "MATMUL_SLOWDOWN", "COMM_STRETCH",
             "CONTENTION", "FORWARD_SHARE", "OPT_FIXED_MS", "OPT_SHARDED_MS", "BOUND_0_95B_FWD_BWD_MS", "MFU_8B_4GPU")
    fitted = {"rate_0_95b_flops": rate_0_95b(), "rate_8b_flops": rate_8b()}
    return {name: getattr(_step_time, name) for name in names} | fitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the inputs and the tables to this JSON file")
    args = parser.parse_args()
    check, prediction, break_even, one_host = check_rows(), prediction_rows(), break_even_rows(), one_host_rows()
    print_check(check)
    print_comm()
    print_prediction(prediction)
    print_break_even(break_even)
    print_one_host(one_host)
    if args.json:
        comm = comm_per_step_ms(LLAMA_0_95B, Topology(2, "fsdp"), Network())
        args.json.write_text(json.dumps({
            "inputs": inputs(),
            "check": [asdict(r) for r in check],
            "comm": [{"run": run, "measured_ms": ms, "model_ms": comm} for run, ms in NO_OVERLAP_COMM_MS.items()],
            "prediction": [asdict(r) | {"hsdp_speedup": r.hsdp_speedup} for r in prediction],
            "break_even": [asdict(r) for r in break_even],
            "one_host": [asdict(r) for r in one_host],
        }, indent=1))


if __name__ == "__main__":
    main()
