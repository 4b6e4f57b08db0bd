"""The README's table of CI legs is .ci/run's, and its test counts are what each leg collects.

Each leg's torch pins, extras and pytest arguments are read from .ci/run's arrays; its tests are counted by
``pytest --collect-only -q`` with those arguments, in this interpreter (or, where this session is the leg's whole
command, ``pytest -p no:cacheprovider ARGS`` from the root, by this session's own collection: the same count
without a second one; .ci/run runs each leg as shards, so there the count is a second collection). The README
says "about N" (the suites grow every week): a count more than 10% away from N fails here, with the count to write. A leg is
counted only in an environment that has its extras (the newest leg's integration libraries, the oldest's
matplotlib), so each leg's run of the suite checks its own figure.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11+)")
ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.10
HEADER = "| leg | torch | extras | runs | tests |"


def ci_array(name: str) -> dict[str, str]:
    """.ci/run's associative array ``name``: leg -> value."""
    script = (ROOT / ".ci" / "run").read_text()
    declaration = re.search(rf"^declare -A {name}=\((.*?)\)$", script, re.S | re.M)
    assert declaration, f".ci/run declares no array {name}"
    return dict(re.findall(r'\[(\w+)\]="([^"]*)"', declaration.group(1)))


def readme_legs() -> dict[str, dict[str, str]]:
    """The README's table of CI legs: leg -> {column: cell}."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(HEADER)
    columns = [cell.strip() for cell in HEADER.strip("|").split("|")]
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip().strip("`") for cell in line.strip("|").split("|")]
        table[cells[0]] = dict(zip(columns, cells))
    return table


def about(cell: str) -> int:
    """'about 1,300' -> 1300."""
    found = re.fullmatch(r"about ([\d,]+)", cell)
    assert found, f"a test count is written 'about N', not {cell!r}"
    return int(found.group(1).replace(",", ""))


def missing_extras(leg: str) -> list[str]:
    """The distributions of the leg's extras that this environment lacks."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    missing = []
    for extra in ci_array("extras")[leg].split(","):
        for requirement in extras[extra]:
            name = Requirement(requirement).name
            try:
                metadata.distribution(name)
            except metadata.PackageNotFoundError:
                missing.append(name)
    return missing


# Options of the CI command that leave the set of collected tests as it is.
SAME_COLLECTION = ("-p", "no:cacheprovider", "-q", "-v", "-ra")


def collected_by_this_session(session: pytest.Session, pytest_args: str) -> int | None:
    """This session's collected count where the session is the leg's whole command (``pytest -p no:cacheprovider
    ARGS`` from the root, no PYTEST_ADDOPTS; not one of .ci/run's shards), else None. Nothing else selects tests then, so it
    is what ``pytest --collect-only`` with ``ARGS`` prints."""
    invocation = session.config.invocation_params
    argv = [arg for arg in invocation.args if arg not in SAME_COLLECTION]
    if argv != shlex.split(pytest_args) or Path(invocation.dir).resolve() != ROOT or os.environ.get("PYTEST_ADDOPTS"):
        return None
    return session.testscollected


def collected(pytest_args: str) -> int:
    """How many tests ``pytest --collect-only`` finds with ``pytest_args``, as the leg runs them."""
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}  # "-k scaler" and such
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q"]
    result = subprocess.run(
        [*command, *shlex.split(pytest_args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    summary = re.search(r"^(\d+) tests? collected in ", result.stdout, re.M)
    assert result.returncode == 0 and summary, result.stdout[-3000:] + result.stderr[-3000:]
    return int(summary.group(1))


def test_the_table_names_each_leg_s_pins_extras_and_tests():
    table, requirements = readme_legs(), ci_array("requirements")
    legs = set(requirements)
    assert set(table) == legs == set(ci_array("extras")) == set(ci_array("pytest_args")) >= {"newest", "oldest"}
    for leg, row in table.items():
        pins = dict(re.findall(r"([\w-]+)==([\d.]+)", requirements[leg]))
        assert row["torch"].split()[0] == pins.pop("torch"), leg
        assert all(f"{name} {version}" in row["torch"] for name, version in pins.items()), (leg, row["torch"])
        assert {extra.strip() for extra in row["extras"].split(",")} == set(ci_array("extras")[leg].split(","))
        assert row["runs"] == ci_array("pytest_args")[leg]


@pytest.mark.parametrize("leg", ["newest", "oldest"])
def test_the_table_s_test_count_is_what_the_leg_collects(leg, request):
    missing = missing_extras(leg)
    if missing:
        pytest.skip(f"this environment lacks the {leg} leg's extras ({', '.join(missing)}): that leg counts it")
    arguments = ci_array("pytest_args")[leg]
    count = collected_by_this_session(request.session, arguments)
    if count is None:
        count = collected(arguments)
    stated = about(readme_legs()[leg]["tests"])
    assert abs(count - stated) <= TOLERANCE * stated, (
        f"the {leg} leg collects {count} tests; the README says about {stated:,}: write about {round(count / 50) * 50:,}"
    )


def test_about_reads_the_figure_and_refuses_anything_else():
    assert about("about 1,300") == 1300
    with pytest.raises(AssertionError):
        about("1,300")
