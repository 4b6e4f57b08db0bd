"""ampguard inside the coqui ``trainer`` package (coqui-tts-trainer, what XTTS fine-tuning runs).

The coqui trainer binds ``GradScaler = functools.partial(torch.GradScaler,
device="cuda")`` when ``trainer.trainer`` is imported and calls it in
``Trainer.__init__``. Its skip detection compares ``scaler.get_scale()``
before and after ``step/update`` and steps the LR scheduler only when the scale
did not drop; checkpoints hold ``"scaler": scaler.state_dict()`` and are loaded
with ``torch.load(weights_only=True)``.

On CPU the trainer's own scaler would disable itself (CUDA is not there), so
the training tests re-point only the partial's ``device`` keyword to "cpu"
(``coqui_tiny.cpu_grad_scaler_factory``) and let the Trainer build its scaler
with its own ``GradScaler()`` line.
"""

from __future__ import annotations

import functools
import itertools
import json
import textwrap
import warnings

import pytest
import torch
from integration_support import (
    REPO,
    OverflowInjector,
    assert_ran,
    assert_safe,
    cuda_reported_available,
    require,
    run_python,
    stock_torch,
    torch_grad_scaler,
)

import ampguard

require("trainer")
import coqui_tiny  # noqa: E402
import trainer.trainer  # noqa: E402

pytestmark = pytest.mark.integration

STEPS = coqui_tiny.SAMPLES // coqui_tiny.TinyConfig.batch_size  # 8 optimizer steps an epoch


def test_the_module_level_partial_now_makes_a_safe_grad_scaler(monkeypatch):
    partial = trainer.trainer.GradScaler
    assert isinstance(partial, functools.partial)
    assert partial.func is torch.amp.GradScaler and issubclass(partial.func, ampguard.SafeGradScaler)
    assert partial.keywords == {"device": "cuda"}
    with cuda_reported_available(monkeypatch):
        assert_safe(partial())  # what Trainer.__init__ creates on a CUDA machine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "CUDA is not available. Disabling."
        here = partial()
    assert isinstance(here, ampguard.SafeGradScaler) and not here.is_enabled()  # as torch's does without CUDA


def test_the_trainer_builds_its_scaler_through_the_rebound_partial(tmp_path):
    coqui = coqui_tiny.build_trainer(tmp_path)
    assert coqui.use_amp_scaler
    assert_safe(coqui.scaler)


def _fit_with_overflows(tmp_path, at, **config):
    """``Trainer.fit()`` for one epoch (8 steps) with inf gradients on the given backward passes."""
    coqui = coqui_tiny.build_trainer(tmp_path, **config)
    injector = OverflowInjector(coqui.model.net[0].weight, at=at)
    coqui.fit()
    injector.remove()
    return coqui, injector


def test_fit_skips_and_counts_overflow_steps_and_holds_the_lr_scheduler(tmp_path, ci_line):
    coqui, injector = _fit_with_overflows(tmp_path / "ampguard", at={2, 6})
    stats = coqui.scaler.stats
    assert injector.injected == 2
    assert (stats.steps, stats.skipped, stats.nonfinite_loss) == (STEPS, 2, 0)
    assert stats.scale == 1024 / 4  # backed off once per overflow; growth_interval 100 is not reached
    # coqui steps its scheduler only when the scale did not drop: never on the two skipped steps
    assert coqui.scheduler[0].last_epoch == STEPS - 2
    assert coqui.total_steps_done == STEPS
    assert all(torch.isfinite(p).all() for p in coqui.model.parameters())

    # What the coqui trainer sees with torch's own GradScaler: the same skips, the same schedule,
    # the same weights (the scales differ only by powers of two, which unscale exactly).
    with stock_torch():
        stock, _ = _fit_with_overflows(tmp_path / "stock", at={2, 6})
        assert type(stock.scaler) is torch_grad_scaler().func
    assert stock.scheduler[0].last_epoch == coqui.scheduler[0].last_epoch
    assert stock.scheduler[0].get_last_lr() == coqui.scheduler[0].get_last_lr()
    for ours, theirs in zip(coqui_tiny.params_of(coqui), coqui_tiny.params_of(stock)):
        torch.testing.assert_close(ours, theirs)

    ci_line("coqui-trainer", stats.skipped, stats.steps)


