"""Files written by ampguard 0.1.0 load and train on exactly as 0.1.0 did (tests/fixtures/make_v0_1_0.py wrote them).

The class paths a pickle names and the keys a checkpoint holds are a promise: moving the code must keep both.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from fixtures.make_v0_1_0 import model_and_optimizer, step

import ampguard

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _continue(model, optimizer, scaler) -> None:
    continued = torch.load(FIXTURES / "continued_v0_1_0.pt", weights_only=True)
    for x, y in continued["batches"]:
        step(model, optimizer, scaler, x, y)
    for name, value in model.state_dict().items():
        assert torch.equal(value, continued["model"][name]), name  # bit for bit: the same run
    assert scaler.get_scale() == continued["scale"]
    stats = scaler.stats.as_dict()
    for key in ("steps", "skipped", "scale", "min_scale_seen", "max_scale_seen"):
        assert stats[key] == continued["stats"][key], key


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_0_1_0_checkpoint_resumes_the_run_bit_for_bit(weights_only):
    checkpoint = torch.load(FIXTURES / "checkpoint_v0_1_0.pt", weights_only=weights_only)
    model, optimizer = model_and_optimizer()
    scaler = torch.amp.GradScaler("cpu")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scaler.load_state_dict(checkpoint["scaler"])
    assert scaler.get_scale() == 512.0 and scaler.stats.skipped == 1
    _continue(model, optimizer, scaler)


def test_a_scaler_pickled_by_0_1_0_unpickles_as_a_safegradscaler_and_trains_on():
    scaler = pickle.loads((FIXTURES / "scaler_v0_1_0.pkl").read_bytes())
    assert isinstance(scaler, ampguard.SafeGradScaler)  # torch.amp.GradScaler under ampguard: names the patched class
    assert scaler.get_scale() == 512.0 and scaler.stats.steps == 3 and scaler.stats.skipped == 1
    checkpoint = torch.load(FIXTURES / "checkpoint_v0_1_0.pt", weights_only=True)
    model, optimizer = model_and_optimizer()
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    _continue(model, optimizer, scaler)
