"""``ampguard selftest``: every check passes here, and each one fails when the property it checks is broken.

Each check compares a run under ampguard with a reference run on plain torch in
the same process. The tests below break ampguard's side (a scaler that
miscounts or drifts from torch's scale, a host read added per step, a clip that
skips unscaling or never clips, no master weights, a headroom watch or an
underflow sampler that sees nothing, a patch switched off) and assert that the
check then fails, so that a "passed" cannot be vacuous; an error inside
ampguard that ampguard contains (training goes on) fails its check too, with
its message shown. The CUDA-only parts run here with the device mocked (the
test names say so); the tests marked ``cuda`` run on a GPU machine
(``pytest -m cuda``) and are skipped here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ampguard
import ampguard.clip_grad.api
import ampguard.clip_grad.kernels
import ampguard.clip_grad.norm
import ampguard.containment
import ampguard.master_weights.patch
import ampguard.underflow.counts
from ampguard import machine, registry
from ampguard.clip_grad.state import ClipState
from ampguard.commands.selftest import checks, device, faults, report, runner, scaling
from ampguard.commands.selftest.result import CheckResult, Context
from ampguard.patch import torch_release
from ampguard.scaler import SafeGradScaler

ROOT = Path(__file__).resolve().parents[2]
CPU = Context(torch.device("cpu"), quick=True)
NOT_ON_CPU = {"bf16_truth", "legacy_spellings"}


def run(name: str, context: Context = CPU) -> CheckResult:
    return runner.run_checks([checks.by_name(name)], context)[0]


def every_check_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's view: every check applies (so a check whose patch or feature is really off runs, and must fail)."""
    monkeypatch.setattr(runner, "why_not_applicable", lambda check: None)


def watched_pass_class() -> type:
    from ampguard.headroom_watch.watched_pass import WatchedPass

    return WatchedPass


@pytest.mark.parametrize("name", [check.name for check in checks.CHECKS])
def test_each_check_passes_on_this_cpu_or_says_why_it_does_not_apply(name):
    result = run(name)
    if name in NOT_ON_CPU or (name == "skips_and_parity_fused_adam" and not scaling.has_fused_adam(CPU.device)):
        assert result.status == "not applicable" and result.detail
    else:
        assert result.status == "passed", result
        assert result.measured is not None and result.reference is not None


