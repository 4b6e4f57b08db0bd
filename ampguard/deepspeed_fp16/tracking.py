"""What ampguard counts for each DeepSpeed loss scale, and what it reports: stats lines, collapse, stall.

One :class:`DeepSpeedLossScale` per DeepSpeed scale holder (a ZeRO optimizer's
``DynamicLossScaler``, or the ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``
whose ``LossScaleConfig`` holds the scale), made at its first update and kept
for as long as that object lives (a weak key: nothing of ampguard is added to
DeepSpeed's objects, so their pickles in checkpoints stay DeepSpeed's own).

DeepSpeed decides overflow once per optimizer step, agreed between ranks, and
reads it on the host before it updates the scale: every count here comes from
that boolean, so counting adds no host read. The numbers reach the same stats
line, stats file and exit summary as a SafeGradScaler's
(:func:`ampguard.stats.counters.log_stats`, :mod:`ampguard.stats.summary`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import ampguard.stats.summary as summary
from ampguard.errors import ScaleCollapseError
from ampguard.log import event, logger
from ampguard.stats.counters import ScalerStats, log_stats

COLLAPSE = (
    "DeepSpeed's loss scale is at its floor {scale:g}{floor} and step {step} overflowed again. Plain DeepSpeed stops "
    "the run here ('Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.'); ampguard "
    "keeps the scale at the floor and skips the step, and AMPGUARD_ON_STALL decides what happens after "
    "AMPGUARD_MAX_CONSECUTIVE_SKIPS={limit} consecutive skips. No loss scale can help now: the loss was finite and "
    "its gradients overflow float16 even at this scale. Likely causes: the learning rate is too high; gradients are "
    'not clipped ("gradient_clipping" in the DeepSpeed config); a backward pass whose float16 values overflow (run '
    "that block in float32, or train in bf16 on a GPU with native bf16)."
)

STALL = (
    "{count} consecutive DeepSpeed optimizer steps were skipped for inf/NaN gradients (step {step}, loss scale "
    "{scale:g}); training is not progressing.{cause} "
    "{action} See docs/deepspeed.md and docs/troubleshooting.md."
)
STALL_WARN = "Set AMPGUARD_ON_STALL=raise to stop the run here."
STALL_RAISE = (
    "The run was stopped here because AMPGUARD_ON_STALL=raise (the limit is AMPGUARD_MAX_CONSECUTIVE_SKIPS={limit}); "
    "DeepSpeed's loss scale was updated first."
)
AT_FLOOR = " The loss scale is at its floor: the overflow is not one a smaller scale would avoid."


@dataclass(frozen=True)
class Policy:
    """ampguard's loss-scale policy for DeepSpeed, read from the configuration at install."""

    start: float  # the initial scale when the DeepSpeed config sets neither initial_scale_power nor loss_scale
    floor: float  # 0: none beyond DeepSpeed's own minimum
    cap: float
    max_consecutive_skips: int
    on_stall: str
    stats_every: int
    said: set[str] = field(default_factory=set, compare=False)  # the lines said once while the patch is applied


