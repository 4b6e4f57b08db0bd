"""ampguard's own code never stops a training run: where it fails, torch's behaviour is used for that call.

ampguard runs inside every training step of code it has never seen, for days,
on many ranks. Each of its hooks on the training path (the scaler's skip check
and bookkeeping, the loss check, the safe clip, ...) wraps ampguard's own work
so that an exception there is :func:`report`\\ ed (one WARNING per hook, the
traceback at DEBUG) and the call goes on as torch would do it.

What passes through unchanged: exceptions raised by torch or by user code that
ampguard calls (an optimizer's ``step``, torch's ``update``: called through
:func:`torch_call`, which marks them), the errors ampguard raises on purpose
(torch's own errors where torch raises them: marked with :func:`intended`;
``ConfigError``, ``ScaleCollapseError``), and ``KeyboardInterrupt``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from ampguard.errors import AmpguardError
from ampguard.log import event_logger

logger = event_logger("contained")

E = TypeVar("E", bound=BaseException)
T = TypeVar("T")

CONTAINED = (
    "ampguard's {where} failed ({error}); torch's behaviour is used instead for this call and training "
    "goes on. This is a bug in ampguard: please report it with the traceback (logged at DEBUG on logger "
    "'ampguard'). Later failures here are logged at DEBUG only."
)

_reported: set[str] = set()


class FromTorch(Exception):
    """Carries an exception raised by torch or user code through an ampguard hook's handler."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def torch_call(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call torch (or user code) from inside a contained region: its exceptions are its own, not ampguard's."""
    try:
        return function(*args, **kwargs)
    except FromTorch:
        raise
    except Exception as error:
        raise FromTorch(error) from None


def intended(error: E) -> E:
    """Mark an exception ampguard raises on purpose (torch's own error, where torch would raise it)."""
    error._ampguard_intended = True  # type: ignore[attr-defined]
    return error


def passes_through(error: BaseException) -> BaseException | None:
    """The exception to re-raise unchanged, or None when ``error`` is a failure of ampguard's own code."""
    if isinstance(error, FromTorch):
        return error.error
    if isinstance(error, AmpguardError) or getattr(error, "_ampguard_intended", False):
        return error
    return None


def report(where: str, error: BaseException) -> None:
    """One WARNING per hook (``where``), the traceback at DEBUG every time."""
    logger.debug("ampguard's %s failed", where, exc_info=error)
    if where in _reported:
        return
    _reported.add(where)
    logger.log(logging.WARNING, CONTAINED.format(where=where, error=f"{type(error).__name__}: {error}"))
