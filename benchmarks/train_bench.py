"""Compiled-training benchmark: fsdp_compile against its peers, side by side in ONE run.

    torchrun --nproc_per_node 2 benchmarks/train_bench.py                       # 0.95B, sweep 1024 and 4096 tokens/GPU
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens 2048 8192    # more points of the sweep
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --model tiny-untied --tokens 16 32   # CPU smoke test (gloo)
    torchrun --nproc_per_node 2 benchmarks/train_bench.py --tokens 1024 \\
        --system fsdp2_eager no_comm_bound:cudagraphs=1 fsdp_compile:all_gather=copy_engine,cudagraphs=1
    torchrun --nproc_per_node 4 benchmarks/train_bench.py --model 8.8b --tokens 8192 --seq-cap 8192 \\
        --checkpoint selective --system fsdp2_compile fsdp_compile

The systems (``--system SPEC``, SPEC = ``family[:key=value,...]``): ``specs.py`` (``--help`` lists the families,
keys and the names of the systems measured so far), their set-up ``systems.py``, the measurement and its JSON
``harness.py``. Per point of the sweep (tokens per GPU = batch x seq; seq up to --seq-cap), each system runs
--repeats times, interleaved (``report.py`` aggregates: medians over the runs, and the range of the step time)
and the table compares each with the **tight bound** (the headline), the loose bound (``no_comm_bound``'s whole
step) and FSDP2. ``--stall-dump-s S`` prints every thread's Python stack to stderr when one system's run takes
longer than S seconds (a hang shows where each rank waits; the run goes on).

Two guards, run after every sweep, each failing the run (exit 1): the losses of every step agree with
FSDP2 eager's, and every parameter's gradient norm after step 0 agrees with FSDP2's (``report.py``: the
loss alone cannot see a missing average). Writes JSON (``--out``, every run kept); ``benchmarks/plot.py``
turns it into plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os
from dataclasses import asdict

import torch
import torch.distributed as dist

from fsdp_compile.testing.dist import gloo_one_worker_thread
from fsdp_compile.testing.llama import LLAMA_0_95B, LLAMA_8B, LLAMA_TESTS, LLAMA_TINY, LlamaConfig, save_matmuls

from harness import Settings, meta, run, write  # benchmarks/
from report import BOUNDS, LOSS_RTOL, REFERENCES, Result, check_gradients, check_losses, grad_rtol, reference, table
from specs import Spec, default_specs, help_text, parse_specs

MODELS = {
    "0.95b": LLAMA_0_95B, "8.8b": LLAMA_8B, "tiny": LLAMA_TINY, "tests": LLAMA_TESTS,
    "5.9b": dataclasses.replace(LLAMA_8B, n_layers=20),  # 94 GB of fp32 weights, gradients and AdamW: offload's
    "tiny-untied": dataclasses.replace(LLAMA_TINY, tie_embeddings=False),
    "tests-untied": dataclasses.replace(LLAMA_TESTS, tie_embeddings=False),  # the test suite's runs of every system
    "8.8b-slice": dataclasses.replace(LLAMA_8B, n_layers=4),  # the 8.8B's dims (4096, ffn 14336) in 4 blocks
    "80x1024": LlamaConfig(vocab_size=32000, dim=1024, n_layers=80, n_heads=8, ffn_dim=2816, max_seq_len=2048,
                           tie_embeddings=False),  # deep and narrow: 80 blocks of 12.6M parameters (1.08B in all)
}
CHECKPOINTING = {
    "none": {},
    "full": {"checkpoint_blocks": True},
    "selective": {"checkpoint_blocks": True, "checkpoint_policy": save_matmuls},
}
"""``--checkpoint``: activation checkpointing of every block, the same for every system (the model does it)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="fsdp_compile vs FSDP2, SimpleFSDP-style and the bounds, in one run.",
                                     epilog=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="0.95b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per GPU (sweep points)")
    parser.add_argument("--seq-cap", type=int, default=2048, help="longest sequence; more tokens go to the batch")
    parser.add_argument("--checkpoint", choices=sorted(CHECKPOINTING), default="none",
                        help="activation checkpointing of every block (selective: save the matmuls)")
    parser.add_argument("--system", nargs="+", action="extend", metavar="SPEC",
                        help="the systems, in the order they run: one or more specs after each --system (the "
                             "option repeatable, a word may hold several specs separated by spaces); SPEC = "
                             "family[:key=value,...], below. Default: the systems listed below but keep_gathered "
                             "(on CPU: and the GPU-only ones; under 4 ranks: and HSDP; with --compiler aot_eager: "
                             "and CUDA graphs)")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="the compiler of every compiled system (aot_eager: the same graphs run by eager kernels, "
                             "a quick check of the systems' results; leaves out the CUDA-graph systems)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of every system per point, interleaved "
                                                               "(headlines: 3)")
    parser.add_argument("--gc", choices=("auto", "manual"), default="auto",
                        help="Python's garbage collection during the steps: automatic, or none (torchtitan's gc_freq)")
    parser.add_argument("--float8", choices=("none", "tensorwise"), default="none",
                        help="torchao float8 training (tensorwise) of every block's linear layers, in every system "
                        "(emulated off the GPU; needs torchao); the systems' float8_gather=1 gathers them as float8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="forward+backward passes per optimizer step (gradient accumulation); --tokens is each one's")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of timing and peak memory")
    parser.add_argument("--split-steps", type=int, default=3,
                        help="extra steps with forward+backward and the optimizer timed apart (the tight bound)")
    parser.add_argument("--profile-steps", type=int, default=2, help="extra steps traced for exposed communication")
    parser.add_argument("--out", help="write the JSON results to this file")
    parser.add_argument("--stall-dump-s", type=float, default=0,
                        help="print every thread's Python stack (stderr) when one system's run takes longer (0: off)")
    parser.add_argument("--trace-dir", help="keep each system's profiler trace (CPU and CUDA) here, per rank")
    parser.add_argument("--trace-kernels-only", action="store_true",
                        help="with --trace-dir: trace the GPU's activity only (the host runs at its own speed)")
    return parser


def _specs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Spec] | None:
    """--system's specs, checked against the other options (None: the default set, chosen once the ranks are
    known); a mistake is the parser's error (exit 2), before any process group is joined."""
    if args.trace_kernels_only and not args.trace_dir:
        parser.error("--trace-kernels-only needs --trace-dir (where to keep the traces)")
    if args.split_steps < 1 or args.repeats < 1 or not 0 < args.warmup < args.steps:
        parser.error("--split-steps and --repeats must be >= 1, and 0 < --warmup < --steps")
    if not args.system:
        return None
    try:
        specs = parse_specs(args.system)
    except ValueError as error:
        parser.error(f"--system: {error}")
    names = [spec.name for spec in specs]
    if not set(REFERENCES) & set(names):
        parser.error(f"--system must include one of {', '.join(REFERENCES)} (the guards' reference)")
    graphs = sorted(spec.name for spec in specs if spec.cudagraphs)
    if args.compiler != "inductor" and graphs:
        parser.error(f"{graphs} need --compiler inductor (CUDA graphs are Inductor's)")
    return specs