def test_checkpoint_continue_round_trips_the_scaler_state(tmp_path):
    # save_step=5: checkpoint_5.pth is written at coqui's (0-based) step 5, i.e. after 6 optimizer steps,
    # with the overflow of step 3 behind it.
    first, _ = _fit_with_overflows(tmp_path, at={2})
    run_folder = first.output_path
    checkpoint_path = run_folder / "checkpoint_5.pth"
    saved = torch.load(checkpoint_path, map_location="cpu", weights_only=True)["scaler"]  # as coqui loads it
    assert saved["scale"] == 512.0 and saved["_growth_tracker"] == 3
    assert saved["ampguard"]["steps"] == 6 and saved["ampguard"]["skipped"] == 1

    resumed = coqui_tiny.build_trainer(tmp_path, continue_path=str(run_folder))
    assert resumed.continue_run and resumed.total_steps_done == 6  # coqui's "step + 1"
    assert_safe(resumed.scaler, init_scale=512.0)  # loading overwrote the init scale, as torch's does
    assert resumed.scaler.state_dict() == saved
    stats = resumed.scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (6, 1, 512.0)

    # Training goes on from the restored counters: one more overflow is the second skip.
    injector = OverflowInjector(resumed.model.net[0].weight, at={0})
    resumed.fit()
    injector.remove()
    stats = resumed.scaler.stats
    assert stats.skipped == 2 and stats.steps == 6 + STEPS
    assert stats.scale == 256.0


def _fit_gan(tmp_path, at, **options):
    coqui = coqui_tiny.build_gan_trainer(tmp_path, **options)
    injector = OverflowInjector(coqui.model.generator[0].weight, at=at)  # reached by the generator's steps only
    coqui.fit()
    injector.remove()
    return coqui


def test_gan_two_optimizers_one_scaler_skip_only_the_overflowing_one(tmp_path):
    coqui = _fit_gan(tmp_path / "ampguard", {3})  # the generator's 4th step overflows
    stats = coqui.scaler.stats
    assert (stats.steps, stats.skipped, stats.scale) == (2 * STEPS, 1, 512.0)
    discriminator_scheduler, generator_scheduler = coqui.scheduler
    # coqui compares scales around each optimizer's step; the one update() follows the last optimizer.
    assert (discriminator_scheduler.last_epoch, generator_scheduler.last_epoch) == (STEPS, STEPS - 1)

    with stock_torch():
        stock = _fit_gan(tmp_path / "stock", {3})
        assert type(stock.scaler) is torch_grad_scaler().func
    assert [s.last_epoch for s in stock.scheduler] == [s.last_epoch for s in coqui.scheduler]
    for ours, theirs in zip(coqui_tiny.params_of(coqui), coqui_tiny.params_of(stock)):
        torch.testing.assert_close(ours, theirs)


def _storm_against_torch(tmp_path):
    """12 overflowing steps in a row from scale 1024 (the scale reaches 1 after 10 of them), 16 steps in all."""
    storm = set(range(12))
    coqui, _ = _fit_with_overflows(tmp_path / "ampguard", at=storm, epochs=2)
    assert coqui.scaler.stats.skipped == 12
    with stock_torch():
        torch_same_settings = torch_grad_scaler(device="cpu", init_scale=1024.0, growth_interval=100)
        stock, _ = _fit_with_overflows(tmp_path / "stock", at=storm, epochs=2, scaler_factory=torch_same_settings)
        assert type(stock.scaler) is torch_grad_scaler().func
    assert stock.scheduler[0].last_epoch == 16 - 12  # torch: every skip halves the scale, coqui sees it
    return coqui, stock


def test_at_the_scale_floor_coqui_skip_detection_misses_skips_that_stats_count(tmp_path, reinstall):
    # Known interaction, documented in docs/troubleshooting.md: the floor (AMPGUARD_MIN_SCALE=1) keeps the
    # scale at 1 on an overflow, so coqui's "scale_prev <= scale_now" takes the two skips at the floor for
    # real steps and steps its LR scheduler on them. ampguard's own count stays exact.
    reinstall(AMPGUARD_DISABLE="scheduler_hold")
    coqui, stock = _storm_against_torch(tmp_path)
    assert coqui.scaler.stats.min_scale_seen == 1.0
    assert coqui.scheduler[0].last_epoch == stock.scheduler[0].last_epoch + 2


def test_at_the_scale_floor_the_scheduler_hold_patch_holds_the_skips_coqui_misses(tmp_path):
    # coqui calls scheduler.step() after the two skips at the floor; the scheduler_hold patch holds them:
    # the schedule counts real steps only, as with torch's scaler (docs/schedulers.md).
    coqui, stock = _storm_against_torch(tmp_path)
    assert coqui.scaler.stats.min_scale_seen == 1.0
    assert coqui.scheduler[0].last_epoch == stock.scheduler[0].last_epoch == 16 - 12


def test_without_a_floor_coqui_sees_every_skip(tmp_path, reinstall):
    reinstall(AMPGUARD_MIN_SCALE="0")
    coqui, stock = _storm_against_torch(tmp_path)
    assert coqui.scheduler[0].last_epoch == stock.scheduler[0].last_epoch


