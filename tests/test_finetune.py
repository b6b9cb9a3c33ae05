"""Fine-tuning: frozen units, a frozen embedding, peft's LoRA adapters and mixed dtypes in one unit, on real ranks
against the unsharded reference (layer 3) and in the graphs (layer 1): only trainable parameters take part in the
gradient reduction, and frozen ones stay bitwise as they were."""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

import fsdp_compile
from fsdp_compile._plan_shard import plan_shard
from fsdp_compile.debug import capture_graphs
from fsdp_compile.testing.dist import run_ranks
from fsdp_compile.testing.hf import VOCAB, add_lora, is_decoder_layer, tiny_causal_lm, train_side_by_side, trainable
from fsdp_compile.testing.reference import CausalLMLoss, assert_bitwise
from fsdp_compile.testing.scripts import load_script, run_script_main

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
LAYERS = 2
STEPS = 2
EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
RS, A2A = torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops._c10d_functional.all_to_all_single.default
AG = (torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops.fsdp_compile.all_gather_into_slot.default)

# rel. error of (loss, trainable gradients, parameters after the steps), the worst tensor, against the unsharded model
# (averaging the ranks' gradients as the sharded model does: micro_batch_step). float64: only the reduction order
# differs (measured up to 1.7e-15). bf16 base with float32 adapters: the bf16 matmuls are the same ops on both sides,
# the adapters' gradients are summed in float32 in another order (measured up to 3.8e-7, float32's resolution 6e-8
# times a few). Inductor's kernels on a unit of two dtypes: tests/test_default_path.py's LoRA cases.
TOLERANCES = {torch.float64: (1e-12, 1e-12, 1e-12), torch.bfloat16: (1e-6, 1e-6, 1e-6)}


