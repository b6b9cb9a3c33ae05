"""Layer 2: what Inductor generates (fake process group, one process): one all-gather per unit in the
forward code, one all-gather and one gradient exchange per unit in backward (bf16 gradients, fp32 sums:
an all-to-all), the overlap schedule kept (each prefetched all-gather is issued, then the previous unit's
matmuls run, then it is waited for), and the memory plan applied (every all-gather writes into a slot, the
matmuls read the parameters as views of the slots)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import re
from collections.abc import Iterable

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
import torch._inductor.cudagraph_trees
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.graphs import BF16_FP32_REDUCE, compile_and_capture, slotted_exchanges
from fsdp_compile.testing.llama import LLAMA_TESTS, LLAMA_TINY, Block, Llama, LlamaConfig

N_UNITS = LLAMA_TINY.n_layers + 1  # the fixture's model: slots reused across 5 units
N_TESTS_UNITS = LLAMA_TESTS.n_layers + 1  # the variants' (2 blocks)
AG = "torch.ops._c10d_functional.all_gather_into_tensor.default("
AG_OUT = "extern_kernels.fsdp_compile_all_gather_into_slot("  # the op's function, called directly
SLOT = "torch.ops.fsdp_compile.slot.default("
A2A = "torch.ops._c10d_functional.all_to_all_single.default("
EXCHANGE = "extern_kernels.fsdp_compile_exchange_into_slot("


# Settings that leave the CPU kernels as they are (Inductor's cache has them): max-autotune's GEMM tuning would build
# kernels of its own (mode="max-autotune" keeps the numbers: tests/test_default_path.py). Each carries a
# test's compile; CUDA graphs are off by default.
MODE = ({"mode": "reduce-overhead"}, {"triton.cudagraphs": True})
OPTIONS = ({"options": {"epilogue_fusion": False, "coordinate_descent_tuning": True}},
           {"epilogue_fusion": False, "coordinate_descent_tuning": True, "triton.cudagraphs": False})


def _settings_seen(monkeypatch: pytest.MonkeyPatch, names: Iterable[str]) -> list[tuple[dict, bool]]:
    """``torch.compile(..., backend="fsdp_compile", mode=...)`` (or ``options=``) must reach Inductor beside the
    passes: for each graph Inductor compiles from now on, (the settings ``names`` had, whether fsdp_compile's
    post-grad pass was set)."""
    from torch._inductor import config as inductor_config

    from fsdp_compile import _internals

    seen: list[tuple[dict, bool]] = []
    real = _internals.compile_fx_inner

    def spy(gm: torch.fx.GraphModule, example_inputs: object, **kwargs: object) -> object:
        settings = {name: functools.reduce(getattr, name.split("."), inductor_config) for name in names}
        seen.append((settings, inductor_config.post_grad_custom_post_pass is not None))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(_internals, "compile_fx_inner", spy)
    return seen


def _code(
    backend: object, checkpoint: bool = False, cfg: LlamaConfig = LLAMA_TINY, **compile_options: object
) -> list[str]:
    """Inductor's code for the forward and backward graphs of a tiny Llama (bf16 params, fp32 reduce; each block
    under activation checkpointing if ``checkpoint``); ``compile_options`` go to ``torch.compile`` (``mode=``,
    ``options=``). ``cfg``: ``LLAMA_TINY`` (4 blocks, the fixture's), or ``LLAMA_TESTS`` (2 blocks: half the
    compile) where a claim holds for any number of units."""
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = fsdp_compile.shard(
            Llama(dataclasses.replace(cfg, checkpoint_blocks=checkpoint)),
            units=[Block],
            mp=BF16_FP32_REDUCE,
        )
        compiled = torch.compile(model, backend=backend, fullgraph=True, **compile_options)  # type: ignore[call-overload]
        tokens = torch.randint(0, cfg.vocab_size, (2, 8))
        _, code = run_and_get_code(lambda: compiled(tokens, tokens).backward())
    finally:
        dist.destroy_process_group()
    return code


@pytest.fixture(scope="module")
def code() -> list[str]:
    return _code("fsdp_compile")  # by name: the registered backend, default options (overlap on, shared bodies)


@pytest.fixture(scope="module")
def whole_code() -> list[str]:
    """The whole step as one graph (``regions=False``): every block's code written out in the step's code (the graphs
    of tests/test_explain.py's dump, which reuses these kernels)."""
    return _code(fsdp_compile.backend(regions=False), cfg=LLAMA_TESTS)


@pytest.mark.slow
def test_the_blocks_share_one_body_each_way_called_once_per_block(code: list[str]) -> None:
    """Shared bodies: the step's code calls one forward body and one backward body, once per block, each
    generated once; every block's all-gather stays in the step's code, into a slot passed to the body."""
    for graph in code:
        calls = BODY_CALL.findall(graph)
        assert len(calls) == LLAMA_TINY.n_layers and len(set(calls)) == 1, calls
        assert len(_gathers(graph)) == N_UNITS
        assert len(re.findall(rf"^\s*# subgraph: {calls[0]}$", graph, re.M)) == LLAMA_TINY.n_layers
        assert not _inputs_reused(graph, calls[0]), _inputs_reused(graph, calls[0])


def _inputs_reused(code: str, body: str) -> list[str]:
    """The lines of ``body``'s code that reuse the storage of one of its inputs for a buffer of its own: the caller
    still holds its operands (a backward body lowered with the step's donated inputs did, [Note: shared bodies])."""
    inputs = re.search(rf"def {body}\(args\):\n\s*(.*) = args$", code, re.M)
    assert inputs, f"no body {body} in the code"
    names = [name.strip() for name in inputs.group(1).split(",") if name.strip()]
    return [line.strip() for line in code.splitlines() if any(f"del {name}  # reuse" in line for name in names)]


@pytest.mark.slow
def test_the_same_model_compiled_again_comes_from_inductors_fx_graph_cache(code: list[str]) -> None:
    """The passes' cache keys do not change from one model to the next (or every model would compile afresh:
    ~30 s on GPUs), so the fixture's graphs are loaded from Inductor's FX graph cache."""
    counters.clear()
    _code("fsdp_compile")
    assert counters["inductor"]["fxgraph_cache_hit"] > 0, dict(counters["inductor"])
    assert "fxgraph_cache_miss" not in counters["inductor"], dict(counters["inductor"])


@pytest.mark.slow
def test_captured_graphs_are_the_passes_output_even_when_inductor_has_them_cached(code: list[str]) -> None:
    """The same graph compiled again comes from Inductor's FX graph cache (the fixture's compile put it there),
    which runs no pass: inside ``capture_graphs`` it is compiled again (CI once saw the first compile's graph
    unplanned)."""
    counters.clear()
    forward = compile_and_capture(mp=BF16_FP32_REDUCE, cfg=LLAMA_TINY)["forward"]
    nodes = [n.target for n in forward.graph.nodes]
    assert nodes.count(torch.ops.fsdp_compile.all_gather_into_slot.default) == N_UNITS
    assert torch.ops._c10d_functional.all_gather_into_tensor.default not in nodes
    assert "fxgraph_cache_hit" not in counters["inductor"], dict(counters["inductor"])


def _gathers(code: str) -> list[tuple[str, str]]:
    """Each all-gather's line, in launch order, and the buffer its wait names: its result, or the slot it
    writes into (``out=``)."""
    found = []
    for line in code.splitlines():
        if AG in line or AG_OUT in line:
            written = re.search(r"out=(?:reinterpret_tensor\()?(buf\d+)\b", line) or re.match(r"\s*(buf\d+) = ", line)
            assert written, line
            found.append((line.strip(), written.group(1)))
    return found


BODY_CALL = re.compile(r"^\s*buf\d+ = (partitioned_[fb]w_subgraph_\w+)\(", re.M)
"""A call of a shared body (its code generated once, as a function of the graph's module)."""


def _overlapped_gathers(code: str) -> int:
    """All-gathers (after the first) with a matmul, or a call of a shared body, between their launch and their wait
    (the first wait on the buffer after the launch: a slot is waited for once per occupant)."""
    overlapped = 0
    for line, buf in _gathers(code)[1:]:
        launch = code.index(line)
        wait = re.compile(rf"wait_tensor\.default\((reinterpret_tensor\()?{buf}\b").search(code, launch)
        assert wait, line
        between = code[launch : wait.start()]
        overlapped += "extern_kernels.mm(" in between or bool(BODY_CALL.search(between))
    return overlapped


@pytest.mark.slow
def test_collective_counts(code: list[str]) -> None:
    forward, backward = code
    assert len(_gathers(forward)) == len(_gathers(backward)) == N_UNITS
    FileCheck().check_not("all_to_all_single").run(forward)
    FileCheck().check_count(A2A, N_UNITS, exactly=True).check_not("reduce_scatter_tensor").run(backward)


@pytest.mark.slow
def test_every_all_gather_writes_into_a_slot_and_the_matmuls_read_the_slots(code: list[str]) -> None:
    """The memory plan applied: no all-gather allocates its output; each writes into one of a few slots
    (fewer than the all-gathers), made once at the graph's start; the matmuls read views of the slots."""
    for graph in code:
        slots = re.findall(r"(buf\d+) = " + re.escape(SLOT), graph)
        named = set(slots) | {m for s in slots for m in re.findall(rf"(buf\d+) = {s}\n", graph)}  # buf1 = buf0
        assert AG not in graph
        written = [buf for _, buf in _gathers(graph)]
        assert set(written) <= named and 1 < len(set(written)) < len(written) == N_UNITS
        for buf in set(written):  # read by the step's own matmuls, or handed to a shared body
            assert re.search(rf"extern_kernels\.mm\(.*reinterpret_tensor\({buf}, ", graph) or re.search(
                rf"_args = \[.*\b{buf}\b", graph), buf
        assert not re.search(rf"del ({'|'.join(named)})  # reuse", graph)  # Inductor never reuses a slot


def _uses_while_in_flight(code: str) -> list[str]:
    """Lines that use a slot between an all-gather's write into it and the wait for that all-gather: reads of its
    previous occupant (overwritten) or of the new one (not there yet)."""
    found = []
    for line, buf in _gathers(code):
        if AG_OUT in line:
            launch = code.index(line) + len(line)
            wait = re.compile(rf"wait_tensor\.default\((reinterpret_tensor\()?{buf}\b").search(code, launch)
            assert wait, line
            uses = code[launch : wait.start()].splitlines()
            found += [used.strip() for used in uses if re.search(rf"\b{buf}\b", used)]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_no_kernel_uses_a_slot_while_its_all_gather_is_in_flight(
    code: list[str], checkpoint: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory plan's order survives Inductor. Under activation checkpointing the backward recomputes each block
    beside the next unit's prefetched all-gather; Inductor had moved the read of the final norm's weight (a
    pointwise op, computed only when its consumer, a reduction after the recomputation, needed it) past the next
    all-gather into that slot: the norms' gradients came out wrong (now `_internals.step_ops.step_op` lowers every
    op that writes an argument after the reads of its old value; with that lowering switched off, a fused kernel of
    the 2-block model's backward reads a slot while its all-gather is in flight, as on 4 blocks). The checkpointed
    model is compiled with ``mode="reduce-overhead"``: a compile mode reaches Inductor, for both graphs, beside the
    passes."""
    if checkpoint:
        (compile_options, expected), seen = MODE, _settings_seen(monkeypatch, MODE[1])
        code = _code("fsdp_compile", checkpoint=True, cfg=LLAMA_TESTS, **compile_options)
        assert seen == [(expected, True)] * 2 and _overlapped_gathers(code[1]) == N_TESTS_UNITS - 1  # schedule kept
    for graph in code:
        assert _uses_while_in_flight(graph) == []


@pytest.mark.slow
def test_each_blocks_weight_gradients_are_written_by_their_matmuls_into_what_its_exchange_sends(
    whole_code: list[str],
) -> None:
    """``write_gradients_in_place``: each block's flat gradient is allocated once, its matmuls write into it, and
    the exchange reads it: no kernel copies the matmuls' results into it. (In the step's graphs only: a shared body
    returns its unit's gradient, [Note: shared bodies].)"""
    backward = whole_code[1]
    exchanges = re.findall(r"all_to_all_single\.default\((buf\d+),", backward)
    assert len(exchanges) == LLAMA_TESTS.n_layers + 1
    for flat in exchanges[: LLAMA_TESTS.n_layers]:
        writes = {op: re.findall(rf"^\s*extern_kernels\.fsdp_compile_{op}\(.*, out=reinterpret_tensor\({flat}, ",
                                 backward, re.M) for op in ("mm_into", "copy_into")}
        assert len(writes["mm_into"]) == 7, flat  # wq, wk, wv, wo, w1, w2, w3
        assert len(writes["copy_into"]) == 2, flat  # the two norms' weights


@pytest.mark.slow
def test_the_step_ops_that_return_nothing_are_called_as_functions(whole_code: list[str]) -> None:
    """Inductor's code calls the library's step ops that return nothing (the collectives into slots, their waits,
    the in-place gradient writes) as their functions, not through the dispatcher (2.7-7 µs of host time a call
    less, ~200 calls a step on the benchmark's model); the op that hands out a slot stays an op call."""
    for graph in whole_code:
        called = set(re.findall(r"^\s*(?:buf\d+ = )?torch\.ops\.fsdp_compile\.(\w+)\.default\(", graph, re.M))
        assert called == {"slot"}, called
    direct = set(re.findall(r"^\s*extern_kernels\.fsdp_compile_(\w+)\(", whole_code[1], re.M))
    assert direct == {"all_gather_into_slot", "mm_into", "copy_into"}, direct  # no gaps to zero here


def test_a_step_op_stays_a_call_where_torch_cannot_call_its_function(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A step op defined on a torch without Inductor's table of custom fallback codegen: the op is defined and
    works, its calls stay calls of the op (the log says so), and nothing else is written."""
    from torch._inductor.select_algorithm import extern_kernels

    from fsdp_compile._internals import step_ops

    codegen = importlib.import_module("torch._inductor.codegen.custom_extern_kernel_codegen")
    table = dict(codegen.CUSTOM_EXTERN_KERNEL_CODEGEN)
    monkeypatch.delattr(codegen, "CUSTOM_EXTERN_KERNEL_CODEGEN")
    with caplog.at_level(logging.INFO, logger=step_ops.__name__):
        @step_ops.step_op("fsdp_compile_test::add_into", "(Tensor a, Tensor b, *, Tensor(a!) out) -> ()",
                          lambda *args, **kwargs: None)
        def add_into(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> None:
            torch.add(a, b, out=out)

    out = torch.zeros(3)
    add_into(torch.ones(3), torch.ones(3), out=out)
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert "fsdp_compile_test.add_into.default stays a call of the op" in caplog.text
    assert not hasattr(extern_kernels, "fsdp_compile_test_add_into")
    monkeypatch.undo()
    assert codegen.CUSTOM_EXTERN_KERNEL_CODEGEN == table


@pytest.mark.slow
def test_each_slotted_exchange_keeps_its_gradient_until_it_is_waited_for_and_then_summed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the exchanges in slots (what ``grad_reduce="copy_engine"`` applies; its copy engines need GPUs, so
    here the slotted NCCL-route op), each exchange reads its gradient on another stream: Inductor must not free
    the gradient, nor hand its memory to another buffer, before ``wait_exchange`` (which takes it for that).
    The slot holds the peers' parts only: after the wait, the first kernel sums them with this rank's own part,
    read from the gradient (no copy of it). Compiled with ``options=``: Inductor's settings reach it, for both
    graphs, beside the passes (and CUDA graphs stay off by default)."""
    (compile_options, expected), seen = OPTIONS, _settings_seen(monkeypatch, OPTIONS[1])
    with slotted_exchanges():
        forward, backward = _code("fsdp_compile", cfg=LLAMA_TESTS, **compile_options)
    assert seen == [(expected, True)] * 2 and len(_gathers(forward)) == N_TESTS_UNITS
    assert _overlapped_gathers(backward) == N_TESTS_UNITS - 1  # the overlap schedule kept
    exchanges = re.findall(rf"^\s*({re.escape(EXCHANGE)}(buf\d+), \d+, '\d+', out=(.+)\))$", backward, re.MULTILINE)
    assert len(exchanges) == N_TESTS_UNITS and A2A not in backward
    for line, gradient, out in exchanges:
        start = backward.index(line)
        wait = backward.index(f"fsdp_compile_wait_exchange({out}, {gradient})", start)
        assert not re.search(rf"del {gradient}\b|= {gradient}\b|\({gradient}, \(", backward[start:wait]), line
        summed = re.search(r"^\s*\w+_fused_\w+\((.*)\)$", backward[wait:], re.MULTILINE)
        slot = re.match(r"(?:reinterpret_tensor\()?(buf\d+)", out).group(1)  # type: ignore[union-attr]
        assert summed and {gradient, slot} <= set(summed.group(1).split(", ")), (line, summed)


@pytest.mark.slow
def test_inductor_keeps_the_overlap_schedule(code: list[str]) -> None:
    forward, backward = code
    # Every block's all-gather is in flight during the previous unit's matmuls; in forward, except the
    # first block's: before it there is only the root's embedding (fused into the block's first kernel).
    assert _overlapped_gathers(forward) == N_UNITS - 2
    assert _overlapped_gathers(backward) == N_UNITS - 1
    # Gradient exchanges: the first one's wait comes after the second one is issued.
    exchanges = re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_to_all_single\.default\(", backward)
    FileCheck().check(f"{exchanges[0]} = {A2A}").check(f"{exchanges[1]} = {A2A}").check(
        f"wait_tensor.default({exchanges[0]})"
    ).run(backward)


@pytest.mark.slow
def test_without_the_pass_no_all_gather_overlaps_without_the_plan_each_has_its_own_output_and_cudagraphs_arrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three options in one compile (no claim depends on another option): without the overlap pass no all-gather is
    in flight during another unit's kernels; without the memory plan none writes into a slot; ``cudagraphs=True``
    turns on Inductor's CUDA graphs. On CPU the forward compile records why it skips them (once: the backward
    compile takes the forward's decision), which shows the setting arrived; on GPUs
    ``test_parity_nccl_inductor[cudagraphs]`` checks that the graphs run. And ``destroy_process_group()`` frees the
    CUDA graphs first (else it would wait for them forever on GPUs: ``tests/test_gpu_exit.py``)."""
    freed: list[int] = []
    monkeypatch.setattr(torch._inductor.cudagraph_trees, "reset_cudagraph_trees", lambda: freed.append(1))
    counters.clear()
    forward, backward = _code(fsdp_compile.backend(overlap=False, memory_plan=False, cudagraphs=True), cfg=LLAMA_TESTS)
    for graph in (forward, backward):
        assert _overlapped_gathers(graph) == 0
        assert SLOT not in graph and AG_OUT not in graph
        assert len(_gathers(graph)) == N_TESTS_UNITS
    assert counters["inductor"]["cudagraph_skips"] == 1, dict(counters["inductor"])
    assert freed == [1]  # by _code's destroy_process_group()
    # Off by default: test_each_slotted_exchange_keeps_its_gradient_until_it_is_waited_for_and_then_summed sees
    # triton.cudagraphs False in both compiles.


@pytest.mark.parametrize(
    "compile_options, message",
    [
        ({"options": {"no_such_setting": 1}}, r"names settings Inductor does not have: \['no_such_setting'\]"),
        ({"options": {"reorder_for_peak_memory": True}}, r"sets \['reorder_for_peak_memory'\], which fsdp_compile sets itself"),
        ({"options": {"post_grad_custom_post_pass": None}}, r"sets \['post_grad_custom_post_pass'\], which fsdp_compile"),
    ],
    ids=["unknown", "peak-memory-reordering", "post-grad-pass"],
)
def test_compile_options_that_cannot_work_are_refused(compile_options: dict, message: str) -> None:
    with pytest.raises(Exception, match=message):
        _code("fsdp_compile", **compile_options)


def test_compile_mode_without_inductor_is_refused() -> None:
    with pytest.raises(Exception, match=r"mode= and options= are Inductor settings, but this backend runs compiler='aot_eager'"):
        _code(fsdp_compile.backend(compiler="aot_eager"), mode="max-autotune")
