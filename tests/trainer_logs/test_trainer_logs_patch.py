"""Patch ``trainer_logs`` without the trainer libraries: the switch, what import costs, the coqui forwarder, the numbers.

The libraries themselves are driven in tests/integration/test_trainer_logs.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ampguard
from ampguard.log import logger
from ampguard.stats.counters import ScalerStats
from ampguard.trainer_logs import attach as integrations
from ampguard.trainer_logs.coqui import TRAINER_LOGGER, ToTrainerLogFiles

TRAINER_LIBRARIES = ("trainer", "transformers", "accelerate", "lightning", "pytorch_lightning")


def _status(name: str) -> ampguard.PatchStatus:
    return next(s for s in ampguard.status() if s.name == name)


def test_on_by_default_and_off_with_ampguard_disable(reinstall):
    assert _status("trainer_logs").state == "applied" and integrations.active()
    reinstall(AMPGUARD_DISABLE="trainer_logs")
    assert (_status("trainer_logs").state, _status("trainer_logs").reason) == ("disabled", "AMPGUARD_DISABLE")
    assert not integrations.active() and integrations.attached() == []
    assert not [h for h in logger.handlers if isinstance(h, ToTrainerLogFiles)]


def test_import_ampguard_imports_no_trainer_library():
    code = f"import sys, ampguard; print(sorted(m for m in sys.modules if m.split('.')[0] in {TRAINER_LIBRARIES!r}))"
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")},
        "AMPGUARD_QUIET": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.fixture
def coqui_logging(tmp_path, monkeypatch):
    """Logger ``trainer`` as coqui's Trainer.__init__ leaves it: a console handler and a FileHandler with format ''."""
    trainer_logger = logging.getLogger(TRAINER_LOGGER)
    file_handler = logging.FileHandler(tmp_path / "trainer_0_log.txt", mode="a")
    file_handler.setFormatter(logging.Formatter(""))
    console = logging.StreamHandler()
    console_records: list[logging.LogRecord] = []
    console.emit = console_records.append  # type: ignore[method-assign]
    monkeypatch.setattr(trainer_logger, "handlers", [console, file_handler])
    # Only this test's forwarder: the real coqui trainer imported by an earlier test (tests/integration) leaves
    # the patch's own forwarder attached, which would write every line twice.
    monkeypatch.setattr(logger, "handlers", [h for h in logger.handlers if not isinstance(h, ToTrainerLogFiles)])
    forwarder = ToTrainerLogFiles()
    logger.addHandler(forwarder)
    yield tmp_path / "trainer_0_log.txt", console_records, file_handler
    logger.removeHandler(forwarder)
    file_handler.close()


def test_ampguard_records_reach_the_trainer_s_log_file_and_not_its_console(coqui_logging, caplog, monkeypatch):
    path, console_records, _ = coqui_logging
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")
    logging.getLogger(TRAINER_LOGGER).info("coqui's own line")  # what coqui writes (its logger level permitting)
    logger.info("stats step=%d scale=%g", 10, 512.0)
    logger.warning("something to look at")
    logger.debug("not for the file")
    lines = path.read_text().splitlines()
    assert lines[-2:] == ["ampguard: stats step=10 scale=512", "ampguard WARNING: something to look at"]
    assert not [r for r in console_records if r.name == "ampguard"]
    assert list(dict.fromkeys(r.getMessage() for r in caplog.records if r.name == "ampguard"))[-2:] == [
        "stats step=10 scale=512",
        "something to look at",  # the original records, unchanged for other handlers
    ]


def test_a_file_handler_s_own_level_is_honoured(coqui_logging):
    path, _, file_handler = coqui_logging
    file_handler.setLevel(logging.WARNING)
    logger.info("stats step=1")
    logger.warning("a warning")
    assert path.read_text().splitlines() == ["ampguard WARNING: a warning"]


def test_a_failing_log_file_costs_one_warning_and_nothing_else(coqui_logging, caplog, monkeypatch):
    _, _, file_handler = coqui_logging

    def broken(record: logging.LogRecord) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(file_handler, "handle", broken)
    monkeypatch.setattr(logger, "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")
    for step in (1, 2, 3):
        logger.info("stats step=%d", step)  # never raises into the caller
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}  # (caplog may see one twice)
    assert warnings == {
        "ampguard could not write to the coqui trainer's log file (OSError: disk full); its lines "
        "stay on the console only from now on."
    }


def _stats(skipped: int, scale: float, islands: tuple[str, ...] = ()) -> ScalerStats:
    return ScalerStats(
        steps=10,
        skipped=skipped,
        no_grad_steps=0,
        nonfinite_loss=1,
        scale=scale,
        min_scale_seen=scale,
        max_scale_seen=1024.0,
        consecutive_skipped=0,
        fp32_islands=islands,
    )


def test_metric_fields_count_skipped_steps_since_the_previous_record():
    fields = integrations.MetricFields()
    assert fields(_stats(2, 256.0)) == {
        "ampguard/loss_scale": 256.0,
        "ampguard/skipped": 2.0,
        "ampguard/skipped_total": 2.0,
        "ampguard/nonfinite_loss": 1.0,
        "ampguard/fp32_islands": 0.0,
    }
    assert fields(_stats(2, 512.0))["ampguard/skipped"] == 0.0
    assert fields(_stats(5, 64.0, ("net.attn",)))["ampguard/skipped"] == 3.0
    assert fields(_stats(1, 64.0))["ampguard/skipped"] == 0.0  # a scaler restored from an older checkpoint
    assert all(isinstance(value, float) for value in fields(_stats(1, 64.0)).values())
