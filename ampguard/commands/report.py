"""``ampguard report FILE``: summarise an ``AMPGUARD_STATS_FILE``, with a terminal chart (and a PNG on request).

    ampguard report run.jsonl               # summary and chart of every run in the file
    ampguard report run.jsonl --png run.png # the same chart drawn by matplotlib (pip install 'ampguard[report]')
    ampguard report run.jsonl --json        # the summary as JSON

A bad line stops the report with ``ampguard report: error: FILE line N: ...``
(exit status 2); only an incomplete last line, as a crash mid-write leaves it,
is skipped with a warning. ``--png`` on a file without stats lines prints the
report, says there is nothing to chart and exits 1. See docs/stats-file.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from ampguard.stats.report import ReportError, Run, Series, read

FLOAT16_MAX = 65504.0
CHART_WIDTH = 60
CHART_HEIGHT = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a file written with AMPGUARD_STATS_FILE set")
    parser.add_argument("--png", metavar="OUT.png", help="also draw the chart into this PNG (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON (no chart)")


def main(args: argparse.Namespace) -> int:
    try:
        runs, problems = read(args.file)
    except ReportError as error:
        return _error(str(error))
    charted = any(run.series for run in runs)
    if args.png and charted:
        try:
            with _quiet_third_parties():
                import matplotlib  # noqa: F401
        except ImportError:
            return _error("--png needs matplotlib, which is not installed: pip install 'ampguard[report]'")
    for problem in problems:
        print(f"ampguard report: warning: {problem}", file=sys.stderr)
    if args.json:
        json.dump([run.summary() for run in runs], sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(args.file, runs))
    if args.png:
        if not charted:
            print(
                f"ampguard report: nothing to chart: {args.file} has no stats lines (the run was shorter than "
                f"AMPGUARD_STATS_EVERY, 500 steps by default, or it was 0); no PNG written",
                file=sys.stderr,
            )
            return 1
        with _quiet_third_parties():
            draw_png(runs, args.png)
        print(f"chart written to {args.png}", file=sys.stderr if args.json else sys.stdout)
    return 0


@contextlib.contextmanager
def _quiet_third_parties() -> Iterator[None]:
    """matplotlib's warnings and log records (a font cache being built, an empty legend) are not the report's."""
    library = logging.getLogger("matplotlib")
    level = library.level
    library.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        library.setLevel(level)


def _error(message: str) -> int:
    print(f"ampguard report: error: {message}", file=sys.stderr)
    return 2


def render(path: str, runs: list[Run]) -> str:
    """The text report: per run its summary, then per scaler its numbers and chart."""
    out = [f"{path}: {len(runs)} run{'s' if len(runs) != 1 else ''}"]
    for number, run in enumerate(runs, start=1):
        summary = run.summary()
        out.append(
            f"\nrun {number}: {_when(summary)}, pid {summary['pid'] or '?'}, ampguard {summary['ampguard'] or '?'}"
        )
        if not run.series:
            out.append(
                "  no stats lines (fewer steps than AMPGUARD_STATS_EVERY, 500 by default, or it is 0): "
                "what follows is from the run's events"
            )
        for index, (series, numbers) in enumerate(zip(run.series, summary["scalers"]), start=1):
            out.append(
                f"  scaler {index} (lines {numbers['lines'][0]}-{numbers['lines'][1]}): {numbers['steps']} steps, "
                f"{numbers['skipped']} skipped ({numbers['skipped_percent']:.2f}%), "
                f"{numbers['nonfinite_loss']} non-finite losses, {numbers['no_grad_steps']} without gradients; "
                f"loss scale {numbers['final_scale']:g} (range {numbers['scale_min']:g}..{numbers['scale_max']:g})"
            )
            out.extend("    " + line for line in chart(series))
            peak = numbers["headroom_peak"]
            if peak is not None:
                out.append(
                    f"    headroom: the closest to float16's 65,504 any stats line saw was {peak['module']} at "
                    f"{peak['peak']:,.0f} ({peak['peak'] / FLOAT16_MAX:.0%}), step {peak['step']}"
                )
            underflow = numbers["underflow"]
            if underflow["samples"]:
                modules = ", ".join(f"{name} {share:.1%}" for name, share in underflow["modules"]) or "none"
                out.append(
                    f"    float16 gradient underflow: {underflow['last_share']:.2%} at the last sample "
                    f"(at most {underflow['max_share']:.2%}), {underflow['samples']} steps sampled, "
                    f"the scale grown {underflow['growths']} times for it; modules losing most: {modules}"
                )
        out.extend(_from_events(summary))
        events = summary["events"]
        out.append("  events: " + (", ".join(f"{kind} {count}" for kind, count in events.items()) or "none"))
    return "\n".join(out)


def _from_events(summary: dict[str, Any]) -> list[str]:
    """The lines the run's events give: the exit tally, skipped steps described, peaks, underflow, islands."""
    digest, out = summary["from_events"], []
    for tally in digest["exit_summary"]:
        scale = f"; loss scale {tally['final_scale']:g}" if tally["final_scale"] is not None else ""
        out.append(
            f"  at exit (summary event), {tally['scaler']}: {tally['steps']} steps, {tally['skipped']} skipped "
            f"({tally['skipped_percent']:.2f}%), {tally['nonfinite_loss']} non-finite losses, "
            f"{tally['no_grad_steps']} without gradients{scale}"
        )
    if digest["clip_skipped"]:
        out.append(f"  at exit (summary event): clip_grad_norm_ without a GradScaler skipped {digest['clip_skipped']}")
    steps = digest["skips_described"]
    if steps:
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        out.append(
            f"  skipped steps described (skip events, the first of each stats interval): {len(steps)}, "
            f"at step{'s' if len(steps) != 1 else ''} {shown}"
        )
    peak = digest["headroom_peak"]
    if peak is not None:
        at = f", step {peak['step']}" if peak["step"] is not None else ""
        out.append(
            f"  headroom: the closest to float16's 65,504 an event named was {peak['module']} at "
            f"{peak['peak']:,.0f} ({peak['peak'] / FLOAT16_MAX:.0%}){at}"
        )
    for seen in digest["underflow"]:
        grown = (
            f"the scale grown {seen['scale']:g} -> {seen['grown_to']:g}"
            if seen["grown_to"] is not None and seen["scale"] is not None
            else f"at loss scale {seen['scale']:g}"
            if seen["scale"] is not None
            else "reported"
        )
        modules = ", ".join(f"{name} {share:.0%}" for name, share in seen["modules"])
        out.append(
            f"  float16 gradient underflow (underflow event): {seen['share']:.2%} at step {seen['step']}, {grown}"
            + (f"; modules losing most: {modules}" if modules else "")
        )
    made = {island["name"]: island["step"] for island in digest["fp32_islands"]}
    named = [
        name + (f" (made at step {made[name]})" if made.get(name) is not None else "")
        for name in summary["fp32_islands"]
    ]
    out.append(f"  fp32 islands: {', '.join(named) or 'none'}")
    return out


