"""``ampguard bench``: the synchronisation counts (deterministic, asserted) and the command end to end.

No test here asserts a time: times depend on the machine and its load.
docs/performance.md has the measured numbers and the method.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
import torch

import ampguard
import ampguard.scaler
from ampguard import cli
from ampguard.commands.bench import counting, markdown, report, runs
from ampguard.commands.bench.timing import time_steps
from ampguard.commands.console import print_table
from ampguard.syncs import HostReadCounter

TINY = runs.ModelSpec(vocab=64, d_model=16, heads=2, ff=32, layers=2, seq=8, batch=2)
OPTIONS = runs.Options(device="cpu", model=TINY)
FUSED_UNAVAILABLE = runs.fused_unavailable_reason("cpu")
needs_fused = pytest.mark.skipif(FUSED_UNAVAILABLE is not None, reason=f"fused AdamW on CPU: {FUSED_UNAVAILABLE}")

JSON_FIELDS = {
    "schema",
    "environment",
    "settings",
    "patches",
    "clip_wrapped",
    "step_time",
    "syncs",
    "clip_idle",
    "sampled_steps",
    "import_time",
    "targets",
    "checks",
}
UNDERFLOW_SAMPLE_FIELDS = {
    "healthy_ms",
    "sampled_ms",
    "ratio",
    "ratio_min",
    "ratio_max",
    "ratio_stderr",
    "extra_reads",
    "float16_gradient_values",
    "every",
    "overhead_at_every",
    "blocks",
}
STEP_TIME_FIELDS = {
    "optimizer",
    "torch_ms_per_step",
    "ampguard_ms_per_step",
    "ratio",
    "ratio_min",
    "ratio_max",
    "ratio_stderr",
    "overhead_us_per_step",
    "blocks",
    "block_steps",
    "same_parameters",
    "underflow_growths",
}
SYNC_FIELDS = {
    "optimizer",
    "torch_per_step",
    "ampguard_per_step",
    "extra_per_step",
    "ampguard_per_stats_report",
    "optimizer_host_reads_per_step",
    "torch_ops_per_step",
    "ampguard_ops_per_step",
    "extra_ops_per_step",
}
CLIP_FIELDS = {
    "tensors",
    "tensor_shape",
    "wrapped",
    "torch_us_per_call",
    "ampguard_us_per_call",
    "overhead",
    "overhead_min",
    "overhead_max",
    "overhead_stderr",
    "torch_syncs_per_call",
    "ampguard_syncs_per_call",
    "blocks",
}
IMPORT_FIELDS = {
    "runs",
    "bytecode_cache",
    "torch_ms",
    "ampguard_ms",
    "ampguard_ms_min",
    "ampguard_ms_max",
    "ampguard_cpu_ms",
    "ampguard_terminal_ms",
    "ampguard_terminal_cpu_ms",
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a busy 2-core machine two threads spin against each other (slow, not wrong)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- the synchronisation counts ---------------------------------------------------------


def test_plain_optimizer_one_sync_per_step_each_and_none_added():
    counted = counting.count_syncs(OPTIONS, fused=False)
    assert counted["torch_per_step"] == 1  # torch's own found_inf read in step()
    assert counted["ampguard_per_step"] == 1  # the same read, carrying the loss bit too
    assert counted["extra_per_step"] == 0
    assert counted["ampguard_per_stats_report"] == 0  # host mode: the counters are already on the host
    # AdamW reads its CPU step counters either way (no device sync, also on a GPU): same for both.
    torch_host, ampguard_host = counted["optimizer_host_reads_per_step"]
    assert torch_host == ampguard_host > 0


@needs_fused
def test_fused_optimizer_no_sync_per_step_and_one_per_stats_report():
    counted = counting.count_syncs(OPTIONS, fused=True)
    assert counted["torch_per_step"] == 0
    assert counted["ampguard_per_step"] == 0
    assert counted["extra_per_step"] == 0
    assert counted["ampguard_per_stats_report"] == 1  # the packed device-ledger read
    assert counted["optimizer_host_reads_per_step"] == [0, 0]


@needs_fused
def test_stats_lines_are_the_only_reads_with_a_fused_optimizer(reinstall):
    reinstall(AMPGUARD_STATS_EVERY="2")
    torch_run, ampguard_run = runs.make_runs(OPTIONS, fused=True)
    torch_run.steps(1)
    ampguard_run.steps(1)
    with HostReadCounter() as torch_reads:
        torch_run.steps(6)
    with HostReadCounter() as ampguard_reads:
        ampguard_run.steps(6)  # steps 2..7: stats lines after steps 2, 4 and 6
    assert torch_reads.total == 0
    assert ampguard_reads.total == 3
    assert ampguard_reads.by_source["ampguard.read_to_host"] == 3


def test_plain_optimizer_stats_lines_read_nothing(reinstall):
    reinstall(AMPGUARD_STATS_EVERY="1")
    _, ampguard_run = runs.make_runs(OPTIONS, fused=False)
    ampguard_run.steps(1)
    syncs, _, _ = counting.count_steps(ampguard_run, 3)
    assert syncs == 3  # torch's found_inf read of each step(), nothing for the three stats lines


def test_sync_counts_are_the_same_every_time():
    first = counting.count_syncs(OPTIONS, fused=False)
    second = counting.count_syncs(OPTIONS, fused=False)
    assert first == second


# -- the two implementations ------------------------------------------------------------


def test_torch_variant_gets_torchs_originals_through_ampguards_wrappers():
    implementation = runs.torch_implementations()
    clip = implementation.clip_grad_norm_
    assert not runs.is_ampguard_wrapper(clip)
    assert clip.__code__.co_filename.endswith("clip_grad.py") and "torch" in clip.__code__.co_filename
    # (module attributes, not names imported here: install rebinds every module global holding torch's class)
    assert issubclass(implementation.scaler_class, ampguard.scaler.TorchGradScaler)
    assert not issubclass(implementation.scaler_class, ampguard.SafeGradScaler)
    for name in ("scale", "unscale_", "step", "update"):
        assert not runs.is_ampguard_wrapper(getattr(implementation.scaler_class, name))
    assert not runs.is_ampguard_wrapper(implementation.autocast.__init__)


def test_clip_patch_applied_means_the_ampguard_variant_clips_through_it():
    states = {entry.name: entry.state for entry in ampguard.status()}
    if states.get("clip_grad") != "applied":
        pytest.skip("the clip_grad patch is not applied here")
    assert runs.clip_is_wrapped()
    assert runs.unwrap_ampguard(torch.nn.utils.clip_grad_norm_) is runs.torch_implementations().clip_grad_norm_


def test_without_ampguard_both_variants_use_torchs_objects(stock_torch):
    implementation = runs.torch_implementations()
    assert implementation.scaler_class is ampguard.scaler.TorchGradScaler
    assert implementation.autocast is torch.amp.autocast_mode.autocast
    assert implementation.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
    assert not runs.clip_is_wrapped()


def test_healthy_training_is_bit_identical_under_ampguard():
    timing = time_steps(runs.Options(device="cpu", model=TINY, steps=6, block_steps=2, warmup_steps=2), fused=False)
    assert timing["same_parameters"] is True and timing["underflow_growths"] == 0
    assert timing["blocks"] == 3 and timing["block_steps"] == 2


def test_the_table_says_why_weights_differ_when_the_scale_grew_for_underflow():
    from ampguard.commands.bench.markdown import _same_weights

    assert _same_weights({"same_parameters": True, "underflow_growths": 0}) == "yes"
    assert _same_weights({"same_parameters": False, "underflow_growths": 3}).startswith("no: the scale grew 3x")
    assert _same_weights({"same_parameters": False, "underflow_growths": 0}) == "NO"  # nothing explains it


# -- the command ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_json(_one_thread) -> dict:
    stdout = io.StringIO()
    argv = [
        "bench",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--block-steps",
        "1",
        "--warmup-steps",
        "1",
        "--import-runs",
        "1",
        "--fused",
        "--threads",
        "1",
        "--json",
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdout", stdout)
        patch.setattr(
            runs.ModelSpec, "for_device", classmethod(lambda cls, device: TINY)
        )  # the command's model, smaller
        assert cli.main(argv) == 0
    return json.loads(stdout.getvalue())


def test_bench_json_has_the_documented_fields(bench_json):
    assert set(bench_json) == JSON_FIELDS
    assert bench_json["schema"] == report.SCHEMA_VERSION
    assert set(bench_json["step_time"]) == {"plain", "fused"}
    assert set(bench_json["step_time"]["plain"]) == STEP_TIME_FIELDS
    fused = bench_json["step_time"]["fused"]
    assert fused is None if FUSED_UNAVAILABLE else set(fused) == STEP_TIME_FIELDS
    assert set(bench_json["syncs"]) == {"plain", "fused"}
    assert set(bench_json["syncs"]["plain"]) == SYNC_FIELDS
    if FUSED_UNAVAILABLE:
        assert set(bench_json["syncs"]["fused"]) == {"optimizer", "unavailable"}
    else:
        assert set(bench_json["syncs"]["fused"]) == SYNC_FIELDS
    assert set(bench_json["clip_idle"]) == CLIP_FIELDS
    watched = bench_json["sampled_steps"]["headroom_watch"]
    assert set(watched) == {"normal_ms", "watched_ms", "ratio", "every", "amortised", "pairs"}
    assert watched["every"] == 100 and watched["ratio"] > 0
    sample = bench_json["sampled_steps"]["underflow"]
    assert set(sample) == UNDERFLOW_SAMPLE_FIELDS
    assert set(bench_json["import_time"]) == IMPORT_FIELDS
    assert bench_json["targets"] == report.TARGETS
    assert {c["name"] for c in bench_json["checks"]} == set(report.TARGETS)
    assert all(set(c) == {"name", "target", "measured", "ok", "unreliable"} for c in bench_json["checks"])
    assert bench_json["environment"]["torch_threads"] == 1
    assert bench_json["settings"]["model"] == {
        "vocab": 64,
        "d_model": 16,
        "heads": 2,
        "ff": 32,
        "layers": 2,
        "seq": 8,
        "batch": 2,
    }


def test_bench_json_values_that_do_not_depend_on_the_machine(bench_json):
    assert bench_json["syncs"]["plain"]["extra_per_step"] == 0
    assert next(c for c in bench_json["checks"] if c["name"] == "extra_syncs_per_step")["ok"] is True
    assert bench_json["step_time"]["plain"]["same_parameters"] is True
    assert bench_json["step_time"]["plain"]["blocks"] == 2
    assert bench_json["import_time"]["runs"] == 1
    assert bench_json["clip_idle"]["tensors"] == 100
    # bfloat16 autocast on the CPU has no float16 gradient: the sample counts none and reads nothing.
    sample = bench_json["sampled_steps"]["underflow"]
    assert sample["float16_gradient_values"] == 0 and sample["extra_reads"] == 0 and sample["every"] == 100
    assert bench_json["patches"] == {entry.name: entry.state for entry in ampguard.status()}
    assert bench_json["settings"]["autocast_dtype"] == "bfloat16"
    for timing in filter(None, bench_json["step_time"].values()):
        assert timing["ratio_min"] <= timing["ratio"] <= timing["ratio_max"]
        assert timing["torch_ms_per_step"] > 0 and timing["ampguard_ms_per_step"] > 0


def test_bench_table_plain_text(bench_json):
    stream = io.StringIO()
    print_table(
        "ampguard bench",
        ["measure", "torch", "ampguard", "result", "target", "met"],
        list(report.iter_table_rows(bench_json)),
        stream=stream,
    )
    text = stream.getvalue()
    assert "step time, AdamW" in text
    assert "median paired ratio" in text  # not the ratio of the two medians in the columns before it
    assert "syncs/step, AdamW" in text
    assert "import ampguard after torch" in text
    assert "clip_grad_norm_, 100 tensors, nothing scaled" in text
    assert "a step sampled for underflow" in text


# -- what the table says of its own figures (a synthetic result: wording and logic, no timing) ----------


def _synthetic(load: float, ratio_stderr: float = 0.001) -> dict:
    """A bench result on a 2-core machine: torch's median faster, the paired ratio under 1, the targets missed."""
    result = {
        "environment": {
            "ampguard": "0.1.0",
            "torch": "2.14.1",
            "python": "3.11.7",
            "device": "cpu",
            "device_name": "x86_64",
            "cpu_count": 2,
            "torch_threads": 2,
            "load_average_before": [load, load, load],
            "load_average_after": [load + 2, load, load],
        },
        "settings": {
            "steps": 50,
            "block_steps": 1,
            "warmup_steps": 10,
            "autocast_dtype": "float16",
            "fused": False,
            "model": dataclasses.asdict(TINY),
        },
        "clip_wrapped": True,
        "step_time": {
            "plain": {
                "optimizer": "AdamW",
                "torch_ms_per_step": 10.0,
                "ampguard_ms_per_step": 10.5,  # the medians: ampguard slower ...
                "ratio": 1.02,  # ... the ratio too: they agree here
                "ratio_min": 0.6,
                "ratio_max": 1.7,
                "ratio_stderr": ratio_stderr,
                "overhead_us_per_step": 200.0,
                "blocks": 50,
                "block_steps": 1,
                "same_parameters": True,
                "underflow_growths": 0,
            },
            "fused": {
                "optimizer": "AdamW(fused=True)",
                "torch_ms_per_step": 10.0,
                "ampguard_ms_per_step": 9.8,  # the medians: ampguard faster; the paired ratio: slower
                "ratio": 1.03,
                "ratio_min": 0.6,
                "ratio_max": 1.7,
                "ratio_stderr": ratio_stderr,
                "overhead_us_per_step": 300.0,
                "blocks": 50,
                "block_steps": 1,
                "same_parameters": True,
                "underflow_growths": 0,
            },
        },
        "syncs": {
            "plain": {
                "optimizer": "AdamW",
                "torch_per_step": 1,
                "ampguard_per_step": 1,
                "extra_per_step": 0,
                "ampguard_per_stats_report": 0,
                "torch_ops_per_step": 100,
                "ampguard_ops_per_step": 104,
                "extra_ops_per_step": {"aten::mul_": 4},
            }
        },
        "clip_idle": {
            "tensors": 100,
            "tensor_shape": [64, 64],
            "wrapped": True,
            "torch_us_per_call": 500.0,
            "ampguard_us_per_call": 520.0,
            "overhead": 0.03,
            "overhead_min": -0.2,
            "overhead_max": 0.4,
            "overhead_stderr": 0.004,
            "torch_syncs_per_call": 0,
            "ampguard_syncs_per_call": 0,
            "blocks": 30,
        },
        "sampled_steps": {},
        "import_time": {
            "runs": 5,
            "bytecode_cache": True,
            "torch_ms": 900.0,
            "ampguard_ms": 60.0,
            "ampguard_ms_min": 55.0,
            "ampguard_ms_max": 70.0,
            "ampguard_cpu_ms": 25.0,
            "ampguard_terminal_ms": None,
            "ampguard_terminal_cpu_ms": None,
        },
        "targets": dict(report.TARGETS),
    }
    result["checks"] = report.checks(result)
    return result


