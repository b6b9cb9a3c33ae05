"""lower_to_copy_engines at graph level (CPU, fake process group, the scheduled AOT graphs under aot_eager).
Copy-engine all-gathers need GPUs to run: ``test_parity_nccl_inductor[...-copy_engine]`` checks their
numerics and ``tests/test_gpu_overlap.py`` that they run on copy engines, beside compute."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp_compile
from fsdp_compile._internals import MissingTorchFeature, symm_mem
from fsdp_compile.lowering.choose_route import RouteChoice, choose_route
from fsdp_compile.lowering.lower_to_copy_engines import CopyEnginesPlan, apply_copy_engines, plan_copy_engines
from fsdp_compile.passes._graph import EXCHANGE
from fsdp_compile.passes._write_slots import slot_hazards
from fsdp_compile.testing.graphs import compile_and_capture, slotted_exchanges
from fsdp_compile.testing.llama import LLAMA_TESTS

N_UNITS = LLAMA_TESTS.n_layers + 1
_c10d = torch.ops._c10d_functional
AG, WAIT = _c10d.all_gather_into_tensor.default, _c10d.wait_tensor.default
CE = torch.ops.fsdp_compile.all_gather_copy_engine.default
CE_INTO = torch.ops.fsdp_compile.all_gather_into_slot_copy_engine.default
INTO_SLOT = torch.ops.fsdp_compile.all_gather_into_slot.default
EXCHANGE_INTO = torch.ops.fsdp_compile.exchange_into_slot.default
CE_EXCHANGE = torch.ops.fsdp_compile.exchange_into_slot_copy_engine.default
WAIT_EXCHANGE = torch.ops.fsdp_compile.wait_exchange.default
CE_WAIT = torch.ops.fsdp_compile.wait_copy_engine.default
MP = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture(scope="module")
def scheduled() -> dict[str, fx.GraphModule]:
    """The graphs with the memory plan not applied: every all-gather into a buffer of its own."""
    return compile_and_capture(mp=MP, backend_options={"compiler": "aot_eager", "memory_plan": False})


@pytest.fixture(scope="module")
def slotted() -> dict[str, fx.GraphModule]:
    """The graphs with the memory plan applied (the default), the gradient exchanges in slots too (as
    ``grad_reduce="copy_engine"`` has them; its copy engines need GPUs): every collective into its slot."""
    with slotted_exchanges():
        return compile_and_capture(mp=MP, backend_options={"compiler": "aot_eager"})


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_each_all_gather_becomes_a_copy_engine_all_gather_in_its_place(scheduled: dict, stage: str) -> None:
    gm = copy.deepcopy(scheduled[stage])
    before = [(n.name, n.target, n.args) for n in gm.graph.nodes]
    gathers = tuple(n.name for n in gm.graph.nodes if n.target == AG)
    assert len(gathers) == N_UNITS
    # plan_copy_engines refuses CPU graphs (below); the transformation itself is device-independent.
    apply_copy_engines(gm, CopyEnginesPlan(gathers=gathers, workspace_bytes=1234))
    after = [(n.name, n.target, n.args) for n in gm.graph.nodes]
    assert [name for name, _, _ in after] == [name for name, _, _ in before]  # nothing moved
    for (name, target, args), (_, new_target, new_args) in zip(before, after):
        assert (new_target, new_args) == ((CE, (*args, 1234)) if name in gathers else (target, args))
    for node in gm.graph.nodes:
        if node.target == CE:
            assert [u.target for u in node.users] == [WAIT]
            with FakeTensorMode():  # the op's fake kernel gives the all-gather's result
                shard = torch.empty(node.args[0].meta["val"].shape, dtype=node.args[0].meta["val"].dtype)
                out = CE(shard, *node.args[1:])
            assert (out.shape, out.dtype) == (node.meta["val"].shape, node.meta["val"].dtype)


@pytest.mark.parametrize("stage", ["forward", "backward"])
def test_each_all_gather_into_a_slot_becomes_a_copy_engine_one_in_its_place(slotted: dict, stage: str) -> None:
    gm = copy.deepcopy(slotted[stage])
    into = [n.name for n in gm.graph.nodes if n.target == INTO_SLOT]
    assert len(into) == N_UNITS
    expected = _waits_on_events(gm, into)
    apply_copy_engines(gm, CopyEnginesPlan(gathers=(), workspace_bytes=0, into_slots=tuple(into)))
    assert _targets_and_args(gm) == expected  # nothing else changed or moved
    assert [n.name for n in gm.graph.nodes if n.target == CE_INTO] == into
    for node in gm.graph.nodes:
        if node.target == CE_INTO:  # the shard, uncast (bf16 parameters: the op casts into its slot)
            assert node.args[0].op == "placeholder" and node.args[0].meta["val"].dtype == torch.float32
    assert slot_hazards(gm.graph) == []


def _targets_and_args(gm: fx.GraphModule, rename: dict[str, str] | None = None) -> list[tuple]:
    """Each node's target (the lowered collectives' left out: the tests check them) and its arguments by name."""
    lowered = (CE_INTO, CE_EXCHANGE, INTO_SLOT, EXCHANGE_INTO)
    return [(None if n.target in lowered else n.target,
             fx.map_arg((n.args, n.kwargs), lambda a: (rename or {}).get(a.name, a.name))) for n in gm.graph.nodes]


def _waits_on_events(gm: fx.GraphModule, lowered: list[str]) -> list[tuple]:
    """What ``_targets_and_args`` should give once the ``lowered`` collectives into slots are on copy engines: each
    one's wait (``wait_tensor(out)``, ``wait_exchange(out, gradient)``) replaced in its place by
    ``wait_copy_engine(out, gradient or None)``, what read the wait reading ``out``."""
    outs = {n.kwargs["out"].name for n in gm.graph.nodes if n.name in lowered}
    waits = {n.name: n for n in gm.graph.nodes if n.target in (WAIT, WAIT_EXCHANGE) and n.args[0].name in outs}
    assert len(waits) == len(lowered)
    rename = {name: wait.args[0].name for name, wait in waits.items()}
    return [
        (CE_WAIT, ((n.args[0].name, n.args[1].name if n.target == WAIT_EXCHANGE else None), {}))
        if n.name in waits else entry
        for n, entry in zip(gm.graph.nodes, _targets_and_args(gm, rename))
    ]


def test_plan_refuses_all_gathers_off_cuda(scheduled: dict) -> None:
    message = r"all_gather='copy_engine' needs all-gathers of CUDA tensors .* run on cpu: use all_gather='nccl'"
    with pytest.raises(ValueError, match=message):
        plan_copy_engines(scheduled["forward"].graph)


def test_backend_with_copy_engine_all_gathers_refuses_cpu_at_compile_time() -> None:
    with pytest.raises(Exception, match=r"all_gather='copy_engine' needs all-gathers of CUDA tensors"):
        compile_and_capture(mp=MP, backend_options={"compiler": "aot_eager", "all_gather": "copy_engine"})


def test_bad_all_gather_option() -> None:
    with pytest.raises(ValueError, match="all_gather must be 'nccl' or 'copy_engine' or 'auto', got 'nvshmem'"):
        fsdp_compile.backend(all_gather="nvshmem")


def test_each_exchange_into_a_slot_becomes_a_copy_engine_one_in_its_place(slotted: dict) -> None:
    gm = copy.deepcopy(slotted["backward"])
    exchanges = [n.name for n in gm.graph.nodes if n.target == EXCHANGE_INTO]
    assert len(exchanges) == N_UNITS  # bf16 gradients, fp32 sums: every unit exchanges
    expected = _waits_on_events(gm, exchanges)
    apply_copy_engines(gm, CopyEnginesPlan(gathers=(), workspace_bytes=0, exchanges=tuple(exchanges)))
    assert _targets_and_args(gm) == expected  # nothing else changed or moved
    assert [n.name for n in gm.graph.nodes if n.target == CE_EXCHANGE] == exchanges
    assert not [n for n in gm.graph.nodes if n.target == CE_INTO]  # the all-gathers: not asked for
    assert slot_hazards(gm.graph) == []


@pytest.mark.parametrize(
    "mp, options, message",
    [
        (MP, {"grad_reduce": "copy_engine"},
         r"grad_reduce='copy_engine' needs gradient exchanges of CUDA tensors .* run on cpu: use grad_reduce='nccl'"),
        (None, {"grad_reduce": "copy_engine"},
         r"grad_reduce='copy_engine' runs the gradient exchanges .* but units \['', 'layers.0', .* reduce-scatter"),
    ],
    ids=["cpu", "units-that-reduce-scatter"],
)
def test_backend_with_copy_engine_exchanges_refuses_what_it_cannot_run(
    mp: fsdp_compile.MixedPrecision | None, options: dict, message: str
) -> None:
    with pytest.raises(Exception, match=message):
        compile_and_capture(mp=mp, backend_options={"compiler": "aot_eager", **options})


def test_copy_engine_exchanges_need_the_memory_plan() -> None:
    with pytest.raises(ValueError, match="grad_reduce='copy_engine' pushes gradients into the peers' slots of the "
                                         "memory plan, which memory_plan=False does not apply"):
        fsdp_compile.backend(grad_reduce="copy_engine", memory_plan=False)


def test_auto_routes_by_nccl_on_cpu_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fsdp_compile"):
        graphs = compile_and_capture(
            mp=MP, backend_options={"compiler": "aot_eager", "all_gather": "auto", "grad_reduce": "auto"}
        )
    for option, noun in (("all_gather", "all-gathers"), ("grad_reduce", "gradient exchanges")):
        assert f"{option}='auto' chose 'nccl': {noun} on cpu: copy engines need CUDA tensors" in caplog.text
    targets = {n.target for gm in graphs.values() for n in gm.graph.nodes}
    assert INTO_SLOT in targets and not targets & {CE, CE_INTO, CE_EXCHANGE, EXCHANGE_INTO}  # NCCL: as by default


@pytest.fixture
def two_gpus_one_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """What choose_route checks, as on one host with 2 GPUs that reach each other, under torchrun."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(symm_mem, "module", lambda: None)


