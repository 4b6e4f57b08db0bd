"""A scaler's checkpoint state: ``state_dict()`` extras, ``load_state_dict()``, pickling.

``state_dict()`` is torch's five keys plus ``ampguard``, the counters as plain
Python numbers (a ``weights_only=True`` load takes it). A checkpoint saved by
torch's GradScaler loads with torch's meaning. A pickled scaler (``torch.save``
of the object, ``copy.deepcopy``) drops the iteration in progress and carries
the listeners' entries of ``state_dict()["ampguard"]``; one pickled by torch's
own GradScaler unpickles as a SafeGradScaler with fresh ampguard bookkeeping.
"""

from __future__ import annotations

from typing import Any

import ampguard.messages as messages
import ampguard.scaler.listeners as listeners
import ampguard.scaler.policy as policy
from ampguard.log import logger
from ampguard.scaler.accounting import HostBooks
from ampguard.scaler.counters import from_earlier_attributes
from ampguard.scaler.iteration import Iteration
from ampguard.scaler.settings import resolve_settings

COUNTER_KEYS = (
    "steps",
    "skipped",
    "no_grad_steps",
    "nonfinite_loss",
    "consecutive_skipped",
    "min_scale_seen",
    "max_scale_seen",
)


# Where the iteration in progress was kept before it became one object (pickles of earlier versions).
_EARLIER_ITERATION_KEYS = (
    "_loss_check",
    "_host_found",
    "_unscaled_optimizers",
    "_iteration_loss_nonfinite",
    "_scale_read_in_iteration",
    "_scaling_thread",
)


# The listeners' entries in a pickled scaler's dict (as in ``state_dict()["ampguard"]``); taken out before the
# dict becomes the unpickled scaler's ``__dict__``.
LISTENER_ENTRIES = "_ampguard_listener_entries"


