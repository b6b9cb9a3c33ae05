"""The first step's compile time against the model's depth: the first forward+backward's wall time of a Llama-style
model of LAYERS blocks, each point in fresh processes with an empty Inductor cache, side by side:

    default       fsdp_compile.shard + torch.compile(backend=fsdp_compile.backend()): each distinct block body once
    regions_off   the same with fsdp_compile.backend(regions=False): the whole step as one graph
    plain         torch.compile(model) of the unsharded model (no communication)
    per_block     torchtitan's way: FSDP2's fully_shard per block and the root, torch.compile(block) per block

    python benchmarks/compile_time.py                                  # CPU: dim 64, 8/32/80 layers, world 1 and 2
    python benchmarks/compile_time.py --layers 8 80 --world 1 --systems default regions_off --out /tmp/ct.json
    python benchmarks/compile_time.py --layers 80 --world 1 --cache /tmp/warm   # twice: the second, a warm restart
    python benchmarks/compile_time.py --device cuda --world 1 --dim 1024 --head-dim 128 --vocab 32000 --seq 2048 \
        --dtype bfloat16 --layers 80                                  # one GPU; --float8 tensorwise: torchao's

Prints a table (seconds; the default's time at each depth over its time at the fewest layers) and, per point, where
the time went (``torch._dynamo.utils.compile_times()``'s metrics, summed): Dynamo's tracing, AOTAutograd's joint
graph and partition, fsdp_compile's passes, Inductor's code generation. Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

import fsdp_compile
from fsdp_compile.testing.dist import spawn_ranks
from fsdp_compile.testing.llama import Block, Llama, LlamaConfig

SYSTEMS = ("default", "regions_off", "plain", "per_block")
PHASES = {
    "dynamo": ("bytecode_tracing",),
    "aot_joint": ("aot_trace_joint_graph",),
    "partition": ("min_cut_rematerialization_partition",),
    "fsdp_passes": ("pass.fsdp_compile.",),
    "inductor": ("fx_codegen_and_compile",),
}
"""Where the time went: the compile-time metrics whose names start with these, summed (Dynamo keeps them per
process; nested metrics overlap, so the phases do not add up to the wall time)."""


def _model(args: argparse.Namespace, layers: int) -> Llama:
    cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=layers, n_heads=max(args.dim // args.head_dim, 1),
                      ffn_dim=args.dim * 11 // 4, max_seq_len=args.seq, tie_embeddings=False)
    model = Llama(cfg).to(getattr(torch, args.dtype))
    if args.float8 != "none":  # torchao's float8 training: every block's linear layers (emulated off Hopper)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(args.float8)
        if not torch.cuda.is_available():
            config = Float8LinearConfig(emulate=True)
        convert_to_float8_training(model.layers, config=config)
    return model


def _prepared(system: str, model: Llama) -> Any:
    if system in ("default", "regions_off"):
        fsdp_compile.shard(model, units=[Block])
        return torch.compile(model, backend=fsdp_compile.backend(regions=system == "default"))
    if system == "plain":
        return torch.compile(model)
    from torch.distributed.fsdp import fully_shard

    for index, block in enumerate(model.layers):
        fully_shard(block)
        model.layers.register_module(str(index), torch.compile(block))
    fully_shard(model)
    return model


def _phases() -> dict[str, float]:
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return {phase: round(sum(sum(times) for name, times in metrics.items() if name.startswith(prefixes)), 2)
            for phase, prefixes in PHASES.items()}


def _point(rank: int, world: int, args: argparse.Namespace, system: str, layers: int, out: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    with torch.device(device):
        model = _model(args, layers)
    run = _prepared(system, model)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    dist.barrier()
    start = time.perf_counter()
    run(tokens[:, :-1], tokens[:, 1:]).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if rank == 0:
        shared = torch._dynamo.utils.counters["fsdp_compile"]["shared_bodies"]
        with open(out, "w") as f:
            metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
            json.dump({"system": system, "layers": layers, "world": world, "first_step_s": round(seconds, 2),
                       "shared_bodies": shared, "phases": _phases(),
                       "metrics": {name: round(sum(times), 3) for name, times in metrics.items()}}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 32, 80])
    parser.add_argument("--world", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the model's dtype")
    parser.add_argument("--float8", choices=["none", "tensorwise", "rowwise"], default="none",
                        help="torchao float8 training of the blocks' linear layers")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--cache", help="keep each system's Inductor caches (FX graphs, AOTAutograd's, kernels) under "
                                        "this folder: a second run with it measures a warm restart")
    parser.add_argument("--out", help="JSON file for the results")
    args = parser.parse_args()
    results = []
    for world in args.world:
        for layers in args.layers:
            for system in args.systems:
                with tempfile.TemporaryDirectory() as fresh, tempfile.TemporaryDirectory() as where:
                    cache = os.path.join(args.cache, system) if args.cache else fresh
                    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # fresh: every kernel and graph compiled afresh
                    spawn_ranks(_point, world, args, system, layers, os.path.join(where, "point.json"),
                                backend="nccl" if args.device == "cuda" else "gloo")
                    with open(os.path.join(where, "point.json")) as f:
                        results.append(json.load(f))
                print(json.dumps(results[-1]), flush=True)
    _table(results, args)
    if args.out:
        meta = {"torch": torch.__version__, "device": _device_name(args.device), "cpus": os.cpu_count(),
                "model": {k: getattr(args, k) for k in ("dim", "head_dim", "vocab", "seq", "batch", "dtype", "float8")},
                "cache": args.cache}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()


def _table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nfirst forward+backward, s (torch {torch.__version__}, {_device_name(args.device)}, "
          f"{os.cpu_count()} CPUs, dim {args.dim})")
    print("| world | layers | " + " | ".join(args.systems) + " | default / default at the fewest layers |")
    print("|---" * (len(args.systems) + 3) + "|")
    for world in args.world:
        first = {r["system"]: r["first_step_s"] for r in results if r["world"] == world
                 and r["layers"] == min(args.layers)}
        for layers in args.layers:
            row = {r["system"]: r for r in results if r["world"] == world and r["layers"] == layers}
            ratio = (f"{row['default']['first_step_s'] / first['default']:.2f}x"
                     if "default" in row and "default" in first else "-")
            print(f"| {world} | {layers} | " + " | ".join(f"{row[s]['first_step_s']:.1f}" for s in args.systems)
                  + f" | {ratio} |")
    print("\nwhere the time went (s; nested metrics overlap):")
    for r in results:
        print(f"  {r['system']:12s} world {r['world']} layers {r['layers']:3d}: "
              + ", ".join(f"{k} {v}" for k, v in r["phases"].items()))


if __name__ == "__main__":
    main()
