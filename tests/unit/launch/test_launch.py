"""launch.sh's choices (plugin.launch): validation first, launcher, process count, the exact command."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.launch.hostfile import HostfileError, read_hostfile
from plugin.launch.launcher import LaunchError, Request, build_command, main, parse, pick_launcher, processes_per_node
from plugin.launch.machine import Machine
from plugin.recipe.checks import load_recipe

ROOT = Path(__file__).resolve().parents[3]
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
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_tp2_pp2").to_dict()
    data["pipeline_parallel"]["schedule"] = "gpipe"
    r = Recipe.from_dict(data)
    assert pick_launcher(r, "auto", CPU_ALL) == "accelerate"
    with pytest.raises(LaunchError, match="1F1B only"):
        pick_launcher(r, "deepspeed", CPU_ALL)


def test_an_auto_recipe_with_moe_layers_over_data_ranks_gets_torchrun():
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_dp4").to_dict()
    data["parallelism"]["expert"], data["zero"] = 2, {"stage": 0}
    data["model"]["moe"] = {"experts": 4, "top_k": 2, "every": 2}
    r = Recipe.from_dict(data)
    assert pick_launcher(r, "auto", CPU_ALL) == "torchrun"  # DeepSpeed's processes would refuse it
    assert pick_launcher(r, "deepspeed", CPU_ALL) == "deepspeed"  # asked for: its refusal names the axis


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


def _hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_hostfile_is_read_as_deepspeed_reads_it(tmp_path):
    runner = pytest.importorskip("deepspeed.launcher.runner")  # the reference: DeepSpeed's own parser

    text = "# two workers\n\nworker-1 slots=4\n  worker-2   slots=2 # spare\n"
    assert read_hostfile(_hostfile(tmp_path, text)) == dict(runner._parse_hostfile(text.splitlines(True)))
    assert read_hostfile(_hostfile(tmp_path, text)) == {"worker-1": 4, "worker-2": 2}


def test_bad_hostfiles_are_named_by_line(tmp_path):
    for bad, why in [("worker-1\n", "line 1: 'worker-1' is not a host entry"),
                     ("a slots=1\n# c\na slots=2\n", "line 3: host 'a' is listed twice"),
                     ("# nothing\n\n", "lists no host")]:
        with pytest.raises(HostfileError, match=why):
            read_hostfile(_hostfile(tmp_path, bad))
    with pytest.raises(HostfileError, match="missing: cannot read the hostfile"):
        read_hostfile(str(tmp_path / "missing"))


def test_hostfile_launch_leaves_the_master_to_deepspeed(tmp_path, capsys):
    """DeepSpeed's runner asks the first host for its address only when no --master_addr is given: a
    127.0.0.1 would point every node at itself."""
    hosts = _hostfile(tmp_path, "# cluster\nworker-1 slots=4\nworker-2 slots=4\n")
    assert main(["--dry-run", "--hostfile", hosts, "cpu_dp4"], machine=CPU_ALL) == 0
    cmd = capsys.readouterr().out.split()
    assert "--master_addr" not in cmd and "--master_port" not in cmd and "--no_ssh" not in cmd
    at = cmd.index("--hostfile")
    assert cmd[at:at + 4] == ["--hostfile", hosts, "--num_gpus", "2"], "cpu_dp4's 4 processes over 2 hosts"
    assert main(["--dry-run", "--hostfile", hosts, "--master", "10.0.0.1:6000", "cpu_dp4"], machine=CPU_ALL) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.1" and cmd[cmd.index("--master_port") + 1] == "6000"


def test_hostfile_hosts_and_slots_make_the_world_checked(tmp_path, capsys):
    two = _hostfile(tmp_path, "worker-1 slots=4\nworker-2 slots=4\n")
    # --nproc 4 on each of 2 hosts is a world of 8: cpu_dp4 (4) is refused before anything starts
    assert main(["--dry-run", "--hostfile", two, "--nproc", "4", "cpu_dp4"], machine=CPU_ALL) == 2
    assert "but the launcher runs 8" in capsys.readouterr().err
    # "data": "auto" takes every slot: 8 processes, tensor 2 x data 4, DeepSpeed uses each host's slots
    assert main(["--dry-run", "--hostfile", two, "tp2_auto"], machine=CPU_ALL) == 0
    assert "--num_gpus" not in capsys.readouterr().out.split()
    uneven = _hostfile(tmp_path, "a slots=3\nb slots=2\n")  # 5 processes cannot hold tensor 2
    assert main(["--dry-run", "--hostfile", uneven, "tp2_auto"], machine=CPU_ALL) == 2
    assert "cannot fill a world of 5 processes" in capsys.readouterr().err
    small = _hostfile(tmp_path, "a slots=1\nb slots=1\n")
    assert main(["--dry-run", "--hostfile", small, "cpu_dp4"], machine=CPU_ALL) == 1
    assert "puts 2 on each host, more than a (slots=1), b (slots=1) offers" in capsys.readouterr().err
    three = _hostfile(tmp_path, "a slots=4\nb slots=4\nc slots=4\n")
    assert main(["--dry-run", "--hostfile", three, "cpu_dp4"], machine=CPU_ALL) == 1
    assert "4 processes do not split evenly over its 3 hosts" in capsys.readouterr().err


def test_hostfile_errors_are_clear(tmp_path, capsys):
    assert main(["--dry-run", "--hostfile", str(tmp_path / "nope"), "cpu_dp4"], machine=CPU_ALL) == 1
    assert "nope: cannot read the hostfile (No such file or directory)" in capsys.readouterr().err
    hosts = _hostfile(tmp_path, "a slots=2\nb slots=2\n")
    assert main(["--dry-run", "--hostfile", hosts, "--launcher", "torchrun", "cpu_dp4"], machine=CPU_ALL) == 1
    assert "the torchrun launcher cannot use it" in capsys.readouterr().err
    assert main(["--dry-run", "--hostfile", hosts, "--nodes", "2", "cpu_dp4"], machine=CPU_ALL) == 1
    assert "--hostfile lists the nodes itself" in capsys.readouterr().err


def test_a_recipe_without_a_model_block_is_refused_as_train_py_would(capsys):
    assert main(["--dry-run", str(ROOT / "examples" / "lenet_dp.json")], machine=CPU_ALL) == 2
    assert "lenet_dp.json: $.model: train.py builds its model from the recipe's model block -> add one" in \
        capsys.readouterr().err


def test_launch_sh_resolves_paths_against_the_callers_directory(tmp_path):
    """No cd: a recipe given relative to the caller's directory is found, train.py gets it absolute, and
    train.py's own relative paths (--save, --metrics) are passed unchanged to run in the caller's directory."""
    (tmp_path / "mine.json").write_text((ROOT / "recipes" / "cpu_dp4.json").read_text().replace(
        '"name": "cpu_dp4"', '"name": "mine"'))
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([str(ROOT / "launch.sh"), "--dry-run", "mine.json", "--", "--save", "ck", "--metrics",
                          "m.jsonl"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-7:] == [str(ROOT / "train.py"), "--recipe", str(tmp_path / "mine.json"), "--save",
                                       "ck", "--metrics", "m.jsonl"]
    out = subprocess.run([str(ROOT / "launch.sh"), "--dry-run", "cpu_tp2_dp2"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert out.returncode == 0 and str(ROOT / "recipes" / "cpu_tp2_dp2.json") in out.stdout, out.stderr


def _elastic_recipe(tmp_path):
    data = json.loads((ROOT / "recipes" / "cpu_tp2_dp2.json").read_text())
    data["name"], data["parallelism"] = "el", {"data": "auto", "tensor": 2, "pipeline": 1}
    path = tmp_path / "el.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_elastic_is_torchruns_c10d_rendezvous_with_the_shared_store_off(tmp_path, capsys):
    recipe = _elastic_recipe(tmp_path)
    argv = ["--dry-run", "--elastic", "1:3", "--max-restarts", "5", "--master", "10.0.0.1:29400", "--nproc", "2",
            recipe, "--", "--save", "ck"]
    assert main(argv, machine=CPU_ALL) == 0  # deepspeed installed: the engine is train.py's choice under torchrun
    out = capsys.readouterr().out
    assert out.startswith("OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")
    assert ("-m torch.distributed.run --nnodes 1:3 --nproc_per_node 2 --rdzv_backend c10d --rdzv_endpoint "
            "10.0.0.1:29400 --rdzv_id el-29400 --rdzv_conf last_call_timeout=5 --max_restarts 5 ") in out
    assert out.rstrip().endswith(f"--recipe {recipe} --save ck --elastic")


def test_elastic_refusals_come_before_anything_starts(tmp_path, capsys):
    recipe = _elastic_recipe(tmp_path)
    common = ["--dry-run", "--master", "h:1", "--nproc", "2"]
    assert main([*common, "--elastic", "1:2", "--launcher", "deepspeed", recipe, "--", "--save", "ck"],
                machine=CPU_ALL) == 1
    assert "--launcher deepspeed with --elastic: DeepSpeed's launcher starts a fixed world" in capsys.readouterr().err
    assert main([*common, "--elastic", "1:2", recipe], machine=CPU_ALL) == 2
    assert "--save: an elastic job resumes every restart from train.py's --save directory" in capsys.readouterr().err
    assert main([*common, "--elastic", "1:2", "cpu_tp2_dp2", "--", "--save", "ck"], machine=CPU_ALL) == 2
    assert "$.parallelism.data" in capsys.readouterr().err  # a fixed data degree cannot follow the world
    assert main(["--dry-run", "--nproc", "1", "--elastic", "1:2", "--master", "h:1", recipe, "--", "--save", "ck"],
                machine=CPU_ALL) == 2
    assert "at 1 node(s) of 1 process(es) no number of processes trains the recipe" in capsys.readouterr().err
    for bad, said in ((["--elastic", "2:1", "--master", "h:1"], "expected 1 <= MIN <= MAX"),
                      (["--elastic", "1:2"], "needs --master ADDR:PORT"),
                      (["--elastic", "1:2", "--nodes", "2", "--master", "h:1"], "replaces --nodes"),
                      (["--max-restarts", "2"], "--max-restarts goes with --elastic")):
        assert main(["--dry-run", *bad, recipe], machine=CPU_ALL) == 1
        assert said in capsys.readouterr().err
