"""What ampguard costs next to plain torch AMP: the measurements behind ``ampguard bench``.

One small transformer model is trained twice from the same weights on the same
batches:

* **torch**: torch's own ``GradScaler``, ``torch.autocast`` and
  ``clip_grad_norm_``, exactly as they are without ampguard (the original
  objects, reached through the wrappers ampguard installed: see
  :func:`torch_implementations`);
* **ampguard**: :class:`~ampguard.SafeGradScaler`, and ``torch.autocast`` and
  ``torch.nn.utils.clip_grad_norm_`` as the installed patches left them.

Both run the documented recipe (scale, backward, ``unscale_``, clip, step,
update). Timed blocks of a few steps alternate between the two in the order
torch, ampguard, ampguard, torch, ... so that drift of the machine (other
processes, clock changes) falls on both alike; the ratio is the median of the
ratios of paired blocks. Host-device synchronisations and dispatched tensor
ops are counted in a separate, untimed pass (a counting TorchDispatchMode
slows every op down). The time ``import ampguard`` adds to ``import torch`` is
measured in fresh interpreters, and the idle overhead of the wrapped
``clip_grad_norm_`` with interleaved blocks of calls.

:func:`run` returns everything as one JSON-ready dict; the fields are
documented in ``docs/performance.md`` and checked by ``tests/test_bench.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampguard
from ampguard.scaler import SafeGradScaler, TorchGradScaler
from ampguard.syncs import HostReadCounter

SCHEMA_VERSION = 1

# What "no measurable cost" means, as checked next to every measured value.
TARGETS: dict[str, float] = {
    "step_time_ratio": 1.01,  # median ampguard/torch per-step time, at most
    "extra_syncs_per_step": 0,  # host-device synchronisations ampguard adds per step
    "import_overhead_ms": 50.0,  # what `import ampguard` adds to `import torch`
    "clip_idle_overhead": 0.02,  # wrapped clip_grad_norm_ vs torch's, nothing scaled
}

# Both scalers start from the same scale and grow alike, so both skip the same
# steps (torch's default of 65536 would skip early steps that ampguard's 1024 does not).
INIT_SCALE = 1024.0
GROWTH_INTERVAL = 100
MAX_NORM = 1.0
LEARNING_RATE = 1e-3
SEED = 0
DATA_BATCHES = 8  # distinct batches, cycled
COUNTED_STEPS = 4  # steps per variant in the sync-counting pass
CLIP_TENSORS = 100
CLIP_TENSOR_SHAPE = (64, 64)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(ampguard.__file__)) + os.sep


@dataclass(frozen=True)
class ModelSpec:
    """The transformer the bench trains: token embedding, pre-norm encoder blocks, output head."""

    vocab: int
    d_model: int
    heads: int
    ff: int
    layers: int
    seq: int
    batch: int

    @classmethod
    def for_device(cls, device: str) -> ModelSpec:
        if device == "cuda":
            return cls(vocab=8192, d_model=512, heads=8, ff=2048, layers=4, seq=256, batch=16)
        return cls(vocab=1024, d_model=128, heads=4, ff=512, layers=2, seq=64, batch=8)


def default_dtype(device: str) -> str:
    """float16 on a GPU; bfloat16 on the CPU, where float16 matmuls have no fast kernel on most
    processors (0.4 GFLOP/s against 31 in float32 on the machine docs/performance.md was measured on)
    and would hide any overhead. The GradScaler recipe runs unchanged either way: the parameters and
    their gradients are float32, so the scaler and the clip do the same work."""
    return "float16" if device == "cuda" else "bfloat16"


def default_block_steps(device: str) -> int:
    """Steps per timed block: 1 on the CPU (the most pairs, the closest in time); 10 on a GPU, where
    each block ends with a synchronize that would otherwise keep the GPU's queue from filling."""
    return 10 if device == "cuda" else 1


