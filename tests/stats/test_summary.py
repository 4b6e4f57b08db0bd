"""The one-line tally at interpreter exit, rank 0 only, when anything was skipped.

One fresh interpreter shows the tally printed at its exit; the other cases check what the exit hook
(:func:`ampguard.stats.summary.log_summary`) logs, called in this process on the loops' own scalers only.
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import weakref
from collections.abc import Callable

import pytest

import ampguard
from ampguard.stats import summary
from ampguard.stats.counters import process_counters

SCRIPT = """
import torch, ampguard
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(8):
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    if step != 5:  # 7 of 8 steps overflow
        model.weight.grad.fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
{extra}
"""

NO_SCALER = """
model.weight.grad = None
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    model.weight.grad.fill_(float("nan"))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # bf16/fp32 training: the guard skips
"""

TALLY = ": 7 of 8 steps skipped (87.5%), 0 with a non-finite loss, 0 without gradients, final scale 8."


def test_a_short_run_that_skipped_most_steps_ends_with_the_tally():
    """In a fresh interpreter: the tally is printed at its exit (7 of the 8 steps overflowed)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(extra="")], capture_output=True, text=True, env=environ, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "run summary" in line]
    # 1024 halved 7 times
    assert lines == ["ampguard: run summary: SafeGradScaler#" + lines[0].split("#")[1][:4] + TALLY]


@pytest.fixture
def at_exit(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Callable[[str], list[str]]:
    """``at_exit(code)``: run ``code`` here as a fresh interpreter would (ampguard's default configuration, nothing
    counted yet), then what the exit hook logs: its records' messages."""
    monkeypatch.setattr(summary, "_scalers", weakref.WeakSet())
    monkeypatch.setattr(summary, "_gone", [])
    monkeypatch.setattr(process_counters, "clip_skipped", 0)
    monkeypatch.delenv("AMPGUARD_UNDERFLOW")  # the suite's setting; the fresh interpreter has the default
    ampguard.uninstall()
    ampguard.install()
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")

    def run(code: str) -> list[str]:
        exec(compile(code, "<tally script>", "exec"), {"__name__": "__main__"})
        gc.collect()
        caplog.clear()
        summary.log_summary()
        return [record.getMessage() for record in caplog.records]

    return run


def test_a_scaler_collected_before_exit_is_in_the_tally(at_exit):
    """The training loop lived in a function that returned: its scaler is gone by exit."""
    in_a_function = (
        "def train():\n" + "\n".join("    " + line for line in SCRIPT.format(extra="").splitlines()) + "\ntrain()\n"
    )
    [line] = at_exit(in_a_function)
    assert line.startswith("run summary: SafeGradScaler#") and line.endswith(TALLY)
    assert not summary._scalers  # the scaler was collected: its line is the one kept at collection


def test_the_clip_guard_is_in_the_tally(at_exit):
    [line] = at_exit(SCRIPT.format(extra=NO_SCALER))
    assert line.endswith("; clip_grad_norm_ without a GradScaler: 3 step(s) skipped for an inf/NaN norm.")
    assert TALLY[:-1] in line  # the scaler's own part, first


def test_nothing_skipped_nothing_said(at_exit):
    healthy = SCRIPT.format(extra="").replace("if step != 5:", "if False:")
    assert at_exit(healthy) == []


def test_other_ranks_say_nothing(at_exit, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert at_exit(SCRIPT.format(extra="")) == []
    monkeypatch.delenv("RANK")
    assert [line.endswith(TALLY) for line in at_exit("")] == [True]  # the same process's tally, on rank 0
