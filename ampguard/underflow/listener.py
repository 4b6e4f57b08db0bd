"""The SafeGradScaler step listener that samples a step, reads its measurement and acts on it.

Registered by the underflow patch (:mod:`ampguard.underflow.patch`); the scaler
never imports this module. Per scaler (:class:`~ampguard.underflow.policy.ScaleState`):

* at the end of an ``update()``, when a sample is due, the sampler is armed for
  the next iteration (the first update arms the second step; then every
  ``AMPGUARD_UNDERFLOW_EVERY`` steps, and the very next step while the policy
  grows the scale), to count the backward passes of the losses this scaler
  scales and no other (``scale()`` tells the listener of each:
  :meth:`UnderflowListener.on_scale`);
* at the end of the sampled iteration's ``update()``, the sample's counts start
  for the host (:class:`~ampguard.underflow.counts.Transfer`: no synchronisation);
  at that update on the CPU, at a later one on CUDA when the copy is done, the
  measurement is known and, with ``AMPGUARD_UNDERFLOW=adapt``,
  :func:`~ampguard.underflow.policy.decide` may grow the scale
  (:meth:`ScalerHandle.grow_now <ampguard.scaler.handle.ScalerHandle.grow_now>`, the scaler's
  :meth:`~ampguard.scaler.policy.ScalePolicy.grow_now`: no read either).

Under torch.distributed, ranks training one model (DDP, FSDP) must keep one
scale while each measures its own batch. With ``adapt`` they agree on one
measurement: at the end of the sampled iteration's ``update()`` (the same
optimizer step on every rank: the schedule depends only on the step counter
and the decisions) the totals are all-reduced
(:func:`ampguard.distributed.agree_on_underflow`; the per-module counts stay
the rank's own), and the decision is taken at the same update on every rank:
that one on the CPU, the next one on CUDA, waiting for the copy there if it is
not done (whose event each rank would find done at a different update). An
exchange that fails leaves that sample reported only. Ranks training models of
their own sample and grow alone.

Healthy steps cost a few comparisons; no step reads the device for this.
``scaler.stats`` shows the scaler's own measurement. The state travels with the
scaler's ``state_dict()``, pickle and deep copy (:mod:`ampguard.underflow.checkpoint`).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import TYPE_CHECKING, Any

import torch

import ampguard.scaler.listeners as listeners
import ampguard.underflow.checkpoint as checkpoint
from ampguard.distributed import agree_on_underflow, distributed
from ampguard.log import event_logger
from ampguard.scaler.listeners import StepListener
from ampguard.scaler.view import ScalerView
from ampguard.underflow.counts import Measurement, Transfer, judged_now, totals
from ampguard.underflow.policy import ScaleState, decide

if TYPE_CHECKING:
    from ampguard.scaler.handle import ScalerHandle
    from ampguard.scaler.verdict import StepVerdict

logger = event_logger("underflow")

GROWN = (
    "loss scale {before:g} -> {after:g} at step {step}: the float16 gradients of the sampled backward pass lost "
    "{norm:.2%} of their norm ({lost:.2%} of their values were lost, zeros where float32 holds a value; "
    "{share:.2%} were subnormal or lost{worst}) (ampguard.underflow; AMPGUARD_UNDERFLOW=report keeps torch's schedule)"
)
DISTRIBUTED = (
    " (the scale is not grown for it: the ranks of this torch.distributed job could not agree on the measurement, "
    "and every rank must keep the same scale)"
)
AGREED = "; the shares are all ranks', the modules this rank's"
REPORTED = (
    "at loss scale {scale:g}, the float16 gradients of the sampled backward pass (step {step}) lost {norm:.2%} of "
    "their norm ({lost:.2%} of their values were lost, zeros where float32 holds a value; {share:.2%} were "
    "subnormal or lost{worst}); AMPGUARD_UNDERFLOW=adapt grows the scale while the gradients have room"
)

MALFORMED = (
    "the loaded state's underflow entries are not ampguard's ({error}): the scaler keeps its own underflow "
    "state (ceiling, counters, schedule); the rest of the checkpoint is loaded"
)


def counts_come_through_a_copy(view: ScalerView) -> bool:
    """Whether a sample's counts reach the host through a copy and an event (:class:`Transfer` on CUDA)."""
    return view.device.startswith("cuda")


