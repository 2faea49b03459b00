"""``launch.sh``'s brain: validate the recipe, pick a launcher, count processes, build the exact command.

Quick (no torch import): it validates first (exit 2 on an invalid recipe, nothing started), then
picks deepspeed when it is importable and the recipe allows it, else accelerate, else torchrun; derives the
process count from the recipe and the machine (GPUs, else CPU processes); ``--dry-run`` prints the command.

Several nodes (run launch.sh once on each, with the same ``--master``): ``--nodes N --node-rank R --master A:P``
becomes torchrun ``--nnodes N --node_rank R --rdzv_endpoint A:P`` (static rendezvous), accelerate launch
``--num_machines N --machine_rank R --main_process_ip A --main_process_port P`` (with ``--num_processes`` the
whole world), and deepspeed ``--no_ssh --node_rank R --master_addr A --master_port P`` with a generated
hostfile (:func:`no_ssh_hostfile`). ``--hostfile FILE`` instead hands DeepSpeed its own ssh-based launch from
one node: the hosts and slots come from the file (:func:`read_hostfile`), so the world checked against the
recipe is the whole job's; without ``--master`` no address is passed and DeepSpeed's runner asks the first
host for its own (``ssh HOST hostname -I``), with its default port.

Inside a Slurm allocation (``SLURM_JOB_ID`` set), unless ``--nodes``, ``--hostfile``, ``--elastic`` or ``--master``
says where to run: one torchrun per node of the allocation with ``srun``, the allocation checked against the
recipe first (:mod:`.slurm`).

An elastic job (``--elastic MIN:MAX`` instead of ``--nodes N``, run on each node with the same ``--master``, the
rendezvous endpoint) is torchrun's elastic agent: :mod:`.elastic`.

Relative paths (the recipe, the hostfile, train.py's own arguments) are the caller's: launch.sh does not
change directory, and the recipe reaches train.py as an absolute path.

A ``--save DIR`` that another live job holds (or, without ``--resume``, that holds another run's complete
checkpoints) is refused first, before the recipe is read (:func:`plugin.job.lock.save_refusal`). The launcher runs
as launch.sh's child (:mod:`plugin.job.supervise`): a SIGINT or SIGTERM to launch.sh reaches every worker, which
stops at its next step boundary (saving it with ``--save``), and nothing of the launcher's tree outlives it.
``PLUGIN_RUN_ID`` (the job's run id, made here unless set) names the job in its ``--save`` lock.
"""
from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..engines.choose import native_only
from ..errors import Problem
from ..interop.precision import PRECISIONS
from ..job import supervise
from ..job.lock import new_run_id, save_refusal
from .argv import train_option
from .elastic import elastic_command, elastic_launch_problems, node_range
from .hostfile import HostfileError, read_hostfile
from .machine import Machine
from .slurm.allocation import in_allocation

ROOT = Path(__file__).resolve().parents[2]  # the checkout: plugin/launch/launcher.py -> <repo> (train.py is there)
DEFAULT_RECIPE = "cpu_dp4"


@dataclass
class Request:
    recipe: str = DEFAULT_RECIPE
    launcher: str = "auto"
    nproc: int | None = None  # processes per node
    nodes: int = 1  # with a hostfile: unused, the file's hosts are the nodes
    node_rank: int = 0
    master: str | None = None  # ADDR:PORT
    hostfile: str | None = None  # a DeepSpeed hostfile: DeepSpeed's ssh-based launch of every host
    dry_run: bool = False
    train_args: list = field(default_factory=list)
    elastic: tuple[int, int] | None = None  # (MIN, MAX) nodes: torchrun's elastic agent, c10d rendezvous
    max_restarts: int | None = None  # with elastic: torchrun's --max_restarts (default DEFAULT_MAX_RESTARTS)


