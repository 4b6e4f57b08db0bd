"""Patch ``trainer_logs``: ampguard's stats in the trainer's own records, with the real libraries.

* coqui ``trainer``: the stats lines (and the skipped-step description) in
  ``trainer_0_log.txt``, between coqui's own lines;
* HF Trainer: ``ampguard/...`` numbers in ``state.log_history`` and in the logs
  every later callback (the reporting integrations) receives; no host read
  added outside the Trainer's logging steps;
* Lightning: the same numbers in the CSV logger's ``metrics.csv`` at
  ``log_every_n_steps``;
* ``AMPGUARD_DISABLE=trainer_logs``: none of it, the records as without ampguard.

Each run is a few steps on CPU (see README.md in this folder for how the
libraries get a CPU scaler). The expected numbers come from where the overflows
are injected: each skipped step halves the scale from 1024.
"""

from __future__ import annotations

import csv
import logging
import textwrap

import pytest
import torch
from integration_support import OverflowInjector, assert_ran, require, run_python

import ampguard
from ampguard.stats.counters import stats_line
from ampguard.syncs import HostReadCounter
from ampguard.trainer_logs import attach as integrations

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::UserWarning"),  # Lightning's num_workers / logging advice
]

STEPS = 8
OVERFLOWS = {2, 5}  # 0-based backward passes: optimizer steps 3 and 6 are skipped


def expected_per_step() -> list[tuple[float, int, int]]:
    """(loss scale, skipped in the step, skipped so far) after each optimizer step 1..STEPS."""
    rows, scale, total = [], 1024.0, 0
    for index in range(STEPS):
        skipped = int(index in OVERFLOWS)
        scale, total = scale / 2**skipped, total + skipped
        rows.append((scale, skipped, total))
    return rows


# -- coqui trainer ---------------------------------------------------------------------------------


def _coqui_fit(tmp_path):
    require("trainer")
    import coqui_tiny

    coqui = coqui_tiny.build_trainer(tmp_path)
    injector = OverflowInjector(coqui.model.net[0].weight, at=OVERFLOWS)
    coqui.fit()
    injector.remove()
    return coqui, (coqui.output_path / "trainer_0_log.txt").read_text().splitlines()


def test_coqui_trainer_log_file_holds_the_stats_lines(tmp_path, reinstall):
    reinstall(AMPGUARD_STATS_EVERY="2")
    coqui, lines = _coqui_fit(tmp_path)
    assert "trainer.trainer" in integrations.attached()
    stats_lines = [line for line in lines if line.startswith("ampguard: stats ")]
    assert [line.split()[2] for line in stats_lines] == ["step=2", "step=4", "step=6", "step=8"]
    scales = [scale for scale, _, _ in expected_per_step()]
    assert [line.split()[3] for line in stats_lines] == [f"scale={scales[i]:g}" for i in (1, 3, 5, 7)]
    assert stats_lines[-1] == "ampguard: " + stats_line(coqui.scaler.stats, 0)  # step 8: nothing skipped in 7-8
    # the skipped-step descriptions too, between coqui's own lines (its step reports, its checkpoint line)
    assert any(line.startswith("ampguard: step 3 skipped at loss scale 1024") for line in lines)
    checkpoint = next(i for i, line in enumerate(lines) if "CHECKPOINT" in line)
    assert lines.index(stats_lines[2]) < checkpoint < lines.index(stats_lines[3])  # checkpoint_5: after step 6


def test_coqui_trainer_log_file_without_ampguard_lines_when_disabled(tmp_path, reinstall, caplog, monkeypatch):
    reinstall(AMPGUARD_STATS_EVERY="2", AMPGUARD_DISABLE="trainer_logs")
    monkeypatch.setattr(logging.getLogger("ampguard"), "propagate", True)
    caplog.set_level(logging.INFO, logger="ampguard")
    _, lines = _coqui_fit(tmp_path)
    assert integrations.attached() == []
    assert any(r.getMessage().startswith("stats step=8 ") for r in caplog.records)  # ampguard did log them
    assert not [line for line in lines if line.startswith("ampguard:")]
    assert any("CHECKPOINT" in line for line in lines)  # coqui's own lines are there


