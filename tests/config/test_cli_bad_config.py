"""A bad AMPGUARD_* variable does not lock the user out of the tools that would fix it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ampguard.commands import doctor

BAD = {"AMPGUARD_STATS_EVERY": "often"}


def ampguard_command(*args: str, env: dict[str, str] = BAD) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"} | env
    return subprocess.run(
        [sys.executable, "-m", "ampguard", *args], capture_output=True, text=True, env=environ, timeout=300
    )


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("patches", "--help"), ()])
def test_help_and_version_still_work(args):
    done = ampguard_command(*args)
    assert "Traceback" not in done.stderr
    assert done.returncode == (2 if not args else 0)  # no command: usage, as without a bad variable
    assert "usage: ampguard" in done.stdout or "ampguard 0." in done.stdout


@pytest.mark.parametrize("args", [("patches",), ("bench", "--steps", "5"), ("run", "train.py")])
def test_other_commands_print_one_line_and_exit_2(args):
    done = ampguard_command(*args)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert done.stderr.startswith("ampguard: error: AMPGUARD_STATS_EVERY='often' is not valid")


def test_doctor_reports_the_bad_variable_as_a_finding():
    done = ampguard_command("doctor", "--json", env={"AMPGUARD_MAX_SCALE": "1e39"})
    assert done.returncode == 2 and "Traceback" not in done.stderr  # the report, then exit 2 (docs/doctor.md)
    report = json.loads(done.stdout)
    assert report["config_error"].startswith("AMPGUARD_MAX_SCALE='1e39' is not valid")
    assert report["gpus"] == [] and report["patches"]  # the rest of the report is there
    table = ampguard_command("doctor", env={"AMPGUARD_MAX_SCALE": "1e39"})
    assert table.returncode == 2 and "configuration problem" in table.stdout


def test_doctor_reports_every_bad_variable_and_every_unknown_name(capsys):
    bad = {"AMPGUARD_MAX_SCALE": "1e39", "AMPGUARD_FP32_ISLANDS": "off", "ampguard_init_scale": "3"}
    done = ampguard_command("doctor", "--json", env=bad)
    assert done.returncode == 2, done.stderr
    report = json.loads(done.stdout)
    assert [problem.split("=")[0] for problem in report["config_problems"]] == [
        "AMPGUARD_MAX_SCALE",
        "AMPGUARD_FP32_ISLANDS",
    ]
    assert all(problem in report["config_error"] for problem in report["config_problems"])
    assert report["config_warnings"] == [
        "ampguard_init_scale is not an ampguard variable; ampguard ignores it. Did you mean AMPGUARD_INIT_SCALE?"
    ]
    doctor.render(report)
    table = capsys.readouterr().out
    assert table.count("configuration problem") == 2 and table.count("configuration warning") == 1


def test_report_needs_no_configuration(tmp_path):
    path = tmp_path / "run.jsonl"
    records = [
        {"event": "start", "time": 1.0, "format": 1},
        {"event": "stats", "time": 2.0, "steps": 10, "skipped": 1, "no_grad_steps": 0, "nonfinite_loss": 0}
        | {"scale": 512.0, "min_scale_seen": 512.0, "max_scale_seen": 1024.0},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    bad = {"AMPGUARD_INIT_SCALE": "abc", "AMPGUARD_STATS_EVERY": "often", "AMPGUARD_CHECKOUT": "/src"}
    done = ampguard_command("report", str(path), "--json", env=bad)
    assert done.returncode == 0, done.stderr
    [run] = json.loads(done.stdout)
    assert run["scalers"][0]["steps"] == 10 and run["scalers"][0]["skipped"] == 1


def test_a_training_script_still_gets_the_config_error():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | BAD
    done = subprocess.run([sys.executable, "-c", "import ampguard"], capture_output=True, text=True, env=environ)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1] == (
        "ampguard.errors.ConfigError: AMPGUARD_STATS_EVERY='often' is not valid: accepted values are a whole number >= 0."
    )
