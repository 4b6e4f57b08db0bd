"""AMPGUARD_STATS_FILE: one JSON object per stats line and per notable event, from a real SafeGradScaler loop."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import ampguard
from ampguard.log import event, event_logger, logger
from ampguard.stats.counters import process_counters
from ampguard.stats.file import StatsFileHandler

GRADIENT_OVERFLOWS = (3, 4, 11)  # the loss is finite, its gradients are not: a gradient overflow, the scale halves
FORWARD_OVERFLOW = 7  # the forward pass itself gives inf: a non-finite loss


def train(steps: int, overflow_every_step: bool = False, after_each_step=None, keep=None) -> ampguard.SafeGradScaler:
    """``keep``: a list the model is appended to (its islands live as long as it does)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    if keep is not None:
        keep.append(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    assert isinstance(scaler, ampguard.SafeGradScaler)
    for step in range(1, steps + 1):
        x = torch.randn(8, 16) * (1e6 if step == FORWARD_OVERFLOW else 1.0)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        if overflow_every_step or step in GRADIENT_OVERFLOWS:
            loss = loss / loss.detach() * 1e38  # 1e38 (finite) times the scale overflows float32 in backward
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if after_each_step is not None:
            after_each_step(step)
    return scaler


def read(path: Path) -> list[dict]:
    text = path.read_text()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_stats_lines_and_events_are_json_objects_matching_the_scaler(reinstall, tmp_path):
    path = tmp_path / "run.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="5")
    models: list[nn.Module] = []
    scaler = train(20, keep=models)  # the model lives on: its island ("0", named at step 7) is in both
    records = read(path)

    start = records[0]
    assert start["event"] == "start" and start["format"] == 1 and start["ampguard"] == ampguard.__version__
    stats = [r for r in records if r["event"] == "stats"]
    assert [r["steps"] for r in stats] == [5, 10, 15, 20]
    final = {key: stats[-1][key] for key in scaler.stats.as_dict()}
    assert final == scaler.stats.as_dict()
    assert scaler.stats.skipped == 4 and scaler.stats.nonfinite_loss == 1 and scaler.stats.scale < 1024
    assert sum(r["skipped_in_interval"] for r in stats) == 4
    assert [r["skipped_in_interval"] for r in stats] == [2, 1, 1, 0]
    assert all(r["clip_skipped"] == process_counters.clip_skipped for r in stats)  # (process-wide: earlier tests count)

    skips = [r for r in records if r["event"] == "skip"]
    assert skips and skips[0]["message"].startswith("step 3 skipped")
    assert {r["level"] for r in skips} <= {"INFO", "WARNING"}
    for record in records:
        assert isinstance(record["time"], float)
        if record["event"] not in ("stats", "start"):
            assert set(record) == {"event", "level", "time", "message"}


def test_collapse_and_stall_are_events_of_their_own(reinstall, tmp_path):
    path = tmp_path / "run.jsonl"
    reinstall(
        AMPGUARD_STATS_FILE=str(path),
        AMPGUARD_INIT_SCALE="4",
        AMPGUARD_MAX_CONSECUTIVE_SKIPS="4",
        AMPGUARD_STATS_EVERY="0",
    )
    train(6, overflow_every_step=True)
    kinds = [r["event"] for r in read(path)]
    assert kinds.count("collapse") == 1 and kinds.count("stall") == 1
    assert "stats" not in kinds  # AMPGUARD_STATS_EVERY=0: no stats lines, events only


def test_each_line_is_on_disk_as_soon_as_it_is_logged(reinstall, tmp_path):
    path = tmp_path / "run.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="2")
    seen: dict[int, list[str]] = {}

    def look(step: int) -> None:  # what another process (or a crash right now) would find in the file
        seen[step] = path.read_text().splitlines() if path.exists() else []

    train(4, after_each_step=look)
    assert seen[1] == []  # nothing logged yet: no file
    assert [json.loads(line)["event"] for line in seen[2]] == ["start", "stats"]
    assert json.loads(seen[4][-1])["steps"] == 4


@pytest.mark.parametrize("variable", ["RANK", "LOCAL_RANK"])
def test_other_ranks_write_nothing(reinstall, tmp_path, monkeypatch, variable):
    path = tmp_path / "run.jsonl"
    monkeypatch.setenv(variable, "1")
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="5")
    train(12)
    logger.error("an error passes the rank filter on every rank")
    assert not path.exists()


def test_unset_means_no_handler_and_no_file(reinstall, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reinstall(AMPGUARD_STATS_EVERY="5")
    assert not any(isinstance(h, StatsFileHandler) for h in logger.handlers)
    train(6)
    assert list(tmp_path.iterdir()) == []


def test_appends_across_runs_and_uninstall_detaches(reinstall, tmp_path):
    path = tmp_path / "run.jsonl"
    for _ in range(2):
        reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="10")
        train(10)
    assert [r["event"] for r in read(path) if r["event"] in ("start", "stats")] == ["start", "stats"] * 2
    ampguard.uninstall()
    assert not any(isinstance(h, StatsFileHandler) for h in logger.handlers)


def test_an_unwritable_file_warns_once_and_training_goes_on(reinstall, tmp_path):
    path = tmp_path / "run.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="2")
    path.mkdir()  # made unopenable after the setting was checked
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "AMPGUARD_STATS_FILE" in record.getMessage():
                warnings.append(record.getMessage())

    collect = Collect()
    logger.addHandler(collect)
    try:
        scaler = train(6)
    finally:
        logger.removeHandler(collect)
    assert scaler.stats.steps == 6
    assert len(warnings) == 1 and "IsADirectoryError" in warnings[0]


@pytest.mark.parametrize("value, why", [("missing/run.jsonl", "does not exist"), (".", "is a directory")])
def test_a_path_that_cannot_be_written_is_a_config_error(tmp_path, monkeypatch, value, why):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ampguard.ConfigError, match="AMPGUARD_STATS_FILE") as error:
        ampguard.config.load({"AMPGUARD_STATS_FILE": value})
    assert why in str(error.value)


def test_event_kinds_are_what_the_record_says_not_where_it_was_logged(tmp_path):
    """The kind travels with the record (extra=event(kind)): a file renamed or code moved keeps the format."""
    handler = StatsFileHandler(str(tmp_path / "events.jsonl"))
    logger.addHandler(handler)
    try:
        logger.warning("the banner stands for the start", extra=event("start"))
        logger.warning("an island from the test file", extra=event("island"))
        event_logger("masters").warning("through a module's event logger")
        event_logger("masters").warning("a call's own kind wins", extra=event("skip"))
        logger.warning("no kind at all")
    finally:
        logger.removeHandler(handler)
        handler.close()
    events = [(e["event"], e.get("message")) for e in read(tmp_path / "events.jsonl")]
    assert [kind for kind, _ in events[1:]] == ["island", "masters", "skip", "message"]
    assert events[0][0] == "start" and events[0][1] == "the banner stands for the start"
