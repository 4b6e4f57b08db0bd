"""After a forward overflow: what SafeGradScaler hands over when a loss was itself inf/NaN.

A forward overflow (the loss passed to ``scale()`` was inf/NaN) is not the scale's doing: the scaler skips and
counts the step without backing off. A run without non-finite losses is untouched, bit-identical to torch's.

With the ``fp32_islands`` patch applied (:func:`activate`), a forward overflow also

* tells bad data from a module's overflow by the kept inputs (:mod:`~ampguard.fp32_islands.model_inputs`),
  and runs the forward again under the probe (:mod:`~ampguard.fp32_islands.rerun`);
* restores the small buffers the forward pass updated (:mod:`ampguard.fp32_islands.buffers`);
* else arms the probe (:mod:`ampguard.fp32_islands.probe`) for the following forward passes; its verdict rides
  on the scaler's one host read (:func:`add_verdict`, :func:`note_verdict`) and names the module at the next
  forward overflow; it disarms after ``AMPGUARD_PROBE_STEPS`` steps without one;
* makes that module an fp32 island, or reports why not (:mod:`ampguard.fp32_islands.islands`).

Every ``AMPGUARD_WATCH_EVERY`` steps the headroom watch (:mod:`ampguard.headroom_watch`) sees one iteration's
float16 peaks; its verdict rides on the same read (never while the probe is armed) and makes an island before an
overflow, or names the module at the first one (:mod:`ampguard.fp32_islands.watch_verdicts`). Device mode reads
nothing on a healthy step; ranks all-reduce their verdicts on skipped steps only (docs/islands.md).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

import ampguard.fp32_islands.islands as islands
import ampguard.fp32_islands.model_inputs as model_inputs
import ampguard.fp32_islands.rerun as rerun
import ampguard.fp32_islands.watch_verdicts as watch_verdicts
import ampguard.messages as messages
import ampguard.scaler.live as live
from ampguard.distributed import distributed
from ampguard.fp32_islands.back_off import BackOff
from ampguard.fp32_islands.buffers import BufferGuard
from ampguard.fp32_islands.model_inputs import ModelInputs
from ampguard.fp32_islands.probe import Probe
from ampguard.headroom_watch.watch import HeadroomWatch
from ampguard.log import event_logger
from ampguard.scaler.counters import counters_of
from ampguard.syncs import read_to_host

logger = event_logger("island")

if TYPE_CHECKING:
    from ampguard.config import Config


@dataclass
class _Healing:
    mode: str
    max_islands: int
    probe_steps: int
    rerun: bool = True  # a forward overflow's forward passes run again under the probe (rerun.py)
    probe: Probe = field(default_factory=Probe)
    watch: HeadroomWatch = field(default_factory=lambda: HeadroomWatch(0, 4.0))
    buffers: BufferGuard = field(default_factory=BufferGuard)
    inputs: ModelInputs = field(default_factory=ModelInputs)  # to tell a batch holding inf/NaN from a module
    verdict: int = 0  # the probe's verdict decoded from this iteration's read
    quiet_steps: int = 0
    exhausted: bool = False
    warned: set[str] = field(default_factory=set)
    # Per scaler: forward overflows device mode already saw at an update (the probe watching) since its last read.
    seen_in_device_mode: weakref.WeakKeyDictionary[Any, int] = field(default_factory=weakref.WeakKeyDictionary)
    # The scaler whose updates delimit buffer discovery (a weak reference).
    buffers_owner: Any = None
    back_off: BackOff = field(default_factory=BackOff)  # while verdicts make no island
    # Armed since the last update: if the probe recorded no module call, it did not see that iteration's forward
    # pass (armed by a read after it, in device mode) and has nothing to judge.
    armed_since_update: bool = False
    stopped: bool = False  # after an error inside ampguard: the probe does not arm again
    on_engaged: Callable[[], None] | None = None  # told when the healing is engaged between updates (activate())


_active: _Healing | None = None


def _steps_of(scaler: Any) -> int:
    counters = counters_of(scaler)
    steps = counters.steps if counters is not None else getattr(scaler, "steps", 0)  # (DeepSpeed's counts)
    return steps if isinstance(steps, int) else 0


def activate(config: Config, on_engaged: Callable[[], None] | None = None) -> None:
    """Heal from now on; ``on_engaged()`` is told when it is engaged between updates (bench, a freed owner)."""
    global _active
    deactivate()
    settings = (config.fp32_islands, config.max_islands, config.probe_steps, config.forward_rerun)
    _active = _Healing(*settings, watch=HeadroomWatch(config.watch_every, config.headroom), on_engaged=on_engaged)


def deactivate() -> None:
    global _active
    if _active is not None:
        _active.probe.disarm()
        _active.watch.stop()
        _active.buffers.close()
        _active.inputs.close()
        model_inputs.strip_everywhere()
        islands.clear()
    _active = None


def state() -> _Healing | None:
    """The patch's state while applied (its probe, watch, buffers, inputs, mode): for its stats and checkpoints."""
    return _active