def _table_text(result: dict) -> str:
    stream = io.StringIO()
    print_table(
        report.title(result),
        ["measure", "torch", "ampguard", "result", "target", "met"],
        list(report.iter_table_rows(result)),
        stream=stream,
    )
    return stream.getvalue()


def test_bench_table_says_what_ran():
    text = _table_text(_synthetic(load=0.1))
    title = text.splitlines()[0]
    for said in ("cpu (x86_64, 2 cores)", "autocast float16", "2 torch thread(s)", "load average 0.10 before"):
        assert said in title
    assert "others' 0.05 per core" in title  # the bench's own 2 threads are taken off the load after


def test_a_quiet_machine_misses_a_target_with_a_flat_no():
    result = _synthetic(load=0.1)
    assert all(c["unreliable"] is None for c in result["checks"])
    text = _table_text(result)
    step_rows = [line for line in text.splitlines() if line.startswith("step time")]
    assert all(line.rstrip().endswith("NO") for line in step_rows)
    assert report.unreliable_note(result) is None
    assert "unreliable" not in text and "unreliable" not in markdown.render(result, "python -m ampguard bench")


def test_a_busy_machine_says_its_timed_figures_are_unreliable_instead_of_no():
    result = _synthetic(load=1.5)  # others' load: 1.5 before, 3.5 - 2 after: 1.5 / 2 cores = 0.75 per core
    verdicts = {c["name"]: report.verdict(c["ok"], c["unreliable"]) for c in result["checks"]}
    assert verdicts == {
        "step_time_ratio": "unreliable",
        "extra_syncs_per_step": "yes",  # counted, not timed: the load changes nothing
        "import_overhead_ms": "unreliable",
        "clip_idle_overhead": "unreliable",
    }
    assert "load 0.75/core" in next(c["unreliable"] for c in result["checks"] if c["name"] == "step_time_ratio")
    text = _table_text(result)
    assert "others' 0.75 per core" in text.splitlines()[0]
    step_rows = [line for line in text.splitlines() if line.startswith("step time")]
    assert step_rows and all(line.rstrip().endswith("unreliable") for line in step_rows)
    note = report.unreliable_note(result)
    assert note is not None and note.startswith("unreliable: step_time_ratio (load 0.75/core")
    section = markdown.render(result, "python -m ampguard bench")
    assert (
        "busy, the timings are unreliable" in section and "| step_time_ratio | <= 1.01 | 1.03 | unreliable |" in section
    )
    assert "Unreliable: step_time_ratio" in section


