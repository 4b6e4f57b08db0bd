"""Timing the two runs: interleaved blocks, paired ratios (the step time and the idle clip).

Timed blocks of a few steps alternate between the two variants in the order
torch, ampguard, ampguard, torch, ... so that drift of the machine (other
processes, clock changes) falls on both alike; the ratio is the median of the
ratios of paired blocks.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from ampguard.commands.bench.runs import (
    CLIP_TENSOR_SHAPE,
    CLIP_TENSORS,
    SEED,
    Options,
    clip_is_wrapped,
    current_clip_grad_norm_,
    make_runs,
    optimizer_name,
    same_parameters,
    torch_implementations,
)
from ampguard.syncs import HostReadCounter


class Timer:
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
            milliseconds: float = start.elapsed_time(end)
            return milliseconds / 1e3
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


def interleaved_blocks(
    first: Callable[[], None], second: Callable[[], None], pairs: int, timer: Timer
) -> list[tuple[float, float]]:
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


def ratio_summary(timed: list[tuple[float, float]]) -> dict[str, float]:
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
    timer = Timer(options.device)
    block = max(1, min(options.block_steps, options.steps))
    pairs = max(1, options.steps // block)
    warmup_pairs = max(1, -(-options.warmup_steps // block)) if options.warmup_steps > 0 else 0
    interleaved_blocks(lambda: torch_run.steps(block), lambda: ampguard_run.steps(block), warmup_pairs, timer)
    timed = interleaved_blocks(lambda: torch_run.steps(block), lambda: ampguard_run.steps(block), pairs, timer)
    torch_ms = statistics.median(a for a, _ in timed) / block * 1e3
    ampguard_ms = statistics.median(b for _, b in timed) / block * 1e3
    return {
        "optimizer": optimizer_name(fused),
        "torch_ms_per_step": torch_ms,
        "ampguard_ms_per_step": ampguard_ms,
        **ratio_summary(timed),
        "overhead_us_per_step": statistics.median((b - a) / block for a, b in timed) * 1e6,
        "blocks": pairs,
        "block_steps": block,
        "same_parameters": same_parameters(torch_run.model, ampguard_run.model),
        # float16 gradients that underflow grow ampguard's scale (AMPGUARD_UNDERFLOW=adapt): then the weights differ
        "underflow_growths": getattr(getattr(ampguard_run.scaler, "stats", None), "underflow_growths", 0),
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
    current = current_clip_grad_norm_
    # A max_norm no gradient reaches: every call sees the same gradients (the coefficient is 1).
    max_norm = 1e12

    def calls(clip: Callable[..., torch.Tensor]) -> Callable[[], None]:
        def work() -> None:
            for _ in range(options.clip_calls):
                clip(parameters, max_norm)

        return work

    timer = Timer(options.device)
    interleaved_blocks(calls(original), calls(current), max(1, options.clip_blocks // 5), timer)
    timed = interleaved_blocks(calls(original), calls(current), options.clip_blocks, timer)
    summary = ratio_summary(timed)
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
