"""A scaler's settings: constructor arguments, ampguard's defaults and the environment, resolved once.

``AMPGUARD_INIT_SCALE`` and ``AMPGUARD_GROWTH_INTERVAL`` override even values the
code passes (logged once per variable); the floor, cap, stall and stats settings
come from the constructor or from :mod:`ampguard.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ampguard.config import FLOAT32_MAX
from ampguard.log import logger

if TYPE_CHECKING:
    from ampguard.config import Config

DEFAULT_INIT_SCALE = 1024.0
DEFAULT_GROWTH_INTERVAL = 100

_overrides_logged: set[str] = set()


@dataclass
class Settings:
    init_scale: float
    growth_interval: int
    min_scale: float
    max_scale: float
    max_consecutive_skips: int
    on_stall: str
    stats_every: int
    fp16_grads: str


def resolve_settings(
    init_scale: float | None,
    growth_interval: int | None,
    min_scale: float | None,
    max_scale: float | None,
    config: Config,
) -> Settings:
    def pick(variable: str, from_env: Any, explicit: Any, default: Any) -> Any:
        if from_env is None:
            return default if explicit is None else explicit
        if explicit is not None and explicit != from_env and variable not in _overrides_logged:
            _overrides_logged.add(variable)
            logger.info("%s=%g overrides the %g the code asked for.", variable, from_env, explicit)
        return from_env

    settings = Settings(
        init_scale=float(pick("AMPGUARD_INIT_SCALE", config.init_scale, init_scale, DEFAULT_INIT_SCALE)),
        growth_interval=int(
            pick("AMPGUARD_GROWTH_INTERVAL", config.growth_interval, growth_interval, DEFAULT_GROWTH_INTERVAL)
        ),
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


def check_device_argument(device: object) -> None:
    """The first argument is a device type: ``SafeGradScaler(1024.0)``, in ``torch.cuda.amp.GradScaler``'s order, is an error."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"SafeGradScaler's first argument is the device type (e.g. 'cuda'), got {device!r}. "
            f"Did you mean init_scale={device!r}?"
        )


def active_settings(
    init_scale: float | None, growth_interval: int | None, min_scale: float | None, max_scale: float | None
) -> Settings:
    """:func:`resolve_settings` with the installed configuration."""
    from ampguard.registry import active_config

    return resolve_settings(init_scale, growth_interval, min_scale, max_scale, active_config())
