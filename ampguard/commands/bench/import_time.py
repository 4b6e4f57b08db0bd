"""What ``import ampguard`` adds to ``import torch``, in fresh interpreters, off and on a terminal."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

# Wall-clock time, and the process's CPU time, which other processes on a busy machine do not stretch.
_IMPORT_PROBE = """
import json, time
started = time.perf_counter()
import torch
after_torch, cpu_before = time.perf_counter(), time.process_time()
import ampguard
done, cpu_done = time.perf_counter(), time.process_time()
print(json.dumps([after_torch - started, done - after_torch, cpu_done - cpu_before]))
"""


def _import_probe(environment: dict[str, str], terminal: bool) -> tuple[float, float, float]:
    """One fresh interpreter: seconds for ``import torch``, then for ``import ampguard`` (wall and CPU time).

    ``terminal``: its stderr is a pseudo-terminal, as for a person running a
    script (ampguard's log handler is then rich's).
    """
    command = [sys.executable, "-c", _IMPORT_PROBE]
    if terminal:
        import pty

        leader, follower = pty.openpty()
        try:
            completed = subprocess.run(
                command, env=environment, stdout=subprocess.PIPE, stderr=follower, check=True, text=True
            )
        finally:
            os.close(follower)
            os.close(leader)
    else:
        completed = subprocess.run(command, env=environment, capture_output=True, check=True, text=True)
    torch_seconds, ampguard_seconds, ampguard_cpu_seconds = json.loads(completed.stdout.strip().splitlines()[-1])
    return torch_seconds, ampguard_seconds, ampguard_cpu_seconds


def time_import(runs: int) -> dict[str, Any]:
    """Median over ``runs`` fresh interpreters of what ``import ampguard`` adds to ``import torch``.

    Bytecode caching is allowed (as users have it, even when this process runs
    with PYTHONDONTWRITEBYTECODE): one discarded run first writes the ``.pyc``.
    """
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    terminal = hasattr(os, "openpty") and sys.platform != "win32"
    _import_probe(environment, terminal=False)
    plain = [_import_probe(environment, terminal=False) for _ in range(runs)]
    on_terminal = [_import_probe(environment, terminal=True) for _ in range(runs)] if terminal else []
    return {
        "runs": runs,
        "bytecode_cache": True,
        "torch_ms": statistics.median(t for t, _, _ in plain) * 1e3,
        "ampguard_ms": statistics.median(a for _, a, _ in plain) * 1e3,
        "ampguard_ms_min": min(a for _, a, _ in plain) * 1e3,
        "ampguard_ms_max": max(a for _, a, _ in plain) * 1e3,
        "ampguard_cpu_ms": statistics.median(c for _, _, c in plain) * 1e3,
        "ampguard_terminal_ms": statistics.median(a for _, a, _ in on_terminal) * 1e3 if on_terminal else None,
        "ampguard_terminal_cpu_ms": statistics.median(c for _, _, c in on_terminal) * 1e3 if on_terminal else None,
    }
