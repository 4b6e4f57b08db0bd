"""The README's "Tested with" table names exactly the versions CI installs.

The torch (and torchvision) pins are read from .ci/run's requirements, the trainer
libraries' from pyproject.toml's ``integration`` extra, DeepSpeed's from .ci/run's
``after_install``, the demo's torch from the README's own demo command: a pin changed
in one place and not in the table fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11+)")
ROOT = Path(__file__).resolve().parents[2]
VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?")
ROWS_NOT_PINNED = {"Python", "OS", "GPU"}


def readme_table() -> dict[str, str]:
    """First cell -> second cell of the table under the README's "## Tested with" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Tested with\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # after the header and its rule
    cells = [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]
    return {row[0]: row[1] for row in cells}


def ci_requirements() -> dict[str, str]:
    """.ci/run's ``requirements`` array: leg -> what it installs."""
    script = (ROOT / ".ci" / "run").read_text()
    block = script.split("declare -A requirements=(", 1)[1].split("\n)", 1)[0]
    return dict(re.findall(r'\[(\w+)\]="([^"]*)"', block))


def ci_pins(package: str) -> set[str]:
    """The versions of ``package`` that .ci/run's legs install."""
    pattern = rf"(?<![\w-]){re.escape(package)}==([\d.]+)"
    return {pin for requirements in ci_requirements().values() for pin in re.findall(pattern, requirements)}


def ci_after_install() -> dict[str, str]:
    """.ci/run's ``after_install`` array (what a leg installs into its environment once made): package -> pin."""
    script = (ROOT / ".ci" / "run").read_text()
    block = script.split("declare -A after_install=(", 1)[1].split(")\n", 1)[0]
    return dict(re.findall(r"([\w-]+)==([\d.]+)", block))


def integration_pins() -> dict[str, str]:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["integration"]
    return dict(requirement.split("==") for requirement in extra)


def versions(cell: str) -> set[str]:
    return set(VERSION.findall(cell))


def test_torch_rows_name_the_versions_ci_runs():
    table = readme_table()
    assert len(ci_pins("torch")) == len(ci_requirements()) >= 2  # one torch per leg: the parser read .ci/run
    assert versions(table["torch"]) == ci_pins("torch")
    assert versions(table["torchvision"]) == ci_pins("torchvision")


def test_demo_torch_row_names_the_demo_commands_torch():
    readme = (ROOT / "README.md").read_text()
    demo_command = next(line for line in readme.splitlines() if "examples/demo.py" in line and "pip install" in line)
    assert versions(readme_table()["torch (demo)"]) == set(re.findall(r"torch==([\d.]+)", demo_command))


def test_every_integration_pin_has_its_row_and_no_other_library_is_listed():
    table = readme_table()
    pins = integration_pins() | ci_after_install()
    assert "deepspeed" in pins  # the parser read .ci/run
    assert {name: versions(table.get(name, "")) for name in pins} == {name: {pin} for name, pin in pins.items()}
    libraries = set(table) - ROWS_NOT_PINNED - {"torch", "torchvision", "torch (demo)"}
    assert libraries == set(pins)
