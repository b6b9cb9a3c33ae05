"""The step-time model of fsdp_compile on N GPUs (docs/scaling.md): FSDP over all GPUs or HSDP (shard within a node,
replicate across nodes). ``benchmarks/scaling_model.py`` checks it against every 2- and 4-GPU run and prints its
tables; ``fsdp_compile.estimate`` feeds it a model's units as the compiled step counts them. Standard library only.

Each unit gets its share of the step's FLOPs as compute and its parameters as collectives. Forward: unit i computes
while unit i+1 is gathered. Backward (the last unit first, kept gathered since forward): unit j computes while the
next unit is re-gathered and the previous one's gradient is exchanged, on one NCCL stream; HSDP's all-reduce across
nodes runs on its own stream a unit later. A segment takes max(communication, compute slowed by contention); the
first gathers and the last reductions have nothing to hide behind. Step = forward + backward + AdamW over this
GPU's shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Every measured number: NVIDIA H100 80GB HBM3 (2 or 4 GPUs of one host, NVLink), torch 2.11.0+cu130, NCCL 2.28.9,
# multicast off, unless it names the H200. Run numbers as in benchmarks/NOTES.md.
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
COPY_ENGINE_MATMUL_SLOWDOWN = 1.08
"""A block's matmuls beside the copy-engine all-gather or exchange into slots (in ring order, one stream): 1.06-1.09x
and 1.05-1.12x (run 53, 4 H200s, results/gemm_contention_slots_4gpu_h200_run53.txt): the default's routes within a
host ("auto")."""
COPY_ENGINE_CONTENTION = 1 - 1 / COPY_ENGINE_MATMUL_SLOWDOWN
"""CONTENTION for the copy-engine routes: the copies' own stretch beside compute not measured (taken as 1). With it
the model gives the H200 runs' 2- and 4-GPU steps within 1-3% (docs/big-models.md, "Before launch")."""
FORWARD_SHARE = 0.94 / (0.94 + 2.34)
"""Forward's share of a unit's compute: one block's forward / backward, 0.94 / 2.34 ms at 4096 tokens/GPU
(the team's DESIGN.md, 'Per unit of that model')."""
OPT_2GPU_MS, OPT_4GPU_MS = 6.5, 4.1
"""AdamW over 1/2 and 1/4 of the 0.95B model (the tight bound's optimizer, fixed as NOTES.md says: run 15 median,
results/bench_2gpu_4096_run15.json; run 13 median, results/bench_4gpu_1024_run13.json)."""


def _adamw_fit(two_gpu_ms: float, four_gpu_ms: float) -> tuple[float, float]:
    """AdamW ms = fixed + sharded x (parameters / 0.95B's) / shard ranks, through the 2- and 4-GPU times:
    (fixed, sharded)."""
    sharded = (two_gpu_ms - four_gpu_ms) / (1 / 2 - 1 / 4)
    return four_gpu_ms - sharded / 4, sharded


OPT_FIXED_MS, OPT_SHARDED_MS = _adamw_fit(OPT_2GPU_MS, OPT_4GPU_MS)
"""Fitted to those two (``_adamw_fit``): the part that does not shrink with the shard (launches), and the part that
does."""
OPT_2GPU_MS_H200, OPT_4GPU_MS_H200 = 5.34, 3.40
"""The same on H200s: fsdp_compile's `opt_ms`, medians of runs 37, 66, 69 (2 GPUs: 5.15-5.49) and run 53 (4 GPUs)."""
_ADAMW = {"H100": (OPT_FIXED_MS, OPT_SHARDED_MS), "H200": _adamw_fit(OPT_2GPU_MS_H200, OPT_4GPU_MS_H200)}
"""Card -> (fixed, sharded) AdamW ms (any other card: the H100's)."""
BOUND_0_95B_FWD_BWD_MS = 47.7
"""0.95B local forward+backward without communication, 4096 tokens/GPU (run 15 median, bench_2gpu_4096_run15.json):
sets the compute rate of the 0.95B predictions."""
BOUND_0_95B_FWD_BWD_MS_H200 = 46.4
"""The same on H200s: the median of the 19 `no_comm_bound` repeats at 4096 tokens/GPU in results/*h200*.json
(runs 37, 47, 49, 53, 64, 66, 69 and the one-GPU regions run; 45.5-48.6 ms)."""
MFU_8B_4GPU, PEAK_BF16_FLOPS = 0.507, 989.4e12
"""8.8B on 4 GPUs, 4096 tokens/GPU: fsdp_compile's MFU (the team's DESIGN.md; no JSON kept) over the dense bf16
peak that train_bench.py divides by. Assumed: seq 2048 (the default --seq-cap), no activation checkpointing."""
PEAK_FP32_FLOPS = 66.9e12
"""H100 SXM's dense float32 peak (no TF32): a float32 step's compute rate is the bf16 one scaled by it."""


