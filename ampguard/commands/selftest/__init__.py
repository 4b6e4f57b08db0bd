"""``ampguard selftest``: ampguard proves itself on this machine's device, each check against torch in the same process.

Short training loops on the chosen device (``--device``; CUDA where torch sees
one): skip counting and parity with torch's own GradScaler (plain and fused
optimizer), host reads per healthy step, a forward overflow healed, the
headroom watch's island ahead of an overflow, the underflow sampler's counts,
a float16 model trained with fp32 masters, clipping with and without
``unscale_``, the device's bfloat16 and the legacy ``torch.cuda.amp``
spellings. Each check is passed, failed or not applicable (:mod:`.checks`);
ampguard's own errors during a check, contained so that training goes on, fail
it (:mod:`.faults`). The exit status is 0 when at least one check ran and
every check that ran passed, 1 when a check failed or when none ran (each
not applicable), 2 for a device this machine does not have. ``--json`` prints
one object (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default=None, metavar="DEVICE", help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object: the device, versions and checks")
    parser.add_argument("--quick", action="store_true", help="fewer steps per check")


def resolve_device(name: str | None) -> object:
    """The torch.device to check, or an error message (str) for one this machine does not have."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {name}: not a device (cpu, cuda or cuda:N)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {name}: only cpu and cuda are checked"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {name}, but torch sees no CUDA device (run `ampguard doctor`)"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {name}, but torch sees {torch.cuda.device_count()} CUDA device(s)"
    return device


def main(args: argparse.Namespace) -> int:
    import torch

    import ampguard.commands.selftest.report as report
    from ampguard.commands.selftest.checks import CHECKS
    from ampguard.commands.selftest.result import Context
    from ampguard.commands.selftest.runner import run_checks

    device = resolve_device(args.device)
    if not isinstance(device, torch.device):
        print(f"ampguard selftest: {device}", file=sys.stderr)
        return 2
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    progress = None
    if sys.stderr.isatty():

        def progress(name: str) -> None:
            print(f"ampguard selftest: {name} ...", file=sys.stderr, flush=True)

    started = time.perf_counter()
    results = run_checks(CHECKS, Context(device, quick=args.quick), progress)
    data = report.document(device, args.quick, results, time.perf_counter() - started)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        report.render(data)
    return 0 if data["passed"] else 1
