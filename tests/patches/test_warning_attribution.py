"""torch's own warnings from inside ampguard's wrappers point where plain torch points them, as often.

The same script runs under plain torch and under ampguard (CUDA hidden, so
that torch warns that CUDA autocast and the CUDA GradScaler are disabled); the
UserWarnings each run prints, with their file and line, are compared.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from torchrun_support import environment_without_ampguard

import ampguard

SCRIPT = """
import sys
if sys.argv[1] == "ampguard":
    import ampguard
import torch

model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
scheduler.step()  # before optimizer.step(): torch warns
legacy_scaler = torch.cuda.amp.GradScaler()  # LEGACY SCALER
scaler = torch.amp.GradScaler("cuda")
for step in range(3):
    with torch.cuda.amp.autocast():
        loss = model(torch.randn(2, 4)).sum()
    with torch.autocast("cuda"):
        loss = loss + model(torch.randn(2, 4)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
"""

WARNING_LINE = re.compile(r"^(?P<file>.+?):(?P<line>\d+): UserWarning: (?P<message>.*)$")
AMPGUARD_DIRECTORY = os.path.dirname(ampguard.__file__)


def _user_warnings(script: Path, mode: str) -> list[tuple[str, int, str]]:
    result = subprocess.run(
        [sys.executable, str(script), mode],
        cwd=script.parent,
        env=environment_without_ampguard(CUDA_VISIBLE_DEVICES="", AMPGUARD_QUIET="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return [
        (match["file"], int(match["line"]), match["message"])
        for match in map(WARNING_LINE.match, result.stderr.splitlines())
        if match
    ]


def test_torch_warnings_point_where_they_point_under_plain_torch_and_print_as_often(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    legacy_scaler_line = next(n for n, line in enumerate(script.read_text().splitlines(), 1) if "LEGACY SCALER" in line)

    plain = _user_warnings(script, "plain")
    guarded = _user_warnings(script, "ampguard")

    messages = [message for _, _, message in plain]
    # the legacy and the modern line (torch < 2.4 warns from its own file: one location, printed once)
    assert sum("Disabling" in message for message in messages) >= 1, plain
    assert any("before `optimizer.step()`" in message for message in messages), plain
    # Plain torch names its legacy class's file for torch.cuda.amp.GradScaler(); ampguard's legacy class is its
    # own, so the warning names the line the user wrote. Everything else: the same file, line and count.
    legacy_scaler_file = os.path.join("torch", "cuda", "amp", "grad_scaler.py")
    expected = [
        (str(script), legacy_scaler_line, message) if file.endswith(legacy_scaler_file) else (file, line, message)
        for file, line, message in plain
    ]
    assert guarded == expected
    assert not [warning for warning in guarded if warning[0].startswith(AMPGUARD_DIRECTORY)]