def watch_next_iteration() -> bool:
    """Have the headroom watch observe the next iteration, off its schedule (for ``ampguard bench``).

    False when there is nothing to do it with: the patch is off, the watch is
    switched off (``AMPGUARD_WATCH_EVERY=0``), stopped, or busy with a watch.
    """
    if _active is None or not _active.watch.every or not _may_watch(_active):
        return False
    watching = _active.watch.watch_next(0)
    if watching and _active.on_engaged is not None:
        _active.on_engaged()
    return watching


# -- the scaler's one read -----------------------------------------------------------------


def add_verdict(code: torch.Tensor, weight: float) -> torch.Tensor:
    """``code`` plus ``weight * verdict`` while the probe is armed or the watch watched; ``code`` itself otherwise."""
    if _active is None:
        return code
    if _active.probe.armed:
        return _active.probe.add_to(code, weight)
    return _active.watch.add_to(code, weight) if _active.watch.busy() else code


def note_verdict(verdict: int) -> None:
    """The verdict as the host read it (the largest of the iteration's reads, on any rank): the probe's, or the
    headroom watch's."""
    if _active is not None and verdict:
        _active.verdict = max(_active.verdict, verdict)


# -- the end of each host-mode update ---------------------------------------------------------


def end_iteration(scaler: Any, overflow: bool) -> None:
    """Buffers, probe, watch and islands after an update: ``overflow`` is the agreed forward-overflow verdict."""
    active = _active
    if active is None:
        return
    _host_iteration(active, scaler, overflow)


def _host_iteration(active: _Healing, scaler: Any, overflow: bool) -> None:
    owner = _follow(active, scaler)
    step = _steps_of(scaler)
    verdict = active.verdict if active.watch.in_read else 0
    bad_batch = overflow and active.inputs.held_nonfinite(step, updates=1, collective=True)
    found = _found_again(active, step, collective=True) if overflow and not bad_batch else None
    may_blame = found is None and not bad_batch  # run again without a module found: the overflow is not one's
    blamed = (active.watch.busy() or overflow) and _judge_watch(active, step, overflow, verdict, may_blame)
    try:
        _end_iteration(active, scaler, owner, overflow, blamed or bad_batch or bool(found))
    finally:
        if active.watch.every:
            active.watch.after_update(step, may_watch=_may_watch(active), scaler=scaler)
            _keep_inputs(active)


