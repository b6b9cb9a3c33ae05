"""The failure channel of a process group: when a rank leaves a step of a sharded model early (an exception left
its forward or backward, or a forward went without its backward), it says so in the group's store, and every rank
that waits in a collective the departed rank will never issue raises :class:`RankFailed` within seconds, naming it,
instead of hanging until the transport's timeout. Ranks that all leave at the same place (the same bad batch
everywhere) go on. A watcher thread per group does the store traffic, so a collective costs nothing more.

The protocol, what is aborted and what a process is left with: [Note: failures] in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist

from fsdp_compile import _internals
from fsdp_compile._departure import Departure, RankFailed
from fsdp_compile._internals import failures

__all__ = ["BEAT_S", "Channel", "helper_waits", "watchers"]

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a watcher looks for departures (one store round trip)."""
BEAT_S = 0.5
"""How often a watcher writes its heartbeat (where this rank is: its collectives issued, the one it waits in)."""
DEAD_S = 10.0
"""A rank whose heartbeat stands still this long is gone (killed, aborted, stuck): every rank raises."""
ENDED_HOW = ("killed (by the out-of-memory killer, say) or aborted by a library (gloo aborts a rank whose collective "
             "differs in size from its peers'): that rank's own output says which")
DIED = f"died (its connection closed and its heartbeat stopped: its process ended without a word, {ENDED_HOW})"
"""What is known of a rank whose process ended under its peers, and no more."""
_PREFIX = "fsdp_compile/failures/"
watchers: set[threading.Thread] = set()
"""The watcher threads still running (those of destroyed groups end within ``POLL_S``): joined as the process ends."""
helper_waits: set[str] = set()
"""The groups (by name) whose gloo collective a helper thread waits for now (``fsdp_compile.runtime.gloo_wait``)."""


