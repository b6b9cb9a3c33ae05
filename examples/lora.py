"""Fine-tune a sharded Hugging Face model with LoRA adapters (peft): the base frozen, only the adapters train, and
only they are reduced in backward; then save the adapters where ``PeftModel.from_pretrained`` reads them.

    pip install peft transformers                                # (both in the test extras: pip install -e '.[test]')
    python examples/lora.py                                      # CPU: 2 gloo ranks, a tiny Llama (~1 min)
    torchrun --nproc_per_node 8 examples/lora.py --model 8.8b    # GPUs: Llama 3.1 8B's shape (full attention heads)
    torchrun --nproc_per_node 1 examples/lora.py --model 8.8b --compare --json lora.json
        # one GPU: the same LoRA model without shard() first, under torch.compile, then sharded: peak memory and
        # step time side by side
    torchrun --nproc_per_node 1 examples/lora.py --model 8.8b --offload --json lora.json
        # then the same model sharded with CPU offload (FSDP2's CPUOffloadPolicy): the frozen base and the adapters
        # in pinned host memory, each unit copied to the GPU for its forward and again for its backward

On a bf16 model peft makes the adapters float32 (``autocast_adapter_dtype=True``): each decoder layer then holds
a frozen bf16 group and a trainable float32 group, gathered separately; only the float32 group has a gradient.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import fsdp_compile
from fsdp_compile.testing.dist import gloo_one_worker_thread, spawn_ranks
from fsdp_compile.testing.reference import CausalLMLoss, assert_bitwise

MODELS = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4),
    "8.8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32),
}


def build(model_name: str, rank: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The base model (the same on every rank: seeded) with peft's LoRA adapters on the q and v projections."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**MODELS[model_name], max_position_embeddings=8192, tie_word_embeddings=False, use_cache=False)
    with device:
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype)  # built in dtype (float32 buffers stay float32)
    return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))


def train(model: torch.nn.Module, backend: object, args: argparse.Namespace, device: torch.device) -> dict:
    """``warmup + steps`` AdamW steps of the model compiled with ``backend`` on this rank's batches; the timed
    steps' mean and the peak memory from the first step on."""
    compiled = torch.compile(CausalLMLoss(model), backend=backend)
    vocab, seq, steps, warmup = MODELS[args.model]["vocab_size"], args.seq, args.steps, args.warmup
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for step in range(warmup + steps):
        seed = torch.Generator().manual_seed(step * world_size + rank)
        tokens = torch.randint(0, vocab, (1, seq + 1), generator=seed).to(device)
        start = time.perf_counter()
        loss = compiled(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_s": sum(times) / len(times), "peak_bytes": peak, "losses": losses}


def save_adapters(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Gather the trainable parameters (the adapters: a collective, on every rank) and save them from rank 0 with
    peft's ``save_pretrained``; return peft's state dict of them."""
    trainable = fsdp_compile.full_state_dict(model, trainable_only=True)
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=trainable)
    dist.barrier()
    return get_peft_model_state_dict(model, state_dict=trainable)


def release(device: torch.device) -> None:
    """Free the previous run's model and compiled code before the next run's (each run's peak is its own)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(rank: int, world_size: int, args: argparse.Namespace) -> None:
    cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    results = {"card": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
               "model": args.model, "world_size": world_size, "seq": args.seq, "lora_rank": args.rank}
    if args.compare:
        if world_size != 1:
            raise SystemExit("--compare runs the model without shard() beside the sharded one: one rank only")
        results["unsharded"] = train(build(args.model, args.rank, device, dtype), args.compiler, args, device)
        release(device)
    model = build(args.model, args.rank, device, dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    fsdp_compile.shard(model, units=[LlamaDecoderLayer])
    units = fsdp_compile.sharded_units(model)
    reduced = sum(u.layout.padded_numel for u in units if u.trainable)
    padding = sum((u.layout.padded_numel - sum(s.numel for s in u.layout.slots)) * u.flat.element_size() for u in units)
    results.update(parameters=total, trainable=trainable, reduced_elements=reduced, padding_bytes=padding)
    results["sharded"] = train(model, fsdp_compile.backend(compiler=args.compiler), args, device)
    if args.offload:
        del model, units
        release(device)
        model = fsdp_compile.shard(build(args.model, args.rank, device, dtype), units=[LlamaDecoderLayer],
                                   offload_policy=CPUOffloadPolicy(pin_memory=cuda))
        results["offloaded"] = train(model, fsdp_compile.backend(compiler=args.compiler), args, device)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.save or tmp
        adapters = save_adapters(model, path)
        if rank == 0 and args.model == "tiny":  # loaded onto an unsharded base: the same adapters
            loaded = PeftModel.from_pretrained(build(args.model, args.rank, device, dtype).get_base_model(), path)
            assert_bitwise(get_peft_model_state_dict(loaded), adapters)
    if rank == 0:
        sharded = results["sharded"]
        print(f"{results['card']}, torch {results['torch']}, {world_size} ranks: {total:,} parameters, {trainable:,} "
              f"trainable ({trainable / total:.2%}); backward reduces {reduced:,} elements (with padding)")
        print(f"sharded: {sharded['step_s'] * 1e3:.1f} ms a step; losses {[round(x, 4) for x in sharded['losses']]}")
        print(f"adapters: {len(adapters)} tensors saved" + (" and reloaded onto an unsharded base, bitwise equal"
                                                            if args.model == "tiny" else ""))
        if args.compare and cuda:
            plain = results["unsharded"]
            more = (sharded["peak_bytes"] - plain["peak_bytes"]) / 2**20
            print(f"peak memory: sharded {sharded['peak_bytes'] / 2**30:.3f} GiB, without shard() "
                  f"{plain['peak_bytes'] / 2**30:.3f} GiB (difference {more:+.1f} "
                  f"MiB; the shards' padding {padding / 2**20:.2f} MiB); step time sharded / without shard(): "
                  f"{sharded['step_s'] / plain['step_s']:.3f} ({plain['step_s'] * 1e3:.1f} ms without)")
        if args.offload:
            offloaded = results["offloaded"]
            print(f"offloaded: {offloaded['step_s'] * 1e3:.1f} ms a step; losses "
                  f"{[round(x, 4) for x in offloaded['losses']]}")
            if cuda:
                print(f"peak memory: offloaded {offloaded['peak_bytes'] / 2**30:.3f} GiB, sharded "
                      f"{sharded['peak_bytes'] / 2**30:.3f} GiB; step time offloaded / sharded: "
                      f"{offloaded['step_s'] / sharded['step_s']:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``: the process's if None)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--rank", type=int, default=8, help="LoRA's rank r")
    parser.add_argument("--seq", type=int, default=128, help="tokens per rank and step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones (compilation)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor")
    parser.add_argument("--compare", action="store_true", help="first the same LoRA model without shard() (1 rank)")
    parser.add_argument("--offload", action="store_true", help="then the model sharded with CPU offload")
    parser.add_argument("--save", help="a folder for the adapters (default: a temporary one)")
    parser.add_argument("--json", help="write the measurements here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = arguments()
    if "RANK" in os.environ:  # torchrun
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        else:
            gloo_one_worker_thread()
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        main(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        spawn_ranks(main, 2, args)
