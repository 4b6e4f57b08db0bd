"""The HF Trainer on test_master_weights_hf.py's tiny Llama (60 steps, fp16 autocast, AdamW), loaded in float32
or in float16 (master weights), under ampguard with ``AMPGUARD_UNDERFLOW=report|adapt``: what the underflow
patch measured and did.

Run as a script for docs/underflow.md's numbers::

    python tests/integration/hf_underflow.py [--every 10] [--modes report adapt] [--dtypes float32 float16]

prints one JSON line per run and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # the helper modules next to this file and in tests/support/ import by name
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "support")]

import test_master_weights_hf
import torch
from accelerate.state import AcceleratorState, GradientState
from integration_support import note_new_sample, require, samples_text
from test_accelerate_hf import hand_cpu_scaler

import ampguard

MODES = ("report", "adapt")
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def run(mode: str, dtype: str, *, every: int, optim: str = "adamw_torch") -> dict[str, Any]:
    """One run of the test's ``_train`` with ``AMPGUARD_UNDERFLOW=mode`` (ampguard installed again): the
    scaler's stats at the end, the eval loss before and after, and each sample with the scale it ran at."""
    os.environ.update(AMPGUARD_UNDERFLOW=mode, AMPGUARD_UNDERFLOW_EVERY=str(every))
    ampguard.uninstall()
    ampguard.install()
    AcceleratorState._reset_state(reset_partial_state=True)  # accelerate's singletons: one Accelerator per run
    GradientState._reset_state()
    samples: list[dict[str, Any]] = []

    def hand_and_watch_scaler(accelerator: Any, scaler_class: Any = None) -> None:
        hand_cpu_scaler(accelerator, scaler_class)
        scaler = accelerator.scaler
        update = scaler.update

        def update_and_note(*args: Any, **kwargs: Any) -> None:
            update(*args, **kwargs)
            note_new_sample(scaler.stats.as_dict(), samples)

        scaler.update = update_and_note

    transformers = require("transformers")
    test_master_weights_hf.hand_cpu_scaler = hand_and_watch_scaler  # what _train's Trainer calls
    try:
        with tempfile.TemporaryDirectory() as directory:
            path = test_master_weights_hf._saved_tiny_llama(transformers, Path(directory) / "llama")
            start, end, trainer = test_master_weights_hf._train(
                transformers, path, Path(directory) / "out", DTYPES[dtype], optim
            )
    finally:
        test_master_weights_hf.hand_cpu_scaler = hand_cpu_scaler
    stats = trainer.accelerator.scaler.stats.as_dict()
    keys = ("steps", "skipped", "scale", "underflow_samples", "underflow_growths", "underflow_share")
    return {"mode": mode, "dtype": dtype, **{key: stats[key] for key in keys}} | {
        "modules": stats["underflow_modules"],
        "eval_start": round(start, 4),
        "eval_end": round(end, 4),
        "samples": samples,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model loaded in | mode | samples | growths | final scale | skipped | underflow at the sampled steps (scale) "
        "| last sample's modules | eval loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        modules = ", ".join(f"`{name}` ({share:.1%})" for name, share in row["modules"])
        lines.append(
            f"| {row['dtype']} | {row['mode']} | {row['underflow_samples']} | {row['underflow_growths']} "
            f"| {row['scale']:g} | {row['skipped']} | {samples_text(row['samples'])} | {modules} "
            f"| {row['eval_start']:.4f} -> {row['eval_end']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10, help="AMPGUARD_UNDERFLOW_EVERY")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for dtype in args.dtypes:
        for mode in args.modes:
            rows.append(run(mode, dtype, every=args.every))
            print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
