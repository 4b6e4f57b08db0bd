"""Logger ``ampguard``, rank awareness and rate limiting.

ampguard never touches the root logger. Like transformers, it gives its own
logger one handler when nobody else has (rich on a terminal, plain text
otherwise) and does not propagate, so a training script that never configured
logging still sees the banner and the stats lines. Attach your own handler to
``logging.getLogger("ampguard")`` beforehand and ampguard adds none.

In a process that is one of several (``RANK`` / ``LOCAL_RANK`` set, as torchrun
does), only rank 0's records below ERROR pass the logger (whoever's handlers are
attached), except a fact only another rank knows, logged with ``extra=ANY_RANK``
and tagged ``[rank N]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, MutableMapping
from typing import Any

logger = logging.getLogger("ampguard")

_default_handler: logging.Handler | None = None
_importing = False  # inside `import ampguard` (see _RichOnFirstRecord)


@contextlib.contextmanager
def during_import() -> Iterator[None]:
    """Records logged inside are the import's own: on a terminal, laid out without importing rich."""
    global _importing
    _importing = True
    try:
        yield
    finally:
        _importing = False


def process_rank() -> int:
    """This process's global rank: torch.distributed when initialised, else RANK / LOCAL_RANK, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except Exception:  # an exotic backend must not break logging
            pass
    for variable in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(variable, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def is_rank_zero() -> bool:
    return process_rank() == 0


# The kind of event a record is (``extra={EVENT_KEY: "island"}``): the stats file's "event" field
# (docs/stats-file.md). Records without one are plain "message" events.
EVENT_KEY = "ampguard_event"


def event(kind: str) -> dict[str, str]:
    """``extra=`` for a record that is an event of ``kind`` (for a module whose records are of several kinds)."""
    return {EVENT_KEY: kind}


class EventLogger(logging.LoggerAdapter):  # type: ignore[type-arg]  # generic only from Python 3.11
    """Logger ``ampguard`` for a module whose records are all one kind of event (:func:`event_logger`)."""

    def process(self, msg: object, kwargs: MutableMapping[str, Any]) -> tuple[object, MutableMapping[str, Any]]:
        assert self.extra is not None
        kwargs["extra"] = {**self.extra, **(kwargs.get("extra") or {})}
        return msg, kwargs


def event_logger(kind: str) -> EventLogger:
    """Logger ``ampguard`` whose records carry the event kind ``kind`` (a call's own ``extra`` may override it)."""
    return EventLogger(logger, event(kind))


def label(obj: object) -> str:
    """How a log line names an optimizer or a scaler: its class and the low bits of its id (``AdamW#1a2b``)."""
    return f"{type(obj).__name__}#{id(obj) & 0xFFFF:04x}"


# ``logger.info(..., extra=ANY_RANK)``: a fact only this rank knows (its own loss was inf/NaN), which
# the other ranks' records cannot say; logged on any rank, tagged with it.
ANY_RANK = {"ampguard_any_rank": True}


class _RankZeroFilter(logging.Filter):
    """On the logger itself, so that no handler (the user's, a trainer's) sees other ranks' records below ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or is_rank_zero():
            return True
        if getattr(record, "ampguard_any_rank", False):
            record.msg = f"[rank {process_rank()}] {record.msg}"
            return True
        return False


logger.addFilter(_RankZeroFilter())


class _PlainFormatter(logging.Formatter):
    """``ampguard: message`` for INFO and below, ``ampguard WARNING: message`` above."""

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno <= logging.INFO else f" {record.levelname}"
        return f"ampguard{level}: {record.getMessage()}"


def _on_terminal(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


_LEVEL_STYLES = {"DEBUG": "32", "INFO": "34", "WARNING": "33", "ERROR": "1;31", "CRITICAL": "1;7;31"}  # rich's
_TIME = "\x1b[2;36m"  # rich's log.time: dim cyan
_RESET = "\x1b[0m"


def _terminal_width(stream: object) -> int:
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return 80


def rich_layout(record: logging.LogRecord, message: str, width: int, previous_time: str | None) -> str:
    """``message`` laid out as rich's ``RichHandler`` lays out a record, without importing rich.

    The same columns and colours: ``[HH:MM:SS]`` (blank when it repeats the
    previous record's), the level padded to 8, the message wrapped at the
    terminal width with its continuation lines under it, every line padded to
    the width. Not rich's highlighting of numbers, paths and brackets.
    """
    import textwrap

    clock = time.strftime("[%X]", time.localtime(record.created))
    shown = " " * len(clock) if clock == previous_time else clock
    level = f"\x1b[{_LEVEL_STYLES.get(record.levelname, '2')}m{record.levelname.ljust(8)}{_RESET}"
    column = max(10, width - len(clock) - 10)
    lines = [
        piece
        for paragraph in message.splitlines() or [""]
        for piece in textwrap.wrap(paragraph, column, break_on_hyphens=False) or [""]
    ]
    first = f"{_TIME}{shown}{_RESET}{_TIME} {_RESET}{level} {lines[0].ljust(column)}"
    rest = [f"{_TIME}{' ' * (len(clock) + 1)}{_RESET}{' ' * 9}{line.ljust(column)}" for line in lines[1:]]
    return "\n".join([first, *rest]) + "\n"


class _RichOnFirstRecord(logging.Handler):
    """rich's ``RichHandler``, made when the first record after ``import ampguard`` is emitted.

    Importing rich and building its console costs tens of milliseconds, and the
    objects it allocates often set off a full garbage collection (about 100 ms
    more at ``import ampguard`` on a terminal, measured in docs/performance.md);
    a process that logs nothing (AMPGUARD_QUIET=1, ranks other than 0) pays none of it.
    The records of ``import ampguard`` itself (the banner) are laid out like
    rich's by :func:`rich_layout`, without rich: the import stays as fast on a
    terminal as off one.
    """

    def __init__(self) -> None:
        super().__init__()
        self._rich: logging.Handler | None = None
        self._previous_time: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if _importing and self._rich is None:
            try:
                message = f"ampguard: {record.getMessage()}"
                stream = sys.stderr
                stream.write(rich_layout(record, message, _terminal_width(stream), self._previous_time))
                stream.flush()
                self._previous_time = time.strftime("[%X]", time.localtime(record.created))
            except Exception:
                self.handleError(record)
            return
        if self._rich is None:
            from rich.console import Console
            from rich.logging import RichHandler

            rich_handler = RichHandler(
                console=Console(stderr=True),  # like the plain handler; rich's default console is stdout
                show_path=False,
                markup=False,
                rich_tracebacks=False,
                log_time_format="[%X]",
            )
            rich_handler.setFormatter(logging.Formatter("ampguard: %(message)s"))
            self._rich = rich_handler
        self._rich.emit(record)


def ensure_default_handler() -> None:
    """Give logger ``ampguard`` a handler unless somebody already did."""
    global _default_handler
    if _default_handler is not None or logger.handlers:
        return
    handler: logging.Handler
    if _on_terminal(sys.stderr):
        handler = _RichOnFirstRecord()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_PlainFormatter())
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False
    _default_handler = handler


class RateLimiter:
    """Lets an event through at most once per ``interval`` seconds (and always the first time)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last: float | None = None
        self.suppressed = 0

    def ready(self) -> bool:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            self._last = now
            return True
        self.suppressed += 1
        return False
