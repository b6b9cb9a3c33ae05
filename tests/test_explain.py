"""The dump folder (``FSDP_COMPILE_DUMP`` / ``backend(dump=...)``) and ``python -m fsdp_compile explain``: the
files of each rank and graph, what explain prints, its pictures, a profiler trace, bad input."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile import _dump, _pictures, explain
from fsdp_compile.__main__ import main as fsdp_compile_command
from fsdp_compile.testing.graphs import BF16_FP32_REDUCE, compile_and_capture
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama

SVG = "{http://www.w3.org/2000/svg}"
STAGE_FILES = [
    "dynamo_dynamo_output_graph.py", "dynamo_units.json", "dynamo_collectives_plan.json",
    "dynamo_insert_collectives_before.py", "dynamo_all_gather_route.json", "dynamo_grad_reduce_route.json",
    "dynamo_insert_collectives_after.py",
    "joint_reshard_after_forward_before.py",
    "joint_reshard_after_forward_plan.json", "joint_reshard_after_forward_after.py",
    *(f"{stage}_{name}" for stage in ("forward", "backward") for name in (
        "schedule_overlap_before.py", "schedule_overlap_plan.json", "schedule_overlap_after.py",
        "write_gradients_in_place_before.py", "write_gradients_in_place_plan.json",
        "write_gradients_in_place_after.py", "plan_memory_before.py", "plan_memory_plan.json", "plan_memory_after.py",
        "inductor_post_grad_graph.py", "inductor_output_code.py")),
]
"""The files of one compiled graph, in the order they are logged (each numbered NN_ in front)."""


def _compile_and_trace(root: Path, rank: int, backend: object, mp: fsdp_compile.MixedPrecision) -> None:
    """As ``rank`` of 2 (fake process group): compile a tiny sharded Llama (the dump on, as
    ``FSDP_COMPILE_DUMP`` turns it on), train a step, then trace one more step with the CPU profiler into
    ``root/trace_rank<rank>.json``."""
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block], mp=mp)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 8))
        compiled(tokens, tokens).backward()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            compiled(tokens, tokens).backward()
        prof.export_chrome_trace(str(root / f"trace_rank{rank}.json"))
    finally:
        dist.destroy_process_group()


def _dumped(
    root: Path,
    backend: object,
    ranks: tuple[int, ...] = (0, 1),
    mp: fsdp_compile.MixedPrecision = fsdp_compile.MixedPrecision(),
) -> Path:
    _dump.enable(root)
    try:
        for rank in ranks:
            _compile_and_trace(root, rank, backend, mp)
    finally:
        _dump.disable(root)
    return root


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole step as one graph: every file and line this file checks (the shared bodies' own: below). bf16
    parameters, fp32 reduction: tests/test_codegen.py's ``whole_code`` graphs, whose kernels Inductor has built."""
    return _dumped(tmp_path_factory.mktemp("dump"), fsdp_compile.backend(regions=False), mp=BF16_FP32_REDUCE)


@pytest.mark.slow
def test_explain_says_which_units_share_a_body(tmp_path: Path) -> None:
    """The default (shared bodies): explain names the body and the units that run it, and counts the gradients its
    backward writes in place (once, for every unit that runs it). aot_eager: the bodies and the plans are the
    passes' (Inductor's files: the whole-step dump above); rank 0's alone (the ranks: that dump)."""
    root = _dumped(tmp_path, fsdp_compile.backend(compiler="aot_eager"), ranks=(0,))
    out = _explain(str(root)).stdout
    # The joint graph's pass that takes what the bodies return of their inputs from the calls' operands ran and said
    # what it took: the forward body returns its activation input (the backward reads it).
    (plan,) = root.glob("rank0/graph_*/*_joint_unalias_body_outputs_plan.json")
    assert any(a["body"].startswith("partitioned_fw") for a in json.loads(plan.read_text())["aliases"]), plan.read_text()
    assert re.search(r"shared body \w+: compiled once for forward and once for backward, run by 2 units "
                     r"\(layers\.0, layers\.1\)", out), out
    assert re.search(r"gradients written in place: 1 of 2 units \(\d+ pieces, 7 written by their matmul\); "
                     r"packed by a copy: <root>", out), out