def _worst(measurement: Measurement) -> str:
    worst = measurement.worst_modules()
    return "; most in " + ", ".join(f"{name} {share:.0%}" for name, share in worst) if worst else ""


class UnderflowListener(StepListener):
    """``mode``: "adapt" (measure and grow) or "report" (measure only); ``every``: steps between samples."""

    name = "underflow"

    def __init__(self, mode: str, every: int) -> None:
        super().__init__()
        self.mode = mode
        self.every = every
        # Per scaler, keyed by its handle (gone with the scaler).
        self.states: weakref.WeakKeyDictionary[ScalerHandle, ScaleState] = weakref.WeakKeyDictionary()
        self.reported = False

    def state_of(self, handle: ScalerHandle) -> ScaleState:
        """The state of ``handle``'s scaler (made at its first update), kept as long as that scaler lives."""
        state = self.states.get(handle)
        if state is None:
            state = self.states[handle] = ScaleState()
            weakref.finalize(handle, state.sampler.disarm)  # a scaler dropped mid-sample leaves no hook behind
            weakref.finalize(handle, self.wake_at.pop, id(handle), None)
        return state

    def stop(self) -> None:
        """The patch is reverted: no more hooks."""
        for state in list(self.states.values()):
            state.sampler.disarm()

    def on_scale(self, handle: ScalerHandle, scaled: Any) -> None:
        """On a sampled step, the sample counts the backward passes of the losses ``handle``'s scaler scales, and no other
        (another scaler's model trained in turn: a GAN's other half)."""
        state = self.states.get(handle)
        if state is not None and state.sampler.armed:
            state.sampler.own_loss(scaled)

    def on_unscale(self, handle: ScalerHandle, optimizer: torch.optim.Optimizer) -> None:
        """On a sampled step, the sample counts the optimizer's gradients before they are unscaled."""
        state = self.states.get(handle)
        if state is not None and state.sampler.armed:
            state.sampler.count_parameters(optimizer)

    # -- host mode -------------------------------------------------------------------------------

    def on_update(self, handle: ScalerHandle, verdict: StepVerdict, field: int) -> None:
        state = self.state_of(handle)
        view = handle.view()
        scale = view.scale
        assert scale is not None  # (host mode: the scale's host mirror)
        overflowed = bool(view.last_skipped) and not verdict.forward_overflow
        state.note_scale(scale, overflowed, view.backoff_factor)
        fresh = self._sampled(state)
        if fresh:
            self._start(state, view.steps, state.sampled_at)
            state.pending_skipped, state.pending_device = bool(view.last_skipped), False
        grown: bool | None = None
        if self._due(view, state, fresh):
            device = state.pending_device
            measurement, extra = state.take().result()
            skipped = extra[2] > 0 if device else state.pending_skipped  # (device mode's: found)
            grown = self._act(handle, view, state, measurement, scale, skipped=skipped)
        self._schedule(handle, state, grown)

    # -- device mode (fused optimizers) ------------------------------------------------------------

    def on_device_update(
        self, handle: ScalerHandle, check: torch.Tensor | None, held: bool, row: torch.Tensor | None
    ) -> bool | None:
        state = self.state_of(handle)
        view = handle.view()
        fresh = self._sampled(state)
        if fresh:
            if row is not None and view.scale_on_device is not None:
                # after the counts: [scale the step ran at, skipped, found, loss check, scale after update()]
                extra = torch.cat([row[3:4], row[0:3], view.scale_on_device.reshape(1).to(row.dtype)])
                self._start(state, view.steps, math.nan, extra)
                state.pending_held, state.pending_device = held, True
            else:
                state.sampler.finish()
        grown: bool | None = None
        due = self._due(view, state, fresh)  # (polls the copy's event: once per update)
        if due and not state.pending_device:
            # a host-mode sample known at a device-mode update (update(new_scale), a fused optimizer added):
            # its step's verdict is known, the scale now is not (no read); grown, if at all, on the device
            measurement, _ = state.take().result()
            grown = self._act(handle, view, state, measurement, measurement.scale, skipped=state.pending_skipped)
        elif due:
            measurement, (_, _, found, loss_check, scale) = state.take().result()
            overflowed = found > 0 and not (state.pending_held and math.isnan(loss_check))
            state.note_scale(scale, overflowed, view.backoff_factor)
            grown = self._act(handle, view, state, measurement, scale, skipped=found > 0)
        self._schedule(handle, state, grown)
        return None

    def on_overflow_known(self, handle: ScalerHandle, scale: float) -> None:
        """An overflow on a step not sampled, learned from its row: the ceiling, as host mode sets it."""
        state = self.states.get(handle)
        if state is not None:
            state.ceiling = scale

    # -- both ----------------------------------------------------------------------------------

    def _start(self, state: ScaleState, step: int, scale: float, extra: torch.Tensor | None = None) -> None:
        """End the sample; its counts start for the host. Ranks training one model first agree on its totals
        (adapt only: report mode reports each rank's own)."""
        gradients = state.sampler.finish()
        state.pending_shared = self.mode == "adapt" and distributed() is not None
        if not state.pending_shared:
            state.pending = Transfer(gradients, step, scale, extra)
            return
        modules = judged_now(gradients)  # (judged once: the totals exchanged and this rank's modules)
        agreed = agree_on_underflow(totals(modules, gradients.device))
        state.pending = Transfer(gradients, step, scale, extra, total=agreed, modules=modules)

    def _sampled(self, state: ScaleState) -> bool:
        """Whether the iteration this update ends was sampled. Ranks training one model (adapt) go by the schedule,
        the same on every rank, even where the sampler disarmed itself (:attr:`Sampler.MAX_CALLS`: a rank that
        evaluated alone while it was armed): that rank's tallies are empty, but it joins the exchange the others
        make (a collective some ranks skip pairs with the next one, DDP's gradients, and kills or mixes the job)."""
        scheduled, state.armed_for_step = state.armed_for_step, False
        if state.sampler.armed:
            return True
        return scheduled and self.mode == "adapt" and distributed() is not None

    @staticmethod
    def _due(view: ScalerView, state: ScaleState, fresh: bool) -> bool:
        """Whether the sample on its way is acted on at this update (``fresh``: the update that started it).

        Alone: once its copy is known, never waiting. Ranks training one model: at the same update on every
        rank, the sample's own where the counts are known at once, else the next one (waiting for the copy
        there if need be: each rank's event would be found done at a different update). Which of the two goes
        by the scaler's device, the same on every rank, not by this rank's transfer: one that counted nothing
        holds only the exchanged totals, on the CPU under gloo.
        """
        pending = state.pending
        if pending is None:
            return False
        if not state.pending_shared:
            return pending.ready
        return not (fresh and counts_come_through_a_copy(view))

    def _act(
        self,
        handle: ScalerHandle,
        view: ScalerView,
        state: ScaleState,
        measurement: Measurement,
        scale: float,
        *,
        skipped: bool,
    ) -> bool | None:
        """Record the measurement; grow the scale when the policy says so (adapt). Returns whether it grew.

        A sampled step that was skipped counts as a sample but is no measurement: ``scaler.stats`` and the
        checkpoint keep the last one (so ampguard never saves the inf peak of an overflowed backward pass).

        None when ranks training one model counted nothing together (every rank's sampler disarmed itself:
        an evaluation of more than :attr:`Sampler.MAX_CALLS` batches while it was armed): not a sample; the
        next step is sampled instead, once (a model without float16 gradients is not sampled every step).
        """
        if state.pending_shared and measurement.total.values == 0 and not state.retaking:
            state.retaking = True
            state.next_sample = view.steps + 1
            return None
        state.retaking = False
        state.samples += 1
        if skipped:  # its gradients overflowed: no measurement (an inf peak, counts of what was no update)
            return False
        state.last = measurement
        if view.scale_given:  # update(new_scale): the caller's scale stands
            return False
        if not decide(scale, view.growth_factor, measurement, state.ceiling, view.max_scale):
            return False
        unagreed = state.pending_shared and not state.last_agreed  # ranks whose scales must stay equal
        if self.mode != "adapt" or unagreed:
            if not self.reported:
                self.reported = True
                message = REPORTED.format(
                    scale=measurement.scale,
                    share=measurement.underflow_share,
                    lost=measurement.flushed_share,
                    norm=measurement.lost_norm_share,
                    step=measurement.step,
                    worst=_worst(measurement),
                )
                logger.warning(message + (DISTRIBUTED if unagreed else ""))
            return False
        after = handle.grow_now(below=state.ceiling)
        if after is not None and after <= scale:
            return False
        state.growths += 1
        message = GROWN.format(
            before=scale,
            after=after if after is not None else scale * view.growth_factor,
            step=measurement.step,
            share=measurement.underflow_share,
            lost=measurement.flushed_share,
            norm=measurement.lost_norm_share,
            worst=_worst(measurement) + (AGREED if state.pending_shared else ""),
        )
        if not self.reported:
            self.reported = True
            logger.info(message)
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug(message)
        return True

    def _schedule(self, handle: ScalerHandle, state: ScaleState, grown: bool | None) -> None:
        """Arm the sampler for the next iteration when a sample is due (none while one is on its way).

        Armed, the next sample is due ``every`` steps after this one: a sample the sampler dropped (a validation
        of more than its calls in between) is tried again then, not at every step.
        """
        view = handle.view()  # (after a growth this update made)
        step = view.steps
        if grown is not None:  # a sample was just acted on
            state.next_sample = step + (1 if grown else self.every)
        if state.pending is None and step + 1 >= state.next_sample and not state.sampler.armed:
            state.sampled_at = view.scale if view.scale is not None else math.nan
            state.next_sample = step + 1 + self.every
            state.sampler.arm(own_losses=True)
            state.armed_for_step = True
        self._rest(handle, state)

    def _rest(self, handle: ScalerHandle, state: ScaleState) -> None:
        """Hear the scaler only when it concerns a sample: ``scale()`` and ``unscale_()`` while a sampler is armed,
        a healthy update once a sample is due or on its way (:attr:`StepListener.wake_at`)."""
        busy = state.pending is not None or state.armed_for_step
        self.wake_at[id(handle)] = 0 if busy else state.next_sample - 1
        if any(known.sampler.armed for known in self.states.values()):
            listeners.subscribe(self, "scale", "unscale")
        else:
            listeners.unsubscribe(self, "scale", "unscale")

    # -- checkpoints, pickles, deep copies (ampguard.underflow.checkpoint) ------------------------

    def save(self, handle: ScalerHandle | Any) -> dict[str, Any]:
        state = self.states.get(handle)
        return checkpoint.entries(state, handle.steps) if state is not None else {}

    def load(self, handle: ScalerHandle | Any, entries: dict[str, Any]) -> None:
        """A saved state replaces that of ``handle``'s scaler; a sample armed or in flight is dropped (its hooks with it), and the
        loaded schedule arms the next step's when it is due."""
        try:
            saved = checkpoint.Saved.parse(entries)
        except ValueError as error:
            logger.warning(MALFORMED.format(error=error))
            return
        if saved is None:  # an earlier version's checkpoint, or torch's: the state is left as it is
            return
        state = self.state_of(handle)
        state.sampler.finish()
        state.armed_for_step = False
        saved.restore(state, handle.steps, self.every)
        self._schedule(handle, state, None)

    # -- what the scaler shows -------------------------------------------------------------------

    def stats_fields(self, handle: ScalerHandle) -> dict[str, Any]:
        state = self.states.get(handle)
        if state is None or state.last is None:
            return {}
        last = state.last
        return {
            "underflow_share": round(last.underflow_share, 6),
            "underflow_subnormal": round(last.subnormal_share, 6),
            "underflow_lost": round(last.flushed_share, 6),
            "underflow_lost_norm": round(last.lost_norm_share, 6),
            "underflow_grad_peak": last.total.peak,
            "underflow_values": last.total.values,
            "underflow_step": last.step,
            "underflow_scale": last.scale,
            "underflow_samples": state.samples,
            "underflow_growths": state.growths,
            "underflow_modules": last.worst_modules(),
        }
