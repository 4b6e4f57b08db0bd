"""The table in docs/deepspeed.md: plain DeepSpeed against DeepSpeed under ampguard, ZeRO 0-3, on the CPU.

``python tests/deepspeed_fp16/measure.py [STEPS]`` (default 40) runs deepspeed_run.py once with every case: the
model's block overflowing float16 on every call, on every 5th call, never, and its gradients overflowing on
every call; each plain and under ampguard with
DeepSpeed's defaults (no ``initial_scale_power``), and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("deepspeed_run.py")


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    runs = [
        {"stage": stage, "overflow": overflow, "steps": steps, "ampguard": guarded}
        for stage in (0, 1, 2, 3)
        for overflow in ("always", "every5", "never", "backward")
        for guarded in (False, True)
    ]
    env = {**os.environ, "AMPGUARD_QUIET": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(runs)], env=env, capture_output=True, text=True, check=True
    )
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    words = {"always": "every call", "every5": "every 5th call", "never": "never", "backward": "gradients, every call"}
    print("| ZeRO stage | block overflows | DeepSpeed | end | skipped steps | final loss scale | parameters finite |")
    print("|---|---|---|---|---|---|---|")
    for run, result in zip(runs, results):
        end = f"died at step {result['died_at']} (Exiting run)" if result["died"] else f"all {steps} steps"
        print(
            f"| {run['stage']} | {words[run['overflow']]} | {'under ampguard' if run['ampguard'] else 'plain'} | {end} | "
            f"{result['engine_skipped']} | {result['scale']:g} | {'yes' if result['finite'] else 'no'} |"
        )


if __name__ == "__main__":
    main()
