"""The install banner: one line per run, from the main process, and from the CLI only where it concerns the command.

The fresh interpreters show what depends on the process: the banner held by ``python -m ampguard``'s import,
shown once by ``run``, not by spawned workers. Which commands show the held banner is the CLI's choice, checked
in this process with the banner held as that import holds it (banner_support).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from banner_support import banners_after_install
from torchrun_support import environment_without_ampguard

from ampguard import cli

DATALOADER_SCRIPT = """
import ampguard
import torch
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    loader = DataLoader(
        TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1, multiprocessing_context="spawn"
    )
    batches = sum(1 for batch in loader)
    print("batches", batches)
"""


def _run(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=cwd,
        env=environment_without_ampguard(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _banners(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ampguard: ") and " on torch " in line]


def test_one_banner_for_a_run_with_spawned_dataloader_workers(tmp_path: Path) -> None:
    """A worker started with spawn (the default on Windows and macOS) imports ampguard again: 2 imports, 1 banner."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DATALOADER_SCRIPT))

    result = _run([str(script)], tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["batches", "4"]
    assert len(_banners(result)) == 1, result.stderr


def test_no_banner_before_help(tmp_path: Path) -> None:
    """``python -m ampguard --help``: the import holds the banner and the help does not show it."""
    result = _run(["-m", "ampguard", "--help"], tmp_path)

    assert result.returncode == 0, result.stderr
    assert "usage: ampguard" in result.stdout
    assert _banners(result) == [], result.stderr


def _main(argv: list[str]) -> int:
    """``ampguard ARGV``'s exit status (argparse's --help exits)."""
    try:
        return cli.main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


@pytest.mark.parametrize("arguments", [["report", "--help"], ["bench", "--help"], ["run", "--help"]])
def test_no_banner_before_a_commands_help(monkeypatch, capsys, arguments: list[str]) -> None:
    banners = banners_after_install(monkeypatch, held=True, AMPGUARD_QUIET="0")

    assert _main(arguments) == 0
    assert "usage: ampguard" in capsys.readouterr().out
    assert banners() == []


def test_no_banner_before_report(monkeypatch, tmp_path: Path) -> None:
    stats = tmp_path / "stats.jsonl"
    stats.write_text('{"event": "start", "time": 1.0, "format": 1, "ampguard": "0.1.0", "pid": 1, "message": null}\n')
    banners = banners_after_install(monkeypatch, held=True, AMPGUARD_QUIET="0")

    assert _main(["report", str(stats)]) == 0
    assert banners() == []


def test_the_banner_is_shown_once_by_patches(monkeypatch) -> None:
    banners = banners_after_install(monkeypatch, held=True, AMPGUARD_QUIET="0")

    assert _main(["patches"]) == 0
    assert len(banners()) == 1


def test_the_banner_is_shown_once_by_run(tmp_path: Path) -> None:
    """``python -m ampguard run script.py``: shown as the script starts, not again by its ``import ampguard``."""
    script = tmp_path / "script.py"
    script.write_text("import ampguard\nprint('ran')\n")

    ran = _run(["-m", "ampguard", "run", str(script)], tmp_path)

    assert ran.returncode == 0, ran.stderr
    assert len(_banners(ran)) == 1 and ran.stdout == "ran\n", ran.stderr
