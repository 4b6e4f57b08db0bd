"""``ampguard bench --half-params``: a model stored in half precision, trained with fp32 master weights.

The bench's transformer (:mod:`ampguard.commands.bench.runs`) is trained twice under
ampguard from the same weights on the same batches, with the same recipe
(autocast, scale, backward, ``unscale_``, clip, AdamW step, update):

* **float32**: the parameters in float32, the operations in the autocast dtype
  (the usual AMP set-up);
* **half + masters**: the same model converted to the autocast dtype
  (``model.half()``), its optimizer stepping float32 master copies
  (:mod:`ampguard.master_weights`; for bfloat16 parameters the masters are switched on
  for the length of the bench, as ``AMPGUARD_MASTER_WEIGHTS=all`` would).

Reported: the paired per-step time ratio (interleaved blocks, as for the main
bench), host-device synchronisations per step of each, and the memory of the
parameters, the masters and the optimizer state.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Iterator
from typing import Any

import torch

import ampguard.master_weights as master_weights
from ampguard.commands.bench.counting import count_steps
from ampguard.commands.bench.runs import COUNTED_STEPS, GROWTH_INTERVAL, INIT_SCALE, LEARNING_RATE, Options, Run
from ampguard.commands.bench.runs import make_runs as make_bench_runs
from ampguard.commands.bench.timing import Timer, interleaved_blocks, ratio_summary
from ampguard.scaler import SafeGradScaler


@contextlib.contextmanager
def _masters_for(dtype: torch.dtype) -> Iterator[None]:
    masters = master_weights.applied_masters()
    if masters is None:
        raise RuntimeError("the master_weights patch is not applied (AMPGUARD_MASTER_WEIGHTS=off or disabled)")
    previous = masters.dtypes
    masters.dtypes = tuple(dict.fromkeys((*previous, dtype)))
    try:
        yield
    finally:
        masters.dtypes = previous


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return _bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def make_runs(options: Options) -> tuple[Run, Run]:
    """The float32-parameter run and the half-parameter run: same weights (rounded), same batches."""
    _, full = make_bench_runs(options, fused=False)  # the ampguard variant: SafeGradScaler, patched clip
    half = copy.copy(full)
    half.model = copy.deepcopy(full.model).to(getattr(torch, options.dtype))
    half.optimizer = torch.optim.AdamW(half.model.parameters(), lr=LEARNING_RATE)
    half.scaler = SafeGradScaler(options.device, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    with torch.no_grad():  # both start from the weights the half model can hold
        for p, q in zip(full.model.parameters(), half.model.parameters()):
            p.copy_(q)
    return full, half


def run(options: Options) -> dict[str, Any]:
    """Step time, synchronisations and memory of half parameters with masters against float32 parameters."""
    say = options.progress or (lambda message: None)
    dtype = getattr(torch, options.dtype)
    with _masters_for(dtype):
        full, half = make_runs(options)
        full.steps(2)
        half.steps(2)  # masters made, optimizer state allocated
        say("counting synchronisations (float32 parameters, then half parameters with masters)")
        full_syncs, _, _ = count_steps(full, COUNTED_STEPS)
        half_syncs, _, _ = count_steps(half, COUNTED_STEPS)
        say(f"timing {options.steps} steps per variant")
        timer = Timer(options.device)
        block = max(1, min(options.block_steps, options.steps))
        pairs = max(1, options.steps // block)
        if options.warmup_steps > 0:
            interleaved_blocks(
                lambda: full.steps(block), lambda: half.steps(block), max(1, options.warmup_steps // block), timer
            )
        timed = interleaved_blocks(lambda: full.steps(block), lambda: half.steps(block), pairs, timer)
        masters = [m for _, m in master_weights.masters_of(half.optimizer)]
    return {
        "autocast_dtype": options.dtype,
        "float32_ms_per_step": statistics.median(a for a, _ in timed) / block * 1e3,
        "half_ms_per_step": statistics.median(b for _, b in timed) / block * 1e3,
        **ratio_summary(timed),
        "blocks": pairs,
        "block_steps": block,
        "syncs_per_step": [full_syncs / COUNTED_STEPS, half_syncs / COUNTED_STEPS],
        "parameter_bytes": [_bytes(full.model.parameters()), _bytes(half.model.parameters())],
        "master_bytes": _bytes(masters),
        "masters": len(masters),
        "optimizer_state_bytes": [_state_bytes(full.optimizer), _state_bytes(half.optimizer)],
        "finite": all(bool(torch.isfinite(p).all()) for p in half.model.parameters()),
    }


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """``[measure, float32 parameters, half parameters + masters, note]`` rows."""
    mib = 2.0**20
    params32, params16 = result["parameter_bytes"]
    state32, state16 = result["optimizer_state_bytes"]
    return [
        [
            "step time",
            f"{result['float32_ms_per_step']:.2f} ms",
            f"{result['half_ms_per_step']:.2f} ms",
            f"ratio {result['ratio']:.3f} +-{result['ratio_stderr']:.3f} ({result['ratio_min']:.3f}-{result['ratio_max']:.3f})",
        ],
        ["syncs/step", f"{result['syncs_per_step'][0]:g}", f"{result['syncs_per_step'][1]:g}", ""],
        ["parameters", f"{params32 / mib:.2f} MiB", f"{params16 / mib:.2f} MiB", result["autocast_dtype"]],
        ["fp32 masters", "-", f"{result['master_bytes'] / mib:.2f} MiB", f"{result['masters']} tensors"],
        ["optimizer state", f"{state32 / mib:.2f} MiB", f"{state16 / mib:.2f} MiB", "float32 in both"],
    ]
