"""LR schedulers hold on the optimizer steps a SafeGradScaler skipped.

When the scaler skips a step (inf/NaN gradients), torch's LR schedulers still
advance: a warm-up is consumed by steps that never happened, and when the very
first step is skipped torch warns "Detected call of `lr_scheduler.step()` before
`optimizer.step()`", which sends users after a bug they do not have. DeepSpeed
and accelerate hold the scheduler on a skipped step; this module makes every
``torch.optim.lr_scheduler`` scheduler do so:

* **What the scaler tells.** ``SafeGradScaler._maybe_opt_step`` knows on the
  host whether it skips an optimizer's step (the one read torch makes there)
  and calls :func:`note_step`, which counts the optimizer's step attempts and
  how many of the last ones in a row were skipped (two integer writes on an
  attribute of the optimizer; torch's ``Optimizer.__getstate__`` does not
  carry it into pickles or copies).
* **When a scheduler holds.** ``scheduler.step()`` does nothing (and is counted
  in ``ampguard.stats.counters.process_counters.scheduler_held``) when at least one
  step of its optimizer was attempted through a SafeGradScaler since the
  scheduler last advanced and every one of those attempts was skipped. A
  scheduler stepped once per optimizer step holds exactly on the skipped ones;
  one stepped per epoch holds only if the whole epoch was skipped; a scheduler
  stepped several times per optimizer step (accelerate with
  ``split_batches=False`` on N processes) holds all of them. Two schedulers on
  one optimizer each hold. ``SequentialLR`` / ``ChainedScheduler`` hold as a
  whole (their children are not called).
* **accelerate** already holds its prepared scheduler: ``AcceleratedScheduler``
  does not call the scheduler when ``optimizer.step_was_skipped``, so the
  scheduler is not called at all on that step and holds once, not twice.
* **Fused optimizers** (``Adam(fused=True)``) skip on the device: torch's
  GradScaler hands them the found-inf flag, and the host learns of the step
  from the iteration's verdict copied to host memory (no synchronisation,
  :class:`ampguard.scaler.ledger.RowCopies`): on the CPU at the step's own
  ``update()``, so :func:`note_step` is called before ``scheduler.step()`` as
  for other optimizers; on CUDA one or two iterations later, so the attempts
  are counted that much late and a skip holds the scheduler's ``step()`` that
  many steps late (unless a later step of the optimizer, known at the same
  time, was made: then the skip is not held). A scheduler created between a
  step and the moment its verdict is known (:func:`note_pending`) did not exist
  at that step and does not hold for it; steps whose copies had not landed at a
  read of the ledger are told there.

A scheduler whose first ``step()`` ampguard sees after some steps were
attempted (``SequentialLR`` and ``ChainedScheduler``, whose constructors make
no initial step; one created before ``import ampguard``) is taken, for that
first call, as stepped once per optimizer step. torch's initial step, made by a
scheduler's constructor, always runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ampguard.log import is_rank_zero, logger
from ampguard.scaler.listeners import StepListener
from ampguard.stats.counters import process_counters

if TYPE_CHECKING:
    from ampguard.scaler.handle import ScalerHandle

_ATTRIBUTE = "_ampguard_scaler_steps"

HELD = (
    "lr_scheduler.step() held: the GradScaler skipped the optimizer step (inf/NaN gradients), so the learning-rate "
    "schedule waits for the steps that happen ({count} held so far, "
    "ampguard.stats.counters.process_counters.scheduler_held). AMPGUARD_DISABLE=scheduler_hold restores torch's behaviour."
)


class _Steps:
    """One optimizer's step attempts through a SafeGradScaler."""

    def __init__(self) -> None:
        self.attempts = 0
        self.skipped_run = 0  # how many of the last attempts in a row were skipped
        self.pending = 0  # attempts made whose verdict is still on the device (fused, a GPU): counted when known
        # id(scheduler) -> attempts when it last advanced. Not an attribute of the scheduler: torch's
        # LRScheduler.state_dict() saves every attribute. A new scheduler reusing an id starts afresh
        # with its initial step.
        self.advanced_at: dict[int, int] = {}