@dataclass(frozen=True)
class Options:
    """What ``ampguard bench`` was asked to do."""

    device: str = "cpu"
    dtype: str = "bfloat16"  # autocast dtype: see default_dtype()
    steps: int = 300  # timed steps per variant (and per optimizer kind)
    block_steps: int = 1  # steps per timed block; the ratio is taken over paired blocks
    warmup_steps: int = 10  # untimed steps per variant before timing
    fused: bool = False  # also time a fused optimizer
    import_runs: int = 5  # fresh interpreters per import measurement (0: skip)
    clip_calls: int = 20  # calls per timed block of the clip measurement
    clip_blocks: int = 30  # paired blocks of the clip measurement
    model: ModelSpec | None = None  # None: ModelSpec.for_device(device)
    progress: Callable[[str], None] | None = None


# -- the two implementations -----------------------------------------------------------


def _in_ampguard(function: Any) -> bool:
    code = getattr(function, "__code__", None) if type(function) is types.FunctionType else None
    return code is not None and os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR)


def is_ampguard_wrapper(obj: Any) -> bool:
    """Whether ``obj`` is a wrapper ampguard put around a torch object (``functools.wraps`` or wrapt)."""
    if type(obj) is types.FunctionType:
        return "__wrapped__" in vars(obj) and _in_ampguard(obj)
    # wrapt proxies forward __class__, __module__ and __code__ to the wrapped object; their wrapper is their own.
    # (a wrapt proxy keeps attributes named _self_* on itself, so this is the proxy's own wrapper).
    return _in_ampguard(getattr(obj, "_self_wrapper", None)) and hasattr(obj, "__wrapped__")


def unwrap_ampguard(obj: Any) -> Any:
    """``obj`` without ampguard's wrappers; torch's own decorators (``_no_grad``...) stay."""
    while is_ampguard_wrapper(obj):
        obj = obj.__wrapped__
    return obj


def pristine(cls: type) -> type:
    """``cls`` as torch defines it: a subclass undoing the wrappers ampguard put on its methods in place.

    ``cls`` itself when ampguard changed none of them.
    """
    originals = {name: unwrap_ampguard(value) for name, value in vars(cls).items() if is_ampguard_wrapper(value)}
    if not originals:
        return cls
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__, **originals}
    return type(cls.__name__, (cls,), namespace)


@dataclass(frozen=True)
class Implementation:
    """The three things a training step uses that ampguard may change."""

    name: str
    scaler_class: type
    autocast: Callable[..., Any]
    clip_grad_norm_: Callable[..., torch.Tensor]


def torch_implementations() -> Implementation:
    """torch's originals, whatever ampguard has wrapped or rebound."""
    return Implementation(
        name="torch",
        scaler_class=pristine(TorchGradScaler),
        autocast=pristine(torch.amp.autocast_mode.autocast),
        clip_grad_norm_=unwrap_ampguard(torch.nn.utils.clip_grad_norm_),
    )


def _current_clip_grad_norm_(*args: Any, **kwargs: Any) -> torch.Tensor:
    # Looked up at every call, as a training script's `torch.nn.utils.clip_grad_norm_(...)` is.
    return torch.nn.utils.clip_grad_norm_(*args, **kwargs)


def ampguard_implementations() -> Implementation:
    """SafeGradScaler, and autocast and clip_grad_norm_ as the installed patches left them."""
    return Implementation(
        name="ampguard",
        scaler_class=SafeGradScaler,
        autocast=torch.autocast,
        clip_grad_norm_=_current_clip_grad_norm_,
    )


def clip_is_wrapped() -> bool:
    return is_ampguard_wrapper(torch.nn.utils.clip_grad_norm_)


# -- the model and one training run ----------------------------------------------------


