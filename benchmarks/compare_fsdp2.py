"""fsdp_compile vs FSDP2 eager on the same model, init and data, side by side in one run.

    torchrun --nproc_per_node 2 benchmarks/compare_fsdp2.py                 # 0.95B, seq 2048, batch 2 per GPU
    torchrun --nproc_per_node 2 benchmarks/compare_fsdp2.py --config tiny   # seconds; also runs on CPU (gloo)

Both systems: bf16 params/compute, fp32 reduce-scatter, fp32 shards, AdamW (fused on GPU). Prints per-step
losses, median step time (steps after --warmup), peak memory (torch.cuda.max_memory_allocated over the
measured steps) and whether the loss curves agree within bf16 tolerance; writes JSON with --json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_compile
from fsdp_compile.testing.llama import LLAMA_0_95B, LLAMA_TINY, Block, Llama, LlamaConfig

CONFIGS = {"0.95b": (LLAMA_0_95B, 2, 2048), "tiny": (LLAMA_TINY, 2, 16)}
LOSS_RTOL = 1e-2  # bf16 compute: per-step losses of the two systems agree to ~1e-3; 1e-2 flags a real bug


def _fsdp2(model: Llama) -> torch.nn.Module:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def _fsdp_compile(model: Llama) -> torch.nn.Module:
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp_compile.shard(model, units=[Block], mp=mp)
    return torch.compile(model, backend="fsdp_compile", fullgraph=True)


SYSTEMS: dict[str, Callable[[Llama], torch.nn.Module]] = {"fsdp2_eager": _fsdp2, "fsdp_compile": _fsdp_compile}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_system(name: str, cfg: LlamaConfig, batch: int, seq: int, steps: int, warmup: int, device: torch.device) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    with device:
        model = Llama(cfg)
    trained = SYSTEMS[name](model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")
    losses, step_ms = [], []
    for step in range(steps):
        if step == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen).to(device)
        _sync(device)
        start = time.perf_counter()
        loss = trained(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        _sync(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        global_loss = loss.detach().float()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del trained, model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "losses": losses,
        "step_ms": step_ms,
        "median_step_ms": statistics.median(step_ms[warmup:]),
        "first_step_ms": step_ms[0],
        "peak_gib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="0.95b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of timing and peak memory")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cfg, batch, seq = CONFIGS[args.config]
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    results = {name: run_system(name, cfg, batch, seq, args.steps, args.warmup, device) for name in SYSTEMS}
    ref = results["fsdp2_eager"]
    ours = results["fsdp_compile"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], ref["losses"]))
    meta = {
        "config": args.config,
        "tokens_per_gpu": batch * seq,
        "world_size": dist.get_world_size(),
        "card": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        "loss_max_rel_diff": worst,
        "loss_rtol": LOSS_RTOL,
    }
    if dist.get_rank() == 0:
        print(f"# {meta}")
        print("| step | fsdp2_eager loss | fsdp_compile loss |")
        print("|---|---|---|")
        for step, (a, b) in enumerate(zip(ref["losses"], ours["losses"])):
            print(f"| {step} | {a:.5f} | {b:.5f} |")
        print()
        print("| system | median step ms | first step ms (incl. compile) | peak GiB | step time vs FSDP2 eager |")
        print("|---|---|---|---|---|")
        for name, r in results.items():
            ratio = r["median_step_ms"] / ref["median_step_ms"]
            print(f"| {name} | {r['median_step_ms']:.1f} | {r['first_step_ms']:.0f} | {r['peak_gib']:.2f} | {ratio:.2f}x |")
        print(f"loss curves agree within {LOSS_RTOL}: {worst <= LOSS_RTOL} (max rel diff {worst:.2e}); "
              f"peak memory <= FSDP2 eager: {ours['peak_gib'] <= ref['peak_gib']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
