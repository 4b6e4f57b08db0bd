"""ampguard's own errors during a check: contained (training went on as torch's), yet each one fails the check.

ampguard never lets its own failure stop a training run
(:mod:`ampguard.containment`): an exception inside one of its hooks is
reported once and torch's behaviour is used for that call; the headroom watch
and the forward-overflow probe stop for good after an error, with one WARNING.
A run goes on, and so would a check, without the feature it checks. While the
checks run, :func:`recorded` therefore

* wraps :func:`ampguard.containment.report`, through which every contained
  error passes (the underflow sampler's included), and records each call, not
  only the first per hook, which alone is logged at WARNING;
* takes every record of logger ``ampguard`` at WARNING and above before any
  handler sees it (the checks skip steps and make islands on purpose: their
  lines are no news to the user) and records those that say a part of
  ampguard stopped after an error (the headroom watch's ``fail``, the probe's).

:func:`apply` turns a check's result into a failure that names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

import ampguard.containment as containment
from ampguard.commands.selftest.result import CheckResult

# What a WARNING of a part of ampguard that stopped after an error says ("... stopped after an error (...)").
STOPPED = "after an error"
SHOWN = 3  # errors named in a check's detail (all of them in its JSON)


@dataclass
class Recorder:
    """The errors recorded so far, in order (``"where: Type: message"``), and the records the log held back."""

    errors: list[str] = field(default_factory=list)
    held_back: int = 0

    def distinct(self) -> list[str]:
        """The errors recorded, each once, in order."""
        return list(dict.fromkeys(self.errors))


class _HoldBack(logging.Filter):
    """On logger ``ampguard``: every record stops here; those of a part that stopped after an error are recorded."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def filter(self, record: logging.LogRecord) -> bool:
        self.recorder.held_back += 1
        # (the format alone is searched: formatting every record's arguments could read the device)
        if getattr(record, "ampguard_event", None) != "contained" and STOPPED in str(record.msg):
            self.recorder.errors.append(_message(record).splitlines()[0].split("; ")[0].rstrip("."))
        return False


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a record whose arguments do not fit its format: its format alone
        return str(record.msg)


def _describe(where: str, error: BaseException) -> str:
    text = str(error).splitlines()[0][:200] if str(error) else ""
    return f"ampguard's {where} failed: {type(error).__name__}" + (f": {text}" if text else "")


@contextlib.contextmanager
def recorded() -> Iterator[Recorder]:
    """Inside: ampguard's log held back (WARNING and above recorded, the rest not even made) and its errors recorded."""
    recorder = Recorder()
    report = containment.report

    def recording_report(where: str, error: BaseException) -> None:
        recorder.errors.append(_describe(where, error))
        report(where, error)

    logger = logging.getLogger("ampguard")
    level, hold_back = logger.level, _HoldBack(recorder)
    containment.report = recording_report
    logger.setLevel(logging.WARNING)
    logger.addFilter(hold_back)
    try:
        yield recorder
    finally:
        logger.removeFilter(hold_back)
        logger.setLevel(level)
        containment.report = report


def apply(result: CheckResult, errors: list[str]) -> CheckResult:
    """``result``, failed when ampguard's own code failed during the check (whatever the check found besides)."""
    if not errors:
        return result
    shown = "; ".join(errors[:SHOWN]) + (f" (and {len(errors) - SHOWN} more)" if len(errors) > SHOWN else "")
    detail = f"ampguard's own error during the check (contained; training went on without it): {shown}"
    if result.detail:
        detail += f". The check itself: {result.status}, {result.detail}"
    return dataclasses.replace(result, status="failed", detail=detail, ampguard_errors=tuple(errors))