def _brief(result: Result) -> str:
    """One run's line of progress (rank 0's output)."""
    brief = {k: round(v, 2) if isinstance(v, float) else v for k, v in asdict(result).items()
             if k not in ("system", "losses", "step_ms", "extra", "grad_norms")}
    return (f"# {result.system} {result.batch}x{result.seq} run {result.repeat}: {result.median_step_ms:.1f} ms, "
            f"losses {[round(x, 4) for x in result.losses]}, {brief}, {result.extra}")


def _points(tokens: list[int], cfg: LlamaConfig, seq_cap: int) -> list[tuple[int, int]]:
    """tokens per GPU -> (batch, seq): seq as long as the model allows (up to ``seq_cap``), batch for the rest."""
    seq_cap = min(cfg.max_seq_len, seq_cap)
    return [(max(1, t // seq_cap), min(t, seq_cap)) for t in tokens]


def main(argv: list[str] | None = None) -> None:
    """The program (``argv``: its arguments, default ``sys.argv``); its own process group, or, called in ranks whose
    default group exists (the tests'), that one."""
    parser = _parser()
    args = parser.parse_args(argv)
    specs = _specs(parser, args)
    settings = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
    cfg = dataclasses.replace(MODELS[args.model], **CHECKPOINTING[args.checkpoint])
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    own_group = not dist.is_initialized()  # else: called in a job's ranks (the tests'), in their default group
    if own_group:
        if not use_cuda:
            gloo_one_worker_thread()  # torch's gloo races with two worker threads (heap corruption)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    hsdp_ok = dist.get_world_size() >= 4 and dist.get_world_size() % 2 == 0
    if specs and not hsdp_ok and any(spec.hsdp for spec in specs):
        parser.error(f"{sorted(s.name for s in specs if s.hsdp)} need an even number of ranks, at least 4")
    specs = specs or default_specs(cuda=use_cuda, hsdp=hsdp_ok, cuda_graphs=args.compiler == "inductor")
    results: list[Result] = []
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, cache_size_limit=64):
        for batch, seq in _points(args.tokens, cfg, args.seq_cap):
            for repeat in range(args.repeats):
                for spec in specs:
                    if args.stall_dump_s:
                        faulthandler.dump_traceback_later(args.stall_dump_s)
                    results.append(run(spec, cfg, batch, seq, repeat, settings, device))
                    faulthandler.cancel_dump_traceback_later()
                    if dist.get_rank() == 0:
                        write(args.out, meta(settings, specs, device), results)  # kept if a later run dies
                        print(_brief(results[-1]), flush=True)
    loss_problems, grad_problems = check_losses(results), check_gradients(results, grad_rtol(args.float8))
    if dist.get_rank() == 0:
        run_meta = meta(settings, specs, device)
        print(f"\n## {run_meta}")
        for line in table(results):
            print(line)
        ref = reference(r.system for r in results)
        print(f"\nloss guard (all systems vs {ref}, rtol {LOSS_RTOL}; bounds at step 0 only): "
              + ("; ".join(loss_problems) or "OK"))
        print(f"gradient guard (per-parameter gradient norms after step 0 vs {ref}, rtol {grad_rtol(args.float8)}; "
              f"{', '.join(BOUNDS)} not compared: no averaging over ranks): " + ("; ".join(grad_problems) or "OK"))
        write(args.out, run_meta, results)
    if own_group:
        dist.destroy_process_group()
    if loss_problems or grad_problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