def _when(summary: dict[str, Any]) -> str:
    """When the run started (ampguard installed), or, for a file without that, when it logged its first record."""
    for key, what in (("installed", "ampguard installed"), ("first_record", "first record")):
        if isinstance(summary[key], (int, float)) and summary[key] > 0:
            return f"{what} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(summary[key]))}"
    return "start unknown"


def chart(series: Series, width: int = CHART_WIDTH, height: int = CHART_HEIGHT) -> list[str]:
    """Loss scale (log2, ``*`` at each stats line, ``-`` held until the next) and skipped steps per interval."""
    points = series.points()
    first, last = points[0][0], points[-1][0]
    width = min(width, max(len(points), last - first + 1))
    columns: list[tuple[float, int] | None] = [None] * width
    for step, scale, skipped in points:
        column = round((step - first) / (last - first) * (width - 1)) if last > first else 0
        held = columns[column]
        columns[column] = (math.log2(scale) if scale > 0 else -math.inf, skipped + (held[1] if held else 0))
    levels = [c[0] for c in columns if c is not None and math.isfinite(c[0])] or [0.0]
    low, high = math.floor(min(levels)), math.ceil(max(levels))
    high = max(high, low + 1)
    height = min(height, high - low + 1)
    grid = [[" "] * width for _ in range(height)]
    level: float | None = None
    for column, cell in enumerate(columns):
        mark = "*" if cell is not None else "-"
        if cell is not None:
            level = max(cell[0], low)
        if level is not None:
            grid[round((high - level) / (high - low) * (height - 1))][column] = mark
    labels = {0: f"2^{high}", height - 1: f"2^{low}"}
    lines = [f"{labels.get(row, ''):>6} |{''.join(cells)}" for row, cells in enumerate(grid)]
    skips = "".join(" " if c is None else "." if c[1] == 0 else str(c[1]) if c[1] < 10 else "#" for c in columns)
    lines.append(f"{'':>6} +{'-' * width}")
    lines.append(f"{'skip':>6} |{skips}")
    watched = series.headroom()
    if watched:
        shares: list[float | None] = [None] * width
        for step, _, peak in watched:
            column = round((step - first) / (last - first) * (width - 1)) if last > first else 0
            shares[column] = max(shares[column] or 0.0, peak / FLOAT16_MAX)
        lines.append(f"{'peak':>6} |{''.join(_share_mark(share) for share in shares)}")
    underflow = series.underflow()
    if underflow:
        lines.append(f"{'uflow':>6} |{_underflow_row(underflow, first, last, width)}")
    lines.append(f"{'step':>6}  {first:<{max(width - len(str(last)), 1)}}{last}")
    lines.append("        loss scale, log2 (* a stats line); skipped steps per interval (. none, # 10 or more)")
    if watched:
        lines.append(
            "        peak: the tightest watched module's float16 peak, tenths of 65,504 (0: under 10%, # 90%+)"
        )
    if underflow:
        lines.append("        float16 gradient underflow at the last sample (. below 1%, 0-9: 1-10%, ... 90-100%)")
    return lines


