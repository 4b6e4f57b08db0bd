"""ampguard's counts in DeepSpeed checkpoints: saved with the optimizer's state, restored when it is loaded.

``engine.save_checkpoint`` saves ``engine.optimizer.state_dict()`` (ZeRO 0: in
the model-states file; ZeRO 1-3: one ``*_optim_states.pt`` per rank) and
``engine.load_checkpoint`` gives it back to ``load_state_dict``. The patch
wraps both methods of DeepSpeed's four fp16 optimizers:

- ``state_dict()`` gains an ``ampguard`` entry, as ``SafeGradScaler.state_dict()``
  does: the counters as plain Python numbers and the step listeners' entries (the
  fp32 islands' names). DeepSpeed's loaders read the keys they know, so such a
  checkpoint loads without ampguard as well.
- ``load_state_dict()`` runs DeepSpeed's load, then gives the counts to the
  scale now held (ZeRO 1-3 unpickle a new ``DynamicLossScaler``: this optimizer's
  counts move to it, so the exit summary has one line for the optimizer) and
  sets them from the entry, the listeners' entries loaded too (the islands
  re-applied at the next forward). A checkpoint saved without ampguard has no
  entry: the counts go on from this optimizer's own, said once at INFO.

ZeRO 1-3 load a list of the ranks' states; DeepSpeed agrees overflow between
ranks, so every rank saved the same counts and the first entry found is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ampguard.containment as containment
import ampguard.deepspeed_fp16.tracking as tracking
import ampguard.scaler.listeners as listeners
from ampguard.deepspeed_fp16.tracking import Policy
from ampguard.log import logger

KEY = "ampguard"
COUNTERS = ("steps", "skipped", "nonfinite_loss", "consecutive_skipped", "min_scale_seen", "max_scale_seen")

WITHOUT_COUNTS = (
    "loaded a DeepSpeed checkpoint saved without ampguard: its loss scale {scale:g} is DeepSpeed's and kept; "
    "ampguard's skip counts go on from this run's own ({steps} optimizer steps so far)."
)

MALFORMED = (
    "the loaded DeepSpeed optimizer state's \"ampguard\" entry is not ampguard's ({error}): DeepSpeed's state is "
    "loaded, and ampguard's skip counts go on from this run's own."
)


def state_dict(original: Callable[[Any], Any], policy: Policy) -> Callable[[Any], Any]:
    """``state_dict()`` of DeepSpeed's fp16 optimizers: DeepSpeed's state, and the ``ampguard`` entry."""

    def state_dict(self: Any) -> Any:
        state = original(self)
        try:
            counts = tracking.of(self)
            if counts is not None and isinstance(state, dict):
                stats = counts.stats.as_dict()
                state[KEY] = {key: stats[key] for key in COUNTERS} | listeners.save(counts)
        except Exception as error:  # never the reason a run dies: DeepSpeed's state as it is
            containment.report("deepspeed_fp16 state_dict", error)
        return state

    return state_dict


def load_state_dict(original: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """``load_state_dict(...)`` of DeepSpeed's fp16 optimizers: DeepSpeed's load, then ampguard's counts."""

    def load_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            before = tracking.of(self)
        except Exception as error:
            containment.report("deepspeed_fp16 load_state_dict", error)
            return original(self, *args, **kwargs)
        result = original(self, *args, **kwargs)
        try:
            _restore(self, policy, before, _entry(args, kwargs))
        except Exception as error:
            containment.report("deepspeed_fp16 load_state_dict", error)
        return result

    return load_state_dict


def _entry(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The ``ampguard`` entry of the state(s) given to ``load_state_dict``: ZeRO 0 ``(state_dict, ...)``,
    ZeRO 1-3 ``(state_dict_list, ...)``; None when there is none (saved without ampguard, or universal
    checkpoints, which ZeRO loads from a folder)."""
    given = args[0] if args else kwargs.get("state_dict", kwargs.get("state_dict_list"))
    states = given if isinstance(given, (list, tuple)) else [given]
    for state in states:
        if isinstance(state, dict) and isinstance(state.get(KEY), dict):
            return dict(state[KEY])
    return None


def _holder(optimizer: Any) -> Any:
    """The object DeepSpeed's updates are counted on: ZeRO 0's optimizer (its ``LossScaleConfig``
    holds the scale), ZeRO 1-3's ``loss_scaler``."""
    return optimizer if hasattr(optimizer, "loss_scale_config") else optimizer.loss_scaler


def _scaled(optimizer: Any, holder: Any) -> bool:
    """Whether ampguard counts this optimizer's steps: an fp16 loss scale (ZeRO 0: static or dynamic; ZeRO 1-3:
    dynamic), not bf16 or fp32."""
    if holder is optimizer:
        return bool(optimizer.loss_scale_config.use_grad_scaling)
    return bool(getattr(holder, "dynamic", False))


def _restore(
    optimizer: Any, policy: Policy, before: tracking.DeepSpeedLossScale | None, entry: dict[str, Any] | None
) -> None:
    holder = _holder(optimizer)
    scale = float(optimizer.loss_scale)
    if before is not None:
        counts = tracking.adopt(holder, before)  # ZeRO 1-3: the optimizer's counts follow its new scaler
    elif entry is not None:
        counts = tracking.tracker(holder, scale)
    else:
        counts = None
    if entry is None:
        if "without counts" not in policy.said and (counts is not None or _scaled(optimizer, holder)):
            policy.said.add("without counts")
            logger.info(WITHOUT_COUNTS.format(scale=scale, steps=counts.steps if counts is not None else 0))
        if counts is not None:
            counts.scale = scale
            counts.min_seen, counts.max_seen = min(counts.min_seen, scale), max(counts.max_seen, scale)
        return
    assert counts is not None
    try:
        loaded = (
            int(entry.get("steps", 0)),
            int(entry.get("skipped", 0)),
            int(entry.get("nonfinite_loss", 0)),
            int(entry.get("consecutive_skipped", 0)),
            min(float(entry.get("min_scale_seen", scale)), scale),
            max(float(entry.get("max_scale_seen", scale)), scale),
        )
    except (TypeError, ValueError, OverflowError) as error:
        logger.warning(MALFORMED.format(error=f"{type(error).__name__}: {error}"))
        return
    counts.restore(*loaded, scale=scale)
    listeners.load(counts, entry)
