"""ampguard inside timm's training utilities, wired the way timm's train.py wires them.

timm's ``NativeScaler(device=...)`` creates ``torch.amp.GradScaler(device=device)``
at run time, unscales right before ``dispatch_clip_grad`` and then steps and
updates; autocast is ``functools.partial(torch.autocast, ...)``. timm does not
detect skipped steps: ``lr_scheduler.step_update`` runs after every update, with
torch's scaler too. ``CheckpointSaver`` stores the scaler state under
``"amp_scaler"`` and ``resume_checkpoint`` loads it with ``weights_only=True``.

timm needs torchvision; the pair that loads together here is torch 2.14.1 +
torchvision 0.29.1 (see README.md). With a torchvision that does not match torch
this module is skipped with the import error as the reason.
"""

from __future__ import annotations

import functools
import json
import textwrap

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

timm = require("timm")
import timm.models  # noqa: E402
import timm.optim  # noqa: E402
import timm.scheduler  # noqa: E402
import timm.utils  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = 8


def _batches(count: int = STEPS):
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, 3, 32, 32, generator=generator), torch.randint(0, 4, (4,), generator=generator))
        for _ in range(count)
    ]


def _train(overflow_at, *, scaler=None, saver_dir=None, resume=None, steps=STEPS):
    """timm train.py's train_one_epoch, shortened: autocast partial, NativeScaler with clipping, step_update."""
    torch.manual_seed(0)
    model = timm.create_model("test_vit", pretrained=False, num_classes=4, img_size=32)
    optimizer = timm.optim.create_optimizer_v2(model, opt="sgd", lr=0.05, momentum=0.9, weight_decay=0.0)
    lr_scheduler, _ = timm.scheduler.create_scheduler_v2(
        optimizer, sched="cosine", num_epochs=2, updates_per_epoch=STEPS, step_on_epochs=False
    )
    loss_scaler = timm.utils.NativeScaler(device="cpu")
    if scaler is not None:
        loss_scaler._scaler = scaler
    amp_autocast = functools.partial(torch.autocast, device_type="cpu", dtype=torch.float16)
    loss_fn = torch.nn.CrossEntropyLoss()
    num_updates = 0
    if resume is not None:
        timm.models.resume_checkpoint(model, str(resume), optimizer=optimizer, loss_scaler=loss_scaler)
        num_updates = loss_scaler._scaler.stats.steps
    injector = OverflowInjector(model.patch_embed.proj.weight, at=overflow_at)
    learning_rates = []
    model.train()
    for x, target in _batches(steps):
        with amp_autocast():
            loss = loss_fn(model(x), target)
        loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=timm.models.model_parameters(model))
        optimizer.zero_grad()
        num_updates += 1
        lr_scheduler.step_update(num_updates=num_updates)
        learning_rates.append(optimizer.param_groups[0]["lr"])
    injector.remove()
    if saver_dir is not None:
        saver = timm.utils.CheckpointSaver(
            model, optimizer, amp_scaler=loss_scaler, checkpoint_dir=str(saver_dir), recovery_dir=str(saver_dir)
        )
        saver.save_checkpoint(epoch=0, metric=0.0)
    return model, loss_scaler, learning_rates


def test_native_scaler_creates_a_safe_grad_scaler(monkeypatch):
    assert_safe(timm.utils.NativeScaler(device="cpu")._scaler)
    with cuda_reported_available(monkeypatch):
        assert_safe(timm.utils.NativeScaler()._scaler)  # train.py on a GPU


def test_train_loop_skips_and_counts_and_schedules_as_with_torch_s_scaler(ci_line):
    model, loss_scaler, learning_rates = _train({2, 5})
    scaler = loss_scaler._scaler
    assert_safe(scaler)
    stats = scaler.stats
    assert (stats.steps, stats.skipped, stats.nonfinite_loss, stats.scale) == (STEPS, 2, 0, 256.0)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    with stock_torch():
        stock_model, _, stock_rates = _train(
            {2, 5}, scaler=torch_grad_scaler(init_scale=1024.0, growth_interval=100)("cpu")
        )
    assert stock_rates == learning_rates  # timm steps its scheduler on every update, skipped or not
    for ours, theirs in zip(model.parameters(), stock_model.parameters()):
        torch.testing.assert_close(ours, theirs)

    ci_line("timm", stats.skipped, stats.steps)


def test_checkpoint_saver_and_resume_checkpoint_round_trip_the_scaler(tmp_path):
    _, loss_scaler, _ = _train({1}, steps=4, saver_dir=tmp_path)
    path = tmp_path / "checkpoint-0.pth.tar"
    saved = torch.load(path, map_location="cpu", weights_only=True)["amp_scaler"]
    assert saved == loss_scaler.state_dict()
    assert saved["scale"] == 512.0 and saved["ampguard"]["skipped"] == 1 and saved["ampguard"]["steps"] == 4

    _, resumed, _ = _train({0}, steps=2, resume=path)  # resume_checkpoint: weights_only=True
    stats = resumed._scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (6, 2, 256.0)


IMPORT_AFTER_TIMM = textwrap.dedent(
    """
    import json
    import timm, timm.utils
    import ampguard                                   # after timm
    scaler = timm.utils.NativeScaler(device="cpu")._scaler
    print("RESULT " + json.dumps({"type": type(scaler).__name__, "init_scale": scaler._init_scale}))
    """
)


def test_import_ampguard_after_timm_still_takes_effect(tmp_path):
    result = run_python(["-c", IMPORT_AFTER_TIMM], cwd=tmp_path)
    assert_ran(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[len("RESULT ") :]) == {"type": "SafeGradScaler", "init_scale": 1024.0}


def _train_task(overflow_at: set[int], steps: int = 6):
    """train.py's loop through timm's ClassificationTask on a resnet (BatchNorm): batches in ``overflow_at``
    are 1e5 times larger, beyond float16 once autocast casts them for the stem's convolution."""
    import timm.task

    torch.manual_seed(0)
    model = timm.create_model("test_resnet", pretrained=False, num_classes=4)
    task = timm.task.ClassificationTask(model, device=torch.device("cpu"), verbose=False)
    optimizer = timm.optim.create_optimizer_v2(model, opt="sgd", lr=0.05, momentum=0.9, weight_decay=0.0)
    loss_scaler = timm.utils.NativeScaler(device="cpu")
    amp_autocast = functools.partial(torch.autocast, device_type="cpu", dtype=torch.float16)
    task.train()
    for step, (x, target) in enumerate(_batches(steps)):
        with amp_autocast():
            loss = task(x * 1e5 if step in overflow_at else x, target)["loss"]
        loss_scaler(loss, optimizer, clip_grad=1.0, clip_mode="norm", parameters=timm.models.model_parameters(model))
        optimizer.zero_grad()
    return task, loss_scaler._scaler


def test_a_forward_overflow_at_step_2_leaves_batchnorm_finite_and_the_island_is_named_from_the_task():
    """Step 2 is the iteration in which ampguard learns which buffers to guard; step 4's overflow names the stem."""
    task, scaler = _train_task({1, 3})
    assert scaler.stats.buffers_restored >= 1
    assert all(torch.isfinite(b.float()).all() for b in task.buffers())
    (name,) = scaler.stats.fp32_islands
    assert name.startswith("trainable_module.") and task.get_submodule(name) is not None  # the printed line's path
    with stock_torch():
        stock_task, _ = _train_task({1, 3})
    assert not all(torch.isfinite(b.float()).all() for b in stock_task.buffers())  # torch leaves them NaN