def _underflow_row(points: list[tuple[int, float]], first: int, last: int, width: int) -> str:
    """The measured underflow share per chart column: ``.`` below 1% (the policy's threshold), else its tens."""
    cells = [" "] * width
    for step, share in points:
        column = round((step - first) / (last - first) * (width - 1)) if last > first else 0
        cells[column] = "." if share < 0.01 else str(min(int(share * 10), 9))
    return "".join(cells)


def _share_mark(share: float | None) -> str:
    if share is None:
        return " "
    return "#" if share >= 0.9 else str(int(share * 10))


def draw_png(runs: list[Run], path: str) -> None:
    """Scale (log2) above, skipped steps per interval below, one line per scaler of every run."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    watched = any(series.headroom() for run in runs for series in run.series)
    measured = any(series.underflow() for run in runs for series in run.series)
    panels = 2 + watched + measured
    figure, axes = plt.subplots(
        panels, 1, sharex=True, figsize=(10, 4 + 2 * panels),
        gridspec_kw={"height_ratios": (2,) + (1,) * (panels - 1)},
    )  # fmt: skip
    underflow_axes = axes[-1] if measured else None
    scale_axes, skip_axes = axes[0], axes[1]
    for run_number, run in enumerate(runs, start=1):
        for index, series in enumerate(run.series, start=1):
            steps, scales, skipped = zip(*series.points())
            label = f"run {run_number} scaler {index}" if len(runs) > 1 else f"scaler {index}"
            scale_axes.step(steps, scales, where="post", marker=".", label=label)
            skip_axes.plot(steps, skipped, marker="o", linestyle="none", label=label)
            if watched and series.headroom():
                at, _, peaks = zip(*series.headroom())
                axes[2].plot(at, [peak / FLOAT16_MAX for peak in peaks], marker=".", label=label)
            if underflow_axes is not None and series.underflow():
                underflow_steps, shares = zip(*series.underflow())
                underflow_axes.plot(underflow_steps, [100 * share for share in shares], marker="o", label=label)
    if underflow_axes is not None:
        underflow_axes.set_ylabel("underflow %")
        underflow_axes.axhline(1.0, color="grey", linewidth=0.5)  # the underflow policy's threshold
    scale_axes.set_yscale("log", base=2)
    scale_axes.set_ylabel("loss scale")
    scale_axes.legend(fontsize="small")
    skip_axes.set_ylabel("skipped per interval")
    skip_axes.set_xlabel("optimizer step")
    if watched:
        axes[2].axhline(1.0, color="red", linewidth=0.8)
        axes[2].set_ylabel("tightest peak / 65,504")
        axes[2].set_xlabel("optimizer step")
    axes[-1].set_xlabel("optimizer step")
    figure.suptitle("ampguard: loss scale and skipped steps")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
