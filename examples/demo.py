"""The demo: the same XTTS-style fine-tuning script, without and with ampguard, side by side.

    python examples/demo.py

runs ``examples/xtts_style_finetune.py`` twice, at the same time:

* ``python examples/xtts_style_finetune.py``: plain torch AMP;
* ``python -m ampguard run examples/xtts_style_finetune.py``: the same file,
  unedited, with ampguard installed first (stats line every 20 steps).

``AMPGUARD_STATS_FILE=demo.jsonl AMPGUARD_STATS_EVERY=5 python examples/demo.py`` also
records the ampguard run for ``ampguard report demo.jsonl``.

It shows each run's own output (a ``--- scenario NAME ---`` line before each
scenario's, ampguard's stats lines included), then a summary table and what each
scenario did, written from the two runs' results. Takes well under a minute on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("xtts_style_finetune.py")
PASSED_ON = ("AMPGUARD_STATS_FILE", "AMPGUARD_STATS_EVERY")


def launch(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(title: str, process: subprocess.Popen[str]) -> dict:
    output, _ = process.communicate()
    lines = output.rstrip().splitlines()
    # The run's results are its last JSON line (ampguard's exit tally may follow it).
    results = max((i for i, line in enumerate(lines) if line.startswith('{"results"')), default=None)
    print(f"\n===== {title} =====")
    shown = [line for i, line in enumerate(lines) if i != results]
    print("\n".join(_shortened(line) for line in shown))
    if process.returncode != 0 or results is None:
        raise SystemExit(f"{title} exited with {process.returncode}")
    return json.loads(lines[results])


def _shortened(line: str) -> str:
    """A long line cut at 220 characters; a stats line keeps its step, interval, run and now parts whole."""
    if "stats step=" in line and " | last " in line:
        line = line.split(" | last ")[0] + " | last ..."
    return line if len(line) < 220 or "stats step=" in line else line[:217] + "..."


def cell(result: dict) -> str:
    if result["outcome"] != "finished":
        return result["outcome"].split(":")[0] + f" ({result['outcome'].split(': ')[1]})"
    return f"{result['skipped_steps']} skipped, loss {result['final_loss']}, scale {result['final_scale']:g}"


def _outcome(result: dict) -> str:
    """``skipped 3 of 60 steps, scale 65536 -> 8192`` or ``crashed (AssertionError)``."""
    if result["outcome"] != "finished":
        return cell(result)
    return (
        f"skipped {result['skipped_steps']} of {result['steps_run']} steps, "
        f"scale {result['initial_scale']:g} -> {result['final_scale']:g}"
    )


def _islands(result: dict) -> str:
    names = result.get("fp32_islands") or []
    if not names:
        return "made no fp32 island"
    return f"made fp32 island{'s' if len(names) > 1 else ''} of {', then '.join(names)} (docs/islands.md)"


def closing(without: list[dict], with_ampguard: list[dict]) -> str:
    """What each scenario did, from the two runs' own results (nothing here is assumed of a run)."""
    lines = []
    for plain, guarded in zip(without, with_ampguard):
        name = plain["scenario"]
        what = {
            "calibration": "the loss scale's first steps, finding a scale",
            "storm": f"{guarded['corrupt_batches']} corrupt batches (a NaN loss in any precision, "
            "which no loss scale fixes)",
            "no_grad": "a second optimizer whose parameters get no gradient",
            "hot_block": "one block overflows float16 on every batch",
        }.get(name, name)
        lines.append(f"{name}: {what}.")
        lines.append(f"    torch:    {_outcome(plain)}.")
        said = _outcome(guarded)
        if guarded["outcome"] == "finished" and (guarded["fp32_islands"] or name == "hot_block"):
            said += f"; {_islands(guarded)}"
        lines.append(f"    ampguard: {said}.")
        if name == "storm" and guarded["outcome"] == "finished":
            lines.append(
                "    (ampguard does not lower its scale for a non-finite loss: it says nothing about the scale.)"
            )
    return "\n".join(lines)


def main() -> int:
    base = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    plain = launch([sys.executable, str(SCRIPT)], base)
    guarded = launch(
        [sys.executable, "-m", "ampguard", "run", str(SCRIPT)],
        # AMPGUARD_STATS_FILE / AMPGUARD_STATS_EVERY, when set, reach this run only (docs/stats-file.md).
        {**base, "AMPGUARD_STATS_EVERY": "20", **{k: v for k, v in os.environ.items() if k in PASSED_ON}},
    )
    without = finish("plain torch AMP", plain)
    with_ampguard = finish("with ampguard (python -m ampguard run, script unchanged)", guarded)

    rows = [("scenario", "plain torch AMP", "with ampguard")]
    for a, b in zip(without["results"], with_ampguard["results"]):
        rows.append((a["scenario"], cell(a), cell(b)))
    rows.append(("FutureWarnings", str(len(without["future_warnings"])), str(len(with_ampguard["future_warnings"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    steps = max(r["steps_run"] for r in with_ampguard["results"])
    print(f"\n===== summary ({steps} optimizer steps per scenario) =====")
    for index, row in enumerate(rows):
        print("  ".join(text.ljust(width) for text, width in zip(row, widths)))
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print("\n" + closing(without["results"], with_ampguard["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
