"""The end of each update, as the healing (:class:`~ampguard.fp32_islands.healing.Healing`) acts on it.

Host mode (:func:`end_iteration`): the agreed forward-overflow verdict, with the probe's or the headroom watch's
verdict read alongside. Device mode (:func:`end_device_iteration`, :func:`after_stats_read`): nothing is read on
a healthy step; the host learns of forward overflows at the reads of the device-side counters. Another loss
scale's steps (:func:`end_foreign_step`, DeepSpeed fp16). Each takes the applied patch's healing first.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

import ampguard.messages as messages
import ampguard.scaler.live as live
from ampguard.distributed import distributed
from ampguard.log import event_logger
from ampguard.syncs import read_to_host

logger = event_logger("island")

if TYPE_CHECKING:
    from ampguard.fp32_islands.healing import Healing
    from ampguard.scaler.handle import ScalerHandle


# -- the end of each host-mode update ---------------------------------------------------------


def end_iteration(healing: Healing, handle: ScalerHandle, overflow: bool) -> None:
    """Buffers, probe, watch and islands after an update: ``overflow`` is the agreed forward-overflow verdict."""
    _host_iteration(healing, handle, overflow)


def _host_iteration(healing: Healing, handle: ScalerHandle, overflow: bool) -> None:
    owner = healing.follow(handle)
    step = handle.steps
    verdict = healing.verdict if healing.watch.in_read else 0
    bad_batch = overflow and healing.inputs.held_nonfinite(step, updates=1, collective=True)
    found = healing.found_again(step, collective=True) if overflow and not bad_batch else None
    may_blame = found is None and not bad_batch  # run again without a module found: the overflow is not one's
    blamed = (healing.watch.busy() or overflow) and healing.judge_watch(step, overflow, verdict, may_blame)
    try:
        _end_iteration(healing, step, owner, overflow, blamed or bad_batch or bool(found))
    finally:
        if healing.watch.every:
            healing.watch.after_update(step, may_watch=healing.may_watch(), handle=handle)
            healing.keep_inputs()


def _end_iteration(healing: Healing, step: int, owner: bool, overflow: bool, blamed: bool) -> None:
    """``step``: the optimizer steps of the scale heard; ``blamed``: the forward overflow is accounted for (an
    island made at once, or a batch holding inf/NaN)."""
    if (
        not overflow
        and not healing.probe.armed
        and not healing.islands.checkpoint.restoring()
        and healing.buffers.idle()
    ):
        return  # the healthy step of a model without small buffers: nothing to do
    try:
        healing.islands.checkpoint.end_window()
        healing.buffers.on_update(overflow, step, discover=owner)
        verdict, healing.verdict = healing.verdict, 0
        fresh, healing.armed_since_update = healing.armed_since_update, False
        probe = healing.probe
        if overflow:
            healing.quiet_steps = 0
            if blamed and probe.armed:  # a batch holding inf/NaN: the probe has nothing to judge in it
                probe.reset()
                return
            if not probe.armed:
                if not blamed and healing.may_arm():
                    healing.arm()
                    level = logging.DEBUG if healing.back_off.fruitless else logging.INFO
                    logger.log(level, messages.PROBE_ARMED, step, healing.probe_steps)
                return
            if fresh and not probe.calls:  # armed after this iteration's forward pass: it saw nothing to judge
                probe.reset()
                return
            call = probe.call(verdict)
            if call is None:  # no module to blame: the probe keeps watching (unless it backs off)
                healing.warn_once("unlocated", messages.PROBE_UNLOCATED.format(step=step))
                healing.after_verdict(made_island=False)
            else:
                again = healing.islands.holds(call[0])  # an island that overflows in float32 too
                healing.islands.settle_blame(call[0], call[1], step)
                made = healing.islands.decide(*call, step=step, mode=healing.mode, max_islands=healing.max_islands)
                probe.disarm()
                healing.after_verdict(made_island=made, conclusive=again)
                return
        elif probe.armed:
            healing.quiet_steps += 1
            if healing.quiet_steps >= healing.probe_steps:
                probe.disarm()
                healing.back_off.reset()  # the overflows stopped: the next one is news
                logger.info(messages.PROBE_DISARMED, healing.quiet_steps)
                return
        if probe.armed:
            probe.reset()
    except Exception as error:  # never the reason a run dies
        healing.stop("end", error)


# -- another loss scale's steps (DeepSpeed fp16) ---------------------------------------------------


def end_foreign_step(healing: Healing, owner: Any, forward_overflow: bool) -> None:
    """A step of a loss scale that is no SafeGradScaler (ampguard.deepspeed_fp16): the probe's verdict read at
    a forward overflow only; no watch, no forward run again (the probe names the module at the second)."""
    live.updates.count += 1  # (a SafeGradScaler's update() counts its own)
    try:
        if forward_overflow and healing.probe.armed and healing.probe.verdict is not None:
            healing.verdict = max(healing.verdict, int(read_to_host(healing.probe.verdict.reshape(1))[0]))
    except Exception as error:  # never the reason a run dies
        return healing.stop("foreign", error)
    _end_iteration(healing, owner.steps, healing.follow(owner), forward_overflow, blamed=False)


# -- device mode (fused optimizers) ------------------------------------------------------------


def end_device_iteration(
    healing: Healing, handle: ScalerHandle, check: torch.Tensor | None, held: bool, row: torch.Tensor | None
) -> bool | None:
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
    owner = healing.follow(handle)
    if healing.watch.every:  # its verdict waits for the next read of the counters (after_stats_read)
        if healing.watch.watching:
            healing.watch.finish()
        healing.watch.after_update(handle.steps, may_watch=healing.may_watch(), handle=handle)
        healing.keep_inputs()
    if not healing.probe.armed and healing.buffers.discovered and not healing.islands.checkpoint.restoring():
        return None
    try:
        if healing.probe.armed and check is not None and row is not None and distributed() is None:
            verdict = healing.probe.verdict
            zero = check.new_zeros(())
            values = [check.float(), zero if verdict is None else verdict.to(check.device), row[0].to(check.device)]
            loss_check, verdict_value, skipped_value = read_to_host(torch.stack(values))
            overflow = loss_check != loss_check  # NaN: a loss was non-finite
            healing.verdict = max(healing.verdict, int(verdict_value))
            if overflow:
                healing.seen_in_device_mode[handle] = healing.seen_in_device_mode.get(handle, 0) + 1
            _host_iteration(healing, handle, overflow)
            return bool(skipped_value > 0)
        healing.islands.checkpoint.end_window()
        if owner and not healing.buffers.discovered:
            healing.buffers.advance(handle.steps)  # its copy is compared with them at a read
    except Exception as error:  # never the reason a run dies
        healing.stop("device", error)
    return None


def after_stats_read(
    healing: Healing,
    handle: ScalerHandle,
    forward_overflows: int,
    iterations: int,
    at_read: bool = True,
    current: bool = True,
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
    if distributed() is not None:
        return
    # Overflows the armed probe already read at their update are not news when their rows are told.
    seen = healing.seen_in_device_mode.pop(handle, 0)
    unseen = max(forward_overflows - seen, 0)
    if seen > forward_overflows and not at_read:
        healing.seen_in_device_mode[handle] = seen - forward_overflows  # their rows come later (a GPU)
    step = handle.steps
    try:
        if current or unseen:
            healing.buffers.on_stats_read(unseen > 0, step, finite_only=at_read or not current)
        pending = healing.watch.pending
        # The watch's verdict once its host copy has landed (no read); until then it stays pending (a GPU).
        ready = pending is not None and pending.summary.ready
        verdict = pending.read_verdict() if pending is not None and ready else 0
        watched = pending.overflowed if pending is not None and ready else None
        judge = ready or (unseen > 0 and pending is None)
        # The inputs of the iterations told, when they are the last ones (else not known: judged without them).
        # Its forward passes run again when the overflow is the iteration just updated (a CPU: rows known at once).
        bad_batch = unseen > 0 and healing.inputs.held_nonfinite(step, iterations if current else None)
        found = healing.found_again(step) if unseen > 0 and not bad_batch and current and iterations == 1 else None
        may_blame = found is None and not bad_batch
        blamed = healing.judge_watch(step, unseen > 0, verdict, may_blame, watched) if judge else False
        blamed = blamed or bad_batch or bool(found)
        if unseen and not blamed and not healing.probe.armed and healing.may_arm():
            healing.arm()
            within = f"in {unseen} of the last {iterations} steps" if iterations > 1 else "in the step"
            level = logging.DEBUG if healing.back_off.fruitless else logging.INFO
            logger.log(level, messages.PROBE_ARMED_LEARNED, within, step, healing.probe_steps)
    except Exception as error:  # never the reason a run dies
        healing.stop("read", error)
