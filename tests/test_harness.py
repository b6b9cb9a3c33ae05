"""The multi-rank harness (``fsdp_compile.testing.dist``): gloo groups run their collectives on one worker
thread, because torch's gloo corrupts its heap, rarely, with its default two (``_internals.gloo_one_worker_thread``
says how); gloo ranks are forked from a server that imported torch once, and see the caller's environment."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from fsdp_compile.testing.dist import spawn_ranks


def _worker_threads(rank: int, world_size: int) -> None:
    groups = [dist.group.WORLD, dist.new_group(list(range(world_size)))]
    assert [g._get_backend(torch.device("cpu")).options._threads for g in groups] == [1, 1]
    # ... and they still work: an all-reduce and a functional all-gather, as the library issues it.
    total = torch.full((3,), float(rank))
    dist.all_reduce(total)
    c10d = torch.ops._c10d_functional
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(total, world_size, groups[1].group_name))
    assert gathered.tolist() == [float(sum(range(world_size)))] * 3 * world_size


def test_gloo_groups_run_their_collectives_on_one_worker_thread() -> None:
    spawn_ranks(_worker_threads, 2)


def _environment(rank: int, world_size: int, caller: int, expected: dict[str, str | None], forked: bool) -> None:
    assert {name: os.environ.get(name) for name in expected} == expected
    assert (os.getppid() != caller) == forked, "forked from the server" if forked else "spawned by the caller"


def test_gloo_ranks_are_forked_from_a_server_with_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPAWN_RANKS_PROBE", "set after the server started, maybe")
    spawn_ranks(_environment, 2, os.getpid(), {"SPAWN_RANKS_PROBE": "set after the server started, maybe"}, True)
    monkeypatch.delenv("SPAWN_RANKS_PROBE")
    spawn_ranks(_environment, 2, os.getpid(), {"SPAWN_RANKS_PROBE": None}, True)
    # A variable torch reads when imported: the server imported torch without it, so the ranks are spawned.
    monkeypatch.setenv("TORCHINDUCTOR_SPAWN_RANKS_PROBE", "1")
    spawn_ranks(_environment, 2, os.getpid(), {"TORCHINDUCTOR_SPAWN_RANKS_PROBE": "1"}, False)
