"""A real Slurm on this machine for the tests: munged, slurmctld and two slurmd (nodes n1 and n2, both this host,
each on its own port), everything in one temporary directory, stopped afterwards with nothing left running.

Debian's packages (``apt-get install slurmctld slurmd slurm-client munge``; .ci/run installs them as root). The
configuration is the smallest that runs jobs as root on one host: ``proctrack/linuxproc``, ``task/none``,
``select/cons_tres`` counting CPUs, 4 CPUs per node whatever the host has (``SlurmdParameters=config_overrides``),
a credential lifetime of 5 s (a requeued job waits that long before it may start again: Slurm's default is 120 s), a
scheduler that looks at pending jobs every second, and Slurm's default KillWait (30 s between SIGTERM and SIGKILL).
``python -m tests.dist.slurm_cluster DIR`` starts one by hand and stops it on Enter.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .needs import required
from .ports import free_port

COMMANDS = ("munged", "munge", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4
KILL_WAIT_S = 30
START_S = 60


def unavailable() -> str | None:
    """Why a Slurm cannot be started here (None: it can)."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing) -> apt-get install slurmctld slurmd "
                "slurm-client munge, as root (.ci/run does)")
    if os.geteuid() != 0:
        return "the test Slurm runs its daemons and jobs as root, and this is not root"
    return None


def need_slurm() -> None:
    """Skip with the reason where Slurm cannot run; fail instead where ``PLUGIN_REQUIRE`` lists ``slurm`` (CI)."""
    import pytest

    reason = unavailable()
    if reason is None:
        return
    if "slurm" in required():
        pytest.fail(f"PLUGIN_REQUIRE lists slurm: {reason}")
    pytest.skip(reason)


def _config(root: Path, host: str, ports: dict) -> str:
    nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={CPUS_PER_NODE}"
                      for n in NODES)
    return f"""ClusterName=plugintest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=5
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait={KILL_WAIT_S}
InactiveLimit=0
MinJobAge=600
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class SlurmCluster:
    """One Slurm controller and two nodes in ``root`` (:meth:`start`, :meth:`stop`); :attr:`env` has its SLURM_CONF."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: dict[str, subprocess.Popen] = {}
        self._stepds_before: set[int] = set()

    # ------------------------------------------------------------------ commands
    def run(self, *cmd: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        out = subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
        return out

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s fields (JobState, Restarts, ExitCode, ...), {} once Slurm forgot the job."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        fields = {}
        for word in out.stdout.split():
            key, eq, value = word.partition("=")
            if eq:
                fields[key] = value
        return fields

    def wait_for(self, what: str, predicate, timeout: float, poll: float = 0.2):
        """Poll ``predicate()`` until it returns something true; AssertionError naming ``what`` after ``timeout``."""
        end = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > end:
                raise AssertionError(f"{what}: not within {timeout:.0f} s\n{self.logs()}")
            time.sleep(poll)

    def logs(self, lines: int = 30) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    # ------------------------------------------------------------------ life
    def start(self) -> SlurmCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged: its socket's directory must be reachable
        (self.root / "state").mkdir(exist_ok=True)
        for node in NODES:
            (self.root / f"spool-{node}").mkdir(exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ports = {"ctld": free_port(), **{n: free_port() for n in NODES}}
        self.conf.write_text(_config(self.root, socket.gethostname(), ports))
        self._stepds_before = set(self._stepds())
        munged = ["munged", "--foreground", "--force", f"--socket={self.root}/munge.socket", f"--key-file={key}",
                  f"--pid-file={self.root}/munged.pid", f"--log-file={self.root}/munged.log",
                  f"--seed-file={self.root}/munged.seed"]
        self._daemon("munged", munged)
        self.wait_for("munged's socket", (self.root / "munge.socket").exists, 20, 0.05)
        self._daemon("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
        for node in NODES:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self.wait_for("both nodes idle (sinfo)", self._idle, START_S, 0.5)
        return self

    def _daemon(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / f"{name}.out", "w")
        self.daemons[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True)

    def _idle(self) -> bool:
        dead = [n for n, p in self.daemons.items() if p.poll() is not None]
        if dead:
            raise AssertionError(f"{', '.join(dead)} exited at start\n{self.logs()}")
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return out.returncode == 0 and all(states.get(n) == "idle" for n in NODES)

    def _stepds(self) -> list[int]:
        return [pid for pid in _pids() if _cmdline(pid).startswith("slurmstepd")]

    def left_behind(self) -> list[str]:
        """Processes of this cluster's jobs still running: any with a SLURM_JOB_ID and this cluster's SLURM_CONF in
        its environment (what slurmd starts for a job: the batch script, srun, the tasks and their children), any
        slurmstepd that was not there before the cluster started."""
        mark = f"SLURM_CONF={self.conf}".encode()
        left = [pid for pid in _pids() if _alive(pid) and mark in (env := _environ(pid).split(b"\0"))
                and any(v.startswith(b"SLURM_JOB_ID=") for v in env)]
        left += [pid for pid in self._stepds() if pid not in self._stepds_before and _alive(pid)]
        return [f"{pid} {_cmdline(pid)}" for pid in sorted(set(left))]

    def stop(self) -> list[str]:
        """Cancel every job, wait until none runs, stop the daemons; what was left behind (then killed)."""
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.run("scancel", *jobs, check=False)
        try:
            self.wait_for("every job ended", lambda: not self.run("squeue", "-h", "-o", "%i", check=False)
                          .stdout.split(), KILL_WAIT_S + 30, 0.5)
        except AssertionError:
            pass  # the daemons go anyway; what is left is reported below
        left = self.left_behind()
        for proc in reversed(self.daemons.values()):  # the nodes, then the controller, then munged
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for entry in left:
            try:
                os.kill(int(entry.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


if __name__ == "__main__":  # python -m tests.dist.slurm_cluster DIR: a Slurm to try things on, until Enter
    cluster = SlurmCluster(Path(sys.argv[1])).start()
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    try:
        input("Slurm is up; Enter stops it\n")
    except EOFError:
        pass
    finally:
        print("left behind:", cluster.stop())
