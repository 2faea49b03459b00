"""launch.sh inside a Slurm allocation, its pure parts (plugin.launch.slurm): the allocation read from Slurm's
environment, the checks against the recipe's world (one line each, with the fix), the srun command, the start line's
words. The real Slurm runs in tests/dist/test_slurm.py."""
import socket

import pytest

from plugin.distributed.env import scheduler_words
from plugin.launch.launcher import main
from plugin.launch.machine import Machine
from plugin.launch.slurm.allocation import Allocation, SlurmError, allocation_from, gpus_per_node, node_address
from plugin.launch.slurm.fit import fit_allocation
from plugin.launch.slurm.srun import AGENT, refuse_launcher, rendezvous_port, srun_command, step_refusal
from plugin.recipe.checks import load_recipe
from plugin.recipe.spec import Recipe

JOB = {"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4",
       "SLURM_CPUS_PER_TASK": "32", "SLURMD_NODENAME": "gpu01"}


def alloc(nodes=("n1",), gpus=0, job="7", **kw) -> Allocation:
    return Allocation(job_id=job, nodes=tuple(nodes), nodelist=",".join(nodes), gpus_per_node=gpus, **kw)


def line(problem) -> str:
    """The problem's line without its file (a recipe built from a dict has none)."""
    return problem.format()[len(problem.file) + 2:] if problem.file else problem.format()


def recipe_with(base: str, **blocks) -> Recipe:
    data = load_recipe(base).to_dict()
    data.update(blocks)
    return Recipe.from_dict(data)


def test_the_allocation_from_slurms_environment():
    a = allocation_from({**JOB, "SLURM_RESTART_COUNT": "1"}, ["gpu01", "gpu02"])
    assert (a.job_id, a.nodes, a.nodelist, a.gpus_per_node, a.cpus_per_task, a.restart, a.this_node, a.step) == \
        ("12", ("gpu01", "gpu02"), "gpu[01-02]", 4, 32, 1, "gpu01", None)
    assert a.run_id == "slurm-12"  # the same at every start of the job: its lock and ledger know it
    assert a.words() == "Slurm job 12 (start 2) on gpu01, gpu02"
    assert allocation_from({"SLURM_JOB_ID": "3", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "n1"}, ["n1"]).words() == \
        "Slurm job 3 on n1"


@pytest.mark.parametrize("environ, gpus", [
    ({"SLURM_GPUS_ON_NODE": "8"}, 8),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4),
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:2"}, 4),
    ({"SLURM_GPUS_PER_NODE": "2"}, 2),
    ({"SLURM_JOB_GPUS": "0,1,2"}, 3),
    ({}, 0),
])
def test_gpus_per_node(environ, gpus):
    assert gpus_per_node(environ) == gpus


def test_what_cannot_be_read_says_so():
    with pytest.raises(SlurmError, match=r"SLURM_GPUS_PER_NODE='gpu:lots'.*-> pass --nproc N"):
        gpus_per_node({"SLURM_GPUS_PER_NODE": "gpu:lots"})
    with pytest.raises(SlurmError, match="SLURM_JOB_NUM_NODES=3, but its node list gpu\\[01-02\\] has 2"):
        allocation_from({**JOB, "SLURM_JOB_NUM_NODES": "3"}, ["gpu01", "gpu02"])
    with pytest.raises(SlurmError, match="not inside a Slurm allocation"):
        allocation_from({}, ["n1"])


def test_a_nodes_address_is_its_nodeaddr_else_its_name():
    line = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=0 NodeAddr=127.0.0.1 NodeHostName=vm Port=16818 "
            "Version=22.05.8")  # scontrol show node -o n1, as Debian's Slurm 22.05 prints it
    assert node_address(line, "n1") == "127.0.0.1"
    assert node_address("NodeName=gpu01 State=IDLE", "gpu01") == "gpu01"


