"""The measurement of one system at one point (``run``), and the JSON it goes into (``meta``, ``write``).

A run: the step time (median after ``warmup``); forward+backward and optimizer timed apart in ``split_steps`` more
steps (the bound's, with ``sharded_opt_ms``, make the **tight bound**); tokens/s/GPU; MFU (6 x matmul params + 12 x
layers x dim x seq FLOPs per token, over the card's dense bf16 peak); peak memory (``max_memory_allocated`` over the
timed steps, less what the previous system left: ``leftover_after_gib``, plus the memory plan's symmetric slabs,
which the allocator does not count; not comparable under CUDA graphs, whose pool it leaves out) and
``max_memory_reserved``; the slabs (``fsdp_compile.slab_bytes()``); host time to enqueue a step (the slowest
rank's; every rank's in ``extra``, split into forward and backward, with the garbage collections); from a trace of
``profile_steps`` more steps: communication, exposed communication (no other kernel running), compute, copies
between host and device (CPU offload's) and their exposed part, GPU idle time; the host's peak resident memory
while the system is built and stepped (sampled; the process's, so what earlier systems left resident counts too:
``extra["host_start_gib"]`` says how much); compile time (first step minus the median; ``extra["caches"]``:
Inductor's and AOTAutograd's cache hits).
``trace_dir`` keeps each trace (``trace_summary.py`` reads them); tracing the host slows it, so the profile columns
then come from slower steps (not the step times: those are untraced); ``trace_kernels_only`` traces the GPU only.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import gzip
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdp_compile
from fsdp_compile.testing.llama import Llama, LlamaConfig
from fsdp_compile.testing.profile import communication_overlap, trace_steps

from report import LOSS_RTOL, Result, grad_rtol  # benchmarks/
from specs import Spec
from systems import Prepared, build, grad_norms

PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}  # dense, per GPU


@dataclass(frozen=True)
class Settings:
    """The run's options (the CLI's), the same for every system and point."""

    model: str
    checkpoint: str
    compiler: str
    gc: str
    repeats: int
    steps: int
    warmup: int
    split_steps: int
    profile_steps: int
    trace_dir: str | None
    trace_kernels_only: bool
    micro_batches: int = 1
    """Forward+backward passes per optimizer step, each of ``batch`` sequences (gradient accumulation)."""
    float8: str = "none"
    """``"tensorwise"``: torchao's float8 training in every block's linear layers, for every system (emulated off the
    GPU); whether its weights are gathered as float8 is each system's ``float8_gather``."""


class _Collections:
    """A ``gc.callbacks`` entry: Python's garbage collections while it is registered, how many of each generation
    and their time (the host's, inside the steps it pauses)."""

    def __init__(self) -> None:
        self.count, self.ms, self._start = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._start) * 1e3


@contextlib.contextmanager
def _garbage_collection(mode: str) -> Iterator[None]:
    """``auto``: Python's automatic collections. ``manual``: torchtitan's practice, none during the steps (one of
    the young generations before them), automatic again after."""
    if mode == "auto":
        yield
        return
    gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _optimizer(params: list[torch.Tensor], device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=device.type == "cuda")


class _Steps:
    """One system's training steps: the same data for every system (seeded by step and rank), the host's time
    stamps after forward and after backward, the gradient norms after step 0."""

    def __init__(self, prepared: Prepared, model: Llama, batch: int, seq: int, micro_batches: int,
                 device: torch.device) -> None:
        self.prepared, self.model, self.batch, self.seq, self.device = prepared, model, batch, seq, device
        self.micro_batches = micro_batches
        self.opt = _optimizer(prepared.params, device)
        self.marks: list[float] = []
        self.grad_norms: dict[str, float] = {}

    def forward_backward(self, i: int) -> torch.Tensor:
        """The step's micro-batches (the host's marks: the first one's forward and backward); step 0 never steps in
        backward (its gradients are the guards' norms)."""
        losses = []
        for micro in range(self.micro_batches):
            last = micro == self.micro_batches - 1
            if self.prepared.set_sync is not None:
                self.prepared.set_sync(last)
            gen = torch.Generator().manual_seed(1000 * i + 100 * micro + dist.get_rank())
            tokens = torch.randint(0, self.model.cfg.vocab_size, (self.batch, self.seq + 1), generator=gen)
            tokens = tokens.to(self.device)
            loss = self.prepared.module(tokens[:, :-1], tokens[:, 1:])
            self.marks.append(time.perf_counter())
            stepping = self.prepared.stepping if last and i > 0 else None
            with stepping(self.opt) if stepping is not None else contextlib.nullcontext():
                loss.backward()
            self.marks.append(time.perf_counter())
            losses.append(loss.detach().clone())  # a CUDA graph's next replay overwrites its outputs
        return torch.stack(losses).mean()

    def optimize(self) -> None:
        self.opt.step()  # after step_in_backward, no gradient is left: nothing to step
        self.opt.zero_grad()

    def step(self, i: int) -> torch.Tensor:
        loss = self.forward_backward(i)
        if i == 0:
            self.grad_norms = grad_norms(self.model, self.prepared.replicas)
        self.optimize()
        return loss


