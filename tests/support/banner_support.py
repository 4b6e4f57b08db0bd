"""The install banner in the test process, as a fresh interpreter would have it: not shown yet.

The banner is once per process: the suite's own import showed it or not (AMPGUARD_QUIET=1), so a test that
checks when it is shown gives this process a banner not yet shown, installs again under the environment it
sets, and reads the banner records the ``ampguard`` logger passes (its rank filter included).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

import ampguard
from ampguard import registry


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def banners_after_install(
    monkeypatch: pytest.MonkeyPatch, *, held: bool = False, **variables: str
) -> Callable[[], list[str]]:
    """Install again with ``variables`` set, the banner not yet shown (``held``: held, as ``python -m ampguard``
    holds it at import); the returned function gives the banner messages logged since."""
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(registry._registry, "banner_shown", False)
    monkeypatch.setattr(registry._registry, "banner_held", held)
    logger = logging.getLogger("ampguard")
    collected = _Messages()
    monkeypatch.setattr(logger, "handlers", [*logger.handlers, collected])  # the rank filter is the logger's
    ampguard.uninstall()
    ampguard.install()
    return lambda: [message for message in collected.messages if " on torch " in message]
