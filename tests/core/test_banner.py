"""The install banner: one line per run, from the main process, and from the CLI only where it concerns the command."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torchrun_support import environment_without_ampguard

DATALOADER_SCRIPT = """
import ampguard
import torch
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    loader = DataLoader(
        TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2, multiprocessing_context="spawn"
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
    """2 workers started with spawn (the default on Windows and macOS), each importing ampguard: 3 imports, 1 banner."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(DATALOADER_SCRIPT))

    result = _run([str(script)], tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["batches", "4"]
    assert len(_banners(result)) == 1, result.stderr


@pytest.mark.parametrize("arguments", [["--help"], ["report", "--help"], ["bench", "--help"], ["run", "--help"]])
def test_no_banner_before_help(tmp_path: Path, arguments: list[str]) -> None:
    result = _run(["-m", "ampguard", *arguments], tmp_path)

    assert result.returncode == 0, result.stderr
    assert "usage: ampguard" in result.stdout
    assert _banners(result) == [], result.stderr


def test_no_banner_before_report(tmp_path: Path) -> None:
    stats = tmp_path / "stats.jsonl"
    stats.write_text('{"event": "start", "time": 1.0, "format": 1, "ampguard": "0.1.0", "pid": 1, "message": null}\n')

    result = _run(["-m", "ampguard", "report", str(stats)], tmp_path)

    assert result.returncode == 0, result.stderr
    assert _banners(result) == [], result.stderr


def test_the_banner_is_shown_once_by_patches_and_by_run(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import ampguard\nprint('ran')\n")

    patches = _run(["-m", "ampguard", "patches"], tmp_path)
    ran = _run(["-m", "ampguard", "run", str(script)], tmp_path)

    assert patches.returncode == 0 and ran.returncode == 0, patches.stderr + ran.stderr
    assert len(_banners(patches)) == 1, patches.stderr
    assert len(_banners(ran)) == 1 and ran.stdout == "ran\n", ran.stderr
