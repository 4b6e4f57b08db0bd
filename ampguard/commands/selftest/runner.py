"""Running the checks: which apply, stock torch for the references, one failing check never stops the others.

A check is a function ``(Context) -> CheckResult``. Its reference runs in this
process on torch without ampguard (:func:`plain_torch`: ampguard uninstalled and
installed again with the same configuration), so that whatever ampguard
changes shows up as a difference. A check whose patch the user switched off,
or whose feature a setting switches off or sets to report only
(:attr:`Check.needs`), is "not applicable", never "passed". ampguard's own
errors during a check, contained so that training goes on, fail it
(:mod:`.faults`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

import ampguard
import ampguard.commands.selftest.faults as faults
import ampguard.config as config_module
import ampguard.registry as registry
import ampguard.stats.summary as summary
from ampguard.commands.selftest.result import CheckResult, Context, not_applicable
from ampguard.config import Config

# Why a setting leaves nothing of a check's feature to check (e.g. "AMPGUARD_UNDERFLOW=off: ..."), or None.
Need = Callable[[Config], "str | None"]


@dataclass(frozen=True)
class Check:
    """A check, the patches it is about (each must be applied for the check to mean anything), the settings its
    feature needs (``needs``: each says why the user's configuration leaves nothing to check, or None), and the
    check's own (``settings``: its schedule, over the user's configuration)."""

    name: str
    function: Callable[[Context], CheckResult]
    patches: tuple[str, ...]
    needs: tuple[Need, ...] = ()
    settings: tuple[tuple[str, str], ...] = ()  # run with these AMPGUARD_* variables (over default_schedule's)


def patch_states() -> dict[str, str]:
    """``{patch name: "applied" | "disabled" | "unavailable"}`` of the installation now."""
    return {entry.name: entry.state for entry in ampguard.status()}


# The environments the installation was made from, the one in effect now last (None: os.environ).
_environments: list[Mapping[str, str] | None] = [None]


@contextlib.contextmanager
def plain_torch() -> Iterator[None]:
    """torch without ampguard inside the block (the reference runs); the same installation afterwards."""
    ampguard.uninstall()
    try:
        yield
    finally:
        ampguard.install(_environments[-1])


@contextlib.contextmanager
def configured(variables: Mapping[str, str]) -> Iterator[None]:
    """ampguard installed with these ``AMPGUARD_*`` variables over the environment's inside the block (a check's own
    settings); as before afterwards. Nothing is installed again when they change nothing."""
    environ = {**(_environments[-1] or os.environ), **variables}
    if config_module.load(environ, patch_names=registry.patch_names()) == registry.active_config():
        yield
        return
    ampguard.uninstall()
    _environments.append(environ)
    try:
        ampguard.install(environ)
        yield
    finally:
        _environments.pop()
        ampguard.uninstall()
        ampguard.install(_environments[-1])


def default_schedule(config: Config) -> dict[str, str]:
    """The headroom watch's and the underflow samples' default schedule (the watch stays off where it is off).

    Every check runs with it, over the user's settings, unless it has its own (:attr:`Check.settings`): the
    checks compare with torch step by step and count a healthy step's cost, and a watched or sampled step is no
    healthy step (``AMPGUARD_WATCH_EVERY=1`` would watch every one).
    """
    names = ("AMPGUARD_UNDERFLOW_EVERY", "AMPGUARD_HEADROOM") + (
        ("AMPGUARD_WATCH_EVERY",) if config.watch_every else ()
    )
    return {name: config_module.default_text(config_module.SETTINGS_BY_VARIABLE[name]) for name in names}


def why_not_applicable(check: Check) -> str | None:
    """Why the check has nothing of ampguard's to check here (a patch not applied, a setting), or None."""
    states = patch_states()
    off = [f"{name} {states.get(name, 'unknown')}" for name in check.patches if states.get(name) != "applied"]
    if off:
        return "patch " + ", ".join(off) + ": nothing of ampguard's to check"
    config = registry.active_config()
    return next((why for why in (need(config) for need in check.needs) if why), None)


def run_check(check: Check, context: Context) -> CheckResult:
    """The check's result; an exception inside it, or ampguard's own error contained during it, is a failure."""
    why = why_not_applicable(check)
    if why is not None:
        return not_applicable(check.name, why)
    started = time.perf_counter()
    settings = {**default_schedule(registry.active_config()), **dict(check.settings)}
    with faults.recorded() as recorder:
        try:
            with configured(settings):
                result = check.function(context)
        except Exception as error:
            result = CheckResult(check.name, "failed", None, None, f"raised {type(error).__name__}: {error}")
    result = faults.apply(result, recorder.distinct())
    return dataclasses.replace(result, seconds=time.perf_counter() - started)


def run_checks(
    checks: list[Check], context: Context, progress: Callable[[str], None] | None = None
) -> list[CheckResult]:
    """Every check in order, its log held back (:mod:`.faults`), on one intra-op CPU thread (tiny models run
    faster so); ampguard installed once with :func:`default_schedule` for all of them."""
    threads = torch.get_num_threads()
    results = []
    with summary.left_out(), configured(default_schedule(registry.active_config())):
        torch.set_num_threads(1)
        try:
            for check in checks:
                if progress is not None:
                    progress(check.name)
                results.append(run_check(check, context))
        finally:
            torch.set_num_threads(threads)
    return results
