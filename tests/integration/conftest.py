"""Fixtures of the integration tests; the helpers are in ``integration_support``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# The helper modules next to this file (integration_support, coqui_tiny) import by name under
# any --import-mode, and in the subprocesses that put this folder on sys.path.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import integration_support  # noqa: F401  (sets the offline environment before any library import)


@pytest.fixture
def ci_line(request: pytest.FixtureRequest) -> Callable[[str, int, int], str]:
    """``ci_line(client, skipped, steps)`` writes ``ampguard-integration <client>: skipped=<n> steps=<m>``.

    It goes to the real stderr with pytest's capture suspended, so the line
    is in the CI log with or without ``-s``.
    """

    def emit(client: str, skipped: int, steps: int) -> str:
        line = f"ampguard-integration {client}: skipped={skipped} steps={steps}"
        capture = request.config.pluginmanager.getplugin("capturemanager")
        suspended = capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext()
        with suspended:
            stream = sys.__stderr__ or sys.stderr
            stream.write("\n" + line + "\n")
            stream.flush()
        return line

    return emit
