"""What ampguard counts, and the one-line stats record it logs.

:class:`ScalerStats` is the snapshot ``SafeGradScaler.stats`` returns.
:data:`process_counters` holds what is counted outside any scaler (steps the
clip guard skipped in bf16 / fp32 training); it appears in every stats line.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from ampguard.log import is_rank_zero, logger


@dataclass(frozen=True)
class ScalerStats:
    """A snapshot of one scaler's counters.

    Attributes:
        steps: optimizer steps requested through ``step()``.
        skipped: steps skipped because the gradients held inf/NaN.
        no_grad_steps: steps of an optimizer none of whose parameters had a gradient.
        nonfinite_loss: iterations whose loss, as passed to ``scale()``, was itself inf/NaN
            (a forward-pass problem: no loss scale can fix it).
        scale: the current loss scale.
        min_scale_seen, max_scale_seen: the extremes the scale took since the scaler was made.
        consecutive_skipped: iterations skipped in a row, up to now.
        fp32_islands: qualified names of the modules ampguard runs in float32 (docs/islands.md).
        buffers_restored: skipped forward overflows after which buffers were restored (docs/islands.md).
        headroom: the modules the last headroom watch saw closest to float16's 65,504, with their peaks, the
            tightest first (docs/islands.md).
        underflow_share: at the last sampled step, the share of the float16 gradient values of the backward
            pass that were subnormal or lost (``underflow_subnormal + underflow_lost``; docs/underflow.md).
        underflow_subnormal: the share subnormal (fewer than 11 significant bits).
        underflow_lost: the share lost: exact zeros where float32 would hold the value nonzero (estimated
            from float16's smallest subnormals; all-zero gradients computed from flushed ones).
        underflow_lost_norm: the share of the gradients' norm lost (the values lost against all of them, each
            taken as a value below float16's rounding to zero): what ``AMPGUARD_UNDERFLOW=adapt`` acts on.
        underflow_grad_peak: the largest float16 gradient magnitude of the sampled step (scaled).
        underflow_values: the float16 gradient values the last sample counted (0 with no float16 gradient:
            bfloat16 or float32 training).
        underflow_step: the optimizer step sampled last (0: none yet).
        underflow_scale: the loss scale that step ran at (0.0: none yet).
        underflow_samples: steps sampled so far.
        underflow_growths: times the measured underflow grew the scale (``AMPGUARD_UNDERFLOW=adapt``).
        underflow_modules: the modules that lost the largest share of their gradient values at the last
            sample, with that share (at most 3).
    """

    steps: int
    skipped: int
    no_grad_steps: int
    nonfinite_loss: int
    scale: float
    min_scale_seen: float
    max_scale_seen: float
    consecutive_skipped: int
    fp32_islands: tuple[str, ...] = ()
    buffers_restored: int = 0
    headroom: tuple[tuple[str, float], ...] = ()
    underflow_share: float = 0.0
    underflow_subnormal: float = 0.0
    underflow_lost: float = 0.0
    underflow_lost_norm: float = 0.0
    underflow_grad_peak: float = 0.0
    underflow_values: int = 0
    underflow_step: int = 0
    underflow_scale: float = 0.0
    underflow_samples: int = 0
    underflow_growths: int = 0
    underflow_modules: tuple[tuple[str, float], ...] = ()

    @property
    def skipped_percent(self) -> float:
        return 100.0 * self.skipped / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Plain data, as JSON gives it back (``fp32_islands`` a list; ``headroom`` a list of [name, peak] lists)."""
        return {key: _plain(value) for key, value in asdict(self).items()}


def _plain(value: Any) -> Any:
    return [_plain(item) for item in value] if isinstance(value, tuple) else value


@dataclass
class ProcessCounters:
    """Counters that belong to no scaler."""

    clip_skipped: int = 0
    scheduler_held: int = 0  # lr_scheduler.step() calls held on skipped steps (ampguard.scheduler_hold.hold)


process_counters = ProcessCounters()


def _g(value: float) -> str:
    return f"{value:g}"


def stats_line(stats: ScalerStats, skipped_in_interval: int) -> str:
    """One greppable line, each figure under a label saying what it counts.

    ``stats step=... scale=... | this interval: skipped=... | whole run: skipped_total=... | now: ...``:
    "this interval" is the steps since the previous stats line, "whole run" every step since the scaler was
    made (or restored from a checkpoint), "now" the state at this step; headroom and underflow figures come
    from the last step the headroom watch observed and the last step sampled for underflow.
    """
    run = (
        f"skipped_total={stats.skipped} ({stats.skipped_percent:.2f}% of {stats.steps} steps) "
        f"no_grad={stats.no_grad_steps} nonfinite_loss={stats.nonfinite_loss} "
        f"scale_range={_g(stats.min_scale_seen)}..{_g(stats.max_scale_seen)} "
        f"clip_skipped={process_counters.clip_skipped}"
        + (f" buffers_restored={stats.buffers_restored}" if stats.buffers_restored else "")
        + (f" underflow_growths={stats.underflow_growths}" if stats.underflow_samples else "")
    )
    now = f"consecutive_skipped={stats.consecutive_skipped}" + (
        f" fp32_islands={','.join(stats.fp32_islands)}" if stats.fp32_islands else ""
    )
    return (
        f"stats step={stats.steps} scale={_g(stats.scale)} | this interval: skipped={skipped_in_interval} "
        f"| whole run: {run} | now: {now}"
        + (
            f" | last headroom watch: peak_per_module={','.join(f'{name}:{peak:.4g}' for name, peak in stats.headroom)}"
            if stats.headroom
            else ""
        )
        + (_underflow_text(stats) if stats.underflow_samples else "")
    )


def _underflow_text(stats: ScalerStats) -> str:
    worst = ",".join(f"{name}:{share:.2%}" for name, share in stats.underflow_modules)
    return (
        f" | last underflow sample: underflow={stats.underflow_share:.2%} (subnormal={stats.underflow_subnormal:.2%} "
        f"lost={stats.underflow_lost:.2%} lost_norm={stats.underflow_lost_norm:.2%} at_step={stats.underflow_step} "
        f"at_scale={_g(stats.underflow_scale)})" + (f" underflow_modules={worst}" if worst else "")
    )


def log_stats(stats: ScalerStats, skipped_in_interval: int) -> None:
    if is_rank_zero() and logger.isEnabledFor(logging.INFO):
        # The numbers themselves ride along for AMPGUARD_STATS_FILE (ampguard.stats.file); the line is for people.
        logger.info(
            stats_line(stats, skipped_in_interval),
            extra={"ampguard_stats": stats, "ampguard_skipped_in_interval": skipped_in_interval},
        )