def _end_iteration(active: _Healing, scaler: Any, owner: bool, overflow: bool, blamed: bool) -> None:
    """``blamed``: the forward overflow is accounted for (an island made at once, or a batch holding inf/NaN)."""
    if not overflow and not active.probe.armed and not islands.restoring() and active.buffers.idle():
        return  # the healthy step of a model without small buffers: nothing to do
    step = _steps_of(scaler)
    try:
        islands.end_restore_window()
        active.buffers.on_update(overflow, step, discover=owner)
        verdict, active.verdict = active.verdict, 0
        fresh, active.armed_since_update = active.armed_since_update, False
        probe = active.probe
        if overflow:
            active.quiet_steps = 0
            if blamed and probe.armed:  # a batch holding inf/NaN: the probe has nothing to judge in it
                probe.reset()
                return
            if not probe.armed:
                if not blamed and _may_arm(active):
                    _arm(active)
                    level = logging.DEBUG if active.back_off.fruitless else logging.INFO
                    logger.log(level, messages.PROBE_ARMED, step, active.probe_steps)
                return
            if fresh and not probe.calls:  # armed after this iteration's forward pass: it saw nothing to judge
                probe.reset()
                return
            call = probe.call(verdict)
            if call is None:  # no module to blame: the probe keeps watching (unless it backs off)
                _warn_once("unlocated", messages.PROBE_UNLOCATED.format(step=step))
                _after_verdict(active, made_island=False)
            else:
                again = islands.holds(call[0])  # an island that overflows in float32 too
                islands.settle_blame(call[0], call[1], step)
                made = islands.decide(*call, step=step, mode=active.mode, max_islands=active.max_islands)
                probe.disarm()
                _after_verdict(active, made_island=made, conclusive=again)
                return
        elif probe.armed:
            active.quiet_steps += 1
            if active.quiet_steps >= active.probe_steps:
                probe.disarm()
                active.back_off.reset()  # the overflows stopped: the next one is news
                logger.info(messages.PROBE_DISARMED, active.quiet_steps)
                return
        if probe.armed:
            probe.reset()
    except Exception as error:  # never the reason a run dies
        _stop(active, "end", error)


def _found_again(active: _Healing, step: int, collective: bool = False) -> bool | None:
    """At a forward overflow: its forward passes run again under the probe (rerun.py).

    True when a module was named (its island decided), False when they ran and no
    module turned finite inputs into inf/NaN (the loss, the data), None when they
    were not run. Not while the probe watches (its verdict is this iteration's) or may not arm.
    """
    if not active.rerun or active.probe.armed or active.exhausted or active.stopped or active.back_off.skip_arming:
        return None
    try:
        call, reason = rerun.find(active.inputs.last_passes(), active.probe, collective)
    except Exception as error:  # never the reason a run dies
        _stop(active, "rerun", error)
        return None
    if reason is not None:
        _say_once(f"rerun {reason.split(':')[0]}", messages.NOT_RUN_AGAIN.format(step=step, reason=reason))
    if call is None:
        return None if reason is not None else False
    again = islands.holds(call[0])  # an island that overflows in float32 too
    islands.settle_blame(call[0], call[1], step)
    made = islands.decide(*call, step=step, mode=active.mode, max_islands=active.max_islands)
    _after_verdict(active, made_island=made, conclusive=again)
    return True


def _may_arm(active: _Healing) -> bool:
    """Whether the probe may arm at this forward overflow (no island limit reached or error, no back-off pending)."""
    return not (active.exhausted or active.stopped) and active.back_off.may_arm()


def _arm(active: _Healing) -> None:
    active.probe.arm()
    active.quiet_steps = 0
    active.armed_since_update = True


def _after_verdict(active: _Healing, made_island: bool, conclusive: bool = False) -> None:
    """After a verdict (a module named, or none): the probe backs off while verdicts keep making no island."""
    if active.back_off.after_verdict(made_island, conclusive):
        active.probe.disarm()
    _note_limit(active)


def _note_limit(active: _Healing) -> None:
    active.exhausted = "(limit)" in islands.reported or len(islands.reported) >= active.max_islands


# -- the headroom watch -----------------------------------------------------------------------


def _may_watch(active: _Healing) -> bool:
    return not (active.probe.armed or active.exhausted or active.stopped)


def _keep_inputs(active: _Healing) -> None:
    if active.watch.last is not None:  # the models the watch saw keep their inputs
        active.inputs.follow_safely(active.watch.last.roots())