def _timed_steps(steps: _Steps, result: Result, settings: Settings) -> dict[str, Any]:
    """The timed steps (peak memory and collections counted after the warm-up): each step's time and loss into
    ``result``; this rank's host times and collections, medians over the timed steps."""
    collections, enqueue_ms, phases_ms = _Collections(), [], []
    with contextlib.ExitStack() as counting:  # the collections during the timed steps only
        for i in range(settings.steps):
            if i == settings.warmup:
                if steps.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(steps.device)
                gc.callbacks.append(collections)
                counting.callback(gc.callbacks.remove, collections)
            _sync(steps.device)
            steps.marks.clear()
            start = time.perf_counter()
            loss = steps.step(i)
            enqueue_ms.append((time.perf_counter() - start) * 1e3)
            phases_ms.append(((steps.marks[0] - start) * 1e3, (steps.marks[1] - steps.marks[0]) * 1e3))
            _sync(steps.device)
            result.step_ms.append((time.perf_counter() - start) * 1e3)
            global_loss = loss.float()
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            result.losses.append(global_loss.item())
    timed, warmup = settings.steps - settings.warmup, settings.warmup
    return {"host_ms_per_rank": statistics.median(enqueue_ms[warmup:]),
            "host_forward_ms_per_rank": statistics.median(f for f, _ in phases_ms[warmup:]),
            "host_backward_ms_per_rank": statistics.median(b for _, b in phases_ms[warmup:]),
            "gc_ms_per_step_per_rank": collections.ms / timed,
            "gc_collections_per_step_per_rank": [n / timed for n in collections.count]}


def _split_steps(steps: _Steps, settings: Settings) -> tuple[float, float]:
    """Medians of forward+backward and of the optimizer step, timed apart in ``split_steps`` more steps."""
    split_ms = []
    for i in range(settings.steps, settings.steps + settings.split_steps):
        _sync(steps.device)
        start = time.perf_counter()
        steps.forward_backward(i)
        _sync(steps.device)
        middle = time.perf_counter()
        steps.optimize()
        _sync(steps.device)
        split_ms.append(((middle - start) * 1e3, (time.perf_counter() - middle) * 1e3))
    return statistics.median(f for f, _ in split_ms), statistics.median(o for _, o in split_ms)


def _profile(steps: _Steps, settings: Settings, stem: str) -> dict[str, float]:
    """Where the GPU's time went in ``profile_steps`` traced steps (communication, exposed, compute, idle);
    the trace kept in ``trace_dir`` as ``stem``.json.gz."""
    first = settings.steps + settings.split_steps
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        trace_steps(lambda i: steps.step(first + i), settings.profile_steps, trace.name,
                    host=bool(settings.trace_dir) and not settings.trace_kernels_only)
        overlap = communication_overlap(trace.name, settings.profile_steps)
        if settings.trace_dir:
            os.makedirs(settings.trace_dir, exist_ok=True)
            kept = os.path.join(settings.trace_dir, f"{stem}.json.gz")
            with open(trace.name, "rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return overlap


def run(spec: Spec, cfg: LlamaConfig, batch: int, seq: int, repeat: int, settings: Settings,
        device: torch.device) -> Result:
    """One system at one point of the sweep, built afresh (the previous system's code and memory released)."""
    resident = _release(device)
    caches = _cache_counts()
    torch.manual_seed(0)
    tokens = batch * seq * settings.micro_batches
    result = Result(system=spec.name, tokens_per_gpu=tokens, batch=batch, seq=seq, repeat=repeat, losses=[],
                    step_ms=[], peak_comparable=not spec.cudagraphs)
    host_memory = _HostPeak()
    with device:
        model = Llama(cfg)
    if settings.float8 != "none":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(emulate=device.type != "cuda", enable_fsdp_float8_all_gather=spec.float8_gather)
        convert_to_float8_training(model.layers, config=config)
    model_ref = weakref.ref(model)
    steps = _Steps(build(spec, model, device, settings.compiler), model, batch, seq, settings.micro_batches, device)
    del model
    with steps.prepared.context(), _garbage_collection(settings.gc):
        host = _timed_steps(steps, result, settings)
        result.grad_norms = steps.grad_norms
        result.slab_mib = fsdp_compile.slab_bytes() / 2**20
        if device.type == "cuda":
            symmetric = fsdp_compile.slab_bytes(symmetric=True)  # the driver's memory: not in the allocator's peak
            result.peak_gib = (torch.cuda.max_memory_allocated(device) - resident + symmetric) / 2**30
            result.reserved_gib = torch.cuda.max_memory_reserved(device) / 2**30
        result.fwd_bwd_ms, result.opt_ms = _split_steps(steps, settings)
        start, result.host_peak_gib, end = host_memory.stop()
        result.extra.update(host_start_gib=start, host_rss_gib=end)
        if device.type == "cuda" and settings.profile_steps:
            overlap = _profile(steps, settings, f"{spec.name}_{tokens}_run{repeat}_rank{dist.get_rank()}")
            result.comm_ms, result.exposed_comm_ms = overlap["comm"], overlap["exposed"]
            result.compute_ms, result.idle_ms = overlap["compute"], overlap["idle"]
            result.host_copy_ms, result.exposed_host_copy_ms = overlap["host_copy"], overlap["host_copy_exposed"]
    if spec.family == "no_comm_bound":
        result.sharded_opt_ms = _sharded_optimizer_ms(steps.prepared.params, settings.split_steps, device)
    result.median_step_ms = statistics.median(result.step_ms[settings.warmup:])
    per_rank: list[Any] = [None] * dist.get_world_size()  # the slowest rank's host paces every collective
    dist.all_gather_object(per_rank, host)
    result.extra.update({key: [rank[key] for rank in per_rank] for key in host})
    result.cpu_ms = max(result.extra["host_ms_per_rank"])
    result.compile_s = max(0.0, (result.step_ms[0] - result.median_step_ms) / 1e3)
    result.tokens_per_s_per_gpu = tokens / (result.median_step_ms / 1e3)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in card), None)
    if peak:
        result.mfu = _flops_per_token(cfg, seq) * result.tokens_per_s_per_gpu / peak
    del steps
    leftover = _release(device) - resident
    result.extra.update(resident_before_gib=resident / 2**30, leftover_after_gib=leftover / 2**30,
                        model_freed=model_ref() is None, spec=spec.text,
                        caches={k: v - caches.get(k, 0) for k, v in _cache_counts().items() if v != caches.get(k, 0)})
    return result