def _fit_with_forward_overflows(tmp_path, at, **config):
    """``Trainer.fit()`` for one epoch whose loss is inf on the given forward passes (of the model's ``net``)."""
    coqui = coqui_tiny.build_trainer(tmp_path, **config)
    calls = itertools.count()
    handle = coqui.model.net.register_forward_hook(
        lambda module, inputs, output: output * float("inf") if next(calls) in at else None
    )
    coqui.fit()
    handle.remove()
    return coqui


@pytest.mark.parametrize("hold", ["scheduler_hold on", "scheduler_hold off"])
def test_forward_overflows_keep_the_scale_so_coqui_s_gate_misses_them_and_scheduler_hold_holds(
    tmp_path, reinstall, hold
):
    # coqui steps its scheduler when scale_prev <= scaler.get_scale(): torch halves the scale on a forward
    # overflow, ampguard keeps it (no loss scale helps), so only the scheduler_hold patch holds the schedule.
    if hold == "scheduler_hold off":
        reinstall(AMPGUARD_DISABLE="scheduler_hold")
    coqui = _fit_with_forward_overflows(tmp_path / "ampguard", at={2, 6})
    stats = coqui.scaler.stats
    assert (stats.steps, stats.skipped, stats.nonfinite_loss, stats.scale) == (STEPS, 2, 2, 1024.0)
    with stock_torch():
        stock = _fit_with_forward_overflows(tmp_path / "stock", at={2, 6})
    assert stock.scaler.get_scale() == 2.0**16 / 4 and stock.scheduler[0].last_epoch == STEPS - 2
    if hold == "scheduler_hold on":
        assert coqui.scheduler[0].last_epoch == stock.scheduler[0].last_epoch
        assert coqui.scheduler[0].get_last_lr() == stock.scheduler[0].get_last_lr()
    else:
        assert coqui.scheduler[0].last_epoch == STEPS


IMPORT_AFTER_TRAINER = textwrap.dedent(
    """
    import functools, json, sys, tempfile, warnings
    import trainer                                    # binds the module-level GradScaler partial
    from trainer.trainer import GradScaler as held    # a second holder of that same partial
    import torch
    before = held.func is torch.amp.grad_scaler.GradScaler

    import ampguard                                   # after the library

    sys.path.insert(0, sys.argv[1])
    import coqui_tiny
    from integration_support import OverflowInjector

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        as_built = coqui_tiny.Trainer(                # the trainer's own scaler, built after the import
            coqui_tiny.TrainerArgs(), coqui_tiny.TinyConfig(output_path=tempfile.mkdtemp()),
            model=coqui_tiny.TinyModel(), parse_command_line_args=False,
        )
    coqui = coqui_tiny.build_trainer(tempfile.mkdtemp())
    injector = OverflowInjector(coqui.model.net[0].weight, at={1})
    coqui.fit()
    print("RESULT " + json.dumps({
        "held_was_torch": before,
        "held_is_safe": issubclass(held.func, ampguard.SafeGradScaler),
        "built_type": type(as_built.scaler).__name__,
        "built_is_safe": isinstance(as_built.scaler, ampguard.SafeGradScaler),
        "cpu_scaler_init": coqui.scaler._init_scale,
        "skipped": coqui.scaler.stats.skipped,
        "steps": coqui.scaler.stats.steps,
        "scheduler_steps": coqui.scheduler[0].last_epoch,
    }))
    """
)


def test_import_ampguard_after_trainer_still_takes_effect(tmp_path):
    # integration_support imports ampguard, but only after trainer and ampguard are both in:
    # the order under test is settled by then.
    result = run_python(["-c", IMPORT_AFTER_TRAINER, str(REPO / "tests" / "integration")], cwd=tmp_path)
    assert_ran(result)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    seen = json.loads(line[len("RESULT ") :])
    assert seen == {
        "held_was_torch": True,
        "held_is_safe": True,
        "built_type": "SafeGradScaler",
        "built_is_safe": True,
        "cpu_scaler_init": 1024.0,
        "skipped": 1,
        "steps": STEPS,
        "scheduler_steps": STEPS - 1,
    }


UNINSTALL_AFTER_IMPORTING_TRAINER = textwrap.dedent(
    """
    import ampguard
    import torch
    import trainer.trainer                    # imported while ampguard is installed
    ampguard.uninstall()
    print("RESULT", trainer.trainer.GradScaler.func.__module__, trainer.trainer.GradScaler.func.__qualname__)
    """
)


def test_uninstall_gives_a_trainer_imported_after_install_torch_s_scaler_back(tmp_path):
    # The partial was built around SafeGradScaler (torch.GradScaler already was one): uninstall
    # must still hand the coqui trainer torch's class back.
    result = run_python(["-c", UNINSTALL_AFTER_IMPORTING_TRAINER], cwd=tmp_path)
    assert_ran(result)
    assert "RESULT torch.amp.grad_scaler GradScaler" in result.stdout, result.stdout
