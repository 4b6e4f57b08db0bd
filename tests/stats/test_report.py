"""``ampguard report``: the summary of a stats file against the scaler that wrote it, the chart, PNG, bad files."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import time

import pytest
from test_stats_file import train

from ampguard.cli import main
from ampguard.stats.file import StatsFileHandler


@pytest.fixture
def written(reinstall, tmp_path):
    """A stats file from a real loop (stats every 5 of 20 steps, 4 skipped) and the scaler's final stats."""
    path = tmp_path / "run.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="5")
    stats = train(20).stats
    return path, stats


def report(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["report", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_numbers_are_the_scalers(written, capsys):
    path, stats = written
    code, out, _ = report(capsys, str(path), "--json")
    assert code == 0
    [run] = json.loads(out)
    [scaler] = run["scalers"]
    assert scaler["steps"] == stats.steps == 20
    assert scaler["skipped"] == stats.skipped == 4
    assert scaler["skipped_percent"] == round(stats.skipped_percent, 2) == 20.0
    assert scaler["nonfinite_loss"] == stats.nonfinite_loss == 1
    assert scaler["final_scale"] == stats.scale
    assert (scaler["scale_min"], scaler["scale_max"]) == (stats.min_scale_seen, stats.max_scale_seen)
    assert run["events"]["skip"] >= 1 and run["pid"] == os.getpid()


def test_text_report_has_the_summary_and_a_chart(written, capsys):
    path, stats = written
    code, out, _ = report(capsys, str(path))
    assert code == 0
    assert f"20 steps, 4 skipped (20.00%), 1 non-finite losses, 0 without gradients; loss scale {stats.scale:g}" in out
    top = math.ceil(math.log2(256))  # the highest scale at a stats line: 1024 halved by the overflows at steps 3 and 4
    assert f"  2^{top} |*" in out  # the first stats line marks the top row
    skip_row = next(line for line in out.splitlines() if line.strip().startswith("skip |"))
    assert [c for c in skip_row.split("|", 1)[1] if c != " "] == ["2", "1", "1", "."]


def test_every_run_of_an_appended_file_and_each_scaler(reinstall, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="5")
    train(10)
    train(15)  # a second scaler in the same process: its steps start again
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="10")  # (re-installing starts another run)
    train(10)
    code, out, _ = report(capsys, str(path), "--json")
    runs = json.loads(out)
    assert code == 0 and [[s["steps"] for s in run["scalers"]] for run in runs] == [[10, 15], [10]]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_png_is_written(written, tmp_path, capsys):
    path, _ = written
    png = tmp_path / "out.png"
    code, out, _ = report(capsys, str(path), "--png", str(png))
    assert code == 0 and f"chart written to {png}" in out
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_png_without_matplotlib_is_one_clear_error(written, tmp_path, capsys):
    path, _ = written
    code, out, err = report(capsys, str(path), "--png", str(tmp_path / "out.png"))
    assert code == 2 and out == ""
    assert (
        err
        == "ampguard report: error: --png needs matplotlib, which is not installed: pip install 'ampguard[report]'\n"
    )


def test_a_truncated_last_line_is_skipped_with_a_warning(written, capsys):
    path, stats = written
    whole = path.read_text().splitlines()
    path.write_text("\n".join(whole[:-1]) + "\n" + whole[-1][: len(whole[-1]) // 2])  # a crash mid-write
    code, out, err = report(capsys, str(path), "--json")
    assert code == 0
    assert (
        err
        == f"ampguard report: warning: {path} line {len(whole)}: incomplete last record (the run stopped while writing it); skipped\n"
    )
    assert json.loads(out)[0]["scalers"][0]["steps"] == stats.steps - 5  # the stats line of step 20 was cut off


@pytest.mark.parametrize(
    "damage, what",
    [
        (lambda line: line[:-1], "not JSON (Expecting ',' delimiter at column"),
        (lambda line: "[1, 2]", "a JSON list, not an object"),
        (lambda line: line.replace('"event": "stats"', '"event": 3'), 'no "event" name'),
        (lambda line: line.replace('"steps": 10', '"steps": "10"'), "stats record with a bad \"steps\" ('10')"),
        (lambda line: line.replace('"scale": ', '"scale_": '), 'stats record with no "scale" (None)'),
    ],
)
def test_a_malformed_line_is_an_error_naming_it(written, capsys, damage, what):
    path, _ = written
    lines = path.read_text().splitlines()
    number = next(i for i, line in enumerate(lines, start=1) if '"steps": 10,' in line)
    lines[number - 1] = damage(lines[number - 1])
    path.write_text("\n".join(lines) + "\n")
    code, out, err = report(capsys, str(path))
    assert code == 2 and out == ""
    assert err.startswith(f"ampguard report: error: {path} line {number}: {what}")


def test_a_cut_off_line_that_is_not_the_last_is_an_error(written, capsys):
    path, _ = written
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:20]
    path.write_text("\n".join(lines) + "\n")
    code, _, err = report(capsys, str(path))
    assert code == 2 and f"{path} line 3: not JSON" in err


def test_a_missing_or_empty_file_is_an_error(tmp_path, capsys):
    code, _, err = report(capsys, str(tmp_path / "none.jsonl"))
    assert code == 2 and err == f"ampguard report: error: {tmp_path / 'none.jsonl'}: No such file or directory\n"
    (tmp_path / "empty.jsonl").write_text("")
    code, _, err = report(capsys, str(tmp_path / "empty.jsonl"))
    assert code == 2 and err == f"ampguard report: error: {tmp_path / 'empty.jsonl'}: no records\n"


def test_report_on_a_file_the_demo_wrote(demo_run, capsys):
    """The demo's ampguard run with AMPGUARD_STATS_FILE: four scenarios, four scalers, the skips and the islands.

    The demo runs in its own process (the stats file is opened at import; tests/conftest.py runs the demo once for
    this test and tests/docs/test_demo.py); the report reads it in this one."""
    path = demo_run["stats_file"]
    code, out, _ = report(capsys, str(path), "--json")
    assert code == 0
    [run] = json.loads(out)
    calibration, storm, no_grad, hot_block = run["scalers"]
    assert calibration["skipped"] == 0
    assert storm["skipped"] == 24 and storm["nonfinite_loss"] == 24 and storm["scale_min"] == storm["scale_max"] == 1024
    assert no_grad["no_grad_steps"] > 0
    assert "blocks.0.linear1" in hot_block["fp32_islands"]
    assert set(hot_block["fp32_islands"]) <= set(run["fp32_islands"])  # (islands are counted per process)
    assert run["events"]["island"] >= 1 and run["events"]["no_grad"] == 1 and "collapse" not in run["events"]
    code, text, _ = report(capsys, str(path))
    assert code == 0 and text.count("loss scale, log2") == 4


def test_a_long_run_fits_the_chart_width(tmp_path, capsys):
    """500 stats lines, the scale halving every 100: 60 columns, the first and last marked, skips summed per column."""
    path = tmp_path / "long.jsonl"
    records = [{"event": "start", "time": 1.0, "format": 1}]
    for index in range(1, 501):
        scale = 2.0 ** (10 - index // 100)
        records.append(
            {
                "event": "stats",
                "time": 1.0 + index,
                "steps": 10 * index,
                "skipped": index // 100,
                "no_grad_steps": 0,
                "nonfinite_loss": 0,
                "scale": scale,
                "min_scale_seen": scale,
                "max_scale_seen": 1024.0,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, _ = report(capsys, str(path))
    rows = [line.split("|", 1)[1] for line in out.splitlines() if "|" in line]
    assert code == 0 and {len(row) for row in rows} == {60}
    assert rows[0].startswith("*") and rows[-2].endswith("*")  # 2^10 at step 10, 2^5 at step 5000
    assert sum(int(c) for c in rows[-1] if c.isdigit()) == 5  # the skip row


def test_the_report_command_itself_writes_nothing_to_the_stats_file(written):
    """AMPGUARD_STATS_FILE still set in the shell: `ampguard report` logs only its banner, so the file is unchanged."""
    path, _ = written
    before = path.read_bytes()
    base = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    subprocess.run(
        [sys.executable, "-m", "ampguard", "report", str(path)],
        env={**base, "AMPGUARD_STATS_FILE": str(path)},
        capture_output=True,
        check=True,
    )
    assert path.read_bytes() == before


def test_a_run_is_dated_by_when_ampguard_was_installed_not_by_its_first_record(tmp_path, capsys):
    """The start record is written with the first record after the banner, maybe hours in: that is not the start."""
    path = tmp_path / "run.jsonl"
    handler = StatsFileHandler(str(path))  # made at install
    an_hour_later = time.time() + 3600
    record = logging.LogRecord("ampguard", logging.WARNING, __file__, 1, "a skip", None, None)
    record.created = an_hour_later
    handler.emit(record)
    handler.close()

    code, out, _ = report(capsys, str(path), "--json")
    [run] = json.loads(out)
    assert code == 0 and run["first_record"] == round(an_hour_later, 3)
    assert an_hour_later - 3600 - 60 < run["installed"] < an_hour_later - 3600 + 60
    code, out, _ = report(capsys, str(path))
    installed = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run["installed"]))
    assert code == 0 and f"run 1: ampguard installed {installed}, pid {os.getpid()}" in out


def test_a_file_without_the_install_time_is_dated_by_its_first_record(tmp_path, capsys):
    path = tmp_path / "old.jsonl"
    path.write_text(
        '{"event": "start", "time": 86400.0, "format": 1, "ampguard": "0.1.0", "pid": 7, "message": null}\n'
    )
    code, out, _ = report(capsys, str(path))
    assert code == 0 and "run 1: first record 1970-01-02 00:00:00 UTC, pid 7" in out


def test_the_measured_underflow_is_charted_and_the_modules_losing_most_named(tmp_path, capsys):
    """Stats lines with underflow_* fields (AMPGUARD_UNDERFLOW): a row of the chart, the summary, the PNG's panel."""
    path = tmp_path / "underflow.jsonl"
    shares = [0.97, 0.45, 0.05, 0.004]
    records: list[dict] = [{"event": "start", "time": 1.0, "format": 1}]
    for index, share in enumerate(shares, start=1):
        records.append(
            {
                "event": "stats",
                "time": 1.0 + index,
                "steps": 10 * index,
                "skipped": 0,
                "no_grad_steps": 0,
                "nonfinite_loss": 0,
                "scale": 1024.0 * 2**index,
                "min_scale_seen": 1024.0,
                "max_scale_seen": 1024.0 * 2**index,
                "underflow_share": share,
                "underflow_samples": index,
                "underflow_growths": index,
                "underflow_modules": [["blocks.1.qkv", share], ["head", share / 2]] if index < 3 else [["head", share]],
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out, _ = report(capsys, str(path), "--json")
    [run] = json.loads(out)
    assert code == 0 and run["scalers"][0]["underflow"] == {
        "samples": 4,
        "growths": 4,
        "last_share": 0.004,
        "max_share": 0.97,
        "modules": [["blocks.1.qkv", 0.97], ["head", 0.485]],
    }
    code, out, _ = report(capsys, str(path))
    row = next(line for line in out.splitlines() if line.strip().startswith("uflow |")).split("|", 1)[1]
    assert [c for c in row if c != " "] == ["9", "4", "0", "."]
    assert "modules losing most: blocks.1.qkv 97.0%, head 48.5%" in out
    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "underflow.png"
        assert report(capsys, str(path), "--png", str(png))[0] == 0 and png.stat().st_size > 0


@pytest.fixture
def watched(reinstall, tmp_path):
    """A stats file from the islands test net with the headroom watch every 5 steps, stats every 10 of 30."""
    from islands_support import make_net
    from islands_support import train as train_net

    path = tmp_path / "watched.jsonl"
    reinstall(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="10", AMPGUARD_WATCH_EVERY="5")
    model = make_net()
    run = train_net(30, model=model, healthy=True)
    return path, run.scaler.stats


def test_the_headroom_the_watch_saw_is_reported_and_charted(watched, capsys):
    path, stats = watched
    assert stats.headroom  # the watch ran and reported its tightest modules
    code, out, _ = report(capsys, str(path), "--json")
    [scaler] = json.loads(out)[0]["scalers"]
    assert scaler["headroom"] == [list(item) for item in stats.headroom]
    closest = scaler["headroom_peak"]
    assert closest["peak"] >= stats.headroom[0][1] and closest["step"] in (10, 20, 30)
    code, out, _ = report(capsys, str(path))
    assert code == 0
    assert f"headroom: the closest to float16's 65,504 any stats line saw was {closest['module']}" in out
    peak_row = next(line for line in out.splitlines() if line.strip().startswith("peak |"))
    assert len([c for c in peak_row.split("|", 1)[1] if c != " "]) == 3  # one mark per stats line


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_png_with_the_headroom_panel_is_written(watched, tmp_path, capsys):
    path, _ = watched
    png = tmp_path / "watched.png"
    code, _, _ = report(capsys, str(path), "--png", str(png))
    assert code == 0 and png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
