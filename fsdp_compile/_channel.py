"""The failure channel of a process group: when a rank leaves a step of a sharded model early (an exception left
its forward or backward, or a forward went without its backward), it says so in the group's store, and every rank
that waits in a collective the departed rank will never issue raises :class:`RankFailed` within seconds, naming it,
instead of hanging until the transport's timeout. Ranks that all leave at the same place (the same bad batch
everywhere) go on. A watcher thread per group does the store traffic, so a collective costs nothing more.

The protocol, what is aborted and what a process is left with: [Note: failures] in docs/architecture.md.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile import _internals

__all__ = ["Channel", "Departure", "RankFailed", "channel_named", "channel_of"]

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a watcher looks for departures (one store round trip)."""
BEAT_S = 0.5
"""How often a watcher writes its heartbeat (where this rank is: its collectives issued, the one it waits in)."""
DEAD_S = 10.0
"""A rank whose heartbeat stands still this long is gone (killed, out of host memory): every rank raises."""
_WAIT_POLL_S = 0.05
_PREFIX = "fsdp_compile/failures/"


class RankFailed(RuntimeError):
    """A rank of a process group that a sharded model runs over failed or stopped, so the model's collectives can
    no longer complete. ``rank``: that rank (global); ``reason``: what it said (its exception, where, which step).
    The group cannot be used any more: restart every rank from the last checkpoint."""

    def __init__(self, message: str, *, rank: int, reason: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True)
class Departure:
    """A rank that left a step early: ``rank`` (global), ``seq`` (collectives it had issued over the group then)
    and ``reason`` (e.g. "raised ValueError('bad batch') in the forward of step 2, unit 'layers.1'")."""

    rank: int
    seq: int
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> Departure:
        return Departure(**json.loads(text))


_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, Channel] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def channel_of(group: dist.ProcessGroup, device: torch.device) -> Channel:
    """The channel of ``group`` (a group of more than one rank with a store), made and watched at the first call."""
    with _lock:
        channel = _channels.get(group)
        if channel is None:
            channel = _channels[group] = Channel(group, device)
        return channel


def channel_named(group_name: str) -> Channel | None:
    """The channel of the live group named ``group_name``, if it has one."""
    with _lock:
        return next((c for g, c in _channels.items() if c.group_name == group_name and _internals.group_alive(g)), None)


