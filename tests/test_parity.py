"""Layer 3: numerics on real ranks (gloo; NCCL on GPUs): sharded training == the unsharded single-process
reference.

Each rank trains on its slice of the global batch; the reference (on every rank, in one process) trains
on the whole global batch. After every step the loss and every full parameter must match. The same
check covers compiled and eager execution, graph breaks, gradient accumulation (with and without a
reduce-scatter per micro-batch) and activation checkpointing.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import CPUOffloadPolicy

import fsdp_compile
from fsdp_compile.testing.dist import hsdp_mesh, run_ranks, spawn_ranks
from fsdp_compile.testing.graphs import slotted_exchanges
from fsdp_compile.testing.llama import LLAMA_TESTS, Block, Llama, save_matmuls
from fsdp_compile.testing.reference import full_grads, reference_step, rel_error

BATCH_PER_RANK = 2
BF16_FP32_REDUCE = {"dtype": torch.float32, "param_dtype": torch.bfloat16}  # gradients exchanged (all-to-alls)
SEQ = 8
LR = 1e-3

# (device, compiler, model dtype, param dtype) -> rtol of (loss, gradients before the optimizer step, parameters
# after it); rtol = ||got - want|| / ||want||, the worst tensor. The optimizer's state (AdamW's running averages
# of the gradients and their squares) is held to the gradients' tolerance, doubled for the squares.
TOLERANCES = {
    # Same dtype: only the reduction order differs (per-rank means averaged vs one global mean).
    ("cpu", "aot_eager", torch.float64, torch.float64): (1e-12, 1e-12, 1e-10),
    ("cpu", "eager", torch.float64, torch.float64): (1e-12, 1e-12, 1e-10),
    ("cpu", "inductor", torch.float64, torch.float64): (1e-12, 1e-12, 1e-10),
    ("cpu", "aot_eager", torch.float32, torch.float32): (1e-5, 1e-5, 1e-5),
    # bf16 params, fp32 reduce, eager kernels: the same ops as the reference, so (near) bitwise.
    ("cpu", "aot_eager", torch.float32, torch.bfloat16): (1e-6, 1e-6, 1e-6),
    # Inductor fuses bf16 ops and keeps fp32 intermediates where eager rounds to bf16: gradients differ at
    # bf16 resolution (2**-8 = 3.9e-3), most for tensors with small gradients (measured up to 2.3e-2,
    # feed_forward.w3 of the tiny model), and AdamW's update of an element whose gradient is within that
    # noise can flip; measured 1.3e-4 (loss) and 9.6e-3 (worst parameter, attention.wk) over 5 steps.
    ("cpu", "inductor", torch.float32, torch.bfloat16): (1e-3, 5e-2, 3e-2),
    # NCCL on GPUs: the same claims; float64 for the exact check (in fp32, cuBLAS's reduction orders and
    # AdamW's amplification of near-zero gradients gave 1.1e-5 on an H100), bf16 as above.
    ("cuda", "inductor", torch.float64, torch.float64): (1e-12, 1e-12, 1e-10),
    ("cuda", "inductor", torch.float32, torch.bfloat16): (1e-3, 5e-2, 3e-2),
}


class HFCausalLM(torch.nn.Module):
    """A Hugging Face transformers GPT-2 (tied wte/lm_head), built as a user would from a config, behind the
    ``model(inputs, targets) -> loss`` interface the reference uses. Dropout off: both sides must compute
    the same function."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=LLAMA_TESTS.vocab_size, n_positions=16, n_embd=32, n_layer=3, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        )
        self.hf = GPT2LMHeadModel(cfg)
        assert self.hf.lm_head.weight is self.hf.transformer.wte.weight

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.hf(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build(case: "Case") -> tuple[torch.nn.Module, list[type[torch.nn.Module]]]:
    if case.model == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return HFCausalLM(), [GPT2Block]
    policy = save_matmuls if case.checkpoint == "selective" else None
    cfg = dataclasses.replace(LLAMA_TESTS, checkpoint_blocks=bool(case.checkpoint), checkpoint_policy=policy)
    return Llama(cfg), [Block]


class BreakingBlock(Block):
    """A block with a forced graph break between its attention and its feed-forward."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        torch._dynamo.graph_break()
        return x + self.feed_forward(self.ffn_norm(x))


@dataclass(frozen=True)
class Case:
    compiler: Literal["inductor", "aot_eager", "eager"]  # "eager": the sharded module is not compiled
    dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    device: Literal["cpu", "cuda"] = "cpu"
    steps: int = 5
    micro_batches: int = 1
    gradient_sync: bool = True  # False: no reduce-scatter on the micro-batches before the last
    graph_break: bool = False  # a graph break inside every unit, compiled with fullgraph=False
    checkpoint: Literal[False, True, "selective"] = False  # torch.utils.checkpoint around every block (selective:
    # save_matmuls)
    model: Literal["llama", "gpt2"] = "llama"
    overlap: bool = True  # the schedule_overlap pass
    exchange: bool = True  # MixedPrecision.exchange_grads_in_param_dtype (matters when param_dtype is narrower)
    keep_root_gathered: bool = False  # shard(reshard_after_forward=...) false for the root unit
    cudagraphs: bool = False  # BackendConfig.cudagraphs (CUDA graphs: GPU only)
    all_gather: Literal["nccl", "copy_engine", "auto"] = "nccl"  # BackendConfig.all_gather (copy engines: GPU only;
    # auto: under the environment torchrun gives one host, copy engines for groups of 2 or 4 GPUs)
    grad_reduce: Literal["nccl", "copy_engine", "auto"] = "nccl"  # BackendConfig.grad_reduce (the exchanges: GPU only
    # for copy engines)
    mode: str | None = None  # torch.compile(mode=...)
    memory_plan: bool = True  # BackendConfig.memory_plan: all-gathers into planned slots
    mesh: tuple[int, int] | None = None  # HSDP: shard(mesh=...) on a (replicate, shard) DeviceMesh of this shape
    slotted_exchanges: bool = False  # the exchanges in the plan's slots, as grad_reduce="copy_engine" has them, on
    # the route any device runs (fsdp_compile.testing.graphs.slotted_exchanges)
    each_block: bool = False  # torchtitan's habit: each block compiled on its own (block.compile), the rest eager
    offload: bool = False  # shard(offload_policy=CPUOffloadPolicy()): shards, gradients and the optimizer's state in
    # host memory, each unit copied to the device before its all-gather (on CPU the copies stand for the transfers)


def _param_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay except on norms, chosen by name: the sharded pieces must keep their names."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if "norm" not in n], "weight_decay": 0.1},
        {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0},
    ]


def _train_and_compare(rank: int, world_size: int, case: Case) -> None:
    with slotted_exchanges() if case.slotted_exchanges else contextlib.nullcontext():
        _train_and_compare_here(rank, world_size, case)


def _train_and_compare_here(rank: int, world_size: int, case: Case) -> None:
    loss_tol, grad_tol, param_tol = TOLERANCES[(case.device, case.compiler, case.dtype, case.param_dtype)]
    device = f"cuda:{rank}" if case.device == "cuda" else "cpu"
    torch.manual_seed(0)
    ref, unit_classes = _build(case)
    ref = ref.to(device, case.dtype)
    model = copy.deepcopy(ref)
    if case.graph_break:
        for layer in model.layers:
            layer.__class__ = BreakingBlock
    mp = fsdp_compile.MixedPrecision(
        param_dtype=case.param_dtype, reduce_dtype=case.dtype, exchange_grads_in_param_dtype=case.exchange
    )
    reshard = (lambda fqn, module: fqn != "") if case.keep_root_gathered else True
    mesh = hsdp_mesh(case.mesh, case.device)
    offload = CPUOffloadPolicy() if case.offload else None
    fsdp_compile.shard(model, units=unit_classes, mp=mp, reshard_after_forward=reshard, mesh=mesh, offload_policy=offload)
    assert all((u.offload_to is not None) == case.offload for u in fsdp_compile.sharded_units(model))
    if case.mesh:  # each rank holds 1/shard of the model
        units = fsdp_compile.sharded_units(model)
        assert {(u.world_size, u.replicas) for u in units} == {(case.mesh[1], case.mesh[0])}
        assert sum(u.flat.numel() for u in units) * case.mesh[1] == sum(u.layout.padded_numel for u in units)
    if "auto" in (case.all_gather, case.grad_reduce):  # what torchrun sets on one host (spawn_ranks does not)
        os.environ.update(LOCAL_WORLD_SIZE=str(world_size), WORLD_SIZE=str(world_size))
    if case.compiler == "eager":
        run = model
    else:
        backend = fsdp_compile.backend(
            compiler=case.compiler, overlap=case.overlap, cudagraphs=case.cudagraphs, all_gather=case.all_gather,
            grad_reduce=case.grad_reduce, memory_plan=case.memory_plan,
        )
        if case.each_block:
            for block in model.layers:
                block.compile(backend=backend, fullgraph=True)
            run = model
        else:
            run = torch.compile(model, backend=backend, fullgraph=not case.graph_break, mode=case.mode)
    opt = torch.optim.AdamW(_param_groups(model), lr=LR)
    ref_opt = torch.optim.AdamW(_param_groups(ref), lr=LR)
    n_units = len(fsdp_compile.sharded_units(model))
    counters.clear()
    for step in range(case.steps):
        losses, ref_losses = [], []
        for micro in range(case.micro_batches):
            gen = torch.Generator().manual_seed(100 * step + micro)
            shape = (world_size * BATCH_PER_RANK, SEQ + 1)
            tokens = torch.randint(0, LLAMA_TESTS.vocab_size, shape, generator=gen).to(device)
            local = tokens[rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
            last = micro == case.micro_batches - 1
            fsdp_compile.set_requires_gradient_sync(model, case.gradient_sync or last)
            if case.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss = run(local[:, :-1], local[:, 1:])
            loss.backward()
            losses.append(loss.detach().clone())  # a CUDA graph's next replay overwrites its outputs
            ref_losses.append(reference_step(ref, tokens, case.param_dtype, world_size))
        grads = full_grads(model)
        grad_errors = {n: rel_error(grads[n], p.grad) for n, p in ref.named_parameters()}
        worst_grad = max(grad_errors, key=grad_errors.__getitem__)
        assert grad_errors[worst_grad] <= grad_tol, f"step {step}: grad of {worst_grad} rel. error {grad_errors[worst_grad]:.2e}"
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if not case.gradient_sync and (world_size > 1 or case.offload):  # the accumulated gradient delivered once
            assert counters["fsdp_compile"]["accumulated_reduce_scatters"] == n_units * (step + 1)
        if case.graph_break:
            assert sum(counters["graph_break"].values()) >= 1, "the test model did not break the graph"
        shard_ranks = case.mesh[1] if case.mesh else world_size
        route = "copy_engine" if case.device == "cuda" and shard_ranks in (2, 4) else "nccl"
        for option in ("all_gather", "grad_reduce"):
            if getattr(case, option) == "auto":
                assert counters["fsdp_compile"][f"{option}_auto_{route}"] >= 1, dict(counters["fsdp_compile"])

        global_loss = torch.stack(losses).mean()
        dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        ref_loss = torch.stack(ref_losses).mean()
        loss_err = rel_error(global_loss, ref_loss)
        assert loss_err <= loss_tol, (step, global_loss.item(), ref_loss.item())
        full = fsdp_compile.full_state_dict(model)
        expected = ref.state_dict()
        assert list(full) == list(expected)
        errors = {k: rel_error(full[k], v) for k, v in expected.items()}
        worst = max(errors, key=errors.__getitem__)
        if rank == 0:
            print(f"parity {case} world {world_size} step {step}: loss {global_loss.item():.5f} rel {loss_err:.1e}; "
                  f"worst grad {worst_grad} rel {grad_errors[worst_grad]:.1e}; worst param {worst} rel {errors[worst]:.1e}")
        assert errors[worst] <= param_tol, f"step {step}: {worst} rel. error {errors[worst]:.2e} > {param_tol}"
    sharded_over = case.mesh[1] if case.mesh else world_size
    if case.compiler != "eager" and sharded_over > 1:  # the plan was applied (or not): slabs exist (or not)
        assert (fsdp_compile.slab_bytes() > 0) == case.memory_plan, fsdp_compile.slab_bytes()
    # The optimizer's state against the unsharded reference optimizer's, parameter by parameter.
    state = fsdp_compile.full_optimizer_state_dict(model, opt)["state"]
    for name, param in ref.named_parameters():
        want = ref_opt.state[param]
        assert state[name]["step"] == want["step"], name
        for key, tol in (("exp_avg", grad_tol), ("exp_avg_sq", 2 * grad_tol)):
            error = rel_error(state[name][key], want[key])
            assert error <= tol, f"optimizer state {name}[{key!r}] rel. error {error:.2e} > {tol}"
    if case.cudagraphs:
        assert counters["inductor"]["cudagraph_skips"] == 0, "Inductor skipped CUDA graphs (its log says why)"


# Inductor's own parity cases, each several features at once (docs/architecture.md, "Testing numerics", says
# which claim is checked under which compiler); every feature's numerics are checked with aot_eager as well.
INDUCTOR_CASES = {
    # float64 on 2 and 3 ranks, torch.compile's mode=, the root kept gathered, graph breaks inside units, CPU offload on
    # 1 rank: tests/test_default_path.py.
    # bf16 parameters, fp32 sums: the all-to-all exchanges, in the memory plan's slots; gradients accumulated over
    # micro-batches and reduced once; selective activation checkpointing; no overlap pass (Inductor's own
    # peak-memory reordering then moves the collectives); CPU offload (the sum kept on the device, copied once).
    "bf16-exchanges_into_slots-reduce_once-selective_checkpointing-no_overlap-cpu_offload": (2, Case(
        "inductor", param_dtype=torch.bfloat16, steps=3, slotted_exchanges=True, micro_batches=2, gradient_sync=False,
        checkpoint="selective", overlap=False, offload=True)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", INDUCTOR_CASES)
def test_parity_inductor(name: str) -> None:
    world_size, case = INDUCTOR_CASES[name]
    run_ranks(_train_and_compare, world_size, case)


@pytest.mark.parametrize("compiler, world_size", [("aot_eager", 1), ("aot_eager", 3), ("eager", 2)])
def test_parity_cpu_offload(compiler: str, world_size: int) -> None:
    """FSDP2's ``CPUOffloadPolicy``: float64 parity with the unsharded model, the optimizer stepping on the host
    pieces. On 1 and 3 ranks (3: shards padded), two micro-batches accumulated and the sum delivered once (the
    accumulator on the device, also on one rank, where nothing is reduced: the gradient copied to the host once).
    Inductor: ``test_parity_inductor[...-cpu_offload]`` (bf16 accumulated on 2 ranks), ``tests/test_gradient_checkpointing.py``
    (float64 on 2 ranks) and ``tests/test_default_path.py`` (peft's LoRA on 1 rank)."""
    accumulated = {"micro_batches": 2, "gradient_sync": False} if world_size != 2 else {}
    case = Case(compiler, torch.float64, torch.float64, steps=3, offload=True, **accumulated)
    run_ranks(_train_and_compare, world_size, case)


@pytest.mark.parametrize("compiler", ["aot_eager", "eager"])
def test_parity_hsdp_2x2(compiler: str) -> None:
    """HSDP on 4 ranks: sharded over pairs, replicated across them; float64 parity with the unsharded model.
    Compiled, with gradients accumulated over two micro-batches and reduced once; eager, CPU offload."""
    options = {"micro_batches": 2, "gradient_sync": False} if compiler == "aot_eager" else {"offload": True}
    run_ranks(_train_and_compare, 4, Case(compiler, torch.float64, torch.float64, steps=2, mesh=(2, 2), **options))


def test_parity_replicated_only() -> None:
    """A (replicate, shard) mesh whose shard dimension has one rank: DDP, gradients averaged by all-reduce; two
    micro-batches, the first accumulated without it."""
    case = Case("aot_eager", torch.float64, torch.float64, steps=2, micro_batches=2, gradient_sync=False, mesh=(2, 1))
    run_ranks(_train_and_compare, 2, case)


def test_parity_root_not_resharded_after_forward() -> None:
    """``reshard_after_forward`` a predicate (every unit but the root), eager (compiled: tests/test_default_path.py)."""
    run_ranks(_train_and_compare, 2, Case("eager", torch.float64, torch.float64, steps=3, keep_root_gathered=True))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "reduce_scatter"])