def _first_half_frozen(lm: nn.Module) -> nn.Module:
    for layer in lm.model.layers[: LAYERS // 2]:
        layer.requires_grad_(False)
    return lm


def _frozen_embedding(lm: nn.Module) -> nn.Module:
    lm.model.embed_tokens.requires_grad_(False)
    return lm


class Case(NamedTuple):
    base: Callable[[], nn.Module]
    """The unsharded Hugging Face model (seeded by the caller)."""
    prepare: Callable[[nn.Module], nn.Module]
    """What fine-tuning does to it before shard(): freeze parameters, or add peft's adapters."""
    dtype: torch.dtype


CASES = {
    # A frozen unit (the first layer) and a frozen embedding in the root unit beside trainable parameters.
    "first_half_and_embedding_frozen": Case(lambda: tiny_causal_lm(layers=LAYERS),
                                            lambda lm: _frozen_embedding(_first_half_frozen(lm)), torch.float64),
    # peft's LoRA over a bf16 base (float64 LoRA, on Qwen2 with its q and v projections' biases too:
    # tests/test_gradient_checkpointing.py's aot_eager case).
    "lora_bf16_base_fp32_adapters": Case(lambda: tiny_causal_lm(dtype=torch.bfloat16, layers=LAYERS), add_lora,
                                         torch.bfloat16),
}


def _finetune(rank: int, world_size: int, saved: pathlib.Path) -> None:
    for name, case in CASES.items():
        torch._dynamo.reset()  # two models a case, compiled from the same code: stay under the recompile limit
        torch.manual_seed(0)
        ref = CausalLMLoss(case.prepare(case.base()))
        frozen = {n: p.detach().clone() for n, p in ref.lm.named_parameters() if not p.requires_grad}
        lm = fsdp_compile.shard(copy.deepcopy(ref.lm), units=is_decoder_layer)
        if name.startswith("lora"):  # the adapters, gathered, are the unsharded model's
            assert_bitwise(_adapters(lm), peft.get_peft_model_state_dict(ref.lm))
        run = torch.compile(CausalLMLoss(lm), backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
        worst = train_side_by_side(run, ref, lm, ref.lm, steps=STEPS, rank=rank, world_size=world_size)
        trained = fsdp_compile.full_state_dict(lm)
        for n, want in frozen.items():
            assert_bitwise(trained[n], want, f"{name}: frozen {n}")
        if rank == 0:
            print(f"{name} world {world_size}: worst rel. errors " + ", ".join(
                f"{k} {v:.1e}" for k, v in worst.items()) + f"; {len(frozen)} frozen tensors bitwise unchanged")
        assert all(worst[k] <= tol for k, tol in zip(worst, TOLERANCES[case.dtype])), (name, worst)
        if name.startswith("lora"):
            _save_and_load_adapters(lm, case.base, saved / name)


def _adapters(lm: nn.Module) -> dict[str, torch.Tensor]:
    """peft's state dict of the adapters of a sharded model: the trainable parameters, gathered (a collective)."""
    return peft.get_peft_model_state_dict(lm, state_dict=fsdp_compile.full_state_dict(lm, trainable_only=True))


def _save_and_load_adapters(lm: nn.Module, base: Callable[[], nn.Module], path: pathlib.Path) -> None:
    """``save_pretrained`` of the trained adapters on rank 0, then ``PeftModel.from_pretrained`` on an unsharded
    base: the same adapters, bitwise."""
    adapters = fsdp_compile.full_state_dict(lm, trainable_only=True, rank0_only=True)
    if dist.get_rank() == 0:
        lm.save_pretrained(path, state_dict=adapters)
    dist.barrier()
    torch.manual_seed(0)
    loaded = peft.PeftModel.from_pretrained(base(), path)
    assert_bitwise(peft.get_peft_model_state_dict(loaded), _adapters(lm))


@pytest.mark.slow
def test_finetuning_matches_the_unsharded_model(tmp_path: pathlib.Path) -> None:
    """Each case trains two AdamW steps on 3 ranks (shards padded), sharded over the decoder layers, compiled
    (aot_eager), as the unsharded model does; frozen parameters are bitwise as they were and get no gradient.
    peft's adapters: gathered from the sharded model they are the unsharded model's, bitwise; saved with
    ``save_pretrained`` and loaded onto an unsharded base, the trained ones, bitwise. (Inductor's kernels on a unit
    of two dtypes: tests/test_default_path.py.)"""
    run_ranks(_finetune, 3, tmp_path)


def _graph_model(case: str) -> nn.Module:
    """A wider tiny Llama (hidden 64, float32): LoRA's share of it is then as small as on real models (~2%)."""
    lm = tiny_causal_lm(dtype=torch.float32, hidden=64, layers=LAYERS)
    return CausalLMLoss(add_lora(lm) if case == "lora" else _first_half_frozen(lm))


def _compiled_graphs(model: nn.Module) -> dict[str, fx.GraphModule]:
    compiled = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
    tokens = torch.randint(0, VOCAB, (2, 8))
    with capture_graphs() as graphs:
        compiled(tokens, tokens).backward()
    return {g.stage: g.gm for g in graphs}


@pytest.mark.parametrize("case", ["lora", "first_half_frozen"])
def test_backward_reduces_the_trainable_parameters_only(case: str, fake_pg: None) -> None:
    """The gradient reductions cover the trainable groups (their parameters plus alignment padding) and nothing
    else; a frozen group has neither a reduction nor a gradient (no backward output for its shard); every group
    is gathered once in forward (a unit with frozen and trainable parameters: two all-gathers, see "Parameter
    groups" in docs/architecture.md)."""
    torch.manual_seed(0)
    model = fsdp_compile.shard(_graph_model(case), units=is_decoder_layer)
    units = fsdp_compile.sharded_units(model)
    trained = [u for u in units if u.trainable]
    graphs = _compiled_graphs(model)
    fwd, bwd = graphs["forward"], graphs["backward"]
    reductions = [n for n in bwd.graph.nodes if n.target in (RS, A2A)]
    reduced = sum(n.args[0].meta["val"].numel() for n in reductions)
    assert len(reductions) == len(trained)
    assert reduced == sum(u.layout.padded_numel for u in trained)
    wanted = sum(p.numel() for p in trainable(_graph_model(case)).values())
    total = sum(slot.numel for u in units for slot in u.layout.slots)
    assert wanted <= reduced <= wanted + sum(16 * len(u.layout.slots) + 2 for u in trained)
    if case == "lora":
        assert reduced < 0.05 * total, (reduced, total)
    grads = [o for o in bwd.graph.output_node().args[0] if isinstance(o, fx.Node)]
    assert sorted(o.meta["val"].numel() for o in grads) == sorted(u.layout.shard_numel for u in trained)
    assert sum(1 for n in fwd.graph.nodes if n.target in AG) == len(units)
    frozen_units = {u.layout.fqn for u in units if not u.trainable} - {u.layout.fqn for u in trained}
    assert len(frozen_units) == (LAYERS // 2 if case == "first_half_frozen" else 1)  # LoRA: the root (embeddings)
    print(f"{case}: {len(units)} groups, reduced {reduced:,} of {total:,} elements ({reduced / total:.1%})")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_parameter_frozen_at_shard_that_asks_for_a_gradient_later_is_refused(compiled: bool, fake_pg: None) -> None:
    """Dynamo guards on the frozen pieces' ``requires_grad``: the next call recompiles and refuses, as eager does.
    Freezing a trainable parameter after ``shard()`` takes effect: it gets no gradient (its group still reduces)."""
    torch.manual_seed(0)
    model = fsdp_compile.shard(_graph_model("first_half_frozen"), units=is_decoder_layer)
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager")) if compiled else model
    tokens = torch.randint(0, VOCAB, (2, 8))
    run(tokens, tokens).backward()
    pieces = dict(model.named_parameters())
    model.lm.model.layers[-1].mlp.requires_grad_(False)  # the last layer trains
    model.zero_grad(set_to_none=True)
    run(tokens, tokens).backward()
    last = f"lm.model.layers.{LAYERS - 1}"
    assert pieces[f"{last}.mlp.up_proj.weight"].grad is None
    assert pieces[f"{last}.self_attn.q_proj.weight"].grad is not None
    model.lm.model.layers[0].self_attn.q_proj.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn.q_proj.weight was frozen \(requires_grad=False\) "
                                           r"when fsdp_compile.shard\(\) ran .* Set requires_grad before shard\(\)"):
        run(tokens, tokens)


class Permuted(nn.Module):
    """A unit holding an integer parameter beside floating ones (a fixed permutation of its outputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.perm = nn.Parameter(torch.randperm(8), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)[:, self.perm]


def _integer_parameters(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(Permuted(), Permuted()).double()  # .double() leaves the integer parameters as they are
    model = fsdp_compile.shard(copy.deepcopy(ref), units=[Permuted])
    assert [u.name for u in fsdp_compile.describe(model).units] == [
        f"{i}[{dtype}]" for i in (0, 1) for dtype in ("int64 frozen", "float64 trainable")]  # module order
    run = torch.compile(model, backend=fsdp_compile.backend(compiler="aot_eager"), fullgraph=True)
    x = torch.randn(2 * world_size, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = run(x[2 * rank : 2 * rank + 2])
    out.square().sum().backward()  # a gradient for the floating group only
    torch.testing.assert_close(out, ref(x[2 * rank : 2 * rank + 2]), rtol=0, atol=0)  # the same shapes: bitwise
    assert_bitwise(fsdp_compile.full_state_dict(model)["1.perm"], ref[1].perm)


def test_integer_parameters_are_gathered_as_they_are() -> None:
    """An integer parameter in a unit is its own (frozen) group, gathered in its dtype: the outputs are the unsharded
    model's, bitwise."""
    run_ranks(_integer_parameters, 2)


def test_mixed_precision_casts_the_floating_groups_only() -> None:
    """``MixedPrecision(param_dtype=bf16)`` casts the float32 and float64 groups; the integer group is gathered in
    int64, with no gradient."""
    module = nn.Sequential(Permuted(), Permuted())
    module[1].linear.double()
    mp = fsdp_compile.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = plan_shard(module, units=[Permuted], world_size=2, mp=mp)
    got = {u.layout.name: (u.dtype, u.param_dtype) for u in plan.units}
    assert got == {
        "0[float32 trainable]": (torch.float32, torch.bfloat16), "0[int64 frozen]": (torch.int64, torch.int64),
        "1[float64 trainable]": (torch.float64, torch.bfloat16), "1[int64 frozen]": (torch.int64, torch.int64),
    }


def test_gradient_accumulation_keeps_no_accumulator_for_a_frozen_group(fake_pg: None) -> None:
    """``set_requires_gradient_sync(False)`` gives the trainable groups their full-size accumulator, and a frozen
    group none (it has no gradient to accumulate)."""
    torch.manual_seed(0)
    model = fsdp_compile.shard(_graph_model("lora"), units=is_decoder_layer)
    fsdp_compile.set_requires_gradient_sync(model, False)
    units = fsdp_compile.sharded_units(model)
    assert [u.accum is not None for u in units] == [u.trainable for u in units]
    tokens = torch.randint(0, VOCAB, (2, 8))
    model(tokens, tokens).backward()
    fsdp_compile.set_requires_gradient_sync(model, True)
    model(tokens, tokens).backward()
    assert all(p.grad is not None for p in trainable(model).values() if p.numel())


@pytest.mark.slow
def test_the_lora_example_trains_saves_and_reloads_the_adapters(tmp_path: pathlib.Path) -> None:
    """``examples/lora.py`` with docs/finetuning.md's options (aot_eager, to be quick), its ``main`` on the suite's 2
    ranks (its command line spawns them as examples/big_model.py's does, which test_init_parameters.py runs): the
    adapters alone are reduced, saved with ``save_pretrained`` and reloaded onto an unsharded base, bitwise."""
    script = str(EXAMPLES / "lora.py")
    args = load_script(script).arguments(["--compiler", "aot_eager", "--steps", "1", "--save", str(tmp_path)])
    out = str(tmp_path / "out")
    run_ranks(run_script_main, 2, script, out, args)
    stdout = pathlib.Path(f"{out}.0").read_text()
    assert "4,096 trainable (3.12%); backward reduces 4,096 elements" in stdout, stdout
    assert "adapters: 8 tensors saved and reloaded onto an unsharded base, bitwise equal" in stdout
    assert (tmp_path / "adapter_model.safetensors").exists()