class TinyTransformer(torch.nn.Module):
    """A token embedding, ``layers`` pre-norm transformer encoder blocks and a linear head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(spec.vocab, spec.d_model)
        block = torch.nn.TransformerEncoderLayer(
            spec.d_model, spec.heads, spec.ff, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.ModuleList([copy.deepcopy(block) for _ in range(spec.layers)])
        self.head = torch.nn.Linear(spec.d_model, spec.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def fused_unavailable_reason(device: str) -> str | None:
    """Why ``AdamW(fused=True)`` cannot run on ``device`` with this torch (None: it can)."""
    try:
        parameter = torch.nn.Parameter(torch.zeros(2, device=device))
        optimizer = torch.optim.AdamW([parameter], fused=True)
        parameter.grad = torch.zeros_like(parameter)
        optimizer.step()
    except Exception as error:  # the error text is the reason (e.g. CPU before torch 2.4)
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return None


class Run:
    """One variant training its own copy of the model: ``step()`` is one full AMP iteration."""

    def __init__(
        self,
        implementation: Implementation,
        model: torch.nn.Module,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        device: str,
        fused: bool,
        dtype: torch.dtype,
    ) -> None:
        self.implementation = implementation
        self.device = device
        self.dtype = dtype
        self.model = copy.deepcopy(model)
        extra = {"fused": True} if fused else {}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATE, **extra)
        self.scaler = implementation.scaler_class(device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
        self.batches = batches
        self.index = 0

    def step(self) -> None:
        tokens, targets = self.batches[self.index % len(self.batches)]
        self.index += 1
        impl = self.implementation
        self.optimizer.zero_grad(set_to_none=True)
        with impl.autocast(self.device, dtype=self.dtype):
            logits = self.model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        impl.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.step()


def make_runs(options: Options, fused: bool) -> tuple[Run, Run]:
    """The torch run and the ampguard run: same initial weights, same batches."""
    spec = options.model or ModelSpec.for_device(options.device)
    generator = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model = TinyTransformer(spec).to(options.device)
    batches = [
        (
            torch.randint(spec.vocab, (spec.batch, spec.seq), generator=generator).to(options.device),
            torch.randint(spec.vocab, (spec.batch, spec.seq), generator=generator).to(options.device),
        )
        for _ in range(DATA_BATCHES)
    ]
    dtype = getattr(torch, options.dtype)
    return (
        Run(torch_implementations(), model, batches, options.device, fused, dtype),
        Run(ampguard_implementations(), model, batches, options.device, fused, dtype),
    )


# -- timing -----------------------------------------------------------------------------


class _Timer:
    """Seconds taken by ``work()``: wall clock on the CPU, CUDA events on a GPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def __call__(self, work: Callable[[], None]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        started = time.perf_counter()
        work()
        return time.perf_counter() - started


def _without_gc(work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        gc.disable()
        try:
            work()
        finally:
            gc.enable()

    return run


def interleaved_blocks(first: Callable[[], None], second: Callable[[], None], pairs: int, timer: _Timer) -> list[tuple[float, float]]:
    """``pairs`` paired timings (first, second), run in the order A B, B A, A B, ... (drift cancels)."""
    timed: list[tuple[float, float]] = []
    gc.collect()
    for pair in range(pairs):
        if pair % 2 == 0:
            a = timer(_without_gc(first))
            b = timer(_without_gc(second))
        else:
            b = timer(_without_gc(second))
            a = timer(_without_gc(first))
        timed.append((a, b))
    return timed


def _ratio_summary(timed: list[tuple[float, float]]) -> dict[str, float]:
    ratios = [b / a for a, b in timed]
    median = statistics.median(ratios)
    # Standard error of a median, from a robust spread (1.4826 MAD estimates the standard deviation).
    spread = 1.4826 * statistics.median(abs(r - median) for r in ratios)
    return {
        "ratio": median,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_stderr": 1.2533 * spread / len(ratios) ** 0.5,
    }


def time_steps(options: Options, fused: bool) -> dict[str, Any]:
    """Median per-step time of each variant and the paired ratio, for one optimizer kind."""
    torch_run, ampguard_run = make_runs(options, fused)
    timer = _Timer(options.device)
    block = max(1, min(options.block_steps, options.steps))
    pairs = max(1, options.steps // block)
    warmup_pairs = max(1, -(-options.warmup_steps // block)) if options.warmup_steps > 0 else 0
    interleaved_blocks(lambda: torch_run.steps(block), lambda: ampguard_run.steps(block), warmup_pairs, timer)
    timed = interleaved_blocks(lambda: torch_run.steps(block), lambda: ampguard_run.steps(block), pairs, timer)
    torch_ms = statistics.median(a for a, _ in timed) / block * 1e3
    ampguard_ms = statistics.median(b for _, b in timed) / block * 1e3
    return {
        "optimizer": _optimizer_name(fused),
        "torch_ms_per_step": torch_ms,
        "ampguard_ms_per_step": ampguard_ms,
        **_ratio_summary(timed),
        "overhead_us_per_step": statistics.median((b - a) / block for a, b in timed) * 1e6,
        "blocks": pairs,
        "block_steps": block,
        "same_parameters": _same_parameters(torch_run.model, ampguard_run.model),
    }


def _optimizer_name(fused: bool) -> str:
    return "AdamW(fused=True)" if fused else "AdamW"


def _same_parameters(first: torch.nn.Module, second: torch.nn.Module) -> bool:
    """Whether both runs ended with bit-identical weights (same work done: same steps skipped, same clip)."""
    return all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


# -- counting (untimed) -----------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it (``ops.total``, ``ops.by_op``)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.by_op[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class DeviceSyncCounter(HostReadCounter):
    """:class:`~ampguard.syncs.HostReadCounter`, less the reads of tensors that live on the host in any run.

    A non-fused, non-capturable torch optimizer keeps each parameter's step
    count in a CPU tensor and reads it (``.item()``) every step, on a GPU run
    too, where that is no synchronisation. Those reads are the same for both
    variants; they are tallied in ``host_resident_reads`` instead of ``total``
    so that the counts are the synchronisations a GPU run would make.
    """

    def __init__(self, host_resident: Callable[[], set[int]]) -> None:
        super().__init__()
        self._host_resident = host_resident
        self.host_resident_reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func._schema.name == "aten::_local_scalar_dense" and args and id(args[0]) in self._host_resident():
            self.host_resident_reads += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _optimizer_step_counters(optimizer: torch.optim.Optimizer) -> set[int]:
    return {
        id(state["step"])
        for state in optimizer.state.values()
        if isinstance(state.get("step"), torch.Tensor) and state["step"].device.type == "cpu"
        and not getattr(optimizer, "_step_supports_amp_scaling", False)
    }


def count_steps(run: Run, steps: int) -> tuple[int, int, Counter[str]]:
    """(device synchronisations, host-resident reads, ops by name) of ``steps`` steps of ``run``."""
    counters = _optimizer_step_counters(run.optimizer)
    with DeviceSyncCounter(lambda: counters) as reads, OpCounter() as ops:
        run.steps(steps)
    return reads.total, reads.host_resident_reads, ops.by_op


def count_syncs(options: Options, fused: bool) -> dict[str, Any]:
    """Host-device synchronisations and dispatched ops per step of each variant (deterministic)."""
    torch_run, ampguard_run = make_runs(options, fused)
    torch_run.steps(2)  # lazy state (scale tensors, optimizer state) out of the way
    ampguard_run.steps(2)
    torch_reads, torch_host, torch_ops = count_steps(torch_run, COUNTED_STEPS)
    ampguard_reads, ampguard_host, ampguard_ops = count_steps(ampguard_run, COUNTED_STEPS)
    with HostReadCounter() as report_reads:
        ampguard_run.scaler.stats  # what a stats line (every AMPGUARD_STATS_EVERY steps) reads
    extra_ops = ampguard_ops.copy()
    extra_ops.subtract(torch_ops)
    return {
        "optimizer": _optimizer_name(fused),
        "torch_per_step": torch_reads / COUNTED_STEPS,
        "ampguard_per_step": ampguard_reads / COUNTED_STEPS,
        "extra_per_step": (ampguard_reads - torch_reads) / COUNTED_STEPS,
        "ampguard_per_stats_report": report_reads.total,
        "optimizer_host_reads_per_step": [torch_host / COUNTED_STEPS, ampguard_host / COUNTED_STEPS],
        "torch_ops_per_step": sum(torch_ops.values()) / COUNTED_STEPS,
        "ampguard_ops_per_step": sum(ampguard_ops.values()) / COUNTED_STEPS,
        "extra_ops_per_step": {name: n / COUNTED_STEPS for name, n in sorted(extra_ops.items()) if n},
    }


# -- clip_grad_norm_ when nothing is scaled ----------------------------------------------


def time_idle_clip(options: Options) -> dict[str, Any]:
    """torch's clip_grad_norm_ against the one training scripts now call, no loss scaled, finite grads."""
    generator = torch.Generator().manual_seed(SEED)
    parameters = []
    for _ in range(CLIP_TENSORS):
        parameter = torch.nn.Parameter(torch.randn(CLIP_TENSOR_SHAPE, generator=generator).to(options.device))
        parameter.grad = torch.randn(CLIP_TENSOR_SHAPE, generator=generator).to(options.device)
        parameters.append(parameter)
    original = torch_implementations().clip_grad_norm_
    current = _current_clip_grad_norm_
    # A max_norm no gradient reaches: every call sees the same gradients (the coefficient is 1).
    max_norm = 1e12

    def calls(clip: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def work() -> None:
            for _ in range(options.clip_calls):
                clip(parameters, max_norm)

        return work

    timer = _Timer(options.device)
    interleaved_blocks(calls(original), calls(current), max(1, options.clip_blocks // 5), timer)
    timed = interleaved_blocks(calls(original), calls(current), options.clip_blocks, timer)
    summary = _ratio_summary(timed)
    syncs = []
    for clip in (original, current):
        with HostReadCounter() as reads:
            clip(parameters, max_norm)
        syncs.append(reads.total)
    return {
        "tensors": CLIP_TENSORS,
        "tensor_shape": list(CLIP_TENSOR_SHAPE),
        "wrapped": clip_is_wrapped(),
        "torch_us_per_call": statistics.median(a for a, _ in timed) / options.clip_calls * 1e6,
        "ampguard_us_per_call": statistics.median(b for _, b in timed) / options.clip_calls * 1e6,
        "overhead": summary["ratio"] - 1.0,
        "overhead_min": summary["ratio_min"] - 1.0,
        "overhead_max": summary["ratio_max"] - 1.0,
        "overhead_stderr": summary["ratio_stderr"],
        "torch_syncs_per_call": syncs[0],
        "ampguard_syncs_per_call": syncs[1],
        "blocks": options.clip_blocks,
    }


# -- import time -------------------------------------------------------------------------

_IMPORT_PROBE = """
import json, time
started = time.perf_counter()
import torch
after_torch = time.perf_counter()
import ampguard
done = time.perf_counter()
print(json.dumps([after_torch - started, done - after_torch]))
"""


def _import_probe(environment: dict[str, str], terminal: bool) -> tuple[float, float]:
    """One fresh interpreter: seconds for ``import torch`` and then for ``import ampguard``.

    ``terminal``: its stderr is a pseudo-terminal, as for a person running a
    script (ampguard's log handler is then rich's).
    """
    command = [sys.executable, "-c", _IMPORT_PROBE]
    if terminal:
        import pty

        leader, follower = pty.openpty()
        try:
            completed = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=follower, check=True, text=True)
        finally:
            os.close(follower)
            os.close(leader)
    else:
        completed = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, check=True, text=True)
    torch_seconds, ampguard_seconds = json.loads(completed.stdout.strip().splitlines()[-1])
    return torch_seconds, ampguard_seconds


def time_import(runs: int) -> dict[str, Any]:
    """Median over ``runs`` fresh interpreters of what ``import ampguard`` adds to ``import torch``.

    Bytecode caching is allowed (as users have it, even when this process runs
    with PYTHONDONTWRITEBYTECODE): one discarded run first writes the ``.pyc``.
    """
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    terminal = hasattr(os, "openpty") and sys.platform != "win32"
    _import_probe(environment, terminal=False)
    plain = [_import_probe(environment, terminal=False) for _ in range(runs)]
    on_terminal = [_import_probe(environment, terminal=True) for _ in range(runs)] if terminal else []
    return {
        "runs": runs,
        "bytecode_cache": True,
        "torch_ms": statistics.median(t for t, _ in plain) * 1e3,
        "ampguard_ms": statistics.median(a for _, a in plain) * 1e3,
        "ampguard_ms_min": min(a for _, a in plain) * 1e3,
        "ampguard_ms_max": max(a for _, a in plain) * 1e3,
        "ampguard_terminal_ms": statistics.median(a for _, a in on_terminal) * 1e3 if on_terminal else None,
    }


# -- everything --------------------------------------------------------------------------


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target next to its measured value (the worst optimizer kind for per-step values)."""
    rows: list[dict[str, Any]] = []
    timings = [t for t in result["step_time"].values() if t]
    if timings:
        ratio = max(t["ratio"] for t in timings)
        rows.append({"name": "step_time_ratio", "target": f"<= {TARGETS['step_time_ratio']}", "measured": ratio,
                     "ok": ratio <= TARGETS["step_time_ratio"]})
    counted = [s for s in result["syncs"].values() if "extra_per_step" in s]
    if counted:
        extra = max(s["extra_per_step"] for s in counted)
        rows.append({"name": "extra_syncs_per_step", "target": f"== {TARGETS['extra_syncs_per_step']}", "measured": extra,
                     "ok": extra <= TARGETS["extra_syncs_per_step"]})
    if result["import_time"]:
        measured = result["import_time"]["ampguard_ms"]
        rows.append({"name": "import_overhead_ms", "target": f"<= {TARGETS['import_overhead_ms']:g}", "measured": measured,
                     "ok": measured <= TARGETS["import_overhead_ms"]})
    if result["clip_idle"]:
        overhead = result["clip_idle"]["overhead"]
        rows.append({"name": "clip_idle_overhead", "target": f"<= {TARGETS['clip_idle_overhead']:g}", "measured": overhead,
                     "ok": overhead <= TARGETS["clip_idle_overhead"]})
    return rows


def run(options: Options) -> dict[str, Any]:
    """Every measurement of ``ampguard bench``, as one JSON-ready dict (see docs/performance.md)."""
    say = options.progress or (lambda message: None)
    load_before = _load()
    fused_reason = fused_unavailable_reason(options.device)
    kinds = [False] + ([True] if fused_reason is None else [])
    import ampguard.log as log

    previous_level = log.logger.level
    log.logger.setLevel(max(previous_level, 30))  # stats lines would interleave with the output
    try:
        syncs: dict[str, Any] = {}
        for fused in kinds:
            say(f"counting synchronisations ({_optimizer_name(fused)})")
            syncs["fused" if fused else "plain"] = count_syncs(options, fused)
        if fused_reason is not None:
            syncs["fused"] = {"optimizer": _optimizer_name(True), "unavailable": fused_reason}
        step_time: dict[str, Any] = {}
        for fused in [False] + ([True] if options.fused else []):
            key = "fused" if fused else "plain"
            if fused and fused_reason is not None:
                step_time[key] = None
                continue
            say(f"timing {options.steps} steps per variant ({_optimizer_name(fused)})")
            step_time[key] = time_steps(options, fused)
        say("timing clip_grad_norm_ with nothing scaled")
        clip_idle = time_idle_clip(options)
    finally:
        log.logger.setLevel(previous_level)
    import_time = None
    if options.import_runs > 0:
        say(f"timing `import ampguard` in {options.import_runs} fresh interpreters")
        import_time = time_import(options.import_runs)
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "environment": {
            "ampguard": ampguard.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": options.device,
            "device_name": _device_name(options.device),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": _load(),
        },
        "settings": {
            "steps": options.steps,
            "block_steps": options.block_steps,
            "warmup_steps": options.warmup_steps,
            "autocast_dtype": options.dtype,
            "fused": options.fused,
            "model": dataclasses.asdict(options.model or ModelSpec.for_device(options.device)),
            "init_scale": INIT_SCALE,
            "growth_interval": GROWTH_INTERVAL,
        },
        "patches": {entry.name: entry.state for entry in ampguard.status()},
        "clip_wrapped": clip_is_wrapped(),
        "step_time": step_time,
        "syncs": syncs,
        "clip_idle": clip_idle,
        "import_time": import_time,
        "targets": dict(TARGETS),
    }
    result["checks"] = checks(result)
    return result


def iter_table_rows(result: dict[str, Any]) -> Iterator[list[str]]:
    """``[measure, torch, ampguard, result, target, ok]`` rows for the human-readable table."""
    verdict = {c["name"]: "yes" if c["ok"] else "NO" for c in result["checks"]}
    for key, timing in result["step_time"].items():
        if timing is None:
            yield [f"step time, {_optimizer_name(key == 'fused')}", "-", "-", "unavailable", "", ""]
            continue
        yield [
            f"step time, {timing['optimizer']}",
            f"{timing['torch_ms_per_step']:.2f} ms",
            f"{timing['ampguard_ms_per_step']:.2f} ms",
            f"ratio {timing['ratio']:.4f} +-{timing['ratio_stderr']:.4f} ({timing['ratio_min']:.3f}-{timing['ratio_max']:.3f}), "
            f"{timing['overhead_us_per_step']:+.0f} us/step",
            f"<= {TARGETS['step_time_ratio']}",
            "yes" if timing["ratio"] <= TARGETS["step_time_ratio"] else "NO",
        ]
    for key, counted in result["syncs"].items():
        if "unavailable" in counted:
            yield [f"syncs/step, {counted['optimizer']}", "-", "-", "unavailable: " + counted["unavailable"], "", ""]
            continue
        yield [
            f"syncs/step, {counted['optimizer']}",
            f"{counted['torch_per_step']:g}",
            f"{counted['ampguard_per_step']:g}",
            f"{counted['extra_per_step']:+g}/step, {counted['ampguard_per_stats_report']} per stats report; "
            f"ops/step {counted['torch_ops_per_step']:g} vs {counted['ampguard_ops_per_step']:g}",
            "+0",
            "yes" if counted["extra_per_step"] <= 0 else "NO",
        ]
    imported = result["import_time"]
    if imported:
        terminal = imported["ampguard_terminal_ms"]
        yield [
            "import ampguard after torch",
            f"{imported['torch_ms']:.0f} ms (torch)",
            f"{imported['ampguard_ms']:.1f} ms",
            f"median of {imported['runs']}" + (f"; on a terminal {terminal:.1f} ms" if terminal is not None else ""),
            f"<= {TARGETS['import_overhead_ms']:g} ms",
            verdict.get("import_overhead_ms", ""),
        ]
    clip = result["clip_idle"]
    yield [
        f"clip_grad_norm_, {clip['tensors']} tensors, nothing scaled",
        f"{clip['torch_us_per_call']:.0f} us",
        f"{clip['ampguard_us_per_call']:.0f} us",
        f"{clip['overhead']:+.2%} ({clip['overhead_min']:+.1%}..{clip['overhead_max']:+.1%}); "
        f"syncs {clip['torch_syncs_per_call']} vs {clip['ampguard_syncs_per_call']}"
        + ("" if clip["wrapped"] else "; clip patch not applied"),
        f"<= {TARGETS['clip_idle_overhead']:.0%}",
        verdict.get("clip_idle_overhead", ""),
    ]
