"""Rank consistency: before collectives that every rank must issue alike, the ranks compare them through the
process group's store and raise an error naming the first difference, instead of hanging in mismatched
collectives until the transport times out.

Checked: each compiled graph's all-gathers (once per compilation), eager mode's gathers until a first
forward completes, and the optimizer-state keys a full optimizer state dict gathers. And, at ``shard()``, the
units' values (:func:`agree_on_values`): ranks that start from different weights would train a mixture. The protocol, and why
it never waits for a rank that compiled the same collectives earlier: [Note: rank consistency] in
docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_compile import _internals
from fsdp_compile.runtime.channel import BEAT_S
from fsdp_compile.runtime.channels import channel_named

if TYPE_CHECKING:
    from fsdp_compile._unit import UnitState

__all__ = ["EagerFirstForward", "RanksDisagree", "agree", "agree_on_values", "fingerprint"]

log = logging.getLogger(__name__)

_PREFIX = "fsdp_compile/agree/"
_FAILED = "failed:"


class RanksDisagree(RuntimeError):
    """The ranks would issue different collectives (and hang in them)."""


MODEL_HINT = (
    "Every rank must run the same model, sharded the same way, with control flow that does not depend on the "
    "rank or its data (a layer used only for some input shapes, a rank-dependent model)"
)


def agree(
    group: dist.ProcessGroup, device: torch.device, what: str, collectives: Sequence[str], hint: str = MODEL_HINT
) -> None:
    """Return once every rank of ``group`` has published the same ``collectives`` (descriptions, in the order
    they will be issued) for ``what``, now or at an earlier call. Raise :class:`RanksDisagree` on every rank,
    naming the first difference and ending with ``hint`` (how to fix it), as soon as some rank is stuck
    waiting for a list this rank never published (a wait that cannot end), or after the group's timeout."""
    world_size = dist.get_world_size(group)
    if world_size == 1 or dist.get_backend(group) == "fake":
        return
    store = _internals.group_store(group)
    rank = dist.get_rank(group)
    text = json.dumps(list(collectives))
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    if not store.check([_PREFIX + "list/" + digest]):
        store.set(_PREFIX + "list/" + digest, text)
    store.set(f"{_PREFIX}has/{digest}/{rank}", "1")
    store.set(f"{_PREFIX}waiting/{rank}", digest)
    wanted = [f"{_PREFIX}has/{digest}/{q}" for q in range(world_size)]
    timeout = _internals.group_timeout(group, device).total_seconds()
    channel = channel_named(group.group_name)
    start = next_look = time.monotonic()
    pause = 0.001
    while not store.check(wanted):
        stuck = _stuck_rank(store, wanted, rank)
        waited = time.monotonic() - start
        blocked = None
        if channel is not None and time.monotonic() >= next_look:  # a rank that waits in a collective for this one
            channel.check()
            blocked = channel.waiting_for_this_rank()
            next_look = time.monotonic() + BEAT_S
        if stuck is not None or waited > timeout or blocked is not None:
            if store.check(wanted):  # it published this list meanwhile and went on (to the next check, or into a
                break  # collective): a rank sets its keys in order, so one seen past this check has this list's key
            store.set(f"{_PREFIX}waiting/{rank}", _FAILED + digest)
            missing = [q for q in range(world_size) if not store.check([wanted[q]])]
            message = _blocked_message(what, rank, *blocked) if blocked else _message(
                store, what, rank, collectives, stuck, missing, waited)
            raise RanksDisagree(message + hint)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    store.set(f"{_PREFIX}waiting/{rank}", "")


def _status(store: Any, rank: int) -> str:
    key = f"{_PREFIX}waiting/{rank}"
    return store.get(key).decode() if store.check([key]) else ""


def _stuck_rank(store: Any, wanted: list[str], rank: int) -> int | None:
    """A rank that has not published this rank's list (its key in ``wanted``, one a rank) and never will: it waits
    for a list this rank (itself waiting) never published, or it gave up. None while they all still could. A
    peer's key is looked at again after its status: a rank sets its key first, so a peer that published this list
    meanwhile and went on (to its next list, or gave up because of a third rank) is not taken for one that differs."""
    for other, key in enumerate(wanted):
        if store.check([key]):
            continue
        status = _status(store, other)
        if store.check([key]):
            continue
        if status.startswith(_FAILED):
            return other
        if status and not store.check([f"{_PREFIX}has/{status}/{rank}"]):
            return other
    return None


def _blocked_message(what: str, rank: int, other: int, seq: int, where: str) -> str:
    return (
        f"fsdp_compile: rank {other} waits in collective #{seq} of the group ({where}), which this rank ({rank}) has "
        f"not issued: this rank is at {what} instead, so the ranks' programs diverged (an exception on one rank that "
        "the training loop caught, a rank-dependent branch, a parameter read on one rank only...). "
    )


def _published(store: Any, rank: int) -> list[str] | None:
    digest = _status(store, rank).removeprefix(_FAILED)
    return json.loads(store.get(_PREFIX + "list/" + digest)) if digest else None


