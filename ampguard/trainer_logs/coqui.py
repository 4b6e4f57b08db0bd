"""coqui ``trainer``: ampguard's lines also go to the trainer's log file, ``trainer_<rank>_log.txt``.

coqui's ``Trainer.__init__`` gives logger ``trainer`` a ``logging.FileHandler``
for that file (format ``%(message)s``) and writes its own lines through it.
:class:`ToTrainerLogFiles`, a handler on logger ``ampguard``, hands each
ampguard record of INFO and above (the stats lines, skipped steps, fp32
islands, warnings) to the file handlers logger ``trainer`` has at that moment,
as ``ampguard: <message>``: the lines land between coqui's own, in every file
coqui writes. Logger ``trainer``'s console handler is left alone: ampguard's own
handler already prints there. Other ranks' records stop at logger ``ampguard``
(its rank-0 filter), as on the console.
"""

from __future__ import annotations

import logging
from types import ModuleType

from ampguard.bindings import Bindings
from ampguard.errors import PatchUnavailable
from ampguard.log import _PlainFormatter, logger

TRAINER_LOGGER = "trainer"  # the name coqui's trainer.trainer logs under


class ToTrainerLogFiles(logging.Handler):
    """Forwards ampguard's records to the file handlers of logger ``trainer`` (coqui's log files)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(_PlainFormatter())
        self._off = False

    def emit(self, record: logging.LogRecord) -> None:
        if self._off:
            return
        try:
            files = [h for h in logging.getLogger(TRAINER_LOGGER).handlers if isinstance(h, logging.FileHandler)]
            if not files:
                return
            line = logging.makeLogRecord(record.__dict__)  # a copy: other handlers format the original
            line.msg, line.args, line.exc_info, line.exc_text = self.format(record), None, None, None
            for handler in files:
                if line.levelno >= handler.level:
                    handler.handle(line)
        except Exception as error:  # never the reason a run dies: off after one warning
            self._off = True
            logger.warning(
                "ampguard could not write to the coqui trainer's log file (%s: %s); its lines stay on "
                "the console only from now on.",
                type(error).__name__,
                error,
            )


_handler: ToTrainerLogFiles | None = None


def attach(module: ModuleType, bindings: Bindings) -> None:
    global _handler
    if not isinstance(getattr(module, "Trainer", None), type):
        raise PatchUnavailable(f"{module.__name__} has no Trainer class: not coqui's trainer")
    if _handler is None:
        _handler = ToTrainerLogFiles()
        logger.addHandler(_handler)


def detach() -> None:
    global _handler
    if _handler is not None:
        logger.removeHandler(_handler)
        _handler = None
