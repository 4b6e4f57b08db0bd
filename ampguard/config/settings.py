"""The table of every ``AMPGUARD_*`` environment variable (:data:`SETTINGS`) and the parsers of their values.

:mod:`ampguard.config` reads them into a :class:`~ampguard.config.Config`.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ampguard.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(variable, raw, "1/true/yes/on or 0/false/no/off")


# What torch can hold: the loss scale is a float32 tensor, the growth tracker an
# int32 one, and device-mode skip streaks are counted in float32 (exact to 2**24).
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2**31 - 1
FLOAT32_EXACT_INT = 2**24


def _number_parser(
    kind: type, minimum: float, maximum: float | None = None, *, allow_zero: bool = False, describe: str
) -> Callable[[str, str], Any]:
    def parse(variable: str, raw: str) -> Any:
        try:
            value = kind(raw.strip())
        except ValueError:
            raise ConfigError(variable, raw, describe) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(variable, raw, describe)
        if not (value >= minimum or (allow_zero and value == 0)):
            raise ConfigError(variable, raw, describe)
        if maximum is not None and value > maximum:
            raise ConfigError(variable, raw, describe)
        return value

    return parse


_SCALE_RANGE = "a finite number from 1 to 3.4028234663852886e38 (the largest float32: the scale is a float32 tensor)"


# What people write to switch something off.
_OFF_WORDS = (*_FALSE, "disable", "disabled", "none")


def _choice_parser(choices: tuple[str, ...], *, patch: str = "") -> Callable[[str, str], str]:
    """One of ``choices``; when the variable chooses a ``patch``'s mode, "off" points to AMPGUARD_DISABLE."""

    def parse(variable: str, raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            hint = suggest(value, choices)
            if value in _OFF_WORDS:
                if "off" in choices:
                    hint = "Did you mean 'off'?"
                elif patch:
                    hint = f"To switch the {patch} patch off, set AMPGUARD_DISABLE={patch}."
            raise ConfigError(variable, raw, " or ".join(repr(c) for c in choices), hint)
        return value

    return parse


def _parse_watch_every(variable: str, raw: str) -> int:
    """A whole number of optimizer steps >= 0; off (or no, false...) is 0: no watch."""
    if raw.strip().lower() in _OFF_WORDS:
        return 0
    value: int = _number_parser(int, 0, describe="a whole number >= 0, or off (0: no headroom watch)")(variable, raw)
    return value


def _parse_writable_path(variable: str, raw: str) -> str:
    """A file path whose directory exists and is writable (the file itself is made on first use)."""
    path = os.path.abspath(os.path.expanduser(raw.strip()))
    directory = os.path.dirname(path)
    describe = "a file path in an existing, writable directory"
    if os.path.isdir(path):
        raise ConfigError(variable, raw, describe + f" ({path} is a directory)")
    if not os.path.isdir(directory):
        raise ConfigError(variable, raw, describe + f" ({directory} does not exist)")
    if not os.access(directory, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ConfigError(variable, raw, describe + f" ({path} is not writable)")
    return path


def suggest(value: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(known), n=1, cutoff=0.6)
    return f"Did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class Setting:
    """One environment variable: what it sets, its default and what it accepts."""

    variable: str
    attribute: str
    default: Any
    accepted: str
    description: str
    example: str
    # None: a comma-separated list of patch names, checked against the registry.
    parse: Callable[[str, str], Any] | None = field(repr=False, compare=False)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "AMPGUARD",
        "enabled",
        True,
        "1 or 0 (also true/false, yes/no, on/off)",
        "Master switch. 0: `import ampguard` works but patches nothing.",
        "AMPGUARD=0",
        _parse_bool,
    ),
    Setting(
        "AMPGUARD_DISABLE",
        "disable",
        frozenset(),
        "comma-separated patch names",
        "Patches not to apply (see `ampguard patches`).",
        "AMPGUARD_DISABLE=clip_grad,bf16_check",
        None,
    ),
    Setting(
        "AMPGUARD_ENABLE",
        "enable",
        frozenset(),
        "comma-separated patch names",
        "Opt-in patches to apply in addition to the default ones.",
        "AMPGUARD_ENABLE=anomaly",
        None,
    ),
    Setting("AMPGUARD_QUIET", "quiet", False, "1 or 0", "1: no banner on import.", "AMPGUARD_QUIET=1", _parse_bool),
    Setting(
        "AMPGUARD_INIT_SCALE",
        "init_scale",
        None,
        "a number from 1 to 3.4e38 (float32's largest)",
        "Initial loss scale of every GradScaler, overriding even an explicit argument "
        "(unset: 1024 unless the caller passes init_scale).",
        "AMPGUARD_INIT_SCALE=4096",
        _number_parser(float, 1.0, FLOAT32_MAX, describe=_SCALE_RANGE),
    ),
    Setting(
        "AMPGUARD_GROWTH_INTERVAL",
        "growth_interval",
        None,
        "a whole number from 1 to 2147483647",
        "Successful steps between scale growths, overriding even an explicit argument "
        "(unset: 100 unless the caller passes growth_interval).",
        "AMPGUARD_GROWTH_INTERVAL=200",
        _number_parser(int, 1, INT32_MAX, describe="a whole number from 1 to 2147483647 (the int32 growth tracker)"),
    ),
    Setting(
        "AMPGUARD_MAX_SCALE",
        "max_scale",
        2.0**24,
        "a number from 1 to 3.4e38 (float32's largest)",
        "The loss scale never grows past this cap.",
        "AMPGUARD_MAX_SCALE=65536",
        _number_parser(float, 1.0, FLOAT32_MAX, describe=_SCALE_RANGE),
    ),
    Setting(
        "AMPGUARD_MIN_SCALE",
        "min_scale",
        1.0,
        "a number from 1e-30 to AMPGUARD_MAX_SCALE, or 0 for no floor",
        "The loss scale never falls below this floor.",
        "AMPGUARD_MIN_SCALE=0",
        _number_parser(
            float,
            1e-30,
            FLOAT32_MAX,
            allow_zero=True,
            describe="a finite number from 1e-30 to AMPGUARD_MAX_SCALE, or 0 for no floor",
        ),
    ),
    Setting(
        "AMPGUARD_MAX_CONSECUTIVE_SKIPS",
        "max_consecutive_skips",
        100,
        "a whole number from 1 to 16777216",
        "After this many consecutive skipped steps ampguard logs CRITICAL (or raises, see AMPGUARD_ON_STALL).",
        "AMPGUARD_MAX_CONSECUTIVE_SKIPS=50",
        _number_parser(int, 1, FLOAT32_EXACT_INT, describe="a whole number from 1 to 16777216 (2**24)"),
    ),
    Setting(
        "AMPGUARD_ON_STALL",
        "on_stall",
        "warn",
        "warn or raise",
        "What a stall does: log CRITICAL, or raise ampguard.ScaleCollapseError.",
        "AMPGUARD_ON_STALL=raise",
        _choice_parser(("warn", "raise")),
    ),
    Setting(
        "AMPGUARD_STATS_EVERY",
        "stats_every",
        500,
        "a whole number >= 0",
        "Optimizer steps between two stats lines on logger `ampguard` (0: never).",
        "AMPGUARD_STATS_EVERY=100",
        _number_parser(int, 0, describe="a whole number >= 0"),
    ),
    Setting(
        "AMPGUARD_STATS_FILE",
        "stats_file",
        None,
        "a file path in an existing, writable directory",
        "Append each stats line and each notable event (skipped step, collapse, stall, fp32 island, ...) to this "
        "file as one JSON object per line, rank 0 only; `ampguard report FILE` summarises it "
        "(see docs/stats-file.md).",
        "AMPGUARD_STATS_FILE=run.jsonl",
        _parse_writable_path,
    ),
    Setting(
        "AMPGUARD_FP16_GRADS",
        "fp16_grads",
        "allow",
        "allow or error",
        "fp16 parameters under a GradScaler: unscale them with a warning, or raise torch's ValueError.",
        "AMPGUARD_FP16_GRADS=error",
        _choice_parser(("allow", "error")),
    ),
    Setting(
        "AMPGUARD_BF16_FALLBACK",
        "bf16_fallback",
        "off",
        "off or fp16",
        "bf16 autocast on a GPU without native bf16: only warn, or run the region in fp16.",
        "AMPGUARD_BF16_FALLBACK=fp16",
        _choice_parser(("off", "fp16")),
    ),
    Setting(
        "AMPGUARD_FP32_ISLANDS",
        "fp32_islands",
        "auto",
        "auto or report",
        "A module found to overflow float16 in the forward pass: run it in float32 from then on, "
        "or only name it (see docs/islands.md).",
        "AMPGUARD_FP32_ISLANDS=report",
        _choice_parser(("auto", "report"), patch="fp32_islands"),
    ),
    Setting(
        "AMPGUARD_MAX_ISLANDS",
        "max_islands",
        8,
        "a whole number >= 1",
        "At most this many fp32 islands; past that ampguard reports that the model does not suit float16.",
        "AMPGUARD_MAX_ISLANDS=2",
        _number_parser(int, 1, describe="a whole number >= 1"),
    ),
    Setting(
        "AMPGUARD_PROBE_STEPS",
        "probe_steps",
        200,
        "a whole number >= 1",
        "Optimizer steps the forward-overflow probe stays armed without another overflow.",
        "AMPGUARD_PROBE_STEPS=50",
        _number_parser(int, 1, describe="a whole number >= 1"),
    ),
    Setting(
        "AMPGUARD_FORWARD_RERUN",
        "forward_rerun",
        True,
        "on or off",
        "At a forward overflow, run that iteration's forward pass again (no autograd, state put back) to name the "
        "module at once; off: the probe names it at the next overflow (a forward that cannot be repeated).",
        "AMPGUARD_FORWARD_RERUN=off",
        _parse_bool,
    ),
    Setting(
        "AMPGUARD_WATCH_EVERY",
        "watch_every",
        100,
        "a whole number >= 0, or off",
        "Every this many optimizer steps one iteration's forward passes are watched: the largest float16 magnitude "
        "inside each module (intermediates included), on the device; a module close to float16's limit becomes an "
        "fp32 island before it overflows (see docs/islands.md). 0 or off: never.",
        "AMPGUARD_WATCH_EVERY=500",
        _parse_watch_every,
    ),
    Setting(
        "AMPGUARD_HEADROOM",
        "headroom",
        4.0,
        "a number from 1 to 65504",
        "The headroom watch makes a module an fp32 island when its peak comes within this factor of float16's "
        "65,504 (4: two bits, a peak of 16,376).",
        "AMPGUARD_HEADROOM=16",
        _number_parser(
            float, 1.0, 65504.0, describe="a number from 1 to 65504 (a factor below float16's largest, 65,504)"
        ),
    ),
    Setting(
        "AMPGUARD_MASTER_WEIGHTS",
        "master_weights",
        "fp16",
        "fp16, all or off",
        "float32 master copies of the trainable half-precision parameters an optimizer steps: "
        "of float16 ones, of float16 and bfloat16 ones, or none (see docs/master-weights.md).",
        "AMPGUARD_MASTER_WEIGHTS=all",
        _choice_parser(("fp16", "all", "off")),
    ),
    Setting(
        "AMPGUARD_UNDERFLOW",
        "underflow",
        "adapt",
        "adapt, report or off",
        "Sampled steps measure how much of the float16 gradient traffic the loss scale loses to underflow: grow "
        "the scale while that is material and the gradients have room, only report it, or measure nothing "
        "(see docs/underflow.md).",
        "AMPGUARD_UNDERFLOW=report",
        _choice_parser(("adapt", "report", "off"), patch="underflow"),
    ),
    Setting(
        "AMPGUARD_UNDERFLOW_EVERY",
        "underflow_every",
        100,
        "a whole number >= 1",
        "Optimizer steps between two underflow samples (the next step is sampled too while the scale grows for "
        "underflow).",
        "AMPGUARD_UNDERFLOW_EVERY=500",
        _number_parser(int, 1, describe="a whole number >= 1"),
    ),
    Setting(
        "AMPGUARD_DEEPSPEED",
        "deepspeed",
        True,
        "on or off",
        "DeepSpeed's fp16 dynamic loss scaling (ZeRO 0-3) follows ampguard's policy once deepspeed is imported: "
        "start at 1024 (AMPGUARD_INIT_SCALE when set) unless the DeepSpeed config sets initial_scale_power, never "
        "below AMPGUARD_MIN_SCALE and "
        "no 'Exiting run' there (AMPGUARD_ON_STALL decides), skips counted in the stats lines "
        "(see docs/deepspeed.md). off: DeepSpeed's own.",
        "AMPGUARD_DEEPSPEED=off",
        _parse_bool,
    ),
)

SETTINGS_BY_VARIABLE: dict[str, Setting] = {s.variable: s for s in SETTINGS}
