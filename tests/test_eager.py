"""Eager mode (no torch.compile): units are gathered by hooks and resharded after forward."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import fsdp_compile
from fsdp_compile._eager import live_gathers
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama


def _reshard_after_forward(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    units = fsdp_compile.sharded_units(model)
    gathered: list[weakref.ref[torch.Tensor]] = []
    for unit in units:
        module = model.get_submodule(unit.layout.fqn)
        # Runs after shard()'s own pre-hook, which has gathered the unit.
        module.register_forward_pre_hook(lambda m, a, unit=unit: gathered.append(weakref.ref(unit.eager.gathered)))
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
    counters.clear()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert len(gathered) == len(units)
    # gloo's worker thread drops its handle on a finished collective (and so on its output) a moment after
    # wait() returns: give it that moment, no more.
    deadline = time.monotonic() + 5.0
    while any(ref() is not None for ref in gathered) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(ref() is None for ref in gathered), "a gathered unit outlived its forward"
    assert not live_gathers and all(u.eager.gathered is None for u in units)
    loss.backward()
    # Backward gathers each unit once more, for the parameters its gradients need, and lets it go.
    assert counters["fsdp_compile"]["eager_regathers"] == len(units)
    assert all(u.eager.regathered is None and u.eager.pending == 0 for u in units)
    assert all(p.grad is not None for p in model.parameters())


def test_units_are_resharded_after_forward_and_regathered_once_in_backward() -> None:
    run_ranks(_reshard_after_forward, 2)


def _keep_root_gathered(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block], reshard_after_forward=lambda fqn, m: fqn != "")
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
    counters.clear()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    # The root (tied embedding/output) kept what backward needs of it: only the blocks are gathered again.
    assert counters["fsdp_compile"]["eager_regathers"] == LLAMA_TESTS.n_layers
    assert all(p.grad is not None for p in model.parameters())


def test_a_unit_not_resharded_is_not_gathered_again() -> None:
    run_ranks(_keep_root_gathered, 2)


class _SparseMix(torch.nn.Module):
    """A unit whose forward saves a sparse tensor (no plain storage) for backward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("mix", torch.eye(4).to_sparse())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.mix, self.lin(x))


def _saved_whole(rank: int, world_size: int) -> None:
    import logging

    from fsdp_compile import debug

    debug._said.clear()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fsdp_compile.debug").addHandler(handler)
    model = fsdp_compile.shard(torch.nn.Sequential(_SparseMix(), _SparseMix()), units=[_SparseMix])
    counters.clear()
    try:
        for _ in range(2):
            model(torch.randn(4, 4)).sum().backward()
    finally:
        logging.getLogger("fsdp_compile.debug").removeHandler(handler)
    assert counters["fsdp_compile"]["eager_saved_whole"] == 4  # two units, two steps
    assert [r for r in records if "as it is" in r] == [
        "eager mode saved a Tensor with layout torch.sparse_coo for backward as it is (no plain storage to tell "
        "whether it views a gathered unit): a unit it views stays gathered until backward [counted in "
        "torch._dynamo.utils.counters['fsdp_compile']['eager_saved_whole']; said once]"
    ]


def test_a_saved_tensor_without_plain_storage_is_counted_and_said_once() -> None:
    run_ranks(_saved_whole, 2)


class _FailingBlock(Block):
    """A block whose forward raises after its attention ran (its activations saved for backward) while its
    ``fail`` is set: a bad batch, an out-of-memory that the training loop catches. An attribute of the
    instance: Dynamo guards it (torch 2.11's does not guard a class attribute, so it would not recompile)."""

    fail = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.fail:
            raise RuntimeError("bad batch")
        return x + self.feed_forward(self.ffn_norm(x))


def _train_through_an_exception(rank: int, world_size: int, compiled: bool) -> None:
    import copy

    from fsdp_compile.testing.reference import reference_step, rel_error

    torch.manual_seed(0)
    ref = Llama(LLAMA_TESTS).double()
    model = copy.deepcopy(ref)
    for layer in model.layers:
        layer.__class__ = _FailingBlock
    fsdp_compile.shard(model, units=[Block])
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager")) if compiled else model
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
    units = fsdp_compile.sharded_units(model)

    def tokens(step: int) -> torch.Tensor:
        return torch.randint(0, LLAMA_TESTS.vocab_size, (2 * world_size, 9), generator=torch.Generator().manual_seed(step))

    for step in range(4):
        batch = tokens(step)
        local = batch[2 * rank : 2 * rank + 2]
        if step == 1:  # the training loop catches the error and goes on with the next batch
            model.layers[1].fail = True
            with pytest.raises(RuntimeError, match="bad batch") as failure:  # kept, as a loop that logs it would
                run(local[:, :-1], local[:, 1:])
            model.layers[1].fail = False
            assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None, "saved-tensor hooks left installed"
            assert not live_gathers and all(u.eager.gathered is None and u.eager.regathered is None for u in units)
            continue
        loss = run(local[:, :-1], local[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference_step(ref, batch, torch.float64, world_size)
        ref_opt.step()
        ref_opt.zero_grad()
        full, want = fsdp_compile.full_state_dict(model), ref.state_dict()
        worst = max(rel_error(full[k], v) for k, v in want.items())
        assert worst <= 1e-10, (step, worst)
    if compiled:  # the rest is about eager mode's saved views
        return
    # While the exception is kept, its traceback keeps the failed forward's saved views: they only keep a
    # gathered buffer alive (never read once the shard has changed: it is gathered again). Then all goes.
    assert any(u.eager.pending for u in units)
    del failure
    assert all(u.eager.pending == 0 and u.eager.regathered is None for u in units), [(u.eager.pending, u.eager.regathered is None) for u in units]
    # A forward never backpropagated (an evaluation under grad mode) is freed with its loss, views and all.
    loss = model(local[:, :-1], local[:, 1:])
    assert all(u.eager.pending > 0 for u in units[1:])
    del loss
    assert all(u.eager.pending == 0 for u in units)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_exception_in_a_units_forward_leaves_the_model_trainable(compiled: bool) -> None:
    run_ranks(_train_through_an_exception, 2, compiled)


def test_a_deleted_model_is_freed_at_once_and_a_backward_after_it_says_why_it_cannot_run(fake_pg: None) -> None:
    gc.disable()  # no cycle left for the garbage collector: reference counting alone frees the units
    try:
        model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
        tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        units = [weakref.ref(u) for u in fsdp_compile.sharded_units(model)]
        loss = model(tokens[:, :-1], tokens[:, 1:])
        del model
        assert all(u() is None for u in units)
        with pytest.raises(RuntimeError, match="a sharded model deleted since its forward: keep the model"):
            loss.backward()
    finally:
        gc.enable()
