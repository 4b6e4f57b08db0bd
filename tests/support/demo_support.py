"""The README's first command, ``python examples/demo.py``: the driver here, its two training runs in their own
processes, what it prints and each run's results kept for the tests."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def demo_module() -> ModuleType:
    """``examples/demo.py``, loaded afresh."""
    spec = importlib.util.spec_from_file_location("ampguard_demo", EXAMPLES / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_demo(**variables: str) -> dict[str, Any]:
    """``VARIABLES... python examples/demo.py`` with its ``main()`` run in this process (it starts the plain and
    the ampguard run as it always does): ``stdout``, its exit status ``code``, and ``plain`` and ``guarded``: each
    run's results by scenario name, and ``results``, ``warnings`` (its FutureWarnings) and ``output`` (the run's
    stdout and stderr as the driver printed them: its section, each line as shown)."""
    demo = demo_module()
    finish = demo.finish
    printed = io.StringIO()
    runs: list[dict[str, Any]] = []

    def finished(title: str, process: Any) -> dict:
        start = printed.tell()
        summary = finish(title, process)
        runs.append(
            {r["scenario"]: r for r in summary["results"]}
            | {"results": summary["results"], "warnings": summary["future_warnings"]}
            | {"output": printed.getvalue()[start:]}
        )
        return summary

    demo.finish = finished  # the driver's own finish(), its return value and what it printed kept
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        for name, value in variables.items():
            patch.setenv(name, value)
        code = demo.main()
    plain, guarded = runs
    return {"stdout": printed.getvalue(), "code": code, "plain": plain, "guarded": guarded}
