"""Layer 2: what Inductor generates (fake process group, one process): one all-gather per unit in the
forward code, one all-gather and one gradient exchange per unit in backward (bf16 gradients, fp32 sums:
an all-to-all), and the overlap schedule kept: each prefetched all-gather is issued, then the previous
unit's matmuls run, then it is waited for."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
import torch._inductor.cudagraph_trees
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama

N_UNITS = LLAMA_TINY.n_layers + 1
AG = "torch.ops._c10d_functional.all_gather_into_tensor.default("
A2A = "torch.ops._c10d_functional.all_to_all_single.default("


def _code(backend: object, **compile_options: object) -> list[str]:
    """Inductor's code for the forward and backward graphs of a tiny Llama (bf16 params, fp32 reduce);
    ``compile_options`` go to ``torch.compile`` (``mode=``, ``options=``)."""
    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = fsdp_compile.shard(
            Llama(LLAMA_TINY),
            units=[Block],
            mp=fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        compiled = torch.compile(model, backend=backend, fullgraph=True, **compile_options)  # type: ignore[call-overload]
        tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 8))
        _, code = run_and_get_code(lambda: compiled(tokens, tokens).backward())
    finally:
        dist.destroy_process_group()
    return code


@pytest.fixture(scope="module")
def code() -> list[str]:
    return _code("fsdp_compile")  # by name: the registered backend, default options (overlap on)


def _overlapped_gathers(code: str) -> int:
    """All-gathers (after the first) with a matmul between their launch and their wait."""
    gathers = re.findall(r"(buf\d+) = torch\.ops\._c10d_functional\.all_gather_into_tensor\.default\(", code)
    overlapped = 0
    for buf in gathers[1:]:
        try:
            FileCheck().check(f"{buf} = {AG}").check("extern_kernels.mm(").check(f"wait_tensor.default({buf})").run(code)
            overlapped += 1
        except RuntimeError:
            pass
    return overlapped


@pytest.mark.slow
def test_collective_counts(code: list[str]) -> None:
    forward, backward = code
    FileCheck().check_count(AG, N_UNITS, exactly=True).check_not("all_to_all_single").run(forward)
    FileCheck().check_count(AG, N_UNITS, exactly=True).run(backward)
    FileCheck().check_count(A2A, N_UNITS, exactly=True).check_not("reduce_scatter_tensor").run(backward)


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
def test_without_the_pass_no_all_gather_overlaps() -> None:
    forward, backward = _code(fsdp_compile.backend(overlap=False))
    assert _overlapped_gathers(forward) == 0
    assert _overlapped_gathers(backward) == 0


@pytest.mark.slow
def test_cudagraphs_option_reaches_inductor(monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend(cudagraphs=True)`` turns on Inductor's CUDA graphs. On CPU the forward compile records why
    it skips them (once: the backward compile takes the forward's decision), which shows the setting
    arrived; on GPUs ``test_parity_nccl_inductor[cudagraphs]`` checks that the graphs run. And
    ``destroy_process_group()`` frees the CUDA graphs first (else it would wait for them forever on GPUs:
    ``tests/test_gpu_exit.py``)."""
    freed: list[int] = []
    monkeypatch.setattr(torch._inductor.cudagraph_trees, "reset_cudagraph_trees", lambda: freed.append(1))
    counters.clear()
    _code(fsdp_compile.backend(cudagraphs=True))
    assert counters["inductor"]["cudagraph_skips"] == 1, dict(counters["inductor"])
    assert freed == [1]  # by _code's destroy_process_group()
    counters.clear()
    _code(fsdp_compile.backend())
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert freed == [1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "compile_options, expected",
    [
        ({"mode": "max-autotune"}, {"max_autotune": True, "coordinate_descent_tuning": True}),
        ({"options": {"epilogue_fusion": False, "max_autotune": True}}, {"epilogue_fusion": False, "max_autotune": True}),
    ],
    ids=["mode", "options"],
)
def test_compile_mode_and_options_reach_inductor_beside_the_passes(
    monkeypatch: pytest.MonkeyPatch, compile_options: dict, expected: dict
) -> None:
    """``torch.compile(..., backend="fsdp_compile", mode=...)`` (or ``options=``): Inductor compiles both graphs
    with those settings, and fsdp_compile's passes still run."""
    from torch._inductor import config as inductor_config

    from fsdp_compile import _internals

    seen = []
    real = _internals.compile_fx_inner

    def spy(gm: torch.fx.GraphModule, example_inputs: object, **kwargs: object) -> object:
        settings = {name: getattr(inductor_config, name) for name in expected}
        seen.append((settings, inductor_config.post_grad_custom_post_pass is not None))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(_internals, "compile_fx_inner", spy)
    forward, backward = _code("fsdp_compile", **compile_options)
    assert seen == [(expected, True)] * 2
    FileCheck().check_count(AG, N_UNITS, exactly=True).run(forward)
    assert _overlapped_gathers(backward) == N_UNITS - 1  # the overlap schedule survived


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
