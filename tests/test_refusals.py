"""Every refusal of ``shard()`` leaves the module as it was (parameters, classes, hooks, values): checked before
touched, by test. The table below holds one case per ``raise`` of ``shard()``'s checks, and the test fails if a
check is added without a case (the ranks disagreeing on their weights needs two real ranks:
tests/test_init_parameters.py)."""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import fsdp_compile
from fsdp_compile import _plan_shard, _shard
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.llama import LLAMA_TINY, Block, Llama
from fsdp_compile.testing.snapshot import assert_unchanged, module_snapshot


class Refusal(NamedTuple):
    setup: Callable[[], tuple[nn.Module, dict[str, Any]]]
    """The module and shard()'s arguments, made under the process group (if any)."""
    error: type[Exception]
    match: str
    process_group: bool = True
    """False: no process group is initialized."""


def _tiny(**kwargs: Any) -> Callable[[], tuple[nn.Module, dict[str, Any]]]:
    return lambda: (Llama(LLAMA_TINY), {"units": [Block], **kwargs})


def _sharded() -> Llama:
    return fsdp_compile.shard(Llama(LLAMA_TINY), units=[Block])


def _on_two_devices() -> tuple[nn.Module, dict[str, Any]]:
    model = Llama(LLAMA_TINY)
    with FakeTensorMode():  # a parameter on a second device, without one
        model.norm.weight = nn.Parameter(torch.ones(LLAMA_TINY.dim, device="cuda"))
    return model, {"units": [Block]}


def _tied_across_units() -> tuple[nn.Module, dict[str, Any]]:
    model = Llama(LLAMA_TINY)
    model.layers[2].attention.wq.weight = model.layers[0].attention.wq.weight
    return model, {"units": [Block]}


def _compiled_submodule() -> tuple[nn.Module, dict[str, Any]]:
    model = Llama(LLAMA_TINY)
    model.layers[1] = torch.compile(model.layers[1])
    return model, {"units": [Block]}


REFUSALS = {
    "already-sharded": Refusal(lambda: (_sharded(), {"units": [Block]}), ValueError,
                               "already sharded by fsdp_compile.shard"),
    "part-of-a-sharded-model": Refusal(lambda: (_sharded().layers[0], {"units": [nn.Linear]}), ValueError,
                                       "already sharded"),
    "group-and-mesh": Refusal(_tiny(group="WORLD", mesh=(2,)), ValueError,
                              r"pass group= or mesh= to fsdp_compile.shard\(\), not both"),
    "not-a-mesh": Refusal(_tiny(mesh="dp"), TypeError,
                          "mesh must be a torch.distributed.device_mesh.DeviceMesh, got str"),
    "3-d-mesh": Refusal(_tiny(mesh=(2, 1, 1)), ValueError,
                        r"a mesh of 1 dimension \(shard\) or 2 \(replicate, shard\), got 3 dimensions"),
    "rank-not-in-mesh": Refusal(_tiny(mesh="rank 1 only"), ValueError,
                                r"this rank \(global rank 0\) is not in the mesh"),
    "no-process-group": Refusal(_tiny(), RuntimeError, r"init_process_group\(\) first .* or pass group=", False),
    "not-a-member": Refusal(_tiny(group="rank 1 only"), ValueError,
                            r"this rank \(global rank 0\) is not a member of the process group passed as group="),
    "group-of-the-wrong-type": Refusal(_tiny(group=2), TypeError, "group must be a torch.distributed.ProcessGroup"),
    "mp-of-the-wrong-type": Refusal(_tiny(mp=torch.bfloat16), TypeError, "mp must be a fsdp_compile.MixedPrecision"),
    "offload-of-the-wrong-type": Refusal(_tiny(offload_policy="cpu"), TypeError,
                                         r"offload_policy must be torch.distributed.fsdp.CPUOffloadPolicy \(or "
                                         r"OffloadPolicy\(\): none\), as FSDP2's fully_shard takes it, got str"),
    "reshard-of-the-wrong-type": Refusal(_tiny(reshard_after_forward="output"), TypeError,
                                         "reshard_after_forward must be a bool or a predicate"),
    "compiled": Refusal(lambda: (torch.compile(Llama(LLAMA_TINY)), {"units": [Block]}), TypeError,
                        r"wrapped by torch.compile \(<the module itself>\): shard the plain model first"),
    "compiled-submodule": Refusal(_compiled_submodule, TypeError, r"wrapped by torch.compile \(layers.1\)"),
    "units-of-the-wrong-type": Refusal(_tiny(units=["Block"]), TypeError,
                                       "units must be an iterable of nn.Module subclasses"),
    "no-units": Refusal(_tiny(units=[]), ValueError, r"units=\[\] names no unit: name at least one nn.Module subclass"),
    "units-that-match-nothing": Refusal(_tiny(units=[nn.GRU]), ValueError,
                                        r"units=\[<class .*GRU'>\] matched no submodule of Llama"),
    "no-parameters": Refusal(lambda: (nn.Sequential(nn.ReLU()), {"units": [nn.ReLU]}), ValueError,
                             "Sequential has no parameters to shard"),
    "several-devices": Refusal(_on_two_devices, ValueError,
                               r"several devices \(.*'norm.weight' on cuda.*move the whole model"),
    "tied-across-units": Refusal(_tied_across_units, ValueError,
                                 r"'layers.0.attention.wq.weight' is shared by modules of different units "
                                 r"\['layers.0', 'layers.2'\]"),
}