def test_a_recipe_for_more_nodes_than_the_allocation_is_one_line_with_the_fix():
    recipe = recipe_with("cpu_tp2_dp2", cluster={"nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 4})
    per_node, problems = fit_allocation(recipe, alloc(["n1"]), None)
    assert per_node is None
    assert [line(p) for p in problems] == [
        "$.cluster.nodes: the recipe asks for 2 nodes, Slurm job 7 has 1 node (n1) -> submit it on 2 nodes "
        f"(sbatch --nodes=2; python -m plugin sbatch {recipe.name} writes the script), or set cluster.nodes to 1"]
    assert "\n" not in problems[0].format()


def test_the_processes_per_node():
    tp2dp2 = load_recipe("cpu_tp2_dp2")  # 4 processes, cluster 1 x 4
    assert fit_allocation(tp2dp2, alloc(["n1"]), None) == (4, [])
    two = recipe_with("cpu_tp2_dp2", cluster={"nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 4})
    assert fit_allocation(two, alloc(["n1", "n2"]), None) == (2, [])
    assert fit_allocation(two, alloc(["n1", "n2"], gpus=2), None) == (2, [])
    auto = load_recipe("tp2_auto")  # data auto, cluster 1 x 8
    assert fit_allocation(auto, alloc(["g1"], gpus=4), None)[0] == 4  # the GPUs the job holds
    assert fit_allocation(auto, alloc(["g1"]), None)[0] == 8  # CPU nodes: the recipe's gpus_per_node
    assert fit_allocation(auto, alloc(["g1"]), 6)[0] == 6


@pytest.mark.parametrize("base, blocks, allocation, nproc, expected", [
    ("cpu_tp2_dp2", {"cluster": None}, alloc(["a", "b", "c"]), None,
     "$.parallelism: the recipe's 4 processes do not split evenly over the 3 nodes of Slurm job 7 -> submit it on a "
     "number of nodes that divides them (sbatch --nodes=N), or change the layout"),
    ("cpu_tp2_dp2", {}, alloc(["n1"], gpus=2), None,
     "$.parallelism: 4 processes per node, and Slurm job 7 holds 2 GPUs on each node -> submit it with "
     "--gpus-per-node=4 (python -m plugin sbatch writes it), or on more nodes"),
    ("cpu_tp2_dp2", {}, alloc(["n1"]), 2,
     "--nproc: 2 processes on each of the 1 node(s) of Slurm job 7 make 2, the recipe's layout needs 4 -> drop "
     "--nproc (launch.sh puts 4 / nodes on each), or change the layout"),
    ("tp2_auto", {"cluster": None}, alloc(["n1"]), None,
     '$.parallelism.data: "auto" fills the world from the processes per node, and Slurm job 7 holds no GPU to count '
     "them by -> pass --nproc N (processes per node), or give the recipe a cluster block (gpus_per_node)"),
])
def test_each_mismatch_is_one_line_naming_it_and_the_fix(base, blocks, allocation, nproc, expected):
    recipe = recipe_with(base, **blocks)
    per_node, problems = fit_allocation(recipe, allocation, nproc)
    assert per_node is None
    assert [line(p) for p in problems if p.is_error] == [expected]


def test_fewer_processes_than_gpus_is_a_warning():
    per_node, problems = fit_allocation(load_recipe("cpu_tp2_dp2"), alloc(["n1"], gpus=8), None)
    assert per_node == 4 and [p.is_error for p in problems] == [False]
    assert "use 4 of the 8 GPUs" in problems[0].message


def test_the_srun_command():
    a = allocation_from(JOB, ["gpu01", "gpu02"])
    cmd = srun_command("/venv/bin/python", a, 4, "10.0.0.1:23456", ["/repo/train.py", "--recipe", "/r.json"])
    assert cmd == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                   "--cpus-per-task=32", "/venv/bin/python", "-m", AGENT, "--nnodes", "2", "--nproc_per_node", "4",
                   "--rdzv_backend", "c10d", "--rdzv_endpoint", "10.0.0.1:23456", "--rdzv_id", "slurm-12",
                   "/repo/train.py", "--recipe", "/r.json"]
    in_step = srun_command("p", alloc(["n1"], step="0"), 2, "h:1", [])
    assert "--overlap" in in_step and "--cpus-per-task" not in " ".join(in_step)


def test_the_rendezvous_port():
    here = alloc(["n1", "n2"], this_node="n1")  # a batch script: on the first node, a free port there
    port = rendezvous_port(here)
    with socket.socket() as s:
        s.bind(("", port))  # free
    assert rendezvous_port(alloc(["n1", "n2"], job="12345")) == 20000 + 2345  # elsewhere: from the job id
    assert rendezvous_port(alloc(["n1", "n2"], job="9", this_node="n2")) == 20009


def test_refusals_under_slurm():
    a = alloc(["n1", "n2"], job="5")
    assert refuse_launcher("auto", a) is None and refuse_launcher("torchrun", a) is None
    assert refuse_launcher("deepspeed", a).startswith("--launcher deepspeed inside Slurm job 5 on n1, n2: launch.sh "
                                                      "starts torchrun on every node with srun there")
    assert step_refusal(alloc(["n1"], step="0", step_tasks=1)) is None  # an interactive step: launch.sh once
    assert "(srun launch.sh): each would start the whole job -> run launch.sh once" in \
        step_refusal(alloc(["n1", "n2"], step="0", step_tasks=2))


def test_the_start_lines_words():
    assert scheduler_words({}) == ""
    assert scheduler_words({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n[1-2]"}) == ", Slurm job 12 on n[1-2]"
    assert scheduler_words({"SLURM_JOB_ID": "12", "SLURM_JOB_NODELIST": "n1", "SLURM_RESTART_COUNT": "2"}) == \
        ", Slurm job 12 on n1, requeued 2 times"


def test_nodes_given_on_the_command_line_are_not_slurms(monkeypatch, capsys):
    """Inside an allocation, --nodes/--master say where to run: launch.sh does as told (no srun)."""
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    machine = Machine(gpus=0, cpus=2, has_deepspeed=False, has_accelerate=False, python="/venv/bin/python")
    assert main(["--dry-run", "--nodes", "2", "--node-rank", "0", "--master", "h:29500", "cpu_dp4"], machine) == 0
    out = capsys.readouterr().out
    assert "torch.distributed.run" in out and "srun" not in out
