"""Starting a 2-rank gloo job from a test: ``python -m torch.distributed.run --standalone --nproc-per-node 2``."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def torchrun_command(*entry: str, log_dir: Path | None = None, tee: bool = False) -> list[str]:
    """torchrun on 2 ranks running ``entry`` (a script and its arguments, or ``-m module ...``).

    ``log_dir``: each rank's stdout and stderr go to files there (``--redirects 3``),
    and with ``tee`` to torchrun's own output as well.
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    if log_dir is not None:
        command += ["--log-dir", str(log_dir), "--redirects", "3", *(["--tee", "3"] if tee else [])]
    return [*command, *entry]


def environment_without_ampguard(**extra: str) -> dict[str, str]:
    """This process's environment less every ``AMPGUARD*`` variable, one torch thread per rank, and ``extra``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    return environment | {"OMP_NUM_THREADS": "1", **extra}
