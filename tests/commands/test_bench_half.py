"""``ampguard bench --half-params``: half-precision parameters with fp32 masters against float32 parameters.

No timing is asserted (benchmarks go to docs/performance.md with the command);
the structure, the memory accounting and the synchronisation counts are.
"""

from __future__ import annotations

import json

import pytest
import torch

from ampguard import cli, master_weights
from ampguard.commands.bench import half, runs

TINY = runs.ModelSpec(vocab=64, d_model=16, heads=2, ff=32, layers=1, seq=8, batch=2)


@pytest.fixture
def tiny_model(monkeypatch):
    monkeypatch.setattr(runs.ModelSpec, "for_device", classmethod(lambda cls, device: TINY))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_params_bench_reports_memory_and_no_extra_syncs(dtype):
    options = runs.Options(dtype=dtype, steps=2, warmup_steps=1, model=TINY, import_runs=0)
    result = half.run(options)
    full_bytes, half_bytes = result["parameter_bytes"]
    assert half_bytes * 2 == full_bytes == result["master_bytes"]
    assert result["masters"] == len(list(torch.nn.Module.parameters(runs.TinyTransformer(TINY))))
    assert result["syncs_per_step"][1] <= result["syncs_per_step"][0]
    assert result["optimizer_state_bytes"][0] == result["optimizer_state_bytes"][1]
    assert result["finite"] and result["ratio"] > 0
    assert master_weights.applied_masters().dtypes == (
        torch.float16,
    )  # bfloat16 masters only for the length of the bench
    assert [row[0] for row in half.table_rows(result)] == [
        "step time",
        "syncs/step",
        "parameters",
        "fp32 masters",
        "optimizer state",
    ]


def test_half_params_from_the_command_line(tiny_model, capsys):
    argv = [
        "bench",
        "--half-params",
        "--json",
        "--steps",
        "1",
        "--warmup-steps",
        "0",
        "--import-runs",
        "0",
        "--dtype",
        "float16",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["autocast_dtype"] == "float16" and result["masters"] > 0


def test_half_params_needs_the_patch(reinstall):
    reinstall(AMPGUARD_MASTER_WEIGHTS="off")
    with pytest.raises(RuntimeError, match="master_weights patch is not applied"):
        half.run(runs.Options(steps=1, model=TINY, import_runs=0))
