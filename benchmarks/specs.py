"""Which systems the benchmark runs: ``--system SPEC``, SPEC = ``family[:key=value,key=value,...]``, parsed into a
frozen :class:`Spec`. A spec's canonical name (``Spec.name``: the family, then one word per option that differs
from its default, in a fixed order) labels its results in the JSON, the tables, the traces and report.py's guards.

Every family trains the same model, initial weights and data with the same mixed precision (bf16 parameters and
compute, fp32 reduce, fp32 main weights, AdamW) and the same FSDP units, torchtitan's: every block, the embedding
and the output projection (when untied) each a unit, the final norm left to the root; the unit holding the
output projection, which backward needs first, is not resharded after forward (``keep_gathered=1``: no unit is).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import fsdp_compile

FAMILIES: dict[str, str] = {
    "no_comm_bound": "the same per-GPU work with no collective: fsdp_compile over a group of one rank, each rank "
                     "training the whole model on its own micro-batch (its loss is compared at step 0 only)",
    "fsdp2_eager": "fully_shard per unit and on the root",
    "fsdp2_compile": "each block torch.compile'd, then fully_shard (torchtitan's order)",
    "simplefsdp": "written from SimpleFSDP's description: DTensor Shard(0) parameters replicated by a "
                  "parametrization, the whole model compiled with Inductor's overlap scheduling and bucketing",
    "fsdp_compile": "shard() per unit, the whole model compiled with fsdp_compile.backend(...)",
}
"""The families (``--system FAMILY``), with what each runs."""

ROUTE_VALUES = ("auto", "nccl", "copy_engine")
BOOL = ("0", "1")
KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "all_gather": (ROUTE_VALUES, "backend option: the all-gathers' route (not auto: GPU only)"),
    "grad_reduce": (ROUTE_VALUES, "backend option: the gradient exchanges' route (not auto: GPU only)"),
    "cudagraphs": (BOOL, "backend option: CUDA graphs (needs --compiler inductor)"),
    "overlap": (BOOL, "backend option: the overlap pass"),
    "memory_plan": (BOOL, "backend option: the memory plan's slabs"),
    "gradients_in_place": (BOOL, "backend option: gradients written into the flat gradient (0: packed)"),
    "regions": (BOOL, "backend option: each distinct block body compiled once (0: the whole step as one graph)"),
    "exchange_grads_in_param_dtype": (BOOL, "MixedPrecision option (0: an fp32 reduce-scatter)"),
    "keep_gathered": (BOOL, "every unit gathered from forward to backward (reshard_after_forward=False)"),
    "barriers": (("memops", "kernels"), "copy-engine barriers: the driver's stream memory operations, or "
                                        "symmetric memory's barrier kernels (kernels: GPU only)"),
    "hsdp": (BOOL, "HSDP as on two nodes: a (replicate, shard) mesh of shape (2, ranks / 2); an even number "
                   "of ranks, at least 4"),
    "offload": (BOOL, "CPU offload: FSDP2's CPUOffloadPolicy(pin_memory=True), the shards, gradients and AdamW "
                      "(fused) on the host"),
    "sync_off": (BOOL, "with --micro-batches: gradient sync off for every micro-batch but the last "
                       "(set_requires_gradient_sync; 0: reduced every micro-batch, torchtitan's way)"),
    "float8_gather": (BOOL, "with --float8 tensorwise: torchao's enable_fsdp_float8_all_gather (the blocks' linear "
                            "weights gathered as float8)"),
    "step_in_backward": (BOOL, "the step's last backward inside fsdp_compile.step_in_backward (each unit stepped as "
                               "its gradient lands)"),
}
"""Spec keys: their values (``0``/``1`` for a switch) and what they set."""
FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "no_comm_bound": ("cudagraphs", "regions"),
    "fsdp2_eager": ("hsdp", "offload", "sync_off", "float8_gather"),
    "fsdp2_compile": ("hsdp", "offload", "sync_off", "float8_gather"),
    "simplefsdp": (),
    "fsdp_compile": tuple(KEYS),
}
"""The keys each family takes."""
BACKEND_KEYS = ("all_gather", "grad_reduce", "cudagraphs", "overlap", "memory_plan", "gradients_in_place", "regions")
"""The keys that are ``fsdp_compile.backend(**options)``'s options."""
ROUTE_NAMES = {
    ("auto", "auto"): "", ("copy_engine", "auto"): "copy_engine", ("nccl", "nccl"): "nccl",
    ("copy_engine", "copy_engine"): "copy_engine_exchange", ("nccl", "copy_engine"): "nccl_gather_copy_engine_exchange",
}
"""(all_gather, grad_reduce) -> the name's route word (the names of earlier results, and report.py's ``ROUTES``);
any other pair is ``<all_gather>_gather_<grad_reduce>_exchange``."""