def test_parity_bf16_params_fp32_reduce(exchange: bool) -> None:
    """bf16 gradients exchanged as they are (all-to-all) and summed in fp32 by the receiver; and the fp32
    reduce-scatter the exchange replaces. The exchange on 3 ranks (rank 1's peers on both sides):
    test_parity_exchanges_into_slots."""
    run_ranks(_train_and_compare, 2, Case("aot_eager", param_dtype=torch.bfloat16, steps=3, exchange=exchange))


def test_parity_exchanges_into_slots() -> None:
    """The gradient exchanges in the plan's slots (as on the copy-engine route): each slot receives the peers'
    parts and the sum reads this rank's own part from its gradient, a constant of each rank's graph (3 ranks:
    rank 1's peers lie on both sides of it)."""
    run_ranks(_train_and_compare, 3, Case("aot_eager", param_dtype=torch.bfloat16, steps=3, slotted_exchanges=True))


def test_parity_eager_without_compile() -> None:
    run_ranks(_train_and_compare, 2, Case("eager", torch.float64, torch.float64, steps=3))


def test_parity_gradient_accumulation() -> None:
    """Three micro-batches reduced once, with selective activation checkpointing around every block (a policy that
    saves the matmuls, torchtitan's kind). Each micro-batch reduced, and the backend's switches off, under Inductor
    with every other default: ``tests/test_default_path.py``."""
    case = Case("aot_eager", torch.float64, torch.float64, steps=3, micro_batches=3, gradient_sync=False,
                checkpoint="selective")
    run_ranks(_train_and_compare, 2, case)


