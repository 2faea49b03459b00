"""What ``srun`` runs on each node: torchrun (``torch.distributed.run``), with one line instead of its traceback when
Slurm stops the job.

Slurm sends its SIGTERM to every process of a job it stops (preemption, requeue, ``scancel``), torchrun's agent
included. torch 2.13's agent passes it to its workers, waits for them (they finish their step and save it) and then
raises ``SignalException``, whose traceback (some 30 lines per node) would bury the ranks' ``interrupted at step N``
line in the job's output. Here the agent runs in this process as ``torchrun`` runs it (``runpy``, the same
arguments), and that exception ends it with one line and the exit status 128 + the signal's number; anything else
is torchrun's own.

This module never imports torch itself (launch.sh's brain does not import it at all): the agent it runs does, on
the node.
"""
from __future__ import annotations

import os
import runpy
import signal
import sys


def main(argv: list[str]) -> int:
    sys.argv = ["torchrun", *argv]
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except Exception as e:
        if type(e).__name__ != "SignalException":  # torch.distributed.elastic.multiprocessing.api.SignalException
            raise
        signum = int(getattr(e, "sigval", signal.SIGTERM))
        node = os.environ.get("SLURMD_NODENAME", "this node")
        print(f"torchrun on {node}: {signal.Signals(signum).name}, passed to its workers, which stop at their step "
              "boundary", file=sys.stderr, flush=True)
        return 128 + signum
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
