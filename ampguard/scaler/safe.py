"""SafeGradScaler: torch's GradScaler with safe defaults, exact accounting and the classic crashes handled.

How it stays free: torch's ``step()`` already reads the optimizer's found_inf
flag on the host once (``_maybe_opt_step``). SafeGradScaler makes that same
single read carry one more bit (was the loss itself non-finite?) and keeps all
of its bookkeeping on the host from there: skip counts, a float32 mirror of the
scale (the rule of ``torch._amp_update_scale_``, replayed exactly), the floor,
the cap, collapse and stall detection. Nothing else is read from the device.

This module is the torch-facing part: the class overrides torch's methods. It
is one object made of parts, one class per file, each using ``self`` (the state
they share is declared in :mod:`~ampguard.scaler.parts`):

* :class:`~ampguard.scaler.policy.ScalePolicy`: torch's update rule replayed on the host, the floor
  and cap, the one counting path (each iteration's :class:`~ampguard.scaler.verdict.StepVerdict`),
  collapse and stall reports, ``grow_now()``;
* :class:`~ampguard.scaler.ledger.DeviceBooks`: device mode, the rows kept on the device for fused
  optimizers, read once when a stats line is due, ``stats`` is asked for or a checkpoint is taken;
* :class:`~ampguard.scaler.accounting.HostBooks`: host mode, the verdict riding on torch's one read,
  ``stats`` and the periodic stats line;
* :class:`~ampguard.scaler.checkpoint.Checkpoints`: ``state_dict()``, ``load_state_dict()``, pickling;
* :class:`~ampguard.scaler.crashes.CrashGuards`: no-gradient optimizers, float16 and bfloat16 gradients,
  a second ``unscale_()``;
* :class:`~ampguard.scaler.accumulation.Accumulation`: ``scale()`` again after ``unscale_()``.

Beside them: :mod:`~ampguard.scaler.settings` (constructor arguments, defaults and environment, resolved
once), :mod:`~ampguard.scaler.iteration` (the iteration in progress), :mod:`~ampguard.scaler.listeners`
(the capabilities that hear of its steps), :mod:`~ampguard.scaler.sharded` (FSDP's ShardedGradScaler with
this class's safety).
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch

try:
    from torch.amp.grad_scaler import OptState
except ImportError:  # a torch that renamed it: the grad_scaler patch reports itself unavailable
    OptState = None  # type: ignore[assignment, misc]

import ampguard.containment as containment
import ampguard.scaler.listeners as listeners
import ampguard.scaler.live as live
import ampguard.stats.summary as summary
from ampguard.log import label, logger
from ampguard.scaler.accumulation import Accumulation
from ampguard.scaler.checkpoint import Checkpoints
from ampguard.scaler.counters import Counters
from ampguard.scaler.crashes import CrashGuards
from ampguard.scaler.handle import ScalerHandle
from ampguard.scaler.iteration import Iteration
from ampguard.scaler.live import TorchGradScaler, scalers_in_iteration
from ampguard.scaler.policy import f32
from ampguard.scaler.settings import Settings, active_settings, check_device_argument
from ampguard.scaler.view import ScalerView


class SafeGradScaler(Checkpoints, CrashGuards, Accumulation, TorchGradScaler):
    """A drop-in :class:`torch.amp.GradScaler` that is safe for short fp16 fine-tunes.

    Differences from torch's scaler, each visible in the logs:

    * starts at ``init_scale=1024`` and grows every ``growth_interval=100`` steps
      (torch: 65536 and 2000), unless the caller passes its own values;
      ``AMPGUARD_INIT_SCALE`` / ``AMPGUARD_GROWTH_INTERVAL`` override even those;
    * the scale stays within ``[min_scale, max_scale]`` (default ``[1, 2**24]``);
    * counts steps, skipped steps, no-gradient steps and non-finite losses
      (:attr:`stats`) without any host-device synchronisation beyond torch's own,
      and logs a stats line every ``AMPGUARD_STATS_EVERY`` steps; says whether
      the last step was skipped (:attr:`last_step_skipped`: a forward overflow
      is skipped without lowering the scale);
    * logs CRITICAL when the scale collapses or steps stall, or raises
      :class:`~ampguard.ScaleCollapseError` with ``AMPGUARD_ON_STALL=raise``;
    * does not crash where torch's does: an optimizer without gradients,
      float16 parameters, bfloat16 gradients on CUDA, a second ``unscale_()``.

    Example::

        scaler = ampguard.SafeGradScaler("cuda")
        for batch in loader:
            optimizer.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(batch)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
        print(scaler.stats)

    Args:
        device: device type, as for torch's GradScaler ("cuda", "cpu", ...).
        init_scale: initial scale; None means ampguard's default (1024).
        growth_factor, backoff_factor, enabled: as torch's.
        growth_interval: successful steps between growths; None means 100.
        min_scale: floor (0: none); None means ``AMPGUARD_MIN_SCALE`` (default 1).
        max_scale: cap; None means ``AMPGUARD_MAX_SCALE`` (default 2**24).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float | None = None,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int | None = None,
        enabled: bool = True,
        *,
        min_scale: float | None = None,
        max_scale: float | None = None,
    ) -> None:
        check_device_argument(device)
        settings = active_settings(init_scale, growth_interval, min_scale, max_scale)
        super().__init__(
            device,
            init_scale=settings.init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=settings.growth_interval,
            enabled=enabled,
        )
        self._ampguard_setup(settings)

    def _ampguard_setup(self, settings: Settings) -> None:
        self._settings = settings
        self._min_scale, self._max_scale = settings.min_scale, settings.max_scale
        bounded = self._bounded(settings.init_scale)
        self._counters = Counters.at_start(f32(bounded), settings.stats_every)  # f32: the scale tensor's
        self._iteration = Iteration()
        self._new_handle()
        if self._enabled:
            summary.track(self)
            if settings.init_scale != bounded:
                self._init_scale = bounded  # a Python float until scale() makes the tensor, as torch's

    def _new_handle(self) -> None:
        """What the features hold of it from now on (:mod:`~ampguard.scaler.handle`): made with its counters, and
        anew for an unpickled or deep-copied scaler (never carried by a pickle)."""
        self._handle = ScalerHandle(self, self._counters)

    def scale(self, outputs: Any) -> Any:
        """As torch's ``scale()``; also notes, on the device, whether the loss itself is finite.

        Called again after ``unscale_()`` in the same iteration (gradient
        accumulation), it first multiplies the unscaled gradients back by the
        scale (:mod:`ampguard.scaler.accumulation`).
        """
        if self._enabled and self._iteration.unscaled_optimizers:
            try:
                self._rescale_unscaled_gradients()
            except Exception as error:
                containment.report("re-scaling of gradients unscaled earlier (scale())", error)
        torch_scale = super().scale
        # Past ampguard.clip_grad's watch for other scalers, when torch's scale() is that wrapper itself (a plain
        # bound method of it: another library's wrapper, functools' or wrapt's, proxies its attributes and runs).
        marker = getattr(torch_scale, "unwatched", None)  # (wrapper, torch's scale), set by ampguard.clip_grad
        if type(torch_scale) is MethodType and type(marker) is tuple and marker[0] is torch_scale.__func__:
            scaled = marker[1](self, outputs)
        else:
            scaled = torch_scale(outputs)
        if self._enabled:
            scalers_in_iteration.add(self)
            try:
                self._iteration.note_loss(outputs)
            except Exception as error:
                containment.report("loss check (scale())", error)
            if listeners.hearing_scale:
                listeners.notify_scale(self._handle, scaled)
        return scaled

    def get_scale(self) -> float:
        """As torch's ``get_scale()`` (one host read)."""
        if self._enabled and self in scalers_in_iteration:
            self._iteration.scale_read = True
        return super().get_scale()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """As torch's ``unscale_()``, except that a second call with no ``scale()`` in between is a no-op.

        Libraries and users both call it (accelerate, Lightning manual
        optimisation); the gradients are divided once. After another
        ``scale()`` (gradient accumulation) the gradients were multiplied back,
        and this call unscales and checks all of them (:mod:`ampguard.scaler.accumulation`).
        """
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED:
            logger.debug("unscale_() called again for %s in one iteration: ignored.", label(optimizer))
            return
        if self._enabled and listeners.hearing_unscale:
            listeners.notify_unscale(self._handle, optimizer)
        super().unscale_(optimizer)
        if self._enabled:
            self._iteration.unscaled_optimizers.append(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As torch's ``step()``; an optimizer without any gradient is stepped as in fp32 instead of raising."""
        if not self._enabled or self._scale is None or "closure" in kwargs:
            result = super().step(optimizer, *args, **kwargs)
            self._counters.steps += 1
            return result
        state = self._per_optimizer_states[id(optimizer)]
        self._iteration.optimizers[id(optimizer)] = optimizer
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if not fused and state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if fused and state["stage"] is OptState.READY and listeners.hearing_unscale:  # (it unscales in its step)
            listeners.notify_unscale(self._handle, optimizer)
        if not fused and state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
            # Unscaled, yet no found_inf recorded: none of its parameters has a gradient (torch raises).
            result = self._step_without_gradients(optimizer, state, *args, **kwargs)
        else:
            result = super().step(optimizer, *args, **kwargs)
            if fused and not state["found_inf_per_device"]:
                self._note_no_gradients(optimizer)
        self._counters.steps += 1
        return result

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        # The single host read torch makes here also carries "was the loss finite?" and the listeners' fields.
        try:
            code, layout = self._step_code(optimizer_state)
        except Exception as error:
            containment.report("skip check (step())", error)
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        value = int(code.item())
        try:
            found = self._note_verdict(optimizer, value, layout)
        except Exception as error:
            containment.report("bookkeeping of a step's verdict (step())", error)
            found = bool(value & 1)
        if found:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch's ``update()``, plus the floor and cap, accounting and reporting.

        An iteration in which no optimizer had gradients leaves the scale as it
        is (torch raises "No inf checks were recorded prior to update.").
        With ``AMPGUARD_ON_STALL=raise``, a stall raises
        :class:`~ampguard.ScaleCollapseError` here, after the iteration is complete
        (a stall found while folding device counters elsewhere waits for update()).
        """
        if not self._enabled or self._scale is None:  # (no scale: torch's error, scale() was never called)
            return super().update(new_scale)
        live.updates.count += 1  # an update begins: the forward passes since the last one were this one's
        try:
            self._update_books(new_scale)
        finally:
            self._end_iteration()
        stall, self._counters.stall_error = self._counters.stall_error, None
        if stall is not None:
            raise stall

    def _end_iteration(self) -> None:
        scalers_in_iteration.discard(self)
        self._iteration = Iteration()
        if self._counters.next_report and self._counters.steps >= self._counters.next_report:
            self._report_now()

    def view(self) -> ScalerView:
        """What a capability may read of this scaler now (no device read): :class:`~ampguard.scaler.view.ScalerView`."""
        counters = self._counters
        return ScalerView(
            steps=counters.steps,
            scale=counters.mirror_scale,
            last_skipped=counters.last_skipped,
            scale_given=self._iteration.scale_given,
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            max_scale=self._max_scale,
            device=str(self._device),
            scale_on_device=self._scale,
            unscaled=tuple(self._iteration.unscaled_optimizers),
            scaling_thread=self._iteration.scaling_thread,
            scale_read=self._iteration.scale_read,
        )

    def skip_step_if(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
        """Skip ``optimizer``'s next ``step()`` when ``flag`` (on the device, 0 or 1) is 1, as for inf gradients
        found by ``unscale_()``: for a capability that finds them non-finite after it (ampguard.clip_grad's norm of
        unscaled gradients). No host read; nothing when ``optimizer`` was not unscaled in this iteration."""
        state = self._per_optimizer_states.get(id(optimizer))  # .get: never create an entry
        for found_inf in state["found_inf_per_device"].values() if state is not None else ():
            torch.maximum(found_inf, flag.to(device=found_inf.device, dtype=found_inf.dtype), out=found_inf)

    def __del__(self) -> None:
        try:  # the exit summary keeps this scaler's tally (host counters only)
            counters = self._counters
            summary.remember(
                self,
                counters.steps,
                counters.skipped,
                counters.nonfinite_loss,
                counters.no_grad_steps,
                counters.mirror_scale,
            )
        except Exception:  # at interpreter exit modules may be half torn down
            pass


SafeGradScaler.__module__ = "ampguard.scaler"  # the name pickles store, before and after this module split
