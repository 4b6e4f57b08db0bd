"""The README's first command: the demo shows torch's failures and ampguard training through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ampguard.patch import torch_release

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(*command: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    result = subprocess.run(
        [sys.executable, *command, str(EXAMPLES / "xtts_style_finetune.py"), "--steps", "40"],
        capture_output=True,
        text=True,
        env={**base, **env},
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return {r["scenario"]: r for r in summary["results"]} | {
        "warnings": summary["future_warnings"],
        "stderr": result.stderr,
    }


def test_demo_script_fails_plain_and_trains_through_with_ampguard():
    plain = _run()
    guarded = _run("-m", "ampguard", "run", AMPGUARD_STATS_EVERY="10")

    assert plain["calibration"]["skipped_steps"] > 0  # 65536 overflows first
    assert guarded["calibration"]["skipped_steps"] == 0

    # 24 corrupt batches: torch halves its scale at each, far below 1, where it stays; ampguard skips
    # them and keeps its scale (a non-finite loss says nothing about the loss scale).
    assert plain["storm"]["skipped_steps"] >= 24 and plain["storm"]["final_scale"] < 0.01
    assert guarded["storm"]["skipped_steps"] == 24 and guarded["storm"]["final_scale"] == 1024.0
    assert "forward overflow" in guarded["stderr"] and "the batch itself held inf/NaN" in guarded["stderr"]
    assert "loss scale collapsed" not in guarded["stderr"]

    assert plain["hot_block"]["skipped_steps"] == 40 and plain["hot_block"]["final_scale"] < 1e-6  # every step
    assert guarded["hot_block"]["skipped_steps"] <= 4 and guarded["hot_block"]["final_scale"] >= 1024.0
    assert "fp32 island: blocks.0.linear1 (Linear)" in guarded["stderr"]

    assert plain["no_grad"]["outcome"].startswith("crashed: AssertionError: No inf checks were recorded")
    assert guarded["no_grad"]["outcome"] == "finished"
    assert "got no gradient" in guarded["stderr"]

    assert "stats step=10 " in guarded["stderr"]
    assert guarded["warnings"] == []
    if torch_release() >= torch_release("2.4"):
        assert plain["warnings"]  # torch.cpu.amp.autocast is deprecated from 2.4


def test_demo_driver_prints_the_side_by_side_summary():
    result = subprocess.run([sys.executable, str(EXAMPLES / "demo.py")], capture_output=True, text=True, check=True)
    summary = result.stdout.split("===== summary")[1]
    assert "crashed (AssertionError)" in summary
    assert "with ampguard" in summary and "FutureWarnings" in summary
