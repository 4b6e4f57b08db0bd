"""Test fixtures.

``import ampguard`` installs its patches, so the whole test process runs with
ampguard installed in its default configuration; a test that needs stock torch
or another configuration uses the fixtures below, and every test ends with the
default installation back in place.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path
from typing import Any

# The shared helpers (scaler_support, islands_support, ...) live in tests/support/ and are imported by name from
# every folder of tests/ (the folders have no __init__.py: pytest puts each test file's own folder on sys.path).
SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

os.environ["AMPGUARD_QUIET"] = "1"
for _variable in [
    v for v in os.environ if v.startswith("AMPGUARD") and v not in ("AMPGUARD_QUIET", "AMPGUARD_DIFFERENTIAL_EXAMPLES")
]:
    del os.environ[_variable]
# The suite compares against torch's own loss-scale schedule; the underflow policy's default, adapt, departs from
# it by design where gradients underflow (tiny test models often do). Its tests (tests/underflow/) set
# adapt themselves; everything else measures without acting (docs/underflow.md).
os.environ["AMPGUARD_UNDERFLOW"] = "report"
# One intra-op thread, here and in the subprocesses the tests start: on a machine as small as CI's (2 cores, the two
# legs side by side), torch's thread pool spin-waits for threads that have no core, and a test of small ops ran up
# to ten times slower with 2 threads than with 1. The variable also keeps a library from picking another count
# (Lightning sets torch's to the cores per process when OMP_NUM_THREADS is unset).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import ampguard  # noqa: E402
import ampguard.config  # noqa: E402
import ampguard.registry  # noqa: E402

torch.set_num_threads(1)

# What torch, pytest and ampguard made at import lives for the whole run: out of the garbage collector's passes, so
# that a collection (the islands' tests collect before each) and ampguard's scans of live objects (the model tree
# above an island, copies of its hooks at uninstall) go over the tests' objects only. Nothing a test makes is frozen.
gc.freeze()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The libraries the test modules imported (the trainer libraries: a quarter of a million objects) frozen too."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are collected everywhere and skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _default_installation(monkeypatch: pytest.MonkeyPatch):
    yield
    monkeypatch.undo()
    default = ampguard.config.load(patch_names=ampguard.registry.patch_names())
    if not ampguard.registry.is_installed() or ampguard.registry._registry.config != default:
        ampguard.uninstall()
        ampguard.install()


@pytest.fixture(autouse=True)
def _one_thread_kept():
    """A test (or a library it runs) that sets another intra-op thread count leaves the next test the one thread."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _compiled_graphs_forgotten():
    """Each test starts as a process that compiled nothing: on torch < 2.4 the headroom watch steps aside for good
    once dynamo has compiled a graph in the process (docs/islands.md), which one test's compile must not decide for
    the next; and dynamo's caches (per code object, ``nn.Module._call_impl`` among them, up to its recompile limit)
    must not fill with another test's graphs, so a test that counts graphs or compiled runs counts its own."""
    yield
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None and utils.counters["stats"].pop("unique_graphs", None):
        torch._dynamo.reset()


@pytest.fixture
def stock_torch():
    """torch exactly as without ampguard, for the length of the test."""
    ampguard.uninstall()
    yield
    ampguard.install()


@pytest.fixture
def reinstall(monkeypatch: pytest.MonkeyPatch):
    """``reinstall(AMPGUARD_X="1", ...)``: install again with these environment variables."""

    def _reinstall(**variables: str) -> list[ampguard.PatchStatus]:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        ampguard.uninstall()
        return ampguard.install()

    return _reinstall


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``AMPGUARD_STATS_FILE=demo.jsonl AMPGUARD_STATS_EVERY=10 python examples/demo.py`` (as docs/stats-file.md
    suggests; its ampguard run writes the stats file, ``stats_file``), run once for the demo's tests and the report
    of its file (tests/support/demo_support.py)."""
    from demo_support import run_demo

    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    return run_demo(AMPGUARD_STATS_FILE=str(path), AMPGUARD_STATS_EVERY="10") | {"stats_file": path}