@dataclass(frozen=True)
class Spec:
    """One system: a family and its options (the defaults are the library's and the benchmark's)."""

    family: str
    all_gather: str = "auto"
    grad_reduce: str = "auto"
    cudagraphs: bool = False
    overlap: bool = True
    memory_plan: bool = True
    gradients_in_place: bool = True
    regions: bool = True
    exchange_grads_in_param_dtype: bool = True
    keep_gathered: bool = False
    barriers: str = "memops"
    hsdp: bool = False
    offload: bool = False
    sync_off: bool = False
    float8_gather: bool = False
    step_in_backward: bool = False

    def options(self) -> dict[str, Any]:
        """The keys that differ from their defaults, in ``KEYS``' order."""
        defaults = Spec(self.family)
        return {key: getattr(self, key) for key in KEYS if getattr(self, key) != getattr(defaults, key)}

    def backend_options(self) -> dict[str, Any]:
        """``fsdp_compile.backend(**options)``'s options that differ from their defaults."""
        return {key: value for key, value in self.options().items() if key in BACKEND_KEYS}

    def other_options(self) -> dict[str, Any]:
        """The options beyond the backend's (sharding, mixed precision, barriers, mesh) that differ."""
        return {key: value for key, value in self.options().items() if key not in BACKEND_KEYS}

    @property
    def text(self) -> str:
        """The spec as ``--system`` takes it, defaults left out."""
        items = [f"{key}={int(v) if isinstance(v, bool) else v}" for key, v in self.options().items()]
        return f"{self.family}:{','.join(items)}" if items else self.family

    @property
    def name(self) -> str:
        """The canonical result name: the family, then a word per option that differs from its default."""
        routes = (self.all_gather, self.grad_reduce)
        route = ROUTE_NAMES.get(routes, "{}_gather_{}_exchange".format(*routes))
        words = ((True, self.family), (True, route), (not self.overlap, "no_overlap"),
                 (not self.exchange_grads_in_param_dtype, "reduce_scatter"), (not self.gradients_in_place, "packed"),
                 (not self.regions, "whole_graph"),
                 (self.keep_gathered, "keep_gathered"), (not self.memory_plan, "unplanned"),
                 (self.barriers == "kernels", "barrier_kernels"), (self.hsdp, "hsdp"), (self.cudagraphs, "cudagraphs"),
                 (self.offload, "offload"), (self.sync_off, "sync_off"), (self.float8_gather, "float8_gather"),
                 (self.step_in_backward, "step_in_backward"))
        return "_".join(word for wanted, word in words if wanted and word)

    @property
    def gpu_only(self) -> bool:
        """Copy-engine routes and barrier kernels need GPUs; on CPU an ``nccl`` route is gloo, the default again."""
        return self.all_gather != "auto" or self.grad_reduce != "auto" or self.barriers == "kernels"


def parse_spec(text: str) -> Spec:
    """``family[:key=value,...]`` -> its Spec; ValueError naming the valid families, keys or values (and, given a
    result name, its spec)."""
    try:
        return _parse(text)
    except ValueError as error:
        known = {spec.name: spec.text for spec in CATALOGUE}
        if text in known:
            raise ValueError(f"{error} ({text} is a result name: write --system {known[text]})") from None
        raise


def _parse(text: str) -> Spec:
    family, colon, rest = text.partition(":")
    if family not in FAMILIES:
        raise ValueError(f"unknown system family {family!r} in {text!r}; valid families: {', '.join(FAMILIES)}")
    options: dict[str, Any] = {}
    for item in rest.split(",") if colon else ():
        key, equals, value = item.partition("=")
        valid_keys = ", ".join(FAMILY_KEYS[family]) or "none"
        if key not in FAMILY_KEYS[family] or not equals:
            raise ValueError(f"{text!r}: {item!r} is not a key=value of {family}; its keys: {valid_keys}")
        values = KEYS[key][0]
        if value not in values:
            raise ValueError(f"{text!r}: {key}={value!r}; valid values of {key}: {', '.join(values)}")
        if key in options:
            raise ValueError(f"{text!r}: {key} given twice")
        options[key] = value == "1" if values == BOOL else value
    spec = Spec(family, **options)
    if family == "fsdp_compile":
        try:  # the library's own checks of the backend options' combinations
            fsdp_compile.BackendConfig(**spec.backend_options())
        except (TypeError, ValueError) as error:
            raise ValueError(f"{text!r}: {error}") from None
        if spec.grad_reduce == "copy_engine" and not spec.exchange_grads_in_param_dtype:
            raise ValueError(f"{text!r}: grad_reduce=copy_engine exchanges gradients, "
                             "which exchange_grads_in_param_dtype=0 replaces by a reduce-scatter")
    return spec


