"""The selftest's output: one JSON document, or a table and, after a failure, what to send in a bug report."""

from __future__ import annotations

import platform
import sys
from typing import Any, Literal, TextIO

import torch

import ampguard
import ampguard.machine as machine
from ampguard.commands.selftest.result import CheckResult
from ampguard.commands.selftest.runner import patch_states

# 2: "outcome" ("passed", "failed", "nothing checked": no check ran, "passed" then false) and each check's
# "ampguard_errors".
JSON_SCHEMA_VERSION = 2

Outcome = Literal["passed", "failed", "nothing checked"]


def describe_device(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"name": str(device), "description": platform.processor() or platform.machine()}
    gpu = machine.gpu_info(device.index if device.index is not None else torch.cuda.current_device())
    return {"name": f"cuda:{gpu.index}", "description": gpu.label, **gpu.as_dict()}


def versions() -> dict[str, Any]:
    return {
        "ampguard": ampguard.__version__,
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "python": machine.python_version(),
        "platform": platform.platform(),
    }


def document(device: torch.device, quick: bool, results: list[CheckResult], seconds: float) -> dict[str, Any]:
    """Everything the selftest found, as the JSON object ``--json`` prints (docs/gpu.md)."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "device": describe_device(device),
        "versions": versions(),
        "patches": patch_states(),
        "quick": quick,
        "seconds": round(seconds, 2),
        "checks": [result.as_dict() for result in results],
        "outcome": outcome(results),
        "passed": passed(results),
    }


def outcome(results: list[CheckResult]) -> Outcome:
    """The run's outcome: failed when a check failed, nothing checked when none ran (each not applicable), else
    passed."""
    if any(result.status == "failed" for result in results):
        return "failed"
    if not any(result.status == "passed" for result in results):
        return "nothing checked"
    return "passed"


def passed(results: list[CheckResult]) -> bool:
    """At least one check ran, and every check that ran passed (a "not applicable" one did not run)."""
    return outcome(results) == "passed"


def render(data: dict[str, Any], stream: TextIO | None = None) -> None:
    from ampguard.commands.console import print_table

    out = stream or sys.stdout
    versions = data["versions"]
    title = (
        f"ampguard selftest on {data['device']['description']}: ampguard {versions['ampguard']}, "
        f"torch {versions['torch']} ({data['seconds']:.1f} s)"
    )
    rows = [[check["name"], check["status"], check["detail"]] for check in data["checks"]]
    print_table(title, ["check", "status", "detail"], rows, out)
    failed = [check for check in data["checks"] if check["status"] == "failed"]
    if data["outcome"] == "nothing checked":
        out.write(
            "\nno check ran: each one is not applicable here (the reasons above), so nothing of ampguard was "
            "checked on this device (exit status 1)\n"
        )
        return
    if not failed:
        out.write("\nall checks that apply here passed\n")
        return
    out.write(
        f"\n{len(failed)} check(s) failed. Please report it with the output of `ampguard selftest --json` "
        "(docs/troubleshooting.md); the numbers of the failing checks:\n"
    )
    for check in failed:
        out.write(f"  {check['name']}: measured {check['measured']}, reference {check['reference']}\n")
        for error in check.get("ampguard_errors", ()):
            out.write(f"    {error}\n")
    out.write(f"  versions: {versions}\n  device: {data['device']}\n")