def test_a_wide_spread_is_unreliable_on_a_quiet_machine_too():
    result = _synthetic(load=0.1, ratio_stderr=0.02)
    why = next(c["unreliable"] for c in result["checks"] if c["name"] == "step_time_ratio")
    assert why is not None and why.startswith("spread: +-0.0200 s.e.") and "load" not in why
    assert next(c["unreliable"] for c in result["checks"] if c["name"] == "extra_syncs_per_step") is None


def test_the_medians_that_point_the_other_way_from_the_ratio_are_called_out():
    result = _synthetic(load=0.1)
    rows = {line.split("  ")[0]: line for line in _table_text(result).splitlines() if line.startswith("step time")}
    assert report.DISAGREE in rows["step time, AdamW(fused=True)"]  # 9.8 < 10.0 ms, ratio 1.03
    assert report.DISAGREE not in rows["step time, AdamW"]  # 10.5 > 10.0 ms, ratio 1.02
    assert "ms (median)" in rows["step time, AdamW"]
    section = markdown.render(result, "python -m ampguard bench")
    assert section.count("(the medians point the other way: drift)") == 1
    assert "not the ratio of the two medians beside it" in section


def test_bench_rejects_a_device_it_does_not_have(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cli.main(["bench", "--device", "cuda", "--json"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_is_listed_by_the_cli():
    parser = cli.build_parser()
    assert "bench" in parser.format_help()


# -- docs/performance.md's generated section (its structure; never its numbers) ----------

PERFORMANCE_MD = Path(__file__).resolve().parents[2] / "docs" / "performance.md"
SECTIONS = [
    "### Step time",
    "### Host-device synchronisations and aten ops per step (counted, not timed)",
    "### Import time",
    "### Idle `clip_grad_norm_` (nothing scaled, finite gradients)",
    "### Against the targets",
]


def test_docs_performance_has_the_generated_sections_structure(bench_json):
    section = markdown.render(bench_json, "python -m ampguard bench --fused --markdown docs/performance.md")
    shape = markdown.structure(section)
    assert [line for line in shape if line.startswith("#")] == SECTIONS
    assert "command: python -m ampguard bench" in shape
    assert markdown.structure(PERFORMANCE_MD.read_text()) == shape  # rerun the documented command if this fails


def test_bench_markdown_rewrites_only_the_generated_section(tmp_path, capsys):
    path = tmp_path / "performance.md"
    before, after = "# Performance\n\nprose kept as written\n\n", "\n## More prose\n"
    path.write_text(f"{before}{markdown.BEGIN}\nold numbers\n{markdown.END}\n{after}")
    argv = [
        "bench",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--block-steps",
        "1",
        "--warmup-steps",
        "1",
        "--import-runs",
        "0",
        "--threads",
        "1",
        "--markdown",
        str(path),
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs.ModelSpec, "for_device", classmethod(lambda cls, device: TINY))
        assert cli.main(argv) == 0
    text = path.read_text()
    assert text.startswith(before + markdown.BEGIN) and text.endswith(markdown.END + "\n" + after)
    assert "old numbers" not in text
    assert "python -m ampguard bench --device cpu --dtype bfloat16 --steps 2 " in text and f"--markdown {path}" in text
    assert [line for line in markdown.structure(text) if line.startswith("#")] == SECTIONS
    out = capsys.readouterr().out
    assert "step time, AdamW" in out  # the table is printed as without --markdown
    assert report.RATIO_NOTE in out  # the ratio and the medians beside it explained


def test_bench_markdown_without_its_markers_stops_before_measuring(tmp_path):
    path = tmp_path / "notes.md"
    path.write_text("no generated section here\n")
    with pytest.raises(SystemExit, match="no generated section"):
        cli.main(["bench", "--device", "cpu", "--markdown", str(path)])
    assert path.read_text() == "no generated section here\n"


# -- import time: what `import ampguard` must not import ------------------------------


@pytest.fixture(scope="module")
def off_a_terminal():
    """``import sys, torch, ampguard`` in a fresh interpreter, no AMPGUARD_* variable, its stderr a pipe: it prints
    which of packaging.specifiers and rich are imported; its stderr is the banner as a pipe gets it."""
    import os
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD") and k != "COLUMNS"}
    probe = (
        "import sys, torch, ampguard; print(sorted(m for m in ('packaging.specifiers', 'rich') if m in sys.modules))"
    )
    return subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True, check=True)


def test_import_ampguard_loads_no_heavy_optional_module(off_a_terminal):
    """packaging.specifiers (about 10 ms) and rich (100+ ms) stay out of ``import ampguard`` off a terminal, the
    banner logged."""
    assert off_a_terminal.stdout.strip() == "[]"
    assert " on torch " in off_a_terminal.stderr


@pytest.mark.parametrize(
    "specifiers",
    [
        ">=2.3",
        ">=2.1",
        "<2.15",
        ">=2.3,<2.15",
        "==2.3",
        "!=2.3.1",
        ">2.3",
        "<=2.4",
        "==2.3.*",
        "~=2.3",
        ">=2.3.0, <2.14.1",
    ],
)
@pytest.mark.parametrize(
    "version", ["2", "2.1", "2.2.9", "2.3", "2.3.0", "2.3.1", "2.4", "2.10", "2.14.1", "3.0", "2.3.0rc1"]
)
def test_patch_version_gate_agrees_with_packaging(specifiers, version):
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from ampguard.patch import release_in

    assert release_in(Version(version), specifiers) == (Version(version) in SpecifierSet(specifiers))


@pytest.mark.skipif(not hasattr(__import__("os"), "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_rich_is_imported_with_the_first_record_not_before():
    import os
    import pty
    import subprocess
    import sys

    probe = (
        "import sys, logging, torch, ampguard; before = 'rich' in sys.modules; "
        "logging.getLogger('ampguard').warning('first record'); "
        "print(before, 'rich' in sys.modules, type(logging.getLogger('ampguard').handlers[0]._rich).__name__)"
    )
    environment = dict(os.environ, AMPGUARD_QUIET="1")
    leader, follower = pty.openpty()
    try:
        completed = subprocess.run(
            [sys.executable, "-c", probe],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=follower,
            text=True,
            check=True,
        )
    finally:
        os.close(follower)
        os.close(leader)
    assert completed.stdout.strip().splitlines()[-1] == "False True RichHandler"


def _on_a_terminal(code: str, environment: dict[str, str], columns: int = 100) -> tuple[str, str]:
    """(stdout, what reached the pseudo-terminal its stderr was) of ``python -c code``."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    process = subprocess.Popen([sys.executable, "-c", code], env=environment, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        terminal += chunk
    os.close(leader)
    stdout = process.stdout.read().decode() if process.stdout else ""
    assert process.wait() == 0, terminal.decode(errors="replace")
    return stdout, terminal.decode()


@pytest.mark.skipif(not hasattr(__import__("os"), "openpty"), reason="needs a pseudo-terminal")
def test_on_a_terminal_the_banner_is_laid_out_like_rich_without_importing_it(off_a_terminal):
    """The banner is the import's own record: rich's layout and the banner's text, rich not imported (~30-100 ms)."""
    import os
    import re

    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD") and k != "COLUMNS"}
    stdout, terminal = _on_a_terminal("import sys, torch, ampguard; print('rich' in sys.modules)", environment)
    assert stdout.strip() == "False"
    lines = re.sub(r"\x1b\[[0-9;]*m", "", terminal).replace("\r\n", "\n").splitlines()
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] INFO     ampguard: \S.*", lines[0])
    assert all(len(line) == 100 for line in lines)  # padded to the terminal's width, as rich pads
    assert all(line.startswith(" " * 20) and line[20] != " " for line in lines[1:])  # wrapped under the message
    plain = off_a_terminal.stderr.strip()  # the same environment's banner through a pipe
    assert " ".join(line[20:].strip() for line in lines) == plain  # the banner's text, word for word
