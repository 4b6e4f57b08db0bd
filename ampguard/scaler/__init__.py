"""SafeGradScaler: torch's GradScaler with safe defaults, exact accounting and the classic crashes handled.

How it stays free: torch's ``step()`` already reads the optimizer's found_inf
flag on the host once (``_maybe_opt_step``). SafeGradScaler makes that same
single read carry one more bit (was the loss itself non-finite?) and keeps all
of its bookkeeping on the host from there: skip counts, a float32 mirror of the
scale (the rule of ``torch._amp_update_scale_``, replayed exactly), the floor,
the cap, collapse and stall detection. Nothing else is read from the device.

Where each behaviour lives:

* :mod:`ampguard.scaler.policy`: torch's update rule replayed on the host, the
  floor and cap, collapse and stall reports;
* :mod:`ampguard.scaler.ledger`: device mode, the counters kept on the device
  for fused optimizers (read once when a stats line is due, ``scaler.stats`` is
  asked for or a checkpoint is taken).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import torch

try:
    from torch.amp.grad_scaler import OptState, _MultiDeviceReplicator, _refresh_per_optimizer_state
except ImportError:  # a torch that renamed them: the grad_scaler patch reports itself unavailable
    OptState = _MultiDeviceReplicator = _refresh_per_optimizer_state = None  # type: ignore[assignment, misc]

from ampguard import containment, diagnose, healing, master, messages, scheduler_hold, summary
from ampguard.accumulation import rescale_unscaled_gradients
from ampguard.config import FLOAT32_MAX
from ampguard.errors import ScaleCollapseError
from ampguard.log import logger
from ampguard.scaler import ledger, policy
from ampguard.scaler.policy import next_scale
from ampguard.stats import ScalerStats, log_stats

if TYPE_CHECKING:
    from ampguard.config import Config

TorchGradScaler = torch.amp.grad_scaler.GradScaler  # torch's class, whatever names point to later

DEFAULT_INIT_SCALE = 1024.0
DEFAULT_GROWTH_INTERVAL = 100

# Scalers that scaled a loss since their last update(); the clip patch reads it
# through live_scalers().
scalers_in_iteration: weakref.WeakSet[SafeGradScaler] = weakref.WeakSet()


def live_scalers() -> list[SafeGradScaler]:
    """The scalers in :data:`scalers_in_iteration`, safe while other threads add or discard some.

    Iterating a WeakSet that another thread changes raises "Set changed size
    during iteration"; copying its set of references is one C call under the GIL.
    """
    return [scaler for scaler in (ref() for ref in scalers_in_iteration.data.copy()) if scaler is not None]

_overrides_logged: set[str] = set()

# Device types whose _amp_foreach_non_finite_check_and_unscale_ kernel has no
# bfloat16 implementation (pytorch issue 127176).
DEVICES_WITHOUT_BF16_UNSCALE = frozenset({"cuda"})


@dataclass
class _Settings:
    init_scale: float
    growth_interval: int
    min_scale: float
    max_scale: float
    max_consecutive_skips: int
    on_stall: str
    stats_every: int
    fp16_grads: str


def _resolve_settings(
    init_scale: float | None,
    growth_interval: int | None,
    min_scale: float | None,
    max_scale: float | None,
    config: Config,
) -> _Settings:
    def pick(variable: str, from_env: Any, explicit: Any, default: Any) -> Any:
        if from_env is None:
            return default if explicit is None else explicit
        if explicit is not None and explicit != from_env and variable not in _overrides_logged:
            _overrides_logged.add(variable)
            logger.info("%s=%g overrides the %g the code asked for.", variable, from_env, explicit)
        return from_env

    settings = _Settings(
        init_scale=float(pick("AMPGUARD_INIT_SCALE", config.init_scale, init_scale, DEFAULT_INIT_SCALE)),
        growth_interval=int(pick("AMPGUARD_GROWTH_INTERVAL", config.growth_interval, growth_interval, DEFAULT_GROWTH_INTERVAL)),
        min_scale=float(config.min_scale if min_scale is None else min_scale),
        max_scale=float(config.max_scale if max_scale is None else max_scale),
        max_consecutive_skips=config.max_consecutive_skips,
        on_stall=config.on_stall,
        stats_every=config.stats_every,
        fp16_grads=config.fp16_grads,
    )
    if not 0.0 <= settings.min_scale <= settings.max_scale <= FLOAT32_MAX:
        raise ValueError(
            f"min_scale={settings.min_scale:g}, max_scale={settings.max_scale:g}: the scale is a float32 tensor, "
            f"so 0 <= min_scale <= max_scale <= {FLOAT32_MAX:g} is needed (min_scale=0: no floor)."
        )
    return settings


def _optimizer_label(optimizer: Any) -> str:
    return f"{type(optimizer).__name__}#{id(optimizer) & 0xFFFF:04x}"


class SafeGradScaler(TorchGradScaler):
    """A drop-in :class:`torch.amp.GradScaler` that is safe for short fp16 fine-tunes.

    Differences from torch's scaler, each visible in the logs:

    * starts at ``init_scale=1024`` and grows every ``growth_interval=100`` steps
      (torch: 65536 and 2000), unless the caller passes its own values;
      ``AMPGUARD_INIT_SCALE`` / ``AMPGUARD_GROWTH_INTERVAL`` override even those;
    * the scale stays within ``[min_scale, max_scale]`` (default ``[1, 2**24]``);
    * counts steps, skipped steps, no-gradient steps and non-finite losses
      (:attr:`stats`) without any host-device synchronisation beyond torch's own,
      and logs a stats line every ``AMPGUARD_STATS_EVERY`` steps;
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

    # The host replay of the scale update is exact for torch's update(); a
    # subclass whose update() differs (ShardedGradScaler) sets this False and
    # always keeps its bookkeeping on the device.
    _host_mirror_exact = True

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
        if not isinstance(device, (str, torch.device)):
            raise TypeError(
                f"SafeGradScaler's first argument is the device type (e.g. 'cuda'), got {device!r}. "
                f"Did you mean init_scale={device!r}?"
            )
        from ampguard.registry import active_config

        settings = _resolve_settings(init_scale, growth_interval, min_scale, max_scale, active_config())
        super().__init__(
            device,  # type: ignore[arg-type]
            init_scale=settings.init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=settings.growth_interval,
            enabled=enabled,
        )
        self._ampguard_setup(settings)

    # -- state ------------------------------------------------------------------------

    def _ampguard_setup(self, settings: _Settings) -> None:
        self._settings = settings
        self._min_scale = settings.min_scale
        self._max_scale = settings.max_scale
        self._steps = 0
        self._skipped = 0
        self._no_grad_steps = 0
        self._nonfinite_loss = 0
        self._consecutive = 0
        self._skipped_at_last_report = 0
        self._next_report = settings.stats_every or 0
        self._mirror_scale: float | None = policy.f32(min(max(settings.init_scale, self._min_scale), self._max_scale))
        self._mirror_tracker = 0
        self._min_seen = self._max_seen = self._mirror_scale
        self._ledger: ledger.DeviceLedger | None = None
        self._collapse_reported = False
        self._stall_reported = False
        self._stall_error: ScaleCollapseError | None = None
        self._warned_no_grad: set[int] = set()
        self._warned_fp16 = False
        self._reset_iteration()
        if self._enabled:
            summary.track(self)
        if self._enabled and settings.init_scale != self._mirror_scale:
            self._init_scale = self._mirror_scale

    def _reset_iteration(self) -> None:
        # loss - loss of every loss scale()d this iteration, summed: 0 while all were finite, NaN otherwise.
        self._loss_check: torch.Tensor | None = None
        self._host_found: dict[int, bool] = {}
        self._unscaled_optimizers: list[Any] = []
        self._iteration_loss_nonfinite = False
        # get_scale() read after scale(): clip thresholds may be scaled ones (ampguard.clip).
        self._scale_read_in_iteration = False
        # The thread that called scale(): clip_grad_norm_ in a thread looks at that thread's scalers.
        self._scaling_thread: int | None = None

    # -- scale ------------------------------------------------------------------------

    def scale(self, outputs):  # type: ignore[override]
        """As torch's ``scale()``; also notes, on the device, whether the loss itself is finite.

        Called again after ``unscale_()`` in the same iteration (gradient
        accumulation), it first multiplies the unscaled gradients back by the
        scale (:mod:`ampguard.accumulation`).
        """
        if self._enabled and self._unscaled_optimizers:
            try:
                rescale_unscaled_gradients(self)
            except Exception as error:
                containment.report("re-scaling of gradients unscaled earlier (scale())", error)
        scaled = super().scale(outputs)
        if self._enabled:
            scalers_in_iteration.add(self)
            try:
                self._scaling_thread = threading.get_ident()
                check = _loss_check(outputs)
                if check is not None:
                    self._loss_check = check if self._loss_check is None else self._loss_check + check.to(self._loss_check.device)
            except Exception as error:
                containment.report("loss check (scale())", error)
        return scaled

    def get_scale(self) -> float:
        """As torch's ``get_scale()`` (one host read)."""
        if self._enabled and self in scalers_in_iteration:
            self._scale_read_in_iteration = True
        return super().get_scale()

    # -- unscale ----------------------------------------------------------------------

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """As torch's ``unscale_()``, except that a second call with no ``scale()`` in between is a no-op.

        Libraries and users both call it (accelerate, Lightning manual
        optimisation); the gradients are divided once. After another
        ``scale()`` (gradient accumulation) the gradients were multiplied back,
        and this call unscales and checks all of them (:mod:`ampguard.accumulation`).
        """
        if self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED:
            logger.debug("unscale_() called again for %s in one iteration: ignored.", _optimizer_label(optimizer))
            return
        super().unscale_(optimizer)
        if self._enabled:
            self._unscaled_optimizers.append(optimizer)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        # torch's loop, plus: float16 parameters allowed (with one warning, or
        # torch's error with AMPGUARD_FP16_GRADS=error) and bfloat16 gradients
        # unscaled without the CUDA kernel that lacks them.
        refuse_fp16 = not allow_fp16 and self._settings.fp16_grads == "error"
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grouped: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        saw_fp16 = False
        with torch.no_grad():
            # Half-precision parameters with fp32 master weights: their gradients, copied into the masters.
            for param, grad in master.gradients(optimizer, None if refuse_fp16 else self):
                if grad is None:
                    continue
                if grad.dtype == torch.float16:
                    if refuse_fp16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    saw_fp16 = True
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                grouped[grad.device][grad.dtype].append(grad)
            for device, per_dtype in grouped.items():
                for dtype, grads in per_dtype.items():
                    if dtype == torch.bfloat16 and device.type in DEVICES_WITHOUT_BF16_UNSCALE:
                        _unscale_without_kernel_(grads, per_device_found_inf.get(device), per_device_inv_scale.get(device))
                    else:
                        torch._amp_foreach_non_finite_check_and_unscale_(
                            grads, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                        )
        if saw_fp16 and not allow_fp16 and not self._warned_fp16:
            self._warned_fp16 = True
            logger.warning(messages.FP16_GRADIENTS.format(optimizer=_optimizer_label(optimizer)))
        return per_device_found_inf._per_device_tensors

    # -- step -------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As torch's ``step()``; an optimizer without any gradient is stepped as in fp32 instead of raising."""
        if not self._enabled or self._scale is None or "closure" in kwargs:
            result = super().step(optimizer, *args, **kwargs)
            self._steps += 1
            return result
        state = self._per_optimizer_states[id(optimizer)]
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if not fused and state["stage"] is OptState.READY:
            self.unscale_(optimizer)
        if not fused and state["stage"] is OptState.UNSCALED and not state["found_inf_per_device"]:
            if args and callable(args[0]):
                # A positional closure would make the gradients now, scaled and unchecked: torch's error.
                raise AssertionError(messages.NO_INF_CHECKS_CLOSURE)
            self._note_no_gradients(optimizer)
            result = optimizer.step(*args, **kwargs)
            state["stage"] = OptState.STEPPED
        else:
            result = super().step(optimizer, *args, **kwargs)
            if fused and not state["found_inf_per_device"]:
                self._note_no_gradients(optimizer)
        self._steps += 1
        return result

    def _note_no_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        self._no_grad_steps += 1
        if id(optimizer) not in self._warned_no_grad:
            self._warned_no_grad.add(id(optimizer))
            logger.warning(messages.NO_GRADIENTS.format(optimizer=_optimizer_label(optimizer)))

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        # The single host read torch makes here also carries "was the loss finite?" and the probe's verdict.
        try:
            code = self._step_code(optimizer_state)
        except Exception as error:
            containment.report("skip check (step())", error)
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        value = int(code.item())
        try:
            found = self._note_verdict(optimizer, value)
        except Exception as error:
            containment.report("bookkeeping of a step's verdict (step())", error)
            found = bool(value & 1)
        if found:
            return None
        return optimizer.step(*args, **kwargs)

    def _step_code(self, optimizer_state: dict[str, Any]) -> torch.Tensor:
        """found_inf (0/1), + 2 when a loss was non-finite, + the probe's verdict: one value for one read."""
        found_infs = list(optimizer_state["found_inf_per_device"].values())
        total = found_infs[0]
        for other in found_infs[1:]:
            total = total + other.to(total.device, non_blocking=True)
        code = total.clamp(max=1.0) if len(found_infs) > 1 or not self._host_mirror_exact else total  # 0 or 1
        if self._loss_check is not None:
            # + 2 when a loss was non-finite (its check is NaN): still one value, one read.
            code = code + torch.nan_to_num(self._loss_check.to(code.device, non_blocking=True), nan=2.0)
        return healing.add_verdict(code)  # + 4 * (first overflowing module call + 1) while the probe is armed

    def _note_verdict(self, optimizer: torch.optim.Optimizer, value: int) -> bool:
        """Everything the host learns from the one read; returns whether the step is skipped."""
        healing.note_read(value)
        found = bool(value & 1)
        self._host_found[id(optimizer)] = found
        scheduler_hold.note_step(optimizer, found)  # LR schedulers hold on a skipped step
        if value & 2:
            self._iteration_loss_nonfinite = True
        if found:
            diagnose.on_skipped_step(self, optimizer, loss_nonfinite=bool(value & 2), step=self._steps + 1)
        return found

    # -- update -----------------------------------------------------------------------

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """As torch's ``update()``, plus the floor and cap, accounting and reporting.

        An iteration in which no optimizer had gradients leaves the scale as it
        is (torch raises "No inf checks were recorded prior to update.").
        With ``AMPGUARD_ON_STALL=raise``, a stall raises
        :class:`~ampguard.ScaleCollapseError` here, after the iteration is complete
        (a stall found while folding device counters elsewhere waits for update()).
        """
        if not self._enabled:
            return super().update(new_scale)
        states = self._per_optimizer_states
        recorded = [s for s in states.values() if s["found_inf_per_device"]]
        if self._scale is None:
            return super().update(new_scale)  # torch's error: scale() was never called
        self._torch_updated = False
        try:
            if new_scale is None and not recorded:
                self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
            elif new_scale is None and self._ledger is None and self._host_mirror_exact and all(
                key in self._host_found for key, s in states.items() if s["found_inf_per_device"]
            ):
                self._update_in_host_mode()
            else:
                ledger.update_in_device_mode(self, states, new_scale)
        except Exception as error:
            passing = containment.passes_through(error)
            if passing is not None:
                raise passing from None
            containment.report("scale bookkeeping (update())", error)
            self._resync_after_failed_update(new_scale)
        finally:
            self._end_iteration()
        error, self._stall_error = self._stall_error, None
        if error is not None:
            raise error

    def _update_in_host_mode(self) -> None:
        found = any(self._host_found.values())
        forward_overflow = found and healing.agreed_forward_overflow(self._iteration_loss_nonfinite)
        skipped_steps = sum(self._host_found.values())
        scale_before = self._mirror_scale
        assert scale_before is not None
        self._torch_update()
        if forward_overflow:  # the loss itself was inf/NaN: the scale did not cause it, so no back-off
            scale, tracker = healing.keep_scale(self, scale_before, self._mirror_tracker)
        else:
            scale, tracker = next_scale(
                scale_before, self._mirror_tracker, found, self._growth_factor, self._backoff_factor, self._growth_interval
            )
        bounded = min(max(scale, self._min_scale), self._max_scale)
        if bounded != scale:
            assert self._scale is not None
            self._scale.fill_(bounded)
        self._mirror_scale, self._mirror_tracker = bounded, tracker
        self._min_seen = min(self._min_seen, bounded)
        self._max_seen = max(self._max_seen, bounded)
        self._skipped += skipped_steps
        if self._iteration_loss_nonfinite:
            self._nonfinite_loss += 1
        if bounded != scale_before and logger.isEnabledFor(logging.DEBUG):
            logger.debug("loss scale %g -> %g at step %d", scale_before, bounded, self._steps)
        if found:
            self._consecutive += 1
            if not forward_overflow and policy.in_collapse_zone(self, scale_before):
                policy.report_collapse(self, scale_before)
            policy.check_stall(self, self._consecutive)
        else:
            self._consecutive = 0
            self._stall_reported = False
        if not policy.in_collapse_zone(self, bounded):
            self._collapse_reported = False
        healing.end_iteration(self, forward_overflow)

    def _torch_update(self, new_scale: float | torch.Tensor | None = None) -> None:
        containment.torch_call(super().update, new_scale)  # torch's errors are torch's, not ampguard's
        self._torch_updated = True

    def _resync_after_failed_update(self, new_scale: float | torch.Tensor | None) -> None:
        """After a failure in ampguard's bookkeeping: torch's update if it did not run, then the device's truth."""
        if not self._torch_updated:
            super().update(new_scale)
        assert self._scale is not None and self._growth_tracker is not None
        self._ledger = None
        self._mirror_scale = float(self._scale.clamp(min=self._min_scale or None, max=self._max_scale).item())
        self._scale.fill_(self._mirror_scale)
        self._mirror_tracker = int(self._growth_tracker.item())

    def _end_iteration(self) -> None:
        scalers_in_iteration.discard(self)
        self._reset_iteration()
        if self._next_report and self._steps >= self._next_report:
            every = self._settings.stats_every
            self._next_report = (self._steps // every + 1) * every
            self._report()

    # -- collapse, stall and reporting ------------------------------------------------

    def _report(self) -> None:
        try:
            stats = self.stats
            log_stats(stats, stats.skipped - self._skipped_at_last_report)
            self._skipped_at_last_report = stats.skipped
        except Exception as error:
            containment.report("stats line", error)

    @property
    def stats(self) -> ScalerStats:
        """A snapshot of the counters (reads the device only after fused-optimizer iterations)."""
        ledger.fold_device_ledger(self)
        scale = self._mirror_scale if self._enabled else 1.0
        return ScalerStats(
            steps=self._steps,
            skipped=self._skipped,
            no_grad_steps=self._no_grad_steps,
            nonfinite_loss=self._nonfinite_loss,
            scale=float(scale if scale is not None else TorchGradScaler.get_scale(self)),
            min_scale_seen=self._min_seen,
            max_scale_seen=self._max_seen,
            consecutive_skipped=self._consecutive,
            **healing.stats_fields(),
        )

    # -- checkpoints ------------------------------------------------------------------

    _COUNTER_KEYS = ("steps", "skipped", "no_grad_steps", "nonfinite_loss", "consecutive_skipped", "min_scale_seen", "max_scale_seen")

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys, plus ``ampguard``: the counters, as plain Python numbers."""
        state = super().state_dict()
        if state:
            state["ampguard"] = {key: value for key, value in self.stats.as_dict().items() if key in self._COUNTER_KEYS}
            state["ampguard"]["fp32_islands"] = list(healing.stats_fields()["fp32_islands"])  # plain strings
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by torch's GradScaler.

        torch's five keys keep torch's meaning (a stock checkpoint's 65536 loads
        as 65536), bounded by the floor and cap; ``AMPGUARD_GROWTH_INTERVAL``, when
        set, still overrides the checkpoint's growth interval. ampguard's counters
        are restored from the ``ampguard`` entry; a checkpoint without one (torch's)
        leaves the counters this scaler already holds.
        """
        if self._enabled:
            ledger.fold_device_ledger(self)  # counters the checkpoint may not replace
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        from ampguard.registry import active_config

        env_interval = active_config().growth_interval
        if env_interval is not None and env_interval != self._growth_interval:
            logger.info("AMPGUARD_GROWTH_INTERVAL=%d overrides the checkpoint's growth_interval %d.", env_interval, self._growth_interval)
            self._growth_interval = env_interval
        loaded = policy.f32(float(state_dict["scale"]))
        bounded = min(max(loaded, self._min_scale), self._max_scale)
        if bounded != loaded:
            logger.info("loaded loss scale %g is outside [%g, %g]: using %g.", loaded, self._min_scale, self._max_scale, bounded)
            self._init_scale = bounded
            if self._scale is not None:
                self._scale.fill_(bounded)
        self._mirror_scale = bounded
        self._mirror_tracker = int(state_dict["_growth_tracker"])
        counters = state_dict.get("ampguard")
        if counters:
            self._steps = int(counters.get("steps", self._steps))
            self._skipped = int(counters.get("skipped", self._skipped))
            self._no_grad_steps = int(counters.get("no_grad_steps", self._no_grad_steps))
            self._nonfinite_loss = int(counters.get("nonfinite_loss", self._nonfinite_loss))
            self._consecutive = int(counters.get("consecutive_skipped", 0))
            self._min_seen = min(float(counters.get("min_scale_seen", bounded)), bounded)
            self._max_seen = max(float(counters.get("max_scale_seen", bounded)), bounded)
            healing.restore_islands(counters.get("fp32_islands"))
        else:
            logger.info(messages.TORCH_STATE_LOADED.format(scale=bounded, interval=self._growth_interval))
            if self._steps == 0:
                self._min_seen = self._max_seen = bounded  # the init scale was never used
            else:
                self._min_seen, self._max_seen = min(self._min_seen, bounded), max(self._max_seen, bounded)
        self._skipped_at_last_report = self._skipped
        self._collapse_reported = False
        # A streak loaded at or past the limit is reported (or raises) at the next skipped step: the run
        # that saved it may have ended before it could, or saved it mid-stall.
        self._stall_reported = False
        every = self._settings.stats_every
        self._next_report = (self._steps // every + 1) * every if every else 0

    def __del__(self) -> None:
        try:  # the exit summary keeps this scaler's tally (host counters only)
            summary.remember(self)
        except Exception:  # at interpreter exit modules may be half torn down
            pass

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled:
            ledger.fold_device_ledger(self)
        state = super().__getstate__()
        state.update(_loss_check=None, _unscaled_optimizers=[], _host_found={}, _stall_error=None, _scale_read_in_iteration=False)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_settings" in state:
            return
        # Pickled by torch's own GradScaler (before ampguard was installed), and
        # unpickled as a SafeGradScaler through the patched name: torch's values,
        # as load_state_dict would take them, and fresh ampguard bookkeeping.
        from ampguard.registry import active_config

        config = active_config()
        settings = _resolve_settings(None, None, None, None, config)
        settings.init_scale = float(state.get("_init_scale", settings.init_scale))
        self._ampguard_setup(settings)
        if self._enabled:
            self._mirror_tracker = int(state.get("_init_growth_tracker", 0))
            if config.growth_interval is not None:
                self._growth_interval = config.growth_interval


def _loss_check(outputs: Any) -> torch.Tensor | None:
    """``loss - loss`` summed over every tensor of ``outputs`` (nested lists and tuples, as ``scale()`` takes).

    0 while every loss is finite, NaN otherwise; one kernel per loss
    (``torch.isfinite(...).all()`` is five; no ``detach()`` either, under no_grad).
    None when there is no tensor, or ``outputs`` is another iterable, which
    ``scale()`` maps lazily.
    """
    if isinstance(outputs, torch.Tensor):
        with torch.no_grad():
            check = outputs - outputs
            return check.sum() if check.dim() else check
    if not isinstance(outputs, (list, tuple)):
        return None
    total: torch.Tensor | None = None
    for item in outputs:
        check = _loss_check(item)
        if check is not None:
            total = check if total is None else total + check.to(total.device)
    return total


_sharded_classes: dict[type, type] = {}


def safe_sharded_scaler_class(sharded: type) -> type:
    """A subclass of FSDP's ``ShardedGradScaler`` with SafeGradScaler's safety (one per class)."""
    if sharded in _sharded_classes:
        return _sharded_classes[sharded]

    class SafeShardedGradScaler(SafeGradScaler, sharded):  # type: ignore[misc, valid-type]
        """FSDP's ``ShardedGradScaler`` under ampguard: its cross-rank found_inf all-reduce, SafeGradScaler's safety."""

        _host_mirror_exact = False
        _unscale_grads_ = sharded._unscale_grads_

        def __init__(
            self,
            device: str = "cuda",
            init_scale: float | None = None,
            backoff_factor: float = 0.5,
            growth_factor: float = 2.0,
            growth_interval: int | None = None,
            enabled: bool = True,
            process_group: Any = _DEFAULT_GROUP,
            *,
            min_scale: float | None = None,
            max_scale: float | None = None,
        ) -> None:
            from ampguard.registry import active_config

            settings = _resolve_settings(init_scale, growth_interval, min_scale, max_scale, active_config())
            extra = {} if process_group is _DEFAULT_GROUP else {"process_group": process_group}
            sharded.__init__(
                self, device, init_scale=settings.init_scale, backoff_factor=backoff_factor,
                growth_factor=growth_factor, growth_interval=settings.growth_interval, enabled=enabled, **extra,
            )
            self._ampguard_setup(settings)

    SafeShardedGradScaler.__name__ = "ShardedGradScaler"
    # Found by pickle (torch.save of the scaler object) through this module's __getattr__.
    SafeShardedGradScaler.__qualname__ = "SafeShardedGradScaler"
    _sharded_classes[sharded] = SafeShardedGradScaler
    return SafeShardedGradScaler


def __getattr__(name: str) -> Any:
    # ``ampguard.scaler.SafeShardedGradScaler``, the name pickle stores for FSDP's
    # scaler under ampguard: the class is made when FSDP's module is imported,
    # so unpickling in a fresh process builds it here.
    if name == "SafeShardedGradScaler":
        import importlib

        sharded = importlib.import_module("torch.distributed.fsdp.sharded_grad_scaler").ShardedGradScaler
        return sharded if sharded in _sharded_classes.values() else safe_sharded_scaler_class(sharded)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DEFAULT_GROUP = object()


def _unscale_without_kernel_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """What ``_amp_foreach_non_finite_check_and_unscale_`` does, with ops that accept bfloat16 everywhere."""
    finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
    found_inf.copy_(torch.where(finite, found_inf, torch.ones_like(found_inf)))
    torch._foreach_mul_(grads, inv_scale)


def params_of(optimizers: Iterable[Any]) -> set[int]:
    """ids of every parameter the optimizers hold."""
    return {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
