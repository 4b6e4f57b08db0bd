"""Reading an ``AMPGUARD_STATS_FILE`` back: checked records, runs, scalers and their summary.

The file holds one JSON object per line (docs/stats-file.md). A run starts at a
``start`` record (one per process; the file is appended to, so it may hold
several). A scaler's stats lines count its steps from its own start, so within a
run a step count lower than the one before begins the next scaler's series (the
demo runs its scenarios one after the other, each with its own scaler).

Stats lines come every ``AMPGUARD_STATS_EVERY`` steps (500 by default): a shorter
run has none, and what happened after a run's last one is only in its events. So
the report also reads the events (:class:`EventDigest`): the islands made, the
skipped steps described, the peaks and underflow named, and the exit summary's
final tally. Events carry their message as text: the patterns below follow the
messages (ampguard/messages.py and the loggers that write them); tests/stats/test_report.py
runs a real short training and checks the report against it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ampguard.stats.file import FORMAT_VERSION


class ReportError(Exception):
    """A file that is not a stats file: the message names the line."""


# Each stats record's required fields and their JSON types (bool is excluded below: it is an int to Python).
_STATS_FIELDS: dict[str, tuple[type, ...]] = {
    "steps": (int,),
    "skipped": (int,),
    "no_grad_steps": (int,),
    "nonfinite_loss": (int,),
    "scale": (int, float),
    "min_scale_seen": (int, float),
    "max_scale_seen": (int, float),
}


@dataclass
class Series:
    """One scaler's stats records, in order."""

    first_line: int
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last(self) -> dict[str, Any]:
        return self.records[-1]

    def points(self) -> list[tuple[int, float, int]]:
        """``(step, scale, skipped since the previous stats line)`` per stats line."""
        points, before = [], 0
        for record in self.records:
            points.append((record["steps"], float(record["scale"]), record["skipped"] - before))
            before = record["skipped"]
        return points

    def headroom(self) -> list[tuple[int, str, float]]:
        """``(step, module, peak)`` per stats line that carries the headroom watch's tightest module."""
        tightest = []
        for record in self.records:
            watched = record.get("headroom")
            if isinstance(watched, list) and watched and isinstance(watched[0], list) and len(watched[0]) == 2:
                name, peak = watched[0]
                if isinstance(name, str) and isinstance(peak, (int, float)) and math.isfinite(peak):
                    tightest.append((record["steps"], name, float(peak)))
        return tightest

    def underflow(self) -> list[tuple[int, float]]:
        """``(step, measured underflow share)`` per stats line with a measurement (AMPGUARD_UNDERFLOW)."""
        return [(r["steps"], float(r["underflow_share"])) for r in self.records if r.get("underflow_samples")]

    def underflow_modules(self, count: int = 3) -> list[tuple[str, float]]:
        """The modules that lost the largest share of their float16 gradients at any stats line, with that share."""
        worst: dict[str, float] = {}
        for record in self.records:
            for name, share in record.get("underflow_modules") or ():
                worst[name] = max(worst.get(name, 0.0), float(share))
        return sorted(worst.items(), key=lambda item: -item[1])[:count]

    def summary(self) -> dict[str, Any]:
        last = self.last
        watched = self.headroom()
        closest = max(watched, key=lambda point: point[2]) if watched else None
        return {
            "lines": [self.first_line, self.records[-1]["_line"]],
            "steps": last["steps"],
            "skipped": last["skipped"],
            "skipped_percent": round(100.0 * last["skipped"] / last["steps"], 2) if last["steps"] else 0.0,
            "nonfinite_loss": last["nonfinite_loss"],
            "no_grad_steps": last["no_grad_steps"],
            "final_scale": last["scale"],
            "scale_min": min(r["min_scale_seen"] for r in self.records),
            "scale_max": max(r["max_scale_seen"] for r in self.records),
            "fp32_islands": list(last.get("fp32_islands", [])),
            # The headroom watch: its tightest modules at the last stats line, and the closest any line saw.
            "headroom": [list(item) for item in last.get("headroom", [])],
            "headroom_peak": {"step": closest[0], "module": closest[1], "peak": closest[2]} if closest else None,
            "underflow": {
                "samples": last.get("underflow_samples", 0),
                "growths": last.get("underflow_growths", 0),
                "last_share": last.get("underflow_share", 0.0),
                "max_share": max((share for _, share in self.underflow()), default=0.0),
                "modules": [list(item) for item in self.underflow_modules()],
            },
        }


