"""``import ampguard`` under a bad variable, in a process of its own: a training script stops with a short
ConfigError traceback; the error is a ConfigError; importing again once the variable is fixed gives a whole package;
and who counts as the command (found by review).

The failed import leaves every ``ampguard.*`` submodule in sys.modules but not the package; the next
``import ampguard`` makes a new package object, and since the submodules are already loaded the import
system never binds them on it: ``import ampguard.scaler; ampguard.scaler`` is an AttributeError, where
for any package that imports cleanly it is the submodule (as it is here without the failed import).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])

# One process: the error the import raises, then the import retried once the user fixed the variables (a notebook).
CODE = """
import os
import sys
try:
    import ampguard
except ValueError as error:
    ConfigError = sys.modules["ampguard.errors"].ConfigError
    print(isinstance(error, ConfigError), [p.variable for p in error.problems])
else:
    print("imported")
del os.environ["AMPGUARD_STATS_EVERY"], os.environ["AMPGUARD_MAX_SCALE"]
import ampguard
import ampguard.scaler
import ampguard.stats
print(ampguard.scaler.SafeGradScaler.__name__, type(ampguard.stats.process_counters).__name__)
"""


def _environ(**variables: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    return environ | {"AMPGUARD_QUIET": "1", "PYTHONPATH": ROOT} | variables


def test_the_error_is_a_config_error_and_a_retried_import_binds_the_submodules():
    environ = _environ(AMPGUARD_STATS_EVERY="often", AMPGUARD_MAX_SCALE="1e39")
    done = subprocess.run([sys.executable, "-c", CODE], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    raised, retried = done.stdout.splitlines()
    assert raised == "True ['AMPGUARD_MAX_SCALE', 'AMPGUARD_STATS_EVERY']", done.stderr  # a ConfigError, every problem
    assert retried.startswith("SafeGradScaler "), done.stdout  # the submodules are attributes of the new package


def _train(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    """``python train.py ARGUMENTS`` for a script whose first line is ``import ampguard``, with a bad variable."""
    script = tmp_path / "train.py"
    script.write_text("import ampguard\nprint('trained, installed:', ampguard.status()[0].state)\n")
    return subprocess.run(
        [sys.executable, str(script), *arguments],
        env=_environ(AMPGUARD_INIT_SCALE="abc"),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_training_script_stops_with_a_short_traceback_ending_with_the_message(tmp_path):
    done = _train(tmp_path)
    assert done.returncode == 1, done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) <= 8, done.stderr
    assert lines[-1] == (
        "ampguard.errors.ConfigError: AMPGUARD_INIT_SCALE='abc' is not valid: accepted values are a finite number "
        "from 1 to 3.4028234663852886e38 (the largest float32: the scale is a float32 tensor)."
    )
    assert "config.py" not in done.stderr and "registry.py" not in done.stderr  # no internals
    assert "During handling" not in done.stderr and "direct cause" not in done.stderr  # nothing chained


def test_a_script_given_the_arguments_dash_m_ampguard_still_gets_the_config_error(tmp_path):
    """``python train.py -m ampguard`` (the script's own option) is not ``python -m ampguard``.

    ampguard/__init__ takes any "-m ampguard" in sys.orig_argv for the command, which reports a bad
    variable itself: the script's import then neither raises nor installs, and it trains on stock torch
    without a word ("never a silent fallback"). Without the two arguments the same script stops (the test above).
    """
    done = _train(tmp_path, "-m", "ampguard")
    assert done.returncode == 1, done.stdout
    assert "ConfigError: AMPGUARD_INIT_SCALE='abc'" in done.stderr, done.stderr
