"""Patch ``anomaly`` (opt-in, ``AMPGUARD_ENABLE=anomaly``): autograd anomaly detection that fp16 training survives.

``torch.autograd.set_detect_anomaly(True)`` does two things: it records the
forward-pass traceback of every autograd node, so that an error in backward
names the forward line that built the failing operation; and, by default, it
raises as soon as a backward function returns NaN. Under fp16 loss scaling the
second aborts training on the benign overflow steps the GradScaler is there to
skip. This patch turns anomaly detection on with ``check_nan=False`` (torch
>= 2.1): every backward error still carries its forward traceback, NaN
gradients reach the scaler, which skips the step, and ampguard's skipped-step
report (:mod:`ampguard.scaler.diagnose`) names the parameters whose gradients were
non-finite.

Anomaly detection is slow: :data:`MEASURED_SLOWDOWN` is what
:func:`measure_cost` measured (see :data:`MEASURED_ON`); the WARNING logged on
apply states it. ``revert()`` restores the mode that was in effect before.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ampguard.config import Config
from ampguard.errors import PatchUnavailable
from ampguard.log import logger
from ampguard.patch import Patch

# CPU time per training step with anomaly detection (check_nan=False) over the
# time without, as measure_cost() with its defaults measured it: 1.67-1.83 on
# torch 2.3.1, 2.13 and 2.14.1 (torch's own check_nan=True: 2.2-2.7).
MEASURED_SLOWDOWN = 1.8
MEASURED_ON = (
    "MLP 6x256, batch 64, SGD, one CPU thread; "
    'python -c "from ampguard.patches.anomaly import measure_cost; print(measure_cost())"'
)

ENABLED = (
    "autograd anomaly detection is on (AMPGUARD_ENABLE=anomaly): every backward error names the "
    "forward line that caused it, but each training step takes about {slowdown:.1f}x the time "
    "(measured on an {measured}; published figures for real models are 1.8-3x). NaN checks in "
    "backward are off (check_nan=False) so that fp16 overflow steps are skipped by the scaler instead "
    "of aborting the run; ampguard names the parameters with non-finite gradients on skipped steps. "
    "Turn it off for real runs."
)


class AnomalyPatch(Patch):
    name = "anomaly"
    summary = "autograd anomaly detection (forward tracebacks on backward errors), without aborting on fp16 overflow"
    requires_torch = ">=2.1"
    opt_in = True

    def __init__(self) -> None:
        super().__init__()
        self._previous: tuple[bool, bool] | None = None

    def apply(self, config: Config) -> None:
        check_nan_enabled = getattr(torch, "is_anomaly_check_nan_enabled", None)
        if check_nan_enabled is None:
            raise PatchUnavailable("this torch has no check_nan switch for anomaly detection")
        self._previous = (torch.is_anomaly_enabled(), check_nan_enabled())
        torch.set_anomaly_enabled(True, False)
        logger.warning(ENABLED.format(slowdown=MEASURED_SLOWDOWN, measured=MEASURED_ON))

    def revert(self) -> None:
        if self._previous is not None:
            torch.set_anomaly_enabled(*self._previous)
            self._previous = None
        super().revert()


def measure_cost(steps: int = 60, width: int = 256, depth: int = 6, batch: int = 64, rounds: int = 5) -> dict[str, Any]:
    """CPU seconds per training step without and with anomaly detection, and the ratios.

    Process CPU time on one thread, not wall time, so that other jobs on a
    shared machine do not count; rounds alternate between the modes, and each
    mode's figure is the best of its per-round medians. The anomaly mode and
    thread count are restored.
    """
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(batch, width)

    import statistics  # only for this measurement, not at every import of ampguard

    def run(count: int) -> float:
        timings = []
        for _ in range(count):
            start = time.process_time()
            optimizer.zero_grad(set_to_none=True)
            model(data).square().mean().backward()
            optimizer.step()
            timings.append(time.process_time() - start)
        return statistics.median(timings)

    modes = {"off": (False, True), "anomaly_check_nan_off": (True, False), "anomaly_check_nan_on": (True, True)}
    previous = (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())
    threads = torch.get_num_threads()
    samples: dict[str, list[float]] = {name: [] for name in modes}
    try:
        torch.set_num_threads(1)  # one thread: far less noise on a shared machine
        run(5)
        for _ in range(rounds):
            for name, mode in modes.items():
                torch.set_anomaly_enabled(*mode)
                samples[name].append(run(steps // rounds or 1))
    finally:
        torch.set_anomaly_enabled(*previous)
        torch.set_num_threads(threads)
    seconds = {name: min(values) for name, values in samples.items()}
    return {
        "seconds_per_step": seconds,
        "slowdown_check_nan_off": seconds["anomaly_check_nan_off"] / seconds["off"],
        "slowdown_check_nan_on": seconds["anomaly_check_nan_on"] / seconds["off"],
        "torch": torch.__version__,
    }