def test_the_command_prints_one_json_document_and_exits_0(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ampguard", "selftest", "--device", "cpu", "--json", "--quick"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "AMPGUARD_QUIET": "1", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["passed"] is True and data["outcome"] == "passed" and data["schema_version"] == 2
    assert data["device"]["name"] == "cpu" and data["quick"] is True
    assert data["versions"]["torch"] == torch.__version__ and data["versions"]["ampguard"] == ampguard.__version__
    assert [c["name"] for c in data["checks"]] == [c.name for c in checks.CHECKS]
    for check in data["checks"]:
        assert {"name", "status", "passed", "detail", "measured", "reference", "ampguard_errors"} <= set(check)
        assert check["passed"] == (check["status"] == "passed") and check["ampguard_errors"] == []
    assert "run summary" not in done.stderr  # the selftest's own skipped steps are not the user's


# -- each check fails when what it checks is broken ---------------------------------------------------------------


def fused_or_not():
    return ["skips_and_parity_sgd", pytest.param("skips_and_parity_fused_adam", marks=needs_fused_adam)]


needs_fused_adam = pytest.mark.skipif(
    not scaling.has_fused_adam(torch.device("cpu")), reason="Adam(fused=True) has no CPU kernel in this torch"
)


@pytest.mark.parametrize("name", fused_or_not())
def test_skips_check_fails_for_a_scaler_that_miscounts(name, monkeypatch):
    counted = SafeGradScaler.stats

    def one_too_few(self):
        stats = counted.fget(self)
        return dataclasses.replace(stats, skipped=stats.skipped - 1)

    monkeypatch.setattr(SafeGradScaler, "stats", property(one_too_few))
    result = run(name)
    assert result.status == "failed" and result.measured["skipped"] == result.reference["skipped"] - 1


@pytest.mark.parametrize("name", fused_or_not())
def test_skips_check_fails_for_a_scale_that_leaves_torchs(name, monkeypatch):
    update = SafeGradScaler.update

    def drifting_update(self, new_scale=None):
        update(self, new_scale)
        self._scale.mul_(1.0 + 2**-10)  # on the device only: the skips are still counted right

    monkeypatch.setattr(SafeGradScaler, "update", drifting_update)
    result = run(name)
    assert result.status == "failed" and "differ from torch's" in result.detail


def test_host_reads_check_fails_for_one_extra_read_per_step(monkeypatch):
    update = SafeGradScaler.update

    def reading_update(self, new_scale=None):
        update(self, new_scale)
        self._scale.item()

    monkeypatch.setattr(SafeGradScaler, "update", reading_update)
    result = run("host_reads")
    assert result.status == "failed" and result.measured["reads"] == 2 * result.reference["reads"]


def test_kernels_check_fails_for_five_more_ops_per_step(monkeypatch):
    update = SafeGradScaler.update

    def busier_update(self, new_scale=None):
        update(self, new_scale)
        for _ in range(5):
            self._scale.mul_(1.0)

    monkeypatch.setattr(SafeGradScaler, "update", busier_update)
    result = run("kernels_per_step")
    assert result.status == "failed"
    assert result.measured["ops_per_step"] - result.reference["ops_per_step"] == pytest.approx(5 + 3, abs=1)


def test_masters_check_fails_with_the_master_path_turned_off(monkeypatch):
    # the patch applied, no masters made (also after the reference run's uninstall/install)
    monkeypatch.setattr(ampguard.master_weights.patch, "DTYPES", {"fp16": (), "all": ()})
    result = run("fp16_model_with_masters")
    assert result.status == "failed" and result.measured["masters"] == 0
    assert not result.measured["finite"] or result.measured["share_of_float32"] < 0.9


def test_clip_check_fails_for_a_clip_that_skips_unscaling(monkeypatch):
    # ampguard's clip no longer sees the scaler: the still-scaled gradients go to torch's clip as they are.
    # (clip_grad_norm_ itself, and get_total_norm / clip_grads_with_norm_, which torch's clip_grad_norm_ calls)
    for module in (ampguard.clip_grad.norm, ampguard.clip_grad.api):
        monkeypatch.setattr(module, "scalers_in_play", lambda: [])
    monkeypatch.setattr(ClipState, "guard_active", lambda self: False)
    assert run("clip_after_unscale").status == "passed"  # unscale_ did the work: nothing broken there
    result = run("clip_without_unscale")
    assert result.status == "failed"
    assert result.measured["norms"][0] == pytest.approx(1024.0 * result.reference["recipe_norms"][0], rel=1e-3)


@pytest.mark.parametrize("name", ["clip_after_unscale", "clip_without_unscale"])
def test_clip_checks_fail_for_a_clip_that_does_not_clip(name, monkeypatch):
    # ampguard's kernels (still-scaled gradients), and in the recipe's case torch's clip_grads_with_norm_ that
    # ampguard calls (torch >= 2.6; before, its clip_grad_norm_, which only the kernels' path can replace here).
    monkeypatch.setattr(ampguard.clip_grad.kernels, "clip_coefficient", lambda max_norm, total: torch.ones_like(total))
    made = ClipState.__init__

    def a_clip_that_does_not_clip(state: ClipState, *args: Any, **kwargs: Any) -> None:  # (the check installs)
        made(state, *args, **kwargs)
        if state.halves is not None:
            state.halves = (state.halves[0], lambda *args: None)

    monkeypatch.setattr(ClipState, "__init__", a_clip_that_does_not_clip)
    if not hasattr(torch.nn.utils, "get_total_norm"):  # torch < 2.6: the recipe's case through the kernels
        recipe_case = ampguard.clip_grad.norm._recipe_case
        monkeypatch.setattr(
            ampguard.clip_grad.norm, "_recipe_case", lambda params: (case := recipe_case(params)) and (case[0], True)
        )
    result = run(name)
    assert result.status == "failed" and result.measured["max_parameter_difference"] > 1e-6


# The check of each feature, when the user switched it off or set it to report only: "not applicable" with the
# reason (the patch, or the setting), and forced to run, "failed".
SWITCHED_OFF = [
    ({"AMPGUARD_DISABLE": "grad_scaler"}, "skips_and_parity_sgd", "patch grad_scaler disabled"),
    ({"AMPGUARD_DISABLE": "grad_scaler"}, "host_reads", "patch grad_scaler disabled"),
    ({"AMPGUARD_DISABLE": "fp32_islands"}, "forward_overflow_healed", "patch fp32_islands disabled"),
    ({"AMPGUARD_FP32_ISLANDS": "report"}, "forward_overflow_healed", "AMPGUARD_FP32_ISLANDS=report"),
    ({"AMPGUARD_FP32_ISLANDS": "report"}, "headroom_watch", "AMPGUARD_FP32_ISLANDS=report"),
    ({"AMPGUARD_WATCH_EVERY": "0"}, "headroom_watch", "AMPGUARD_WATCH_EVERY=0"),
    ({"AMPGUARD_UNDERFLOW": "off"}, "underflow_sampled", "AMPGUARD_UNDERFLOW=off"),
    ({"AMPGUARD_DISABLE": "underflow"}, "underflow_sampled", "patch underflow disabled"),
    ({"AMPGUARD_MASTER_WEIGHTS": "off"}, "fp16_model_with_masters", "patch"),
    ({"AMPGUARD_DISABLE": "clip_grad"}, "clip_without_unscale", "patch clip_grad disabled"),
    ({"AMPGUARD_DISABLE": "grad_scaler"}, "kernels_per_step", "patch grad_scaler disabled"),
]


@pytest.mark.parametrize("variables,name,why", SWITCHED_OFF)
def test_a_switched_off_feature_makes_its_check_not_applicable(variables, name, why, reinstall):
    reinstall(**variables)
    result = run(name)
    assert result.status == "not applicable" and why in result.detail


# (not where the check's own settings override the user's: headroom_watch's AMPGUARD_WATCH_EVERY=1 watches anyway)
FORCED = [case for case in SWITCHED_OFF if not set(case[0]) & dict(checks.by_name(case[1]).settings).keys()]


@pytest.mark.parametrize("variables,name,why", FORCED)
def test_a_switched_off_feature_fails_its_check_when_forced_to_run(variables, name, why, reinstall, monkeypatch):
    reinstall(**variables)
    every_check_forced(monkeypatch)
    assert run(name).status == "failed"


SCHEDULES = [
    ("AMPGUARD_WATCH_EVERY", "1", "watch_every", "kernels_per_step"),  # every step watched: the watch's ops
    ("AMPGUARD_UNDERFLOW_EVERY", "1", "underflow_every", "kernels_per_step"),  # every step sampled
    ("AMPGUARD_HEADROOM", "65504", "headroom", "skips_and_parity_sgd"),  # every module an island at step 2
]


@pytest.mark.parametrize("variable,value,field,name", SCHEDULES)
def test_a_users_schedule_does_not_fail_the_checks_of_healthy_steps(variable, value, field, name, reinstall):
    # the checks run with the default schedule (a watched or sampled step is no healthy step, and an island made
    # where nothing overflows departs from torch by design); the user's own settings are installed again afterwards
    reinstall(**{variable: value})
    assert run(name).status == "passed"
    assert getattr(registry.active_config(), field) == float(value)


# -- the headroom watch and the underflow sampler: broken silently, or raising inside ampguard ----------------------


def test_watch_check_fails_for_a_watch_that_sees_nothing(monkeypatch):
    monkeypatch.setattr(watched_pass_class(), "measure", lambda self, output: None)
    result = run("headroom_watch")
    assert result.status == "failed" and not result.ampguard_errors
    assert result.measured["ahead_of_overflow"]["nonfinite_loss_steps"]  # no island ahead: the loud batch overflowed
    assert "loud" not in result.measured["observation_only"]["headroom"]


def test_underflow_check_fails_for_a_sampler_that_counts_nothing(monkeypatch):
    monkeypatch.setattr(ampguard.underflow.gradients.Gradients, "add", lambda self, *args, **kwargs: None)
    result = run("underflow_sampled")
    assert result.status == "failed" and result.measured["tiny_loss"]["underflow_values"] == 0
    assert result.reference["tiny_loss"]["underflow_values"] > 0


def injected(*args, **kwargs):
    raise RuntimeError("injected fault")


FAULTS = [
    ("forward_overflow_healed", lambda: (watched_pass_class(), "measure"), "headroom watch stopped after an error"),
    ("headroom_watch", lambda: (watched_pass_class(), "measure"), "headroom watch stopped after an error"),
    (
        "underflow_sampled",
        lambda: (ampguard.underflow.gradients.Gradients, "add"),
        "underflow sample (backward node hook)",
    ),
]


@pytest.mark.parametrize("name,where,message", FAULTS)
def test_a_contained_fault_inside_the_feature_fails_its_check_and_names_it(name, where, message, monkeypatch):
    monkeypatch.setattr(*where(), injected)
    result = run(name)
    assert result.status == "failed" and "RuntimeError: injected fault" in result.detail and message in result.detail
    assert any(message in error for error in result.ampguard_errors)


def test_the_command_exits_1_and_shows_a_contained_fault(monkeypatch, capsys):
    monkeypatch.setattr(checks, "CHECKS", [checks.by_name("underflow_sampled")])
    monkeypatch.setattr(ampguard.underflow.gradients.Gradients, "add", injected)
    from ampguard import cli

    assert cli.main(["selftest", "--device", "cpu", "--quick"]) == 1
    captured = capsys.readouterr()
    assert "ampguard's underflow sample (backward node hook) failed: RuntimeError: injected fault" in captured.out
    assert "injected fault" not in captured.err  # the log is held back; the table says it


def test_every_contained_report_is_recorded_not_only_the_first_per_hook():
    with faults.recorded() as recorder:
        for _ in range(2):
            ampguard.containment.report("selftest's test hook", ValueError("bad"))
    assert recorder.errors == ["ampguard's selftest's test hook failed: ValueError: bad"] * 2
    assert ampguard.containment.report.__name__ == "report"  # put back


# -- the CUDA-only checks, with the device mocked --------------------------------------------------------------------


@pytest.mark.skipif(
    torch_release().release < (2, 4),
    reason="torch's legacy spellings warn from torch 2.4 on: nothing to compare before",
)
def test_legacy_spellings_code_path_mocked_cuda_with_torch_cpu_amp_standing_in():
    # The CUDA check runs legacy_check with torch.cuda.amp's classes; torch.cpu.amp's are the same kind of wrapper.
    with faults.recorded():
        result = device.legacy_check(CPU, torch.cpu.amp.autocast, torch.cpu.amp.GradScaler)
    assert result.status == "passed", result
    assert result.measured["future_warnings"] == [] and result.reference["future_warnings"]  # torch warns; we don't


@pytest.mark.skipif(
    torch_release().release < (2, 4),
    reason="torch's legacy spellings warn from torch 2.4 on: nothing to compare before",
)
def test_legacy_spellings_fail_with_the_autocast_patch_off_mocked_cuda_with_torch_cpu_amp(reinstall):
    reinstall(AMPGUARD_DISABLE="autocast")
    with faults.recorded():
        result = device.legacy_check(CPU, torch.cpu.amp.autocast, torch.cpu.amp.GradScaler)
    assert result.status == "failed" and result.measured["future_warnings"]


def gpu(capability: tuple[int, int]) -> machine.GpuInfo:
    return machine.GpuInfo(0, "mocked", capability, 16.0, machine.has_native_bf16(capability))


@pytest.mark.parametrize(
    "capability,slowdown,status",
    [
        ((7, 5), 8.0, "passed"),  # T4: emulated bf16, the doctor says fp16
        ((8, 0), 1.0, "passed"),  # A100: native, as fast as fp16
        ((8, 0), 6.0, "failed"),  # "native" by capability, yet emulation-slow: the doctor's rule is wrong here
    ],
)
def test_bf16_truth_mocked_cuda(capability, slowdown, status, monkeypatch):
    report = machine.CudaReport(build="12.4", hip=None, cudnn=None, available=True, gpus=[gpu(capability)])
    monkeypatch.setattr(machine, "cuda_report", lambda: report)
    monkeypatch.setattr(machine, "gpu_info", lambda index: gpu(capability))
    monkeypatch.setattr(device, "bf16_slowdown", lambda context: slowdown)
    result = device.bf16_truth(Context(torch.device("cuda", 0)))
    assert result.status == status and result.measured["bf16_over_fp16_time"] == slowdown
    assert result.reference["doctor"] == ("bf16" if capability >= (8, 0) else "fp16")


def test_bf16_judgement_fails_a_recommendation_that_contradicts_the_device():
    assert device.bf16_judgement(False, 8.0, "bf16")[0] is False
    assert device.bf16_judgement(True, 1.0, "fp16")[0] is False


def test_bf16_slowdown_is_measured_here():
    assert device.bf16_slowdown(CPU) > 0  # the CPU numbers are reported, never judged


# -- the runner, the command and its output --------------------------------------------------------------------------


def broken(context: Context) -> CheckResult:
    raise RuntimeError("boom")


def test_a_check_that_raises_is_a_failure_that_names_the_exception():
    result = runner.run_checks([runner.Check("broken", broken, ())], CPU)[0]
    assert result.status == "failed" and result.detail == "raised RuntimeError: boom"


def test_a_failed_check_exits_1_and_says_what_to_report(monkeypatch, capsys):
    monkeypatch.setattr(checks, "CHECKS", [runner.Check("broken", broken, ()), checks.by_name("legacy_spellings")])
    from ampguard import cli

    assert cli.main(["selftest", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "broken" in out and "raised RuntimeError: boom" in out and "ampguard selftest --json" in out
    assert "versions:" in out


def test_no_check_ran_is_not_a_pass_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(checks, "CHECKS", [checks.by_name("legacy_spellings")])  # not applicable on a CPU
    from ampguard import cli

    assert cli.main(["selftest", "--device", "cpu", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is False and data["outcome"] == "nothing checked"
    assert data["checks"][0]["status"] == "not applicable"
    assert data["patches"] == {entry.name: entry.state for entry in ampguard.status()}
    assert cli.main(["selftest", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "no check ran" in out and "all checks that apply here passed" not in out


@pytest.mark.parametrize("name", ["cuda:0", "cuda"])
def test_a_cuda_device_without_cuda_exits_2(name, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    from ampguard import cli

    assert cli.main(["selftest", "--device", name]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


def test_a_device_that_is_not_one_exits_2(capsys):
    from ampguard import cli

    assert cli.main(["selftest", "--device", "gpu"]) == 2
    assert "not a device" in capsys.readouterr().err


def test_the_report_lists_each_check_with_its_status():
    results = [CheckResult("a", "passed", 1, 1, "fine"), CheckResult("b", "not applicable", None, None, "why")]
    data = report.document(torch.device("cpu"), True, results, 1.0)
    assert report.passed(results) and data["checks"][1]["passed"] is False and data["outcome"] == "passed"
    assert report.outcome([*results, CheckResult("c", "failed", 2, 1, "bad")]) == "failed"
    assert report.outcome(results[1:]) == "nothing checked" and not report.passed(results[1:])


# -- on a GPU machine (pytest -m cuda) ------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", [check.name for check in checks.CHECKS])
def test_each_check_passes_on_the_gpu(name):
    result = run(name, Context(torch.device("cuda"), quick=True))
    assert result.status == "passed", result


@pytest.mark.cuda
def test_selftest_passes_on_the_gpu(capsys):
    from ampguard import cli

    assert cli.main(["selftest", "--device", "cuda", "--json"]) == 0, capsys.readouterr().out
    data = json.loads(capsys.readouterr().out)
    statuses = {c["name"]: c["status"] for c in data["checks"]}
    assert statuses["legacy_spellings"] == "passed" and statuses["skips_and_parity_fused_adam"] == "passed"
