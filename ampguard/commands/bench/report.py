"""Every measurement of ``ampguard bench`` as one JSON-ready dict, its targets, and its table.

:func:`run` returns the dict; its fields are documented in
``docs/performance.md`` and checked by ``tests/commands/test_bench.py``.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections.abc import Iterator
from typing import Any

import torch

import ampguard
from ampguard.commands.bench.counting import count_syncs
from ampguard.commands.bench.import_time import time_import
from ampguard.commands.bench.runs import (
    GROWTH_INTERVAL,
    INIT_SCALE,
    ModelSpec,
    Options,
    clip_is_wrapped,
    fused_unavailable_reason,
    optimizer_name,
)
from ampguard.commands.bench.sampled import time_watched_step
from ampguard.commands.bench.timing import time_idle_clip, time_steps
from ampguard.commands.bench.underflow import time_sampled_step

SCHEMA_VERSION = 1

# What "no measurable cost" means, as checked next to every measured value.
TARGETS: dict[str, float] = {
    "step_time_ratio": 1.01,  # median ampguard/torch per-step time, at most
    "extra_syncs_per_step": 0,  # host-device synchronisations ampguard adds per step
    "import_overhead_ms": 50.0,  # what `import ampguard` adds to `import torch`
    "clip_idle_overhead": 0.02,  # wrapped clip_grad_norm_ vs torch's, nothing scaled
}


# When the timed figures are not to be trusted (a "NO" then says "unreliable" instead):
# other processes' 1-minute load average per core above this (they take turns with the bench on the cores) ...
BUSY_LOAD_PER_CORE = 0.5
# ... or a spread so wide that the target's margin lies within two standard errors (the import time: its
# fastest and slowest run further apart than the target itself).
TIMED = ("step_time_ratio", "import_overhead_ms", "clip_idle_overhead")


def load_per_core(environment: dict[str, Any]) -> float | None:
    """Other processes' 1-minute load average per core: the larger of before and after, less the bench's threads.

    The load after includes the bench itself (about one per torch thread), which is not taken as a sign of a
    busy machine; None where the OS has no load average.
    """
    before, after = environment.get("load_average_before"), environment.get("load_average_after")
    cores = environment.get("cpu_count") or 1
    loads = []
    if before:
        loads.append(before[0])
    if after:
        loads.append(max(0.0, after[0] - (environment.get("torch_threads") or 1)))
    return max(loads) / cores if loads else None


def unreliable(name: str, result: dict[str, Any], timing: dict[str, Any] | None = None) -> str | None:
    """Why the timed figure behind target ``name`` is not to be trusted on this run, or None.

    ``timing``: one optimizer kind's ``step_time`` entry (default: the one the check took, the worst).
    """
    if name not in TIMED:
        return None  # counted, not timed: the load changes nothing
    reasons = []
    load = load_per_core(result["environment"])
    if load is not None and load > BUSY_LOAD_PER_CORE:
        reasons.append(f"load {load:.2f}/core, over {BUSY_LOAD_PER_CORE:g}")
    if name == "step_time_ratio":
        timings = [timing] if timing else [t for t in result["step_time"].values() if t]
        worst = max(timings, key=lambda t: t["ratio"], default=None)
        if worst and 2 * worst["ratio_stderr"] > TARGETS[name] - 1.0:
            reasons.append(f"spread: +-{worst['ratio_stderr']:.4f} s.e., over half the {TARGETS[name] - 1:.0%} margin")
    elif name == "clip_idle_overhead" and result.get("clip_idle"):
        stderr = result["clip_idle"]["overhead_stderr"]
        if 2 * stderr > TARGETS[name]:
            reasons.append(f"spread: +-{stderr:.1%} s.e., over half the {TARGETS[name]:.0%} margin")
    elif name == "import_overhead_ms" and result.get("import_time"):
        imported = result["import_time"]
        if imported["ampguard_ms_max"] - imported["ampguard_ms_min"] > TARGETS[name]:
            reasons.append(
                f"spread: {imported['ampguard_ms_min']:.0f}..{imported['ampguard_ms_max']:.0f} ms, "
                f"wider than the {TARGETS[name]:g} ms target"
            )
    return "; ".join(reasons) or None


def verdict(ok: bool, why_unreliable: str | None) -> str:
    """The "met" column: yes / NO, or "unreliable" where a miss may be the machine's (a met target says so too)."""
    if why_unreliable is None:
        return "yes" if ok else "NO"
    return "yes (unreliable)" if ok else "unreliable"