def test_coqui_trainer_imported_before_ampguard_gets_the_lines_too(tmp_path):
    require("trainer")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, "tests/integration")
        import trainer, coqui_tiny  # coqui first
        import ampguard
        coqui = coqui_tiny.build_trainer({str(tmp_path)!r})
        coqui.fit()
        text = (coqui.output_path / "trainer_0_log.txt").read_text()
        print([line for line in text.splitlines() if line.startswith("ampguard: stats ")])
        """
    )
    result = run_python(["-c", script], env={"AMPGUARD_STATS_EVERY": "4"})
    assert_ran(result)
    assert "'ampguard: stats step=4 scale=1024 " in result.stdout and "'ampguard: stats step=8 " in result.stdout


# -- HF Trainer --------------------------------------------------------------------------------------


@pytest.fixture
def hf_trainer():
    """``hf_trainer(tmp_path, optim)``: test_accelerate_hf's tiny GPT-2 Trainer (fp16, CPU scaler, logging_steps=1)."""
    require("accelerate")
    transformers = require("transformers")
    from accelerate.state import AcceleratorState, GradientState
    from test_accelerate_hf import _hf_trainer

    def build(tmp_path, optim="adamw_torch"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        hf, injector = _hf_trainer(transformers, tmp_path, overflow_at=OVERFLOWS, optim=optim)
        return hf, injector

    yield build
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _recorder():
    """A callback after ampguard's (where TensorBoard's and W&B's are): what it is handed in on_log."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    return Recorder()


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])  # host counters; the device-side ledger
def test_hf_trainer_log_history_holds_ampguard_s_numbers(tmp_path, hf_trainer, optim):
    hf, injector = hf_trainer(tmp_path, optim)
    recorder = _recorder()
    hf.add_callback(recorder)
    hf.train()
    injector.remove()
    training = [entry for entry in hf.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in training] == list(range(1, STEPS + 1))
    got = [
        (entry["ampguard/loss_scale"], entry["ampguard/skipped"], entry["ampguard/skipped_total"]) for entry in training
    ]
    assert got == expected_per_step()
    assert all(entry["ampguard/nonfinite_loss"] == 0 and entry["ampguard/fp32_islands"] == 0 for entry in training)
    final = hf.accelerator.scaler.stats
    summary = hf.state.log_history[-1]
    assert "train_runtime" in summary and summary["ampguard/skipped_total"] == final.skipped == 2
    # the later callbacks (the reporting integrations) were handed the same numbers
    assert [{k: v for k, v in logs.items() if k.startswith("ampguard/")} for logs in recorder.logs] == [
        {k: v for k, v in entry.items() if k.startswith("ampguard/")} for entry in hf.state.log_history
    ]
    assert all(isinstance(v, float) for logs in recorder.logs for k, v in logs.items() if k.startswith("ampguard/"))


def test_hf_trainer_evaluation_logs_are_left_alone(tmp_path, hf_trainer):
    hf, injector = hf_trainer(tmp_path)
    hf.train()
    injector.remove()
    metrics = hf.evaluate(hf.train_dataset)
    assert "eval_loss" in metrics and not [key for key in metrics if "ampguard" in key]
    assert not [key for key in hf.state.log_history[-1] if key.startswith("ampguard/")]


def _host_reads(hf) -> int:
    with HostReadCounter() as reads:
        hf.train()
    return reads.total


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_hf_trainer_callback_adds_no_host_read_outside_logging_steps(tmp_path, hf_trainer, reinstall, optim):
    hf, _ = hf_trainer(tmp_path / "on", optim)
    hf.args.logging_steps = 4  # two logging steps and the closing summary: three on_log calls
    with_callback = _host_reads(hf)
    reinstall(AMPGUARD_DISABLE="trainer_logs")
    stock, _ = hf_trainer(tmp_path / "off", optim)
    stock.args.logging_steps = 4
    without = _host_reads(stock)
    added = with_callback - without
    print(f"host reads {optim}: {with_callback} with the callback, {without} without")
    # Host counters: nothing at all. The fused optimizer's device ledger: at most one read per logging step.
    assert added == 0 if optim == "adamw_torch" else 0 <= added <= 3, (with_callback, without)


def test_hf_trainer_without_ampguard_s_numbers_when_disabled(tmp_path, hf_trainer, reinstall):
    reinstall(AMPGUARD_DISABLE="trainer_logs")
    import transformers.trainer

    assert [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS] == ["DefaultFlowCallback"]
    hf, injector = hf_trainer(tmp_path)
    hf.train()
    injector.remove()
    assert hf.accelerator.scaler.stats.skipped == 2  # the scaler still counts
    assert not [key for entry in hf.state.log_history for key in entry if key.startswith("ampguard/")]
    assert "AmpguardCallback" not in [type(c).__name__ for c in hf.callback_handler.callbacks]


def test_uninstall_gives_transformers_its_default_callbacks_back(hf_trainer):
    require("transformers")
    import transformers.trainer

    assert [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS] == ["DefaultFlowCallback", "AmpguardCallback"]
    ampguard.uninstall()
    assert [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS] == ["DefaultFlowCallback"]
    ampguard.install()
    assert [c.__name__ for c in transformers.trainer.DEFAULT_CALLBACKS] == ["DefaultFlowCallback", "AmpguardCallback"]


# -- Lightning ------------------------------------------------------------------------------------


def _lightning_fit(tmp_path):
    L = require("lightning")
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.plugins.precision import MixedPrecision
    from test_lightning import TinyModule, _data

    class LoggingModule(TinyModule):
        def training_step(self, batch, batch_index):
            loss = super().training_step(batch, batch_index)
            self.log("train_loss", loss)  # the user's own metric, in the same rows
            return loss

    torch.manual_seed(0)
    module = LoggingModule()
    module.overflow_at = set(OVERFLOWS)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[MixedPrecision(precision="16-mixed", device="cpu")],
        max_steps=STEPS,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, _data())
    with open(f"{trainer.logger.log_dir}/metrics.csv", newline="") as file:
        return trainer, list(csv.DictReader(file))


def test_lightning_logger_holds_ampguard_s_numbers_at_its_logging_steps(tmp_path):
    trainer, rows = _lightning_fit(tmp_path)
    expected = expected_per_step()
    # Lightning logs after optimizer steps 2, 4, 6, 8 (log_every_n_steps=2), under its 0-based step 1, 3, 5, 7
    assert [int(row["step"]) for row in rows] == [1, 3, 5, 7]
    assert all(row["train_loss"] for row in rows)
    got = [
        (
            float(row["ampguard/loss_scale"]),
            int(float(row["ampguard/skipped"])),
            int(float(row["ampguard/skipped_total"])),
        )
        for row in rows
    ]
    scale_after = [scale for scale, _, _ in expected]
    total_after = [total for _, _, total in expected]
    skipped_since = [
        total_after[1],
        total_after[3] - total_after[1],
        total_after[5] - total_after[3],
        total_after[7] - total_after[5],
    ]
    assert got == [(scale_after[i], skipped_since[n], total_after[i]) for n, i in enumerate((1, 3, 5, 7))]
    assert float(trainer.logged_metrics["ampguard/skipped_total"]) == trainer.precision_plugin.scaler.stats.skipped


def test_lightning_logger_without_ampguard_s_numbers_when_disabled(tmp_path, reinstall):
    reinstall(AMPGUARD_DISABLE="trainer_logs")
    trainer, rows = _lightning_fit(tmp_path)
    assert trainer.precision_plugin.scaler.stats.skipped == 2
    assert "AmpguardCallback" not in [type(c).__name__ for c in trainer.callbacks]
    assert [int(row["step"]) for row in rows] == [1, 3, 5, 7] and all(row["train_loss"] for row in rows)
    assert not [key for row in rows for key in row if key.startswith("ampguard/")]