def _resolve(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Process groups and meshes named in the table, made now that the group exists."""
    groups = {"WORLD": lambda: dist.group.WORLD, "rank 1 only": lambda: dist.new_group([1])}
    if kwargs.get("group") in groups:
        kwargs["group"] = groups[kwargs["group"]]()
    if isinstance(kwargs.get("mesh"), tuple):
        kwargs["mesh"] = init_device_mesh("cpu", kwargs["mesh"])
    elif kwargs.get("mesh") == "rank 1 only":
        kwargs["mesh"] = DeviceMesh("cpu", [1])
    return kwargs


def _raise_site(tb: types.TracebackType | None) -> tuple[str, int]:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    assert tb is not None
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno


def _raises_of(*modules: types.ModuleType) -> set[tuple[str, int]]:
    return {(m.__file__, node.lineno) for m in modules for node in ast.walk(ast.parse(inspect.getsource(m)))
            if isinstance(node, ast.Raise)}  # type: ignore[misc]


def test_every_refusal_of_shard_leaves_the_module_unchanged() -> None:
    reached = set()
    for name, case in REFUSALS.items():
        if case.process_group:
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            model, kwargs = case.setup()
            kwargs = _resolve(kwargs)
            before = module_snapshot(model)
            with pytest.raises(case.error, match=case.match) as caught:
                fsdp_compile.shard(model, **kwargs)
            assert_unchanged(before, module_snapshot(model))
            reached.add(_raise_site(caught.tb))
        except BaseException as e:
            raise AssertionError(f"refusal case {name!r}") from e
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    untested = _raises_of(_shard, _plan_shard) - reached
    assert not untested, f"shard() refusals without a case in REFUSALS: {sorted(untested)}"


def _not_a_member(rank: int, world_size: int) -> None:
    only_rank0 = dist.new_group([0])
    model = Llama(LLAMA_TINY)
    if rank == 0:
        fsdp_compile.shard(model, units=[Block], group=only_rank0)
        assert fsdp_compile.sharded_units(model)[0].world_size == 1
    else:
        before = module_snapshot(model)
        with pytest.raises(ValueError, match=r"this rank \(global rank 1\) is not a member of the process group "
                                             r"passed as group="):
            fsdp_compile.shard(model, units=[Block], group=only_rank0)
        assert_unchanged(before, module_snapshot(model))


def test_a_group_this_rank_is_not_in_shards_on_its_members_only() -> None:
    """On real ranks: rank 0 shards over the group of itself, rank 1 (not in it) is refused, its model unchanged."""
    run_ranks(_not_a_member, 2)
