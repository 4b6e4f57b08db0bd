"""fp32 islands against torch's own scaler: a block that overflows float16 on every 10th batch heals itself.

The model (tests/support/islands_support.py) overflows inside ``blocks.1.attn`` on every
10th batch. torch's GradScaler loses every such batch and halves the scale each
time; with ampguard the first overflow arms the probe, the second names the
block and makes it an fp32 island, and no batch is lost after that.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from islands_support import (  # noqa: F401
    CLASSES,
    DIM,
    EVERY,
    HYPER,
    applied_islands,
    batch,
    fresh_islands,
    make_net,
    probe_only,
    stock_scaler,
    train,
)
from scaler_support import ampguard_log, one_thread, records  # noqa: F401  (fixtures)

import ampguard
import ampguard.scaler
import ampguard.scaler.listeners as listeners
from ampguard.fp32_islands import rerun
from ampguard.fp32_islands.islands import permanent_line
from ampguard.fp32_islands.model_inputs import KeepInputs
from ampguard.fp32_islands.patch import applied_healing
from ampguard.syncs import HostReadCounter

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_islands")

ISLAND = "fp32 island: blocks.1.attn (Attention)"


def global_hooks() -> int:
    hooks = torch.nn.modules.module
    return len(hooks._global_forward_hooks) + len(hooks._global_forward_pre_hooks)


def module_hooks(model: torch.nn.Module) -> int:
    """The hooks on the model's modules but the root's input keeper (counted by :func:`input_keepers`)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) - input_keepers(model)


def input_keepers(model: torch.nn.Module) -> int:
    """The hooks keeping the model's inputs until its update (ampguard.fp32_islands.model_inputs)."""
    return sum(isinstance(h, KeepInputs) for m in model.modules() for h in m._forward_pre_hooks.values())


def test_a_block_overflowing_every_10th_batch_heals_itself(ampguard_log):
    steps = 300
    reference = train(steps, scaler=stock_scaler())
    healed = train(steps)
    assert reference.nonfinite_losses == steps // EVERY == 30  # plain torch loses every 10th batch
    assert min(reference.scales) < 1e-3  # ... and halves its scale each time
    stats = healed.scaler.stats
    assert stats.skipped <= 3 and stats.nonfinite_loss == healed.nonfinite_losses <= 3
    assert stats.fp32_islands == ("blocks.1.attn",)
    assert min(healed.scales) >= 1024.0  # never lowered for a forward overflow
    assert stats.scale > 1024.0  # and grows as on a healthy run
    made = records(ampguard_log, logging.WARNING, "fp32 island:")
    assert len(made) == 1 and made[0].getMessage().startswith(ISLAND)
    assert 'model.get_submodule("blocks.1.attn")' in made[0].getMessage()
    assert not records(ampguard_log, logging.CRITICAL)
    assert all(torch.isfinite(p).all() for p in healed.model.parameters())
    assert module_hooks(healed.model) == 2  # the island's own pair, on blocks.1.attn only
    assert input_keepers(healed.model) == 1 and KeepInputs in map(type, healed.model._forward_pre_hooks.values())
    assert len(healed.model.blocks[1].attn._forward_pre_hooks) == 1
    assert global_hooks() == 0  # the probe disarmed after naming it


def test_report_mode_names_the_block_and_changes_nothing(reinstall, ampguard_log):
    reinstall(AMPGUARD_FP32_ISLANDS="report")
    run = train(4 * EVERY)
    named = records(ampguard_log, logging.WARNING, "AMPGUARD_FP32_ISLANDS=report: nothing changed")
    assert len(named) == 1  # by the headroom watch, at the first overflow (the probe's verdict is not said again)
    assert "blocks.1.attn (Attention)" in named[0].getMessage()
    assert run.nonfinite_losses == 4 and run.scaler.stats.fp32_islands == ()
    assert not records(ampguard_log, logging.WARNING, "fp32 island:")
    assert module_hooks(run.model) == 0
    assert min(run.scales) >= 1024.0  # no back-off for a forward overflow, healed or not


