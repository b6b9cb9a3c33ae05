"""The benchmark program (a program, not a test: no timing is asserted here): it runs on CPU (2 gloo ranks,
tiny model), its guards pass for the real systems and fail for a mutated library, its tables have both
bounds, and the plots are drawn from its JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TINY, Llama, LlamaConfig, save_matmuls

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from report import GRAD_RTOL, ROUTES, Result, check_gradients, check_losses, points, table  # noqa: E402

GUARDS_OK = (
    "loss guard (all systems vs fsdp2_eager, rtol 0.02; bounds at step 0 only): OK",
    "gradient guard (per-parameter gradient norms after step 0 vs fsdp2_eager, rtol 0.02; no_comm_bound, "
    "no_comm_bound_cudagraphs not compared: no averaging over ranks): OK",
)


class Run(NamedTuple):
    returncode: int
    stdout: str  # rank 0's


def _bench(tmp_path: "os.PathLike[str]", *args: str, mutations: dict[str, str] | None = None,
           torchrun: bool = False) -> tuple[Run, str]:
    """Run train_bench.py on 2 gloo ranks: its ``main`` on the pool's ranks (no new processes), or the program
    through torchrun; ``mutations``: system name -> a key of ``MUTATIONS``, a patch of the library in effect while
    that system is built and measured (to break it)."""
    out = os.path.join(tmp_path, "bench.json")
    argv = ["--model", "tests-untied", "--tokens", "32", "--steps", "3", "--warmup", "1", "--split-steps", "1",
            "--out", out, *args]
    if torchrun:  # --standalone: a free port for the rendezvous (the default, 29500, fails beside another run)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "benchmarks/train_bench.py", *argv]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        return Run(proc.returncode, proc.stdout + proc.stderr[-3000:]), out
    run_ranks(_bench_rank, 2, str(tmp_path), argv, mutations or {})
    with open(os.path.join(tmp_path, "stdout.txt")) as f:
        returncode, stdout = f.readline(), f.read()
    return Run(int(returncode), stdout), out


def _bench_rank(rank: int, world_size: int, tmp_path: str, argv: list[str], mutations: dict[str, str]) -> None:
    import train_bench

    measure = train_bench.run

    def mutated(spec: Any, *args: Any) -> Any:
        with MUTATIONS[mutations.get(spec.name, "")]():
            return measure(spec, *args)

    stdout = io.StringIO()
    with mock.patch.object(train_bench, "run", mutated), contextlib.redirect_stdout(stdout):
        try:
            train_bench.main(argv)
            returncode = 0
        except SystemExit as exit:
            returncode = exit.code if isinstance(exit.code, int) else 1
    if rank == 0:
        with open(os.path.join(tmp_path, "stdout.txt"), "w") as f:
            f.write(f"{returncode}\n{stdout.getvalue()}")


@pytest.mark.slow
def test_benchmark_runs_on_cpu_and_its_guards_name_only_the_broken_systems(tmp_path: "os.PathLike[str]") -> None:
    """Every system once, with aot_eager: the systems' results (the guards), the tables and the JSON; the CUDA-graph
    systems, Inductor's, run in the next test. Two systems are built from a broken library (``MUTATIONS``): one sums
    the gradients instead of averaging them, the other leaves a unit's gradient unreduced. The loss guard cannot tell
    (AdamW is invariant to a gradient scale); the gradient guard names each, and no other system (their
    unbroken library trains as the unsharded model in ``tests/test_default_path.py`` and
    ``test_write_gradients_in_place.py``)."""
    broken = {"fsdp_compile_packed": "sum_not_average", "fsdp_compile_no_overlap": "one_unit_not_reduced"}
    proc, out = _bench(tmp_path, "--compiler", "aot_eager", mutations=broken)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert GUARDS_OK[0] in proc.stdout, proc.stdout[-3000:]
    (guard,) = [line for line in proc.stdout.splitlines() if line.startswith("gradient guard ")]
    assert sorted(re.findall(r"run 0: (\w+) gradient of ", guard)) == sorted(broken) and guard.startswith(
        GUARDS_OK[1].removesuffix("OK")), guard[:3000]
    assert "| fsdp_compile |" in proc.stdout and "| vs tight bound | vs loose bound | vs fsdp2_eager |" in proc.stdout
    assert "32 tokens/GPU (batch 2 x seq 16), 1 run(s); no_comm_bound: tight " in proc.stdout
    with open(out) as f:
        data = json.load(f)
    assert data["meta"]["compiler"] == "aot_eager"
    systems = {r["system"] for r in data["results"]}
    assert systems == {"no_comm_bound", "fsdp2_eager", "fsdp2_compile", "simplefsdp", "fsdp_compile",
                       "fsdp_compile_no_overlap", "fsdp_compile_reduce_scatter", "fsdp_compile_unplanned",
                       "fsdp_compile_packed"}
    assert sorted(r["repeat"] for r in data["results"]) == [0] * len(systems)
    assert all(len(r["losses"]) == 3 and r["fwd_bwd_ms"] > 0 and r["opt_ms"] > 0 for r in data["results"])
    assert all((r["sharded_opt_ms"] is not None) == r["system"].startswith("no_comm_bound") for r in data["results"])
    # Every parameter's gradient norm, under its unsharded name, for every system.
    names = {frozenset(r["grad_norms"]) for r in data["results"]}
    assert len(names) == 1 and "layers.0.attention.wq.weight" in next(iter(names))
    # Each system is gone before the next one is measured (its memory would count in the next peak).
    assert all(r["extra"]["model_freed"] for r in data["results"]), [r["system"] for r in data["results"]]
    # Each planned system reports slabs of its own (made afresh: the previous system's are released).
    slabs = {r["system"]: r["slab_mib"] for r in data["results"]}
    assert all(slabs[s] > 0 for s in systems if s.startswith("fsdp_compile") and s != "fsdp_compile_unplanned"), slabs
    assert slabs["fsdp_compile_unplanned"] == slabs["fsdp2_eager"] == 0, slabs
    # Host time per rank (the table's is the slowest rank's), split into forward and backward, and the garbage
    # collections during the steps.
    for r in data["results"]:
        per_rank = {k: v for k, v in r["extra"].items() if k.endswith("_per_rank")}
        assert set(per_rank) == {"host_ms_per_rank", "host_forward_ms_per_rank", "host_backward_ms_per_rank",
                                 "gc_ms_per_step_per_rank", "gc_collections_per_step_per_rank"}, r["extra"]
        assert all(len(v) == 2 for v in per_rank.values()) and r["cpu_ms"] == max(per_rank["host_ms_per_rank"])
        assert all(f + b <= h for f, b, h in zip(per_rank["host_forward_ms_per_rank"],
                                                 per_rank["host_backward_ms_per_rank"], per_rank["host_ms_per_rank"]))
    assert "| peak GiB | slabs MiB | reserved GiB |" in proc.stdout
    # The host's peak resident memory per system, sampled while it was built and stepped.
    assert all(r["host_peak_gib"] >= max(r["extra"]["host_start_gib"], r["extra"]["host_rss_gib"]) > 0
               for r in data["results"])

    subprocess.run([sys.executable, "benchmarks/plot.py", out, "--out", str(tmp_path)], cwd=ROOT, check=True)
    assert os.path.exists(os.path.join(tmp_path, "step_time.png")) and os.path.exists(os.path.join(tmp_path, "memory.png"))


@pytest.mark.slow
def test_benchmark_with_inductor_passes_its_guards_and_compiles_again_from_the_fx_graph_cache(
    tmp_path: "os.PathLike[str]",
) -> None:
    """The CPU smoke run as a user runs it, through torchrun, with Inductor (the default), twice, its guards passing:
    fsdp_compile as it comes (shared bodies, which once trained wrong here: [Note: shared bodies]; the backend's
    switches under Inductor: tests/test_default_path.py) and a CUDA-graph system (on CPU Inductor runs it without
    graphs) agree with FSDP2, and each second run compiles from Inductor's FX graph cache (a pass whose cache key
    changed from one model to the next would compile every time: ~30 s a system on GPUs). (no_comm_bound_cudagraphs is
    no_comm_bound, run above, with this system's CUDA-graph step.)"""
    ours = ["fsdp_compile", "fsdp_compile_cudagraphs"]
    # The tests' model (2 blocks: Inductor compiles half of tiny's 4) and test_codegen.py's batch of 2 x 8 tokens.
    shapes = ("--model", "tests", "--tokens", "16", "--seq-cap", "8")
    proc, out = _bench(tmp_path, "--system", "fsdp2_eager", "fsdp_compile", "fsdp_compile:cudagraphs=1", "--repeats", "2",
                       *shapes, torchrun=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for line in GUARDS_OK:
        assert line in proc.stdout, proc.stdout[-3000:]
    with open(out) as f:
        data = json.load(f)
    assert data["meta"]["compiler"] == "inductor" and data["meta"]["model"] == "tests"
    assert sorted((r["system"], r["repeat"]) for r in data["results"]) == sorted(
        (s, repeat) for s in ["fsdp2_eager", *ours] for repeat in (0, 1))
    again = {r["system"]: r["extra"]["caches"] for r in data["results"] if r["repeat"] == 1}
    assert all(again[s].get("inductor.fxgraph_cache_hit", 0) > 0 and "inductor.fxgraph_cache_miss" not in again[s]
               for s in ours), again


@contextlib.contextmanager
def _sum_not_average() -> Iterator[None]:
    import fsdp_compile.runtime.ops as ops

    all_to_all_avg = ops.all_to_all_avg
    with mock.patch.object(ops, "reduce_scatter_avg", lambda t, w, g: ops._c10d.wait_tensor(
            ops._c10d.reduce_scatter_tensor(t.contiguous(), "sum", w, g))), \
            mock.patch.object(ops, "all_to_all_avg", lambda t, d, w, g: all_to_all_avg(t, d, w, g) * w):
        yield


@contextlib.contextmanager
def _one_unit_not_reduced() -> Iterator[None]:
    import fsdp_compile.runtime.ops as ops

    backward, done = ops._GatherUnit.backward, []

    def first_unreduced(ctx: Any, grad: torch.Tensor) -> Any:  # the first unit traced: this rank's part of its
        if done:  # local gradient, never averaged
            return backward(ctx, grad)
        done.append(True)
        return grad.chunk(ctx.how.world_size)[dist.get_rank()].to(ctx.shard_dtype), None, None

    with mock.patch.object(ops._GatherUnit, "backward", staticmethod(first_unreduced)):
        yield


MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "": contextlib.nullcontext, "sum_not_average": _sum_not_average, "one_unit_not_reduced": _one_unit_not_reduced,
}


def _result(system: str, norms: dict[str, float], losses: list[float] | None = None) -> Result:
    return Result(system=system, tokens_per_gpu=32, batch=2, seq=16, repeat=0, losses=losses or [5.0, 4.0],
                  step_ms=[10.0, 10.0], median_step_ms=10.0, grad_norms=norms)


def test_guards_compare_every_system_but_the_bounds_with_fsdp2() -> None:
    ref = {"a": 1.0, "b": 2.0}
    results = [
        _result("fsdp2_eager", ref),
        _result("no_comm_bound", {"a": 3.0, "b": 4.0}, losses=[5.0, 3.0]),  # no averaging: not compared
        _result("fsdp_compile", {"a": 1.0, "b": 2.0 * (1 + GRAD_RTOL / 2)}),
        _result("summed", {"a": 2.0, "b": 4.0}),
        _result("lost_one", {"a": 1.0}),
        _result("diverged", ref, losses=[5.0, 4.5]),
    ]
    assert check_gradients(results) == [
        "32 tokens/GPU, run 0: summed gradient of a differs from fsdp2_eager's by 1.00e+00 (norm after step 0)",
        "32 tokens/GPU, run 0: lost_one has gradients for other parameters than fsdp2_eager (missing ['b'], extra [])",
    ]
    assert check_losses(results) == ["32 tokens/GPU, run 0: diverged loss differs from fsdp2_eager by 1.25e-01"]
    assert results[1].extra["grad_check"] == "not compared: no averaging over ranks"


def test_without_fsdp2_eager_or_the_bound_fsdp2_compile_is_the_reference_and_the_bounds_say_na() -> None:
    """The 8.8B model: FSDP2 eager takes minutes a step and the bound does not fit one GPU."""
    results = [_result("fsdp2_compile", {"a": 1.0}), _result("fsdp_compile", {"a": 2.0})]
    assert check_gradients(results) == [
        "32 tokens/GPU, run 0: fsdp_compile gradient of a differs from fsdp2_compile's by 1.00e+00 (norm after step 0)"
    ]
    lines = list(table(results))
    assert "1 run(s); no bound in this run" in lines[0] and "| vs fsdp2_compile |" in lines[1]
    assert lines[3].startswith("| fsdp2_compile | 10.0 (10.0-10.0) | n/a | n/a | 1.00x |"), lines[3]


def test_manual_garbage_collection_runs_none_during_the_steps_and_is_counted() -> None:
    from harness import _Collections, _garbage_collection

    collections = _Collections()
    gc.callbacks.append(collections)
    try:
        with _garbage_collection("manual"):
            assert not gc.isenabled()
        assert gc.isenabled()
        before = list(collections.count)
        gc.collect(1)
    finally:
        gc.callbacks.remove(collections)
    assert collections.count[1] == before[1] + 1 and collections.ms > 0


def _compiled_block_backward_matmuls(cfg: LlamaConfig) -> tuple[int, int]:
    """(times the compiled block's forward ran, matmuls in its backward graph) for one training step of a
    one-block model, its block compiled as FSDP2 + compile does it."""
    from systems import _checkpoint_inside

    counts = {"forward_runs": 0, "backward_mms": 0}

    def forward(gm: torch.fx.GraphModule, _: object) -> object:
        def run(args: list[object]) -> object:
            counts["forward_runs"] += 1
            return gm(*args)
        run._boxed_call = True  # type: ignore[attr-defined]  # (AOTAutograd passes a list it may free)
        return run

    def backward(gm: torch.fx.GraphModule, _: object) -> object:
        counts["backward_mms"] = sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    model = Llama(cfg)
    _checkpoint_inside(model)
    backend = aot_autograd(fw_compiler=forward, bw_compiler=backward)
    model.layers.register_module("0", torch.compile(model.layers[0], backend=backend))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    model(tokens, tokens).backward()
    torch._dynamo.reset()
    return counts["forward_runs"], counts["backward_mms"]


def test_fsdp2_compile_checkpoints_inside_the_compiled_block_so_selective_checkpointing_stays_selective() -> None:
    """torchtitan's order (checkpoint-wrap, then compile the block). The model's own checkpoint around a
    compiled block re-ran the whole compiled forward in backward: selective checkpointing became full."""
    one_block = dataclasses.replace(LLAMA_TINY, n_layers=1)
    runs, plain = _compiled_block_backward_matmuls(one_block)
    assert runs == 1
    full = _compiled_block_backward_matmuls(dataclasses.replace(one_block, checkpoint_blocks=True))
    selective = _compiled_block_backward_matmuls(
        dataclasses.replace(one_block, checkpoint_blocks=True, checkpoint_policy=save_matmuls)
    )
    assert full[0] == selective[0] == 1  # the recomputation is inside the compiled backward
    assert selective[1] == plain < full[1], (plain, selective, full)  # the matmuls are saved, not recomputed


@pytest.mark.parametrize("args, error", [
    (["--trace-kernels-only"], "--trace-kernels-only needs --trace-dir"),
    (["--compiler", "aot_eager", "--system", "fsdp2_eager", "fsdp_compile:cudagraphs=1"],
     "['fsdp_compile_cudagraphs'] need --compiler inductor"),
], ids=["kernel-only-traces-need-a-folder", "aot_eager-refuses-the-cuda-graph-systems"])
def test_the_benchmark_refuses_options_that_cannot_work(capsys: pytest.CaptureFixture[str], args: list[str],
                                                        error: str) -> None:
    from train_bench import main

    with pytest.raises(SystemExit) as exit:  # before it joins a process group
        main(args)
    assert exit.value.code == 2 and error in capsys.readouterr().err


def test_each_table_says_how_auto_compares_with_the_fastest_fixed_route() -> None:
    results = [_result("fsdp2_eager", {}), _result("fsdp_compile", {}), _result("fsdp_compile_nccl", {}),
               _result("fsdp_compile_copy_engine", {}), _result("fsdp_compile_cudagraphs", {})]
    results[2].median_step_ms, results[3].median_step_ms = 8.0, 12.0
    lines = list(table(results))
    assert "auto: fsdp_compile 10.0 ms against the fastest fixed route, fsdp_compile_nccl 8.0 ms (1.25x)" in lines
    assert not any(line.startswith("auto with CUDA graphs") for line in lines)  # no fixed route with CUDA graphs


def test_a_table_with_copies_between_host_and_device_splits_the_step() -> None:
    """CPU offload's step: GPU compute, the copies and their exposed part, the optimizer, the rest, host peak."""
    results = [_result("fsdp2_eager", {}), _result("fsdp_compile", {})]
    assert not any("host-device copies" in line for line in table(results))  # no offloaded row: no split
    offloaded = results[1]
    offloaded.compute_ms, offloaded.host_copy_ms, offloaded.exposed_host_copy_ms = 5.0, 4.0, 1.5
    offloaded.opt_ms, offloaded.host_peak_gib = 2.0, 7.25
    offloaded.extra["host_start_gib"] = 1.0
    lines = list(table(results))
    assert "| fsdp_compile | 10.0 | 5.0 | 4.0 | 1.5 | 2.0 | 1.5 | 7.2 (1.0) |" in lines, lines
    assert not any(line.startswith("| fsdp2_eager | 10.0 | n/a |") for line in lines), lines  # no copies: no split


def test_the_benchmarks_fixed_routes_are_named_as_the_report_finds_them() -> None:
    from specs import FSDP_COMPILE_VARIANTS

    routes = {name: options for name, (options, shard) in FSDP_COMPILE_VARIANTS.items()
              if {"all_gather", "grad_reduce"} & set(options) and set(options) <= {"all_gather", "grad_reduce",
                                                                                      "cudagraphs"} and not shard}
    named = {f"fsdp_compile_{route}{graphs}" for route in ROUTES for graphs in ("", "_cudagraphs")}
    assert set(routes) <= named and {name.removesuffix("_cudagraphs") for name in routes} == {
        f"fsdp_compile_{route}" for route in ROUTES}
    assert all(options.get("cudagraphs", False) == name.endswith("_cudagraphs") for name, options in routes.items())


def test_tight_bound_is_the_local_forward_backward_plus_the_sharded_optimizer() -> None:
    bound = [_result("no_comm_bound", {}) for _ in range(3)]
    for r, (fwd_bwd, sharded) in zip(bound, [(40.0, 5.0), (42.0, 5.0), (50.0, 6.0)]):
        r.fwd_bwd_ms, r.sharded_opt_ms, r.repeat = fwd_bwd, sharded, bound.index(r)
    (point,) = points([*bound, _result("fsdp2_eager", {})])
    assert point.tight_bound_ms() == 47.0 and point.row("no_comm_bound").step_range == (10.0, 10.0)


def test_the_scaling_model_checks_every_default_path_result_file() -> None:
    """docs/scaling.md's tables come from ``benchmarks/scaling_model.py``, which reads every
    ``results/bench_[24]gpu_*.json``: a result file it cannot read (one without the bound) must not land."""
    proc = subprocess.run([sys.executable, "benchmarks/scaling_model.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CHECK: fsdp_compile" in proc.stdout and "| 0.95B run 22 | 2 | 4096 | 3 |" in proc.stdout


def test_trace_summary_says_where_exposed_communication_and_host_time_go(tmp_path: "os.PathLike[str]") -> None:
    """trace_summary.py on a made-up trace of one step: a matmul beside the first half of an all-gather, a gap,
    a reduce-scatter alone; a host op calling another, which launches a kernel."""
    import gzip

    from trace_summary import summarize

    def event(cat: str, name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    trace = [event("kernel", "nvjet_gemm", 0, 1000), event("kernel", "ncclDevKernel_AllGather_RING_LL", 500, 1000),
             event("kernel", "ncclDevKernel_ReduceScatter_Sum_f32", 3000, 400),
             event("cpu_op", "CompiledFunction", 0, 900), event("cpu_op", "aten::mm", 100, 300),
             event("cuda_runtime", "cudaLaunchKernel", 150, 50)]
    path = os.path.join(tmp_path, "x_rank0.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": trace}, f)
    lines = list(summarize(path, steps=1, top=3))
    assert lines[0] == "== x_rank0.json.gz: GPU span 3.40 ms/step, 3 kernels/step"
    heading = "   most exposed collectives (ms exposed / ms long, at ms from the first kernel):"
    exposed = lines[lines.index(heading) + 1:]
    assert exposed[0].split() == ["0.50", "/", "1.00", "at", "0.50", "ncclDevKernel_AllGather_RING_LL"], exposed
    assert exposed[1].split()[:5] == ["0.40", "/", "0.40", "at", "3.00"], exposed
    assert "longest gaps with no kernel (ms, at ms from the first kernel): 1.50 at 1.50" in exposed[2], exposed
    own = lines[lines.index("   host ops, self: less the ops they call (ms/step, count/step):") + 1:]
    assert [line.split() for line in own] == [
        ["0.60", "1", "cpu_op:CompiledFunction"], ["0.25", "1", "cpu_op:aten::mm"],
        ["0.05", "1", "cuda_runtime:cudaLaunchKernel"]], own
