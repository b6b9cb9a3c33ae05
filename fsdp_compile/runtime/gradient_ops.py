"""The ops that write a unit's flat gradient in place (``passes/write_gradients_in_place.py`` puts them into
backward graphs): a weight gradient's matmul into its slice, another piece copied into its slice, the gaps zeroed.
Step ops (``_internals.step_ops``): Inductor orders them as the writes they are and its wrapper calls them
directly."""

from __future__ import annotations

import torch

from fsdp_compile._internals import step_ops

__all__ = ["COPY_INTO", "MM_INTO", "ZERO_INTO", "copy_into", "mm_into", "zero_into"]


def _no_output(*args: object, **kwargs: object) -> None:
    return None


@step_ops.step_op("fsdp_compile::mm_into", "(Tensor a, Tensor b, *, Tensor(a!) out) -> ()", _no_output)
def mm_into(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> None:
    """``out = a @ b``, in place."""
    torch.mm(a, b, out=out)


MM_INTO = mm_into


@step_ops.step_op("fsdp_compile::copy_into", "(Tensor src, *, Tensor(a!) out) -> ()", _no_output)
def copy_into(src: torch.Tensor, *, out: torch.Tensor) -> None:
    out.copy_(src)


COPY_INTO = copy_into


@step_ops.step_op("fsdp_compile::zero_into", "(Tensor(a!) out, SymInt[] starts, SymInt[] ends) -> ()", _no_output)
def zero_into(out: torch.Tensor, starts: list[int], ends: list[int]) -> None:
    """Zero ``out[start:end]`` for each (start, end)."""
    for start, end in zip(starts, ends):
        out[start:end].zero_()


ZERO_INTO = zero_into
