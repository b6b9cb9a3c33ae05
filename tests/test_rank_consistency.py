"""Ranks that would issue different collectives fail at once, on every rank, with an error naming the first
difference, instead of hanging until the transport times out (gloo ranks)."""

from __future__ import annotations

import datetime
import os
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fsdp_compile
from fsdp_compile._agree import _FAILED, _PREFIX, _stuck_rank, agree
from fsdp_compile.config import BackendConfig
from fsdp_compile.testing.dist import run_ranks, spawn_ranks
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, LlamaConfig

FAIL_WITHIN_S = 60.0


class ShortInputsSkipTheLastBlock(Llama):
    """A model whose path depends on the input shape: sequences shorter than 8 tokens skip the last block."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers[: len(self.layers) - int(s < 8)]:
            x = layer(x, cos, sin)
        return F.cross_entropy(self.output(self.norm(x)).flatten(0, 1), targets.flatten())


def _step_must_fail(model: torch.nn.Module, compiled: bool, seq_len: int, expect: list[str]) -> None:
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager")) if compiled else model
    device = next(model.parameters()).device
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, seq_len + 1), device=device)
    start = time.monotonic()
    # Compiled: what the backend raised reaches the caller as itself, not as Dynamo's BackendCompilerFailed.
    with pytest.raises(fsdp_compile.RanksDisagree) as error:
        run(tokens[:, :-1], tokens[:, 1:]).backward()
    assert time.monotonic() - start < FAIL_WITHIN_S
    message = str(error.value)
    assert "the ranks' collectives differ" in message, message
    for part in expect:
        assert part in message, (part, message)


def _extra_layer(rank: int, world_size: int, compiled: bool, device: str = "cpu") -> None:
    config = LlamaConfig(**{**LLAMA_TESTS.__dict__, "n_layers": LLAMA_TESTS.n_layers + rank})
    model = fsdp_compile.shard(Llama(config).to(device), units=[Block])
    rank_0_has = "none (it issues 3)" if compiled else "the end of the forward"
    _step_must_fail(model, compiled, 8, ["collective #4", "all-gather of unit 'layers.2'", rank_0_has])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_rank_with_an_extra_layer_fails_on_every_rank_naming_the_first_difference(compiled: bool) -> None:
    run_ranks(_extra_layer, 2, compiled)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_nccl_too_a_rank_with_an_extra_layer_fails_at_once_not_after_the_watchdog(compiled: bool) -> None:
    spawn_ranks(_extra_layer, 2, compiled, "cuda", backend="nccl")


def _auto_chooses_per_rank(rank: int, world_size: int) -> None:
    from fsdp_compile import _backend
    from fsdp_compile.lowering.choose_route import RouteChoice, Routes

    def choose(gm: object, plan: object, config: BackendConfig) -> Routes:  # as peer access might
        route = "copy_engine" if rank == 0 else "nccl"
        return Routes(route, "nccl", chosen=(("all_gather", RouteChoice(route, "peer access on rank 0 only")),))

    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager", all_gather="auto"))
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
    start = time.monotonic()
    with pytest.raises(fsdp_compile.RanksDisagree) as error, mock.patch.object(_backend, "_resolve_routes", choose):
        run(tokens[:, :-1], tokens[:, 1:])
    assert time.monotonic() - start < FAIL_WITHIN_S
    message = str(error.value)
    for part in ("the ranks' collectives differ", "by copy_engine/nccl ('auto')", "by nccl/nccl ('auto')",
                 "set 'nccl'"):
        assert part in message, (part, message)


def test_ranks_on_which_auto_chose_different_all_gather_routes_fail_instead_of_hanging() -> None:
    run_ranks(_auto_chooses_per_rank, 2)


def _rank_dependent_shape(rank: int, world_size: int, compiled: bool) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(ShortInputsSkipTheLastBlock(LLAMA_TESTS), units=[Block])
    rank_0_has = "none (it issues 2)" if compiled else "the end of the forward"
    _step_must_fail(model, compiled, 6 + 4 * rank, ["collective #3", "all-gather of unit 'layers.1'", rank_0_has])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_rank_dependent_input_shape_that_changes_the_collectives_fails_on_every_rank(compiled: bool) -> None:
    run_ranks(_rank_dependent_shape, 2, compiled)


def _shapes_differ_collectives_agree(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"))
    # Rank 1's second batch is shorter: it recompiles alone, to the same collectives, which every rank has
    # agreed on already, so it does not wait for the others to compile them again.
    counters.clear()
    for seq_len in (8, 8 - 2 * rank, 8):
        tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, seq_len + 1))
        run(tokens[:, :-1], tokens[:, 1:]).backward()
    graphs = counters["fsdp_compile"]["all_gathers"] // (LLAMA_TESTS.n_layers + 1)
    assert graphs == 1 + rank, graphs  # rank 1 did compile alone


def test_rank_dependent_shapes_with_the_same_collectives_train() -> None:
    run_ranks(_shapes_differ_collectives_agree, 2)


def _agree_protocol(rank: int, world_size: int) -> None:
    group = dist.new_group(timeout=datetime.timedelta(seconds=FAIL_WITHIN_S))
    cpu = torch.device("cpu")
    agree(group, cpu, "a first list", ["a", "b"])
    # A list every rank published before returns at once: had rank 1 waited for the others, which wait for it
    # in the barrier, it would have raised after the group's timeout.
    if rank == 1:
        agree(group, cpu, "the first list again", ["a", "b"])
    dist.barrier()
    # Rank 2 publishes another list: every rank raises, naming collective #2 of both, before the timeout.
    start = time.monotonic()
    with pytest.raises(fsdp_compile.RanksDisagree, match=r"collective #2: rank \d: (b|x); rank \d: (x|b)"):
        agree(group, cpu, "a list that differs", ["a", "x"] if rank == 2 else ["a", "b", "y"])
    assert time.monotonic() - start < FAIL_WITHIN_S / 2
    dist.barrier()
    # Rank 1 never publishes: the others wait for the group's timeout, then say which rank never came.
    quick = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank != 1:
        with pytest.raises(fsdp_compile.RanksDisagree, match=r"waited 3 s .* ranks \[1\] never did"):
            agree(quick, cpu, "a list rank 1 skips", ["z"])
    dist.barrier()


def test_agree_waits_only_while_the_lists_can_still_match() -> None:
    run_ranks(_agree_protocol, 3)


def test_a_rank_that_published_the_same_list_then_gave_up_is_not_named_as_the_one_that_differs() -> None:
    # What rank 1 can see in the protocol above: rank 0 published rank 1's list, then gave up because of rank 2,
    # which waits for a list rank 1 never published. Rank 1 must name rank 2.
    store = dist.HashStore()
    for digest, rank in (("ours", 0), ("ours", 1), ("theirs", 2)):
        store.set(f"{_PREFIX}has/{digest}/{rank}", "1")
    for rank, status in ((0, _FAILED + "ours"), (1, "ours"), (2, "theirs")):
        store.set(f"{_PREFIX}waiting/{rank}", status)
    assert _stuck_rank(store, [f"{_PREFIX}has/ours/{rank}" for rank in range(3)], 1) == 2


def _rank_1_dies(rank: int, world_size: int, compiled: bool) -> None:
    torch.manual_seed(0)
    model = fsdp_compile.shard(Llama(LLAMA_TESTS), units=[Block])
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager")) if compiled else model
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 9))
    run(tokens[:, :-1], tokens[:, 1:]).backward()
    if rank == 1:
        os._exit(0)  # gone in the middle of training, without a word (exit code 0: the harness waits for rank 0)
    # Rank 0's next collective fails at once (gloo: "Connection closed by peer"), and rank 0 raises naming rank 1
    # once its heartbeat has stood still for a moment (the gloo error, as the cause, names the connection).
    start = time.monotonic()
    with pytest.raises(fsdp_compile.RankFailed, match=r"rank 1 died \(its connection closed and its heartbeat "
                                                      r"stopped") as failure:
        run(tokens[:, :-1], tokens[:, 1:]).backward()
    assert failure.value.rank == 1 and "Connection" in str(failure.value.__cause__)
    assert time.monotonic() - start < FAIL_WITHIN_S
    os._exit(0)  # no teardown: it would wait for rank 1 in a barrier


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_rank_that_dies_makes_the_others_fail_with_a_clear_error(compiled: bool) -> None:
    spawn_ranks(_rank_1_dies, 2, compiled)