def test_disabled_patch_probes_nothing(reinstall, monkeypatch, ampguard_log):
    reinstall(AMPGUARD_DISABLE="fp32_islands", AMPGUARD_UNDERFLOW="off")  # (its samples hook sampled steps)
    registered = []
    original = torch.nn.modules.module.register_module_forward_pre_hook
    monkeypatch.setattr(
        torch.nn.modules.module,
        "register_module_forward_pre_hook",
        lambda hook: registered.append(hook) or original(hook),
    )
    run = train(3 * EVERY)
    assert registered == [] and global_hooks() == 0 and module_hooks(run.model) == 0
    assert run.nonfinite_losses == 3 and run.scaler.stats.fp32_islands == ()
    assert not records(ampguard_log, logging.WARNING, "fp32 island")
    assert min(run.scales) >= 1024.0  # the scale is still kept: that is the scaler's, not the patch's


def test_healthy_run_registers_nothing_and_matches_torch_bit_for_bit():
    steps = 60
    reference = train(steps, scaler=stock_scaler(), healthy=True)
    seen: list[int] = []
    guarded = train(steps, healthy=True, after_update=lambda step: seen.append(global_hooks()))
    # The second iteration: buffer discovery (one global pre-hook, then gone), the headroom watch (a pre- and a
    # post-hook, gone at the next step(); again every AMPGUARD_WATCH_EVERY=100 steps) and the underflow sample
    # (a pre- and a post-hook; the next at step 102, docs/underflow.md); nothing else.
    assert seen[0] == 5 and set(seen[1:]) == {0}
    assert guarded.scaler.stats.headroom[0][0] == "blocks.1.attn"  # the watch saw the model (and changed nothing)
    assert module_hooks(guarded.model) == 0
    assert all("forward" not in vars(m) for m in guarded.model.modules())
    assert torch.nn.Module.__call__ is torch.nn.Module._wrapped_call_impl
    assert guarded.scales == reference.scales
    for ours, theirs in zip(guarded.model.parameters(), reference.model.parameters()):
        assert torch.equal(ours, theirs)
    assert not applied_healing().probe.armed


def test_healing_run_reads_the_host_as_often_as_torch_plus_the_documented_diagnostic_read():
    steps = 4 * EVERY
    with HostReadCounter() as torch_reads:
        train(steps, scaler=stock_scaler(), check_losses=False)
    with HostReadCounter() as ours:
        run = train(steps, check_losses=False)
    assert run.scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert ours.by_source["aten::_local_scalar_dense"] == torch_reads.by_source["aten::_local_scalar_dense"] == steps
    # The probe, the headroom watch and the island add none; diagnose names the parameters of the first skipped
    # step (one read), and the forward overflow reads whether the batch held inf/NaN and the verdict of its forward
    # run again (ampguard/fp32_islands/rerun.py), one read each.
    assert run.scaler.stats.nonfinite_loss == 1
    assert ours.by_source["ampguard.read_to_host"] == 1 + 2


def test_the_permanent_line_from_the_warning_heals_plain_torch(stock_torch):
    model = make_net()
    line = permanent_line("blocks.1.attn", "cpu")
    exec(line, {"model": model, "torch": torch})
    run = train(3 * EVERY, model=model, scaler=stock_scaler())
    assert run.nonfinite_losses == 0


@pytest.mark.usefixtures("probe_only")
def test_probe_disarms_after_probe_steps_without_overflow(reinstall):
    reinstall(AMPGUARD_PROBE_STEPS="3")
    armed: list[bool] = []
    train(EVERY + 6, after_update=lambda step: armed.append(applied_healing().probe.armed))
    assert armed[EVERY - 1] and armed[EVERY + 1]  # armed by the overflow of batch 9
    assert not armed[EVERY + 2] and global_hooks() == 0  # 3 quiet steps later: gone


def test_max_islands_limit_reports_that_the_model_does_not_suit_fp16(reinstall, ampguard_log, monkeypatch):
    reinstall(AMPGUARD_MAX_ISLANDS="1")
    elsewhere = torch.nn.Linear(2, 2)
    applied_islands().make(elsewhere, "elsewhere")
    run = train(3 * EVERY)
    assert run.scaler.stats.fp32_islands == ("elsewhere",)
    limit = records(ampguard_log, logging.WARNING, "AMPGUARD_MAX_ISLANDS=1: this model does not suit float16")
    assert len(limit) == 1 and "blocks.1.attn" in limit[0].getMessage()


