"""The 2-rank launchers run a job once more only when a rank aborted at interpreter exit, never otherwise;
ranks started directly get torchrun's environment, and a failed rank stops the job."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from torchrun_support import EXIT_ABORT, run_ranks, run_torchrun

# Fails (as a rank would) on its first `failures` runs, counting runs in a file; prints `message` when it fails.
# Started as 2 ranks, rank 0 does nothing: rank 1 alone counts and fails.
JOB = """
import os, sys
from pathlib import Path
if os.environ.get("RANK") == "0":
    sys.exit(0)
runs = Path(sys.argv[1]); failures, message = int(sys.argv[2]), sys.argv[3]
count = int(runs.read_text()) + 1 if runs.exists() else 1
runs.write_text(str(count))
if count <= failures:
    sys.stderr.write(message + "\\n")
    sys.exit(1)
"""


def _run(tmp_path: Path, failures: int, message: str, launcher: str) -> tuple[int, int]:
    runs = tmp_path / "runs"
    entry = ["-c", JOB, str(runs), str(failures), message]
    if launcher == "run_torchrun":  # (the command stands for a torchrun command: the retry is what is tested)
        returncode = run_torchrun([sys.executable, *entry], cwd=tmp_path, env={}, timeout=60).returncode
    else:
        returncode = run_ranks(entry, cwd=tmp_path, env={}, timeout=60).returncode
    return returncode, int(runs.read_text())


LAUNCHERS = pytest.mark.parametrize("launcher", ["run_torchrun", "run_ranks"])


@LAUNCHERS
def test_an_abort_at_exit_is_run_again_once_with_a_warning(tmp_path: Path, launcher: str) -> None:
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert _run(tmp_path, failures=1, message=EXIT_ABORT, launcher=launcher) == (0, 2)


@LAUNCHERS
def test_two_aborts_in_a_row_fail(tmp_path: Path, launcher: str) -> None:
    with pytest.warns(UserWarning, match="aborted at exit"):
        assert _run(tmp_path, failures=2, message=EXIT_ABORT, launcher=launcher) == (1, 2)


@LAUNCHERS
def test_any_other_failure_is_not_run_again(tmp_path: Path, launcher: str) -> None:
    assert _run(tmp_path, failures=1, message="AssertionError: ranks disagree", launcher=launcher) == (1, 1)


ENVIRONMENT = """
import os
names = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT TORCHELASTIC_USE_AGENT_STORE T_EXTRA"
print(" ".join(f"{name}={os.environ.get(name)}" for name in names.split()))
"""


def test_ranks_get_torchruns_environment_and_their_own_output(tmp_path: Path) -> None:
    """What torch.distributed's env:// rendezvous and ampguard's rank-0-only logging read; no agent store."""
    result = run_ranks(["-c", ENVIRONMENT], cwd=tmp_path, env={"T_EXTRA": "kept"}, timeout=60)
    assert result.returncode == 0, result.output
    lines = [stdout.split() for stdout in result.stdout]
    port = lines[0][5]
    assert port != "MASTER_PORT=None" and lines[1][5] == port  # one port, the same for both ranks
    for rank, line in enumerate(lines):
        assert line[:5] == [
            f"RANK={rank}",
            f"LOCAL_RANK={rank}",
            "WORLD_SIZE=2",
            "LOCAL_WORLD_SIZE=2",
            "MASTER_ADDR=127.0.0.1",
        ]
        assert line[6:] == ["TORCHELASTIC_USE_AGENT_STORE=None", "T_EXTRA=kept"]


def test_a_failed_rank_stops_the_other_and_the_job_fails(tmp_path: Path) -> None:
    """Rank 1 fails while rank 0 waits (as in a collective rank 1 will not join): the job ends at once, failed."""
    waits = "import os, sys, time; time.sleep(60) if os.environ['RANK'] == '0' else sys.exit(3)"
    started = time.monotonic()
    result = run_ranks(["-c", waits], cwd=tmp_path, env={}, timeout=50)
    assert result.returncode == 3 and time.monotonic() - started < 30, result.output


def test_a_job_past_its_timeout_is_stopped_and_fails(tmp_path: Path) -> None:
    started = time.monotonic()
    result = run_ranks(["-c", "import time; time.sleep(60)"], cwd=tmp_path, env={}, timeout=1)
    assert result.returncode == 124 and time.monotonic() - started < 30
    assert "stopped every rank after 1 s" in result.stderr[0]