GPU = torch.device("cuda", 0)


@pytest.mark.usefixtures("two_gpus_one_host")
def test_auto_puts_all_gathers_over_2_ranks_on_one_host_on_copy_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    def choose(group_sizes: set[int], devices: set[torch.device]) -> RouteChoice:
        return choose_route("all_gather", group_sizes, devices)

    assert choose({2}, {GPU}).route == "copy_engine"
    assert choose({2}, {GPU, torch.device("cpu")}).reason.startswith("all-gathers on cpu, cuda")
    assert choose({2, 8}, {GPU}) == RouteChoice(
        "nccl", "groups of [2, 8] ranks: all-gathers go on copy engines over 2 and 4 ranks only (not measured over "
        "more ranks)")
    assert choose(set(), set()) == RouteChoice("nccl", "no all-gathers in this graph")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert choose({2}, {GPU}).reason == "GPU 0 has no peer access to every other visible GPU ([1])"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert choose({2}, {GPU}).route == "nccl"
    monkeypatch.setenv("WORLD_SIZE", "4")  # HSDP over 2 hosts: shard groups of 2, replicas on another host
    assert "cannot tell that every rank is on this host (LOCAL_WORLD_SIZE=2, WORLD_SIZE=4" in choose({2}, {GPU}).reason
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert choose({2}, {GPU}).route == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")

    def missing() -> None:
        raise MissingTorchFeature("fsdp_compile needs symmetric memory, which torch x lacks")

    monkeypatch.setattr(symm_mem, "module", missing)
    assert choose({2}, {GPU}) == RouteChoice("nccl", "fsdp_compile needs symmetric memory, which torch x lacks")


