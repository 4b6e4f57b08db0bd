"""``ampguard bench``: ampguard's overhead against plain torch AMP, measured on this machine.

Prints a table (rich on a terminal, plain text otherwise) or, with ``--json``,
the dict :func:`ampguard.commands.bench.report.run` returns; docs/performance.md documents its
fields and the method. Exit status 0 whether or not the targets are met (the
measurements are the output); 2 for a device this machine does not have.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to train (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default=None,
                        help="autocast dtype (default: float16 on cuda; bfloat16 on cpu, whose float16 matmuls are slow)")
    parser.add_argument("--steps", type=int, default=300, metavar="N",
                        help="timed training steps per variant (default: 300)")
    parser.add_argument("--block-steps", type=int, default=None, metavar="N",
                        help="steps per timed block; blocks of the two variants alternate "
                             "(default: 1 on cpu, 10 on cuda, where a block ends with a synchronize)")
    parser.add_argument("--warmup-steps", type=int, default=10, metavar="N",
                        help="untimed steps per variant first (default: 10)")
    parser.add_argument("--fused", action="store_true",
                        help="also time a fused optimizer (AdamW(fused=True)); its syncs are always counted")
    parser.add_argument("--import-runs", type=int, default=5, metavar="N",
                        help="fresh interpreters for the import-time measurement (default: 5; 0 skips it)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (default: torch's own choice); 1 is steadier on a busy machine")
    parser.add_argument("--half-params", action="store_true",
                        help="instead: the model stored in the autocast dtype, trained with fp32 master weights, "
                             "against the same model in float32 (docs/master-weights.md)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def _at_least(option: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise SystemExit(f"ampguard bench: {option} must be >= {minimum}, got {value}")


def main(args: argparse.Namespace) -> int:
    import torch

    from ampguard.commands.bench import report, runs

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("ampguard bench: --device cuda, but torch sees no CUDA device.", file=sys.stderr)
        return 2
    _at_least("--steps", args.steps, 1)
    block_steps = args.block_steps if args.block_steps is not None else runs.default_block_steps(device)
    _at_least("--block-steps", block_steps, 1)
    _at_least("--warmup-steps", args.warmup_steps, 0)
    _at_least("--import-runs", args.import_runs, 0)
    if args.threads is not None:
        _at_least("--threads", args.threads, 1)
        torch.set_num_threads(args.threads)
    progress = None
    if sys.stderr.isatty():
        def progress(message: str) -> None:
            print(f"ampguard bench: {message} ...", file=sys.stderr, flush=True)

    options = runs.Options(
        device=device,
        dtype=args.dtype or runs.default_dtype(device),
        steps=args.steps,
        block_steps=block_steps,
        warmup_steps=args.warmup_steps,
        fused=args.fused,
        import_runs=args.import_runs,
        progress=progress,
    )
    if args.half_params:
        return _half_params(options, args.json)
    result = report.run(options)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from ampguard.console import print_table

    environment = result["environment"]
    title = (
        f"ampguard bench: {environment['device']} ({environment['device_name']}), torch {environment['torch']}, "
        f"{environment['torch_threads']} threads, load {environment['load_average_before']}"
    )
    print_table(title, ["measure", "torch", "ampguard", "result", "target", "met"], list(report.iter_table_rows(result)))
    if not result["clip_wrapped"]:
        print("note: the clip_grad patch is not applied: both variants call torch's clip_grad_norm_.")
    return 0


def _half_params(options: object, as_json: bool) -> int:
    from ampguard.commands.bench import half
    from ampguard.console import print_table

    result = half.run(options)  # type: ignore[arg-type]
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    dtype = result["autocast_dtype"]
    print_table(
        f"ampguard bench --half-params: {dtype} parameters with fp32 master weights against float32 parameters",
        ["measure", "float32 parameters", f"{dtype} + masters", "note"], half.table_rows(result),
    )
    return 0