def without_listener_entries(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A pickled dict without the listeners' entries, and those entries (none in earlier pickles)."""
    state = dict(state)
    entries = state.pop(LISTENER_ENTRIES, None)
    return state, entries if isinstance(entries, dict) else {}


class Checkpoints(HostBooks):
    """``state_dict()``, ``load_state_dict()`` and pickling of a SafeGradScaler."""

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys, plus ``ampguard``: the counters, as plain Python numbers."""
        return self._with_counters(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state saved by this class or by torch's GradScaler.

        torch's five keys keep torch's meaning (a stock checkpoint's 65536 loads
        as 65536), bounded by the floor and cap; ``AMPGUARD_GROWTH_INTERVAL``, when
        set, still overrides the checkpoint's growth interval. ampguard's counters
        are restored from the ``ampguard`` entry; a checkpoint without one (torch's)
        leaves the counters this scaler already holds.
        """
        if self._enabled:
            self._fold_device_ledger()  # counters the checkpoint may not replace
        super().load_state_dict(state_dict)
        if self._enabled:
            self._load_counters(state_dict)

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled:
            self._fold_device_ledger()
        return self._for_pickle(super().__getstate__())

    def __setstate__(self, state: dict[str, Any]) -> None:
        state, listener_entries = without_listener_entries(state)
        super().__setstate__(state)
        if "_settings" not in state:  # pickled by torch's own GradScaler
            self._adopt_torch_pickle(state)
        else:
            self._restore_iteration(listener_entries)

    def _with_counters(self, state: dict[str, Any]) -> dict[str, Any]:
        """torch's ``state_dict()`` plus the ``ampguard`` entry (none when torch's is empty: scaler disabled)."""
        if state:
            state["ampguard"] = {key: value for key, value in self.stats.as_dict().items() if key in COUNTER_KEYS}
            state["ampguard"].update(listeners.save(self._handle))  # the capabilities' own entries (fp32 islands ...)
        return state

    def _load_counters(self, state_dict: dict[str, Any]) -> None:
        """After torch's ``load_state_dict()``: the environment's growth interval, the bounded scale, the counters."""
        from ampguard.registry import active_config

        env_interval = active_config().growth_interval
        if env_interval is not None and env_interval != self._growth_interval:
            logger.info(
                "AMPGUARD_GROWTH_INTERVAL=%d overrides the checkpoint's growth_interval %d.",
                env_interval,
                self._growth_interval,
            )
            self._growth_interval = env_interval
        loaded = policy.f32(float(state_dict["scale"]))
        bounded = self._bounded(loaded)
        if bounded != loaded:
            logger.info(
                "loaded loss scale %g is outside [%g, %g]: using %g.", loaded, self._min_scale, self._max_scale, bounded
            )
            self._init_scale = bounded
            if self._scale is not None:
                self._scale.fill_(bounded)
        self._counters.mirror_scale = bounded
        self._counters.mirror_tracker = int(state_dict["_growth_tracker"])
        counters = state_dict.get("ampguard")
        loaded_counters = self._loaded_counters(counters, bounded) if counters else None
        if loaded_counters is not None:
            (
                self._counters.steps,
                self._counters.skipped,
                self._counters.no_grad_steps,
                self._counters.nonfinite_loss,
                self._counters.consecutive,
                self._counters.min_seen,
                self._counters.max_seen,
            ) = loaded_counters
            assert isinstance(counters, dict)
            listeners.load(self._handle, counters)
        else:
            if not counters:  # (a malformed entry was said already)
                logger.info(messages.TORCH_STATE_LOADED.format(scale=bounded, interval=self._growth_interval))
            if self._counters.steps == 0:
                self._counters.min_seen = self._counters.max_seen = bounded  # the init scale was never used
            else:
                self._counters.min_seen, self._counters.max_seen = (
                    min(self._counters.min_seen, bounded),
                    max(self._counters.max_seen, bounded),
                )
        self._counters.skipped_at_last_report = self._counters.skipped
        self._counters.collapse_reported = False
        # A streak loaded at or past the limit is reported (or raises) at the next skipped step: the run
        # that saved it may have ended before it could, or saved it mid-stall.
        self._counters.stall_reported = False
        every = self._settings.stats_every
        self._counters.next_report = (self._counters.steps // every + 1) * every if every else 0

    def _loaded_counters(self, counters: Any, bounded: float) -> tuple[int, int, int, int, int, float, float] | None:
        """The counters of a state's ``ampguard`` entry; None (said once per load) when it is not ampguard's:
        the scaler then keeps its own, as for a torch checkpoint, rather than fail the load."""
        held = self._counters
        try:
            return (
                int(counters.get("steps", held.steps)),
                int(counters.get("skipped", held.skipped)),
                int(counters.get("no_grad_steps", held.no_grad_steps)),
                int(counters.get("nonfinite_loss", held.nonfinite_loss)),
                int(counters.get("consecutive_skipped", 0)),
                min(float(counters.get("min_scale_seen", bounded)), bounded),
                max(float(counters.get("max_scale_seen", bounded)), bounded),
            )
        except (AttributeError, TypeError, ValueError, OverflowError) as error:
            logger.warning(messages.MALFORMED_COUNTERS.format(error=f"{type(error).__name__}: {error}"))
            return None

    def _for_pickle(self, state: dict[str, Any]) -> dict[str, Any]:
        """The pickled ``__dict__``: the iteration in progress is not part of it, nor the ids of the optimizers
        the last one stepped (another process's objects may have them), nor its handle; the listeners' entries are (the
        underflow policy's ceiling and counters ...), so an unpickled or deep-copied scaler continues as this one."""
        state.pop("_iteration", None)
        state.pop("_handle", None)  # the features' key for this scaler: a copy makes its own (_restore_iteration)
        if "_counters" in state:
            state["_counters"] = state["_counters"].for_pickle()
        entries = listeners.save(self._handle, "pickling") if self._enabled else {}
        if entries:
            state[LISTENER_ENTRIES] = entries
        return state

    def _restore_iteration(self, listener_entries: dict[str, Any]) -> None:
        """After ``__setstate__``: a fresh iteration (and none of an earlier version's per-iteration attributes),
        a handle of its own, and the listeners' entries loaded (those of a capability not applied here are ignored)."""
        for key in _EARLIER_ITERATION_KEYS:
            self.__dict__.pop(key, None)
        if "_counters" not in self.__dict__:  # pickled by 0.1.0, when the counters were attributes of the scaler
            self._counters = from_earlier_attributes(self.__dict__)
        self._iteration = Iteration()
        self._new_handle()  # its own: the features' state for it is its own
        if listener_entries:
            listeners.load(self._handle, listener_entries, "unpickling")

    def _adopt_torch_pickle(self, state: dict[str, Any]) -> None:
        """After ``__setstate__`` of a scaler pickled by torch's own GradScaler (before ampguard was installed),
        unpickled as a SafeGradScaler through the patched name: torch's values, as load_state_dict would take
        them, and fresh ampguard bookkeeping."""
        from ampguard.registry import active_config

        config = active_config()
        settings = resolve_settings(None, None, None, None, config)
        settings.init_scale = float(state.get("_init_scale", settings.init_scale))
        self._ampguard_setup(settings)
        if self._enabled:
            self._counters.mirror_tracker = int(state.get("_init_growth_tracker", 0))
            if config.growth_interval is not None:
                self._growth_interval = config.growth_interval
