"""A bad AMPGUARD_* variable does not lock the user out of the tools that would fix it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

BAD = {"AMPGUARD_FOO": "1"}


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
    assert done.stderr.startswith("ampguard: error: AMPGUARD_FOO is not an ampguard variable")


def test_doctor_reports_the_bad_variable_as_a_finding():
    done = ampguard_command("doctor", "--json", env={"AMPGUARD_MAX_SCALE": "1e39"})
    assert done.returncode == 0 and "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    assert report["config_error"].startswith("AMPGUARD_MAX_SCALE='1e39' is not valid")
    assert report["gpus"] == [] and report["patches"]  # the rest of the report is there
    table = ampguard_command("doctor", env={"AMPGUARD_MAX_SCALE": "1e39"})
    assert table.returncode == 0 and "configuration problem" in table.stdout


def test_a_training_script_still_gets_the_config_error():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | BAD
    done = subprocess.run([sys.executable, "-c", "import ampguard"], capture_output=True, text=True, env=environ)
    assert (
        done.returncode == 1 and "ampguard.errors.ConfigError: AMPGUARD_FOO is not an ampguard variable" in done.stderr
    )
