"""Running the checks: which apply, stock torch for the references, one failing check never stops the others.

A check is a function ``(Context) -> CheckResult``. Its reference runs in this
process on torch without ampguard (:func:`plain_torch`: ampguard uninstalled and
installed again with the same configuration), so that whatever ampguard
changes shows up as a difference. A check whose patch the user switched off
is "not applicable", never "passed".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

import ampguard
import ampguard.stats.summary as summary
from ampguard.commands.selftest.result import CheckResult, Context, not_applicable


@dataclass(frozen=True)
class Check:
    """A check, and the patches it is about (each must be applied for the check to mean anything)."""

    name: str
    function: Callable[[Context], CheckResult]
    patches: tuple[str, ...]


def patch_states() -> dict[str, str]:
    """``{patch name: "applied" | "disabled" | "unavailable"}`` of the installation now."""
    return {entry.name: entry.state for entry in ampguard.status()}


@contextlib.contextmanager
def plain_torch() -> Iterator[None]:
    """torch without ampguard inside the block (the reference runs); the same installation afterwards."""
    ampguard.uninstall()
    try:
        yield
    finally:
        ampguard.install()


@contextlib.contextmanager
def quiet_ampguard_log() -> Iterator[None]:
    """The checks make skipped steps and islands on purpose: their log lines are no news to the user."""
    logger = logging.getLogger("ampguard")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def run_check(check: Check, context: Context) -> CheckResult:
    """The check's result; an exception inside it is a failure that names the exception."""
    states = patch_states()
    off = [f"{name} {states.get(name, 'unknown')}" for name in check.patches if states.get(name) != "applied"]
    if off:
        return not_applicable(check.name, "patch " + ", ".join(off) + ": nothing of ampguard's to check")
    started = time.perf_counter()
    try:
        result = check.function(context)
    except Exception as error:
        result = CheckResult(check.name, "failed", None, None, f"raised {type(error).__name__}: {error}")
    seconds = time.perf_counter() - started
    return CheckResult(result.name, result.status, result.measured, result.reference, result.detail, seconds)


def run_checks(
    checks: list[Check], context: Context, progress: Callable[[str], None] | None = None
) -> list[CheckResult]:
    """Every check in order, quietly, on one intra-op CPU thread (tiny models run faster so)."""
    threads = torch.get_num_threads()
    results = []
    with quiet_ampguard_log(), summary.left_out():
        torch.set_num_threads(1)
        try:
            for check in checks:
                if progress is not None:
                    progress(check.name)
                results.append(run_check(check, context))
        finally:
            torch.set_num_threads(threads)
    return results