def _judge_watch(
    active: _Healing, step: int, overflow: bool, verdict: int, may_blame: bool = True, watched: bool | None = None
) -> bool:
    """The watch's part of an update (:func:`ampguard.fp32_islands.watch_verdicts.judge`): True when it blamed.

    ``may_blame``: False when the overflow was a batch holding inf/NaN (no module is blamed for it).
    """
    if active.watch.pending is not None:
        active.verdict = 0  # the verdict read was the watch's
    try:
        may_blame = may_blame and _may_watch(active)
        watch, mode, limit = active.watch, active.mode, active.max_islands
        return watch_verdicts.judge(watch, step, overflow, verdict, mode, limit, may_blame, watched)
    except Exception as error:  # never the reason a run dies
        _stop(active, "watch", error)
        return False
    finally:
        _note_limit(active)
        _keep_inputs(active)


def _follow(active: _Healing, scaler: Any) -> bool:
    """Whether ``scaler`` delimits buffer discovery: the first scaler, or a later one once the one before is freed.

    Discovery watches the module calls between two of its updates (one round of
    the training loop, every model it trains); the buffers found are then put
    back after any scaler's forward overflow.
    """
    owner = active.buffers_owner() if active.buffers_owner is not None else None
    if owner is not None:
        return owner is scaler
    if active.buffers_owner is not None:  # the scaler before was freed: another model trains now
        active.buffers.restart()
        active.probe.disarm()  # it watched for the model before
        active.back_off.reset()  # the probe backed off for the model before, not this one
        active.watch.restart()  # what the watch saw was the model before; this one is watched at its 2nd step
    # Freed, it hands discovery to the next scaler heard: which must then be heard at once, healthy or not.
    active.buffers_owner = weakref.ref(scaler, lambda _: active.on_engaged() if active.on_engaged else None)
    return True


# -- another loss scale's steps (DeepSpeed fp16) ---------------------------------------------------


def end_foreign_step(owner: Any, forward_overflow: bool) -> None:
    """A step of a loss scale that is no SafeGradScaler (ampguard.deepspeed_fp16): the probe's verdict read at
    a forward overflow only; no watch, no forward run again (the probe names the module at the second)."""
    active = _active
    if active is None:
        return
    live.updates.count += 1  # (a SafeGradScaler's update() counts its own)
    try:
        if forward_overflow and active.probe.armed and active.probe.verdict is not None:
            active.verdict = max(active.verdict, int(read_to_host(active.probe.verdict.reshape(1))[0]))
    except Exception as error:  # never the reason a run dies
        return _stop(active, "foreign", error)
    _end_iteration(active, owner, _follow(active, owner), forward_overflow, blamed=False)


# -- device mode (fused optimizers) ------------------------------------------------------------


def end_device_iteration(scaler: Any, check: torch.Tensor | None, held: bool, row: torch.Tensor | None) -> bool | None:
    """The end of each device-mode update; ``check`` is the iteration's loss check on the device (None: no step).

    ``held``: a non-finite loss in this iteration is held (no back-off), and so
    counted as a forward overflow at the next read. ``row``: the iteration's
    ledger row on the device, how many optimizer steps it skipped first (a copy:
    the hold zeroes found_inf).

    Healthy steps cost nothing: no device work, no read. While the probe watches
    (after a forward overflow), one read per step gives the loss check, the
    probe's verdict and whether a step was skipped (returned; None: not read),
    and the host-mode logic follows.
    """
    active = _active
    if active is None:
        return None
    owner = _follow(active, scaler)
    if active.watch.every:  # its verdict waits for the next read of the counters (after_stats_read)
        if active.watch.watching:
            active.watch.finish()
        active.watch.after_update(_steps_of(scaler), may_watch=_may_watch(active), scaler=scaler)
        _keep_inputs(active)
    if not active.probe.armed and active.buffers.discovered and not islands.restoring():
        return None
    try:
        if active.probe.armed and check is not None and row is not None and distributed() is None:
            verdict = active.probe.verdict
            zero = check.new_zeros(())
            values = [check.float(), zero if verdict is None else verdict.to(check.device), row[0].to(check.device)]
            loss_check, verdict_value, skipped_value = read_to_host(torch.stack(values))
            overflow = loss_check != loss_check  # NaN: a loss was non-finite
            active.verdict = max(active.verdict, int(verdict_value))
            if overflow:
                active.seen_in_device_mode[scaler] = active.seen_in_device_mode.get(scaler, 0) + 1
            _host_iteration(active, scaler, overflow)
            return bool(skipped_value > 0)
        islands.end_restore_window()
        if owner and not active.buffers.discovered:
            active.buffers.advance(_steps_of(scaler))  # its copy is compared with them at a read
    except Exception as error:  # never the reason a run dies
        _stop(active, "device", error)
    return None


