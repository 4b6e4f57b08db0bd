"""The client examples under examples/ run on CPU, end to end, and report the skips they caused.

Each example ends with a JSON summary line; the test checks that the library
built (or was handed) a SafeGradScaler, that both simulated overflows were
skipped and counted, and prints the CI line for it. Each example runs in its own
interpreter, as a user runs it (``import ampguard`` is its first line).
"""

from __future__ import annotations

import json

import pytest
from integration_support import REPO, assert_ran, require, run_python

pytestmark = pytest.mark.integration

EXAMPLES = [
    # (script, library it needs, expected summary fields)
    ("coqui_trainer_style.py", "trainer", {"skipped": 2, "steps": 16, "lr_scheduler_steps": 14}),
    ("hf_trainer_tiny.py", "transformers", {"skipped": 2, "steps": 12, "global_step": 12, "lr_scheduler_steps": 10}),
    ("lightning_tiny.py", "lightning", {"skipped": 2, "steps": 20, "global_step": 20}),
]


@pytest.mark.parametrize(("script", "library", "expected"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs_and_reports_its_skipped_steps(script, library, expected, tmp_path, ci_line):
    require(library)
    output = "--output-path" if script.startswith("coqui") else "--output-dir"
    result = run_python([str(REPO / "examples" / script), output, str(tmp_path)], cwd=tmp_path, timeout=180)
    assert_ran(result)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["scaler"] == "SafeGradScaler"
    assert {key: summary[key] for key in expected} == expected
    assert f"{summary['skipped']} of {summary['steps']} optimizer steps skipped" in result.stdout
    ci_line(f"example/{summary['client']}", summary["skipped"], summary["steps"])
