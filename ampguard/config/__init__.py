"""Every ``AMPGUARD_*`` environment variable, in one place.

Each variable is a :class:`Setting`: its name, default, the words used to
describe what it accepts, and a parser. :func:`load` reads them all at install
time into a frozen :class:`Config`. A value that does not parse raises
:class:`~ampguard.errors.ConfigError` (one for all the bad variables); there is
never a silent fallback. A name that is not ampguard's but looks meant for it
(any case) is a WARNING with a suggestion, and is otherwise ignored.
``docs/configuration.md`` documents the same table, and a test keeps the two in
step.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import ampguard.config.names as variable_names
from ampguard.config.settings import FLOAT32_MAX, SETTINGS, SETTINGS_BY_VARIABLE, Setting, suggest
from ampguard.errors import ConfigError

__all__ = ["FLOAT32_MAX", "SETTINGS", "SETTINGS_BY_VARIABLE", "Config", "Setting", "load", "markdown_table"]


@dataclass(frozen=True)
class Config:
    """The configuration in effect, as read from the environment by :func:`load` (defaults: :data:`SETTINGS`)."""

    enabled: bool
    disable: frozenset[str]
    enable: frozenset[str]
    quiet: bool
    init_scale: float | None
    growth_interval: int | None
    max_scale: float
    min_scale: float
    max_consecutive_skips: int
    on_stall: str
    stats_every: int
    fp16_grads: str
    bf16_fallback: str
    fp32_islands: str = "auto"
    max_islands: int = 8
    probe_steps: int = 200
    forward_rerun: bool = True
    master_weights: str = "fp16"
    stats_file: str | None = None
    watch_every: int = 100
    headroom: float = 4.0
    underflow: str = "adapt"
    underflow_every: int = 100
    deepspeed: bool = True

    def as_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: sorted(value) if isinstance(value, frozenset) else value for name, value in values.items()}


def default_text(setting: Setting) -> str:
    """The default as docs/configuration.md shows it."""
    value = setting.default
    if isinstance(value, bool):
        return "1" if value else "0"
    if value is None:
        return "unset"
    if isinstance(value, frozenset):
        return "empty"
    if isinstance(value, float):
        return f"{value:g}" if value < 1e6 else f"{value:.0f} (2**{int(math.log2(value))})"
    return str(value)


def markdown_table() -> str:
    """The table of docs/configuration.md, generated from :data:`SETTINGS`."""
    lines = ["| variable | default | accepted values | what it does | example |", "|---|---|---|---|---|"]
    for setting in SETTINGS:
        lines.append(
            f"| `{setting.variable}` | {default_text(setting)} | {setting.accepted} | "
            f"{setting.description} | `{setting.example}` |"
        )
    return "\n".join(lines)


def _parse_names(variable: str, raw: str, known: Iterable[str]) -> frozenset[str]:
    known = tuple(known)
    names = frozenset(part.strip().lower() for part in raw.split(",") if part.strip())
    for name in sorted(names):
        if name not in known:
            raise ConfigError(variable, raw, "comma-separated names from: " + ", ".join(known), suggest(name, known))
    return names


def load(
    environ: Mapping[str, str] | None = None,
    *,
    patch_names: Iterable[str] = (),
) -> Config:
    """Read every ``AMPGUARD_*`` variable; raise one ConfigError naming every bad one.

    A name that is not ampguard's (see :mod:`ampguard.config.names`) is
    logged as a WARNING, once per process, and otherwise ignored.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    problems: list[ConfigError] = []
    for setting in SETTINGS:
        raw = environ.get(setting.variable)
        if raw is None or raw.strip() == "":
            continue
        try:
            if setting.parse is None:
                values[setting.attribute] = _parse_names(setting.variable, raw, patch_names)
            else:
                values[setting.attribute] = setting.parse(setting.variable, raw)
        except ConfigError as problem:
            problems.append(problem)
    variable_names.warn_unknown(environ, SETTINGS_BY_VARIABLE)
    config = Config(**{setting.attribute: setting.default for setting in SETTINGS} | values)
    bounds_read = not any(p.variable in ("AMPGUARD_MIN_SCALE", "AMPGUARD_MAX_SCALE") for p in problems)
    if bounds_read and config.min_scale > config.max_scale:
        problems.append(
            ConfigError(
                "AMPGUARD_MIN_SCALE",
                environ.get("AMPGUARD_MIN_SCALE", default_text(SETTINGS_BY_VARIABLE["AMPGUARD_MIN_SCALE"])),
                f"a floor no higher than the cap, AMPGUARD_MAX_SCALE={config.max_scale:.10g}, or 0 for no floor",
            )
        )
    if problems:
        raise ConfigError.of_all(problems)
    return config