class Channel:
    """One process group's failure channel on this rank: its departures, its heartbeat, and whether the group is
    poisoned (``cause``: the departure every rank raises for). ``where`` says, for the heartbeat, what this rank
    is doing (set by the models that run over the group)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self._group = weakref.ref(group)
        self.group_name: str = group.group_name
        self.store = _internals.group_store(group)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_ranks = [dist.get_global_rank(group, q) for q in range(self.world_size)]
        self.backend = dist.get_backend(group)
        self.timeout = _internals.group_timeout(group, device).total_seconds()
        self.epoch = 0
        """The step-leaving round this rank is in: it advances when every rank left at the same place."""
        self.cause: Departure | None = None
        self.waiting: int | None = None
        """The collective (sequence number) the main thread waits for, if it waits."""
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()
        """The models that run over the group: the watcher asks each ``where()`` it is (for the heartbeat) and has
        each ``poll()`` (a backward that ended without a word) every round."""
        self._departed: set[int] = set()
        self._lock = threading.Lock()
        self._waits: queue.SimpleQueue[tuple[torch.Tensor, threading.Event, list[BaseException]]] | None = None
        self._beats_sent = 0
        self._unsettled = False
        self._beat()
        threading.Thread(target=self._watch, name=f"fsdp_compile-watch-{self.group_name}", daemon=True).start()

    # -- the main thread --------------------------------------------------------------------------------------

    def seq(self) -> int:
        group = self._group()
        return -1 if group is None else _internals.group_sequence_number(group)

    def depart(self, reason: str, seq: int | None = None) -> None:
        """Tell the other ranks that this rank left the current round's step early (once a round)."""
        with self._lock:
            if self.cause is not None or self.epoch in self._departed:
                return
            self._departed.add(self.epoch)
            epoch = self.epoch
        departure = Departure(dist.get_rank(), self.seq() if seq is None else seq, reason)
        log.warning("fsdp_compile: rank %d left a step early (group %s): %s", departure.rank, self.group_name, reason)
        self.store.append(f"{_PREFIX}left/{epoch}", departure.to_json() + "\n")
        self.store.add(f"{_PREFIX}events", 1)

    def settle(self) -> None:
        """Before this rank issues the model's next collective: raise if the group is poisoned; if this rank left
        the current round's step, wait until every rank has left it at the same place (then go on) or one went
        further (then raise :class:`RankFailed`)."""
        self.check()
        if self.epoch not in self._departed:
            return
        start, pause = time.monotonic(), 0.001
        while True:
            self.check()
            left = self._left(self.epoch)
            if len(left) == self.world_size and len({d.seq for d in left.values()}) == 1:
                with self._lock:
                    self.epoch += 1
                return
            self._decide(left)
            if time.monotonic() - start > self.timeout:
                self._poison(next(iter(left.values())), f"the other ranks did not follow within {self.timeout:.0f} s")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def check(self) -> None:
        if self.cause is not None:
            raise self.failure()

    def waiting_for_this_rank(self) -> tuple[int, int, str] | None:
        """(global rank, collective, where) of a rank that waits in a collective this rank has not issued, if any."""
        mine = self.seq()
        beats = self._beats([q for q in range(self.world_size) if q != self.rank])
        waiting = [(q, b) for q, b in beats.items() if b["waiting"] is not None and b["seq"] > mine]
        if not waiting:
            return None
        q, beat = waiting[0]
        return self.global_ranks[q], beat["waiting"], beat["where"]

    def failure(self) -> RankFailed:
        """The error this rank raises for the group's poisoning departure."""
        cause = self.cause
        assert cause is not None
        me = dist.get_rank()
        who = "this rank" if cause.rank == me else f"rank {cause.rank}"
        return RankFailed(
            f"fsdp_compile: {who} {cause.reason}. Rank {me} cannot complete the collectives of process group "
            f"{self.group_name!r} any more: restart every rank from the last checkpoint (torchrun --max-restarts=N; "
            "docs: README, Failures)",
            rank=cause.rank,
            reason=cause.reason,
        )

    def wait(self, tensor: torch.Tensor) -> torch.Tensor:
        """``wait_tensor(tensor)`` for a collective of this group, given up with :class:`RankFailed` as soon as the
        group is poisoned (gloo cannot abort an operation in flight: a helper thread waits for it instead)."""
        self.check()
        if self._waits is None:
            self._waits = queue.SimpleQueue()
            threading.Thread(target=self._wait_loop, name=f"fsdp_compile-wait-{self.group_name}", daemon=True).start()
        done, error = threading.Event(), []
        self.waiting = waited_for = self.seq()
        self._waits.put((tensor, done, error))
        try:
            while not done.wait(_WAIT_POLL_S):
                self.check()
        finally:
            self.waiting = None
        if error:
            self._explain(error[0], waited_for)
        return tensor

    def _wait_loop(self) -> None:
        assert self._waits is not None
        while True:
            tensor, done, error = self._waits.get()
            try:
                _internals.c10d_functional.wait_tensor(tensor)
            except BaseException as e:  # handed to the waiting thread
                error.append(e)
            done.set()

    def _explain(self, error: BaseException, waited_for: int) -> None:
        """A collective failed: raise :class:`RankFailed` naming the rank to blame. A rank that is alive but never
        issued the collective (the transport timed out) is named at once; a rank whose connection closed (it died)
        once the watchers have found which (within ``DEAD_S``). The transport's own error where none is found."""
        late = {q: b for q, b in self._beats([q for q in range(self.world_size) if q != self.rank]).items()
                if b["seq"] < waited_for}
        if late:
            q, beat = min(late.items())
            self._poison(Departure(self.global_ranks[q], beat["seq"], f"never issued collective #{waited_for} of the "
                                   f"group: it issued {beat['seq']} and is {beat['where']}"), "a collective timed out")
        deadline = time.monotonic() + DEAD_S + 4 * BEAT_S
        while self.cause is None and time.monotonic() < deadline:
            time.sleep(_WAIT_POLL_S)
        if self.cause is not None:
            raise self.failure() from error
        raise error

    # -- the watcher ------------------------------------------------------------------------------------------

    def where(self) -> str:
        busy = [w for w in (model.where() for model in list(self.models)) if w is not None]
        return busy[0] if busy else "outside the model"

    def _beat(self) -> None:
        self._beats_sent += 1
        beat = {"n": self._beats_sent, "seq": self.seq(), "waiting": self.waiting, "where": self.where()}
        self.store.set(f"{_PREFIX}beat/{self.rank}", json.dumps(beat))

    def _watch(self) -> None:
        events, next_beat = 0, time.monotonic() + BEAT_S
        neighbour = (self.rank + 1) % self.world_size
        last_seen: tuple[int, float] | None = None  # the neighbour's beat number, and when it last changed
        while self.cause is None:
            group = self._group()
            if group is None or not _internals.group_alive(group):
                return
            del group
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._beat()
                    next_beat = now + BEAT_S
                    last_seen = self._watch_neighbour(neighbour, last_seen)
                for model in list(self.models):
                    model.poll()
                changed = self.store.add(f"{_PREFIX}events", 0)
                if changed != events or self._unsettled:
                    events = changed
                    self._read_poison()
                    if self.cause is None:
                        left = self._left(self.epoch)
                        self._unsettled = bool(left)
                        self._decide(left)
            except RuntimeError as e:  # the store is gone (the process that served it died)
                self._take(Departure(-1, -1, f"could not be reached: the process group's store failed ({e})"))
            time.sleep(POLL_S)

    def _watch_neighbour(self, neighbour: int, last_seen: tuple[int, float] | None) -> tuple[int, float] | None:
        """Each rank watches the next one's heartbeat (a ring: every rank is watched, at one read a beat)."""
        beat = self._beats([neighbour]).get(neighbour)
        if beat is None:
            return last_seen
        now = time.monotonic()
        if last_seen is None or beat["n"] != last_seen[0]:
            return beat["n"], now
        if now - last_seen[1] > DEAD_S:
            self._poison(
                Departure(self.global_ranks[neighbour], beat["seq"], f"stopped answering for {DEAD_S:.0f} s "
                          f"(killed, out of host memory, or stopped; it was {beat['where']})"),
                "its heartbeat stood still",
            )
        return last_seen

    def _beats(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        keys = {q: f"{_PREFIX}beat/{q}" for q in ranks if self.store.check([f"{_PREFIX}beat/{q}"])}
        values = self.store.multi_get(list(keys.values())) if keys else []
        return {q: json.loads(v) for q, v in zip(keys, values)}

    def _left(self, epoch: int) -> dict[int, Departure]:
        key = f"{_PREFIX}left/{epoch}"
        if not self.store.check([key]):
            return {}
        lines = self.store.get(key).decode().splitlines()
        departures = [Departure.from_json(line) for line in lines]
        return {d.rank: d for d in departures}

    def _decide(self, left: dict[int, Departure]) -> None:
        """Poison the group if the ranks that left this round's step left at different places, or another rank went
        on past where they left (it waits, or will wait, in a collective they never issue)."""
        if not left:
            return
        first = min(left.values(), key=lambda d: (d.seq, d.rank))
        if len({d.seq for d in left.values()}) > 1:
            self._poison(first, "the ranks left the step at different places")
            return
        stayed = [q for q in range(self.world_size) if self.global_ranks[q] not in left]
        beats = self._beats([q for q in stayed if q != self.rank])
        if self.rank in stayed:
            beats[self.rank] = {"seq": self.seq(), "where": self.where()}
        ahead = [q for q, beat in beats.items() if beat["seq"] > first.seq]
        if ahead:
            self._poison(first, f"rank {self.global_ranks[ahead[0]]} went on ({beats[ahead[0]]['where']})")

    def _poison(self, cause: Departure, why: str) -> None:
        log.error("fsdp_compile: process group %s poisoned: rank %d %s; %s", self.group_name, cause.rank, cause.reason, why)
        self.store.compare_set(f"{_PREFIX}poison", "", cause.to_json())
        self.store.add(f"{_PREFIX}events", 1)
        self._read_poison()

    def _read_poison(self) -> None:
        if self.store.check([f"{_PREFIX}poison"]):
            self._take(Departure.from_json(self.store.get(f"{_PREFIX}poison")))

    def _take(self, cause: Departure) -> None:
        """The group is poisoned: every wait gives up; NCCL's collectives in flight are aborted."""
        with self._lock:
            if self.cause is not None:
                return
            self.cause = cause
        group = self._group()
        if group is not None and self.backend == "nccl" and _internals.group_alive(group):
            _internals.abort_group(group)
