"""The exceptions ampguard defines."""

from __future__ import annotations


class AmpguardError(Exception):
    """Base class of every exception ampguard raises on purpose."""


class ConfigError(AmpguardError, ValueError):
    """An ``AMPGUARD_*`` environment variable holds a value ampguard cannot use.

    The message names the variable, the value and what is accepted. It is the
    only exception that ``import ampguard`` lets escape.
    """

    def __init__(self, variable: str, value: str, accepted: str, hint: str = "", *, message: str = "") -> None:
        self.variable = variable
        self.value = value
        self.accepted = accepted
        message = message or f"{variable}={value!r} is not valid: accepted values are {accepted}."
        if hint:
            message += f" {hint}"
        super().__init__(message)


class ScaleCollapseError(AmpguardError, RuntimeError):
    """Raised with ``AMPGUARD_ON_STALL=raise`` when too many consecutive steps were skipped."""


class PatchUnavailable(AmpguardError):
    """Raised by a patch's ``apply()`` when it cannot apply here; the reason is reported."""
