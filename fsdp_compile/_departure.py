"""What a rank says in its group's store when it leaves a step early (:class:`Departure`), and what every rank
raises for the departure that poisons the group (:class:`RankFailed`, public as ``fsdp_compile.RankFailed``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fsdp_compile import _internals

__all__ = ["Departure", "RankFailed", "describe", "root_cause"]


class RankFailed(RuntimeError):
    """A rank of a process group that a sharded model runs over failed or stopped, so the model's collectives can
    no longer complete. ``rank``: that rank (global; -1 where the group's store was lost, not a rank); ``reason``:
    what it said (its exception, where, which step). The group cannot be used any more: restart every rank from the
    last checkpoint."""

    def __init__(self, message: str, *, rank: int, reason: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True)
class Departure:
    """A rank that left a step early: ``rank`` (global), ``seq`` (collectives it had issued over the group then)
    and ``reason`` (e.g. "raised ValueError: bad batch (in the forward of step 2, unit 'layers.1')")."""

    rank: int
    seq: int
    reason: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str | bytes) -> Departure:
        return Departure(**json.loads(text))


RankFailed.__module__ = "fsdp_compile"  # as tracebacks name it


def root_cause(error: BaseException) -> BaseException:
    """``error``, or what torch.compile wrapped in it: a backend's exception reaches the caller as Dynamo's
    ``BackendCompilerFailed``, whose first line names the backend, not the cause."""
    while isinstance(error, _internals.BackendCompilerFailed) and error.inner_exception is not None:
        error = error.inner_exception
    return error


def describe(error: BaseException, chars: int) -> str:
    """``"ValueError: bad batch"``: the exception's type and the first line of its message (at most ``chars``)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:chars] if text else ''}"