def _flops_per_token(cfg: LlamaConfig, seq: int) -> float:
    per_block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    matmul_params = cfg.n_layers * per_block + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * seq


def _release(device: torch.device) -> int:
    """Drop compiled code, memory-plan slabs and garbage from the previous system (each system reserves slabs of
    its own, and its peak counts them); the bytes still allocated after that."""
    torch._dynamo.reset()
    fsdp_compile.release_slabs()
    gc.collect()
    _trim_host_heap()
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache")
    empty_host_cache()  # CPU offload's pinned blocks, cached by the host allocator: the next system's host memory
    return torch.cuda.memory_allocated(device)


def _trim_host_heap() -> None:
    """Hand the C heap's free pages back to the system: glibc keeps freed blocks below its mmap threshold, so a
    previous system's host state (CPU offload's optimizer states and gradients) stayed resident, counted in the
    next system's host memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _resident_gib() -> float:
    """This process's resident host memory (pinned memory included)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


class _HostPeak:
    """Samples the resident memory on a thread from its creation to ``stop``: a host optimizer's transient
    buffers show only in the peak."""

    def __init__(self, every_s: float = 0.005) -> None:
        self._samples = [_resident_gib()]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(every_s,), daemon=True)
        self._thread.start()

    def _sample(self, every_s: float) -> None:
        while not self._done.wait(every_s):
            self._samples.append(_resident_gib())

    def stop(self) -> tuple[float, float, float]:
        """The resident GiB at the start, the peak and now."""
        self._done.set()
        self._thread.join()
        self._samples.append(_resident_gib())
        return self._samples[0], max(self._samples), self._samples[-1]


def _sharded_optimizer_ms(params: list[nn.Parameter], reps: int, device: torch.device) -> float:
    """Median time of the benchmark's AdamW over 1/world of every parameter (zero gradients): the optimizer
    step of a sharded system, without its sharding."""
    world = dist.get_world_size()
    shards = [torch.zeros(-(-p.numel() // world), device=device, requires_grad=True) for p in params]
    opt = _optimizer(shards, device)
    times = []
    for _ in range(reps + 1):
        for shard in shards:  # what backward leaves; opt.zero_grad() drops it again, as in the systems' steps
            shard.grad = torch.zeros_like(shard)
        _sync(device)
        start = time.perf_counter()
        opt.step()
        opt.zero_grad()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def _cache_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache: hits, misses, bypasses so far in this process (a
    system's compile time is short only where its graphs come from the cache)."""
    counters = torch._dynamo.utils.counters
    return {f"{group}.{key}": n for group in ("inductor", "aot_autograd") for key, n in counters[group].items()
            if "cache" in key}


def meta(settings: Settings, specs: list[Spec], device: torch.device) -> dict[str, Any]:
    """The JSON's ``meta``: the run's settings, card and versions, the systems' specs, the guards' tolerances."""
    use_cuda = device.type == "cuda"
    return {
        "model": settings.model, "checkpoint": settings.checkpoint, "world_size": dist.get_world_size(),
        "card": torch.cuda.get_device_name(device) if use_cuda else "cpu", "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if use_cuda else None,
        "steps": settings.steps, "warmup": settings.warmup, "split_steps": settings.split_steps,
        "repeats": settings.repeats, "compiler": settings.compiler, "gc": settings.gc, "float8": settings.float8,
        "loss_rtol": LOSS_RTOL, "grad_rtol": grad_rtol(settings.float8),
        "systems": {spec.name: spec.text for spec in specs},
    }


def write(path: str | None, meta: dict[str, Any], results: list[Result]) -> None:
    """The JSON file (``--out``; none without one): ``meta`` and every result so far."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "results": [asdict(r) for r in results]}, f, indent=1)
