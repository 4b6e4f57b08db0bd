"""Environment names meant for ampguard that are not its variables, and the variable each probably meant.

Any name that starts with "ampguard" in any case and is not a known variable
(a typo such as ``AMPGUARD_INIT_SCAL``, ``ampguard_init_scale`` in lower case,
``AMPGUARDINIT_SCALE`` or ``AMPGUARD__INIT_SCALE`` malformed, a harness's own
``AMPGUARD_CHECKOUT``) is logged as a WARNING once per process with the
suggestion, and otherwise ignored: never silently, never the end of the run.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping

from ampguard.log import logger

# Words people use for what a variable does, for suggestions by meaning as well as by spelling.
_MEANINGS: dict[str, tuple[str, ...]] = {
    "PATCH": ("AMPGUARD_DISABLE", "AMPGUARD_ENABLE"),
    "PATCHES": ("AMPGUARD_DISABLE", "AMPGUARD_ENABLE"),
    "OFF": ("AMPGUARD_DISABLE",),
    "SKIP": ("AMPGUARD_DISABLE",),
    "EXCLUDE": ("AMPGUARD_DISABLE",),
    "ON": ("AMPGUARD_ENABLE",),
    "INCLUDE": ("AMPGUARD_ENABLE",),
    "OPT": ("AMPGUARD_ENABLE",),
    "SCALE": ("AMPGUARD_INIT_SCALE", "AMPGUARD_MIN_SCALE", "AMPGUARD_MAX_SCALE"),
    "FLOOR": ("AMPGUARD_MIN_SCALE",),
    "CAP": ("AMPGUARD_MAX_SCALE",),
    "GROWTH": ("AMPGUARD_GROWTH_INTERVAL",),
    "SILENT": ("AMPGUARD_QUIET",),
    "BANNER": ("AMPGUARD_QUIET",),
    "VERBOSE": ("AMPGUARD_QUIET",),
    "STALL": ("AMPGUARD_ON_STALL", "AMPGUARD_MAX_CONSECUTIVE_SKIPS"),
    "STATS": ("AMPGUARD_STATS_EVERY", "AMPGUARD_STATS_FILE"),
    "LOG": ("AMPGUARD_STATS_EVERY", "AMPGUARD_STATS_FILE"),
    "JSON": ("AMPGUARD_STATS_FILE",),
    "JSONL": ("AMPGUARD_STATS_FILE",),
    "FP16": ("AMPGUARD_FP16_GRADS",),
    "BF16": ("AMPGUARD_BF16_FALLBACK",),
    "MASTER": ("AMPGUARD_MASTER_WEIGHTS",),
    "ISLAND": ("AMPGUARD_FP32_ISLANDS",),
    "ISLANDS": ("AMPGUARD_FP32_ISLANDS", "AMPGUARD_MAX_ISLANDS"),
    "PROBE": ("AMPGUARD_PROBE_STEPS", "AMPGUARD_FORWARD_RERUN"),
    "RERUN": ("AMPGUARD_FORWARD_RERUN",),
    "UNDERFLOW": ("AMPGUARD_UNDERFLOW", "AMPGUARD_UNDERFLOW_EVERY"),
    "SUBNORMAL": ("AMPGUARD_UNDERFLOW",),
}


def _canonical_name(name: str) -> str:
    """``name`` as ampguard spells its variables: upper case, one underscore after the prefix."""
    rest = name.upper().replace("-", "_")[len("AMPGUARD") :].strip("_")
    return f"AMPGUARD_{rest}" if rest else "AMPGUARD"


def _suggest_variable(name: str, known: Collection[str]) -> str:
    """Known variables close to ``name``: the same in ampguard's spelling (``ampguard_quiet``, ``AMPGUARDQUIET``),
    else by meaning (``AMPGUARD_PATCHES`` -> DISABLE / ENABLE), else by spelling."""
    canonical = _canonical_name(name)
    if canonical in known:
        return f"Did you mean {canonical}?"
    suffix = canonical.removeprefix("AMPGUARD_")
    by_meaning = [v for word in suffix.split("_") for v in _MEANINGS.get(word, ()) if v in known]
    if not by_meaning:  # spelling, of the part after the prefix that every variable shares
        suffixes = {v.removeprefix("AMPGUARD_"): v for v in known if v != "AMPGUARD"}
        close = difflib.get_close_matches(suffix, list(suffixes), n=1, cutoff=0.6)
        by_meaning = [suffixes[c] for c in close]
    close = list(dict.fromkeys(by_meaning))
    return "Did you mean " + " or ".join(close) + "?" if close else ""


def unknown(environ: Mapping[str, str], known: Collection[str]) -> list[str]:
    """The names in ``environ`` that start with "ampguard" in any case and are not in ``known``."""
    return sorted(name for name in environ if name.upper().startswith("AMPGUARD") and name not in known)


def warning(name: str, known: Collection[str]) -> str:
    """What the warning about ``name`` says (not its value, which may be anything, a token included)."""
    message = f"{name} is not an ampguard variable; ampguard ignores it."
    suggestion = _suggest_variable(name, known)
    if suggestion:
        return f"{message} {suggestion}"
    return f"{message} `ampguard doctor` lists the known ones (docs/configuration.md describes them)."


_warned: set[str] = set()  # once per name and process, however often the environment is read


def warn_unknown(environ: Mapping[str, str], known: Collection[str]) -> None:
    for name in unknown(environ, known):
        if name not in _warned:
            _warned.add(name)
            logger.warning(warning(name, known))
