"""Starting a 2-rank gloo job from a test: ``python -m torch.distributed.run --standalone --nproc-per-node 2``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

# torch's abort at interpreter exit with gloo (docs/distributed.md, "The SIGABRT"), with or without ampguard.
EXIT_ABORT = "terminate called without an active exception"


def torchrun_command(*entry: str, log_dir: Path | None = None, tee: bool = False) -> list[str]:
    """torchrun on 2 ranks running ``entry`` (a script and its arguments, or ``-m module ...``).

    ``log_dir``: each rank's stdout and stderr go to files there (``--redirects 3``),
    and with ``tee`` to torchrun's own output as well.
    """
    # The agent looks at its workers every 0.1 s, as torch >= 2.4 does by default: torch 2.3's 5 s kept each job
    # running up to 5 s after its ranks had exited.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--monitor-interval", "0.1"]
    if log_dir is not None:
        command += ["--log-dir", str(log_dir), "--redirects", "3", *(["--tee", "3"] if tee else [])]
    return [*command, *entry]


def environment_without_ampguard(**extra: str) -> dict[str, str]:
    """This process's environment less every ``AMPGUARD*`` variable, one torch thread per rank, and ``extra``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    return environment | {"OMP_NUM_THREADS": "1", **extra}


def run_torchrun(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float, log_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command)`` for a torchrun command, once more if a rank aborted at interpreter exit.

    That abort comes after the script's last line, from a gloo thread freeing a
    tensor's Python object while the interpreter shuts down; it happens in plain
    torch too and only now and then (docs/distributed.md). The second run's
    result stands, whatever it is, and the first one's abort is a test warning.
    """
    for attempt in range(2):
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("**/*.log")) if log_dir else ""
        if result.returncode == 0 or attempt == 1 or EXIT_ABORT not in result.stdout + result.stderr + logs:
            break
        warnings.warn(
            f"torchrun: a rank aborted at exit ({EXIT_ABORT!r}, torch's gloo teardown); ran it again", stacklevel=2
        )
    return result
