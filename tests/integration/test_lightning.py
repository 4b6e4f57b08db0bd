"""ampguard inside Lightning (Trainer and Fabric).

Lightning's ``MixedPrecision("16-mixed", device)`` plugin creates
``torch.amp.GradScaler(device=device)`` itself and honours a user-supplied
``scaler=``. ``Trainer(precision="16-mixed")`` on CPU turns into bf16-mixed
(no scaler), so the tests pass the plugin explicitly with ``device="cpu"``:
the Trainer test lets Lightning create the scaler, the Fabric test hands one in
with ``scaler=torch.amp.GradScaler("cpu")``.

Lightning has no skip tracking (issue 5558): its LR schedulers step after
skipped steps with torch's scaler; under ampguard the scheduler_hold patch
holds them. Checkpoints hold the scaler state under
the plugin's class name ``"MixedPrecision"``; ``fit(ckpt_path=...,
weights_only=True)`` restores it.
"""

from __future__ import annotations

import json
import textwrap
import warnings

import pytest
import torch
from integration_support import (
    OverflowInjector,
    assert_ran,
    assert_safe,
    cuda_reported_available,
    require,
    run_python,
    stock_torch,
    torch_grad_scaler,
)
from torch import nn

L = require("lightning")
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's num_workers / logging advice
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
]

STEPS = 8


def _data(batches: int = STEPS, batch_size: int = 4):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batches * batch_size, 8, generator=generator)
    y = torch.randn(batches * batch_size, 1, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class TinyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.overflow_at: set[int] = set()
        self.injector: OverflowInjector | None = None

    def on_fit_start(self) -> None:
        self.injector = OverflowInjector(self.net[0].weight, at=self.overflow_at)

    def on_fit_end(self) -> None:
        assert self.injector is not None
        self.injector.remove()

    def training_step(self, batch, batch_index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _lightning_trainer(tmp_path, *, scaler=None, max_steps=STEPS, gradient_clip_val=1.0, **options):
    # gradient_clip_val: unscale_, then clip_grad_norm_ over a generator, then step and update.
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision(precision="16-mixed", device="cpu", scaler=scaler)],
        max_steps=max_steps,
        gradient_clip_val=gradient_clip_val,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **options,
    )


def _fit(tmp_path, overflow_at, *, scaler=None, ckpt_path=None, max_steps=STEPS):
    torch.manual_seed(0)
    module = TinyModule()
    module.overflow_at = set(overflow_at)
    trainer = _lightning_trainer(tmp_path, scaler=scaler, max_steps=max_steps)
    trainer.fit(module, _data(), ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
    return trainer, module


def test_the_mixed_precision_plugin_creates_a_safe_grad_scaler(monkeypatch):
    assert_safe(MixedPrecision(precision="16-mixed", device="cpu").scaler)
    with cuda_reported_available(monkeypatch):
        assert_safe(MixedPrecision(precision="16-mixed", device="cuda").scaler)  # the GPU default
        assert_safe(FabricMixedPrecision(precision="16-mixed", device="cuda").scaler)


def test_trainer_fit_skips_and_counts_and_schedules_as_with_torch_s_scaler(tmp_path, ci_line, reinstall):
    reinstall(AMPGUARD_DISABLE="scheduler_hold")  # torch's schedulers, so that the weights compare with stock's
    trainer, module = _fit(tmp_path / "ampguard", {2, 5})
    scaler = trainer.precision_plugin.scaler
    assert_safe(scaler)  # created by Lightning's plugin
    stats = scaler.stats
    assert module.injector.injected == 2
    assert (stats.steps, stats.skipped, stats.nonfinite_loss, stats.scale) == (STEPS, 2, 0, 256.0)
    assert trainer.global_step == STEPS
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == STEPS  # Lightning steps schedulers after skipped steps too (issue 5558)
    assert all(torch.isfinite(p).all() for p in module.parameters())

    with stock_torch():
        stock, stock_module = _fit(tmp_path / "stock", {2, 5}, scaler=torch_grad_scaler()("cpu"))
    assert stock.lr_scheduler_configs[0].scheduler.last_epoch == scheduler.last_epoch
    for ours, theirs in zip(module.parameters(), stock_module.parameters()):
        torch.testing.assert_close(ours, theirs)

    ci_line("lightning", stats.skipped, stats.steps)


def test_trainer_fit_lr_scheduler_holds_on_skipped_steps(tmp_path):
    """With the scheduler_hold patch (default), Lightning's per-step scheduler holds on the two skips."""
    trainer, _ = _fit(tmp_path, {2, 5})
    assert trainer.precision_plugin.scaler.stats.skipped == 2
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == STEPS - 2


def test_trainer_checkpoint_resume_round_trips_the_scaler(tmp_path):
    _fit(tmp_path, {1})
    path = tmp_path / "step=4.ckpt"
    saved = torch.load(path, map_location="cpu", weights_only=True)["MixedPrecision"]
    assert saved["scale"] == 512.0 and saved["_growth_tracker"] == 2
    assert saved["ampguard"]["steps"] == 4 and saved["ampguard"]["skipped"] == 1

    resumed, _ = _fit(tmp_path / "resumed", {0}, ckpt_path=path)  # steps 5..8, overflow on step 5
    stats = resumed.precision_plugin.scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (STEPS, 2, 256.0)


class ManualModule(TinyModule):
    """Manual optimisation as Lightning documents it: clip_gradients() before opt.step().

    Lightning clips here without unscaling, and ``opt.step()`` then calls
    ``scaler.unscale_`` itself (issue 18089): the scaler has to take both orders.
    """

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_index):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        optimizer.step()
        self.lr_schedulers().step()
        return loss


