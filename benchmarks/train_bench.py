"""Compiled-training benchmark: fsdp_compile against its peers, side by side in ONE run.

    torchrun --nproc_per_node 2 benchmarks/train_bench.py                       # 0.95B, sweep 1024 and 4096 tokens/GPU
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens 2048 8192    # more points of the sweep
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --model tiny --tokens 16 32   # CPU smoke test (gloo)

Systems (same model, initial weights, data and mixed precision: bf16 params/compute, fp32 reduce, fp32
main weights, AdamW):
- ``no_comm_bound``: the same per-GPU work with no collective: each rank trains the whole model on its
  own micro-batch (fsdp_compile over a group of one rank: bf16 casts, fp32 main weights, full optimizer
  step). Its loss differs from the others after step 0 (no gradient averaging), so the loss guard checks
  its step 0 only.
- ``fsdp2_eager``: ``fully_shard`` per block and root.
- ``fsdp2_compile``: each block ``torch.compile``d, then ``fully_shard`` (torchtitan's order).
- ``simplefsdp``: written from SimpleFSDP's description: parameters as DTensor ``Shard(0)``, a
  parametrization redistributes them to ``Replicate`` (bf16 forward, fp32 backward) under a
  MUST_RECOMPUTE checkpoint policy (reshard after forward), whole model compiled with Inductor's
  overlap scheduling and bucketing (on GPUs).
- ``fsdp_compile`` and its variants (``FSDP_COMPILE_VARIANTS``: one line each).

Per point of the sweep (tokens per GPU = batch x seq; seq up to 2048): median step time over the steps after
--warmup, tokens/s/GPU, MFU (6 x matmul params + 12 x layers x dim x seq FLOPs per token, over the card's
dense bf16 peak), peak memory (``torch.cuda.max_memory_allocated`` over the measured steps, less what the
previous system left allocated: none, unless ``leftover_after_gib`` in the JSON says otherwise), exposed
communication (from a profiler trace of --profile-steps steps: time of NCCL kernels not overlapped by any
other kernel), compile time (first step minus the median). Prints markdown tables of ratios vs FSDP2
eager and vs the bound, a loss-agreement guard, and writes JSON (``--out``); ``benchmarks/plot.py`` turns
the JSON into plots.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import fsdp_compile
from fsdp_compile.testing.llama import LLAMA_0_95B, LLAMA_TINY, Block, Llama, LlamaConfig
from fsdp_compile.testing.profile import communication_overlap

MODELS = {"0.95b": LLAMA_0_95B, "tiny": LLAMA_TINY}
PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32
LOSS_RTOL = 2e-2  # bf16 compute: the systems' losses agree to ~1e-3; 2e-2 flags a real bug
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}  # dense, per GPU

FSDP_COMPILE_VARIANTS: dict[str, dict[str, Any]] = {
    "fsdp_compile": {},
    "fsdp_compile_no_overlap": {"overlap": False},
}
"""fsdp_compile variants: name -> ``fsdp_compile.backend(**options)``. Add one line per new variant."""


@dataclass
class Prepared:
    module: nn.Module  # called as module(inputs, targets) -> loss
    params: list[nn.Parameter]
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    """Entered around every step (Inductor settings must hold at the lazy backward compile too)."""


def _mp_fsdp_compile() -> fsdp_compile.MixedPrecision:
    return fsdp_compile.MixedPrecision(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)


def no_comm_bound(model: Llama, device: torch.device) -> Prepared:
    alone, _ = dist.new_subgroups(group_size=1)
    fsdp_compile.shard(model, units=[Block], group=alone, mp=_mp_fsdp_compile())
    return Prepared(torch.compile(model, backend="fsdp_compile", fullgraph=True), list(model.parameters()))


def fsdp2_eager(model: Llama, device: torch.device, compile_blocks: bool = False) -> Prepared:
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPE, reduce_dtype=REDUCE_DTYPE)
    for i, layer in enumerate(model.layers):
        if compile_blocks:
            layer = torch.compile(layer, fullgraph=True)
            model.layers.register_module(str(i), layer)
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return Prepared(model, list(model.parameters()))


def _must_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


class _ReplicateComputation(nn.Module):
    """SimpleFSDP's parametrization: a Shard(0) DTensor parameter -> the full local tensor, all-gathered
    in bf16, its gradient reduce-scattered (avg) in fp32; recomputed in backward, never saved."""

    def replicate(self, x: DTensor) -> torch.Tensor:
        full = x.redistribute(placements=(Replicate(),), forward_dtype=PARAM_DTYPE, backward_dtype=REDUCE_DTYPE)
        return full.to_local(grad_placements=(Partial("avg"),))

    def forward(self, x: DTensor) -> torch.Tensor:
        context = partial(create_selective_checkpoint_contexts, _must_recompute)
        return checkpoint(self.replicate, x, use_reentrant=False, context_fn=context)


def _overlap_config() -> dict[str, Any]:
    """Inductor's own overlap scheduling and collective bucketing (needs triton's cost model: GPUs)."""
    from torch._inductor import config

    if not torch.cuda.is_available():
        return {}
    if hasattr(config, "aten_distributed_optimizations"):
        return {
            "aten_distributed_optimizations.enable_overlap_scheduling": True,
            "aten_distributed_optimizations.collective_bucketing": True,
            "aten_distributed_optimizations.insert_overlap_deps": True,
        }
    return {"reorder_for_compute_comm_overlap": True, "bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}


def simplefsdp(model: Llama, device: torch.device) -> Prepared:
    from torch._inductor import config

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    replicate = _ReplicateComputation()
    distributed: dict[nn.Parameter, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if param not in distributed:
                distributed[param] = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]))
            module._parameters[name] = distributed[param]
            parametrize.register_parametrization(module, name, replicate, unsafe=True)
    compiled = torch.compile(model, fullgraph=True)
    return Prepared(compiled, list(distributed.values()), partial(config.patch, _overlap_config()))


def _fsdp_compile(options: dict[str, Any], model: Llama, device: torch.device) -> Prepared:
    fsdp_compile.shard(model, units=[Block], mp=_mp_fsdp_compile())
    compiled = torch.compile(model, backend=fsdp_compile.backend(**options), fullgraph=True)
    return Prepared(compiled, list(model.parameters()))


SYSTEMS: dict[str, Callable[[Llama, torch.device], Prepared]] = {
    "no_comm_bound": no_comm_bound,
    "fsdp2_eager": fsdp2_eager,
    "fsdp2_compile": partial(fsdp2_eager, compile_blocks=True),
    "simplefsdp": simplefsdp,
    **{name: partial(_fsdp_compile, options) for name, options in FSDP_COMPILE_VARIANTS.items()},
}


@dataclass
class Result:
    system: str
    tokens_per_gpu: int
    batch: int
    seq: int
    losses: list[float]
    step_ms: list[float]
    median_step_ms: float = 0.0
    compile_s: float = 0.0
    peak_gib: float | None = None
    exposed_comm_ms: float | None = None
    comm_ms: float | None = None
    tokens_per_s_per_gpu: float = 0.0
    mfu: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(cfg: LlamaConfig, batch: int, seq: int, step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)


def _flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    per_block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    matmul_params = cfg.n_layers * per_block + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq


def _release(device: torch.device) -> int:
    """Drop compiled code and garbage from the previous system; the bytes still allocated after that."""
    torch._dynamo.reset()
    gc.collect()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def run(name: str, cfg: LlamaConfig, batch: int, seq: int, args: argparse.Namespace, device: torch.device) -> Result:
    resident = _release(device)
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    model_ref = weakref.ref(model)
    prepared = SYSTEMS[name](model, device)
    opt = torch.optim.AdamW(prepared.params, lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    result = Result(system=name, tokens_per_gpu=batch * seq, batch=batch, seq=seq, losses=[], step_ms=[])

    def step(i: int) -> torch.Tensor:
        tokens = _batch(cfg, batch, seq, i, device)
        loss = prepared.module(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    with prepared.context():
        for i in range(args.steps):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            loss = step(i)
            _sync(device)
            result.step_ms.append((time.perf_counter() - start) * 1e3)
            global_loss = loss.detach().float()
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            result.losses.append(global_loss.item())
        if device.type == "cuda":
            result.peak_gib = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
            if args.profile_steps:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for i in range(args.profile_steps):
                        step(args.steps + i)
                    _sync(device)
                with tempfile.NamedTemporaryFile(suffix=".json") as trace:
                    prof.export_chrome_trace(trace.name)
                    overlap = communication_overlap(trace.name, args.profile_steps)
                result.comm_ms, result.exposed_comm_ms = overlap["comm"], overlap["exposed"]
    result.median_step_ms = statistics.median(result.step_ms[args.warmup :])
    result.compile_s = max(0.0, (result.step_ms[0] - result.median_step_ms) / 1e3)
    result.tokens_per_s_per_gpu = batch * seq / (result.median_step_ms / 1e3)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name(device)), None)
    if peak:
        result.mfu = _flops_per_token(cfg, seq) * result.tokens_per_s_per_gpu / peak
    del prepared, model, opt, step, loss
    leftover = _release(device) - resident
    result.extra.update(resident_before_gib=resident / 2**30, leftover_after_gib=leftover / 2**30,
                        model_freed=model_ref() is None)
    return result


def check_losses(results: list[Result]) -> list[str]:
    """Every system's losses against FSDP2 eager's, per point (the bound: step 0 only)."""
    problems = []
    by_point: dict[int, dict[str, Result]] = {}
    for r in results:
        by_point.setdefault(r.tokens_per_gpu, {})[r.system] = r
    for tokens, systems in by_point.items():
        ref = systems["fsdp2_eager"].losses
        for name, r in systems.items():
            steps = 1 if name == "no_comm_bound" else len(ref)
            worst = max(abs(a - b) / abs(b) for a, b in zip(r.losses[:steps], ref[:steps]))
            r.extra["loss_max_rel_diff_vs_fsdp2_eager"] = worst
            if worst > LOSS_RTOL:
                problems.append(f"{tokens} tokens/GPU: {name} loss differs from fsdp2_eager by {worst:.2e}")
    return problems


def _fmt(value: float | None, spec: str) -> str:
    if value is None:
        return "n/a"
    return format(value, spec[:-1]) + "%" if spec.endswith("%") else format(value, spec)


def table(results: list[Result]) -> Iterator[str]:
    by_point: dict[int, list[Result]] = {}
    for r in results:
        by_point.setdefault(r.tokens_per_gpu, []).append(r)
    for tokens, rows in sorted(by_point.items()):
        ref = next(r for r in rows if r.system == "fsdp2_eager").median_step_ms
        bound = next(r for r in rows if r.system == "no_comm_bound").median_step_ms
        yield f"\n{tokens} tokens/GPU (batch {rows[0].batch} x seq {rows[0].seq})\n"
        yield "| system | step ms | vs FSDP2 eager | vs bound | tokens/s/GPU | MFU | peak GiB | exposed comm ms | comm ms | compile s |"
        yield "|---|---|---|---|---|---|---|---|---|---|"
        for r in rows:
            yield (
                f"| {r.system} | {r.median_step_ms:.1f} | {r.median_step_ms / ref:.2f}x | {r.median_step_ms / bound:.2f}x | "
                f"{r.tokens_per_s_per_gpu:,.0f} | {_fmt(r.mfu and 100 * r.mfu, '.1f%')} | {_fmt(r.peak_gib, '.2f')} | "
                f"{_fmt(r.exposed_comm_ms, '.1f')} | {_fmt(r.comm_ms, '.1f')} | {r.compile_s:.1f} |"
            )


def _points(tokens: list[int], max_seq: int) -> list[tuple[int, int]]:
    """tokens per GPU -> (batch, seq): seq as long as the model allows (up to 2048), batch for the rest."""
    seq_cap = min(max_seq, 2048)
    return [(max(1, t // seq_cap), min(t, seq_cap)) for t in tokens]


def main() -> None:
    parser = argparse.ArgumentParser(description="fsdp_compile vs FSDP2, SimpleFSDP-style and the bound, in one run.")
    parser.add_argument("--model", choices=sorted(MODELS), default="0.95b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per GPU (sweep points)")
    parser.add_argument("--systems", nargs="+", choices=sorted(SYSTEMS), default=list(SYSTEMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of timing and peak memory")
    parser.add_argument("--profile-steps", type=int, default=2, help="extra steps traced for exposed communication")
    parser.add_argument("--out", help="write the JSON results to this file")
    args = parser.parse_args()
    if "fsdp2_eager" not in args.systems or "no_comm_bound" not in args.systems:
        parser.error("--systems must include fsdp2_eager and no_comm_bound (the tables' references)")
    cfg = MODELS[args.model]
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    results = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64):
        for batch, seq in _points(args.tokens, cfg.max_seq_len):
            for name in args.systems:
                results.append(run(name, cfg, batch, seq, args, device))
                if dist.get_rank() == 0:
                    r = results[-1]
                    print(f"# {name} {batch}x{seq}: {r.median_step_ms:.1f} ms, losses {[round(x, 4) for x in r.losses]}, "
                          f"{r.extra}", flush=True)
    problems = check_losses(results)
    meta = {
        "model": args.model,
        "world_size": dist.get_world_size(),
        "card": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "loss_rtol": LOSS_RTOL,
    }
    if dist.get_rank() == 0:
        print(f"\n## {meta}")
        for line in table(results):
            print(line)
        print(f"\nloss guard (all systems vs fsdp2_eager, rtol {LOSS_RTOL}): " + ("; ".join(problems) or "OK"))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
    dist.destroy_process_group()
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