@dataclass(frozen=True)
class Unit:
    """One unit of the step: its parameters, its share of the step's compute (FLOPs per token, or any measure
    proportional to them) and the bytes a parameter moves in its all-gather and gradient exchange."""

    params: int
    flops_per_token: float
    itemsize: float = BF16
    trainable: int | None = None
    """Parameters with a gradient (exchanged, stepped by AdamW); None: all."""

    @property
    def grads(self) -> int:
        return self.params if self.trainable is None else self.trainable


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
    """All-gather over the shard group."""
    reduce_ms: float
    """Gradient all-to-all over the shard group (the fp32 sum after it is compute, not modelled)."""
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


def all_gather_ms(params: int, ranks: int, nodes: int, net: Network, itemsize: float = BF16) -> float:
    """Ring all-gather: each GPU receives (n-1)/n of the unit, at the slowest link's bandwidth."""
    gbps = net.intra_gbps if nodes == 1 else net.inter_gbps
    return _transfer_ms(itemsize * params * (ranks - 1) / ranks, gbps) + _ring_latency_ms(ranks, nodes)


def exchange_ms(params: int, ranks: int, nodes: int, net: Network, itemsize: float = BF16) -> float:
    """All-to-all: each GPU sends (n-1)/n of the unit's gradient, the part for other nodes over its NIC and the rest
    over NVLink at the same time. Latency as a ring's (an upper bound)."""
    if params == 0:  # a frozen unit: no exchange
        return 0.0
    on_node = _transfer_ms(itemsize * params * (ranks // nodes - 1) / ranks, net.intra_gbps)
    off_node = _transfer_ms(itemsize * params * (1 - 1 / nodes), net.inter_gbps)
    return max(on_node, off_node) + _ring_latency_ms(ranks, nodes)


def all_reduce_ms(params: int, replicas: int, net: Network) -> float:
    """Ring all-reduce of an fp32 shard across replicas, each on its own node."""
    nbytes = 2 * FP32 * params * (replicas - 1) / replicas
    return _transfer_ms(nbytes, net.inter_gbps) + _ring_latency_ms(replicas, replicas, rounds=2)


def unit_times(units: Sequence[Unit], topo: Topology, net: Network, fwd_bwd_ms: float,
               forward_share: float = FORWARD_SHARE) -> list[UnitTimes]:
    """fwd_bwd_ms, the whole model's local forward+backward, split over the units by their FLOPs."""
    total = sum(unit.flops_per_token for unit in units)
    out = []
    for unit in units:
        compute = fwd_bwd_ms * unit.flops_per_token / total
        out.append(UnitTimes(
            forward_ms=compute * forward_share,
            backward_ms=compute * (1 - forward_share),
            gather_ms=all_gather_ms(unit.params, topo.shard_ranks, topo.shard_nodes, net, unit.itemsize),
            reduce_ms=exchange_ms(unit.grads, topo.shard_ranks, topo.shard_nodes, net, unit.itemsize),
            replicate_ms=all_reduce_ms(math.ceil(unit.grads / topo.shard_ranks), topo.replicas, net),
        ))
    return out


def _segment(compute_ms: float, comm_ms: float, contention: float) -> tuple[float, float]:
    """One unit's compute beside the communication issued with it: (time, communication exposed)."""
    slowed = compute_ms + contention * min(compute_ms, comm_ms)
    return max(slowed, comm_ms), max(0.0, comm_ms - slowed)


def _forward(times: list[UnitTimes], contention: float) -> tuple[float, float]:
    total = exposed = times[0].gather_ms  # the first unit's all-gather has nothing to hide behind
    for i, unit in enumerate(times):
        prefetch = times[i + 1].gather_ms if i + 1 < len(times) else 0.0
        seg, exp = _segment(unit.forward_ms, prefetch, contention)
        total, exposed = total + seg, exposed + exp
    return total, exposed


def _backward(times: list[UnitTimes], contention: float) -> tuple[float, float]:
    order = times[::-1]  # the last unit first: kept gathered since forward, never re-gathered
    total = exposed = 0.0
    for j, unit in enumerate(order):
        prefetch = order[j + 1].gather_ms if j + 1 < len(order) else 0.0
        reduction = order[j - 1].reduce_ms if j >= 1 else 0.0
        replication = order[j - 2].replicate_ms if j >= 2 else 0.0
        seg, exp = _segment(unit.backward_ms, max(prefetch + reduction, replication), contention)
        total, exposed = total + seg, exposed + exp
    before_last = order[-2].replicate_ms if len(order) > 1 else 0.0
    tail = max(order[-1].reduce_ms, before_last) + order[-1].replicate_ms  # after the last compute
    return total + tail, exposed + tail


def optimizer_ms(params: int, shard_ranks: int, card: str = "H100") -> float:
    """AdamW over a shard of ``params`` parameters (fitted on the 0.95B, on the card's own runs)."""
    fixed, sharded = _ADAMW.get(card, _ADAMW["H100"])
    return fixed + sharded * params / LLAMA_0_95B.params / shard_ranks


def predict(units: Sequence[Unit], topo: Topology, net: Network, fwd_bwd_ms: float,
            forward_share: float = FORWARD_SHARE, contention: float = CONTENTION, card: str = "H100") -> StepTime:
    """One GPU's step, given the whole model's local forward+backward time without communication; ``contention``:
    NCCL's (:data:`CONTENTION`) or the copy engines' (:data:`COPY_ENGINE_CONTENTION`)."""
    times = unit_times(units, topo, net, fwd_bwd_ms, forward_share)
    (fwd, fwd_exposed), (bwd, bwd_exposed) = _forward(times, contention), _backward(times, contention)
    opt = optimizer_ms(sum(unit.grads for unit in units), topo.shard_ranks, card)
    return StepTime(fwd + bwd + opt, fwd + bwd, fwd_exposed + bwd_exposed, opt, fwd_bwd_ms + opt)


def fwd_bwd_ms_at(shape: ModelShape, tokens: int, flops_per_s: float) -> float:
    return shape.flops_per_token * tokens / flops_per_s * 1e3


def rate_0_95b(bound_ms: float = BOUND_0_95B_FWD_BWD_MS) -> float:
    """FLOP/s of the 0.95B bound's forward+backward (run 15; or another card's bound)."""
    return LLAMA_0_95B.flops_per_token * 4096 / (bound_ms / 1e3)


def measured_8b_step_ms() -> float:
    return LLAMA_8B.flops_per_token * 4096 / (MFU_8B_4GPU * PEAK_BF16_FLOPS) * 1e3


def rate_8b() -> float:
    """Fitted: the 8.8B compute rate at which the model's 4-GPU step equals the measured one (bisection on the
    forward+backward time: the step grows with it)."""
    target, topo, blocks = measured_8b_step_ms(), Topology(4, "fsdp"), units(LLAMA_8B)
    low, high = 0.0, target
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if predict(blocks, topo, Network(), mid).step_ms < target else (low, mid)
    return LLAMA_8B.flops_per_token * 4096 / (low / 1e3)


CARDS = ("H100", "H200")


def _counted(shape: ModelShape) -> float:
    """FLOPs per token as torch.utils.flop_counter counts them (``fsdp_compile.estimate`` counts so): attention's
    backward as 2.5 forwards, where train_bench.py's count takes 2."""
    return shape.flops_per_token + 2 * shape.n_layers * shape.dim * shape.seq


def compute_rate(card: str, block_params: int, float32: bool = False) -> float:
    """FLOP/s (counted as torch.utils.flop_counter counts) of a model's forward+backward on ``card``: the 0.95B's
    measured rate for blocks of its size (51M parameters) or smaller, the 8.8B's fitted one for blocks of its size
    (243M) or larger, log-linear between; H200: the H100's scaled by the two cards' 0.95B bounds (the 8.8B was not
    run on H200s). ``float32``: scaled by the dense float32 peak over the bf16 one."""
    if card not in CARDS:
        raise ValueError(f"no compute rate measured for card {card!r}: name one of {CARDS}, or pass the measured "
                         "forward+backward time")
    small, large = units(LLAMA_0_95B)[1].params, units(LLAMA_8B)[1].params
    at = min(1.0, max(0.0, math.log(max(block_params, 1) / small) / math.log(large / small)))
    small_rate = rate_0_95b() * _counted(LLAMA_0_95B) / LLAMA_0_95B.flops_per_token
    rate = small_rate * (rate_8b() * _counted(LLAMA_8B) / LLAMA_8B.flops_per_token / small_rate) ** at
    if card == "H200":
        rate *= BOUND_0_95B_FWD_BWD_MS / BOUND_0_95B_FWD_BWD_MS_H200
    return rate * (PEAK_FP32_FLOPS / PEAK_BF16_FLOPS if float32 else 1.0)
