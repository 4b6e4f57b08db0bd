"""A bad AMPGUARD_* variable does not lock the user out of the tools that would fix it.

The package's own import under the bad variable must not stop ``python -m ampguard`` (ampguard/__init__.py): one
test starts the command fresh for that. The others run the command's entry point, ampguard.cli.main, in this
process under the bad variable (cli_support). That a training script's ``import ampguard`` still raises is
tests/config/test_import_config_error.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_support import ampguard_cli  # noqa: F401  (a fixture)

from ampguard.commands import doctor

BAD = {"AMPGUARD_STATS_EVERY": "often"}


def test_the_package_import_under_a_bad_variable_does_not_stop_the_command():
    """``python -m ampguard patches``: the import of the package says nothing; the command's one line, exit 2."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"} | BAD
    done = subprocess.run(
        [sys.executable, "-m", "ampguard", "patches"], capture_output=True, text=True, env=environ, timeout=300
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert done.stderr.startswith("ampguard: error: AMPGUARD_STATS_EVERY='often' is not valid")


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("patches", "--help"), ()])
def test_help_and_version_still_work(args, ampguard_cli):
    done = ampguard_cli(*args, env={"AMPGUARD_QUIET": "1"} | BAD)
    assert "Traceback" not in done.stderr
    assert done.returncode == (2 if not args else 0)  # no command: usage, as without a bad variable
    assert "usage: ampguard" in done.stdout or "ampguard 0." in done.stdout


@pytest.mark.parametrize("args", [("patches",), ("bench", "--steps", "5"), ("run", "train.py")])
def test_other_commands_print_one_line_and_exit_2(args, ampguard_cli):
    done = ampguard_cli(*args, env={"AMPGUARD_QUIET": "1"} | BAD)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert done.stderr.startswith("ampguard: error: AMPGUARD_STATS_EVERY='often' is not valid")


def test_doctor_reports_the_bad_variable_as_a_finding(ampguard_cli):
    done = ampguard_cli("doctor", "--json", env={"AMPGUARD_QUIET": "1", "AMPGUARD_MAX_SCALE": "1e39"})
    assert done.returncode == 2 and "Traceback" not in done.stderr  # the report, then exit 2 (docs/doctor.md)
    report = json.loads(done.stdout)
    assert report["config_error"].startswith("AMPGUARD_MAX_SCALE='1e39' is not valid")
    assert report["gpus"] == [] and report["patches"]  # the rest of the report is there
    table = ampguard_cli("doctor", env={"AMPGUARD_QUIET": "1", "AMPGUARD_MAX_SCALE": "1e39"})
    assert table.returncode == 2 and "configuration problem" in table.stdout


def test_doctor_reports_every_bad_variable_and_every_unknown_name(ampguard_cli, capsys):
    bad = {"AMPGUARD_MAX_SCALE": "1e39", "AMPGUARD_FP32_ISLANDS": "off", "ampguard_init_scale": "3"}
    done = ampguard_cli("doctor", "--json", env={"AMPGUARD_QUIET": "1"} | bad)
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


def test_report_needs_no_configuration(tmp_path, ampguard_cli):
    path = tmp_path / "run.jsonl"
    records = [
        {"event": "start", "time": 1.0, "format": 1},
        {"event": "stats", "time": 2.0, "steps": 10, "skipped": 1, "no_grad_steps": 0, "nonfinite_loss": 0}
        | {"scale": 512.0, "min_scale_seen": 512.0, "max_scale_seen": 1024.0},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    bad = {"AMPGUARD_INIT_SCALE": "abc", "AMPGUARD_STATS_EVERY": "often", "AMPGUARD_CHECKOUT": "/src"}
    done = ampguard_cli("report", str(path), "--json", env={"AMPGUARD_QUIET": "1"} | bad)
    assert done.returncode == 0, done.stderr
    [run] = json.loads(done.stdout)
    assert run["scalers"][0]["steps"] == 10 and run["scalers"][0]["skipped"] == 1
