"""Does the recipe's world fit the Slurm allocation? Checked by launch.sh before any process starts (pure: no torch).

One rule each, one line each, naming the mismatch and the fix: the recipe's ``cluster.nodes`` against the job's
nodes, the recipe's processes split evenly over those nodes, the processes per node against the GPUs the job holds
there. What passes gives the processes per node; the whole world then goes through the recipe's own checks
(:func:`plugin.recipe.checks.validate` with the world size), as every launch does.
"""
from __future__ import annotations

from ...errors import WARNING, Problem
from .allocation import Allocation


def _job(alloc: Allocation) -> str:
    n = len(alloc.nodes)
    return f"Slurm job {alloc.job_id} has {n} node{'s' if n != 1 else ''} ({alloc.nodelist})"


def check_nodes(recipe, alloc: Allocation) -> list[Problem]:
    """The recipe's ``cluster.nodes`` is the allocation's node count (a recipe without a cluster block takes it)."""
    c, nodes = recipe.cluster, len(alloc.nodes)
    if c is None or c.nodes == nodes:
        return []
    fix = (f"submit it on {c.nodes} node{'s' if c.nodes != 1 else ''} (sbatch --nodes={c.nodes}; python -m plugin "
           f"sbatch {recipe.name} writes the script), or set cluster.nodes to {nodes}")
    return [Problem("$.cluster.nodes", f"the recipe asks for {c.nodes} node{'s' if c.nodes != 1 else ''}, "
                    f"{_job(alloc)}", fix, file=str(recipe.source))]


def processes_per_node(recipe, alloc: Allocation, nproc: int | None) -> tuple[int | None, list[Problem]]:
    """(processes per node, problems): ``--nproc``, else the recipe's fixed world over the nodes, else (``"data":
    "auto"``) the GPUs per node, else on CPU nodes the recipe's ``cluster.gpus_per_node``."""
    par, nodes, source = recipe.parallelism, len(alloc.nodes), str(recipe.source)
    if par.data != "auto":
        world = par.data * par.tensor * par.pipeline * par.context
        if nproc is not None and nproc * nodes != world:
            return None, [Problem("--nproc", f"{nproc} processes on each of the {nodes} node(s) of Slurm job "
                                  f"{alloc.job_id} make {nproc * nodes}, the recipe's layout needs {world}",
                                  f"drop --nproc (launch.sh puts {world} / nodes on each), or change the layout",
                                  file=source)]
        if world % nodes:
            return None, [Problem("$.parallelism", f"the recipe's {world} processes do not split evenly over the "
                                  f"{nodes} nodes of Slurm job {alloc.job_id}",
                                  "submit it on a number of nodes that divides them (sbatch --nodes=N), or change "
                                  "the layout", file=source)]
        return world // nodes, []
    if nproc is not None:
        return nproc, []
    if alloc.gpus_per_node:
        return alloc.gpus_per_node, []
    if recipe.cluster is not None:
        return recipe.cluster.gpus_per_node, []
    return None, [Problem("$.parallelism.data", f'"auto" fills the world from the processes per node, and Slurm job '
                          f"{alloc.job_id} holds no GPU to count them by",
                          "pass --nproc N (processes per node), or give the recipe a cluster block (gpus_per_node)",
                          file=source)]


def check_gpus(recipe, alloc: Allocation, per_node: int) -> list[Problem]:
    """Processes per node against the GPUs the job holds on each node (nothing to check on CPU nodes)."""
    gpus = alloc.gpus_per_node
    if not gpus or per_node == gpus:
        return []
    if per_node > gpus:
        return [Problem("$.parallelism", f"{per_node} processes per node, and Slurm job {alloc.job_id} holds {gpus} "
                        f"GPU{'s' if gpus != 1 else ''} on each node",
                        f"submit it with --gpus-per-node={per_node} (python -m plugin sbatch writes it), or on more "
                        "nodes", file=str(recipe.source))]
    return [Problem("$.parallelism", f"{per_node} processes per node use {per_node} of the {gpus} GPUs Slurm job "
                    f"{alloc.job_id} holds on each node", f"submit it with --gpus-per-node={per_node}", WARNING,
                    file=str(recipe.source))]


def fit_allocation(recipe, alloc: Allocation, nproc: int | None) -> tuple[int | None, list[Problem]]:
    """(processes per node, every problem): None when an error stops the launch."""
    problems = check_nodes(recipe, alloc)
    per_node, more = processes_per_node(recipe, alloc, nproc)
    problems += more
    if per_node is not None:
        problems += check_gpus(recipe, alloc, per_node)
    return (None if any(p.is_error for p in problems) else per_node), problems
