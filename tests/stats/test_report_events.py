"""``ampguard report`` reads the events too: a run shorter than the stats interval, and ``--png`` with nothing to chart.

The README's own line, ``AMPGUARD_STATS_FILE=run.jsonl python train.py && ampguard report run.jsonl``, on a
30-step run (no stats line: the interval is 500 steps) must name the island the run made, its skipped step and
the exit tally, all of which are only in its events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ampguard import messages
from ampguard.cli import main
from ampguard.stats.report import read
from ampguard.underflow.listener import GROWN, REPORTED

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers the workers import

TRAIN = """
import ampguard
from islands_support import make_net, train

train(30, model=make_net())  # blocks.1.attn overflows float16 at step 10 and becomes an island
"""


def _environment(**variables: str) -> dict[str, str]:
    environment = {k: v for k, v in os.environ.items() if not k.upper().startswith("AMPGUARD")}
    return environment | {"PYTHONPATH": str(SUPPORT), "AMPGUARD_QUIET": "1"} | variables


def _report(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "default", "-m", "ampguard", "report", *argv],
        capture_output=True,
        text=True,
        env=env or _environment(),
        timeout=300,
    )


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> Path:
    """The stats file of a real 30-step training in its own process (the exit summary is written at exit)."""
    folder = tmp_path_factory.mktemp("short_run")
    path = folder / "run.jsonl"
    script = folder / "train.py"
    script.write_text(TRAIN)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=_environment(AMPGUARD_STATS_FILE=str(path)),
        timeout=600,
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr
    kinds = [json.loads(line)["event"] for line in path.read_text().splitlines()]
    assert "stats" not in kinds and "island" in kinds  # shorter than the interval: only events
    return path


def test_a_run_shorter_than_the_stats_interval_is_reported_from_its_events(short_run, capsys):
    """The --json report in this process (the command's own process: the text report below)."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("default")
        code = main(["report", str(short_run), "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == "" and warned == [], err
    [run] = json.loads(out)
    assert run["scalers"] == []
    assert run["fp32_islands"] == ["blocks.1.attn"]
    events = run["from_events"]
    assert events["fp32_islands"] == [{"name": "blocks.1.attn", "class": "Attention", "step": 10}]
    assert events["skips_described"] == [10]
    [tally] = events["exit_summary"]
    assert (tally["steps"], tally["skipped"], tally["nonfinite_loss"], tally["no_grad_steps"]) == (30, 1, 1, 0)
    assert tally["final_scale"] == 1024.0 and tally["skipped_percent"] == 3.33

    done = _report(str(short_run))
    assert done.returncode == 0 and done.stderr == ""
    text = done.stdout
    assert "fp32 islands: none" not in text
    assert "  fp32 islands: blocks.1.attn (made at step 10)" in text
    assert "30 steps, 1 skipped (3.33%), 1 non-finite losses, 0 without gradients; loss scale 1024" in text
    assert "skipped steps described (skip events, the first of each stats interval): 1, at step 10" in text
    assert "no stats lines (fewer steps than AMPGUARD_STATS_EVERY, 500 by default, or it is 0)" in text


def test_png_of_a_file_without_stats_lines_says_there_is_nothing_to_chart(short_run, tmp_path, capsys):
    png = tmp_path / "run.png"
    code = main(["report", str(short_run), "--png", str(png)])
    out, err = capsys.readouterr()
    assert code == 1
    assert not png.exists()
    assert "chart written" not in out and "fp32 islands: blocks.1.attn" in out
    assert err.splitlines() == [
        f"ampguard report: nothing to chart: {short_run} has no stats lines (the run was shorter than "
        "AMPGUARD_STATS_EVERY, 500 steps by default, or it was 0); no PNG written"
    ]


def _stats_file(path: Path) -> Path:
    records = [
        {"event": "start", "time": 1.0, "format": 1},
        {"event": "stats", "time": 2.0, "steps": 5, "skipped": 1, "no_grad_steps": 0, "nonfinite_loss": 0}
        | {"scale": 512.0, "min_scale_seen": 512.0, "max_scale_seen": 1024.0},
        {"event": "stats", "time": 3.0, "steps": 10, "skipped": 1, "no_grad_steps": 0, "nonfinite_loss": 0}
        | {"scale": 512.0, "min_scale_seen": 512.0, "max_scale_seen": 1024.0},
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


STUB_MATPLOTLIB = {
    "__init__.py": """
        import logging, warnings
        warnings.warn("stub matplotlib: a third party's warning at import", UserWarning)
        logging.getLogger("matplotlib").warning("Matplotlib is building the font cache; this may take a moment.")
        def use(name):
            warnings.warn("stub matplotlib: use()", DeprecationWarning)
    """,
    "pyplot.py": """
        import warnings
        from unittest import mock
        def subplots(panels, *args, **kwargs):
            warnings.warn("No artists with labels found to put in legend.", UserWarning)
            figure = mock.MagicMock()
            figure.savefig.side_effect = lambda path, **kwargs: open(path, "wb").write(b"stub")
            return figure, [mock.MagicMock() for _ in range(panels)]
        def close(figure):
            warnings.warn("stub matplotlib: close()", RuntimeWarning)
    """,
}


def test_no_third_party_warning_leaks_through_png(tmp_path):
    """A matplotlib that warns (and logs) at import and while drawing: none of it reaches the report's stderr."""
    package = tmp_path / "stub" / "matplotlib"
    package.mkdir(parents=True)
    for name, text in STUB_MATPLOTLIB.items():
        (package / name).write_text(textwrap.dedent(text))
    env = _environment()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "stub"), env["PYTHONPATH"]])
    png = tmp_path / "out.png"
    done = _report(str(_stats_file(tmp_path / "run.jsonl")), "--png", str(png), env=env)
    assert done.returncode == 0, done.stderr
    assert png.read_bytes() == b"stub"  # the stub was the matplotlib used
    assert done.stderr == "" and f"chart written to {png}" in done.stdout


# The event patterns follow the messages ampguard writes: each template, formatted, is read back.
ISLAND_FIELDS = {"cls": "Attention", "parameters": "its parameters are unchanged", "owner": "Net", "line": "m = ..."}


def _events_file(path: Path, *events: tuple[str, str]) -> Path:
    records = [{"event": "start", "time": 1.0, "format": 1}]
    records += [{"event": kind, "level": "WARNING", "time": 2.0, "message": message} for kind, message in events]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_islands_headroom_and_underflow_are_read_from_the_messages_ampguard_writes(tmp_path):
    events = [
        ("island", messages.ISLAND_MADE.format(name="blocks.1.attn", step=12, **ISLAND_FIELDS)),
        (
            "island",
            messages.ISLAND_AHEAD.format(
                name="blocks.2.mlp.0", headroom=2.0, peak=40123.0, share=40123 / 65504, step=40, **ISLAND_FIELDS
            ),
        ),
        (
            "island",
            messages.ISLAND_BLAMED.format(name="blocks.3.attn", step=50, seen=45, peak=51000.0, **ISLAND_FIELDS),
        ),
        (
            "island",
            messages.ISLAND_AHEAD_REPORT.format(
                name="blocks.0.attn", headroom=2.0, peak=33000.0, share=0.5, step=20, **ISLAND_FIELDS
            ),
        ),
        (
            "underflow",
            GROWN.format(
                before=1024.0, after=2048.0, step=30, share=0.1234, lost=0.05, norm=0.031, worst="; most in head 40%"
            ),
        ),
        ("underflow", REPORTED.format(scale=2048.0, share=0.02, lost=0.015, norm=0.012, step=60, worst="")),
    ]
    [run], _ = read(str(_events_file(tmp_path / "events.jsonl", *events)))
    summary = run.summary()
    assert summary["fp32_islands"] == ["blocks.1.attn", "blocks.2.mlp.0", "blocks.3.attn"]  # report mode: no island
    digest = summary["from_events"]
    assert [(i["name"], i["step"]) for i in digest["fp32_islands"]] == [
        ("blocks.1.attn", 12),
        ("blocks.2.mlp.0", 40),
        ("blocks.3.attn", 50),
    ]
    assert digest["headroom_peak"] == {"module": "blocks.3.attn", "peak": 51000.0, "step": 45}
    first, second = digest["underflow"]
    assert first == {
        "step": 30,
        "share": 0.1234,
        "lost": 0.05,
        "lost_norm": 0.031,
        "scale": 1024.0,
        "grown_to": 2048.0,
        "modules": [["head", 0.4]],
    }
    got = (second["step"], second["share"], second["lost"], second["lost_norm"], second["scale"], second["grown_to"])
    assert got == (60, 0.02, 0.015, 0.012, 2048.0, None)


def test_underflow_messages_of_issue_32_before_the_norm_still_read(tmp_path):
    """The wording between issue 32's estimate and the norm share: the values' lost share first, then the
    subnormal-or-lost share and the modules in parentheses; read alike, with no norm share."""
    old = (
        "loss scale 1024 -> 2048 at step 30: 5.00% of the float16 gradient values of the sampled backward pass were "
        "lost, zeros where float32 holds a value (12.34% were subnormal or lost; most in head 40%) "
        "(ampguard.underflow; AMPGUARD_UNDERFLOW=report keeps torch's schedule)"
    )
    [run], _ = read(str(_events_file(tmp_path / "events.jsonl", ("underflow", old))))
    [entry] = run.summary()["from_events"]["underflow"]
    assert entry == {
        "step": 30,
        "share": 0.1234,
        "lost": 0.05,
        "lost_norm": None,
        "scale": 1024.0,
        "grown_to": 2048.0,
        "modules": [["head", 0.4]],
    }


def test_underflow_messages_of_before_issue_32_still_read(tmp_path):
    """A stats file written by ampguard 0.1.0: its underflow messages gave the subnormal-or-lost share first and the
    modules in parentheses; read alike, with no lost share."""
    old = (
        "loss scale 1024 -> 2048 at step 30: 12.34% of the float16 gradient values of the sampled backward pass "
        "were subnormal or lost (most in head 40%, blocks.0 12%) (ampguard.underflow; AMPGUARD_UNDERFLOW=report "
        "keeps torch's schedule)"
    )
    [run], _ = read(str(_events_file(tmp_path / "events.jsonl", ("underflow", old))))
    [entry] = run.summary()["from_events"]["underflow"]
    assert entry == {
        "step": 30,
        "share": 0.1234,
        "lost": None,
        "lost_norm": None,
        "scale": 1024.0,
        "grown_to": 2048.0,
        "modules": [["head", 0.4], ["blocks.0", 0.12]],
    }