# "fp32 island: NAME (CLASS) overflowed ..." (made by the probe, ahead by the headroom watch, or blamed),
# "fp32 island NAME (CLASS) re-applied from the checkpoint." / "... overflowed again at step N ...".
_ISLAND = re.compile(r"^fp32 island:? (?P<name>\S+) \((?P<cls>[^)]*)\) ")
_ISLAND_STEP = re.compile(r"\bstep (?P<step>\d+)")
# "... NAME (CLASS) came within AMPGUARD_HEADROOM=... a peak of 12,424 ... step N" and
# "... the headroom watch of step N saw NAME (CLASS) closest ... a peak of 12,424" (and the island it blames).
_PEAK = re.compile(
    r"(?:^|: |saw )(?P<name>[^\s:]+) \((?P<cls>[^)]*)\) (?:came within|is taken|closest).*?"
    r"peak of (?P<peak>[\d,]+(?:\.\d+)?)"
)
_WATCH_STEP = re.compile(
    r"headroom watch of step (?P<step>\d+)|forward pass of step (?P<ahead>\d+)|, step (?P<at>\d+)\)"
)
# The underflow listener: "loss scale A -> B at step N: the float16 gradients ... lost G% of their norm (L% of their
# values were lost, ...; P% were subnormal or lost; most in ...)" (grown) and "at loss scale A, the float16
# gradients of the sampled backward pass (step N) lost G% of their norm (...)" (reported). Before that wording
# (issue 32): "... N: L% of the float16 gradient values ... were lost, zeros where float32 holds a value (P% were
# subnormal or lost; ...)"; in 0.1.0: "... N: P% of the float16 gradient values ...".
_UNDERFLOW_GROWN = re.compile(
    r"^loss scale (?P<before>\S+) -> (?P<after>\S+) at step (?P<step>\d+): "
    r"(?:(?P<share>[\d.]+)% of the float16|the float16 gradients .*? lost (?P<norm>[\d.]+)% of their norm)"
)
_UNDERFLOW_SEEN = re.compile(
    r"^at loss scale (?P<before>[^,]+), (?:(?P<share>[\d.]+)% of the float16 .*?\(step (?P<step>\d+)\)|"
    r"the float16 gradients .*?\(step (?P<step_now>\d+)\) lost (?P<norm>[\d.]+)% of their norm)"
)
_LOST_THEN_SHARE = re.compile(
    r"(?:were lost, zeros where float32 holds a value \(|; )(?P<share>[\d.]+)% were subnormal"
)
_LOST_VALUES = re.compile(r"\((?P<lost>[\d.]+)% of their values were lost")
_WORST = re.compile(r"(?:\(|; )most in (?P<modules>[^);]*)")
# "step N skipped at loss scale S: ..." (diagnose.py), the first of each stats interval.
_SKIP = re.compile(r"^step (?P<step>\d+) skipped")
# The exit summary: "run summary: LABEL: K of N steps skipped (P%), X with a non-finite loss, Y without
# gradients, final scale S; ...; clip_grad_norm_ without a GradScaler: N step(s) skipped ...".
_TALLY = re.compile(
    r"^(?P<scaler>[^:;]+): (?P<skipped>\d+) of (?P<steps>\d+) steps skipped \([^)]*\), (?P<nonfinite>\d+) with a "
    r"non-finite loss, (?P<no_grad>\d+) without gradients(?:, final scale (?P<scale>\S+))?$"
)
_CLIP = re.compile(r"^clip_grad_norm_ without a GradScaler: (?P<skipped>\d+) step")