@pytest.mark.usefixtures("two_gpus_one_host")
def test_auto_puts_collectives_over_4_ranks_on_copy_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over 4 ranks both directions go on copy engines; over 8, NCCL."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for direction in ("all_gather", "grad_reduce"):
        chosen = choose_route(direction, {4}, {GPU})
        assert chosen.route == "copy_engine" and "19.9 vs 24.5 ms" in chosen.reason, chosen
        assert choose_route(direction, {2, 4}, {GPU}).route == "copy_engine"
    assert "1214 MiB less GPU memory" in choose_route("grad_reduce", {4}, {GPU}).reason
    assert choose_route("grad_reduce", {8}, {GPU}) == RouteChoice(
        "nccl", "groups of [8] ranks: gradient exchanges go on copy engines over 2 and 4 ranks only (not measured "
        "over more ranks)")
    assert choose_route("grad_reduce", set(), set()) == RouteChoice("nccl", "no gradient exchanges in this graph")


def _workspace_grown_mid_step(rank: int, world_size: int) -> None:
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from fsdp_compile.runtime.copy_engine import all_gather_copy_engine

    group = dist.group.WORLD.group_name
    counters.clear()
    shard = torch.full((1000,), float(rank), device="cuda", dtype=torch.bfloat16)
    want = torch.cat([torch.full((1000,), float(r), device="cuda", dtype=torch.bfloat16) for r in range(world_size)])
    for _ in range(2):  # workspace_bytes 0: not reserved at compile time, so the first call grows it
        torch.testing.assert_close(_c10d.wait_tensor(all_gather_copy_engine(shard, world_size, group, 0)), want)
    assert counters["fsdp_compile"]["copy_engine_mid_step_syncs"] == 1, dict(counters["fsdp_compile"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_a_workspace_grown_mid_step_is_counted() -> None:
    from fsdp_compile.testing.dist import spawn_ranks

    spawn_ranks(_workspace_grown_mid_step, 2, backend="nccl")


def _copy_engines_in_a_group_made_again(rank: int, world_size: int, how: str) -> None:
    """One compiled step on copy engines, then the process group destroyed and made again (same name), or only
    ``fsdp_compile.release_slabs()``, then the same step again: the slabs are made afresh and must rendezvous
    (with the new group)."""
    import torch.distributed as dist

    from fsdp_compile import _internals
    from fsdp_compile.testing.llama import Block, Llama
    from fsdp_compile.testing.reference import full_grads

    store = _internals.group_store(dist.group.WORLD)
    results = []
    for attempt in range(2):
        if attempt and how == "release":
            fsdp_compile.release_slabs()
        elif attempt:
            dist.destroy_process_group()
            dist.init_process_group("nccl", store=dist.PrefixStore("again", store), rank=rank, world_size=world_size)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(LLAMA_TESTS).cuda()
        fsdp_compile.shard(model, units=[Block], mp=MP)
        backend = fsdp_compile.backend(all_gather="copy_engine", grad_reduce="copy_engine")
        tokens = torch.randint(0, LLAMA_TESTS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
        tokens = tokens.cuda()
        loss = torch.compile(model, backend=backend)(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append({"loss": loss.detach(), **full_grads(model)})
    torch.testing.assert_close(results[1], results[0])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize("how", ["destroy", "release"])
def test_copy_engines_after_the_process_group_is_made_again_or_the_slabs_released(how: str) -> None:
    from fsdp_compile.testing.dist import spawn_ranks

    spawn_ranks(_copy_engines_in_a_group_made_again, 2, how, backend="nccl")


def test_cuda_graph_compiles_keep_inductors_caches() -> None:
    """Every route under CUDA graphs keeps Inductor's caches: a graph loaded from them reserves its slab at its
    first run on a thread of its own, out of the CUDA graphs' pool (``_internals.outside_graph_pools``; run by
    ``tests/test_gpu_exit.py``, its second run)."""
    from fsdp_compile._backend import _fixed_routes, _inductor_settings, _post_grad_passes
    from fsdp_compile.config import BackendConfig

    for options in ({}, {"all_gather": "copy_engine"}, {"grad_reduce": "copy_engine"}):
        config = BackendConfig(cudagraphs=True, **options)
        settings = _inductor_settings(config, _post_grad_passes(config, _fixed_routes(config)))
        assert not {"force_disable_caches", "fx_graph_cache"} & set(settings), settings


def test_outside_graph_pools_returns_what_it_allocated_and_raises_what_it_raised() -> None:
    from fsdp_compile._internals import outside_graph_pools

    assert outside_graph_pools(torch.device("cpu"), lambda: torch.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="no memory"):
        outside_graph_pools(torch.device("cpu"), lambda: (_ for _ in ()).throw(ValueError("no memory")))


def test_an_exchange_without_a_slot_stays_on_nccl_and_is_counted(scheduled: dict) -> None:
    """Only a symbolic size (dynamic shapes) leaves an exchange without a slot under grad_reduce='copy_engine'
    (memory_plan=False is refused when the backend is built); such an exchange stays on NCCL, said once."""
    from torch._dynamo.utils import counters

    counters.clear()
    backward = scheduled["backward"]
    plan = plan_copy_engines(backward.graph, all_gather=False, grad_reduce=True)
    exchanges = tuple(n.name for n in backward.graph.nodes if n.target == EXCHANGE)
    assert exchanges and plan == CopyEnginesPlan(gathers=(), workspace_bytes=0, left_on_nccl=exchanges)
    assert counters["fsdp_compile"]["copy_engine_exchanges_left_on_nccl"] == 0  # a plan says nothing
    apply_copy_engines(backward, plan)
    assert counters["fsdp_compile"]["copy_engine_exchanges_left_on_nccl"] == 1


def _slab_barriers(rank: int, world_size: int) -> None:
    """Stream-memory-operation barriers on a symmetric slab: each rank writes its part, a barrier, reads the
    peers' parts (what an all-gather into a slot relies on), at every round; the counters then all equal the
    number of barriers; a barrier under CUDA-graph capture is the kernel (the counters do not move)."""
    import torch.distributed as dist

    from fsdp_compile.runtime import slots as _slots

    group, device = dist.group.WORLD.group_name, torch.device("cuda", rank)
    slab = _slots.reserve_slab(group, device, 4096, symmetric=True, keep_old=False)
    assert slab.signals is not None, "the driver should have stream memory operations (CUDA 12+)"
    parts = [slab.handle.get_buffer(peer, (world_size, 256), torch.float32) for peer in range(world_size)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for round in range(20):
            parts[rank][rank].fill_(100 * round + rank)
            slab.barrier(side)
            seen = [parts[peer][peer].clone() for peer in range(world_size)]
            slab.barrier(side)  # nobody writes round + 1 before every peer has read round
            for peer, part in enumerate(seen):
                assert torch.all(part == 100 * round + peer), (round, peer)
        torch.cuda.synchronize()
    counters = slab.handle.get_buffer(rank, (world_size,), torch.int64, slab.memory.numel() // 8).tolist()
    assert slab.signals.reached == 40 and counters == [0 if peer == rank else 40 for peer in range(world_size)]
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        slab.barrier(torch.cuda.current_stream())
    assert slab.signals.reached == 40


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_slab_barriers_wait_for_every_peer() -> None:
    from fsdp_compile.testing.dist import spawn_ranks

    spawn_ranks(_slab_barriers, 2, backend="nccl")


class _FakeHandle:
    """A symmetric-memory handle over CPU tensors, one per rank, for the barrier's bookkeeping."""

    def __init__(self, rank: int, world_size: int, nbytes: int) -> None:
        self.rank, self.world_size, self.barriers = rank, world_size, 0
        self.buffers = [torch.full((nbytes,), 7, dtype=torch.uint8) for _ in range(world_size)]

    def get_buffer(self, peer: int, shape: tuple[int, ...], dtype: torch.dtype, offset: int) -> torch.Tensor:
        words = self.buffers[peer].view(dtype)
        return words[offset : offset + shape[0]]

    def barrier(self) -> None:
        self.barriers += 1


def test_the_driver_calls_fail_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver without a function the copy-engine collectives need, or a call that fails, raises with what to do
    or the driver's error code; missing stream memory operations only turn them off (the barrier kernel stays)."""
    from fsdp_compile._internals import cuda_driver

    monkeypatch.setattr(cuda_driver, "_function", lambda name, *argtypes: None)
    assert not cuda_driver.has_stream_memops()
    with pytest.raises(RuntimeError, match="has no cuMemcpyDtoDAsync_v2, which .* use all_gather='nccl'"):
        cuda_driver.copy(0, 0, 0, 0)
    monkeypatch.setattr(cuda_driver, "_function", lambda name, *argtypes: lambda *args: 1)
    with pytest.raises(RuntimeError, match="cuEventRecord failed with CUDA driver error 1"):
        cuda_driver.record(0, 0)
    with pytest.raises(RuntimeError, match="cuStreamBatchMemOp failed with CUDA driver error 1"):
        cuda_driver.MemOps(writes=[8], waits=[16]).enqueue(0, 1)
    cuda_driver.MemOps(writes=[], waits=[]).enqueue(0, 1)  # no addresses (a group of one rank): no call


def test_a_barrier_is_one_batch_in_the_drivers_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MemOps.enqueue`` makes one ``cuStreamBatchMemOp_v2`` call whose array is, byte for byte, CUDA's
    ``CUstreamBatchMemOpParams`` (48 bytes each: the operation, the address at byte 8, the 64-bit value at byte 16,
    the flags at byte 24): the writes (``CU_STREAM_MEM_OP_WRITE_VALUE_64``, 5) then the waits (``WAIT_VALUE_64``, 4,
    flags 0: at least the value), each barrier with its own value."""
    import ctypes
    import struct

    from fsdp_compile._internals import cuda_driver

    batches: list[tuple] = []

    def batch(stream: int, count: int, params: ctypes.Array, flags: int) -> int:
        raw = ctypes.string_at(params, count * 48)
        batches.append((stream, flags, [struct.unpack_from("<I4xQQI4x", raw, 48 * i) for i in range(count)]))
        return 0

    monkeypatch.setattr(cuda_driver, "_function", lambda name, *argtypes: batch)
    ops = cuda_driver.MemOps(writes=[0x1000, 0x2000], waits=[0x3000])
    ops.enqueue(7, 1)
    ops.enqueue(7, 2)
    assert batches == [(7, 0, [(5, 0x1000, value, 0), (5, 0x2000, value, 0), (4, 0x3000, value, 0)])
                       for value in (1, 2)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batch_of_stream_memory_operations_writes_then_waits() -> None:
    """The driver's batch on one GPU: its writes land; a stream that waits for a value runs nothing after the wait
    until another stream writes it (the batch's layout as the driver reads it)."""
    import time

    from fsdp_compile._internals import cuda_driver

    assert cuda_driver.has_stream_memops(), "the driver should have stream memory operations (CUDA 12+)"
    words = torch.zeros(3, dtype=torch.int64, device="cuda")
    address = [words[index].data_ptr() for index in range(3)]
    waiter, writer, out = torch.cuda.Stream(), torch.cuda.Stream(), torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    cuda_driver.MemOps(writes=address[:2], waits=address[:2]).enqueue(writer.cuda_stream, 5)
    writer.synchronize()
    assert words.tolist() == [5, 5, 0]
    cuda_driver.MemOps(writes=[], waits=[address[2]]).enqueue(waiter.cuda_stream, 7)
    with torch.cuda.stream(waiter):
        out.fill_(1.0)
    time.sleep(0.2)
    assert not waiter.query(), "the waiting stream ran past its wait"
    cuda_driver.MemOps(writes=[address[2]], waits=[]).enqueue(writer.cuda_stream, 7)
    waiter.synchronize()
    assert out.tolist() == [1.0] * 4 and words.tolist() == [5, 5, 7]


def test_copy_engine_collectives_are_driver_calls_on_the_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy-engine collective into a slot as the CUDA driver's calls (faked here, on CPU tensors): the side
    stream forked from the compute stream, a barrier (one batch of stream memory operations: this rank's count
    written into its place in every peer's counters, zeroed when the slab was made, then a wait on each peer's
    place in its own), the peer copies, a
    barrier, the event the graph's wait waits for; the peers in ring order, the addresses those of the same place
    in each peer's slab; the barrier kernel on the side stream under capture and without counters."""
    import contextlib
    from types import SimpleNamespace

    from fsdp_compile._internals import cuda_driver
    from fsdp_compile.runtime import slots as _slots
    from fsdp_compile.runtime import streams as _streams
    from fsdp_compile.runtime.copy_engine import copy_between_slabs

    calls: list[tuple] = []
    for name in ("copy", "record", "wait_event"):
        monkeypatch.setattr(cuda_driver, name, lambda *args, name=name: calls.append((name, *args)))
    monkeypatch.setattr(cuda_driver.MemOps, "enqueue",
                        lambda ops, stream, value: calls.append(("memops", stream, ops.writes, ops.waits, value)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    capturing = False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    compute, side, fork, done = 11, SimpleNamespace(cuda_stream=22), SimpleNamespace(cuda_event=33), 44
    monkeypatch.setattr(cuda_driver, "current_stream", lambda device: compute)
    monkeypatch.setitem(_streams._side, None, (side, fork))  # CPU tensors: device index None

    rank, world, start = 2, 4, 512  # the counters after 4096 bytes of slots
    handle = _FakeHandle(rank, world, 4096 + 8 * world)
    slab = _slots.Slab(handle.buffers[rank][:4096], handle, _slots._signals(handle, start))
    counters = [handle.get_buffer(peer, (world,), torch.int64, start) for peer in range(world)]
    assert counters[rank].tolist() == [0] * world and handle.barriers == 1  # zeroed, then every rank met
    assert counters[0].tolist() != [0] * world  # a peer's counters are the peer's to zero
    gathered = slab.memory[1024:2048].view(torch.float32)  # 4 parts of 64 floats at byte 1024 of every slab
    monkeypatch.setitem(_streams._done, (None, gathered.data_ptr()), SimpleNamespace(cuda_event=done))

    peers = [3, 0, 1]  # ring order from rank 2
    mine, pulls = slab.pulls(gathered, world)
    assert mine.data_ptr() == gathered.view(world, -1)[rank].data_ptr()
    assert pulls == [(gathered.view(world, -1)[peer].data_ptr(), handle.buffers[peer][1024 + 256 * peer:].data_ptr(),
                      256) for peer in peers]
    received = slab.memory[2048:2048 + 3 * 256].view(torch.float32)  # the peers' parts of an exchange
    assert slab.pushes(received, world) == [  # this rank's part of the peer's place: 2 (peer 3), 1 (peers 0, 1)
        (peer, handle.buffers[peer][2048 + 256 * (rank - (rank > peer)):].data_ptr(), 256) for peer in peers]

    def barrier(reached: int) -> list[tuple]:  # one batch of the driver's stream memory operations
        return [("memops", side.cuda_stream, [counters[peer][rank].data_ptr() for peer in peers],
                 [counters[rank][peer].data_ptr() for peer in peers], reached)]

    copies = [("copy", side.cuda_stream, *pull) for pull in pulls]
    fork_side = [("record", fork.cuda_event, compute), ("wait_event", side.cuda_stream, fork.cuda_event)]
    copy_between_slabs(slab, pulls, gathered)
    assert calls == [*fork_side, *barrier(1), *copies, *barrier(2), ("record", done, side.cuda_stream)]
    calls.clear()
    capturing = True
    copy_between_slabs(slab, pulls, gathered)
    assert calls == [*fork_side, *copies, ("record", done, side.cuda_stream)]
    assert handle.barriers == 3 and slab.signals.reached == 2
    capturing = False
    _slots.Slab(slab.memory, handle).barrier(side)  # no counters: the kernel
    assert handle.barriers == 4
