"""DeepSpeed's fp16 loss scaling under ampguard, with the real engine on the CPU (gloo, one rank), ZeRO 0-3.

Each case runs against plain DeepSpeed in the same process (tests/deepspeed_fp16/deepspeed_run.py, one
subprocess for all: DeepSpeed's distributed state is per process):

- a block whose float16 activations overflow on every call: plain DeepSpeed raises "Exiting run" (ZeRO 1-3) or
  skips every step (ZeRO 0); under ampguard the run ends, parameters finite, skips counted exactly, the collapse and
  the stall named in the log;
- the block overflowing on every 5th call: every overflow costs one step, counted as the engine counts it, and the
  stats file carries the counts;
- a healthy run from the same scale (``initial_scale_power`` in both), gradients clipped by DeepSpeed: identical
  weights to plain DeepSpeed, and as many host reads per step;
- ``AMPGUARD_ON_STALL=raise``: the run stops with ScaleCollapseError, as asked;
- a block whose float16 activations overflow inside it: plain DeepSpeed skips most steps, under ampguard it
  becomes an fp32 island after 2 and trains (ZeRO 0-3);
- a direct backward: ``loss.backward()`` fails as in plain DeepSpeed; ``engine.scale(loss).backward()`` finds
  forward overflows as ``engine.backward(loss)`` does;
- deepspeed imported after ampguard (as the script does): patched by the post-import hook;
- ``engine.save_checkpoint`` / ``engine.load_checkpoint`` mid-run: ampguard's counts (and islands) go on from the
  checkpoint as in an uninterrupted run, with its weights; a checkpoint of plain DeepSpeed loads under ampguard and
  one saved under ampguard loads in plain DeepSpeed, each giving the weights plain DeepSpeed's own gives.

Skipped where DeepSpeed is not installed (the CI's newest leg installs it; docs/deepspeed.md).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deepspeed_environment import environment

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed (DS_BUILD_OPS=0 pip install deepspeed)"
)

STEPS = 24
# A healthy run is compared with plain DeepSpeed step for step: 8 steps (one stats line, at step 8) show it
HEALTHY_STEPS = 8
# The block overflowing float16 inside it becomes an island at step 2: 12 steps train through it
INSIDE_STEPS = 12
STAGES = (0, 1, 2, 3)
SCRIPT = Path(__file__).with_name("deepspeed_run.py")
ADAMW = {"lr": 1e-3, "torch_adam": True}
EXITING_RUN = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."


def _runs() -> list[dict[str, Any]]:
    runs = []
    for stage in STAGES:
        for overflow, amp, power in (
            ("always", False, None),
            ("always", True, None),
            ("backward", False, None),
            ("backward", True, None),
            ("never", False, 12),
            ("never", True, 12),
            ("inside", False, None),
            ("inside", True, None),
        ):
            run = {"stage": stage, "overflow": overflow, "steps": STEPS, "ampguard": amp, "initial_scale_power": power}
            if overflow == "never":  # clipped (DeepSpeed's gradient_clipping), host reads counted
                run.update(config={"gradient_clipping": 0.05}, count_reads=True, steps=HEALTHY_STEPS)
            if overflow == "inside":  # no weight decay: a parameter moves only where its gradient reaches it
                config = {"optimizer": {"type": "AdamW", "params": {**ADAMW, "weight_decay": 0.0}}}
                run.update(config=config, steps=INSIDE_STEPS)
            runs.append(run)
    runs.append(
        {"stage": 2, "overflow": "backward", "steps": STEPS, "ampguard": True, "env": {"AMPGUARD_ON_STALL": "raise"}}
    )
    runs.append(
        {
            "stage": 2,
            "overflow": "every5",
            "steps": STEPS,
            "ampguard": True,
            "config": {"gradient_accumulation_steps": 2},
        }
    )
    return runs + _checkpoint_runs() + _direct_backward_runs() + _static_scale_runs()


def _static_scale_runs() -> list[dict[str, Any]]:
    """A static ``loss_scale`` of 128 (DeepSpeed's threads' workaround) at ZeRO 0 and 2, the block overflowing
    inside, plain and under ampguard (named ``"static <stage> <plain|ampguard>"``)."""
    runs = []
    for stage in (0, 2):
        for amp in (False, True):
            config = {"fp16": {"enabled": True, "loss_scale": 128}}
            run = {"stage": stage, "overflow": "inside", "steps": 8, "ampguard": amp, "config": config}
            runs.append({**run, "name": f"static {stage} {'ampguard' if amp else 'plain'}"})
    return runs


def _direct_backward_runs() -> list[dict[str, Any]]:
    """``loss.backward()`` at ZeRO 0 and 2, and ``engine.scale(loss).backward()`` at ZeRO 3, the block overflowing
    inside, plain and under ampguard (named ``"<how> <stage> <plain|ampguard>"``): plain DeepSpeed for
    :data:`STEPS` (it dies on the way), under ampguard as long as the runs it is compared with."""
    runs = []
    for how, stage in (("tensor", 0), ("tensor", 2), ("scale", 3)):
        for amp in (False, True):
            name = f"{how} {stage} {'ampguard' if amp else 'plain'}"
            config = {"optimizer": {"type": "AdamW", "params": {**ADAMW, "weight_decay": 0.0}}}
            steps = INSIDE_STEPS if amp else STEPS
            run = {"stage": stage, "overflow": "inside", "steps": steps, "ampguard": amp, "config": config}
            runs.append({**run, "name": name, "backward": how})
    return runs


SAVED_AT = 12


def _checkpoint_runs() -> list[dict[str, Any]]:
    """Named runs from scale 1024: each saver trains 24 steps and saves after step 12, each loader resumes from
    there. ampguard -> ampguard at ZeRO 0-3, the block overflowing in the forward pass on every 5th call (an
    island made; each saver is also the every-5th-call run of the counts' tests); plain -> ampguard and ampguard ->
    plain at ZeRO 0, 2 and 3 (ZeRO 1 saves and loads with ZeRO 2's class), its gradients overflowing on every 5th
    call (which both back off from alike)."""
    runs: list[dict[str, Any]] = []
    for stage in STAGES:
        common = {"stage": stage, "steps": STEPS, "initial_scale_power": 10}
        own = {**common, "overflow": "every5", "ampguard": True}
        save = {"at": SAVED_AT, "name": f"ampguard-{stage}"}
        runs += [{**own, "name": f"ampguard saves {stage}", "save": save}]
        runs += [{**own, "name": f"ampguard loads ampguard {stage}", "load": save}]
        if stage == 1:
            continue
        cross = {**common, "overflow": "backward5"}
        for saver, loader in (("plain", "ampguard"), ("ampguard", "plain")):
            save = {"at": SAVED_AT, "name": f"{saver}-x{stage}"}
            runs += [{**cross, "ampguard": saver == "ampguard", "name": f"{saver} saves x{stage}", "save": save}]
            runs += [
                {**cross, "ampguard": loader == "ampguard", "name": f"{loader} loads {saver} x{stage}", "load": save}
            ]
    bf16 = {
        "stage": 2,
        "steps": STEPS,
        "overflow": "never",
        "config": {"fp16": {"enabled": False}, "bf16": {"enabled": True}},
    }
    save = {"at": SAVED_AT, "name": "bf16"}
    runs += [{**bf16, "ampguard": True, "name": "bf16 saves", "save": save}]
    runs += [{**bf16, "ampguard": True, "name": "bf16 loads", "load": save}]
    return runs


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Any, ...], dict[str, Any]]:
    runs = _runs()
    stats_file = tmp_path_factory.mktemp("deepspeed") / "stats.jsonl"
    env = environment(
        AMPGUARD_MAX_CONSECUTIVE_SKIPS="20",
        AMPGUARD_STATS_EVERY="8",
        AMPGUARD_STATS_FILE=str(stats_file),
        DEEPSPEED_CHECKPOINTS=str(tmp_path_factory.mktemp("checkpoints")),
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(runs)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(runs), done.stderr[-4000:]
    results: dict[Any, dict[str, Any]] = {}
    for run, line in zip(runs, lines):
        if "name" in run:
            results[run["name"]] = line
        elif run.get("config", {}).get("gradient_accumulation_steps"):
            results["accumulating"] = line
        else:
            results[run["stage"], run["overflow"], run["ampguard"], "raise" if run.get("env") else "warn"] = line
    results["stderr"] = done.stderr
    [order] = [line for line in done.stdout.splitlines() if line.startswith("import order: ")]
    results["import order"] = json.loads(order.removeprefix("import order: "))
    return results


def test_deepspeed_imported_after_ampguard_is_patched_by_the_import_hook(results):
    """deepspeed_run.py imports ampguard, then deepspeed (a new process): the post-import hook patched it, before
    any run installed ampguard again (tests/deepspeed_fp16/test_deepspeed_fp16_patch.py: imported before)."""
    order = results["import order"]
    assert order["imported_before_ampguard"] is False
    assert order["update_scale"] == order["hooks"] == "ampguard.deepspeed_fp16.hooks"
    assert order["init_scale"] == 1024


@pytest.mark.parametrize("stage", STAGES)
def test_a_gradient_overflow_on_every_call_kills_or_stalls_plain_deepspeed_and_ampguard_trains_to_the_end(
    results, stage
):
    plain, guarded = results[stage, "backward", False, "warn"], results[stage, "backward", True, "warn"]
    if stage == 0:  # FP16_UnfusedOptimizer stays at its minimum: every step skipped, no error
        assert plain["died"] is None and plain["engine_skipped"] == STEPS
    else:
        assert plain["died"] == f"Exception: {EXITING_RUN}" and plain["died_at"] < STEPS
    assert guarded["died"] is None
    assert guarded["finite"]
    # every step's gradients overflowed (the loss finite): skipped, and counted as the engine counts it
    assert guarded["engine_skipped"] == STEPS
    assert guarded["ampguard"]["skipped"] == guarded["ampguard"]["steps"] == STEPS
    assert guarded["ampguard"]["nonfinite_loss"] == 0
    assert guarded["ampguard"]["max_scale_seen"] == 1024  # the safe start
    assert guarded["scale"] == guarded["ampguard"]["min_scale_seen"] == 1  # the floor, AMPGUARD_MIN_SCALE=1
    collapse = [line for line in guarded["log"] if "overflowed again" in line]
    assert len(collapse) == 1 and collapse[0].startswith("CRITICAL") and "Exiting run" in collapse[0]
    stall = [line for line in guarded["log"] if "consecutive DeepSpeed optimizer steps were skipped" in line]
    assert len(stall) == 1 and stall[0].startswith("CRITICAL: 20 consecutive"), guarded["log"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_forward_overflow_on_every_call_does_not_lower_the_scale(results, stage):
    """The block's output is past float16's range on every call (no island can help: its output is float16): plain
    DeepSpeed lowers its scale at each until it dies or sits at its minimum; under ampguard a loss that is itself
    inf/NaN is not the scale's doing (as under a SafeGradScaler): DeepSpeed's update does not run for it, and only
    the steps whose loss was finite and gradients not (DeepSpeed's hysteresis first at ZeRO 1-3) lower it."""
    plain, guarded = results[stage, "always", False, "warn"], results[stage, "always", True, "warn"]
    if stage == 0:
        assert plain["died"] is None and plain["engine_skipped"] == STEPS and plain["scale"] == 1
    else:
        assert plain["died"] == f"Exception: {EXITING_RUN}" and plain["died_at"] < STEPS
    counts = guarded["ampguard"]
    assert guarded["died"] is None and guarded["finite"]
    assert guarded["engine_skipped"] == counts["skipped"] == counts["steps"] == STEPS
    gradient_overflows = counts["skipped"] - counts["nonfinite_loss"]
    assert gradient_overflows <= 2  # (the loss was finite, its gradients too large for float16, on 2 steps)
    hysteresis = 0 if stage == 0 else 1
    assert guarded["scale"] == counts["min_scale_seen"] == 1024 / 2 ** max(gradient_overflows - hysteresis, 0)
    assert not [line for line in guarded["log"] if "overflowed again" in line]  # never at the floor
    stall = [line for line in guarded["log"] if "consecutive DeepSpeed optimizer steps were skipped" in line]
    assert len(stall) == 1 and stall[0].startswith("CRITICAL: 20 consecutive"), guarded["log"]


@pytest.mark.parametrize("stage", STAGES)
def test_an_overflow_on_every_fifth_call_costs_one_step_each_counted_exactly(results, stage):
    guarded = results[f"ampguard saves {stage}"]  # (saving its checkpoint after step 12 changes nothing)
    assert guarded["died"] is None and guarded["finite"]
    overflows = STEPS // 5
    assert guarded["engine_skipped"] == guarded["ampguard"]["skipped"] == overflows
    assert guarded["ampguard"]["steps"] == STEPS
    assert guarded["ampguard"]["consecutive_skipped"] == 0
    stats = [record for record in guarded["stats_file"] if record["event"] == "stats"]
    assert [record["steps"] for record in stats] == [8, 16, 24]
    assert [record["skipped"] for record in stats] == [1, 3, 4]  # the 5th, 10th, 15th and 20th steps
    assert [record["skipped_in_interval"] for record in stats] == [1, 2, 1]


@pytest.mark.parametrize("stage", STAGES)
def test_a_healthy_run_from_the_same_scale_gives_plain_deepspeeds_weights(results, stage):
    plain, guarded = results[stage, "never", False, "warn"], results[stage, "never", True, "warn"]
    assert plain["died"] is None and guarded["died"] is None
    assert plain["engine_skipped"] == guarded["engine_skipped"] == guarded["ampguard"]["skipped"]
    assert plain["scale"] == guarded["scale"] == 4096  # the config's initial_scale_power=12 wins over 1024
    assert plain["parameters"] == guarded["parameters"]
    assert plain["parameters"] != results[stage, "backward", False, "warn"]["parameters"]  # (they trained)


@pytest.mark.parametrize("stage", STAGES)
def test_healthy_steps_read_the_host_as_often_as_plain_deepspeed(results, stage):
    """ampguard adds no host read (aten::_local_scalar_dense, counted on the CPU as on a GPU) to DeepSpeed's own."""
    plain, guarded = results[stage, "never", False, "warn"], results[stage, "never", True, "warn"]
    assert plain["host_reads"]["aten::_local_scalar_dense"] >= HEALTHY_STEPS - 2  # DeepSpeed's overflow check
    assert guarded["host_reads"] == plain["host_reads"]
    # (the premise: a stats line's step is among those counted, so a read ampguard made there would show)
    assert [record["steps"] for record in guarded["stats_file"] if record["event"] == "stats"] == [HEALTHY_STEPS]


def test_the_exit_summary_tallies_every_deepspeed_scale_that_skipped(results):
    summary = [line for line in results["stderr"].splitlines() if "run summary: " in line]
    assert len(summary) == 1, results["stderr"][-3000:]
    tallies = summary[0].split("run summary: ", 1)[1].rstrip(".").split("; ")
    assert all(tally.startswith("DeepSpeedLossScale#") for tally in tallies), tallies
    counts = sorted(tally.split(": ", 1)[1].split(" steps skipped")[0] for tally in tallies)
    # every step of the 8 always-overflowing runs (forward, gradients), the raise run's 20, the accumulating run's
    # 4 of its 12 optimizer steps, the islanded runs' 2; healthy runs: none
    expected = [f"{STEPS} of {STEPS}"] * 8 + [f"2 of {INSIDE_STEPS}"] * 4 + ["20 of 20", "4 of 12"]
    # the checkpoint runs: each ampguard saver's (the every-5th-call runs) and each resumed one's 4 of 24 (one line
    # per engine: the counts follow ZeRO 1-3's new scaler), a plain checkpoint resumed under ampguard counts its 12
    # steps
    expected += [f"4 of {STEPS}"] * 11 + ["2 of 12"] * 3
    expected += [
        f"2 of {INSIDE_STEPS}"
    ]  # engine.scale(loss).backward() with the island (bare loss.backward(): no step)
    expected += ["2 of 8"] * 2  # the static scale's islanded runs, ZeRO 0 and 2
    assert counts == sorted(expected)


@pytest.mark.parametrize("stage", STAGES)
def test_a_block_overflowing_float16_inside_becomes_an_fp32_island_after_two_steps(results, stage):
    """The block's activations pass 65504 in float16 inside it (its output is finite in float32) on most batches:
    plain DeepSpeed skips most steps; under ampguard the probe arms at the first forward overflow and names the
    block at the second, which then computes in float32 from its float16 parameters (ZeRO 3: copied after
    DeepSpeed gathers them) and trains."""
    plain, guarded = results[stage, "inside", False, "warn"], results[stage, "inside", True, "warn"]
    assert plain["engine_skipped"] >= INSIDE_STEPS // 2 and guarded["died"] is None and guarded["finite"]
    counts = guarded["ampguard"]
    assert counts["skipped"] == counts["nonfinite_loss"] == guarded["engine_skipped"] == 2  # forward overflows
    assert guarded["islands"] == ["2"]
    # the two forward overflows left DeepSpeed's scale where a healthy run has it: at its start (its growth
    # window, 1000 steps, is not reached in 12)
    assert guarded["scale"] == counts["min_scale_seen"] == counts["max_scale_seen"] == 1024
    assert plain["scale"] < guarded["scale"]
    made = [line for line in guarded["log"] if line.startswith("WARNING: fp32 island: 2 (Loud)")]
    assert len(made) == 1 and "step 2" in made[0] and "the model runs without autocast" in made[0]
    assert "its float16 parameters stay float16" in made[0]
    # The island's own weight moved (no weight decay: only its gradients move it), as every other parameter did.
    assert all(now != before for now, before in zip(guarded["parameters"], guarded["initial"], strict=True))
    # ZeRO 1-3 are one computation at one rank: the same weights, so the ZeRO-3 island computes as ZeRO 2's.
    if stage in (1, 3):
        assert guarded["parameters"] == results[2, "inside", True, "warn"]["parameters"]


def test_with_gradient_accumulation_each_optimizer_step_is_counted_once(results):
    accumulating = results["accumulating"]  # ZeRO 2, 2 micro-batches per optimizer step, every 5th overflowing
    assert accumulating["died"] is None and accumulating["finite"]
    assert accumulating["ampguard"]["steps"] == STEPS // 2
    assert accumulating["ampguard"]["skipped"] == accumulating["engine_skipped"] == STEPS // 5


def test_on_stall_raise_stops_the_run_where_asked(results):
    guarded = results[2, "backward", True, "raise"]
    assert guarded["died"].startswith("ScaleCollapseError: 20 consecutive DeepSpeed optimizer steps were skipped")
    assert guarded["died_at"] == 20


@pytest.mark.parametrize("stage", STAGES)
def test_a_checkpoint_resumes_ampguards_counts_and_islands_as_an_uninterrupted_run(results, stage):
    """Saved after step 12 and loaded into a fresh engine: the counts at 24 steps, the stats lines after the load
    and the weights are the uninterrupted run's; the island the probe made is re-applied from the checkpoint."""
    whole, resumed = results[f"ampguard saves {stage}"], results[f"ampguard loads ampguard {stage}"]
    assert whole["died"] is None and resumed["died"] is None
    assert resumed["ampguard"] == whole["ampguard"]  # steps 24, skipped 4, the scales seen, the islands
    assert resumed["engine_skipped"] == whole["engine_skipped"] == 4
    assert resumed["parameters"] == whole["parameters"]
    later = [(r["steps"], r["skipped"]) for r in whole["stats_file"] if r["event"] == "stats" and r["steps"] > 12]
    assert [(r["steps"], r["skipped"]) for r in resumed["stats_file"] if r["event"] == "stats"] == later
    assert whole["islands"] == ["2"] and resumed["islands"] == ["2"]
    assert "INFO: fp32 island 2 (Loud) re-applied from the checkpoint." in resumed["log"]


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoints_load_across_plain_deepspeed_and_ampguard(results, stage):
    """Plain DeepSpeed's checkpoint under ampguard, ampguard's in plain DeepSpeed: no error, and the weights each
    uninterrupted run of the loader gives (same scale, same overflows). Counts of a plain checkpoint start at the
    load, said once at INFO."""
    plain, guarded = results[f"plain saves x{stage}"], results[f"ampguard saves x{stage}"]
    assert plain["parameters"] == guarded["parameters"]  # the same run from the same scale
    into_plain, into_guarded = results[f"plain loads ampguard x{stage}"], results[f"ampguard loads plain x{stage}"]
    assert into_plain["died"] is None and into_guarded["died"] is None
    assert into_plain["parameters"] == into_guarded["parameters"] == plain["parameters"]
    assert into_plain["engine_skipped"] == into_guarded["engine_skipped"] == plain["engine_skipped"] == 4
    counts = into_guarded["ampguard"]
    assert (counts["steps"], counts["skipped"], counts["nonfinite_loss"]) == (STEPS - SAVED_AT, 2, 0)  # 15 and 20
    said = [line for line in into_guarded["log"] if "DeepSpeed checkpoint saved without ampguard" in line]
    assert len(said) == 1 and said[0].startswith("INFO"), into_guarded["log"]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_bare_loss_backward_fails_as_in_plain_deepspeed(results, stage):
    """DeepSpeed refuses ``loss.backward()`` with an fp16 loss scale (ZeRO 0: no direct backward; ZeRO 1-3: the
    loss is not scaled); under ampguard the same error, at the same step, nothing changed before it."""
    plain, guarded = results[f"tensor {stage} plain"], results[f"tensor {stage} ampguard"]
    assert plain["died"].startswith("RuntimeError: ") and plain["died_at"] == 1
    assert (guarded["died"], guarded["died_at"]) == (plain["died"], plain["died_at"])
    assert guarded["parameters"] == plain["parameters"]  # (the float16 copies of the initial weights: no step)


def test_engine_scale_then_backward_finds_forward_overflows_as_engine_backward_does(results):
    """``engine.scale(loss).backward()`` (DeepSpeed's torch-style backward): the loss is kept as for
    ``engine.backward(loss)``, so the block becomes an island after 2 steps with the scale kept, and the run
    ends with engine.backward's weights (ZeRO 3's island computes as ZeRO 2's); plain DeepSpeed dies."""
    plain, guarded = results["scale 3 plain"], results["scale 3 ampguard"]
    assert plain["died"] == f"Exception: {EXITING_RUN}"
    assert guarded["died"] is None and guarded["islands"] == ["2"]
    counts = guarded["ampguard"]
    assert counts["skipped"] == counts["nonfinite_loss"] == guarded["engine_skipped"] == 2
    assert guarded["scale"] == counts["min_scale_seen"] == 1024
    assert guarded["parameters"] == results[3, "inside", True, "warn"]["parameters"]


def test_a_bf16_checkpoint_is_left_as_deepspeeds(results):
    """bf16 has no loss scale: nothing is counted, the optimizer state gains no entry and its load says nothing."""
    saved, loaded = results["bf16 saves"], results["bf16 loads"]
    assert saved["died"] is None and loaded["died"] is None
    assert saved["ampguard"] is None and loaded["ampguard"] is None
    assert not [line for line in loaded["log"] if "checkpoint" in line], loaded["log"]
    assert loaded["parameters"] == saved["parameters"]


@pytest.mark.parametrize("stage", [0, 2])
def test_a_static_loss_scale_gets_its_island_and_its_counts_at_every_stage(results, stage):
    """``"loss_scale": 128``: plain DeepSpeed skips every step the block overflows in (all of them: a static scale
    cannot help a forward overflow); under ampguard the block becomes an island and the run trains, the scale left
    at 128, at ZeRO 0 (FP16_UnfusedOptimizer) and, since a review found them missing, at ZeRO 1-3 (DeepSpeed's
    static LossScaler: no island, no counts)."""
    plain, guarded = results[f"static {stage} plain"], results[f"static {stage} ampguard"]
    assert plain["engine_skipped"] == 7 and not plain["islands"]  # every step from the block's first overflow on
    assert guarded["died"] is None and guarded["finite"] and guarded["scale"] == 128
    assert guarded["islands"] and guarded["engine_skipped"] <= 2
    assert guarded["ampguard"]["steps"] == 8 and guarded["ampguard"]["skipped"] == guarded["engine_skipped"]
    assert guarded["ampguard"]["nonfinite_loss"] == guarded["engine_skipped"]
