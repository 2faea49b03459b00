"""``launch.sh --elastic MIN:MAX [--max-restarts K]``: torchrun's elastic agent with a c10d rendezvous (pure: no
torch), run once on each node with the same ``--master`` (the rendezvous endpoint).

torchrun then restarts every worker on each membership change (a node lost, a node joining) with the new world;
train.py's ``--elastic`` re-resolves the recipe's data degree there, trains on the most processes it can use and
resumes from ``--save``'s latest complete step. So the recipe must be elastic (``"data": "auto"`` and
``batch.global``, :func:`plugin.recipe.elastic.elastic_problems`), every node count of the range must train on at
least one process, and train.py needs ``--save``: all refused here before anything starts. The back end is
train.py's choice as under any torchrun (DeepSpeed's engine included); DeepSpeed's own launcher and
``accelerate launch`` start a fixed world and are refused with ``--elastic``.

Every agent gets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch's default, the agents share their
rendezvous store with the workers and a node joining a later round waits for a master address nobody writes
there (torch 2.13: ``DistStoreError: wait timeout after 60000ms, keys: /torch.rendezvous.<id>.<round>/torchelastic/
role_info/0, ...``; pytorch#135712 is the shared store's opt-out), which ends the job.
"""
from __future__ import annotations

from ..elastic.world import NO_SHARED_STORE, model_words
from ..errors import Problem
from ..recipe.elastic import elastic_problems, usable_world

DEFAULT_MAX_RESTARTS = 3
# torch's c10d rendezvous waits 30 s (last_call_timeout) for more nodes once MIN are there: most of a recovery's time
# here. The survivors of a loss fail together and a newcomer is announced to every agent at once, so 5 s takes them
# all; a node arriving later only starts one more round (a membership change: no restart spent).
LAST_CALL_S = 5


def node_range(text: str) -> tuple[int, int]:
    """``"1:3"`` -> (1, 3); ``"2"`` -> (2, 2). Raises ValueError with what was expected."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--elastic {text!r}: expected MIN:MAX node counts, e.g. 1:4") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"--elastic {text!r}: expected 1 <= MIN <= MAX")
    return lo, hi


def elastic_launch_problems(recipe, nodes: tuple[int, int], per_node: int, train_args: list[str]) -> list[Problem]:
    """What stops ``recipe`` from an elastic launch of ``per_node`` processes on each of MIN..MAX nodes."""
    problems = elastic_problems(recipe)
    if not problems:
        dead = [n for n in range(nodes[0], nodes[1] + 1) if usable_world(recipe, n * per_node) is None]
        if dead:
            p = recipe.parallelism
            problems.append(Problem("$.parallelism", f"at {', '.join(map(str, dead))} node(s) of {per_node} "
                                    f"process(es) no number of processes trains the recipe ({model_words(p)}, "
                                    f"batch.global {recipe.batch.global_})",
                                    "raise MIN (or --nproc) so that every node count holds "
                                    f"{model_words(p, numbers=False)} processes", file=str(recipe.source)))
    if not any(a == "--save" or a.startswith("--save=") for a in train_args):
        problems.append(Problem("--save", "an elastic job resumes every restart from train.py's --save directory, "
                                "and none is given", "pass -- --save DIR (a directory every node reaches)"))
    return problems


def elastic_command(python: str, nodes: tuple[int, int], per_node: int, endpoint: str, run_id: str,
                    max_restarts: int | None, train: list[str]) -> tuple[list[str], dict]:
    """(argv, extra environment) of torchrun's elastic launch of ``train`` (train.py and its arguments)."""
    lo, hi = nodes
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", f"{lo}:{hi}", "--nproc_per_node", str(per_node),
           "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint, "--rdzv_id", run_id,
           "--rdzv_conf", f"last_call_timeout={LAST_CALL_S}",
           "--max_restarts", str(DEFAULT_MAX_RESTARTS if max_restarts is None else max_restarts),
           *train, *([] if "--elastic" in train else ["--elastic"])]
    return cmd, {NO_SHARED_STORE: "1"}
