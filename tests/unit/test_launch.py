"""launch.sh's choices (plugin.launch): validation first, launcher, process count, the exact command."""
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.checks import load_recipe
from plugin.launch import LaunchError, Machine, Request, build_command, main, parse, pick_launcher, \
    processes_per_node

ROOT = Path(__file__).resolve().parents[2]
CPU_ALL = Machine(gpus=0, cpus=2, has_deepspeed=True, has_accelerate=True, python="/venv/bin/python")
CPU_NO_DS = Machine(gpus=0, cpus=2, has_deepspeed=False, has_accelerate=True, python="/venv/bin/python")
CPU_BARE = Machine(gpus=0, cpus=2, has_deepspeed=False, has_accelerate=False, python="/venv/bin/python")
GPU8 = Machine(gpus=8, cpus=64, has_deepspeed=True, has_accelerate=True, python="/venv/bin/python")


def test_launcher_preference():
    r = load_recipe("cpu_dp4")
    assert pick_launcher(r, "auto", CPU_ALL) == "deepspeed"
    assert pick_launcher(r, "auto", CPU_NO_DS) == "accelerate"
    assert pick_launcher(r, "auto", CPU_BARE) == "torchrun"
    assert pick_launcher(r, "torchrun", CPU_ALL) == "torchrun"
    with pytest.raises(LaunchError, match="deepspeed is not installed"):
        pick_launcher(r, "deepspeed", CPU_NO_DS)


def test_a_schedule_deepspeed_cannot_run_goes_elsewhere(tmp_path):
    from plugin.recipe import Recipe

    data = load_recipe("cpu_tp2_pp2").to_dict()
    data["pipeline_parallel"]["schedule"] = "gpipe"
    r = Recipe.from_dict(data)
    assert pick_launcher(r, "auto", CPU_ALL) == "accelerate"
    with pytest.raises(LaunchError, match="1F1B only"):
        pick_launcher(r, "deepspeed", CPU_ALL)


def test_process_count():
    assert processes_per_node(load_recipe("cpu_tp2_pp2"), Request(), CPU_ALL) == 4
    assert processes_per_node(load_recipe("tp2_auto"), Request(), GPU8) == 8
    assert processes_per_node(load_recipe("tp2_auto"), Request(), CPU_ALL) == 2
    assert processes_per_node(load_recipe("tp2_auto"), Request(nproc=6), CPU_ALL) == 6
    assert processes_per_node(load_recipe("tp2_dp4"), Request(nodes=2, master="h:1"), GPU8) == 4


def test_commands():
    r = load_recipe("cpu_dp4")
    cmd, env = build_command("R.json", r, Request(master="10.0.0.1:29500"), CPU_ALL)
    assert cmd[0].endswith("deepspeed") and cmd[1:7] == ["--num_gpus", "4", "--master_addr", "10.0.0.1",
                                                         "--master_port", "29500"]
    assert cmd[-2:] == ["--recipe", "R.json"] and env["OMP_NUM_THREADS"] == "1"
    cmd, _ = build_command("R.json", r, Request(launcher="torchrun", nodes=2, node_rank=1, master="h:7"), CPU_ALL)
    assert cmd[1:] [:9] == ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "2", "--node_rank",
                            "1", "--rdzv_endpoint"] and "h:7" in cmd
    cmd, env = build_command("R.json", r, Request(launcher="accelerate", nodes=2, node_rank=1, master="h:7"),
                             CPU_NO_DS)
    joined = " ".join(cmd)
    assert "--multi_gpu --num_processes 4 --num_machines 2 --machine_rank 1" in joined
    assert "--main_process_ip h --main_process_port 7" in joined and env["ACCELERATE_USE_CPU"] == "true"
    cmd, _ = build_command("R.json", r, Request(hostfile="hosts"), GPU8)
    assert cmd[1:3] == ["--hostfile", "hosts"]


def test_parse():
    req = parse(["--nproc", "2", "cpu_tp2_dp2", "--", "--steps", "3"])
    assert (req.recipe, req.nproc, req.train_args) == ("cpu_tp2_dp2", 2, ["--steps", "3"])
    assert parse([]).recipe == "cpu_dp4"


def test_invalid_recipe_exits_2_and_starts_nothing(capsys):
    bad = ROOT / "tests" / "data" / "invalid" / "zero3_with_pipeline.json"
    assert main(["--dry-run", str(bad)], machine=CPU_ALL) == 2
    assert "DeepSpeed refuses" in capsys.readouterr().err
    assert main(["--dry-run", "--nproc", "3", "cpu_dp4"], machine=CPU_ALL) == 2  # world 3 != 4
    assert main(["--bogus"], machine=CPU_ALL) == 1


def test_launch_sh_dry_run_prints_the_exact_command():
    out = subprocess.run([str(ROOT / "launch.sh"), "--dry-run", "--launcher", "torchrun", "cpu_tp2_pp2", "--",
                          "--steps", "2"], capture_output=True, text=True, env={"PYTHON": sys.executable,
                                                                                "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert "torch.distributed.run --nproc_per_node 4 --standalone" in out.stdout
    assert out.stdout.strip().endswith("--recipe " + str(ROOT / "recipes" / "cpu_tp2_pp2.json") + " --steps 2")


def test_deepspeed_on_several_nodes_without_ssh_gets_a_hostfile():
    """deepspeed's runner refuses --num_nodes > 1 without a host list, even with --no_ssh: launch.sh writes one."""
    r = load_recipe("cpu_tp2_dp2")
    cmd, _ = build_command("R.json", r, Request(nodes=2, node_rank=1, master="10.0.0.1:29500"), CPU_ALL)
    hostfile = Path(cmd[cmd.index("--hostfile") + 1])
    assert hostfile.read_text() == "node0 slots=2\nnode1 slots=2\n"
    assert cmd[cmd.index("--no_ssh") + 1:][:2] == ["--node_rank", "1"]
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.1" and cmd[cmd.index("--master_port") + 1] == "29500"