def _explain(*args: str) -> subprocess.CompletedProcess:
    """``python -m fsdp_compile explain ARGS``, in this process (the command line itself: the piped test below)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = fsdp_compile_command(["explain", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_the_dump_folder_holds_every_pass_and_plan_for_each_rank_and_graph(dump: Path) -> None:
    for rank in (0, 1):
        (graph,) = [d for d in (dump / f"rank{rank}").iterdir() if d.is_dir()]
        assert re.fullmatch(r"graph_\d+_0", graph.name)
        names = sorted(p.name for p in graph.iterdir())
        assert [re.sub(r"^\d+_", "", n) for n in names] == STAGE_FILES, names  # numbered in the order logged
        after = (graph / names[STAGE_FILES.index("dynamo_insert_collectives_after.py")]).read_text()
        assert "# The unit of each collective:" in after and "layers.0" in after
        units = json.loads((graph / names[1]).read_text())
        assert [u["fqn"] for u in units] == ["", "layers.0", "layers.1"]
        # The memory plans Inductor's post-grad graphs logged: forward's, then the step's (forward and backward).
        plans = [json.loads((graph / names[STAGE_FILES.index(f"{stage}_plan_memory_plan.json")]).read_text())
                 for stage in ("forward", "backward")]
        assert [plan["graphs"] for plan in plans] == [["forward"], ["forward", "backward"]]
        step = plans[1]
        assert len(step["buffers"]) == 3 * len(units)  # each unit gathered in forward, again in backward, reduced
        assert step["lower_bound_bytes"] <= step["pool_bytes"] <= min(step["maxpool_bytes"], step["per_collective_bytes"])
        events = [json.loads(line) for line in (dump / f"rank{rank}" / "events.jsonl").read_text().splitlines()]
        assert any(e["event"] == "compilation_metrics" and e["graph"] == graph.name for e in events)


@pytest.mark.slow
def test_explain_prints_the_units_the_collectives_the_memory_plan_and_draws_the_step(dump: Path) -> None:
    proc = _explain(str(dump))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ranks [0, 1]; rank 0 shown" in out
    assert ("| layers.0 | 9 | 8,768 | 4,384 | 0 | torch.bfloat16 | torch.bfloat16, 8,768 B a rank | torch.float32 | "
            "exchange | True |") in out
    assert "all-gather route chosen by 'auto': nccl (all-gathers on cpu: copy engines need CUDA tensors)" in out
    assert ("gradient exchange route chosen by 'auto': nccl (gradient exchanges on cpu: copy engines need CUDA "
            "tensors)") in out
    assert "forward: 3 all-gathers (prefetch 1)" in out
    assert "backward: 3 all-gathers (prefetch 1), 3 gradient reductions (at most 2 in flight)" in out
    assert re.search(r"all-gather +2 +layers\.0 +all_gather_into_tensor_1 +issued 1 unit\(s\) ahead", out), out
    assert re.search(r"reduction +1 +layers\.1 ", out), out
    assert re.search(r"gradients written in place: 2 of 3 units \(\d+ pieces, 14 written by their matmul\); "
                     r"packed by a copy: <root>", out), out
    assert re.search(r"memory plan over forward\+backward: \d+ slots, pool .*one buffer per collective .*max-pool", out)
    assert re.search(r"\[\d+/0\] forward: \d+ nodes, 0 graph breaks", out)
    assert "the first all-gather (<root>) has no compute before it" in out
    assert "ranks compiled different graphs" not in out
    timeline = ET.parse(dump / "timeline.svg").getroot()
    (graph,) = (dump / "rank0").glob("graph_*")
    assert timeline.find(f"{SVG}text").text.startswith(f"{graph.name}: the planned step")
    titles = [t.text for t in timeline.iter(f"{SVG}title")]
    compute = [t for t in titles if re.fullmatch(r"(forward|backward) (<root>|layers\.\d)", t)]
    assert timeline.tag == f"{SVG}svg" and len(compute) == 6, titles
    assert sum("all-gather" in t for t in titles) == 6 and sum(t.startswith("reduction") for t in titles) == 3
    memory = ET.parse(dump / "memory.svg").getroot()
    assert memory.tag == f"{SVG}svg" and sum(1 for _ in memory.iter(f"{SVG}title")) == 9  # every buffer planned


@pytest.mark.slow
def test_explain_overlays_a_cpu_profiler_trace(dump: Path) -> None:
    proc = _explain(str(dump), "--trace", str(dump / "trace_rank0.json"))
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"trace .*: (\d+) collectives among \d+ host ops", proc.stdout)
    assert match and int(match[1]) > 0, proc.stdout
    assert re.search(r"\| layers\.0 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|", proc.stdout), proc.stdout
    assert "measured (" in (dump / "timeline.svg").read_text()


def test_a_gpu_trace_counts_nccl_kernels_and_peer_copies_not_kernels_named_after_collectives(tmp_path: Path) -> None:
    def event(name: str, cat: str, start: float, end: float) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start}

    events = [
        event("triton_poi_fused__to_copy_all_gather_into_tensor_0", "kernel", 0, 10),  # the cast: compute
        event("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", 5, 30),
        event("sm90_xmma_gemm_bf16bf16_bf16f32", "kernel", 12, 20),
        event("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 40, 50),  # one copy-engine all-gather: two peers
        event("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 45, 55),
        event("triton_red_fused_all_to_all_single_1", "kernel", 50, 52),
        event("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "kernel", 60, 70),
        event("_c10d_functional::wait_tensor", "cpu_op", 0, 100),
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace = _pictures.read_trace(str(path))
    assert trace.device and [(s, t) for _, s, t in trace.comm] == [(5, 30), (40, 55), (60, 70)]
    assert trace.compute == [(0, 10), (12, 20), (50, 52)]
    schedules = {"forward": {"gathers": ["ag0", "ag1"], "units": {"ag0": "layers.0", "ag1": "layers.1"}},
                 "backward": {"grad_reductions": ["a2a"], "units": {"a2a": "layers.0"}}}
    lines = _pictures.exposed_by_unit(trace, schedules)
    assert lines[0].endswith("3 collectives among 7 GPU kernels and copies"), lines
    # layers.0: all-gather 25 us, 12 of them with no compute beside; its reduction 10 us, all exposed
    assert "| layers.0 | 0.025 | 0.012 | 0.010 | 0.010 |" in lines
    assert "| layers.1 | 0.015 | 0.013 | 0.000 | 0.000 |" in lines
    assert not any("not whole steps" in line for line in lines)
    schedules["forward"]["gathers"].append("ag2")  # a plan of 3 all-gathers against the trace's 2
    assert any("not whole steps" in line for line in _pictures.exposed_by_unit(trace, schedules))


@pytest.mark.slow
def test_explain_piped_into_a_reader_that_stops_early_still_writes_the_pictures(dump: Path, tmp_path: Path) -> None:
    copy = tmp_path / "dump"
    shutil.copytree(dump, copy)
    for svg in copy.glob("*.svg"):
        svg.unlink()
    proc = subprocess.Popen([sys.executable, "-m", "fsdp_compile", "explain", str(copy)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does
    assert proc.wait(timeout=300) == 0 and proc.stderr.read() == b""
    assert sorted(p.name for p in copy.glob("*.svg")) == ["memory.svg", "timeline.svg"]


@pytest.mark.slow
def test_ranks_whose_graphs_differ_are_flagged(dump: Path, tmp_path: Path) -> None:
    copy = tmp_path / "dump"
    shutil.copytree(dump, copy)
    (plan,) = (copy / "rank1").glob("graph_*/*_forward_schedule_overlap_plan.json")
    plan.write_text(plan.read_text().replace('"prefetch": 1', '"prefetch": 2'))
    (warning,) = [w for w in explain.warnings(explain.load(copy)) if "different graphs" in w]
    assert "ranks [0]" in warning and "ranks [1]" in warning


@pytest.mark.slow
def test_explain_refuses_a_folder_without_a_dump_and_a_missing_trace(dump: Path, tmp_path: Path) -> None:
    proc = _explain(str(tmp_path))
    assert proc.returncode == 2 and "holds no dump" in proc.stderr and "FSDP_COMPILE_DUMP" in proc.stderr
    proc = _explain(str(dump), "--trace", str(tmp_path / "missing.json"))
    assert proc.returncode == 2 and "no trace file" in proc.stderr


def test_the_backend_option_dumps_that_backends_compiles(tmp_path: Path) -> None:
    compile_and_capture(backend_options={"compiler": "aot_eager", "dump": str(tmp_path), "regions": False})
    (graph,) = (tmp_path / "rank0").iterdir()
    names = [re.sub(r"^\d+_", "", p.name) for p in sorted(graph.iterdir())]
    assert names == [n for n in STAGE_FILES if "dynamo_output_graph" not in n and "inductor" not in n], names
    assert not _dump.active()


def test_a_second_run_into_the_same_folder_replaces_the_first_runs_files(tmp_path: Path, monkeypatch) -> None:
    sink, graph = _dump._Sink(tmp_path), {"frame_id": 0, "frame_compile_id": 0}

    def run(artifacts: list[str]) -> None:  # one process's compile of graph [0/0]
        monkeypatch.setattr(_dump, "_numbers", {})
        monkeypatch.setattr(_dump, "_ranks", set())
        for name in artifacts:
            sink._write({**graph, "artifact": {"name": f"fsdp_compile_{name}", "encoding": "json"}}, "{}")
        sink._write({**graph, "recompile_reasons": {}}, "a reason")

    run(["units", "collectives_plan", "memory_plan"])
    (tmp_path / "rank0" / "graph_5_1").mkdir()  # a graph only the first run compiled (a recompile)
    run(["units"])
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["events.jsonl", "graph_0_0"]
    files = sorted(p.name for p in (tmp_path / "rank0" / "graph_0_0").iterdir())
    assert len(files) == 1 and re.fullmatch(r"01_\w+_units\.json", files[0]), files
    assert len((tmp_path / "rank0" / "events.jsonl").read_text().splitlines()) == 1


def test_a_bad_dump_option_is_refused() -> None:
    with pytest.raises(TypeError, match="dump must be a folder"):
        fsdp_compile.backend(dump=3)


def test_the_environment_variable_dumps_every_compile_until_disabled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not _dump.active()  # backend(dump=...) dumps its own compiles only: the fixture's left nothing open
    monkeypatch.setenv(_dump.ENV, str(tmp_path))
    _dump.from_environment()
    try:
        assert _dump.active()
        with _dump.dumping(tmp_path):  # a compile with backend(dump=) to the same folder leaves it open
            pass
        assert _dump.active()
    finally:
        _dump.disable(tmp_path)
    assert not _dump.active()
