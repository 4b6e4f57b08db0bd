"""One line at interpreter exit, on rank 0, when anything was skipped: the tally a short run never showed.

Skipped-step reports are rate limited (the first, then one per stats interval;
the no-scaler clip guard at most once a minute) and a stats line comes every
``AMPGUARD_STATS_EVERY`` steps, so a run of a few steps that skipped most of
them may end without a tally. At exit, ampguard logs one INFO record with the
totals of every SafeGradScaler that stepped and of the clip guard, when any of
them skipped something; nothing when nothing was skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from ampguard.log import event_logger, is_rank_zero, label
from ampguard.stats.counters import process_counters

logger = event_logger("summary")

_scalers: weakref.WeakSet[Any] = weakref.WeakSet()
# Lines for scalers collected before exit (a training function that returned): see remember().
_gone: list[str] = []
_registered = False


def arm() -> None:
    """Log the summary at exit (registered once, by the first scaler or the first step the clip guard skips)."""
    global _registered
    if not _registered:
        _registered = True
        atexit.register(log_summary)


def track(scaler: Any) -> None:
    """Count this scaler in the exit summary (a weak reference: a scaler gone before exit is not in it)."""
    _scalers.add(scaler)
    arm()


def remember(counted: Any, steps: int, skipped: int, nonfinite: int, no_grad: int, scale: float | None) -> None:
    """An object counted here about to go (``SafeGradScaler.__del__``, a DeepSpeed engine's counts): keep its line."""
    if counted in _scalers:
        line = _line(counted, steps, skipped, nonfinite, no_grad, scale)
        if line is not None:
            _gone.append(line)


def _line(scaler: Any, steps: int, skipped: int, nonfinite: int, no_grad: int, scale: float | None) -> str | None:
    if not steps or not (skipped or nonfinite or no_grad):
        return None
    final = f", final scale {scale:g}" if scale is not None else ""
    return (
        f"{label(scaler)}: {skipped} of {steps} steps skipped "
        f"({100.0 * skipped / steps:.1f}%), {nonfinite} with a non-finite loss, {no_grad} without gradients{final}"
    )


def summary_line() -> str | None:
    """The summary, or None when nothing was skipped."""
    parts = list(_gone)
    for scaler in list(_scalers):
        try:
            stats = scaler.stats  # reads the device once for fused optimizers; only here, at exit
        except Exception:  # a device already gone at exit: the host counters are all there is
            continue
        line = _line(scaler, stats.steps, stats.skipped, stats.nonfinite_loss, stats.no_grad_steps, stats.scale)
        if line is not None:
            parts.append(line)
    if process_counters.clip_skipped:
        parts.append(
            f"clip_grad_norm_ without a GradScaler: {process_counters.clip_skipped} step(s) skipped for an inf/NaN norm"
        )
    return "run summary: " + "; ".join(parts) + "." if parts else None


def log_summary() -> None:
    if not is_rank_zero() or any(getattr(getattr(h, "stream", None), "closed", False) for h in logger.logger.handlers):
        return  # (a test runner may have closed the stream the handler was given)
    try:
        line = summary_line()
        if line is not None:
            logger.info(line)
    except Exception:  # at exit, never a traceback of ampguard's
        pass


@contextlib.contextmanager
def left_out() -> Iterator[None]:
    """The scalers made inside the block are left out of the exit summary (``ampguard selftest``'s own loops)."""
    before, gone = set(_scalers), len(_gone)
    try:
        yield
    finally:
        for scaler in set(_scalers) - before:
            _scalers.discard(scaler)
        del _gone[gone:]
