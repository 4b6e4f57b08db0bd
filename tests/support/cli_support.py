"""The ``ampguard`` command run by its entry point in the test process: :func:`ampguard.cli.main`.

``python -m ampguard ARGS`` is ``raise SystemExit(ampguard.cli.main(ARGS))`` (ampguard/__main__.py) once the
package is imported; what depends on that import or on the process's start and end (the import under a bad
variable, the once-per-process banner, the status the shell sees) keeps a test that starts the command fresh.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping

import pytest

import ampguard
import ampguard.config.names as names
import ampguard.log as log
import ampguard.registry as registry
from ampguard import cli
from ampguard.errors import ConfigError

AmpguardCli = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def ampguard_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> AmpguardCli:
    """``ampguard_cli(*args, env={...})``: the status ``ampguard ARGS`` exits with and what it prints, with these
    ``AMPGUARD_*`` variables and no others, installed as the command's import installs (the test's environment and
    installation are restored afterwards: conftest's ``_default_installation``)."""

    def run(*args: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
        for name in [name for name in os.environ if name.upper().startswith("AMPGUARD")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "argv", ["ampguard", *args])
        monkeypatch.setattr(sys, "path", list(sys.path))
        for flag in ("banner_held", "banner_shown"):
            monkeypatch.setattr(registry._registry, flag, getattr(registry._registry, flag))
        # What the command's process writes to stderr includes ampguard's log lines (the import's warnings among
        # them): its handler writes to this test's captured stderr, and the once-per-process warnings fire again.
        monkeypatch.setattr(names, "_warned", set())
        if isinstance(log._default_handler, logging.StreamHandler):
            monkeypatch.setattr(log._default_handler, "stream", sys.stderr)
        # What importing the package does under ``python -m ampguard`` (ampguard/__init__.py): the banner held for
        # the command to show, and a bad variable's ConfigError left to the command (nothing installed).
        ampguard.uninstall()
        registry.hold_banner()
        capsys.readouterr()
        try:
            ampguard.install()
        except ConfigError:
            pass
        try:
            status = cli.main(list(args))
        except SystemExit as exit:  # argparse's --help, --version and usage errors: python's status for each
            status = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["ampguard", *args], status, out, err)

    return run
