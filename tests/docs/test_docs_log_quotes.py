"""The stats lines quoted in the README and docs/ are in the words the code writes now.

A quoted scaler stats line (``stats step=...``) may leave parts out ("..."), but each
part it keeps must be one of the parts :func:`ampguard.stats.counters.stats_line`
writes, in its order, holding only labels that part holds: a quote in an older
wording (``skipped=`` next to ``skipped_total=`` with no "this interval" / "whole
run" to say which counts what) fails here. A quoted clip-guard line (``stats
clip_calls=...``) must be the line the guard writes, its numbers aside.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ampguard.clip_grad.state import ClipState
from ampguard.stats.counters import ScalerStats, stats_line

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCALER_QUOTE = re.compile(r"stats step=[^`\n]*")
CLIP_QUOTE = re.compile(r"stats clip_calls=[^`\n]*")
LABEL = re.compile(r"([a-z_]+)=")
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def quotes(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """(page name, quoted line) for each match of ``pattern`` in the README and docs/."""
    return [(page.name, match) for page in PAGES for match in pattern.findall(page.read_text())]


def _parts(line: str) -> list[tuple[str, set[str]]]:
    """The line's parts as (heading, labels): the first part's heading is ""; "..." parts are left out."""
    parts = []
    for index, text in enumerate(line.split(" | ")):
        if text.strip() in ("...", ""):
            continue
        heading = "" if index == 0 else text.split(":", 1)[0]
        parts.append((heading, set(LABEL.findall(text))))
    return parts


def every_part() -> list[tuple[str, set[str]]]:
    """The parts of a stats line with every optional figure in it, as the code writes it."""
    stats = ScalerStats(
        steps=200,
        skipped=3,
        no_grad_steps=0,
        nonfinite_loss=1,
        scale=1024.0,
        min_scale_seen=512.0,
        max_scale_seen=2048.0,
        consecutive_skipped=0,
        fp32_islands=("blocks.1.attn",),
        buffers_restored=1,
        headroom=(("blocks.1.attn", 7944.0),),
        underflow_share=0.01,
        underflow_subnormal=0.01,
        underflow_values=100,
        underflow_step=102,
        underflow_scale=1024.0,
        underflow_samples=2,
        underflow_modules=(("blocks.2.attn.k", 0.02),),
    )
    return _parts(stats_line(stats, 1))


def wording_problems(quote: str) -> list[str]:
    """What in ``quote`` the code does not write (empty: it is in the current wording)."""
    expected = every_part()
    headings = [heading for heading, _ in expected]
    problems, last = [], -1
    for heading, labels in _parts(quote):
        if heading not in headings:
            problems.append(f"no part {heading!r} in the stats line")
            continue
        position = headings.index(heading)
        if position <= last:
            problems.append(f"part {heading!r} out of order")
        last = position
        if labels - expected[position][1]:
            problems.append(f"part {heading or 'stats'!r} holds {sorted(labels - expected[position][1])}")
    return problems


def test_the_check_rejects_the_old_wording_and_accepts_the_code_s_own_line():
    old = "stats step=2 scale=1024 skipped=0 skipped_total=0 (0.00%) no_grad=0 nonfinite_loss=0 consecutive_skipped=0"
    assert wording_problems(old)
    old_tail = "stats step=300 scale=1.67772e+07 ... underflow=78.81% (subnormal=71.57%) underflow_growths=14"
    assert wording_problems(old_tail)
    assert not wording_problems(" | ".join(["stats step=1 scale=2", "this interval: skipped=0", "..."]))
    assert wording_problems("stats step=1 scale=2 | whole run: skipped_total=0 | this interval: skipped=0")


@pytest.mark.parametrize(("page", "quote"), quotes(SCALER_QUOTE))
def test_each_quoted_stats_line_is_in_the_current_wording(page, quote):
    assert not wording_problems(quote), f"{page}: {quote}"


def test_the_pages_quote_stats_lines():
    pages = {page for page, _ in quotes(SCALER_QUOTE)}
    assert {"stats-file.md", "islands.md", "trainer-logs.md", "underflow.md"} <= pages


def test_each_quoted_clip_guard_line_is_the_guard_s_line_but_for_its_numbers():
    state = ClipState(lambda *args: None, guard=True, stats_every=500)
    state.guarded_calls, state.guarded_skipped, state.skipped_at_last_line = 1000, 2, 2
    shape = NUMBER.sub("N", state.guard_stats_line())
    found = quotes(CLIP_QUOTE)
    assert found, "docs/clipping.md quotes the clip guard's line"
    for page, quote in found:
        assert NUMBER.sub("N", quote) == shape, f"{page}: {quote}"