class DeepSpeedLossScale:
    """The counts of one DeepSpeed loss scale (named so in the exit summary: ``DeepSpeedLossScale#1a2b``)."""

    def __init__(self, scale: float) -> None:
        self.steps = 0
        self.skipped = 0
        self.nonfinite_loss = 0  # skipped steps whose loss was itself inf/NaN (a forward overflow)
        self.consecutive = 0
        self.scale = scale
        self.min_seen = scale
        self.max_seen = scale
        self.skipped_at_last_line = 0
        self.collapse_reported = False
        self.stall_reported = False
        self.finalizer: weakref.finalize[..., object] | None = None  # keeps the line when its holder goes

    def restore(
        self, steps: int, skipped: int, nonfinite: int, consecutive: int, low: float, high: float, scale: float
    ) -> None:
        """The counts of a loaded checkpoint (ampguard.deepspeed_fp16.checkpoint); ``scale``: DeepSpeed's, loaded.

        A streak loaded at or past the limit is reported (or raises) at the next skipped step, as a SafeGradScaler's.
        """
        self.steps, self.skipped, self.nonfinite_loss, self.consecutive = steps, skipped, nonfinite, consecutive
        self.scale, self.min_seen, self.max_seen = scale, low, high
        self.skipped_at_last_line = skipped
        self.collapse_reported = self.stall_reported = False

    @property
    def stats(self) -> ScalerStats:
        """A snapshot, as ``SafeGradScaler.stats`` gives one (the fields DeepSpeed's scaling has)."""
        return ScalerStats(
            steps=self.steps,
            skipped=self.skipped,
            no_grad_steps=0,
            nonfinite_loss=self.nonfinite_loss,
            scale=self.scale,
            min_scale_seen=self.min_seen,
            max_scale_seen=self.max_seen,
            consecutive_skipped=self.consecutive,
        )

    def record(
        self, policy: Policy, overflow: bool, scale: float, at_floor: bool, floor: float, forward: bool = False
    ) -> None:
        """One optimizer step of DeepSpeed's: skipped (``overflow``) or taken; ``scale`` is the scale after it.

        ``forward``: the overflow was a forward one (a loss inf/NaN, ampguard.deepspeed_fp16.losses).

        Raises :class:`~ampguard.errors.ScaleCollapseError` at a stall with ``AMPGUARD_ON_STALL=raise``.
        """
        self.steps += 1
        self.scale = scale
        self.min_seen, self.max_seen = min(self.min_seen, scale), max(self.max_seen, scale)
        if overflow:
            self.skipped += 1
            self.nonfinite_loss += forward
            self.consecutive += 1
        else:
            self.consecutive = 0
            self.stall_reported = False
        if scale > floor:
            self.collapse_reported = False  # the episode ends when the scale leaves the floor
        if at_floor and not self.collapse_reported:
            self.collapse_reported = True
            floor_text = f" (AMPGUARD_MIN_SCALE={policy.floor:g})" if policy.floor and floor == policy.floor else ""
            logger.critical(
                COLLAPSE.format(scale=scale, floor=floor_text, step=self.steps, limit=policy.max_consecutive_skips),
                extra=event("collapse"),
            )
        if policy.stats_every and self.steps % policy.stats_every == 0:
            log_stats(self.stats, self.skipped - self.skipped_at_last_line)
            self.skipped_at_last_line = self.skipped
        if self.consecutive >= policy.max_consecutive_skips and not self.stall_reported:
            self.stall_reported = True
            raising = policy.on_stall == "raise"
            message = STALL.format(
                count=self.consecutive,
                step=self.steps,
                scale=scale,
                cause=AT_FLOOR if at_floor else "",
                action=STALL_RAISE.format(limit=policy.max_consecutive_skips) if raising else STALL_WARN,
            )
            if raising:
                raise ScaleCollapseError(message)
            logger.critical(message, extra=event("stall"))


_trackers: weakref.WeakKeyDictionary[object, DeepSpeedLossScale] = weakref.WeakKeyDictionary()


def tracker(holder: object, scale: float) -> DeepSpeedLossScale:
    """The counts of the scale ``holder`` keeps (made at its first update, then counted in the exit summary)."""
    found = _trackers.get(holder)
    if found is None:
        found = _trackers[holder] = DeepSpeedLossScale(scale)
        summary.track(found)
        _follow(holder, found)
    return found


def adopt(holder: object, counts: DeepSpeedLossScale) -> DeepSpeedLossScale:
    """``counts`` now kept for ``holder`` (a loaded ZeRO checkpoint's new scaler), no longer for its old one."""
    if _trackers.get(holder) is not counts:
        for old, found in list(_trackers.items()):
            if found is counts:
                del _trackers[old]
        _trackers[holder] = counts
        _follow(holder, counts)
    return counts


def _follow(holder: object, counts: DeepSpeedLossScale) -> None:
    # its line outlives it (an engine destroyed before exit); at exit the live ones are read directly
    if counts.finalizer is not None:
        counts.finalizer.detach()
    counts.finalizer = weakref.finalize(holder, _gone, counts)
    counts.finalizer.atexit = False


def _gone(counts: DeepSpeedLossScale) -> None:
    stats = counts.stats
    summary.remember(counts, stats.steps, stats.skipped, stats.nonfinite_loss, stats.no_grad_steps, stats.scale)


def of(optimizer: object) -> DeepSpeedLossScale | None:
    """The counts for a DeepSpeed optimizer (``engine.optimizer``), or None when none were made (or ``optimizer``
    is anything else, an object that takes no weak reference included)."""
    for holder in (getattr(optimizer, "loss_scaler", None), optimizer):
        try:
            found = _trackers.get(holder) if holder is not None else None
        except TypeError:  # not weakly referable, or unhashable: no DeepSpeed object
            found = None
        if found is not None:
            return found
    return None
