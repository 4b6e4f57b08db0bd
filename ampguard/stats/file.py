"""``AMPGUARD_STATS_FILE``: ampguard's records as JSON lines, for ``ampguard report`` and your own tools.

A :class:`StatsFileHandler` on logger ``ampguard`` turns each record into one
JSON object on one line, appended to the file and flushed at once, so a run that
crashes loses nothing it logged. Only rank 0 writes. Stats lines carry their
numbers (``extra={STATS_KEY: ScalerStats}`` from :func:`ampguard.stats.counters.log_stats`);
every other INFO/WARNING/CRITICAL record becomes an event of the kind it was
logged as (``extra=ampguard.log.event(kind)``, :func:`event_kind`), never of the
file it came from, so moving code does not change the format. The file is opened on the first record
after the install banner, whose text becomes the run's ``start`` record, so a
process that logs nothing (``ampguard report`` itself) writes nothing.
The format is documented in docs/stats-file.md.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import IO, Any

from ampguard.log import EVENT_KEY, is_rank_zero, logger
from ampguard.stats.counters import ScalerStats, process_counters

FORMAT_VERSION = 1
STATS_KEY = "ampguard_stats"
INTERVAL_KEY = "ampguard_skipped_in_interval"


def event_kind(record: logging.LogRecord) -> str:
    """The kind the record was logged as (``extra=event(kind)``): skip, collapse, stall, no_grad, island,
    buffers, masters, summary, contained; "message" for the rest."""
    kind = getattr(record, EVENT_KEY, None)
    return kind if isinstance(kind, str) else "message"


def record_as_dict(record: logging.LogRecord) -> dict[str, Any]:
    """The JSON object one record becomes."""
    stats = getattr(record, STATS_KEY, None)
    if isinstance(stats, ScalerStats):
        return {
            "event": "stats",
            "time": round(record.created, 3),
            **stats.as_dict(),
            "skipped_in_interval": getattr(record, INTERVAL_KEY, None),
            "clip_skipped": process_counters.clip_skipped,
        }
    message = record.getMessage()
    return {
        "event": event_kind(record),
        "level": record.levelname,
        "time": round(record.created, 3),
        "message": message,
    }


def _is_banner(record: logging.LogRecord) -> bool:
    return getattr(record, EVENT_KEY, None) == "start"


class StatsFileHandler(logging.Handler):
    """Appends one JSON line per record to ``path`` (rank 0 only), flushing after each."""

    def __init__(self, path: str) -> None:
        super().__init__(logging.INFO)
        self.path = path
        self._stream: IO[str] | None = None
        self._banner: str | None = None
        self._installed = time.time()  # made at install (import ampguard): the run's start, not its first record
        self._off = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._off or not is_rank_zero():
            return
        try:
            if self._stream is None and _is_banner(record):
                self._banner = record.getMessage()
                return
            line = json.dumps(record_as_dict(record))
            if self._stream is None:
                self._stream = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the run; closed at exit)
                self._write(json.dumps(self._start_record(record.created)))
            self._write(line)
        except Exception as error:  # never the reason a run dies: one warning, then the file is off
            self._off = True
            logger.warning(
                "ampguard could not write AMPGUARD_STATS_FILE=%s (%s: %s); no more records go there.",
                self.path,
                type(error).__name__,
                error,
            )

    def _write(self, line: str) -> None:
        assert self._stream is not None
        self._stream.write(line + "\n")
        self._stream.flush()

    def _start_record(self, created: float) -> dict[str, Any]:
        from ampguard._version import __version__

        return {
            "event": "start",
            "time": round(created, 3),
            "format": FORMAT_VERSION,
            "ampguard": __version__,
            "pid": os.getpid(),
            "installed": round(self._installed, 3),
            "message": self._banner,
        }

    def close(self) -> None:
        with self.lock:  # type: ignore[union-attr]  # (a Handler's lock exists once it is made)
            self._off = True  # a record after close (logging.shutdown at exit) must not start the file again
            if self._stream is not None:
                self._stream.close()
                self._stream = None
        super().close()


_handler: StatsFileHandler | None = None


def attach(path: str | None) -> None:
    """Write to ``path`` from now on (None: stop writing). Called at install with AMPGUARD_STATS_FILE."""
    global _handler
    if _handler is not None and _handler.path == path:
        return
    if _handler is not None:
        logger.removeHandler(_handler)
        _handler.close()
        _handler = None
    if path is not None:
        _handler = StatsFileHandler(path)
        logger.addHandler(_handler)