class _RootOverflow(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * 25.0
        return (h @ h.transpose(-1, -2)).mean(-1)[..., :CLASSES]  # overflows in the root's own code


def test_an_overflow_in_the_root_is_reported_not_islanded(ampguard_log):
    run = train(3 * EVERY, model=_RootOverflow())
    assert run.scaler.stats.fp32_islands == ()
    assert len(records(ampguard_log, logging.WARNING, "forward overflow located in _RootOverflow itself")) == 1
    # Each overflow's forward runs again (another module may be at fault) and names the root, without saying so
    # again; after 3 such verdicts it looks less often.
    assert len(records(ampguard_log, logging.INFO, "the forward-overflow probe looks less often")) == 1


def _corrupt_then_hot(steps: int, corrupt: set[int], hot: set[int], model=None):
    model = make_net() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", **HYPER)
    nonfinite = []
    for step in range(steps):
        x, y = batch(step, healthy=True)
        if step in corrupt:
            x = x.clone()
            x[0, 0, 0] = float("nan")  # the batch itself holds NaN: no module to blame
        if step in hot:
            x = x * 8.0  # blocks.1.attn overflows float16
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if not torch.isfinite(loss):
            nonfinite.append(step)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return model, scaler, nonfinite


@pytest.mark.usefixtures("probe_only")
def test_after_a_verdict_that_finds_no_module_the_probe_keeps_watching(ampguard_log):
    """Corrupt batches at 5 and 6, the block at 9: named at 9 itself, without arming again first."""
    _model, scaler, nonfinite = _corrupt_then_hot(40, corrupt={5, 6}, hot={9, 19, 29})
    assert scaler.stats.fp32_islands == ("blocks.1.attn",) and nonfinite == [5, 6, 9]


@pytest.mark.usefixtures("probe_only")
def test_a_module_overflowing_after_corrupt_batches_is_still_healed(reinstall):
    """Three pairs of corrupt batches: three verdicts without a module, so the probe backs off; the block that
    overflows from step 400 on is named all the same (each quiet spell between the pairs disarms the probe)."""
    reinstall(AMPGUARD_PROBE_STEPS="20")
    _model, scaler, nonfinite = _corrupt_then_hot(600, corrupt={5, 6, 100, 101, 200, 201}, hot=set(range(400, 600, 10)))
    assert scaler.stats.fp32_islands == ("blocks.1.attn",)
    assert nonfinite[:6] == [5, 6, 100, 101, 200, 201] and nonfinite[6:] == [400, 410]


def test_models_trained_one_after_another_each_get_their_islands():
    """An island replacing another model's of the same name is an island made, not a verdict without one."""
    ensemble = []
    for _ in range(4):
        model, scaler, nonfinite = _corrupt_then_hot(40, corrupt=set(), hot={9, 19, 29})
        ensemble.append(model)  # kept alive: the islands of the models before stay theirs
        # named at its first overflow: the headroom watch of step 2 saw it closest to the limit (of this model)
        assert scaler.stats.fp32_islands == ("blocks.1.attn",) and nonfinite == [9]
        assert applied_healing().back_off.fruitless == 0


def test_uninstall_removes_the_islands():
    run = train(3 * EVERY)
    assert module_hooks(run.model) == 2
    ampguard.uninstall()
    assert module_hooks(run.model) == 0 and global_hooks() == 0
    ampguard.install()


def test_each_install_makes_its_own_healing_held_by_its_listener_and_uninstall_closes_it(reinstall):
    """The healing is the applied patch's (issue 34), not module state: the registered islands listener holds it,
    uninstall closes it (the armed probe's global hooks removed) and leaves none to find, the next install makes a
    new one, and with the patch off there is none."""
    reinstall()
    first = applied_healing()
    assert first is not None
    assert [getattr(known, "healing", None) for known in listeners.registered()].count(first) == 1
    first.probe.arm()
    assert global_hooks() > 0
    ampguard.uninstall()
    assert applied_healing() is None and not first.probe.armed and global_hooks() == 0
    ampguard.install()
    second = applied_healing()
    assert second is not None and second is not first and not second.probe.armed
    reinstall(AMPGUARD_DISABLE="fp32_islands")
    assert applied_healing() is None
    assert not any(hasattr(known, "healing") for known in listeners.registered())


def test_islands_are_in_the_stats_line_and_the_checkpoint():
    from ampguard.stats.counters import stats_line

    run = train(3 * EVERY)
    assert "fp32_islands=blocks.1.attn" in stats_line(run.scaler.stats, 0)
    assert run.scaler.state_dict()["ampguard"]["fp32_islands"] == ["blocks.1.attn"]


RESUME = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = {paths!r}
    import ampguard
    from islands_support import make_net, train
    state = torch.load({path!r}, weights_only=True)
    model = make_net(seed=1)
    model.load_state_dict(state["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    optimizer.load_state_dict(state["optimizer"])
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state["scaler"])
    run = train({steps}, model=model, optimizer=optimizer, scaler=scaler, start={start})
    print("RESULT", run.nonfinite_losses, run.scaler.stats.skipped, ",".join(run.scaler.stats.fp32_islands))
""")


def test_checkpoint_round_trip_in_a_new_process_has_no_overflow(tmp_path: Path):
    start = 3 * EVERY
    run = train(start)
    assert run.scaler.stats.fp32_islands == ("blocks.1.attn",)
    path = tmp_path / "checkpoint.pt"
    torch.save(
        {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), "scaler": run.scaler.state_dict()},
        path,
    )
    support = str(Path(__file__).resolve().parents[1] / "support")
    script = RESUME.format(paths=[support], path=str(path), steps=3 * EVERY, start=start)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    nonfinite, skipped_total, names = result[0].split()[1:]
    assert nonfinite == "0" and names == "blocks.1.attn"
    assert int(skipped_total) == run.scaler.stats.skipped  # the counters came back, no new skip
    assert "re-applied from the checkpoint" in done.stderr


def test_non_finite_loss_never_lowers_the_scale_even_without_islands(reinstall):
    reinstall(AMPGUARD_DISABLE="fp32_islands")
    run = train(5 * EVERY)
    assert run.nonfinite_losses == 5 and run.scaler.stats.skipped == 5
    assert run.scaler.stats.min_scale_seen == 1024.0
    assert not math.isnan(run.scaler.stats.scale)


def armings(caplog) -> int:
    return sum(
        len(records(caplog, level, "watching the next forward passes")) for level in (logging.INFO, logging.DEBUG)
    )


def test_a_scripted_block_is_reported_once_and_the_probe_backs_off_instead_of_failing(ampguard_log, monkeypatch):
    """A TorchScript module takes no hooks: it is named with what to do, never made an island (which raised)."""
    model = make_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated, and still used
        model.blocks[1].attn = torch.jit.script(model.blocks[1].attn)
    runs_again = []
    find = rerun.find
    monkeypatch.setattr(rerun, "find", lambda *args: runs_again.append(1) or find(*args))
    run = train(12 * EVERY, model=model)
    assert run.scaler.stats.fp32_islands == ()
    scripted = records(ampguard_log, logging.WARNING, "forward overflow located: blocks.1.attn (Attention)")
    assert len(scripted) == 1 and "TorchScript module" in scripted[0].getMessage()
    assert not records(ampguard_log, logging.WARNING, "probe stopped")
    # 12 overflows, each named from its own forward run again: at the 1st, 2nd and 3rd (verdicts that made no
    # island), then it backs off (2, 4, then 8 overflows pass): again at the 6th and the 11th. The probe never arms.
    assert len(runs_again) == 5 and armings(ampguard_log) == 0
    assert len(records(ampguard_log, logging.INFO, "the forward-overflow probe looks less often")) == 1


@pytest.mark.usefixtures("probe_only")
def test_after_an_error_inside_ampguard_the_probe_stops_for_good(ampguard_log, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(applied_islands(), "decide", broken)
    run = train(6 * EVERY)
    stopped = records(ampguard_log, logging.WARNING, "probe stopped after an error")
    assert len(stopped) == 1 and "does not arm again" in stopped[0].getMessage()
    assert armings(ampguard_log) == 1  # not again at the overflows of steps 30 and 50
    assert global_hooks() == 0 and run.nonfinite_losses == 6 and min(run.scales) >= 1024.0


EXIT_WITH_A_SCALER = """
import torch
from torch.amp.grad_scaler import GradScaler  # (a name held in the script: it changes the order of teardown)
import ampguard
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for _ in range(2):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(2, 4)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
print("trained")
"""


def test_a_scaler_alive_at_interpreter_exit_leaves_no_error_behind():
    """The scaler buffer discovery follows, freed at interpreter exit with the script's globals, engaged the islands
    listener from a weakref callback after ampguard's modules were torn down: "Exception ignored ... TypeError:
    'NoneType' object is not callable" on stderr, at the end of a healthy run (found by the issue-34 review)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")} | {"AMPGUARD_QUIET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITH_A_SCALER], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and "trained" in done.stdout, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