def _number(text: str) -> float | None:
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@dataclass
class EventDigest:
    """What a run's events say, for a run shorter than the stats interval or the steps after its last stats line."""

    islands: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {"class", "step", "line"}
    skips_described: list[int] = field(default_factory=list)  # the step of each skip event
    headroom: list[dict[str, Any]] = field(default_factory=list)  # {"module", "peak", "step"}
    underflow: list[dict[str, Any]] = field(default_factory=list)  # {"step", "share", "scale", "grown_to", "modules"}
    exit_tally: list[dict[str, Any]] = field(default_factory=list)  # per scaler, from the summary event
    clip_skipped: int | None = None

    def add(self, event: dict[str, Any]) -> None:
        kind, message = event["event"], event["message"]
        if kind == "island":
            self._island(message, event["_line"])
        elif kind == "skip" and (skip := _SKIP.match(message)):
            self.skips_described.append(int(skip["step"]))
        elif kind == "underflow":
            self._underflow(message)
        elif kind == "summary" and message.startswith("run summary: "):
            self._tally(message)

    def _island(self, message: str, line: int) -> None:
        island = _ISLAND.match(message)
        if island is not None and island["name"] not in self.islands:
            step = _ISLAND_STEP.search(message)
            self.islands[island["name"]] = {
                "class": island["cls"],
                "step": int(step["step"]) if step else None,
                "line": line,
            }
        peak = _PEAK.search(message)
        if peak is not None and (value := _number(peak["peak"])) is not None:
            at = _WATCH_STEP.search(message)
            seen = next((int(group) for group in at.groups() if group), None) if at else None
            self.headroom.append({"module": peak["name"], "peak": value, "step": seen})

    def _underflow(self, message: str) -> None:
        found = _UNDERFLOW_GROWN.match(message) or _UNDERFLOW_SEEN.match(message)
        if found is None:
            return
        fields = found.groupdict()
        norm = _number(fields["norm"]) if fields.get("norm") else None
        lost = None
        if norm is not None:  # the wording since the norm: the values' shares in the parenthesis
            values = _LOST_VALUES.search(message)
            shares = _LOST_THEN_SHARE.search(message)
            if values is None or shares is None:
                return
            lost, share = _number(values["lost"]), _number(shares["share"])
            lost = lost / 100 if lost is not None else None
        elif (share := _number(fields["share"])) is not None and (shares := _LOST_THEN_SHARE.search(message)):
            lost, share = share / 100, _number(shares["share"])
        if share is None:
            return
        worst = _WORST.search(message)
        modules = []
        for item in worst["modules"].split(", ") if worst else ():
            name, _, percent = item.rpartition(" ")
            if name and percent.endswith("%") and (value := _number(percent[:-1])) is not None:
                modules.append([name, value / 100])
        grown = found.groupdict().get("after")
        self.underflow.append(
            {
                "step": int(fields.get("step") or fields.get("step_now") or 0),
                "share": share / 100,
                "lost": lost,
                "lost_norm": norm / 100 if norm is not None else None,
                "scale": _number(found["before"]),
                "grown_to": _number(grown) if grown else None,
                "modules": modules,
            }
        )

    def _tally(self, message: str) -> None:
        for part in message.removeprefix("run summary: ").removesuffix(".").split("; "):
            if (clip := _CLIP.match(part)) is not None:
                self.clip_skipped = int(clip["skipped"])
            elif (tally := _TALLY.match(part)) is not None:
                steps, skipped = int(tally["steps"]), int(tally["skipped"])
                self.exit_tally.append(
                    {
                        "scaler": tally["scaler"],
                        "steps": steps,
                        "skipped": skipped,
                        "skipped_percent": round(100.0 * skipped / steps, 2) if steps else 0.0,
                        "nonfinite_loss": int(tally["nonfinite"]),
                        "no_grad_steps": int(tally["no_grad"]),
                        "final_scale": _number(tally["scale"]) if tally["scale"] else None,
                    }
                )

    def summary(self) -> dict[str, Any]:
        closest = max(self.headroom, key=lambda item: item["peak"]) if self.headroom else None
        return {
            "fp32_islands": [
                {"name": name, "class": what["class"], "step": what["step"]} for name, what in self.islands.items()
            ],
            "skips_described": list(self.skips_described),
            "headroom_peak": dict(closest) if closest else None,
            "underflow": [dict(item) for item in self.underflow],
            "exit_summary": [dict(item) for item in self.exit_tally],
            "clip_skipped": self.clip_skipped,
        }


