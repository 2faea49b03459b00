"""``python -m plugin sbatch``: the batch script from a recipe (plugin.launch.slurm.batch, plugin.cli.sbatch), pure.
Submitted to a real Slurm in tests/dist/test_slurm.py."""
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plugin.cli.main import main
from plugin.launch.slurm.batch import signal_lead, time_seconds

ROOT = Path(__file__).resolve().parents[3]


def sbatch(capsys, *argv) -> tuple[int, str, str]:
    code = main(["sbatch", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def directives(script: str) -> list[str]:
    return [line[len("#SBATCH "):] for line in script.splitlines() if line.startswith("#SBATCH ")]


def recipe_file(tmp_path, base="cpu_tp2_dp2", **blocks) -> str:
    data = json.loads((ROOT / "recipes" / f"{base}.json").read_text())
    data.pop("$schema")
    data.update(blocks)
    path = tmp_path / f"{data['name']}.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_a_cpu_job_from_a_recipe(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, err = sbatch(capsys, "cpu_tp2_dp2", "--cpu", "--time", "2:00:00", "--partition", "debug",
                               "--dry-run", "--", "--steps", "40", "--metrics", "m.jsonl")
    assert code == 0, err
    assert directives(script) == ["--job-name=cpu_tp2_dp2", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=4",
                                  "--partition=debug", "--time=2:00:00", f"--chdir={tmp_path}",
                                  "--output=cpu_tp2_dp2-%j.out", "--open-mode=append", "--requeue",
                                  "--signal=B:USR1@85"]
    launch = [line for line in script.splitlines() if line.startswith("PYTHON=")]
    assert len(launch) == 1 and launch[0].endswith(
        f"{ROOT / 'launch.sh'} {ROOT / 'recipes' / 'cpu_tp2_dp2.json'} -- --save checkpoints/cpu_tp2_dp2-"
        '"$SLURM_JOB_ID" --resume auto --steps 40 --metrics m.jsonl &')
    assert "scontrol requeue \"$SLURM_JOB_ID\"' USR1" in script  # the time limit's signal requeues the job
    assert not list(tmp_path.iterdir())  # --dry-run wrote nothing
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_gpu_job_and_its_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = sbatch(capsys, "tp2_dp4", "--account", "proj", "--save", "/shared/ck", "-o", "job.sh")
    assert code == 0, err
    assert out.strip() == "wrote job.sh: tp2_dp4, 1 node x 8 processes; submit it with: sbatch job.sh"
    script = (tmp_path / "job.sh").read_text()
    assert {"--nodes=1", "--gpus-per-node=8", "--cpus-per-task=32", "--account=proj"} <= set(directives(script))
    assert "-- --save /shared/ck --resume auto &" in script
    assert (tmp_path / "job.sh").stat().st_mode & 0o111


def test_two_nodes_from_the_cluster_block_or_the_flags(capsys, tmp_path):
    two = recipe_file(tmp_path, cluster={"nodes": 2, "gpus_per_node": 2, "gpu_memory_gb": 4})
    code, script, err = sbatch(capsys, two, "--cpu", "--dry-run")
    assert code == 0, err
    assert {"--nodes=2", "--cpus-per-task=2"} <= set(directives(script))
    bare = recipe_file(tmp_path, cluster=None, name="bare")
    bare_json = json.loads(Path(bare).read_text())
    bare_json.pop("cluster")
    Path(bare).write_text(json.dumps(bare_json))
    code, script, err = sbatch(capsys, bare, "--nodes", "2", "--gpus-per-node", "2", "--dry-run")
    assert code == 0, err
    assert {"--nodes=2", "--gpus-per-node=2", "--cpus-per-task=8"} <= set(directives(script))


@pytest.mark.parametrize("argv, line", [
    (["--nodes", "2"], "$.cluster.nodes: the recipe's cluster has nodes 1, and --nodes 2 says otherwise -> drop "
                       "--nodes (the cluster block gives it), or set cluster.nodes to 2 in the recipe"),
    (["--gpus-per-node", "8"], "$.cluster.gpus_per_node: the recipe's cluster has gpus_per_node 4, and "
                               "--gpus-per-node 8 says otherwise -> drop --gpus-per-node (the cluster block gives "
                               "it), or set cluster.gpus_per_node to 8 in the recipe"),
    (["--time", "1"], "--time: 1 (60 s) leaves no training before the time limit's signal, 85 s before the end -> "
                      "give at least 3 minutes"),
    (["--time", "soon"], "--time: --time 'soon': expected Slurm's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
                         "-> e.g. --time 4:00:00 (four hours) or --time 1-00:00:00 (a day)"),
    (["--", "--save", "x"], "--save: TRAIN_ARGS has --save, which the batch script sets itself -> give it to plugin "
                            "sbatch before the -- (--save DIR): the script passes it on"),
    (["--", "--resume", "x"], "--resume: TRAIN_ARGS has --resume, which the batch script sets itself -> drop it: "
                              "every start of the job runs --resume auto (the save directory's last step)"),
])
def test_refused_with_the_fix(capsys, argv, line):
    code, out, err = sbatch(capsys, "cpu_tp2_dp2", "--dry-run", *argv)
    assert (code, out) == (2, "")
    lines = [re.sub(r"^\S+cpu_tp2_dp2\.json: ", "", x) for x in err.strip().splitlines()]
    assert lines == [line]


def test_a_world_that_does_not_fit_the_cluster_is_the_recipes_own_error(capsys, tmp_path):
    three = recipe_file(tmp_path, cluster={"nodes": 3, "gpus_per_node": 4, "gpu_memory_gb": 4})
    code, _, err = sbatch(capsys, three, "--cpu", "--dry-run")
    assert code == 2 and "the recipe's 4 processes do not split evenly over 3 nodes" in err


def test_the_time_limits_signal_follows_the_grace():
    assert signal_lead([]) == 85  # train.py's 25 s + 60 s for the requeue
    assert signal_lead(["--grace", "100"]) == 160
    assert signal_lead(["--grace=7.5"]) == 68


@pytest.mark.parametrize("text, seconds", [("30", 1800), ("30:15", 1815), ("4:00:00", 14400), ("1-12", 129600),
                                           ("1-0:30", 88200), ("2-00:00:10", 172810), ("UNLIMITED", None)])
def test_slurms_time_formats(text, seconds):
    assert time_seconds(text) == seconds
