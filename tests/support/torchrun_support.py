"""Starting a 2-rank gloo job from a test: the 2 rank processes directly, or under torchrun.

:func:`run_ranks` starts the 2 ranks itself, with the environment torchrun would
give them: the one to use for every claim about ampguard across ranks (DDP, FSDP,
the exchanges between ranks), at one interpreter and the rendezvous less per job
than torchrun (whose agent process imports torch for nothing here).
:func:`torchrun_command` and :func:`run_torchrun` start the real thing,
``python -m torch.distributed.run --standalone --nproc-per-node 2``: only for the
claims about torchrun itself, the README's commands (tests/distributed/test_distributed.py:
``torchrun -m ampguard run`` on a script that never imports ampguard, and the DDP
example under torchrun). Both run a job once more when a rank aborted at
interpreter exit (:data:`EXIT_ABORT`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# torch's abort at interpreter exit with gloo (docs/distributed.md, "The SIGABRT"), with or without ampguard.
EXIT_ABORT = "terminate called without an active exception"
WORLD_SIZE = 2
Result = TypeVar("Result")


def torchrun_command(*entry: str, log_dir: Path | None = None, tee: bool = False) -> list[str]:
    """torchrun on 2 ranks running ``entry`` (a script and its arguments, or ``-m module ...``).

    ``log_dir``: each rank's stdout and stderr go to files there (``--redirects 3``),
    and with ``tee`` to torchrun's own output as well.
    """
    # The agent looks at its workers every 0.1 s, as torch >= 2.4 does by default: torch 2.3's 5 s kept each job
    # running up to 5 s after its ranks had exited.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD_SIZE)]
    command += ["--monitor-interval", "0.1"]
    if log_dir is not None:
        command += ["--log-dir", str(log_dir), "--redirects", "3", *(["--tee", "3"] if tee else [])]
    return [*command, *entry]


def environment_without_ampguard(**extra: str) -> dict[str, str]:
    """This process's environment less every ``AMPGUARD*`` variable, one torch thread per rank, and ``extra``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("AMPGUARD")}
    return environment | {"OMP_NUM_THREADS": "1", **extra}


def _once_more_after_an_exit_abort(run: Callable[[], Result], failed: Callable[[Result], str | None]) -> Result:
    """``run()``, and once more if ``failed`` (the output of a failed run, None when it passed) holds the abort.

    That abort comes after the script's last line, from a gloo thread freeing a
    tensor's Python object while the interpreter shuts down; it happens in plain
    torch too and only now and then (docs/distributed.md). The second run's
    result stands, whatever it is, and the first one's abort is a test warning.
    """
    result = run()
    output = failed(result)
    if output is None or EXIT_ABORT not in output:
        return result
    warnings.warn(f"a rank aborted at exit ({EXIT_ABORT!r}, torch's gloo teardown); ran the job again", stacklevel=3)
    return run()


def run_torchrun(
    command: list[str], *, cwd: Path, env: dict[str, str], timeout: float, log_dir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(command)`` for a torchrun command, once more if a rank aborted at interpreter exit."""

    def run() -> subprocess.CompletedProcess[str]:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    def failed(result: subprocess.CompletedProcess[str]) -> str | None:
        if result.returncode == 0:
            return None
        logs = "".join(p.read_text(errors="replace") for p in log_dir.glob("**/*.log")) if log_dir else ""
        return result.stdout + result.stderr + logs

    return _once_more_after_an_exit_abort(run, failed)


@dataclass
class RanksResult:
    """What the ranks of one :func:`run_ranks` job did: each rank's output, in rank order."""

    returncode: int  # 0 when every rank exited 0; else the first failed rank's status (124: the job timed out)
    stdout: list[str]
    stderr: list[str]

    @property
    def output(self) -> str:
        """Every rank's stdout and stderr, each headed by its name: for a failing test's message."""
        return "".join(
            f"--- rank {rank} {name}\n{text[-4000:]}\n"
            for rank in range(len(self.stdout))
            for name, text in (("stdout", self.stdout[rank]), ("stderr", self.stderr[rank]))
        )


def run_ranks(entry: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float) -> RanksResult:
    """``python *entry`` as the 2 ranks of a job on this machine, once more if a rank aborted at interpreter exit.

    Each rank gets the variables torchrun's agent gives its workers (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` / ``MASTER_PORT``: a port free
    just before, ...), but not ``TORCHELASTIC_USE_AGENT_STORE``: there is no agent,
    rank 0's ``init_process_group`` serves the store itself. Each rank's stdout and
    stderr go to files (``ranks/<rank>/`` under a temporary folder), read back into
    the result. As torchrun does, a rank that fails stops the others (the job
    fails, rather than waiting for a collective the failed rank will not join);
    after ``timeout`` seconds every rank is stopped and the job fails with 124.
    """

    def run() -> RanksResult:
        with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
            return _run_ranks_once(list(entry), cwd=cwd, env=env, timeout=timeout, logs=Path(logs))

    return _once_more_after_an_exit_abort(run, lambda result: result.output if result.returncode else None)


def _rank_environment(env: dict[str, str], rank: int, port: int) -> dict[str, str]:
    """``env`` and what torch.distributed.elastic's local agent sets for worker ``rank`` of one group."""
    return env | {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(WORLD_SIZE),
        "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(WORLD_SIZE),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"tests-{port}",
    }


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_ranks_once(entry: list[str], *, cwd: Path, env: dict[str, str], timeout: float, logs: Path) -> RanksResult:
    port = _free_port()
    files, ranks = [], []
    for rank in range(WORLD_SIZE):
        (logs / str(rank)).mkdir(parents=True)
        out, err = open(logs / str(rank) / "stdout.log", "wb"), open(logs / str(rank) / "stderr.log", "wb")  # noqa: SIM115
        files += [out, err]
        # Each rank in a session of its own, as torchrun starts its workers: where the kernel groups processes
        # by session for scheduling (autogroup), the 2 ranks do not share one group's time.
        environment = _rank_environment(env, rank, port)
        command = [sys.executable, *entry]
        ranks.append(
            subprocess.Popen(command, cwd=cwd, env=environment, stdout=out, stderr=err, start_new_session=True)
        )
    returncode, deadline = 0, time.monotonic() + timeout
    try:
        while returncode == 0 and None in [rank.poll() for rank in ranks]:  # (every rank polled)
            if time.monotonic() > deadline:
                returncode = 124
            else:
                returncode = next((rank.returncode for rank in ranks if rank.returncode), 0)
                time.sleep(0.05)
        returncode = returncode or next((rank.returncode for rank in ranks if rank.returncode), 0)
    finally:
        for rank in ranks:
            _stop(rank)
        for file in files:
            file.close()

    def read(rank: int, name: str) -> str:
        return (logs / str(rank) / f"{name}.log").read_text(errors="replace")

    stderr = [read(rank, "stderr") for rank in range(WORLD_SIZE)]
    if returncode == 124:
        stderr[0] += f"\nrun_ranks: stopped every rank after {timeout} s\n"
    return RanksResult(returncode, [read(rank, "stdout") for rank in range(WORLD_SIZE)], stderr)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a rank that still runs: SIGTERM, then SIGKILL after 5 s, as torchrun's agent does."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
