"""The hang guard's numbers and names, derived from the recipe's ``watchdog.timeout_s`` (pure: no torch).

* :func:`beat_s`: how often each rank's heartbeat thread beats and publishes its ledger (1 s at timeout 20, 5 s at
  the default 600): a peer is taken for stopped or dead once its beat has been silent for ``timeout_s``.
* :func:`settle_s`: how long the survivors of a timeout wait for each other's last ledgers before they report.
* :func:`process_group_timeout_s`: gloo's groups raise after ``timeout_s`` in the waiting rank, which the guard turns
  into its report; NCCL's watchdog ends the process itself (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), so its groups get
  a grace of :data:`NCCL_GRACE_S` on top, and the guard, which reads the flight recorder's pending collectives,
  reports first: NCCL's timeout is the backstop.
* :func:`nccl_env`: the environment ProcessGroupNCCL reads when it is created (torchtitan's settings): the flight
  recorder on, dumped on a timeout into the job's directory, the process ended rather than left hanging.
* :func:`run_dir`: the job's directory for the ledgers and dumps: ``<--save>/watchdog/<run>`` when the job saves,
  else ``<tmp>/plugin-watchdog/<run>``; ``<run>`` is the same on every rank (torchrun's run id and restart count,
  else the rendezvous address), so a restart (issue 24) gets a directory of its own.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

#: Every process of a job the guard stopped exits with this code (sysexits' EX_TEMPFAIL: a hang is worth a retry,
#: and torchrun's elastic agent restarts on any non-zero exit).
EXIT_HUNG = 75
NCCL_GRACE_S = 20.0
FR_BUFFER_SIZE = 2000  # entries of the flight recorder's ring, when the user set none (torch's gloo default)


def beat_s(timeout_s: float) -> float:
    """Seconds between two heartbeats: a twentieth of the timeout, within [0.5, 5].

    >>> beat_s(20), beat_s(600), beat_s(5)
    (1.0, 5.0, 0.5)
    """
    return min(5.0, max(0.5, float(timeout_s) / 20))


def settle_s(timeout_s: float) -> float:
    """The longest the survivors of a timeout wait for each other's last ledgers: three beats and a second.

    >>> settle_s(20), settle_s(600)
    (4.0, 16.0)
    """
    return 3 * beat_s(timeout_s) + 1


def process_group_timeout_s(timeout_s: float, backend: str) -> float:
    """The timeout every process group gets: ``timeout_s`` (gloo), ``timeout_s`` + :data:`NCCL_GRACE_S` (NCCL)."""
    return float(timeout_s) + (NCCL_GRACE_S if backend == "nccl" else 0.0)


def nccl_env(run_directory: Path, environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """``(variables to set, notes)`` for ProcessGroupNCCL, before it exists: the flight recorder
    (``TORCH_FR_BUFFER_SIZE``, kept when set), its dump on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
    ``TORCH_FR_DUMP_TEMP_FILE`` into ``run_directory``), and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (end the process on
    a timeout without aborting the communicators: mode 1, torchrun's default, aborts before the dump; pytorch#121055).
    A value set otherwise is replaced with a note saying so.

    >>> env, notes = nccl_env(Path("/j"), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    >>> env["TORCH_NCCL_ASYNC_ERROR_HANDLING"], env["TORCH_FR_DUMP_TEMP_FILE"], env["TORCH_FR_BUFFER_SIZE"]
    ('3', '/j/nccl_trace_rank_', '2000')
    >>> notes
    ['TORCH_NCCL_ASYNC_ERROR_HANDLING=1 -> 3 (the flight recorder dumps on a timeout only without the abort)']
    """
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_DUMP_TEMP_FILE": str(run_directory / "nccl_trace_rank_")}
    if int(environ.get("TORCH_FR_BUFFER_SIZE") or 0) <= 0:
        wanted["TORCH_FR_BUFFER_SIZE"] = str(FR_BUFFER_SIZE)
    notes = [f"{k}={environ[k]} -> {v} (the flight recorder dumps on a timeout only without the abort)"
             for k, v in wanted.items() if k == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and environ.get(k) not in (None, v)]
    return wanted, notes


def run_id(environ: Mapping[str, str]) -> str:
    """The same word on every rank of one (re)start: torchrun's run id and restart count, else the rendezvous
    address (the deepspeed launcher, a hand launch).

    >>> run_id({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"})
    'abc-2'
    >>> run_id({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    '10.0.0.1-29500'
    """
    if environ.get("TORCHELASTIC_RUN_ID", "none") != "none":  # accelerate launch leaves torchrun's default, "none"
        return f"{environ['TORCHELASTIC_RUN_ID']}-{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    word = f"{environ.get('MASTER_ADDR', 'local')}-{environ.get('MASTER_PORT', '0')}"
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in word)


def run_dir(save_dir: str | os.PathLike | None, environ: Mapping[str, str]) -> Path:
    """Where this job's ledgers and flight-recorder dumps go (see the module's docstring)."""
    base = Path(save_dir) / "watchdog" if save_dir else Path(tempfile.gettempdir()) / "plugin-watchdog"
    return base / run_id(environ)
