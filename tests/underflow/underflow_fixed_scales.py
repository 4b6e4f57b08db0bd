"""docs/underflow.md's table of the 2-block net's underflow at fixed loss scales (issue 24's net, issue 32's measure).

For each loss factor and scale: 60 steps of tests/support/underflow_support.py's net under a SafeGradScaler whose scale
does not grow (growth interval 10**9; an overflow would still back it off), ``AMPGUARD_UNDERFLOW=report`` sampling
every 10 steps (6 samples), and the mean over the samples of the shares subnormal or lost, subnormal and lost, of
the largest gradient, and the module losing the largest share most often, with its mean share::

    python tests/underflow/underflow_fixed_scales.py
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
from pathlib import Path

os.environ.update(AMPGUARD_UNDERFLOW="report", AMPGUARD_UNDERFLOW_EVERY="10", AMPGUARD_QUIET="1")
if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")]

import torch
import underflow_support

import ampguard

CASES = [(1.0, 10), (1.0, 13), (1.0, 16), (1e-8, 10), (1e-8, 16), (1e-8, 20), (1e-8, 24)]


def measure(factor: float, power: int) -> str:
    scaler = ampguard.SafeGradScaler("cpu", init_scale=2.0**power, growth_interval=10**9)
    samples: list[tuple[float, float, float, float, tuple[tuple[str, float], ...]]] = []

    def between(step: int, current: object) -> object:
        stats = scaler.stats
        if stats.underflow_step and (not samples or stats.underflow_step != seen[-1]):
            seen.append(stats.underflow_step)
            samples.append(
                (
                    stats.underflow_share,
                    stats.underflow_subnormal,
                    stats.underflow_lost,
                    stats.underflow_grad_peak,
                    stats.underflow_modules,
                )
            )
        return current

    seen: list[int] = []
    underflow_support.train(scaler, loss_factor=factor, steps=61, between=between)
    share, subnormal, lost, peak = (statistics.mean(sample[i] for sample in samples) for i in range(4))
    tops = collections.Counter(sample[4][0][0] for sample in samples if sample[4])
    top = ""
    if tops:
        name = tops.most_common(1)[0][0]
        top_share = statistics.mean(dict(sample[4]).get(name, 0.0) for sample in samples)
        top = f"{name} ({top_share:.2%})"
    return (
        f"| {factor:g} | 2**{power} | {share:.3%} | {subnormal:.3%} | {lost:.3%} | {peak:.3g} | {top} |"
        f" <!-- {len(samples)} samples, final scale {scaler.get_scale():g} -->"
    )


def main() -> int:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread")
    print("| loss factor | scale | subnormal or lost | subnormal | lost | largest gradient | module losing most |")
    print("|---|---|---|---|---|---|---|")
    for factor, power in CASES:
        print(measure(factor, power), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
