"""The HF Trainer with a DeepSpeed config (fp16, ZeRO 2): DeepSpeed's "Exiting run" against ampguard, one process.

tests/deepspeed_fp16/hf_deepspeed_run.py trains a model whose block overflows float16 on every call: with plain
DeepSpeed the Trainer dies; under ampguard it trains to the end, its skips counted as the engine counts them, and
the Trainer's ``log_history`` carries ampguard's numbers (docs/trainer-logs.md, docs/deepspeed.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from deepspeed_environment import environment

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("transformers") is None,
    reason="needs deepspeed and transformers",
)

STEPS = 24
SCRIPT = Path(__file__).with_name("hf_deepspeed_run.py")


def test_the_hf_trainer_with_deepspeed_fp16_trains_through_what_kills_it_without_ampguard(tmp_path):
    env = environment()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(STEPS), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    plain, guarded = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"died"')]
    assert plain["died"] == (
        "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
    )
    assert guarded["died"] is None
    assert guarded["engine_skipped"] == guarded["ampguard"]["skipped"] == guarded["ampguard"]["steps"] == STEPS
    assert guarded["ampguard"]["max_scale_seen"] == 1024  # the safe start, through accelerate's DeepSpeed plugin
    logged = [entry for entry in guarded["log_history"] if "loss" in entry]
    assert [(e["step"], e["ampguard/skipped"], e["ampguard/skipped_total"]) for e in logged] == [
        (8, 8.0, 8.0),
        (16, 8.0, 16.0),
        (24, 8.0, 24.0),
    ]
    # a loss itself inf/NaN does not lower the scale (as under a SafeGradScaler); the steps whose loss was finite
    # and gradients not do, after DeepSpeed's hysteresis (2)
    gradient_overflows = guarded["ampguard"]["skipped"] - guarded["ampguard"]["nonfinite_loss"]
    assert guarded["ampguard"]["nonfinite_loss"] > STEPS // 2
    assert (
        logged[-1]["ampguard/loss_scale"] == guarded["ampguard"]["scale"] == 1024 / 2 ** max(gradient_overflows - 1, 0)
    )
    assert not any(key.startswith("ampguard/") for entry in plain["log_history"] for key in entry)
