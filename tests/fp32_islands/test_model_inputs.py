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
from scaler_support import ampguard_log, one_thread, recipe_step  # noqa: F401  (fixtures)
from torch import nn
from torch.nn import functional as F

import ampguard
import ampguard.messages as messages
import ampguard.scaler.live as live
from ampguard.fp32_islands.model_inputs import KEEP_UPDATES, KeepInputs, ModelInputs
from ampguard.fp32_islands.patch import applied_healing

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
        loss = recipe_step(optimizer, scaler, lambda: F.cross_entropy(model(features=x) if keyword else model(x), y))  # noqa: B023
        lost += [step] if not torch.isfinite(loss) else []
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
            live.updates.count += 1  # an update begins (a SafeGradScaler's update(), a DeepSpeed step)
        kept = [float(p.args[0][0, 0]) for _, cycle in inputs._cycles for p in cycle]
        # the last KEEP_UPDATES updates' passes, and those of the one before until the next pass begins another
        assert kept == [float(u) for u in range(2, KEEP_UPDATES + 3) for _ in range(2)]
        assert inputs.nonfinite(1) is False and inputs.nonfinite(KEEP_UPDATES + 1) is None
        model(torch.tensor([[1.0, float("inf")]]))
        kept = [float(p.args[0][0, 0]) for _, cycle in inputs._cycles for p in cycle]
        assert kept[: 2 * KEEP_UPDATES] == [float(u) for u in range(3, KEEP_UPDATES + 3) for _ in range(2)]
        assert inputs.nonfinite(1) is False  # the pass after the last update is the next update's
        live.updates.count += 1
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
    state = applied_healing()
    assert state is not None
    before = [(begun, len(passes)) for begun, passes in state.inputs._cycles]
    ema(batch(0)[0])  # the copy's hook does nothing: not its keeper's model
    assert [(begun, len(passes)) for begun, passes in state.inputs._cycles] == before
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    with torch.no_grad():
        assert torch.equal(loaded(batch(0)[0]), model(batch(0)[0]))
    ampguard.uninstall()
    try:
        assert keepers(model) == keepers(ema) == keepers(loaded) == 0
        assert not state.inputs.following()
    finally:
        ampguard.install()


def overflowing_run(model: nn.Module, steps: int, loss_of) -> tuple[list[int], tuple[str, ...]]:
    """islands_support's batches: every 10th is loud, and ``blocks.1.attn`` overflows float16 in it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    lost = []
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_of(model, x, y, step)
        lost += [step] if not torch.isfinite(loss) else []
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return lost, scaler.stats.fp32_islands


class TwoStage(nn.Module):
    """A backbone and a head called one after the other by the loop (a GAN's D(G(z)), a student fed a teacher)."""

    def __init__(self) -> None:
        super().__init__()
        net = make_net()
        self.backbone = nn.Sequential(*net.blocks)
        self.head = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))


def test_a_second_model_fed_the_first_ones_overflow_is_not_bad_data(reinstall, ampguard_log):
    """Before: the head's kept inputs were inf (the backbone overflowed), so every overflow was taken for bad data:
    4 of 4 lost, no island (with the watch off, the probe healed it at the 2nd)."""
    reinstall()
    two = TwoStage()
    lost, made = overflowing_run(two, 30, lambda m, x, y, _: F.cross_entropy(m.head(m.backbone(x).mean(1)), y))
    assert lost == [9] and made == ("backbone.1.attn",)
    assert not [r for r in ampguard_log.records if "the batch itself held" in r.getMessage()]


class Masked(nn.Module):
    """An additive float mask with -inf for padding, by design (``generate_square_subsequent_mask``, key padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, pad_bias: torch.Tensor) -> torch.Tensor:
        for block in self.net.blocks:
            x = block(x)
        weights = (x.mean(-1) + pad_bias).softmax(-1)
        return self.net.head((weights[..., None] * x).sum(1))


def test_an_input_holding_minus_inf_by_design_is_not_bad_data(reinstall):
    reinstall()

    def loss_of(model, x, y, _):
        pad_bias = torch.zeros(x.shape[:2])
        pad_bias[:, -1] = float("-inf")
        return F.cross_entropy(model(x, pad_bias), y)

    assert overflowing_run(Masked(), 30, loss_of) == ([9], ("net.blocks.1.attn",))


def test_a_nan_label_is_not_a_module_even_one_the_watch_saw_close(reinstall):
    """The loss is NaN from a target, which the model never sees: its forward runs again and finite, so nothing is
    blamed (before: blocks.1.attn, the watch's closest, became a permanent island)."""
    reinstall()

    def loss_of(model, x, y, step):
        target = torch.nn.functional.one_hot(y, 4).float()
        if step == 5:
            target[0, 0] = float("nan")
        return F.mse_loss(model(x).float().softmax(-1), target)

    lost, made = overflowing_run(make_net(), 8, loss_of)
    assert lost == [5] and made == ()


def test_evaluation_passes_are_not_kept(reinstall):
    reinstall()
    model = make_net()
    train(model, 3)
    state = applied_healing()
    assert state is not None
    before = [(begun, len(passes)) for begun, passes in state.inputs._cycles]
    assert before and before[-1][1] > 0  # the training passes are kept
    with torch.no_grad():
        for _ in range(100):  # a validation loop: 100 batches that must not stay alive
            model(batch(0)[0])
    with torch.inference_mode():
        model(batch(0)[0])
    assert [(begun, len(passes)) for begun, passes in state.inputs._cycles] == before


def test_a_model_saved_whole_loads_without_ampguard_and_scripts_and_keeps_its_hooks(reinstall, tmp_path):
    """Before: the file named ampguard's KeepInputs (ModuleNotFoundError where ampguard is not installed) and
    torch.jit.script raised AttributeError: 'KeepInputs' object has no attribute '__name__'."""
    import subprocess
    import sys
    import warnings

    reinstall(AMPGUARD_WATCH_EVERY="1")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for step in range(3):
        x, y = batch(step, healthy=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).mean(1), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    assert keepers(model) == 1
    path = tmp_path / "model.pt"
    torch.save({"model": model, "step": 3}, path)
    load = f"import sys; sys.modules['ampguard'] = None; import torch; torch.load({str(path)!r}, weights_only=False)"
    done = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated, and still used
        scripted = torch.jit.script(model)
    x = batch(0, healthy=True)[0]
    assert torch.equal(scripted(x), model(x))
    assert keepers(model) == 1  # put back: the model keeps its inputs as before