def _message(
    store: Any, what: str, rank: int, mine: Sequence[str], stuck: int | None, missing: list[int], waited: float
) -> str:
    if stuck is None:
        return (
            f"fsdp_compile: rank {rank} waited {waited:.0f} s (the process group's timeout) for the other ranks to "
            f"reach the same collectives for {what}; ranks {missing} never did (stuck elsewhere, or gone). "
        )
    theirs = _published(store, stuck)
    if theirs is None:
        return f"fsdp_compile: rank {stuck} gave up before rank {rank} reached {what}. "
    index = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    rank_a = mine[index] if index < len(mine) else f"none (it issues {len(mine)})"
    rank_b = theirs[index] if index < len(theirs) else f"none (it issues {len(theirs)})"
    return (
        f"fsdp_compile: the ranks' collectives differ, so they would hang in {what}. First difference, "
        f"collective #{index + 1}: rank {rank}: {rank_a}; rank {stuck}: {rank_b}. "
    )


class EagerFirstForward:
    """Eager mode's check: before each unit's gather, and at the end of the root's forward, the ranks agree on
    the gathers so far, until a forward completes (one that raises is followed by more checked gathers).
    After that its hooks return at once. Compiled graphs are checked by the backend; the hooks stay
    installed (Dynamo guards on a module's hooks: removing them would recompile). They are bound methods:
    torch 2.11's Dynamo guards a hook it traces through ``hook.__func__``, which a callable object or a
    ``functools.partial`` lacks. Made before the units' own hooks, which must run after them."""

    _END = "the end of the forward (no more gathers)"

    def __init__(self, root: nn.Module, states: Sequence[UnitState]) -> None:
        self.groups = states[0].groups  # HSDP: within the replica, and across the replicas
        self.device = states[0].flat.device
        self.gathers: list[str] = []
        self.done = False
        root.register_forward_hook(self.end_of_forward)
        for state in states:
            before = _BeforeGather(self, state.describe_gather())
            root.get_submodule(state.layout.fqn).register_forward_pre_hook(before.hook)

    def agree_on(self, event: str) -> None:
        self.gathers.append(event)
        for group in self.groups:
            agree(group, self.device, "eager mode's first forward", self.gathers)

    def end_of_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the root: the forward completed."""
        if torch.compiler.is_compiling() or self.done:
            return
        self.agree_on(self._END)
        self.done = True


class _BeforeGather:
    """Its ``hook``: the forward pre-hook of a unit, before the unit's own (which gathers it)."""

    def __init__(self, check: EagerFirstForward, gather: str) -> None:
        self.check = check
        self.gather = gather

    def hook(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling() or self.check.done:
            return
        self.check.agree_on(self.gather)


_values_checks: dict[str, int] = {}
"""Group name -> ``agree_on_values`` calls so far (every rank makes them in the same order: ``shard()`` is collective)."""


def agree_on_values(group: dist.ProcessGroup, fingerprints: Callable[[], Sequence[tuple[str, str, str]]]) -> None:
    """Raise on every rank of ``group`` if its ``(unit, layout, values)`` fingerprints differ in values from rank
    0's, naming the first differing unit: ranks that start from different weights would train a mixture of them,
    silently (each keeps its own chunk). Units that differ in layout are left to the collectives' check, which
    names the first differing collective. Through the group's store; skipped (and logged) under the fake
    process group. ``fingerprints`` is called only where there are peers to compare with."""
    if dist.get_world_size(group) == 1:
        return
    if dist.get_backend(group) == "fake":
        log.info("fsdp_compile.shard: the ranks' weights are not compared under the fake process group (no peers)")
        return
    mine = fingerprints()  # exchanged even when empty (a model all on meta): no rank may skip what others wait for
    store = _internals.group_store(group)
    call = _values_checks[group.group_name] = _values_checks.get(group.group_name, 0) + 1
    keys = [f"{_PREFIX}values/{call}/{q}" for q in range(dist.get_world_size(group))]
    store.set(keys[dist.get_rank(group)], json.dumps([list(f) for f in mine]))
    store.wait(keys)
    lists = [json.loads(store.get(key)) for key in keys]
    if any([u[:2] for u in other] != [u[:2] for u in lists[0]] for other in lists[1:]):
        return
    for q, other in enumerate(lists[1:], 1):
        differ = next((theirs[0] for theirs, ref in zip(other, lists[0]) if theirs != ref), None)
        if differ is not None:
            raise ValueError(
                f"fsdp_compile.shard(): rank {q} (of group {group.group_name}) starts from other values than rank 0 "
                f"in unit {differ!r}, and each rank would keep its own chunk of different weights. Seed every rank "
                "alike (torch.manual_seed) before building the model, load the same checkpoint on every rank, or "
                "pass shard(..., sync_module_states=True) to take rank 0's values (a broadcast per unit)"
            )


def fingerprint(params: Sequence[torch.Tensor]) -> str:
    """A cheap digest of parameters' values: their shapes and up to 64 evenly spaced elements each."""
    digest = hashlib.sha256()
    for p in params:
        flat = p.detach().reshape(-1)
        count = min(flat.numel(), 64)  # integer positions: a float linspace rounds past the end of a large tensor
        index = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        digest.update(str(tuple(p.shape)).encode())
        digest.update(flat[index].cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
