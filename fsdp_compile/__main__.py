"""``python -m fsdp_compile explain DIR [--trace FILE]`` (also the console script ``fsdp-compile``): what the
compiler did, from the folder ``FSDP_COMPILE_DUMP=DIR`` wrote (:mod:`fsdp_compile.explain`); ``python -m
fsdp_compile estimate MODULE:FUNCTION --world-size N --tokens T``: one step's peak memory on rank 0 before launch
(:mod:`fsdp_compile.estimate`)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from fsdp_compile import explain
from fsdp_compile._pictures import read_trace
from fsdp_compile._step_time import CARDS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdp_compile", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("explain", help=explain.__doc__.split("\n\n")[0])
    command.add_argument("dump", help="the folder FSDP_COMPILE_DUMP (or backend(dump=...)) wrote")
    command.add_argument("--trace", help="a profiler's Chrome trace (torch.profiler's export_chrome_trace)")
    command = commands.add_parser("estimate", help="one training step's peak memory on rank 0, on fake tensors")
    command.add_argument("model", help="MODULE:FUNCTION, a function of no arguments that returns the model "
                         "(built on the meta device; its forward takes (inputs, targets) token ids, returns the loss); "
                         "or a Hugging Face causal LM's config.json (or its folder): the model built from it, the "
                         "cross-entropy of its logits the loss")
    command.add_argument("--units", required=True, help="the unit class's name (shard(units=[that class]))")
    command.add_argument("--world-size", type=int, required=True)
    command.add_argument("--tokens", type=int, required=True, help="tokens per rank and step")
    command.add_argument("--seq", type=int, help="the longest sequence (default: --tokens); more tokens go to the batch")
    command.add_argument("--param-dtype", choices=("float32", "bfloat16"), default="float32",
                         help="MixedPrecision(param_dtype=...), gradients reduced in float32")
    command.add_argument("--offload", action="store_true", help="CPU offload (shard(offload_policy=CPUOffloadPolicy()))")
    command.add_argument("--checkpoint", action="store_true",
                         help="recompute each unit in backward (torch's checkpoint_wrapper around each, as FSDP2 and "
                         "torchtitan users apply it)")
    command.add_argument("--card", choices=CARDS, help="also the step's time on this card (docs/scaling.md's model)")
    command.add_argument("--fwd-bwd-ms", type=float,
                         help="also the step's time, from this measured local forward+backward (no communication)")
    command.add_argument("--gpus-per-node", type=int, default=8)
    command.add_argument("--inter-node-gbps", type=float,
                         help="each GPU's network bandwidth across nodes, GB/s (needed past one node)")
    command.add_argument("--json", action="store_true", help="the estimate as JSON")
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return _estimate(args)
    try:
        dump = explain.load(args.dump)
    except FileNotFoundError as e:
        print(f"fsdp_compile explain: {e}", file=sys.stderr)
        return 2
    if not any(dump.graphs.values()):
        print(f"fsdp_compile explain: {args.dump} holds no compiled graph with FSDP units: was the model sharded "
              "with fsdp_compile.shard() and compiled with the fsdp_compile backend?", file=sys.stderr)
        return 2
    if args.trace and not os.path.exists(args.trace):
        print(f"fsdp_compile explain: no trace file {args.trace}", file=sys.stderr)
        return 2
    trace = read_trace(args.trace) if args.trace else None
    lines = [explain.report(dump, trace)]
    for name, svg in explain.pictures(dump, trace).items():
        (dump.root / name).write_text(svg)
        lines.append(f"wrote {dump.root / name}")
    try:
        print("\n".join(lines), flush=True)
    except BrokenPipeError:  # the reader stopped early (``| head``): the pictures are written all the same
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _estimate(args: argparse.Namespace) -> int:
    import torch

    from fsdp_compile import MixedPrecision
    from fsdp_compile.estimate import Hardware, estimate

    try:
        build = _builder(args.model)
    except (ImportError, AttributeError, ValueError, OSError) as e:
        print(f"fsdp_compile estimate: cannot load {args.model!r} ({e}): give MODULE:FUNCTION, importable from here, "
              "or a Hugging Face config.json (or the folder that holds it)", file=sys.stderr)
        return 2
    units = [type(m) for m in _modules(build) if type(m).__name__ == args.units][:1]
    if not units:
        print(f"fsdp_compile estimate: {args.model}'s model has no submodule of class {args.units!r}", file=sys.stderr)
        return 2
    seq = args.seq or args.tokens
    if args.tokens % seq:
        print(f"fsdp_compile estimate: --tokens {args.tokens} is not a multiple of --seq {seq}", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.param_dtype)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(args.tokens // seq, seq + 1, dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]

    from torch.distributed.fsdp import CPUOffloadPolicy

    options: dict[str, object] = {"mp": MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)}
    if args.offload:
        options["offload_policy"] = CPUOffloadPolicy()
    hardware = None
    if args.card or args.fwd_bwd_ms is not None:
        hardware = Hardware(card=args.card or "H100", fwd_bwd_ms=args.fwd_bwd_ms, gpus_per_node=args.gpus_per_node,
                            inter_node_gbps=args.inter_node_gbps)
    model = functools.partial(_checkpointed, build, units[0]) if args.checkpoint else build
    try:
        result = estimate(model, inputs, world_size=args.world_size, units=units, shard_options=options,
                          hardware=hardware)
    except ValueError as e:
        print(f"fsdp_compile estimate: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else result.table())
    return 0


def _builder(model: str) -> Callable[[], Any]:
    """What builds the model: ``MODULE:FUNCTION``'s function, or a Hugging Face causal LM from its config (a
    ``config.json`` or the folder that holds it) behind the ``(inputs, targets) -> loss`` interface."""
    import importlib

    if model.endswith(".json") or os.path.isdir(model):
        import json

        from transformers import AutoConfig, AutoModelForCausalLM

        from fsdp_compile._causal_lm import CausalLMLoss

        path = model if model.endswith(".json") else os.path.join(model, "config.json")
        with open(path) as f:
            config = AutoConfig.for_model(**{**json.load(f), "use_cache": False})
        return lambda: CausalLMLoss(AutoModelForCausalLM.from_config(config))
    module_name, colon, function = model.partition(":")
    if not colon:
        raise ValueError("no ':' between the module and the function")
    return getattr(importlib.import_module(module_name), function)  # type: ignore[no-any-return]


def _checkpointed(build: Callable[[], Any], unit: type) -> Any:
    """``build()``'s model with each ``unit`` module wrapped in torch's ``checkpoint_wrapper``."""
    from fsdp_compile._internals import checkpoint_wrapper

    model = build()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, unit):
                setattr(parent, name, checkpoint_wrapper(child))
    return model


def _modules(build: object) -> list[object]:
    """The modules of the model ``build()`` makes, built on the meta device (to find the unit class by name)."""
    import torch

    with torch.device("meta"):
        return list(build().modules())  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main())