class Channel:
    """One process group's failure channel on this rank: its departures, its heartbeat, and whether the group is
    poisoned (``cause``: the departure every rank raises for). ``models`` run over the group: the heartbeat says
    ``where()`` they are, and the watcher has each ``poll()`` (a backward that ended without a word) every round."""

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
        """The round of departures this rank is in: it advances when every rank left a step at the same place."""
        self.cause: Departure | None = None
        self.waiting: int | None = None
        """The collective (sequence number) the main thread waits for, if it waits (``runtime.gloo_wait``)."""
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()
        self._departed: set[int] = set()
        self._lock = threading.Lock()
        self._beats_sent = 0
        self._unsettled = False
        self._closing = False
        self.beat()
        self._watcher = threading.Thread(target=self._watch, name=f"fsdp_compile-watch-{self.group_name}", daemon=True)
        watchers.add(self._watcher)
        self._watcher.start()

    def alive(self) -> bool:
        """Whether the group is still registered (not destroyed)."""
        return (group := self._group()) is not None and failures.group_alive(group)

    def seq(self) -> int:
        group = self._group()
        return -1 if group is None else failures.group_sequence_number(group)

    def where(self) -> str:
        busy = [w for w in (model.where() for model in list(self.models)) if w is not None]
        return busy[0] if busy else "outside the model"

    def depart(self, reason: str, quiet: bool = False) -> None:
        """Tell the other ranks that this rank left the current round's step early (once a round); ``quiet``: it may
        well be legal (another forward of the step, which every rank makes), and is logged only if the group is
        poisoned for it."""
        with self._lock:
            if self.cause is not None or self.epoch in self._departed:
                return
            self._departed.add(self.epoch)
            epoch = self.epoch
        departure = Departure(dist.get_rank(), self.seq(), reason)
        if quiet:
            log.debug("fsdp_compile: rank %d calls the model again before a backward (group %s): checking that every "
                      "rank does", departure.rank, self.group_name)
        else:
            log.warning("fsdp_compile: rank %d left a step early (group %s): %s", departure.rank, self.group_name, reason)
        self.store.append(f"{_PREFIX}left/{epoch}", departure.to_json() + "\n")
        self.store.add(f"{_PREFIX}events", 1)

    def settle(self) -> None:
        """Before this rank issues the model's next collective: raise if the group is poisoned; if this rank left
        the current round's step, wait until every rank has left it at the same place (then go on) or one went
        further (then raise :class:`RankFailed`)."""
        self.check()
        start, pause = time.monotonic(), 0.001
        while self.epoch in self._departed:
            try:
                self._read_poison()
                left = self._left(self.epoch)
                if self.cause is None and len(left) == self.world_size and len({d.seq for d in left.values()}) == 1:
                    with self._lock:
                        self.epoch += 1
                    return
                self._decide(left)
                if time.monotonic() - start > self.timeout:
                    self._poison(min(left.values(), key=lambda d: d.rank), f"no decision within {self.timeout:.0f} s")
            except RuntimeError as e:
                self._lost_store(e)
            self.check()
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def check(self) -> None:
        if self.cause is not None:
            raise self.failure()

    def failure(self) -> RankFailed:
        """The error this rank raises for the group's poisoning departure."""
        cause = self.cause
        assert cause is not None
        me = dist.get_rank()
        who = "this rank " if cause.rank == me else "" if cause.rank == -1 else f"rank {cause.rank} "
        return RankFailed(
            f"fsdp_compile: {who}{cause.reason}. Rank {me} cannot complete the collectives of process group "
            f"{self.group_name!r} any more: restart every rank from the last checkpoint (torchrun --max-restarts=N; "
            "docs/failures.md)",
            rank=cause.rank,
            reason=cause.reason,
        )

    def waiting_for_this_rank(self) -> tuple[int, int, str] | None:
        """(global rank, collective, where) of a rank that waits in a collective this rank has not issued, if any."""
        mine = self.seq()
        waiting = [(q, b) for q, b in self._peer_beats().items() if b["waiting"] is not None and b["seq"] > mine]
        return (self.global_ranks[waiting[0][0]], waiting[0][1]["waiting"], waiting[0][1]["where"]) if waiting else None

    def explain(self, error: BaseException, waited_for: int) -> None:
        """A collective of the group (``waited_for``: its sequence number) failed: raise :class:`RankFailed` naming
        the rank to blame: one whose heartbeat stopped with its connection (it died), one that ended its process,
        one that is alive and never issued the collective (the transport timed out); or that the watchers found.
        The transport's own error if no rank is to blame within ``DEAD_S``."""
        try:
            self._blame(error, waited_for)
        except RuntimeError as e:
            self._lost_store(e)
        if self.cause is not None:
            raise self.failure() from error
        raise error

    def _blame(self, error: BaseException, waited_for: int) -> None:
        first, start = self._peer_beats(), time.monotonic()
        while self.cause is None and time.monotonic() - start < DEAD_S:
            time.sleep(BEAT_S)
            beats = self._peer_beats()
            gone = [(q, b) for q, b in beats.items() if b["n"] == -1]
            died = [(q, b) for q, b in beats.items() if b["n"] == first.get(q, {}).get("n")]
            late = [(q, b) for q, b in beats.items()
                    if b["seq"] < waited_for and b["n"] not in (-1, first.get(q, {}).get("n"))]  # alive
            for blamed, reason in ((gone, "ended its process, or destroyed the group"),
                                   (died if time.monotonic() - start > 4 * BEAT_S else [], DIED),
                                   (late, f"never issued collective #{waited_for} of the group")):
                if blamed and self.cause is None:
                    q, beat = blamed[0]
                    where = "" if beat["n"] == -1 else f"; it was {beat['where']}"
                    blame = Departure(self.global_ranks[q], beat["seq"], reason + where)
                    self._poison(blame, str(error).splitlines()[0])

    def _lost_store(self, error: RuntimeError) -> None:
        """The group's store failed: the process that served it ended (rank 0's, or torchrun's agent)."""
        reason = f"the process group's store could not be reached (the process that served it ended?): {error}"
        self._take(Departure(-1, -1, reason.splitlines()[0]))

    # -- the watcher ------------------------------------------------------------------------------------------

    def beat(self, gone: bool = False) -> None:
        """Write this rank's heartbeat; ``gone``: its last (the process ends, or destroyed the group)."""
        self._beats_sent += 1
        if gone:
            beat = {"n": -1, "seq": -1, "waiting": None, "where": "gone: its process ended or destroyed the group"}
        else:
            beat = {"n": self._beats_sent, "seq": self.seq(), "waiting": self.waiting, "where": self.where()}
        self.store.set(f"{_PREFIX}beat/{self.rank}", json.dumps(beat))

    def close(self) -> None:
        """The process ends: stop the watcher (a daemon thread that comes back from the store's C++ code while the
        interpreter shuts down aborts the process), and say so in a last heartbeat."""
        self._closing = True
        self._watcher.join(timeout=4 * POLL_S)
        if self.alive():
            self.beat(gone=True)

    def _watch(self) -> None:
        events, next_beat = 0, time.monotonic() + BEAT_S
        neighbour = (self.rank + 1) % self.world_size  # a ring: every rank watched, at one read a beat
        last: tuple[int, float] | None = None  # the neighbour's beat number, and when it last changed
        while self.cause is None and not self._closing:
            if not self.alive():
                with contextlib.suppress(RuntimeError):
                    self.beat(gone=True)
                break
            try:
                if time.monotonic() >= next_beat:
                    self.beat()
                    next_beat = time.monotonic() + BEAT_S
                    last = self._watch_neighbour(neighbour, last)
                for model in list(self.models):
                    model.poll()
                if (changed := self.store.add(f"{_PREFIX}events", 0)) != events or self._unsettled:
                    events = changed
                    self._read_poison()
                    left = self._left(self.epoch)
                    self._unsettled = bool(left)
                    self._decide(left)
            except RuntimeError as e:  # the store is gone (the process that served it died)
                self._lost_store(e)
            time.sleep(POLL_S)
        watchers.discard(threading.current_thread())

    def _watch_neighbour(self, neighbour: int, last: tuple[int, float] | None) -> tuple[int, float] | None:
        beat = self._beats([neighbour]).get(neighbour)
        if beat is None or beat["n"] == -1:
            return None
        if last is None or beat["n"] != last[0]:
            return beat["n"], time.monotonic()
        if time.monotonic() - last[1] > DEAD_S:
            reason = f"stopped answering for {DEAD_S:.0f} s (stuck, or ended without a word: {ENDED_HOW}; it was " \
                     f"{beat['where']})"
            self._poison(Departure(self.global_ranks[neighbour], beat["seq"], reason), "its heartbeat stood still")
        return last

    def _peer_beats(self) -> dict[int, dict[str, Any]]:
        return self._beats([q for q in range(self.world_size) if q != self.rank])

    def _beats(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        keys = {q: f"{_PREFIX}beat/{q}" for q in ranks if self.store.check([f"{_PREFIX}beat/{q}"])}
        values = self.store.multi_get(list(keys.values())) if keys else []
        return {q: json.loads(v) for q, v in zip(keys, values)}

    def _left(self, epoch: int) -> dict[int, Departure]:
        key = f"{_PREFIX}left/{epoch}"
        lines = self.store.get(key).decode().splitlines() if self.store.check([key]) else []
        return {d.rank: d for d in map(Departure.from_json, lines)}

    def _decide(self, left: dict[int, Departure]) -> None:
        """Poison the group if the ranks that left this round's step left at different places, or another rank went
        on past where they left (it waits, or will wait, in a collective they never issue)."""
        if not left or self.cause is not None:
            return
        first = min(left.values(), key=lambda d: (d.seq, d.rank))
        if len({d.seq for d in left.values()}) > 1:
            self._poison(first, "the ranks left the step at different places")
            return
        stayed = {q for q in range(self.world_size) if self.global_ranks[q] not in left}
        beats = {q: b for q, b in self._beats(sorted(stayed - {self.rank})).items() if b["n"] != -1}
        if self.rank in stayed:
            beats[self.rank] = {"seq": self.seq(), "where": self.where()}
        ahead = [q for q, beat in beats.items() if beat["seq"] > first.seq]
        if ahead:
            self._poison(first, f"rank {self.global_ranks[ahead[0]]} went on ({beats[ahead[0]]['where']})")

    def _poison(self, cause: Departure, why: str) -> None:
        log.error("fsdp_compile: group %s poisoned: rank %d %s; %s", self.group_name, cause.rank, cause.reason, why)
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
        if (group := self._group()) is not None and self.backend == "nccl" and failures.group_alive(group):
            failures.abort_group(group)
