"""The README's demo script, ``examples/xtts_style_finetune.py``, run in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_finetune(*command: str, **env: str) -> dict[str, Any]:
    """``python [COMMAND...] examples/xtts_style_finetune.py --steps 40`` (no AMPGUARD_* variable but ``env``):
    each scenario's result by name, and ``results``, ``warnings`` (its FutureWarnings) and ``stderr``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    result = subprocess.run(
        [sys.executable, *command, str(EXAMPLES / "xtts_style_finetune.py"), "--steps", "40"],
        capture_output=True,
        text=True,
        env={**base, **env},
        check=True,
    )
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return {r["scenario"]: r for r in summary["results"]} | {
        "results": summary["results"],
        "warnings": summary["future_warnings"],
        "stderr": result.stderr,
    }
