"""CPU offload beyond the parity tests (tests/test_parity.py): ``fsdp_compile.step_in_backward`` (each unit stepped
as its gradient lands gives the bits of the step after backward; its refusals leave the model and optimizer as they
were), and on a GPU the host copies' bf16 mirrors (``fsdp_compile.runtime.host_copies``)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_compile
from fsdp_compile.testing.dist import run_ranks, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama
from fsdp_compile.testing.reference import assert_bitwise, reference_step, rel_error

STEPS = 3


def _sharded(base: torch.nn.Module, compiler: str, param_dtype: torch.dtype) -> tuple[torch.nn.Module, ...]:
    model = copy.deepcopy(base)
    mp = fsdp_compile.MixedPrecision(param_dtype=param_dtype)
    fsdp_compile.shard(model, units=[Block], offload_policy=CPUOffloadPolicy(), mp=mp)
    run = model if compiler == "eager" else torch.compile(model, backend=fsdp_compile.backend(compiler=compiler))
    return model, run, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, LLAMA_TESTS.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))


def _loss(run: torch.nn.Module, rank: int, seed: int, device: str = "cpu") -> torch.Tensor:
    local = _tokens(seed)[2 * rank : 2 * rank + 2].to(device)
    return run(local[:, :-1], local[:, 1:])


def _bits(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    named = list(model.named_parameters())
    return {**{n: p.detach().clone() for n, p in named},
            **{f"{n}.{k}": v.clone() for n, p in named for k, v in opt.state[p].items()}}


def _same_bits_as_the_step_after_backward(
    rank: int, world_size: int, device: str = "cpu", compilers: tuple[str, ...] = ("aot_eager", "eager"),
    param_dtype: torch.dtype = torch.float64,
) -> None:
    torch.manual_seed(0)
    base = Llama(LLAMA_TESTS).double().to(device)
    for compiler in compilers:
        (model, run, opt), (ref_model, ref_run, ref_opt) = (_sharded(base, compiler, param_dtype) for _ in range(2))
        for step in range(STEPS):
            micro = 2 if step == 1 else 1  # step 1: a micro-batch accumulated before the one stepped in backward
            for k in range(micro - 1):
                _loss(run, rank, 10 * step + k, device).backward()
                _loss(ref_run, rank, 10 * step + k, device).backward()
            with fsdp_compile.step_in_backward(model, opt) as stepper:
                _loss(run, rank, 10 * step + micro - 1, device).backward()
            assert len(stepper.stepped) == len(fsdp_compile.sharded_units(model))
            assert all(p.grad is None for p in model.parameters()), "the step in backward consumes the gradients"
            _loss(ref_run, rank, 10 * step + micro - 1, device).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
            got, want = _bits(model, opt), _bits(ref_model, ref_opt)
            assert list(got) == list(want)
            differ = [k for k in want if not torch.equal(got[k], want[k])]
            assert not differ, f"{compiler} step {step}: not bitwise the step after backward: {differ[:3]}"
    if device == "cpu":
        _refusals(model, run, opt, rank)


def _refusals(model: torch.nn.Module, run: torch.nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    """Each refusal raises before a unit is stepped, and leaves step_in_backward usable."""
    before = _bits(model, opt)
    with pytest.raises(RuntimeError, match="clipping needs every gradient before any step"):
        with fsdp_compile.step_in_backward(model, opt):
            fsdp_compile.clip_grad_norm_(model, 1.0)
    with pytest.raises(RuntimeError, match="a micro-batch without gradient sync has no optimizer step"):
        with fsdp_compile.step_in_backward(model, opt):
            fsdp_compile.set_requires_gradient_sync(model, False)
    fsdp_compile.set_requires_gradient_sync(model, False)
    with pytest.raises(RuntimeError, match="non-final micro-batch of gradient accumulation"):
        fsdp_compile.step_in_backward(model, opt).__enter__()
    fsdp_compile.set_requires_gradient_sync(model, True)
    with pytest.raises(RuntimeError, match="no gradient landed inside the `with` block"):
        with fsdp_compile.step_in_backward(model, opt):
            loss = _loss(run, rank, 99)
    loss.backward()  # outside: no step, the gradients kept
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="already active on this model"):
        with fsdp_compile.step_in_backward(model, opt):
            fsdp_compile.step_in_backward(model, opt).__enter__()
    with pytest.raises(ValueError, match=r"Linear is not sharded: call fsdp_compile.shard\(module, units=...\) first"):
        fsdp_compile.step_in_backward(torch.nn.Linear(2, 2), opt)
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"steps a tensor of shape \(3,\), which is no piece"):
        fsdp_compile.step_in_backward(model, torch.optim.SGD([*model.parameters(), extra], lr=0.1))
    with pytest.raises(ValueError, match="LBFGS"):
        fsdp_compile.step_in_backward(model, torch.optim.LBFGS(model.parameters()))
    after = _bits(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before), "a refusal changed the model or its optimizer"
    assert all(u.on_gradient is None for u in fsdp_compile.sharded_units(model))


def _half_frozen() -> Llama:
    model = Llama(LLAMA_TESTS).double()
    for layer in model.layers[: LLAMA_TESTS.n_layers // 2]:
        layer.requires_grad_(False)
    return model


def _with_the_rest(rank: int, world_size: int, folder: str) -> None:
    """Offloaded, compiled: frozen units (half the blocks) stay bitwise, clip_grad_norm_ gives the unsharded model's
    norm and steps, a DCP checkpoint loads into a model built on the meta device whose shards ``to_empty`` put on
    the host."""
    torch.manual_seed(0)
    ref = _half_frozen()
    model = copy.deepcopy(ref)
    fsdp_compile.shard(model, units=[Block], offload_policy=CPUOffloadPolicy())
    assert sum(not u.trainable for u in fsdp_compile.sharded_units(model)) == LLAMA_TESTS.n_layers // 2
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"))
    opt, ref_opt = (torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref))
    frozen = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    for step in range(2):
        _loss(run, rank, step).backward()
        reference_step(ref, _tokens(step), torch.float64, world_size)
        norm = fsdp_compile.clip_grad_norm_(model, 0.5)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert rel_error(norm, want) < 1e-10, (norm, want)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    trained = fsdp_compile.full_state_dict(model)
    assert max(rel_error(trained[n], p) for n, p in ref.state_dict().items()) < 1e-10
    assert_bitwise({n: trained[n] for n in frozen}, frozen)
    dcp.save(model.state_dict(), checkpoint_id=folder)
    with torch.device("meta"):
        fresh = _half_frozen()
    fsdp_compile.shard(fresh, units=[Block], offload_policy=CPUOffloadPolicy())
    fresh.to_empty(device="cpu")
    units = fsdp_compile.sharded_units(fresh)
    assert all(u.flat.device.type == "cpu" and u.offload_to == torch.device("cpu") for u in units)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=folder)
    fresh.load_state_dict(state)
    assert_bitwise(fsdp_compile.full_state_dict(fresh), trained)


def test_offload_with_frozen_units_clipping_dcp_and_meta_device_init(tmp_path: Path) -> None:
    run_ranks(_with_the_rest, 2, str(tmp_path))


def test_step_in_backward_is_bitwise_the_step_after_backward_and_refuses_clearly() -> None:
    run_ranks(_same_bits_as_the_step_after_backward, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_in_backward_on_one_gpu_is_bitwise_the_step_after_backward() -> None:
    """On a GPU the gradients' copies to the host are asynchronous (a side stream): each unit's step waits for its
    own; Inductor and eager, bf16 compute (the shards' bf16 mirrors refreshed by the step in backward)."""
    spawn_ranks(_same_bits_as_the_step_after_backward, 1, "cuda", ("inductor", "eager"), torch.bfloat16,
                backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_mirror_is_used_only_while_it_holds_the_shards_values() -> None:
    """A copy to the GPU in bf16 moves the shard's bf16 mirror once its cast is done, and the shard's own bytes
    (cast on the GPU) after any write: in place (the version counter) or through ``.data`` (the sampled values)."""
    from torch._dynamo.utils import counters

    from fsdp_compile.runtime import host_copies

    host = torch.randn(1 << 20, pin_memory=True)
    device = torch.device("cuda")

    def copied(expect_mirror: bool) -> None:
        before = counters["fsdp_compile"]["offload_copies_from_mirror"]
        out = host_copies.copy_to_device(host, device, torch.bfloat16)
        assert torch.equal(out.cpu(), host.to(torch.bfloat16))
        assert counters["fsdp_compile"]["offload_copies_from_mirror"] - before == expect_mirror
        host_copies._mirrors[host].cast.result()  # the host thread's cast, done

    copied(False)  # the first copy starts the cast
    copied(True)
    host.mul_(2)  # in place: a new version
    copied(False)
    copied(True)
    host.data.add_(1)  # through .data: no new version, every sampled value differs
    copied(False)
    copied(True)
