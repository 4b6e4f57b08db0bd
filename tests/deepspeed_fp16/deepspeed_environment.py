"""The environment the DeepSpeed tests start their training processes in (one rank or two, on this machine)."""

from __future__ import annotations

import os
import socket


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for the process group's rendezvous (MASTER_PORT)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without its AMPGUARD_* settings, quiet, the underflow patch reporting only (the
    suite's setting), warnings off, a free MASTER_PORT, and ``extra`` on top."""
    return {
        **{key: value for key, value in os.environ.items() if not key.startswith("AMPGUARD")},
        "AMPGUARD_QUIET": "1",
        "AMPGUARD_UNDERFLOW": "report",
        "MASTER_PORT": str(free_port()),
        "PYTHONWARNINGS": "ignore",
        **extra,
    }
