"""``ampguard doctor``: this machine, ampguard's state here, and the precision setup to train with.

Works on a machine without a GPU. ``--json`` prints one object whose fields
are documented in ``docs/doctor.md`` (a test keeps the two in step). Exit status
0, or 2 when the configuration has a bad value (the report is printed all the same).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import ampguard.config.names as variable_names
import ampguard.machine as machine
from ampguard.commands.console import print_table

JSON_SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON (fields: docs/doctor.md) instead of tables")


def collect() -> dict[str, Any]:
    """Everything the doctor reports, as plain JSON-serialisable data."""
    import torch

    import ampguard
    import ampguard.config as config_module
    from ampguard.errors import ConfigError
    from ampguard.registry import active_config

    report = machine.cuda_report()
    try:
        config = active_config()
        error: ConfigError | None = None
    except ConfigError as bad:  # a finding: the rest of the report still helps
        config = config_module.load({}, patch_names=[])
        error = bad
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "ampguard_version": ampguard.__version__,
        "python": {"version": machine.python_version(), "executable": machine.python_executable()},
        "platform": platform.platform(),
        "torch": {
            "version": torch.__version__,
            "cuda_build": report.build,
            "hip_build": report.hip,
            "cudnn": report.cudnn,
            "cuda_available": report.available,
            "cuda_error": report.error,
            "is_bf16_supported": report.torch_says_bf16,
        },
        "gpus": [gpu.as_dict() for gpu in report.gpus],
        "patches": [entry.as_dict() for entry in ampguard.status()],
        "config": config.as_dict(),
        "config_error": None if error is None else str(error),
        "config_problems": [] if error is None else [str(problem) for problem in error.problems],
        "config_warnings": [
            variable_names.warning(name, config_module.SETTINGS_BY_VARIABLE)
            for name in variable_names.unknown(os.environ, config_module.SETTINGS_BY_VARIABLE)
        ],
        "environment": {
            setting.variable: os.environ[setting.variable]
            for setting in config_module.SETTINGS
            if setting.variable in os.environ
        },
        "libraries": [{"name": name, "version": version} for name, version in machine.installed_libraries().items()],
        "recommendation": machine.recommend(report).as_dict(),
    }


def _yes_no(value: bool | None) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def render(data: dict[str, Any]) -> None:
    """The report as tables (rich on a terminal, plain text otherwise)."""
    out = sys.stdout
    torch_info = data["torch"]
    cuda = torch_info["cuda_build"] or (
        f"ROCm {torch_info['hip_build']}" if torch_info["hip_build"] else "none (CPU-only build)"
    )
    rows: list[list[object]] = [
        ["ampguard", data["ampguard_version"]],
        ["python", f"{data['python']['version']} ({data['python']['executable']})"],
        ["platform", data["platform"]],
        ["torch", torch_info["version"]],
        ["CUDA build", cuda],
        ["cuDNN", torch_info["cudnn"] if torch_info["cudnn"] is not None else "-"],
        ["CUDA available", _yes_no(torch_info["cuda_available"])],
    ]
    if torch_info["cuda_error"]:
        rows.append(["CUDA problem", torch_info["cuda_error"]])
    if torch_info["is_bf16_supported"] is not None:
        rows.append(["torch.cuda.is_bf16_supported()", torch_info["is_bf16_supported"]])
    rows.extend(["configuration problem", problem] for problem in data["config_problems"])
    rows.extend(["configuration warning", warning] for warning in data["config_warnings"])
    print_table("ampguard doctor", ["item", "value"], rows, out)
    out.write("\n")

    if data["gpus"]:
        print_table(
            "GPUs",
            ["index", "name", "capability", "memory (GiB)", "native bf16"],
            [
                [g["index"], g["name"], g["capability"], g["total_memory_gib"], _yes_no(g["bf16_native"])]
                for g in data["gpus"]
            ],
            out,
        )
    else:
        out.write("GPUs: none visible to torch\n")
    out.write("\n")

    print_table(
        "patches",
        ["name", "state", "reason"],
        [[p["name"], p["state"], p["reason"] or "-"] for p in data["patches"]],
        out,
    )
    out.write("\n")

    from ampguard.config import SETTINGS

    environment = data["environment"]
    print_table(
        "configuration",
        ["variable", "value", "from"],
        [
            [
                s.variable,
                _config_value(data["config"].get(s.attribute)),
                "environment" if s.variable in environment else "default",
            ]
            for s in SETTINGS
        ],
        out,
    )
    out.write("\n")

    if data["libraries"]:
        print_table(
            "trainer libraries", ["name", "version"], [[lib["name"], lib["version"]] for lib in data["libraries"]], out
        )
    else:
        out.write("trainer libraries: none of the known ones is installed\n")
    out.write("\n")

    advice = data["recommendation"]
    out.write(f"recommendation: {advice['summary']}\n")
    for reason in advice["reasons"]:
        out.write(f"  - {reason}\n")


def _config_value(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(value) or "-"
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, ".10g")
    return str(value)


def main(args: argparse.Namespace) -> int:
    """Exit status 0, or 2 when an ``AMPGUARD_*`` value is bad (as every other command that needs the
    configuration exits); a name ampguard does not know is a warning and leaves it 0."""
    data = collect()
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        render(data)
    if data["config_problems"] or data["config_error"]:
        count = len(data["config_problems"]) or 1
        print(
            f"ampguard doctor: error: {count} bad AMPGUARD_* value{'s' if count != 1 else ''} "
            f"({'config_problems' if args.json else 'configuration problem, above'}): exit status 2",
            file=sys.stderr,
        )
        return 2
    return 0