def test_manual_optimisation_with_clip_gradients_skips_and_counts(tmp_path):
    torch.manual_seed(0)
    module = ManualModule()
    module.overflow_at = {3}
    trainer = _lightning_trainer(tmp_path, gradient_clip_val=None)
    trainer.fit(module, _data())
    stats = trainer.precision_plugin.scaler.stats
    assert (stats.steps, stats.skipped, stats.nonfinite_loss) == (STEPS, 1, 0)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_fabric_with_a_handed_in_scaler_skips_counts_and_round_trips(tmp_path, ci_line):
    fabric = L.Fabric(
        accelerator="cpu",
        devices=1,
        plugins=FabricMixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu")),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(_data())
    scaler = fabric._precision.scaler
    assert_safe(scaler)
    injector = OverflowInjector(model.module[0].weight, at={3})
    for x, y in loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        # Fabric's default error_if_nonfinite=True raises on an overflow (with torch's scaler too);
        # a training loop that expects fp16 overflows turns it off.
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
    injector.remove()
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (STEPS, 1, 512.0)

    fabric.save(tmp_path / "fabric.ckpt", {"model": model, "optimizer": optimizer, "scaler": scaler})
    fresh = torch.amp.GradScaler("cpu")
    fabric.load(tmp_path / "fabric.ckpt", {"scaler": fresh}, strict=False, weights_only=True)
    assert fresh.state_dict() == scaler.state_dict()
    assert fresh.stats.skipped == 1 and fresh.stats.steps == STEPS

    ci_line("lightning-fabric", stats.skipped, stats.steps)


IMPORT_AFTER_LIGHTNING = textwrap.dedent(
    """
    import json, torch
    import lightning
    from lightning.pytorch.plugins.precision import MixedPrecision
    import ampguard                                   # after lightning
    plugin = MixedPrecision(precision="16-mixed", device="cpu")
    print("RESULT " + json.dumps({
        "type": type(plugin.scaler).__name__,
        "init_scale": plugin.scaler._init_scale,
        "growth_interval": plugin.scaler.get_growth_interval(),
    }))
    """
)


def test_import_ampguard_after_lightning_still_takes_effect(tmp_path):
    result = run_python(["-c", IMPORT_AFTER_LIGHTNING], cwd=tmp_path)
    assert_ran(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT ") :]) == {
        "type": "SafeGradScaler",
        "init_scale": 1024.0,
        "growth_interval": 100,
    }
