"""The one-line tally at interpreter exit, rank 0 only, when anything was skipped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _run(extra: str = "", loop: str = SCRIPT, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"} | env
    done = subprocess.run(
        [sys.executable, "-c", loop.format(extra=extra)], capture_output=True, text=True, env=environ, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_short_run_that_skipped_most_steps_ends_with_the_tally():
    lines = [line for line in _run().splitlines() if "run summary" in line]
    assert (
        lines
        == [
            "ampguard: run summary: SafeGradScaler#"
            + lines[0].split("#")[1][:4]
            + ": 7 of 8 steps skipped (87.5%), 0 with a non-finite loss, 0 without gradients, final scale 8."  # 1024 halved 7 times
        ]
    )


def test_a_scaler_collected_before_exit_is_in_the_tally():
    """The training loop lived in a function that returned: its scaler is gone by exit."""
    in_a_function = (
        "def train():\n"
        + "\n".join("    " + line for line in SCRIPT.format(extra="").splitlines())
        + "\ntrain()\nimport gc; gc.collect()\n"
    )
    lines = [
        line
        for line in _run(loop=in_a_function.replace("{", "{{").replace("}", "}}") + "{extra}").splitlines()
        if "run summary" in line
    ]
    assert len(lines) == 1 and ": 7 of 8 steps skipped (87.5%)" in lines[0] and "final scale 8" in lines[0]


def test_the_clip_guard_is_in_the_tally():
    stderr = _run(NO_SCALER)
    summary = [line for line in stderr.splitlines() if "run summary" in line]
    assert len(summary) == 1 and "clip_grad_norm_ without a GradScaler: 3 step(s) skipped" in summary[0]


def test_nothing_skipped_nothing_said():
    healthy = SCRIPT.replace("if step != 5:", "if False:")
    assert "run summary" not in _run(loop=healthy)


@pytest.mark.parametrize("rank", ["1"])
def test_other_ranks_say_nothing(rank):
    assert "run summary" not in _run(RANK=rank)
