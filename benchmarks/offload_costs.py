"""What CPU offload costs before the compiler schedules any of it: a model's shards copied between pinned host memory
and the GPU in each dtype and order, and the optimizer step on the host by each of torch's AdamW implementations
beside the same step on the GPU. One process, one GPU (on a machine without one: the CPU stands for both sides, for
trying the program only).

    python benchmarks/offload_costs.py [--params 0.95e9] [--units 16] [--json results/offload_costs.json]

Beside each row, its prediction from two measured ceilings: the pinned float32 host-to-device bandwidth (the first
row) and each side's streaming bandwidth (the casts: 4 bytes read and 2 written a parameter); AdamW at 28 bytes a
parameter (it reads the parameter, its gradient and the two moments in float32 and writes three) at its side's
streaming bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch


def _seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn`` after one warm-up call, the device synchronized around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin).uniform_(-1, 1)


def copies(units: list[int], device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds to move every unit's shard once, each way and dtype (the rows of the table)."""
    pin = device.type == "cuda"
    fp32 = [_host(n, torch.float32, pin) for n in units]
    bf16 = [_host(n, torch.bfloat16, pin) for n in units]
    pageable = [_host(n, torch.float32, False) for n in units]
    on_device = [torch.empty(n, device=device) for n in units]
    on_device_bf16 = [torch.empty(n, device=device, dtype=torch.bfloat16) for n in units]

    def to_device(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)

    def to_host(src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        for s, d in zip(src, dst):
            d.copy_(s, non_blocking=True)

    def cast_on_host() -> None:
        for s, d in zip(fp32, bf16):
            d.copy_(s)

    def cast_on_device() -> None:
        for s, d in zip(on_device, on_device_bf16):
            d.copy_(s)

    rows = {
        "h2d float32, pinned": lambda: to_device(fp32, on_device),
        "h2d bfloat16, pinned": lambda: to_device(bf16, on_device_bf16),
        "h2d float32, pageable": lambda: to_device(pageable, on_device),
        "d2h float32, pinned": lambda: to_host(on_device, fp32),
        "cast float32 -> bfloat16 on the host": cast_on_host,
        "cast float32 -> bfloat16 on the device": cast_on_device,
        "copy then cast (FSDP2's order)": lambda: (to_device(fp32, on_device), cast_on_device()),
        "cast on the host, then copy": lambda: (cast_on_host(), to_device(bf16, on_device_bf16)),
    }
    return {name: _seconds(fn, repeats, device) for name, fn in rows.items()}


def adamw_steps(units: list[int], device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds of one AdamW step over every unit's shard: on the host by each implementation, and on ``device``."""
    results = {}
    variants = {"host fused": ("cpu", {"fused": True}), "host foreach": ("cpu", {"foreach": True}),
                "host for-loop": ("cpu", {"foreach": False})}
    if device.type == "cuda":
        variants["device fused"] = ("cuda", {"fused": True})
    for name, (where, kwargs) in variants.items():
        params = [torch.nn.Parameter(torch.randn(n, device=where)) for n in units]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **kwargs)
        results[name] = _seconds(opt.step, repeats if "for-loop" not in name else 1, torch.device(where))
        del params, opt
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=0.95e9, help="parameters, split evenly into --units shards")
    parser.add_argument("--units", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    units = [int(args.params) // args.units] * args.units
    numel = sum(units)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU only"
    print(f"{card}, torch {torch.__version__}, {torch.get_num_threads()} host threads; {numel / 1e9:.2f}B parameters "
          f"in {args.units} shards")
    times = copies(units, device, args.repeats)
    pinned_bw = numel * 4 / times["h2d float32, pinned"]
    host_cast_bw = numel * 6 / times["cast float32 -> bfloat16 on the host"]  # 4 bytes read, 2 written
    device_cast_bw = numel * 6 / times["cast float32 -> bfloat16 on the device"]
    predicted = {
        "h2d bfloat16, pinned": numel * 2 / pinned_bw,
        "d2h float32, pinned": numel * 4 / pinned_bw,
        "copy then cast (FSDP2's order)": numel * 4 / pinned_bw + numel * 6 / device_cast_bw,
        "cast on the host, then copy": numel * 6 / host_cast_bw + numel * 2 / pinned_bw,
    }
    print(f"\npinned h2d {pinned_bw / 1e9:.1f} GB/s; casts: host {host_cast_bw / 1e9:.1f} GB/s, "
          f"device {device_cast_bw / 1e9:.1f} GB/s (bytes read + written)")
    print("| move every shard once | ms | predicted ms |\n|---|---|---|")
    for name, seconds in times.items():
        guess = f"{predicted[name] * 1e3:.1f}" if name in predicted else ""
        print(f"| {name} | {seconds * 1e3:.1f} | {guess} |")
    steps = adamw_steps(units, device, max(1, args.repeats // 2))
    for name in steps:
        predicted[f"AdamW {name}"] = numel * 28 / (device_cast_bw if name.startswith("device") else host_cast_bw)
    print("\n| AdamW step | ms | predicted ms | x the device's | GB/s at 28 bytes a parameter |\n|---|---|---|---|---|")
    for name, seconds in steps.items():
        ratio = f"{seconds / steps['device fused']:.1f}" if "device fused" in steps else ""
        print(f"| {name} | {seconds * 1e3:.1f} | {predicted[f'AdamW {name}'] * 1e3:.1f} | {ratio} | "
              f"{numel * 28 / seconds / 1e9:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": card, "torch": torch.__version__, "host_threads": torch.get_num_threads(),
                       "params": numel, "units": args.units, "copies_s": times, "predicted_s": predicted,
                       "adamw_s": steps}, f, indent=1)


if __name__ == "__main__":
    main()