def parse_specs(words: list[str]) -> list[Spec]:
    """``--system``'s words (each may hold several specs, separated by whitespace) -> Specs, each name once."""
    specs = [parse_spec(text) for word in words for text in word.split()]
    names = [spec.name for spec in specs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"the same system given twice: {', '.join(twice)}")
    return specs


CATALOGUE: tuple[Spec, ...] = tuple(_parse(text) for text in (
    "no_comm_bound", "no_comm_bound:cudagraphs=1", "fsdp2_eager", "fsdp2_compile", "simplefsdp",
    "fsdp_compile", "fsdp_compile:overlap=0", "fsdp_compile:exchange_grads_in_param_dtype=0",
    "fsdp_compile:cudagraphs=1", "fsdp_compile:all_gather=copy_engine",
    "fsdp_compile:all_gather=copy_engine,cudagraphs=1", "fsdp_compile:memory_plan=0",
    "fsdp_compile:gradients_in_place=0", "fsdp_compile:all_gather=copy_engine,memory_plan=0",
    "fsdp_compile:all_gather=nccl,grad_reduce=nccl", "fsdp_compile:all_gather=nccl,grad_reduce=nccl,cudagraphs=1",
    "fsdp_compile:all_gather=copy_engine,grad_reduce=copy_engine",
    "fsdp_compile:all_gather=copy_engine,grad_reduce=copy_engine,cudagraphs=1",
    "fsdp_compile:all_gather=nccl,grad_reduce=copy_engine",
    "fsdp_compile:all_gather=nccl,grad_reduce=copy_engine,cudagraphs=1",
    "fsdp_compile:keep_gathered=1", "fsdp_compile:keep_gathered=1,cudagraphs=1", "fsdp_compile:barriers=kernels",
    "fsdp2_compile:hsdp=1", "fsdp_compile:hsdp=1",
))
"""The systems measured so far (benchmarks/results/), in the order a default run takes them."""
FSDP_COMPILE_VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    spec.name: (spec.backend_options(), spec.other_options()) for spec in CATALOGUE if spec.family == "fsdp_compile"
}
"""The catalogue's fsdp_compile systems: name -> (backend options, other options) (the tests check that the
fixed routes' names are the ones report.py's ``ROUTES`` looks for)."""


def default_specs(cuda: bool, hsdp: bool, cuda_graphs: bool) -> list[Spec]:
    """The catalogue but ``keep_gathered`` (another sharding policy), and unless possible: the GPU-only systems
    (``cuda``), the HSDP ones (``hsdp``: an even number of ranks, at least 4), the CUDA-graph ones (Inductor)."""
    return [spec for spec in CATALOGUE if not spec.keep_gathered and (cuda or not spec.gpu_only)
            and (hsdp or not spec.hsdp) and (cuda_graphs or not spec.cudagraphs)]


def help_text() -> str:
    """The spec grammar for ``--help``: families, keys, the catalogue's names and specs."""
    def entry(head: str, what: str) -> list[str]:
        return textwrap.wrap(f"{head}: {what}", 116, initial_indent="  ", subsequent_indent="      ")

    defaults = Spec("fsdp_compile")
    lines = ["SPEC = family[:key=value,key=value,...], e.g. fsdp_compile:all_gather=copy_engine,cudagraphs=1", "",
             "families (their keys):"]
    for family, what in FAMILIES.items():
        lines += entry(f"{family} ({', '.join(FAMILY_KEYS[family]) or 'no keys'})", what)
    lines += ["", "keys (their values; the default):"]
    for key, (values, what) in KEYS.items():
        default = getattr(defaults, key)
        lines += entry(f"{key}={'|'.join(values)} ({int(default) if isinstance(default, bool) else default})", what)
    lines += ["", "the systems measured so far (benchmarks/results/): result name, spec; the default set: all but",
              "keep_gathered, and on CPU the GPU-only ones, under 4 ranks the HSDP ones, with --compiler aot_eager",
              "the CUDA-graph ones:"]
    lines += [f"  {spec.name:<58} {spec.text}" for spec in CATALOGUE]
    return "\n".join(lines)


assert len({spec.name for spec in CATALOGUE}) == len(CATALOGUE) and all(
    parse_spec(spec.text) == spec for spec in CATALOGUE), "a catalogue name or text is not canonical"
