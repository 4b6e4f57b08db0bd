"""``ampguard patches``: the status table of every patch."""

from __future__ import annotations

import argparse
import json
import sys

from ampguard.commands.console import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    import ampguard

    entries = [entry.as_dict() for entry in ampguard.status()]
    if args.json:
        json.dump(entries, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print_table(
        "ampguard patches",
        ["name", "state", "reason", "summary"],
        [[e["name"], e["state"], e["reason"] or "-", e["summary"]] for e in entries],
    )
    return 0
