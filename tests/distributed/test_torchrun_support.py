"""The torchrun helper runs a job once more only when a rank aborted at interpreter exit, never otherwise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torchrun_support import EXIT_ABORT, run_torchrun

# Fails (as a rank would) on its first `failures` runs, counting runs in a file; prints `message` when it fails.
JOB = """
import sys
from pathlib import Path
runs = Path(sys.argv[1]); failures, message = int(sys.argv[2]), sys.argv[3]
count = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(count))
if count <= failures:
    sys.stderr.write(message + "\\n")
    sys.exit(1)
"""


def _run(tmp_path: Path, failures: int, message: str) -> tuple[int, int]:
    runs = tmp_path / "runs"
    command = [sys.executable, "-c", JOB, str(runs), str(failures), message]
    result = run_torchrun(command, cwd=tmp_path, env={}, timeout=60)
    return result.returncode, int(runs.read_text())


def test_an_abort_at_exit_is_run_again_once_with_a_warning(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert _run(tmp_path, failures=1, message=EXIT_ABORT) == (0, 2)


def test_two_aborts_in_a_row_fail(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert _run(tmp_path, failures=2, message=EXIT_ABORT) == (1, 2)


def test_any_other_failure_is_not_run_again(tmp_path: Path) -> None:
    assert _run(tmp_path, failures=1, message="AssertionError: ranks disagree") == (1, 1)
