"""The model's inputs kept until their update (ampguard/fp32_islands/model_inputs.py), against plain torch.

The keeper is one forward pre-hook on each model the headroom watch saw. It must
see keyword inputs, keep no more than the last updates' inputs, step aside for a
compiled model, do nothing on a copy of the model (an EMA made with deepcopy),
survive ``torch.save(model)``, and leave with ``ampguard.uninstall()`` from the
model and its copies.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from islands_support import batch, fresh_islands, make_net  # noqa: F401  (fixture)
from scaler_support import ampguard_log, one_thread  # noqa: F401  (fixtures)
from torch import nn
from torch.nn import functional as F

import ampguard
import ampguard.messages as messages
from ampguard.fp32_islands import healing, model_inputs
from ampguard.fp32_islands.model_inputs import KEEP_UPDATES, KeepInputs, ModelInputs

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")


def keepers(model: nn.Module) -> int:
    return sum(isinstance(h, KeepInputs) for m in model.modules() for h in m._forward_pre_hooks.values())


class KeywordNet(nn.Module):
    """An HF-style model: its float features come as a keyword argument only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, *, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)


def train(model: nn.Module, steps: int, bad_step: int | None = None, keyword: bool = False) -> list[int]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    lost = []
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step == bad_step:
            x[1, 2, 3] = float("nan")
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(features=x) if keyword else model(x), y)
        lost += [step] if not torch.isfinite(loss) else []
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return lost


def test_the_watched_model_gets_one_keeper_and_a_nan_in_a_keyword_input_is_the_datas(reinstall, ampguard_log):
    reinstall(AMPGUARD_WATCH_EVERY="1")
    model = KeywordNet()
    assert train(model, 8, bad_step=5, keyword=True) == [5]
    assert keepers(model) == 1 and KeepInputs in map(type, model._forward_pre_hooks.values())
    assert [r.getMessage() for r in ampguard_log.records if "the batch itself" in r.getMessage()] == [
        messages.BAD_BATCH.format(step=6)
    ]


def test_only_the_last_updates_inputs_are_kept():
    inputs = ModelInputs()
    model = nn.Linear(2, 2)
    inputs.follow([model])
    try:
        for update in range(KEEP_UPDATES + 3):
            for _ in range(2):  # two micro-batches per update
                model(torch.full((1, 2), float(update)))
            inputs.end_update()
        kept = [float(p.args[0][0, 0]) for cycle in inputs._cycles for p in cycle]
        assert kept == [float(u) for u in range(3, KEEP_UPDATES + 3) for _ in range(2)]
        assert inputs.nonfinite(1) is False and inputs.nonfinite(KEEP_UPDATES + 1) is None
        model(torch.tensor([[1.0, float("inf")]]))
        assert inputs.nonfinite(1) is False  # the pass after the last update is the next update's
        inputs.end_update()
        assert inputs.nonfinite(1) is True
    finally:
        inputs.close()
    assert keepers(model) == 0


def test_a_compiled_model_gets_no_keeper():
    inputs = ModelInputs()
    model = nn.Linear(2, 2)
    compiled = torch.compile(model)
    inputs.follow([compiled])
    try:
        assert keepers(compiled) == 0 and keepers(model) == 0
    finally:
        inputs.close()


def test_a_copy_keeps_nothing_a_saved_model_loads_and_uninstall_strips_both(reinstall):
    reinstall(AMPGUARD_WATCH_EVERY="1")
    model = make_net()
    train(model, 3)
    assert keepers(model) == 1
    ema = copy.deepcopy(model)
    state = healing.state()
    assert state is not None
    before = [len(cycle) for cycle in state.inputs._cycles]
    with torch.no_grad():
        ema(batch(0)[0])  # the copy's hook does nothing: not its keeper's model
    assert [len(cycle) for cycle in state.inputs._cycles] == before
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(batch(0)[0]), model(batch(0)[0]))
    ampguard.uninstall()
    try:
        assert keepers(model) == keepers(ema) == keepers(loaded) == 0
        assert not model_inputs._kept
    finally:
        ampguard.install()
