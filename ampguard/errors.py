"""The exceptions ampguard defines."""

from __future__ import annotations


class AmpguardError(Exception):
    """Base class of every exception ampguard raises on purpose."""


class ConfigError(AmpguardError, ValueError):
    """An ``AMPGUARD_*`` environment variable holds a value ampguard cannot use.

    The message names the variable, the value and what is accepted. It is the
    only exception that ``import ampguard`` lets escape. With several bad
    variables one ConfigError names them all: :attr:`problems` holds one
    ConfigError per variable (just ``(self,)`` for one), and ``variable``,
    ``value`` and ``accepted`` are the first one's.
    """

    def __init__(self, variable: str, value: str, accepted: str, hint: str = "", *, message: str = "") -> None:
        self.variable = variable
        self.value = value
        self.accepted = accepted
        self.problems: tuple[ConfigError, ...] = (self,)
        message = message or f"{variable}={value!r} is not valid: accepted values are {accepted}."
        if hint:
            message += f" {hint}"
        super().__init__(message)

    @classmethod
    def of_all(cls, problems: list[ConfigError]) -> ConfigError:
        """One error naming every problem in ``problems`` (not empty), one line each."""
        if len(problems) == 1:
            return problems[0]
        first = problems[0]
        lines = [f"{len(problems)} AMPGUARD_* variables are not valid:", *(f"  {problem}" for problem in problems)]
        error = cls(first.variable, first.value, first.accepted, message="\n".join(lines))
        error.problems = tuple(problems)
        return error


class ScaleCollapseError(AmpguardError, RuntimeError):
    """Raised with ``AMPGUARD_ON_STALL=raise`` when too many consecutive steps were skipped."""


class PatchUnavailable(AmpguardError):
    """Raised by a patch's ``apply()`` when it cannot apply here; the reason is reported."""
