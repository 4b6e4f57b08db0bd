"""Rank 0 only: every ampguard record below ERROR from another rank is dropped at the logger, whatever handler listens."""

from __future__ import annotations

import logging

import pytest

from ampguard.log import ANY_RANK, logger


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelno, record.getMessage()))


@pytest.fixture
def users_handler():
    """A handler the user (or a trainer) attached to logger ``ampguard`` itself."""
    handler = _Collect()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


@pytest.mark.parametrize("variable", ["RANK", "LOCAL_RANK"])
def test_other_ranks_records_below_error_never_reach_a_handler(users_handler, monkeypatch, variable):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(variable, "1")
    logger.info("stats step=4")
    logger.warning("step 3 skipped: backward overflow")
    logger.error("ampguard cannot go on")
    assert users_handler.messages == [(logging.ERROR, "ampguard cannot go on")]


def test_a_fact_only_this_rank_knows_passes_once_tagged(users_handler, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    logger.warning("step 6 skipped: forward overflow: the loss itself was inf/NaN", extra=ANY_RANK)
    assert users_handler.messages == [
        (logging.WARNING, "[rank 3] step 6 skipped: forward overflow: the loss itself was inf/NaN")
    ]


def test_rank_zero_logs_as_before(users_handler, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    logger.info("stats step=4")
    logger.warning("a warning", extra=ANY_RANK)
    assert users_handler.messages == [(logging.INFO, "stats step=4"), (logging.WARNING, "a warning")]
