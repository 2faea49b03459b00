"""train.py's job (plugin.job.life, plugin.job.saves): the --save lock held from the first line to the last, a used
directory refused on every rank (rank 0 saying why), which steps a loop saves, the line after a stop."""
import signal

import pytest

from plugin.checkpoint.directory import MANIFEST
from plugin.job.life import Job
from plugin.job.lock import LOCK_NAME
from plugin.job.saves import Saves


def _complete_step(directory, step: int) -> None:
    d = directory / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / ".metadata").write_text("")
    (d / MANIFEST).write_text('{"complete": true}')


def test_rank_0_holds_the_lock_inside_the_job_and_gives_it_and_the_signals_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with Job(str(tmp_path / "ck"), environ={"RANK": "0"}) as job:
        assert job.rank0 and (tmp_path / "ck" / LOCK_NAME).exists()
        assert signal.getsignal(signal.SIGTERM) is not before
    assert not (tmp_path / "ck" / LOCK_NAME).exists() and signal.getsignal(signal.SIGTERM) is before
    with Job(str(tmp_path / "other"), environ={"RANK": "1"}):
        assert not (tmp_path / "other" / LOCK_NAME).exists()  # only rank 0 takes it


def test_a_fresh_run_into_another_run_s_checkpoints_is_refused_on_every_rank(tmp_path, capsys):
    _complete_step(tmp_path / "ck", 3)
    for rank in ("0", "1"):
        with pytest.raises(SystemExit) as e:
            with Job(str(tmp_path / "ck"), environ={"RANK": rank}):
                raise AssertionError("entered")
        err = capsys.readouterr().err
        assert e.value.code == 2 and ("holds the complete checkpoints of another run (steps 3)" in err) == (rank == "0")
        assert not (tmp_path / "ck" / LOCK_NAME).exists()
    with Job(str(tmp_path / "ck"), resume=str(tmp_path / "ck"), environ={"RANK": "0"}):
        pass  # its own run: resumed


def test_the_steps_a_loop_saves_and_the_line_after_a_stop(tmp_path):
    saves = Saves("ck", every=3)
    assert [s for s in range(1, 9) if saves.due(s, last=s == 8, stop=s == 5)] == [3, 5, 6, 8]
    assert not Saves(None, every=3).due(3, last=True, stop=True)
    assert saves.stopped_line(5) == "interrupted at step 5; saved ck/step-00000005; resume with --resume ck"
    assert Saves(None).stopped_line(5) == "interrupted at step 5; nothing saved (no --save)"
    assert Saves(str(tmp_path), resume="auto").resume_dir is None  # --resume auto, nothing saved yet: a fresh start
    _complete_step(tmp_path, 4)
    assert Saves(str(tmp_path), resume="auto").resume_dir == str(tmp_path)
