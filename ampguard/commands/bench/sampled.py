"""The cost of the steps ampguard samples: an iteration the headroom watch observes, against an ordinary one.

The step-time ratio already includes them amortised (one watched iteration
every ``AMPGUARD_WATCH_EVERY`` steps, as in training); this measures the
sampled step on its own: pairs of an ordinary ampguard step and a watched one,
run back to back in alternating order, medians of each and of their ratio.
"""

from __future__ import annotations

import statistics
from typing import Any

from ampguard.commands.bench.runs import Options, make_runs
from ampguard.commands.bench.timing import Timer, interleaved_blocks
from ampguard.fp32_islands.patch import applied_healing
from ampguard.registry import active_config

PAIRS = 15


def time_watched_step(options: Options) -> dict[str, Any]:
    """``{"normal_ms", "watched_ms", "ratio", "every", "amortised"}``, or ``{"unavailable": reason}``."""
    every = active_config().watch_every
    healing = applied_healing()
    if healing is None or not every:
        return {"unavailable": "the headroom watch is off (AMPGUARD_WATCH_EVERY=0 or the fp32_islands patch)"}
    _, run = make_runs(options, fused=False)
    run.steps(max(options.warmup_steps, 2))
    timer = Timer(options.device)

    def watched() -> None:
        if not healing.watch_next_iteration():
            raise RuntimeError("the headroom watch could not be armed")
        run.step()

    pairs = interleaved_blocks(run.step, watched, PAIRS, timer)
    normal = statistics.median(a for a, _ in pairs)
    sampled = statistics.median(b for _, b in pairs)
    ratio = statistics.median(b / a for a, b in pairs)
    return {
        "normal_ms": normal * 1e3,
        "watched_ms": sampled * 1e3,
        "ratio": ratio,
        "every": every,
        "amortised": (ratio - 1.0) / every,
        "pairs": PAIRS,
    }
