"""Memory of the meta-device route on one rank of a large group: a model built on meta, sharded over a fake
process group of WORLD ranks (this process is rank 0; no peers, no communication), ``to_empty`` on the device,
then ``init_parameters``. Prints the prediction beside what was measured and writes JSON.

    python benchmarks/meta_init_memory.py --model 70b --world-size 64 --device cuda --out /tmp/meta70b.json
    python benchmarks/meta_init_memory.py --model 7b --world-size 64 --device cpu    # peak RSS instead

Prediction: ``to_empty`` allocates this rank's shards (the sum of the units' shard sizes) and the buffers;
``init_parameters`` adds one submodule's full parameters at a time (the largest: the embedding or the output).
Both stay under the largest unit's full size plus the shards, the bound the route promises.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.llama import Block, Llama, LlamaConfig

MODELS = {
    "7b": LlamaConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, ffn_dim=11008, max_seq_len=2048,
                      tie_embeddings=False),  # Llama 2 7B
    "70b": LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, max_seq_len=8192,
                       tie_embeddings=False),  # Llama 3 70B's shape, full multi-head attention (80B parameters)
}


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="70b")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    device = torch.device(args.device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world_size)
    with torch.device("meta"):
        model = Llama(MODELS[args.model])
    largest_submodule = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in model.modules())
    fsdp_compile.shard(model, units=[Block])
    units = fsdp_compile.sharded_units(model)
    element = units[0].flat.element_size()
    shards = sum(u.layout.shard_numel for u in units) * element
    largest_unit = max(u.layout.padded_numel for u in units) * element
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())

    start = _peak(device)
    model.to_empty(device=device)
    after_to_empty = _peak(device) - start
    fsdp_compile.init_parameters(model, lambda m: [nn.init.normal_(p, std=0.02) for p in m.parameters(recurse=False)])
    after_init = _peak(device) - start
    result = {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "model": args.model, "world_size": args.world_size,
        "parameters": fsdp_compile.describe(model).num_parameters,
        "predicted_to_empty_bytes": shards + buffers, "measured_to_empty_bytes": after_to_empty,
        "predicted_init_bytes": shards + buffers + largest_submodule, "measured_init_bytes": after_init,
        "bound_bytes": largest_unit + shards, "largest_unit_bytes": largest_unit, "shard_bytes": shards,
        "measure": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS growth",
    }
    gib = 2**30
    print(f"{result['card']}, torch {result['torch']}: {args.model} ({result['parameters'] / 1e9:.1f}B parameters) "
          f"on rank 0 of {args.world_size}, {result['measure']}")
    print(f"  to_empty:        predicted {(shards + buffers) / gib:6.2f} GiB, measured {after_to_empty / gib:6.2f} GiB")
    print(f"  init_parameters: predicted {result['predicted_init_bytes'] / gib:6.2f} GiB, measured {after_init / gib:6.2f} GiB")
    print(f"  bound: largest unit {largest_unit / gib:.2f} GiB + shards {shards / gib:.2f} GiB = "
          f"{result['bound_bytes'] / gib:.2f} GiB; under it: {max(after_to_empty, after_init) < result['bound_bytes']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