def medians_disagree(torch_value: float, ampguard_value: float, ratio: float) -> bool:
    """The two medians' order says the other run is faster than the paired ratio does."""
    return (ampguard_value - torch_value) * (ratio - 1.0) < 0


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target next to its measured value (the worst optimizer kind for per-step values)."""
    measured: dict[str, float] = {}
    timings = [t for t in result["step_time"].values() if t]
    if timings:
        measured["step_time_ratio"] = max(t["ratio"] for t in timings)
    counted = [s for s in result["syncs"].values() if "extra_per_step" in s]
    if counted:
        measured["extra_syncs_per_step"] = max(s["extra_per_step"] for s in counted)
    if result["import_time"]:
        imported = result["import_time"]  # on and off a terminal: the worse
        measured["import_overhead_ms"] = max(imported["ampguard_ms"], imported["ampguard_terminal_ms"] or 0.0)
    if result["clip_idle"]:
        measured["clip_idle_overhead"] = result["clip_idle"]["overhead"]
    return [
        {
            "name": name,
            "target": f"{'==' if name == 'extra_syncs_per_step' else '<='} {TARGETS[name]:g}",
            "measured": value,
            "ok": value <= TARGETS[name],
            "unreliable": unreliable(name, result),
        }
        for name, value in measured.items()
    ]


def run(options: Options) -> dict[str, Any]:
    """Every measurement of ``ampguard bench``, as one JSON-ready dict (see docs/performance.md)."""
    say = options.progress or (lambda message: None)
    load_before = _load()
    fused_reason = fused_unavailable_reason(options.device)
    kinds = [False] + ([True] if fused_reason is None else [])
    import ampguard.log as log

    previous_level = log.logger.level
    log.logger.setLevel(max(previous_level, 30))  # stats lines would interleave with the output
    try:
        syncs: dict[str, Any] = {}
        for fused in kinds:
            say(f"counting synchronisations ({optimizer_name(fused)})")
            syncs["fused" if fused else "plain"] = count_syncs(options, fused)
        if fused_reason is not None:
            syncs["fused"] = {"optimizer": optimizer_name(True), "unavailable": fused_reason}
        step_time: dict[str, Any] = {}
        for fused in [False] + ([True] if options.fused else []):
            key = "fused" if fused else "plain"
            if fused and fused_reason is not None:
                step_time[key] = None
                continue
            say(f"timing {options.steps} steps per variant ({optimizer_name(fused)})")
            step_time[key] = time_steps(options, fused)
        say("timing clip_grad_norm_ with nothing scaled")
        clip_idle = time_idle_clip(options)
        say("timing a step the headroom watch observes")
        sampled_steps = {"headroom_watch": time_watched_step(options)}
        say("timing a step sampled for underflow against a healthy one")
        sampled_steps["underflow"] = time_sampled_step(options)
    finally:
        log.logger.setLevel(previous_level)
    import_time = None
    if options.import_runs > 0:
        say(f"timing `import ampguard` in {options.import_runs} fresh interpreters")
        import_time = time_import(options.import_runs)
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "environment": {
            "ampguard": ampguard.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": options.device,
            "device_name": _device_name(options.device),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": _load(),
        },
        "settings": {
            "steps": options.steps,
            "block_steps": options.block_steps,
            "warmup_steps": options.warmup_steps,
            "autocast_dtype": options.dtype,
            "fused": options.fused,
            "model": dataclasses.asdict(options.model or ModelSpec.for_device(options.device)),
            "init_scale": INIT_SCALE,
            "growth_interval": GROWTH_INTERVAL,
        },
        "patches": {entry.name: entry.state for entry in ampguard.status()},
        "clip_wrapped": clip_is_wrapped(),
        "step_time": step_time,
        "syncs": syncs,
        "clip_idle": clip_idle,
        "sampled_steps": sampled_steps,
        "import_time": import_time,
        "targets": dict(TARGETS),
    }
    result["checks"] = checks(result)
    return result


RATIO_NOTE = (
    "note: a step time's ratio is the median of ampguard/torch over pairs of blocks run back to back, not the "
    "ratio of the two medians beside it: pairing cancels the machine's drift between blocks, which the medians "
    "keep, so the two can differ, even in which run they call faster (the row says so when they do)."
)
DISAGREE = "the medians beside it point the other way (drift between blocks: see the note)"


def title(result: dict[str, Any]) -> str:
    """What ran, where, and how busy the machine was."""
    environment, settings = result["environment"], result["settings"]
    load = load_per_core(environment)
    return (
        f"ampguard bench: {environment['device']} ({environment['device_name']}, {environment['cpu_count']} cores), "
        f"autocast {settings['autocast_dtype']}, {environment['torch_threads']} torch thread(s), "
        f"torch {environment['torch']}; 1-minute load average {_shown(environment['load_average_before'])} before, "
        f"{_shown(environment['load_average_after'])} after"
        + (f" (others' {load:.2f} per core)" if load is not None else "")
    )


def _shown(values: list[float] | None) -> str:
    return f"{values[0]:.2f}" if values else "unknown"


def unreliable_note(result: dict[str, Any]) -> str | None:
    """One paragraph naming the targets whose figures are unreliable on this run, and why; None when none is."""
    named = [f"{c['name']} ({c['unreliable']})" for c in result["checks"] if c.get("unreliable")]
    if not named:
        return None
    return (
        "unreliable: " + ", ".join(named) + ". These figures say more about the machine than about ampguard: "
        f"a miss there is not a measured cost. Rerun on an idle machine (load under {BUSY_LOAD_PER_CORE:g} per "
        "core), with --threads 1 and more --steps."
    )


def iter_table_rows(result: dict[str, Any]) -> Iterator[list[str]]:
    """``[measure, torch, ampguard, result, target, ok]`` rows for the human-readable table."""
    met = {c["name"]: verdict(c["ok"], c.get("unreliable")) for c in result["checks"]}
    for key, timing in result["step_time"].items():
        if timing is None:
            yield [f"step time, {optimizer_name(key == 'fused')}", "-", "-", "unavailable", "", ""]
            continue
        disagree = medians_disagree(timing["torch_ms_per_step"], timing["ampguard_ms_per_step"], timing["ratio"])
        yield [
            f"step time, {timing['optimizer']}",
            f"{timing['torch_ms_per_step']:.2f} ms (median)",
            f"{timing['ampguard_ms_per_step']:.2f} ms (median)",
            f"median paired ratio {timing['ratio']:.4f} +-{timing['ratio_stderr']:.4f} "
            f"({timing['ratio_min']:.3f}-{timing['ratio_max']:.3f}), {timing['overhead_us_per_step']:+.0f} us/step"
            + (f"; {DISAGREE}" if disagree else ""),
            f"<= {TARGETS['step_time_ratio']}",
            verdict(timing["ratio"] <= TARGETS["step_time_ratio"], unreliable("step_time_ratio", result, timing)),
        ]
    for counted in result["syncs"].values():
        if "unavailable" in counted:
            yield [f"syncs/step, {counted['optimizer']}", "-", "-", "unavailable: " + counted["unavailable"], "", ""]
            continue
        yield [
            f"syncs/step, {counted['optimizer']}",
            f"{counted['torch_per_step']:g}",
            f"{counted['ampguard_per_step']:g}",
            f"{counted['extra_per_step']:+g}/step, {counted['ampguard_per_stats_report']} per stats report; "
            f"ops/step {counted['torch_ops_per_step']:g} vs {counted['ampguard_ops_per_step']:g}",
            "+0",
            "yes" if counted["extra_per_step"] <= 0 else "NO",
        ]
    imported = result["import_time"]
    if imported:
        terminal = imported["ampguard_terminal_ms"]
        yield [
            "import ampguard after torch",
            f"{imported['torch_ms']:.0f} ms (torch)",
            f"{imported['ampguard_ms']:.1f} ms",
            f"median of {imported['runs']}; CPU {imported['ampguard_cpu_ms']:.1f} ms"
            + (f"; on a terminal {terminal:.1f} ms" if terminal is not None else ""),
            f"<= {TARGETS['import_overhead_ms']:g} ms",
            met.get("import_overhead_ms", ""),
        ]
    watched = result.get("sampled_steps", {}).get("headroom_watch")
    if watched and "unavailable" not in watched:
        yield [
            "a step the headroom watch observes",
            "-",
            f"{watched['watched_ms']:.2f} ms",
            f"x{watched['ratio']:.3f} an ordinary step ({watched['normal_ms']:.2f} ms); one in {watched['every']}: "
            f"{watched['amortised']:+.2%} amortised (in the step-time ratio above)",
            "",
            "",
        ]
    sample = result.get("sampled_steps", {}).get("underflow")
    if sample:
        yield [
            "a step sampled for underflow",
            f"{sample['healthy_ms']:.2f} ms (healthy)",
            f"{sample['sampled_ms']:.2f} ms",
            f"median paired ratio {sample['ratio']:.3f}, {sample['extra_reads']:+d} read; every "
            f"{sample['every']} steps: {sample['overhead_at_every']:+.2%} of the run",
            "reported",
            "",
        ]
    clip = result["clip_idle"]
    yield [
        f"clip_grad_norm_, {clip['tensors']} tensors, nothing scaled",
        f"{clip['torch_us_per_call']:.0f} us (median)",
        f"{clip['ampguard_us_per_call']:.0f} us (median)",
        f"median paired {clip['overhead']:+.2%} ({clip['overhead_min']:+.1%}..{clip['overhead_max']:+.1%}); "
        f"syncs {clip['torch_syncs_per_call']} vs {clip['ampguard_syncs_per_call']}"
        + ("" if clip["wrapped"] else "; clip patch not applied")
        + (
            f"; {DISAGREE}"
            if medians_disagree(clip["torch_us_per_call"], clip["ampguard_us_per_call"], 1.0 + clip["overhead"])
            else ""
        ),
        f"<= {TARGETS['clip_idle_overhead']:.0%}",
        met.get("clip_idle_overhead", ""),
    ]
