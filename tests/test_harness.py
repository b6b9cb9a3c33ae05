"""The multi-rank harness (``fsdp_compile.testing.dist``): gloo groups run their collectives on one worker
thread, because torch's gloo corrupts its heap, rarely, with its default two (``_internals.gloo_one_worker_thread``
says how); gloo ranks are forked from a server that imported torch once, and see the caller's environment;
pooled ranks (``run_ranks``) are kept from call to call and find each call as new ranks would."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from torch.multiprocessing.spawn import ProcessRaisedException

from fsdp_compile._internals import counters
from fsdp_compile.testing.dist import run_ranks, spawn_ranks


def _worker_threads(rank: int, world_size: int) -> None:
    groups = [dist.group.WORLD, dist.new_group(list(range(world_size)))]
    assert [g._get_backend(torch.device("cpu")).options._threads for g in groups] == [1, 1]
    # ... and they still work: an all-reduce and a functional all-gather, as the library issues it.
    total = torch.full((3,), float(rank))
    dist.all_reduce(total)
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(total, world_size, groups[1].group_name))
    assert gathered.tolist() == [float(sum(range(world_size)))] * 3 * world_size


def _environment(rank: int, world_size: int, caller: int, expected: dict[str, str | None], forked: bool) -> None:
    assert {name: os.environ.get(name) for name in expected} == expected
    assert (os.getppid() != caller) == forked, "forked from the server" if forked else "spawned by the caller"
    _worker_threads(rank, world_size)


def test_gloo_ranks_are_forked_from_a_server_with_the_callers_environment_and_one_worker_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call's ranks, forked or spawned, see the caller's environment, and their gloo groups run their
    collectives on one worker thread."""
    monkeypatch.setenv("SPAWN_RANKS_PROBE", "set after the server started, maybe")
    spawn_ranks(_environment, 2, os.getpid(), {"SPAWN_RANKS_PROBE": "set after the server started, maybe"}, True)
    monkeypatch.delenv("SPAWN_RANKS_PROBE")
    spawn_ranks(_environment, 2, os.getpid(), {"SPAWN_RANKS_PROBE": None}, True)
    # A variable torch reads when imported: the server imported torch without it, so the ranks are spawned.
    monkeypatch.setenv("TORCHINDUCTOR_SPAWN_RANKS_PROBE", "1")
    spawn_ranks(_environment, 1, os.getpid(), {"TORCHINDUCTOR_SPAWN_RANKS_PROBE": "1"}, False)  # 1: half the imports


def _pooled(rank: int, world_size: int, pids: dict[int, tuple[int, int]], expected: dict[str, str | None]) -> None:
    assert {name: os.environ.get(name) for name in expected} == expected
    assert counters["fsdp_compile"] == {}
    assert dist.get_backend() == "gloo" and dist.get_world_size() == world_size
    store = dist.distributed_c10d._get_default_store()
    assert not store.check([f"left_by_the_last_job/{rank}"])  # each job on a store prefix of its own
    store.set(f"left_by_the_last_job/{rank}", "1")
    counters["fsdp_compile"]["left_by_the_last_job"] += 1
    if pids:
        assert pids[rank] == (os.getpid(), torch.initial_seed()), "the same process as the last call, seeded anew"
    torch.manual_seed(rank + 1)


def _pid(rank: int, world_size: int, path: str) -> None:
    """This rank's process and seed, as a new process has it, into ``path.<rank>``."""
    with open(f"{path}.{rank}", "w") as f:
        f.write(f"{os.getpid()} {torch.initial_seed()}")


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits for rank 1 forever: the pool is ended


def test_pooled_ranks_are_kept_and_each_call_finds_them_as_new(tmp_path: "os.PathLike[str]",
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.path.join(tmp_path, "pid")
    run_ranks(_pid, 2, path)
    pids = {rank: tuple(map(int, open(f"{path}.{rank}").read().split())) for rank in range(2)}
    monkeypatch.setenv("RUN_RANKS_PROBE", "1")
    run_ranks(_pooled, 2, pids, {"RUN_RANKS_PROBE": "1"})
    monkeypatch.delenv("RUN_RANKS_PROBE")
    run_ranks(_pooled, 2, pids, {"RUN_RANKS_PROBE": None})
    with pytest.raises(ProcessRaisedException, match="rank 1 gives up"):
        run_ranks(_raise_on_rank_1, 2)
    run_ranks(_pooled, 2, {}, {})  # a new pool
    run_ranks(_pid, 2, path)
    assert all(int(open(f"{path}.{rank}").read().split()[0]) != pid for rank, (pid, _) in pids.items())


def test_reference_step_in_mixed_precision_leaves_frozen_parameters_without_a_gradient() -> None:
    """The mixed-precision reference (each rank's micro-batch in bf16, gradients averaged in the reference's dtype)
    skips frozen parameters, as the reference's own backward does, and averages the trained ones over the ranks."""
    from fsdp_compile.testing.llama import LLAMA_TESTS, Llama
    from fsdp_compile.testing.reference import reference_step

    torch.manual_seed(0)
    ref = Llama(LLAMA_TESTS)
    ref.tok_embeddings.weight.requires_grad_(False)
    tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (4, 9))
    low = Llama(LLAMA_TESTS).to(torch.bfloat16)
    low.load_state_dict(ref.state_dict())
    low.tok_embeddings.weight.requires_grad_(False)
    for micro in tokens.chunk(2):
        low(micro[:, :-1], micro[:, 1:]).backward()

    reference_step(ref, tokens, torch.bfloat16, world_size=2)

    assert ref.tok_embeddings.weight.grad is None
    for name, p in ref.named_parameters():
        if p.requires_grad:  # the sum of the two micro-batches' bf16 gradients, halved in float32
            q = low.get_parameter(name)
            torch.testing.assert_close(p.grad, q.grad.float() / 2, rtol=1e-2, atol=1e-4, msg=name)
