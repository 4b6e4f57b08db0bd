"""fp32 masters (issue 20): a copy of two optimizers sharing a parameter.

The originals step one float32 copy of the shared memory, so both updates are
kept; a ``copy.deepcopy`` or pickle of the model with both optimizers must go
on doing that, as torch's copy (one Parameter in both optimizers) does.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from master_events_support import Run, assert_like, model_of, sgd
from scaler_support import one_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_two_optimizers_sharing_a_parameter_keeps_both_updates(how):
    copies = []
    for dtype in (torch.float16, torch.float32):
        model = model_of(dtype)
        optimizers = [sgd(model.parameters()), sgd(list(model.parameters())[:2])]
        run = Run(model, optimizers, dtype)
        run.steps(3)
        pair = (model, optimizers)
        model, optimizers = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
        copied = Run(model, optimizers, dtype, run.step)
        copied.steps(3)
        copies.append(copied)
    assert_like(*copies)
