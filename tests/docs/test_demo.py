"""The README's first command: the demo shows torch's failures and ampguard training through them."""

from __future__ import annotations

import re

import pytest
from demo_support import demo_module

from ampguard.patch import torch_release

STEPS = 60  # the demo's optimizer steps per scenario


@pytest.fixture(scope="module")
def runs(demo_run) -> tuple[dict, dict]:
    """The script run plain and under ``ampguard run`` by the demo (tests/conftest.py: a stats line every 10 steps):
    each run's results, and its stdout and stderr as the demo printed them (``output``)."""
    return demo_run["plain"], demo_run["guarded"]


def test_demo_script_fails_plain_and_trains_through_with_ampguard(runs):
    plain, guarded = runs

    assert plain["calibration"]["skipped_steps"] > 0  # 65536 overflows first
    assert guarded["calibration"]["skipped_steps"] == 0

    # 24 corrupt batches: torch halves its scale at each, far below 1, where it stays; ampguard skips
    # them and keeps its scale (a non-finite loss says nothing about the loss scale).
    assert plain["storm"]["skipped_steps"] >= 24 and plain["storm"]["final_scale"] < 0.01
    assert guarded["storm"]["skipped_steps"] == 24 and guarded["storm"]["final_scale"] == 1024.0
    assert "forward overflow" in guarded["output"] and "the batch itself held inf/NaN" in guarded["output"]
    assert "loss scale collapsed" not in guarded["output"]

    assert plain["hot_block"]["skipped_steps"] == STEPS and plain["hot_block"]["final_scale"] < 1e-6  # every step
    assert guarded["hot_block"]["skipped_steps"] <= 4 and guarded["hot_block"]["final_scale"] >= 1024.0
    assert "fp32 island: blocks.0.linear1 (Linear)" in guarded["output"]
    assert guarded["hot_block"]["fp32_islands"][0] == "blocks.0.linear1" and plain["hot_block"]["fp32_islands"] == []

    assert plain["no_grad"]["outcome"].startswith("crashed: AssertionError: No inf checks were recorded")
    assert guarded["no_grad"]["outcome"] == "finished"
    assert "got no gradient" in guarded["output"]

    assert "stats step=10 " in guarded["output"]
    assert guarded["warnings"] == []
    if torch_release() >= torch_release("2.4"):
        assert plain["warnings"]  # torch.cpu.amp.autocast is deprecated from 2.4


def test_demo_driver_prints_the_side_by_side_summary(demo_run):
    assert demo_run["code"] == 0
    stdout = demo_run["stdout"]
    summary = stdout.split("===== summary")[1]
    assert "crashed (AssertionError)" in summary
    assert "with ampguard" in summary and "FutureWarnings" in summary
    # The closing text says what the table's numbers say: ampguard's skips in hot_block, in both.
    row = next(line for line in summary.splitlines() if line.startswith("hot_block "))
    skipped = re.findall(r"(\d+) skipped", row)[-1]
    assert re.search(rf"^hot_block: .*\n.*\n    ampguard: skipped {skipped} of ", summary, flags=re.M)
    assert f"--- scenario hot_block ({STEPS} steps) ---" in stdout
    stats = [line for line in stdout.splitlines() if "stats step=" in line]
    assert stats and all("| now: consecutive_skipped=" in line for line in stats)  # shortened, never that part


def _sections(output: str) -> dict[str, list[str]]:
    """The stats lines under each ``--- scenario NAME ---`` header."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        header = re.match(r"^--- scenario (\w+) \(\d+ steps\) ---$", line)
        if header:
            current = sections.setdefault(header.group(1), [])
        elif "stats step=" in line:
            assert current is not None, f"a stats line before any scenario: {line}"
            current.append(line)
    return sections


def test_each_scenarios_stats_lines_follow_its_header_and_match_its_numbers(runs):
    _, guarded = runs
    sections = _sections(guarded["output"])
    assert list(sections) == ["calibration", "storm", "no_grad", "hot_block"]
    for name, lines in sections.items():
        result = guarded[name]
        assert lines, name
        last = lines[-1]
        assert f"skipped_total={result['skipped_steps']} " in last, (name, last)
        assert (
            ("fp32_islands=" + ",".join(result["fp32_islands"])) in last
            if result["fp32_islands"]
            else ("fp32_islands=" not in last)
        )
    assert all(" no_grad=0 " not in line for line in sections["no_grad"])
    assert all(" no_grad=0 " in line for name in ("calibration", "storm", "hot_block") for line in sections[name])


def test_closing_text_is_written_from_the_runs_results(runs):
    plain, guarded = runs
    text = demo_module().closing(plain["results"], guarded["results"])
    blocks = dict(re.findall(r"^(\w+): .*\n((?:    .*\n?)+)", text, flags=re.M))
    assert list(blocks) == ["calibration", "storm", "no_grad", "hot_block"]
    for name, block in blocks.items():
        torch_line, ampguard_line = block.splitlines()[:2]
        for line, result in ((torch_line, plain[name]), (ampguard_line, guarded[name])):
            if result["outcome"] == "finished":
                assert f"skipped {result['skipped_steps']} of {result['steps_run']} steps" in line, (name, line)
                assert f"-> {result['final_scale']:g}" in line
            else:
                assert "crashed" in line
    islands = guarded["hot_block"]["fp32_islands"]
    assert f"made fp32 island{'s' if len(islands) > 1 else ''} of {', then '.join(islands)}" in blocks["hot_block"]
    assert "linear2" not in text or "blocks.0.linear2" in islands  # only the islands this run made
    assert f"{guarded['storm']['corrupt_batches']} corrupt batches" in text
