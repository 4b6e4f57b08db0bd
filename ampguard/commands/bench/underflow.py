"""The cost of one underflow sample (``AMPGUARD_UNDERFLOW``): a sampled step against a healthy one.

A sampled step runs the sampler's hooks in its forward and backward passes
(:mod:`ampguard.underflow.measure`) and reads its counts once; every other step
runs none of it, which the step-time ratio measures. Here blocks of one
healthy step and one sampled step of the ampguard run alternate, as the step
times' blocks do (:func:`~ampguard.commands.bench.timing.interleaved_blocks`).
"""

from __future__ import annotations

import statistics
from typing import Any

from ampguard.commands.bench.runs import Options, make_runs
from ampguard.commands.bench.timing import Timer, interleaved_blocks, ratio_summary
from ampguard.registry import active_config
from ampguard.syncs import HostReadCounter
from ampguard.underflow.counts import read
from ampguard.underflow.measure import Sampler

SAMPLES = 20


def time_sampled_step(options: Options, samples: int = SAMPLES) -> dict[str, Any]:
    """Median healthy and sampled step times of the ampguard run, the paired ratio, the extra reads."""
    _, run = make_runs(options, fused=False)
    sampler = Sampler()
    measured: list[Any] = []

    def sampled() -> None:
        sampler.arm()
        run.step()
        sampler.count_parameters(run.optimizer)  # (its cost; the scaler's unscale_() has it count them before)
        measured.append(read(sampler.finish(), run.index, 1.0)[0])

    timer = Timer(options.device)
    interleaved_blocks(run.step, sampled, 2, timer)  # warm-up
    timed = interleaved_blocks(run.step, sampled, samples, timer)
    with HostReadCounter() as healthy_reads:
        run.step()
    with HostReadCounter() as sampled_reads:
        sampled()
    healthy_ms = statistics.median(a for a, _ in timed) * 1e3
    sampled_ms = statistics.median(b for _, b in timed) * 1e3
    every = active_config().underflow_every
    return {
        "healthy_ms": healthy_ms,
        "sampled_ms": sampled_ms,
        **ratio_summary(timed),
        "extra_reads": sampled_reads.total - healthy_reads.total,
        "float16_gradient_values": measured[-1].total.values,
        "every": every,
        "overhead_at_every": (sampled_ms - healthy_ms) / (every * healthy_ms),
        "blocks": samples,
    }
