"""Bad input to shard() and friends: the exception type, a message that says what and how to fix, and the
module left exactly as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama, RMSNorm
from fsdp_compile.testing.snapshot import assert_unchanged, module_snapshot


@pytest.fixture
def pg() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"param_dtype": torch.int8}, "param_dtype must be None or a floating-point dtype"),
        ({"reduce_dtype": torch.float8_e4m3fn}, "reduce_dtype must be None or a floating-point dtype of at least 16"),
        ({"param_dtype": "bf16"}, "param_dtype .* got 'bf16'"),
    ],
)
def test_mixed_precision_dtypes_that_make_no_sense(kwargs: dict, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        fsdp_compile.MixedPrecision(**kwargs)


def test_exchange_flag_that_is_not_a_bool() -> None:
    with pytest.raises(TypeError, match="exchange_grads_in_param_dtype must be a bool, got 'yes'"):
        fsdp_compile.MixedPrecision(exchange_grads_in_param_dtype="yes")  # type: ignore[arg-type]


def test_optimizer_built_before_shard_fails_on_its_first_step(pg: None) -> None:
    model = Llama(LLAMA_TINY)
    early = torch.optim.AdamW(model.parameters())
    fsdp_compile.shard(model, units=[Block])
    late = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="holds parameter 'tok_embeddings.weight' as it was before .* build the optimizer after shard"):
        early.step()
    late.step()  # built after shard(): fine


def test_unknown_backend_option() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'prefetch_depth'"):
        fsdp_compile.backend(prefetch_depth=2)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"cudagraphs": 1}, TypeError, "cudagraphs must be a bool, got 1"),
        ({"cudagraphs": True, "compiler": "aot_eager"}, ValueError, "cudagraphs=True needs compiler='inductor'"),
    ],
    ids=["not-a-bool", "without-inductor"],
)
def test_bad_cudagraphs_option(options: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fsdp_compile.backend(**options)


def test_not_sharded() -> None:
    with pytest.raises(ValueError, match="is not sharded: call fsdp_compile.shard"):
        fsdp_compile.full_state_dict(Llama(LLAMA_TINY))


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"prefetch": True}, TypeError, r"prefetch must be an int >= 0 \(units issued ahead\), got True \(bool\)"),
        ({"max_inflight_grad_reductions": False}, TypeError, r"max_inflight_grad_reductions must be an int >= 1 .*got False \(bool\)"),
        ({"prefetch": 1.0}, TypeError, r"prefetch must be an int >= 0 .*got 1.0 \(float\)"),
        ({"prefetch": -1}, ValueError, r"prefetch must be an int >= 0 \(units issued ahead\), got -1"),
        ({"overlap": 1}, TypeError, "overlap must be a bool, got 1"),
    ],
    ids=["prefetch-bool", "reductions-bool", "prefetch-float", "prefetch-negative", "overlap-int"],
)
def test_backend_options_of_the_wrong_type(options: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        fsdp_compile.backend(**options)


def test_the_old_name_of_max_inflight_grad_reductions_still_works() -> None:
    with pytest.warns(FutureWarning, match="max_inflight_reduce_scatters is deprecated .* use max_inflight_grad_reductions"):
        config = fsdp_compile.BackendConfig(max_inflight_reduce_scatters=3)
    assert config.max_inflight_grad_reductions == 3
    with pytest.warns(FutureWarning, match="max_inflight_reduce_scatters is deprecated"):
        fsdp_compile.backend(max_inflight_reduce_scatters=1)
    with pytest.raises(TypeError, match="not both"):
        fsdp_compile.BackendConfig(max_inflight_grad_reductions=4, max_inflight_reduce_scatters=3)


def test_converting_a_sharded_model_is_refused_and_changes_nothing(pg: None) -> None:
    model = fsdp_compile.shard(Llama(LLAMA_TINY).double(), units=[Block])
    flats = [unit.flat for unit in fsdp_compile.sharded_units(model)]
    before = module_snapshot(model)
    for convert in (lambda m: m.float(), lambda m: m.to(torch.float32), lambda m: m.layers[1].half()):
        with pytest.raises(TypeError, match=r"converting it would move its flat shards from torch.float64 on cpu to "
                                            r"torch.(float32|float16) on cpu .* Convert the model before shard\(\)"):
            convert(model)
        assert_unchanged(before, module_snapshot(model))
        assert all(p.dtype == torch.float64 for p in model.parameters())
        assert [unit.flat for unit in fsdp_compile.sharded_units(model)] == flats
    assert model.to("cpu", torch.float64) is model  # to what it already is: fine


def test_a_parameter_added_after_shard_is_refused_eager_and_compiled(pg: None) -> None:
    model = fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block])
    model.norm = RMSNorm(LLAMA_TINY.dim)  # a new module with a parameter no unit holds
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 8))
    with pytest.raises(RuntimeError, match=r"parameter norm.weight belongs to no FSDP unit .* would drift apart"):
        model(tokens, tokens)
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
    with pytest.raises(Exception, match=r"parameter .*norm.*weight.* belongs to no FSDP unit"):
        compiled(tokens, tokens)




@pytest.mark.parametrize("compiled", ["model", "each-block"])
def test_another_backend_on_a_sharded_model_in_training_says_to_compile_with_fsdp_compile(compiled: str, pg: None) -> None:
    """Plain Inductor on the model, or on each block (torchtitan's habit), in training: the marker's own message (its
    backward is traced), never autograd's "no autograd formula was registered". ``torch.compile(block,
    backend='fsdp_compile')`` works: tests/test_parity.py."""
    model = fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block])
    if compiled == "model":
        run = torch.compile(model, backend="inductor")
    else:
        for block in model.layers:
            block.compile()
        run = model
    tokens = torch.randint(0, LLAMA_TINY.vocab_size, (2, 8))
    with pytest.raises(Exception, match=r"a sharded parameter was read inside a graph that the fsdp_compile backend "
                                        r"did not compile; compile the model with torch.compile\(model, "
                                        r"backend='fsdp_compile'\) .* torch.compile\(block, backend='fsdp_compile'\)"
                       ) as raised:
        run(tokens, tokens).backward()
    assert "no autograd formula" not in str(raised.value)
