"""Every use of torch internals in the library, and every shim between torch versions.

The library runs on torch 2.11 (the GPU machines) and 2.13+ (CPU). Library modules reach torch's private
modules (``torch._dynamo``, ``torch._functorch``, ``torch._inductor``, ``torch._logging``, ``torch._C``,
``torch.distributed._symmetric_memory``, the ``torch.ops._c10d_functional`` namespace) only through this
package (this module and ``symm_mem``); ``tests/test_structure.py`` enforces it. Features are detected,
never version numbers compared: what the library cannot work without is looked up when this module is
imported, and a missing piece raises :class:`MissingTorchFeature`, naming the torch version and what it
lacks. Optional features (symmetric memory) are detected once, when first used.

Shims, each where it is used:
* Inductor takes a single ``post_grad_custom_post_pass`` on 2.11 (a list on 2.13+): :class:`PassPipeline`.
* ``compile_fx`` tells its ``inner_compile`` which graph it compiles only through the ``is_backward``
  keyword, for the backward graph alone (the forward call omits it): :func:`is_backward_compile`.
* Symmetric memory's shims: ``fsdp_compile._internals.symm_mem``.
* The library's step ops, defined with the dispatcher, and how Inductor lowers them:
  ``fsdp_compile._internals.step_ops``.
* Gloo process groups race in torch itself when two worker threads finish at once (heap corruption):
  :func:`gloo_one_worker_thread`, for the multi-rank harness on CPU.
* ``destroy_process_group()`` hangs while a CUDA graph that captured NCCL kernels lives, and has no hook:
  ``fsdp_compile._internals.lifetime``.
* What the failure channels lean on (a group's collective count, aborting it, the autograd engine's callbacks):
  ``fsdp_compile._internals.failures``.
* Not torch's, detected the same way: the CUDA driver's stream calls (stream memory operations: barriers that
  hold no SM; peer copies and events at a few µs of host time each), ``fsdp_compile._internals.cuda_driver``.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx

__all__ = [
    "BODY_DONATION_HOOK", "BackendCompilerFailed", "bodies_donate_nothing", "body_schemas_once", "COMPILE_AFRESH", "INVOKE_SUBGRAPH", "compile_region", "dynamo_reset", "frame_callback", "is_region_break", "set_frame_callback", "CustomGraphPass", "MissingTorchFeature", "OptimizedModule", "Shard", "ShardMetadata", "PassPipeline",
    "FakeTensorMode", "OpOverload", "checkpoint_wrapper", "TorchDispatchMode", "aot_autograd", "c10d_functional", "fake_store", "compile_fx", "compile_fx_inner", "counters", "current_compile_id",
    "hash_sources", "flat_optimizer_state", "gloo_one_worker_thread", "group_named", "group_ranks", "group_store",
    "group_timeout",
    "get_optimizer_state_dict", "inductor_config", "is_backward_compile", "is_sharded_tensor", "is_view_op",
    "list_mode_options", "make_boxed_func", "mark_static", "outside_fake_mode", "outside_graph_pools", "tree_leaves", "inductor_decompositions",
    "placeholder_source", "run_by_python", "running_backward",
    "min_cut_rematerialization_partition", "no_donated_buffers", "no_torch_function_subclass", "register_work", "run_observed",
    "set_optimizer_state_dict", "sharded_tensor", "trace_log", "trace_structured",
]


T = TypeVar("T")


class MissingTorchFeature(RuntimeError):
    """This torch lacks something fsdp_compile needs."""


def _missing(what: str, fix: str = "use torch 2.11 or newer") -> MissingTorchFeature:
    return MissingTorchFeature(f"fsdp_compile needs {what}, which torch {torch.__version__} lacks: {fix}")


def _need(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise _missing(f"{module}.{name}") from e


# Registers the autograd of the functional collectives: an all-gather inserted before AOT tracing then
# yields its reduce-scatter in the backward graph.
importlib.import_module("torch.distributed._functional_collectives")

aot_autograd: Callable[..., Any] = _need("torch._dynamo.backends.common", "aot_autograd")
counters: Any = _need("torch._dynamo.utils", "counters")
"""``counters["fsdp_compile"][...]``: what the library did, for tests and tlparse."""
make_boxed_func: Callable[..., Any] = _need("torch._functorch.aot_autograd", "make_boxed_func")
min_cut_rematerialization_partition: Callable[..., Any] = _need(
    "torch._functorch.partitioners", "min_cut_rematerialization_partition"
)
OptimizedModule: type = _need("torch._dynamo.eval_frame", "OptimizedModule")
"""What ``torch.compile(module)`` returns."""
BackendCompilerFailed: type = _need("torch._dynamo.exc", "BackendCompilerFailed")
"""What torch.compile raises for an exception of a backend (``inner_exception``: that exception)."""
mark_static: Callable[..., None] = _need("torch._dynamo", "mark_static")
"""``mark_static(tensor)``: Dynamo compiles the tensor's sizes as constants, even after a recompile for new sizes
(where it would otherwise make them symbolic: "automatic dynamic shapes")."""
inductor_config: Any = _need("torch._inductor", "config")
COMPILE_AFRESH = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
"""Inductor settings under which a graph is compiled, its passes run, never loaded from the FX graph cache (nor
from AOTAutograd's, which stands on it). Its kernels still come from the cache folder when their code is the
same: ``force_disable_caches`` would also point that at a fresh folder and compile every kernel anew (~0.75 s
a C++ kernel on a 2-core CPU)."""
list_mode_options: Callable[..., dict[str, Any]] = _need("torch._inductor", "list_mode_options")
"""``torch.compile``'s ``mode=`` -> Inductor settings."""
checkpoint_wrapper: Callable[..., Any] = _need("torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
                                               "checkpoint_wrapper")
"""``checkpoint_wrapper(module)``: the module recomputed in backward (non-reentrant ``torch.utils.checkpoint``), as
FSDP2 users and torchtitan wrap blocks before sharding."""
compile_fx: Callable[..., Any] = _need("torch._inductor.compile_fx", "compile_fx")
compile_fx_inner: Callable[..., Any] = _need("torch._inductor.compile_fx", "compile_fx_inner")
CustomGraphPass: type = _need("torch._inductor.custom_graph_pass", "CustomGraphPass")
_get_hash_for_files: Callable[..., bytes] = _need("torch._inductor.custom_graph_pass", "get_hash_for_files")
trace_structured: Callable[..., None] = _need("torch._logging", "trace_structured")
trace_log: Any = _need("torch._logging._internal", "trace_log")
"""The structured-trace logger (TORCH_TRACE's): a handler on it receives every structured record."""
OpOverload: type = _need("torch._ops", "OpOverload")
outside_fake_mode: Callable[[], Any] = _need("torch._subclasses.fake_tensor", "unset_fake_temporarily")
"""Context manager: real tensors, even inside a compile (whose passes run under a FakeTensorMode)."""
FakeTensorMode: type = _need("torch._subclasses.fake_tensor", "FakeTensorMode")
TorchDispatchMode: type = _need("torch.utils._python_dispatch", "TorchDispatchMode")
tree_leaves: Callable[[Any], list[Any]] = _need("torch.utils._pytree", "tree_leaves")
inductor_decompositions: Callable[[], dict[Any, Any]] = _need("torch._inductor.decomposition", "select_decomp_table")
"""The decompositions Inductor has AOTAutograd apply: the graphs it lowers."""


def fake_store() -> Any:
    """The store of a fake process group (``dist.init_process_group("fake", store=...)``): collectives that do
    nothing, for one process acting as rank 0 of any world size."""
    return _need("torch.testing._internal.distributed.fake_pg", "FakeStore")()
_GraphTransformObserver: type = _need("torch.fx.passes.graph_transform_observer", "GraphTransformObserver")

ShardMetadata: type = _need("torch.distributed._shard.metadata", "ShardMetadata")
Shard: type = _need("torch.distributed._shard.sharded_tensor", "Shard")
_ShardedTensor: type = _need("torch.distributed._shard.sharded_tensor", "ShardedTensor")
_ShardedTensorMetadata: type = _need("torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata")
_TensorProperties: type = _need("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")
get_optimizer_state_dict: Callable[..., dict[str, Any]] = _need(
    "torch.distributed.checkpoint.state_dict", "get_optimizer_state_dict"
)
set_optimizer_state_dict: Callable[..., None] = _need("torch.distributed.checkpoint.state_dict", "set_optimizer_state_dict")
_StateDictOptions: type = _need("torch.distributed.checkpoint.state_dict", "StateDictOptions")


def flat_optimizer_state() -> Any:
    """Options of ``get/set_optimizer_state_dict``: one key per parameter state and hyperparameter, as DCP
    needs to reshard them."""
    return _StateDictOptions(flatten_optimizer_state_dict=True)

c10d_functional: Any = torch.ops._c10d_functional
"""The functional collectives' op namespace (``all_gather_into_tensor``, ``wait_tensor``, ...). Their
``group_name`` argument is a ``str`` on 2.11 (``Any`` on 2.13): always pass a string."""


def current_compile_id() -> str:
    """Dynamo's id of the compilation in progress ("frame/recompile", e.g. "0/1"), or "?" outside one."""
    compile_id = _need("torch._guards", "CompileContext").current_compile_id()
    return "?" if compile_id is None else str(compile_id)


group_named: Callable[[str], Any] = _need("torch.distributed.distributed_c10d", "_resolve_process_group")
"""The process group a functional collective's ``group_name`` names."""


def group_ranks() -> tuple[tuple[str, int], ...]:
    """(group name, this process's rank in it) for each of its process groups, by name."""
    groups = _need("torch.distributed.distributed_c10d", "_world").pg_names
    return tuple(sorted((name, group.rank()) for group, name in groups.items()))


def outside_graph_pools(device: torch.device, allocate: Callable[[], T]) -> T:
    """``allocate()`` (real tensors) where no CUDA graphs' pool takes its memory: Inductor's CUDA-graph trees send
    every allocation of the thread that runs a graph's warm-up to their pool, whatever the stream
    (``_cuda_beginAllocateCurrentThreadToPool``, torch 2.11 and 2.13), which must hold only the graphs' own
    tensors ("not accounted for as an output of cudagraph trees"). On CUDA it runs on a thread of its own."""
    if device.type != "cuda":
        with outside_fake_mode():
            return allocate()
    result: list[Any] = []

    def run() -> None:
        try:
            with torch.cuda.device(device), outside_fake_mode():
                result.append(allocate())
        except BaseException as e:  # raised again on the calling thread
            result.append(e)

    thread = threading.Thread(target=run, name="fsdp_compile-allocate")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def register_work(tensor: torch.Tensor, work: Any) -> None:
    """Have ``wait_tensor(tensor)`` (the graph's wait) wait for ``work``, as for a functional collective's."""
    torch._C._distributed_c10d._register_work(tensor, work)


INVOKE_SUBGRAPH: Any = getattr(torch.ops.higher_order, "invoke_subgraph", None)
"""The call of a nested compile region's body (``invoke_subgraph(body, identifier, *operands)``), None where this torch
has none."""


@contextlib.contextmanager
def body_schemas_once() -> Iterator[None]:
    """While AOTAutograd traces a step: each region body's schema (which operands it mutates) worked out once, not at
    every call of the body. Torch asks for it at each call, in its autograd check (and, on torch 2.11, in
    functionalization), and traces the whole body to answer: the calls of 80 blocks' shared body then cost as much
    as tracing 80 blocks (docs/performance.md, "Compile time"). The answer depends on the body and its operands'
    types only (the key torch 2.13 caches functionalization's by)."""
    if INVOKE_SUBGRAPH is None or "gen_schema" in vars(INVOKE_SUBGRAPH):  # no regions, or already remembered
        yield
        return
    worked_out = INVOKE_SUBGRAPH.gen_schema
    known: dict[tuple[Any, ...], tuple[Any, Any]] = {}

    def gen_schema(subgraph: Any, identifier: Any, *operands: Any) -> Any:
        body = getattr(subgraph, "subgraph", subgraph)  # through functionalization's wrapper, made anew each call
        key = (id(body), type(subgraph), identifier, tuple(type(operand) for operand in operands))
        if key not in known or known[key][0] is not body:
            known[key] = (body, worked_out(subgraph, identifier, *operands))  # holding body: its id stays its own
        return known[key][1]

    INVOKE_SUBGRAPH.gen_schema = gen_schema
    try:
        yield
    finally:
        del INVOKE_SUBGRAPH.gen_schema


def _float64_cpu_flash_attention() -> None:
    """Torch 2.11's fake kernel of the CPU flash attention (``F.scaled_dot_product_attention`` on CPU) gives a float64
    query a float32 logsumexp, which the kernel computes in float64: the compiled backward then hands the backward
    kernel a float32 buffer ("expected scalar type Double but found Float", plain ``torch.compile`` too). Torch 2.13's
    gives the query's computation dtype. Where this torch's is wrong, its Meta kernel is replaced by one that says
    float64 for float64 (found by asking it once, at import). A graph compiled without it, in Inductor's FX graph cache,
    stays wrong: the cache's key does not see a fake kernel."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    fake = _need("torch._decomp", "meta_table").get(getattr(op, "default", None))
    if fake is None:
        return
    query = torch.empty(1, 1, 1, 8, dtype=torch.float64, device="meta")
    if fake(query, query, query)[1].dtype == torch.float64:
        return

    def fixed(query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        attention, logsumexp = fake(query, *args, **kwargs)
        if query.dtype == torch.float64:
            logsumexp = torch.empty_strided(logsumexp.shape, logsumexp.stride(), dtype=torch.float64,
                                            device=logsumexp.device)
        return attention, logsumexp

    # The wrong kernel is a Python one, registered twice: as the operator's Meta kernel (the dispatcher's; replacing
    # it takes allow_override, False by default on some torches) and as its Python-dispatcher kernel (tracing's).
    global _flash_attention_meta
    _flash_attention_meta = torch.library.Library("aten", "IMPL", "Meta")
    takes = "allow_override" in inspect.signature(_flash_attention_meta.impl).parameters
    _flash_attention_meta.impl(op.default, fixed, **({"allow_override": True} if takes else {}))
    if torch._C.DispatchKey.Meta in op.default.py_kernels:
        op.default.py_kernels[torch._C.DispatchKey.Meta] = fixed
        op.default._dispatch_cache.clear()


_flash_attention_meta: Any = None
_float64_cpu_flash_attention()


_lowering: Any = importlib.import_module("torch._inductor.graph")
_functorch_config: Any = _need("torch._functorch", "config")
BODY_DONATION_HOOK: bool = hasattr(_lowering.GraphLowering, "make_subgraph") and callable(
    getattr(_lowering, "get_donated_idxs", None))
"""Whether :func:`bodies_donate_nothing` can keep Inductor from donating a body's inputs on this torch: it lowers a
body through ``GraphLowering.make_subgraph``, whose new lowering takes the donated indices from
``get_donated_idxs()`` (torch 2.11 and 2.13). Where it cannot, :func:`no_donated_buffers`."""


@contextlib.contextmanager
def bodies_donate_nothing() -> Iterator[None]:
    """While Inductor compiles a graph: the bodies it lowers (a region call's ``invoke_subgraph``) treat no input as
    donated. A body's lowering inherits the indices AOTAutograd gave the OUTER backward's donated inputs (saved
    values nothing else holds, whose storage Inductor may then reuse) and applies them to its own placeholders, a
    different list: the body then writes into an input the caller still reads (pytorch PR #193960, "Keep subgraph
    inputs from inheriting donation indices", which clears them; torch 2.11 and 2.13 lack it). The outer graph keeps
    its donations. [Note: shared bodies]"""
    if not BODY_DONATION_HOOK or getattr(_lowering.GraphLowering.make_subgraph, "donates_nothing", False):
        yield
        return
    lowering = _lowering.GraphLowering
    made = lowering.make_subgraph

    def make_subgraph(self: Any, *args: Any, **kwargs: Any) -> Any:
        donated = _lowering.get_donated_idxs
        _lowering.get_donated_idxs = lambda: None
        try:
            return made(self, *args, **kwargs)
        finally:
            _lowering.get_donated_idxs = donated

    make_subgraph.donates_nothing = True  # type: ignore[attr-defined]
    lowering.make_subgraph = make_subgraph
    try:
        yield
    finally:
        lowering.make_subgraph = made


def no_donated_buffers() -> Any:
    """A context in which AOTAutograd marks no backward input donated (``torch._functorch.config.donated_buffer``):
    Inductor then reuses none of them, in the graph or in a body it calls."""
    return _functorch_config.patch(donated_buffer=False)


def compile_region(fn: Callable[..., T]) -> Callable[..., T] | None:
    """``fn`` as a nested compile region (``torch.compiler.nested_compile_region``): Dynamo traces its calls into
    bodies, keeps one body per distinct graph and calls it (``INVOKE_SUBGRAPH``); AOTAutograd partitions each body once
    and Inductor compiles it once. None where this torch has no regions."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    return None if region is None or INVOKE_SUBGRAPH is None else region(fn)


_UncapturedRegion: type = _need("torch._dynamo.exc", "UncapturedHigherOrderOpError")


def is_region_break(error: BaseException) -> bool:
    """Whether ``error`` is Dynamo's refusal of a nested compile region whose code breaks the graph (a region must be
    traced whole)."""
    return isinstance(error, _UncapturedRegion) and "invoke_subgraph" in str(getattr(error, "_hop_name", ""))


_set_eval_frame: Callable[[Any], Any] = _need("torch._dynamo.eval_frame", "set_eval_frame")


def frame_callback() -> Any:
    """Dynamo's frame callback on this thread now: what a ``torch.compile`` wrapper set for the frames its function
    calls. Dynamo drops it when a frame's compile raises; ``set_frame_callback`` puts it back."""
    callback = _set_eval_frame(None)
    _set_eval_frame(callback)
    return callback


def set_frame_callback(callback: Any) -> None:
    _set_eval_frame(callback)


dynamo_reset: Callable[[], None] = _need("torch._dynamo", "reset")
"""Forget every compiled frame of the process (they compile again at their next call)."""


_current_graph_task_id: Callable[[], int] = _need("torch._C", "_current_graph_task_id")


def running_backward() -> bool:
    """Whether this thread runs an autograd backward pass now (a hook, an autograd function's backward, the recompute
    of an activation checkpoint)."""
    return _current_graph_task_id() != -1


def backward_task() -> int:
    """The autograd backward pass (graph task) this thread runs now; -1 outside any."""
    return _current_graph_task_id()


def run_by_python(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn``, whose frames Dynamo leaves to Python when they are the first it meets, while it compiles the calls
    ``fn`` makes: ``torch.compile(module)`` with ``fn`` as the module's ``__call__`` compiles what ``fn`` calls,
    ``fullgraph=True`` included. Called from code Dynamo traces, ``fn`` is inlined (traced) like any function.
    (``torch.compiler.disable(fn, recursive=False)`` wraps ``fn`` in a frame that breaks the graph at once.)"""
    _need("torch._dynamo.eval_frame", "skip_code")(fn.__code__)
    return fn


def group_store(group: Any) -> Any:
    """The store ``group`` was created with (a ``PrefixStore`` of its own: keys do not collide across groups)."""
    return _need("torch.distributed.distributed_c10d", "_get_process_group_store")(group)


def group_timeout(group: Any, device: torch.device) -> datetime.timedelta:
    """How long ``group``'s collectives on ``device`` wait for the other ranks (its backend's timeout)."""
    try:
        return group._get_backend(device).options._timeout  # type: ignore[no-any-return]
    except (AttributeError, RuntimeError):  # a backend without options: torch's default for every group
        return _need("torch.distributed.distributed_c10d", "default_pg_timeout")  # type: ignore[no-any-return]


def is_sharded_tensor(value: object) -> bool:
    return isinstance(value, _ShardedTensor)


def sharded_tensor(
    shards: list[Any], metadata: list[Any], shape: tuple[int, ...], dtype: torch.dtype, group: Any
) -> Any:
    """A ShardedTensor of ``shape`` from this rank's ``shards`` and every rank's shard ``metadata`` (no
    collective: every rank knows the whole layout)."""
    global_metadata = _ShardedTensorMetadata(
        shards_metadata=metadata, size=torch.Size(shape), tensor_properties=_TensorProperties(dtype=dtype)
    )
    return _ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_metadata, process_group=group)


def no_torch_function_subclass() -> Any:
    """A context in which a ``__torch_function__`` subclass's operations run as plain tensors' (its own override
    calls the operation again inside it)."""
    return torch._C.DisableTorchFunctionSubclass()


def is_view_op(target: object) -> bool:
    """Whether an FX node's target is an aten op whose result aliases its input."""
    return isinstance(target, OpOverload) and target.is_view


def placeholder_source(node: fx.Node) -> str:
    """Where Dynamo took a graph input from (``L['self']._modules['fc']._parameters['weight']``), else the
    placeholder's name."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    if name is None:
        return node.name
    return str(name() if callable(name) else name)


def hash_sources(paths: Iterable[str], extra: str = "") -> bytes:
    """A pass's ``uuid()``: the hash of the source files it depends on and of its options (torch's helper,
    so the FX graph cache is invalidated exactly when one of them changes)."""
    return _get_hash_for_files(tuple(paths), extra)


def run_observed(gm: fx.GraphModule, name: str, graph_pass: Callable[[fx.Graph], T]) -> T | None:
    """Run ``graph_pass`` on ``gm.graph`` through Inductor's ``GraphTransformObserver``, as Inductor runs its
    own passes: provenance tracking records ``name`` on the nodes it creates,
    ``INDUCTOR_LOG_URL_FOR_GRAPH_XFORM=DIR`` draws the graph before and after it (if it creates or erases
    nodes), and ``torch._inductor.config.disabled_passes`` can name it to switch it off (then: None)."""
    return _GraphTransformObserver(gm, name).apply_graph_pass(graph_pass)


class PassPipeline(CustomGraphPass):  # type: ignore[misc, valid-type]
    """Several passes as ONE Inductor custom pass, run in order: torch 2.11 takes a single
    ``post_grad_custom_post_pass``. Its uuid joins the passes' uuids. Inductor also runs the custom pass on the
    bodies a graph calls (before the graph): a graph ``is_body`` says is one gets ``body_passes`` instead."""

    def __init__(self, passes: Sequence[Any], body_passes: Sequence[Any] = (),
                 is_body: Callable[[fx.Graph], bool] = lambda graph: False) -> None:
        self.passes = tuple(passes)
        self.body_passes = tuple(body_passes)
        self.is_body = is_body

    def __call__(self, graph: fx.Graph) -> None:
        for graph_pass in self.body_passes if self.is_body(graph) else self.passes:
            graph_pass(graph)

    def uuid(self) -> bytes:
        return _get_hash_for_files((), "".join(p.uuid().hex() for p in (*self.passes, *self.body_passes)))


def is_backward_compile(kwargs: Mapping[str, Any]) -> bool:
    """Whether ``compile_fx`` called its ``inner_compile`` for the backward graph (``is_backward=True``; the
    forward call passes no such keyword, on 2.11 and 2.13)."""
    return bool(kwargs.get("is_backward", False))


def gloo_one_worker_thread() -> None:
    """Gloo process groups created from now on in this process run their collectives on ONE worker thread
    (gloo's default is two). Why: ``ProcessGroupGloo::runLoop`` updates the group's status (the last
    completed work's name, a ``std::string``) after it releases its lock, so two worker threads finishing
    together can free one string buffer twice: heap corruption ("malloc(): unaligned tcache chunk
    detected", SIGSEGV), in about one multi-rank test run in 20-50 (torch 2.13's libtorch_cpu; reproduced
    with functional all-reduces and all-gathers alone on 3 gloo ranks). Call it before creating the groups;
    calling it again does nothing."""
    c10d = importlib.import_module("torch.distributed.distributed_c10d")
    base = c10d.ProcessGroupGloo
    if getattr(base, "one_worker_thread", False):
        return
    for name in ("_Options", "create_default_device"):
        if not hasattr(base, name):
            raise _missing(f"ProcessGroupGloo.{name}")

    class OneWorkerThreadGloo(base):  # type: ignore[misc, valid-type]
        one_worker_thread = True

        def __init__(self, store: Any, rank: int, size: int, timeout: Any = None) -> None:
            options = base._Options()
            options._devices = [base.create_default_device()]
            options._threads = 1
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = OneWorkerThreadGloo