def test_parity_selective_activation_checkpointing() -> None:
    """A policy that saves the matmuls (torchtitan's kind), eager (compiled: test_parity_gradient_accumulation; the
    gathered parameters not saved: tests/test_graphs.py)."""
    run_ranks(_train_and_compare, 2, Case("eager", torch.float64, torch.float64, steps=3, checkpoint="selective"))


def test_parity_third_party_gpt2_with_tied_embeddings() -> None:
    """Eager (compiled with every default option: tests/test_default_path.py). float64: GPT-2's attention key bias has
    a ~0 true gradient, so in fp32 AdamW turns rounding into visible updates (1e-4 seen) whatever the sharding
    (docs/architecture.md, "Testing numerics")."""
    run_ranks(_train_and_compare, 2, Case("eager", torch.float64, torch.float64, steps=3, model="gpt2"))


def test_parity_each_block_compiled_on_its_own() -> None:
    """``block.compile(backend=fsdp_compile.backend(...))`` on each block (torchtitan's habit), the root eager: each
    block's graph gathers its unit."""
    run_ranks(_train_and_compare, 2, Case("aot_eager", torch.float64, torch.float64, steps=3, each_block=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype, param_dtype", [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)],
                         ids=["fp64", "bf16-fp32reduce"])
def test_parity_cpu_offload_on_one_gpu(dtype: torch.dtype, param_dtype: torch.dtype) -> None:
    """CPU offload on a GPU, Inductor: pinned host shards copied to the GPU and the gradients back, the optimizer
    stepping on the host, against the unsharded model on the GPU (one rank: the copies are the whole gather). fp64:
    a graph break inside every unit (autograd adds each unit's two gradients on the host: after their copies). bf16:
    three micro-batches accumulated on the device, the later ones' copies from the host's bf16 mirrors."""
    if param_dtype == torch.bfloat16:
        options: dict = {"micro_batches": 3, "gradient_sync": False}
    else:
        options = {"graph_break": True}
    case = Case("inductor", dtype, param_dtype, device="cuda", steps=3, offload=True, **options)
    spawn_ranks(_train_and_compare, 1, case, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
@pytest.mark.parametrize(
    "dtype, param_dtype, options",
    [
        (torch.float64, torch.float64, {}),
        (torch.float32, torch.bfloat16, {}),
        (torch.float32, torch.bfloat16, {"cudagraphs": True}),
        (torch.float64, torch.float64, {"all_gather": "copy_engine"}),
        (torch.float32, torch.bfloat16, {"all_gather": "copy_engine", "cudagraphs": True}),
        (torch.float32, torch.bfloat16, {"all_gather": "auto", "grad_reduce": "auto"}),
        (torch.float32, torch.bfloat16, {"all_gather": "auto", "grad_reduce": "auto", "micro_batches": 2,
                                         "gradient_sync": False, "checkpoint": True}),
        (torch.float32, torch.bfloat16, {"all_gather": "copy_engine", "grad_reduce": "copy_engine"}),
        (torch.float32, torch.bfloat16, {"all_gather": "copy_engine", "grad_reduce": "copy_engine", "cudagraphs": True}),
    ],
    ids=["fp64", "bf16-fp32reduce", "bf16-fp32reduce-cudagraphs", "fp64-copy_engine",
         "bf16-fp32reduce-copy_engine-cudagraphs", "bf16-fp32reduce-auto", "bf16-fp32reduce-auto-accumulated-checkpointed",
         "bf16-fp32reduce-copy_engine-exchange", "bf16-fp32reduce-copy_engine-exchange-cudagraphs"],
)
def test_parity_nccl_inductor(dtype: torch.dtype, param_dtype: torch.dtype, options: dict) -> None:
    spawn_ranks(_train_and_compare, 2, Case("inductor", dtype, param_dtype, device="cuda", **options), backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (NCCL)")
@pytest.mark.parametrize(
    "mesh, options",
    [(None, {}), (None, {"all_gather": "copy_engine"}), ((2, 2), {}), ((2, 2), {"all_gather": "copy_engine"}),
     (None, {"all_gather": "auto"}),
     (None, {"all_gather": "copy_engine", "grad_reduce": "copy_engine", **BF16_FP32_REDUCE}),
     (None, {"all_gather": "copy_engine", "grad_reduce": "copy_engine", "cudagraphs": True, **BF16_FP32_REDUCE}),
     ((2, 2), {"grad_reduce": "auto", **BF16_FP32_REDUCE}),
     (None, {"all_gather": "nccl", "grad_reduce": "copy_engine", **BF16_FP32_REDUCE})],
    ids=["fsdp-4gpus", "fsdp-copy_engine-4gpus", "hsdp-2x2-4gpus", "hsdp-2x2-copy_engine-4gpus", "fsdp-auto-4gpus",
         "fsdp-copy_engine-exchange-bf16-4gpus", "fsdp-copy_engine-exchange-cudagraphs-bf16-4gpus",
         "hsdp-2x2-exchange-auto-bf16-4gpus", "fsdp-nccl-gather-copy_engine-exchange-bf16-4gpus"],
)
def test_parity_nccl_four_gpus(mesh: tuple[int, int] | None, options: dict) -> None:
    case = Case("inductor", device="cuda", mesh=mesh, **{"dtype": torch.float64, "param_dtype": torch.float64, **options})
    spawn_ranks(_train_and_compare, 4, case, backend="nccl")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="needs 8 CUDA GPUs (NCCL)")
@pytest.mark.parametrize(
    "mesh, options",
    [(None, {}), (None, {"all_gather": "copy_engine"}), ((2, 4), {}), ((4, 2), {"all_gather": "auto"})],
    ids=["fsdp-8gpus", "fsdp-copy_engine-8gpus", "hsdp-2x4-8gpus", "hsdp-4x2-auto-8gpus"],
)
def test_parity_nccl_eight_gpus(mesh: tuple[int, int] | None, options: dict) -> None:
    case = Case("inductor", torch.float64, torch.float64, device="cuda", mesh=mesh, **options)
    spawn_ranks(_train_and_compare, 8, case, backend="nccl")
