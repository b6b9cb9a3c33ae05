"""Step-time model of fsdp_compile on N GPUs, FSDP over all GPUs vs HSDP (shard within a node, replicate across
nodes), checked against the 2- and 4-GPU benchmark runs. Standard library only; docs/scaling.md explains it.

    python3 benchmarks/scaling_model.py                      # CHECK, COMM, PREDICTION, BREAK-EVEN, ONE HOST
    python3 benchmarks/scaling_model.py --json scaling.json  # the same tables (markdown), and as JSON with the inputs

Each unit (the embedding, every block, the output projection) gets its share of the step's FLOPs as compute and
its parameters as collectives. Forward: unit i computes while unit i+1 is gathered. Backward (output first, kept
gathered since forward): unit j computes while the next unit is re-gathered and the previous one's gradient is
exchanged, on one NCCL stream; HSDP's all-reduce across nodes runs on its own stream a unit later. A segment
takes max(communication, compute slowed by contention); the first gathers and the last reductions have nothing
to hide behind. Step = forward + backward + AdamW over this GPU's shard.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

RESULTS = Path(__file__).parent / "results"

# Every measured number: NVIDIA H100 80GB HBM3 (2 or 4 GPUs of one host, NVLink), torch 2.11.0+cu130, NCCL 2.28.9,
# multicast off. Run numbers as in benchmarks/NOTES.md.
BF16, FP32 = 2, 4
INTRA_NODE_GBPS = 212.0
"""Bus bandwidth per GPU over NVLink: one block's bf16 all-gather (51,380,224 parameters, 102.8 MB gathered) took
0.242 ms on 2 ranks (results/gemm_contention_ours.txt, run 14): 102.8 MB x 1/2 / 0.242 ms. Used for every
collective within a node, of any size and rank count (the bf16 all-to-all measured 0.213 ms, 12% faster)."""
RING_STEP_NVLINK_US, RING_STEP_NET_US = 3.4, 9.6
"""Latency per ring step within a node and across nodes: NCCL's own cost model (src/graph/tuning.cc, hwLat,
Ring/Simple). Not measured here."""
MATMUL_SLOWDOWN = 1.44
"""A block's matmuls beside a NCCL all-gather or bf16 all-to-all run 1.27-1.57x slower, median 1.44 (the 8 NCCL
rows of results/gemm_contention_ours.txt, run 14)."""
COMM_STRETCH = 1.36
"""NCCL kernel time with the overlap pass over that without it, 0.95B, 2 GPUs, 4096 tokens/GPU (`comm_ms`):
18.8/12.3 (run 5, results/bench_exchange_ab_4096.json), 16.6/12.9 (run 6, bench_exchange_ab_4096_1024.json),
16.9/12.4 ms (run 7, bench_1024_4096.json): median 1.36."""
CONTENTION = COMM_STRETCH * (1 - 1 / MATMUL_SLOWDOWN)
"""Extra compute time per ms of communication overlapped with compute: compute runs MATMUL_SLOWDOWN slower while
a NCCL kernel runs beside it, and that kernel runs COMM_STRETCH times its time alone."""
FORWARD_SHARE = 0.94 / (0.94 + 2.34)
"""Forward's share of a unit's compute: one block's forward / backward, 0.94 / 2.34 ms at 4096 tokens/GPU
(the team's DESIGN.md, 'Per unit of that model')."""
OPT_2GPU_MS, OPT_4GPU_MS = 6.5, 4.1
"""AdamW over 1/2 and 1/4 of the 0.95B model (the tight bound's optimizer, fixed as NOTES.md says: run 15 median,
results/bench_2gpu_4096_run15.json; run 13 median, results/bench_4gpu_1024_run13.json)."""
OPT_SHARDED_MS = (OPT_2GPU_MS - OPT_4GPU_MS) / (1 / 2 - 1 / 4)
"""Fitted to those two: AdamW ms = OPT_FIXED_MS + OPT_SHARDED_MS x (parameters / 0.95B's) / shard ranks."""
OPT_FIXED_MS = OPT_4GPU_MS - OPT_SHARDED_MS / 4
"""Fitted likewise: the part that does not shrink with the shard (launches)."""
BOUND_0_95B_FWD_BWD_MS = 47.7
"""0.95B local forward+backward without communication, 4096 tokens/GPU (run 15 median, bench_2gpu_4096_run15.json):
sets the compute rate of the 0.95B predictions."""
MFU_8B_4GPU, PEAK_BF16_FLOPS = 0.507, 989.4e12
"""8.8B on 4 GPUs, 4096 tokens/GPU: fsdp_compile's MFU (the team's DESIGN.md; no JSON kept) over the dense bf16
peak that train_bench.py divides by. Assumed: seq 2048 (the default --seq-cap), no activation checkpointing."""


@dataclass(frozen=True)
class ModelShape:
    """A Llama-style decoder with untied embedding and output (fsdp_compile/testing/llama.py)."""

    name: str
    vocab: int
    dim: int
    n_layers: int
    ffn_dim: int
    seq: int = 2048

    @property
    def params(self) -> int:
        return sum(unit.params for unit in units(self)) + self.dim  # + the root's final norm

    @property
    def flops_per_token(self) -> float:
        """train_bench.py's count: 6 x matmul parameters + 12 x layers x dim x seq (attention)."""
        return sum(unit.flops_per_token for unit in units(self))


LLAMA_0_95B = ModelShape("0.95B", vocab=32000, dim=2048, n_layers=16, ffn_dim=5632)
LLAMA_8B = ModelShape("8.8B", vocab=128256, dim=4096, n_layers=32, ffn_dim=14336)


@dataclass(frozen=True)
class Unit:
    params: int
    flops_per_token: float


def units(shape: ModelShape) -> list[Unit]:
    """The FSDP units in forward order: embedding, blocks, output projection."""
    matmuls = 4 * shape.dim * shape.dim + 3 * shape.dim * shape.ffn_dim
    block = Unit(matmuls + 2 * shape.dim, 6.0 * matmuls + 12 * shape.dim * shape.seq)
    table = shape.vocab * shape.dim
    return [Unit(table, 0.0), *[block] * shape.n_layers, Unit(table, 6.0 * table)]


@dataclass(frozen=True)
class Topology:
    gpus: int
    layout: Literal["fsdp", "hsdp"]
    gpus_per_node: int = 8

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    @property
    def shard_ranks(self) -> int:
        return self.gpus if self.layout == "fsdp" else min(self.gpus, self.gpus_per_node)

    @property
    def shard_nodes(self) -> int:
        return self.nodes if self.layout == "fsdp" else 1

    @property
    def replicas(self) -> int:
        return self.gpus // self.shard_ranks


@dataclass(frozen=True)
class Network:
    inter_gbps: float = 0.0
    """Per GPU across nodes (a parameter); unused within one node."""
    intra_gbps: float = INTRA_NODE_GBPS


@dataclass(frozen=True)
class UnitTimes:
    forward_ms: float
    backward_ms: float
    gather_ms: float
    """bf16 all-gather over the shard group."""
    reduce_ms: float
    """bf16 gradient all-to-all over the shard group (the fp32 sum after it is compute, not modelled)."""
    replicate_ms: float
    """HSDP: fp32 all-reduce of the reduced shard across the replicas, one GPU per node."""


@dataclass(frozen=True)
class StepTime:
    step_ms: float
    fwd_bwd_ms: float
    exposed_ms: float
    optimizer_ms: float
    tight_bound_ms: float
    """Local forward+backward without communication plus AdamW over this GPU's shard."""


def _transfer_ms(nbytes: float, gbps: float) -> float:
    return 0.0 if nbytes == 0 else nbytes / (gbps * 1e9) * 1e3


def _ring_latency_ms(ranks: int, nodes: int, rounds: int = 1) -> float:
    return rounds * ((ranks - nodes) * RING_STEP_NVLINK_US + (nodes - 1) * RING_STEP_NET_US) / 1e3


def all_gather_ms(params: int, ranks: int, nodes: int, net: Network) -> float:
    """Ring all-gather: each GPU receives (n-1)/n of the unit, at the slowest link's bandwidth."""
    gbps = net.intra_gbps if nodes == 1 else net.inter_gbps
    return _transfer_ms(BF16 * params * (ranks - 1) / ranks, gbps) + _ring_latency_ms(ranks, nodes)


def exchange_ms(params: int, ranks: int, nodes: int, net: Network) -> float:
    """All-to-all: each GPU sends (n-1)/n of the unit's bf16 gradient, the part for other nodes over its NIC and
    the rest over NVLink at the same time. Latency as a ring's (an upper bound)."""
    on_node = _transfer_ms(BF16 * params * (ranks // nodes - 1) / ranks, net.intra_gbps)
    off_node = _transfer_ms(BF16 * params * (1 - 1 / nodes), net.inter_gbps)
    return max(on_node, off_node) + _ring_latency_ms(ranks, nodes)


def all_reduce_ms(params: int, replicas: int, net: Network) -> float:
    """Ring all-reduce of an fp32 shard across replicas, each on its own node."""
    nbytes = 2 * FP32 * params * (replicas - 1) / replicas
    return _transfer_ms(nbytes, net.inter_gbps) + _ring_latency_ms(replicas, replicas, rounds=2)


def unit_times(shape: ModelShape, topo: Topology, net: Network, fwd_bwd_ms: float) -> list[UnitTimes]:
    """fwd_bwd_ms, the whole model's local forward+backward, split over the units by their FLOPs."""
    out = []
    for unit in units(shape):
        compute = fwd_bwd_ms * unit.flops_per_token / shape.flops_per_token
        out.append(UnitTimes(
            forward_ms=compute * FORWARD_SHARE,
            backward_ms=compute * (1 - FORWARD_SHARE),
            gather_ms=all_gather_ms(unit.params, topo.shard_ranks, topo.shard_nodes, net),
            reduce_ms=exchange_ms(unit.params, topo.shard_ranks, topo.shard_nodes, net),
            replicate_ms=all_reduce_ms(math.ceil(unit.params / topo.shard_ranks), topo.replicas, net),
        ))
    return out


def _segment(compute_ms: float, comm_ms: float) -> tuple[float, float]:
    """One unit's compute beside the communication issued with it: (time, communication exposed)."""
    slowed = compute_ms + CONTENTION * min(compute_ms, comm_ms)
    return max(slowed, comm_ms), max(0.0, comm_ms - slowed)


def _forward(times: list[UnitTimes]) -> tuple[float, float]:
    total = exposed = times[0].gather_ms  # the first unit's all-gather has nothing to hide behind
    for i, unit in enumerate(times):
        prefetch = times[i + 1].gather_ms if i + 1 < len(times) else 0.0
        seg, exp = _segment(unit.forward_ms, prefetch)
        total, exposed = total + seg, exposed + exp
    return total, exposed


def _backward(times: list[UnitTimes]) -> tuple[float, float]:
    order = times[::-1]  # the output first: kept gathered since forward, never re-gathered
    total = exposed = 0.0
    for j, unit in enumerate(order):
        prefetch = order[j + 1].gather_ms if j + 1 < len(order) else 0.0
        reduction = order[j - 1].reduce_ms if j >= 1 else 0.0
        replication = order[j - 2].replicate_ms if j >= 2 else 0.0
        seg, exp = _segment(unit.backward_ms, max(prefetch + reduction, replication))
        total, exposed = total + seg, exposed + exp
    tail = max(order[-1].reduce_ms, order[-2].replicate_ms) + order[-1].replicate_ms  # after the last compute
    return total + tail, exposed + tail


def optimizer_ms(shape: ModelShape, shard_ranks: int) -> float:
    return OPT_FIXED_MS + OPT_SHARDED_MS * shape.params / LLAMA_0_95B.params / shard_ranks


def predict(shape: ModelShape, topo: Topology, net: Network, fwd_bwd_ms: float) -> StepTime:
    """One GPU's step, given the whole model's local forward+backward time without communication."""
    times = unit_times(shape, topo, net, fwd_bwd_ms)
    (fwd, fwd_exposed), (bwd, bwd_exposed) = _forward(times), _backward(times)
    opt = optimizer_ms(shape, topo.shard_ranks)
    return StepTime(fwd + bwd + opt, fwd + bwd, fwd_exposed + bwd_exposed, opt, fwd_bwd_ms + opt)


def comm_per_step_ms(shape: ModelShape, topo: Topology, net: Network) -> float:
    """Every collective of a step back to back (what the traces without the overlap pass measure)."""
    times = unit_times(shape, topo, net, 0.0)
    gathers = sum(2 * t.gather_ms for t in times) - times[-1].gather_ms  # the output unit is gathered once
    return gathers + sum(t.reduce_ms + t.replicate_ms for t in times)


def fwd_bwd_ms_at(shape: ModelShape, tokens: int, flops_per_s: float) -> float:
    return shape.flops_per_token * tokens / flops_per_s * 1e3


def rate_0_95b() -> float:
    """FLOP/s of the 0.95B bound's forward+backward (run 15)."""
    return LLAMA_0_95B.flops_per_token * 4096 / (BOUND_0_95B_FWD_BWD_MS / 1e3)


def measured_8b_step_ms() -> float:
    return LLAMA_8B.flops_per_token * 4096 / (MFU_8B_4GPU * PEAK_BF16_FLOPS) * 1e3


def rate_8b() -> float:
    """Fitted: the 8.8B compute rate at which the model's 4-GPU step equals the measured one (bisection on the
    forward+backward time: the step grows with it)."""
    target, topo = measured_8b_step_ms(), Topology(4, "fsdp")
    low, high = 0.0, target
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(LLAMA_8B, topo, Network(), mid).step_ms < target else (low, mid)
    return LLAMA_8B.flops_per_token * 4096 / (low / 1e3)


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
                    _median(ours, "cpu_ms"), predict(shape, topo, net, fwd_bwd)))
    fwd_bwd = fwd_bwd_ms_at(LLAMA_8B, 4096, rate_0_95b())
    rows.append(CheckRow("8.8B, 0.95B rate", 4, 4096, 1, fwd_bwd, measured_8b_step_ms(), None, None, None,
                         predict(LLAMA_8B, Topology(4, "fsdp"), Network(), fwd_bwd)))
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
    fsdp, hsdp = (predict(shape, Topology(8 * nodes, layout), net, fwd_bwd_ms) for layout in ("fsdp", "hsdp"))
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
            fsdp = predict(shape, Topology(gpus, "fsdp"), Network(), fwd_bwd)
            hsdp = predict(shape, Topology(gpus, "hsdp", gpus_per_node=gpus // 2), Network(INTRA_NODE_GBPS), fwd_bwd)
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
    return {name: globals()[name] for name in names} | fitted


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