class Hold:
    """What one application of the scheduler_hold patch holds: its once-only messages."""

    def __init__(self) -> None:
        self.logged = False
        self.failed = False

    def report_failure(self) -> None:
        if not self.failed:
            self.failed = True
            logger.warning("scheduler_hold failed; lr_scheduler.step() runs as in torch (traceback at DEBUG)")
        logger.debug("scheduler_hold failure", exc_info=True)

    def count_hold(self) -> None:
        process_counters.scheduler_held += 1
        if not self.logged and is_rank_zero():
            self.logged = True
            logger.info(HELD.format(count=process_counters.scheduler_held))
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug("lr_scheduler.step() held (%d so far)", process_counters.scheduler_held)


def note_step(optimizer: Any, skipped: bool, was_pending: bool = False) -> None:
    """The scaler stepped (``skipped=False``) or skipped ``optimizer``'s step: called on every non-fused step, and
    for a fused one when its verdict is known (``was_pending``: told by :func:`note_pending` when made)."""
    try:
        steps = optimizer.__dict__.get(_ATTRIBUTE)  # (inlined: called on every step)
        if steps is None:
            steps = optimizer.__dict__[_ATTRIBUTE] = _Steps()
        steps.attempts += 1
        steps.skipped_run = steps.skipped_run + 1 if skipped else 0
        if was_pending and steps.pending:
            steps.pending -= 1
    except Exception:  # an optimizer without a __dict__: its schedulers advance as under torch
        logger.debug("scheduler_hold: cannot record the steps of %r", type(optimizer), exc_info=True)


class StepsListener(StepListener):
    """Each optimizer step the scaler made or skipped: told by the host read, or later for fused optimizers."""

    name = "scheduler hold"

    def on_read(self, handle: ScalerHandle, optimizer: Any, field: int, skipped: bool) -> None:
        note_step(optimizer, skipped)

    def on_step_pending(self, handle: ScalerHandle, optimizer: Any) -> None:
        note_pending(optimizer)

    def on_step_known(self, handle: ScalerHandle, optimizer: Any, skipped: bool) -> None:
        note_step(optimizer, skipped, was_pending=True)


def note_pending(optimizer: Any) -> None:
    """A fused ``optimizer``'s step was made; its verdict is known later (:func:`note_step`). A scheduler created
    meanwhile did not exist at that step, and does not hold for it."""
    try:
        _steps_of(optimizer).pending += 1
    except Exception:  # an optimizer without a __dict__: its schedulers advance as under torch
        logger.debug("scheduler_hold: cannot record the steps of %r", type(optimizer), exc_info=True)


def _steps_of(optimizer: Any) -> _Steps:
    steps = optimizer.__dict__.get(_ATTRIBUTE)
    if steps is None:
        steps = optimizer.__dict__[_ATTRIBUTE] = _Steps()
    return steps  # type: ignore[no-any-return]


def should_hold(scheduler: Any) -> bool:
    """Whether this ``scheduler.step()`` call is one to skip; records the advance when it is not."""
    optimizer_dict = getattr(getattr(scheduler, "optimizer", None), "__dict__", None)
    if optimizer_dict is None:
        return False
    steps = optimizer_dict.get(_ATTRIBUTE)
    if steps is None:
        steps = optimizer_dict[_ATTRIBUTE] = _Steps()
    key = id(scheduler)
    # torch's initial step (made by the constructor, _step_count still 0) always runs. The steps made before it
    # whose verdicts are still on their way (a fused optimizer on a GPU) are not this scheduler's to hold for.
    if getattr(scheduler, "_step_count", None) == 0:
        steps.advanced_at[key] = steps.attempts + steps.pending
        return False
    # A scheduler first seen now (SequentialLR and ChainedScheduler make no initial step; one
    # created before import ampguard) is taken as stepped once per optimizer step.
    advanced_at = steps.advanced_at.get(key, steps.attempts - steps.skipped_run)
    if 0 < steps.attempts - advanced_at <= steps.skipped_run:
        return True
    steps.advanced_at[key] = max(steps.attempts, advanced_at)
    return False


class HoldOwner(Protocol):
    """The scheduler_hold patch: its ``hold`` while applied, None otherwise."""

    hold: Hold | None


def step_wrapper(original: Callable[..., Any], owner: HoldOwner) -> Callable[..., Any]:
    """``step`` of an LR scheduler class, held on skipped optimizer steps while ``owner`` (the patch) is applied:
    a wrapper kept past an uninstall runs torch's step, and holds again after the next install."""

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        hold = owner.hold
        if hold is not None:
            try:
                held = should_hold(self)
            except Exception:  # never the reason a run dies: torch's behaviour for this call
                hold.report_failure()
                held = False
            if held:
                hold.count_hold()
                return None
        return original(self, *args, **kwargs)

    return step