def after_stats_read(
    scaler: Any, forward_overflows: int, iterations: int, at_read: bool = True, current: bool = True
) -> None:
    """Device mode: the host learned of ``iterations`` iterations, ``forward_overflows`` with a non-finite loss.

    Buffers and the probe act on the overflows the host had not seen yet.
    ``at_read``: learned at a read of the device-side counters; else from the
    rows' host copies, learned every step. ``current``: the iterations told end
    with the one just updated: the buffers' copy is refreshed (as host mode does
    at each update; at reads keeping the copy's values where the buffers are
    inf/NaN, since another scaler's overflow may not be known yet). Not
    under torch.distributed, where device mode backs off as torch does and no rank
    can ask the others (this read is not collective).
    """
    active = _active
    if active is None or distributed() is not None:
        return
    # Overflows the armed probe already read at their update are not news when their rows are told.
    seen = active.seen_in_device_mode.pop(scaler, 0)
    unseen = max(forward_overflows - seen, 0)
    if seen > forward_overflows and not at_read:
        active.seen_in_device_mode[scaler] = seen - forward_overflows  # their rows come later (a GPU)
    step = _steps_of(scaler)
    try:
        if current or unseen:
            active.buffers.on_stats_read(unseen > 0, step, finite_only=at_read or not current)
        pending = active.watch.pending
        # The watch's verdict once its host copy has landed (no read); until then it stays pending (a GPU).
        ready = pending is not None and pending.summary.ready
        verdict = pending.read_verdict() if pending is not None and ready else 0
        watched = pending.overflowed if pending is not None and ready else None
        judge = ready or (unseen > 0 and pending is None)
        # The inputs of the iterations told, when they are the last ones (else not known: judged without them).
        # Its forward passes run again when the overflow is the iteration just updated (a CPU: rows known at once).
        bad_batch = unseen > 0 and active.inputs.held_nonfinite(step, iterations if current else None)
        found = _found_again(active, step) if unseen > 0 and not bad_batch and current and iterations == 1 else None
        may_blame = found is None and not bad_batch
        blamed = _judge_watch(active, step, unseen > 0, verdict, may_blame, watched) if judge else False
        blamed = blamed or bad_batch or bool(found)
        if unseen and not blamed and not active.probe.armed and _may_arm(active):
            _arm(active)
            within = f"in {unseen} of the last {iterations} steps" if iterations > 1 else "in the step"
            level = logging.DEBUG if active.back_off.fruitless else logging.INFO
            logger.log(level, messages.PROBE_ARMED_LEARNED, within, step, active.probe_steps)
    except Exception as error:  # never the reason a run dies
        _stop(active, "read", error)


def _stop(active: _Healing, where: str, error: Exception) -> None:
    """After an error inside ampguard: the probe disarms for good (arming it again would fail again, unseen)."""
    active.probe.disarm()
    active.stopped = True
    _warn_once(where, messages.PROBE_STOPPED, error)


def _warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    if _active is not None and key not in _active.warned:
        _active.warned.add(key)
        logger.log(level, message, *args)


def _say_once(key: str, message: str) -> None:
    _warn_once(key, "%s", message, level=logging.INFO)