class LaunchError(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class World:
    """The launched job: ``per_node`` processes on each of ``nodes`` nodes, ``total`` in all. ``per_node`` is
    None when each host of a hostfile runs as many as its slots (they may differ)."""

    per_node: int | None
    nodes: int
    total: int


def check_train_script(recipe) -> list:
    """What train.py needs beyond a valid recipe (launch.sh refuses up front what train.py would)."""
    if recipe.model is not None:
        return []
    return [Problem("$.model", "train.py builds its model from the recipe's model block", "add one",
                    file=str(recipe.source))]


def plan_world(recipe, req: Request, machine: Machine) -> World:
    """How many processes the launch starts, per node and in all.

    Without a hostfile: :func:`processes_per_node` on each of ``--nodes``. With one, its hosts are the nodes:
    ``--nproc`` per host, else the recipe's fixed world split evenly over the hosts, else (``"data": "auto"``)
    every slot of every host. A host with fewer slots than it would run is an error.
    """
    if not req.hostfile:
        nproc = processes_per_node(recipe, req, machine)
        return World(nproc, req.nodes, nproc * req.nodes)
    try:
        hosts = read_hostfile(req.hostfile)
    except HostfileError as e:
        raise LaunchError(str(e)) from None
    nodes = len(hosts)
    if req.nproc is not None:
        per, why = req.nproc, f"--nproc {req.nproc}"
    elif recipe.parallelism.data != "auto":
        world = recipe.parallelism.data * recipe.parallelism.tensor * recipe.parallelism.pipeline
        if world % nodes:
            raise LaunchError(f"{req.hostfile}: the recipe's {world} processes do not split evenly over its {nodes} "
                              "hosts -> list a number of hosts that divides them, or pass --nproc")
        per, why = world // nodes, f"the recipe's {world} processes over {nodes} host(s)"
    else:
        return World(None, nodes, sum(hosts.values()))
    short = [f"{h} (slots={s})" for h, s in hosts.items() if s < per]
    if short:
        raise LaunchError(f"{req.hostfile}: {why} puts {per} on each host, more than {', '.join(short[:3])} "
                          "offers -> raise those slots, or run fewer processes per host")
    return World(per, nodes, per * nodes)


def pick_launcher(recipe, requested: str, machine: Machine, elastic: bool = False) -> str:
    if elastic:  # torchrun alone restarts workers on a membership change; train.py still picks the back end
        if requested in ("deepspeed", "accelerate"):
            who = "DeepSpeed's launcher" if requested == "deepspeed" else "accelerate launch"
            raise LaunchError(f"--launcher {requested} with --elastic: {who} starts a fixed world and has no elastic "
                              "mode -> --launcher torchrun (or auto): train.py picks the same back end under "
                              "torchrun, DeepSpeed's engine included")
        return "torchrun"
    wanted = requested if requested != "auto" else recipe.launcher
    deepspeed_allowed = recipe.parallelism.pipeline == 1 or recipe.pipeline_parallel.schedule == "1f1b"
    if wanted == "deepspeed":
        if not machine.has_deepspeed:
            raise LaunchError("deepspeed is not installed -> pip install deepspeed (with torch pinned), "
                              "or use --launcher accelerate/torchrun")
        if not deepspeed_allowed:
            raise LaunchError(f'DeepSpeed runs 1F1B only; the recipe asks for "{recipe.pipeline_parallel.schedule}" '
                              "-> use --launcher torchrun or accelerate")
        return "deepspeed"
    if wanted == "accelerate":
        if not machine.has_accelerate:
            raise LaunchError("accelerate is not installed -> pip install accelerate, or use --launcher torchrun")
        return "accelerate"
    if wanted == "torchrun" or native_only(recipe):  # auto: no launcher whose processes would refuse the recipe
        return "torchrun"
    if machine.has_deepspeed and deepspeed_allowed:
        return "deepspeed"
    return "accelerate" if machine.has_accelerate else "torchrun"


def processes_per_node(recipe, req: Request, machine: Machine) -> int:
    if req.nproc is not None:
        return req.nproc
    model_ranks = recipe.parallelism.tensor * recipe.parallelism.pipeline
    if recipe.parallelism.data != "auto":
        world = recipe.parallelism.data * model_ranks
        if world % req.nodes:
            raise LaunchError(f"the recipe's {world} processes do not split evenly over {req.nodes} nodes "
                              "-> pass --nproc")
        return world // req.nodes
    if machine.gpus:
        return machine.gpus
    return model_ranks * max(1, min(4, machine.cpus) // model_ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _split_master(master: str | None) -> tuple[str, int]:
    if not master:
        return "127.0.0.1", _free_port()
    addr, _, port = master.rpartition(":")
    if not addr or not port.isdigit():
        raise LaunchError(f"--master {master!r}: expected ADDR:PORT, e.g. 10.0.0.1:29500")
    return addr, int(port)


def no_ssh_hostfile(nodes: int, slots: int) -> Path:
    """The hostfile ``deepspeed --no_ssh`` needs: its runner refuses more than one node without a host list
    ("Num nodes is >1 but no extra nodes available via hostfile"), even though each node then starts only its
    own ranks (from --node_rank) and never contacts the others by name. The names are placeholders; the file
    is written to the temp directory (also by --dry-run, so the printed command runs as shown)."""
    path = Path(tempfile.gettempdir()) / f"parallel-recipe-hostfile-{nodes}x{slots}"
    path.write_text("".join(f"node{i} slots={slots}\n" for i in range(nodes)))
    return path


def build_command(recipe_path: str, recipe, req: Request, machine: Machine,
                  world: World | None = None) -> tuple[list[str], dict]:
    """(argv, extra environment) of the launch; ``world`` as :func:`plan_world` gives it (computed if None)."""
    launcher = pick_launcher(recipe, req.launcher, machine, elastic=req.elastic is not None)
    if req.hostfile and launcher != "deepspeed":
        raise LaunchError(f"--hostfile is DeepSpeed's ssh-based launch; the {launcher} launcher cannot use it -> "
                          "run launch.sh on each node with --nodes N --node-rank R --master ADDR:PORT, "
                          "or use --launcher deepspeed")
    world = world or plan_world(recipe, req, machine)
    nproc = world.per_node
    bindir = Path(machine.python).parent
    train = [str(ROOT / "train.py"), "--recipe", recipe_path, *req.train_args]
    env = {}
    if not machine.gpus:
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    multi = req.nodes > 1
    if req.elastic:
        addr, port = _split_master(req.master)
        cmd, more = elastic_command(machine.python, req.elastic, nproc, f"{addr}:{port}", f"{recipe.name}-{port}",
                                    req.max_restarts, train)
        env.update(more)
    elif launcher == "deepspeed":
        exe = str(bindir / "deepspeed") if (bindir / "deepspeed").exists() else "deepspeed"
        cmd = [exe]
        if req.hostfile:  # DeepSpeed finds the master itself (first host, by ssh) unless --master says
            cmd += ["--hostfile", req.hostfile]
            cmd += ["--num_gpus", str(nproc)] if nproc is not None else []
            if req.master:
                addr, port = _split_master(req.master)
                cmd += ["--master_addr", addr, "--master_port", str(port)]
        else:
            addr, port = _split_master(req.master)
            if multi:
                hosts = no_ssh_hostfile(req.nodes, nproc)
                cmd += ["--hostfile", str(hosts), "--no_ssh", "--node_rank", str(req.node_rank)]
            cmd += ["--num_gpus", str(nproc), "--master_addr", addr, "--master_port", str(port)]
        if "--verbose" not in req.train_args:  # the launcher's own INFO/WARNING lines, as train.py quiets the ranks'
            cmd += ["--log_level", "error"]
        cmd += train
        if not machine.gpus:
            env["DS_ACCELERATOR"] = "cpu"
    elif launcher == "torchrun":
        addr, port = _split_master(req.master)
        cmd = [machine.python, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        if multi:
            cmd += ["--nnodes", str(req.nodes), "--node_rank", str(req.node_rank), "--rdzv_endpoint", f"{addr}:{port}"]
        else:
            cmd += ["--standalone"]
        cmd += train
    else:
        addr, port = _split_master(req.master)
        cmd = [machine.python, "-m", "accelerate.commands.launch", "--num_processes", str(nproc * req.nodes),
               "--num_machines", str(req.nodes), "--machine_rank", str(req.node_rank),
               "--main_process_ip", addr, "--main_process_port", str(port)]
        if nproc * req.nodes > 1:
            cmd.insert(3, "--multi_gpu")  # with ACCELERATE_USE_CPU this is gloo over N CPU processes
        cmd += ["--mixed_precision", PRECISIONS[recipe.precision].accelerate, "--dynamo_backend", "no"]
        cmd += train
        if not machine.gpus:
            env["ACCELERATE_USE_CPU"] = "true"
    return cmd, env


def parse(argv: list[str]) -> Request:
    train_args = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="launch.sh", description="Validate a recipe, pick a launcher, train.")
    p.add_argument("--launcher", default="auto", choices=["auto", "deepspeed", "accelerate", "torchrun"])
    p.add_argument("--nproc", type=int, help="processes per node (default: from the recipe and the machine)")
    p.add_argument("--nodes", type=int, help="number of nodes (run launch.sh on each; default 1)")
    p.add_argument("--node-rank", type=int, help="this node's rank, 0 .. nodes-1 (default 0)")
    p.add_argument("--master", help="ADDR:PORT of node 0")
    p.add_argument("--hostfile", help="a DeepSpeed hostfile, 'HOST slots=N' per line: DeepSpeed starts every host "
                                      "by ssh (deepspeed launcher only)")
    p.add_argument("--elastic", metavar="MIN:MAX", help="an elastic job of MIN to MAX nodes (instead of --nodes; run "
                   "on each node with the same --master, the rendezvous endpoint): torchrun restarts the workers on "
                   "every membership change and train.py resumes from --save")
    p.add_argument("--max-restarts", type=int, metavar="K", help="with --elastic: restarts after failures before the "
                   "job gives up (torchrun's --max_restarts; default 3; a node joining does not count)")
    p.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    p.add_argument("recipe", nargs="?", default=DEFAULT_RECIPE, help=f"default: {DEFAULT_RECIPE}")
    a = p.parse_args(argv)
    if a.hostfile and (a.nodes is not None or a.node_rank is not None):
        p.error("--hostfile lists the nodes itself: drop --nodes/--node-rank (--master ADDR:PORT may stay)")
    elastic = None
    if a.elastic is not None:
        if a.nodes is not None or a.node_rank is not None or a.hostfile:
            p.error("--elastic MIN:MAX replaces --nodes/--node-rank/--hostfile: the rendezvous numbers the nodes")
        try:
            elastic = node_range(a.elastic)
        except ValueError as e:
            p.error(str(e))
        if elastic[1] > 1 and not a.master:
            p.error("--elastic with MAX > 1 needs --master ADDR:PORT, the rendezvous endpoint every node's launch.sh "
                    "gives (the first agent there hosts it)")
    elif a.max_restarts is not None:
        p.error("--max-restarts goes with --elastic MIN:MAX")
    if a.max_restarts is not None and a.max_restarts < 0:
        p.error("--max-restarts takes a number of at least 0")
    nodes, node_rank = a.nodes or 1, a.node_rank or 0
    if nodes > 1 and not a.master:
        p.error("--nodes > 1 needs --master ADDR:PORT (or --hostfile FILE instead of --nodes)")
    return Request(recipe=a.recipe, launcher=a.launcher, nproc=a.nproc, nodes=nodes, node_rank=node_rank,
                   master=a.master, hostfile=a.hostfile, dry_run=a.dry_run, train_args=train_args,
                   elastic=elastic, max_restarts=a.max_restarts)


def main(argv: list[str] | None = None, machine: Machine | None = None) -> int:
    try:
        req = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 1
    if in_allocation(os.environ) and not (req.nodes > 1 or req.hostfile or req.elastic or req.master):
        from .slurm.srun import launch_in_allocation

        return launch_in_allocation(req, machine or Machine.detect(), os.environ, ROOT, check_train_script)
    save = None if req.dry_run else train_option(req.train_args, "--save")
    # first: a second job on a --save directory is refused in well under a second (not an elastic node joining its
    # job: train.py's lock knows the run by its rendezvous id and lets the same run through)
    if save and req.node_rank == 0 and not req.elastic:
        refused = save_refusal(save, resume=train_option(req.train_args, "--resume") is not None)
        if refused:
            print(refused, file=sys.stderr)
            return 2
    from ..recipe.checks import validate  # jsonschema: a fifth of a second, after that refusal

    machine = machine or Machine.detect()
    recipe, problems = validate(req.recipe)
    for p in problems:
        print(p.format(), file=sys.stderr)
    if recipe is None:
        return 2
    try:
        world = plan_world(recipe, req, machine)
        if req.elastic:  # the world changes: the recipe must follow it at every node count of the range
            errors = elastic_launch_problems(recipe, req.elastic, world.per_node, req.train_args)
        else:
            _, check = validate(req.recipe, world.total)
            errors = [p for p in check if p.is_error]
        errors += check_train_script(recipe)
        if errors:
            print("\n".join(p.format() for p in errors), file=sys.stderr)
            return 2
        cmd, env = build_command(str(Path(recipe.source).resolve()), recipe, req, machine, world)
    except LaunchError as e:
        print(f"launch.sh: {e}", file=sys.stderr)
        return e.code
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + (" " if env else "") + shlex.join(cmd)
    if req.dry_run:
        print(shown)
        return 0
    env.setdefault("PLUGIN_RUN_ID", os.environ.get("PLUGIN_RUN_ID") or new_run_id())  # the job's id (its --save lock)
    print(f"+ {shown}", file=sys.stderr, flush=True)
    return supervise.run(cmd, {**os.environ, **env})  # the launcher as a child: a stop reaches the workers
