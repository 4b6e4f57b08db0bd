"""``import ampguard`` after an import that raised ConfigError (the variable since fixed), and who counts as the command (found by review).

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

CODE = """
import os
try:
    import ampguard
except ValueError:
    pass
del os.environ["AMPGUARD_INIT_SCALE"]  # the user fixes the variable and imports again (a notebook)
import ampguard
import ampguard.scaler
import ampguard.stats
print(ampguard.scaler.SafeGradScaler.__name__, type(ampguard.stats.process_counters).__name__)
"""


def test_submodules_are_attributes_after_a_failed_import_is_retried():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    environ |= {"AMPGUARD_QUIET": "1", "AMPGUARD_INIT_SCALE": "abc", "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", CODE], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("SafeGradScaler "), done.stdout


def test_a_script_given_the_arguments_dash_m_ampguard_still_gets_the_config_error(tmp_path):
    """``python train.py -m ampguard`` (the script's own option) is not ``python -m ampguard``.

    ampguard/__init__ takes any "-m ampguard" in sys.orig_argv for the command, which reports a bad
    variable itself: the script's import then neither raises nor installs, and it trains on stock torch
    without a word ("never a silent fallback"). Without the two arguments the same script stops.
    """
    script = tmp_path / "train.py"
    script.write_text("import ampguard\nprint('trained, installed:', ampguard.status()[0].state)\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    environ |= {"AMPGUARD_QUIET": "1", "AMPGUARD_INIT_SCALE": "abc", "PYTHONPATH": ROOT}
    for arguments in ([], ["-m", "ampguard"]):
        done = subprocess.run(
            [sys.executable, str(script), *arguments], env=environ, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 1, (arguments, done.stdout)
        assert "ConfigError: AMPGUARD_INIT_SCALE='abc'" in done.stderr, (arguments, done.stderr)