@dataclass
class Run:
    """The records of one process: its start record (None for records before any), its scalers and its events."""

    start: dict[str, Any] | None
    series: list[Series] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def add_stats(self, record: dict[str, Any]) -> None:
        if not self.series or record["steps"] < self.series[-1].last["steps"]:
            self.series.append(Series(record["_line"]))
        self.series[-1].records.append(record)

    def digest(self) -> EventDigest:
        """What the run's events say (islands, skips, headroom, underflow, the exit tally)."""
        digest = EventDigest()
        for event in self.events:
            digest.add(event)
        return digest

    def summary(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for event in self.events:
            kinds[event["event"]] = kinds.get(event["event"], 0) + 1
        start = self.start or {}
        from_events = self.digest().summary()
        islands = {name for s in self.series for name in s.last.get("fp32_islands", [])}
        islands.update(island["name"] for island in from_events["fp32_islands"])
        return {
            # When ampguard was installed in the process (import ampguard), and the time of the start record,
            # written with the process's first record (files from before "installed" have only that).
            "installed": start.get("installed"),
            "first_record": start.get("time"),
            "pid": start.get("pid"),
            "ampguard": start.get("ampguard"),
            "scalers": [series.summary() for series in self.series],
            # The islands of the stats lines and of the events (an island made after the last stats line, or in a
            # run shorter than the stats interval, is only in an event).
            "fp32_islands": sorted(islands),
            "events": dict(sorted(kinds.items())),
            "from_events": from_events,
        }


def _check(record: Any, line: int) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    event = record.get("event")
    if not isinstance(event, str):
        return 'no "event" name'
    if not isinstance(record.get("time"), (int, float)):
        return f'{event} record without a "time"'
    if event == "start" and isinstance(record.get("format"), int) and record["format"] > FORMAT_VERSION:
        return f"format {record['format']}, newer than this ampguard reads ({FORMAT_VERSION}): upgrade ampguard"
    if event == "stats":
        for name, types in _STATS_FIELDS.items():
            value = record.get(name)
            if isinstance(value, bool) or not isinstance(value, types):
                return f'stats record with {"no" if value is None else "a bad"} "{name}" ({value!r})'
            # (an int or a float: checked just above)
            if not math.isfinite(value) or value < 0:  # type: ignore[arg-type, operator]
                return f'stats record with a bad "{name}" ({value!r})'
    elif event != "start" and not isinstance(record.get("message"), str):
        return f'{event} record without a "message"'
    return None


def read(path: str) -> tuple[list[Run], list[str]]:
    """The runs in ``path`` and warnings. Raises ReportError naming the line of the first bad record.

    A last line that is cut off (no newline at its end, not valid JSON), as a crash
    in the middle of a write leaves it, is skipped with a warning: everything before it is whole.
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ReportError(f"{path}: {error.strerror if isinstance(error, OSError) else error}") from None
    lines = text.split("\n")
    cut_off = lines.pop()  # "" when the file ends with a newline, as every whole record does
    runs: list[Run] = []
    warnings: list[str] = []
    for number, line in enumerate([*lines, cut_off] if cut_off else lines, start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if cut_off and number == len(lines) + 1:
                warnings.append(
                    f"{path} line {number}: incomplete last record (the run stopped while writing it); skipped"
                )
                break
            raise ReportError(f"{path} line {number}: not JSON ({error.msg} at column {error.colno})") from None
        problem = _check(record, number)
        if problem is not None:
            raise ReportError(f"{path} line {number}: {problem}")
        record["_line"] = number
        if record["event"] == "start" or not runs:
            runs.append(Run(record if record["event"] == "start" else None))
        if record["event"] == "stats":
            runs[-1].add_stats(record)
        elif record["event"] != "start":
            runs[-1].events.append(record)
    if not runs:
        raise ReportError(f"{path}: no records")
    return runs, warnings
