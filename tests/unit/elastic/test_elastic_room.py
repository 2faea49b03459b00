"""plugin.elastic (pure): who trains at a start of an elastic job, where --resume auto resumes from, the ledger, and
the stand-by of a node that trains none (against a real listening socket)."""
import json
import socket
import threading
import time

import pytest

from plugin.checkpoint.directory import MANIFEST
from plugin.elastic.ledger import LEDGER, Heartbeat, Ledger, read_ledger, recovery_line, write_ledger
from plugin.elastic.resume import resume_from, resume_problem
from plugin.elastic.standby import finished, hold, stand_by
from plugin.elastic.world import follow_world, idle_node_ranks, shared_store_warning
from plugin.errors import RecipeError
from plugin.recipe.spec import Recipe

# tensor 2: a world must be even; global 16 = micro 4 x accumulation x data, so data 1, 2 or 4
ELASTIC = {"name": "el", "parallelism": {"data": "auto", "tensor": 2, "pipeline": 1},
           "batch": {"global": 16, "micro": 4},
           "model": {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq_len": 16}}


def test_a_world_the_recipe_cannot_use_whole_trains_on_the_most_it_can_and_the_rest_sit_out():
    r = Recipe.from_dict(ELASTIC)
    # 6 processes: data 3 does not split 16 / 4; 4 processes (data 2) is the most that trains
    worlds = [follow_world(r, {"RANK": str(k), "WORLD_SIZE": "6"}) for k in range(6)]
    assert [w.trains for w in worlds] == [True] * 4 + [False] * 2
    assert {(w.usable, w.layout.data, w.layout.grad_accum) for w in worlds} == {(4, 2, 2)}
    assert worlds[4].sit_out_line("el") == (
        "elastic: ranks 4-5 sit out this start (exit 0 now, back at the next restart): el trains on 4 of the 6 "
        "processes, data 2 x tensor 2 x pipeline 1, the most it can use")
    three = follow_world(r, {"RANK": "2", "WORLD_SIZE": "3"})
    assert (three.trains, three.usable, list(three.surplus)) == (False, 2, [2])
    assert three.sit_out_line("el").startswith("elastic: rank 2 sits out this start")
    alone = follow_world(r, {"RANK": "0", "WORLD_SIZE": "8"})
    assert (alone.trains, alone.usable, alone.layout.data, alone.layout.grad_accum) == (True, 8, 4, 1)


def test_a_node_none_of_whose_processes_train_keeps_its_first_one_standing_by():
    r = Recipe.from_dict(ELASTIC)
    # three nodes of 2: ranks 4-5 (node 2) train none; its local rank 0 stands by so that its agent stays in the job
    worlds = [follow_world(r, {"RANK": str(k), "LOCAL_RANK": str(k % 2), "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "2"})
              for k in range(6)]
    assert [w.stands_by for w in worlds] == [False] * 4 + [True, False]
    assert worlds[4].sit_out_line("el") == (
        "elastic: ranks 4-5 sit out this start (exit 0 now, back at the next restart; rank 4 stands by, its node "
        "trains none): el trains on 4 of the 6 processes, data 2 x tensor 2 x pipeline 1, the most it can use")
    # two nodes of 3: rank 3 trains, so node 1 (ranks 3-5) is not idle and nobody stands by
    threes = [follow_world(r, {"RANK": str(k), "LOCAL_RANK": str(k % 3), "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "3"})
              for k in range(6)]
    assert not any(w.stands_by for w in threes) and "stands by" not in threes[4].sit_out_line("el")
    six = follow_world(r, {"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "2"})
    assert "; ranks 8, 10 stand by, their nodes train none)" in six.sit_out_line("el")
    assert [idle_node_ranks(*a) for a in ((6, 4, 2), (6, 3, 2), (9, 8, 3), (8, 8, 2))] == \
        [range(4, 6), range(4, 6), range(9, 9), range(8, 8)]


def test_the_sit_out_line_names_the_context_axis():
    r = Recipe.from_dict({**ELASTIC, "parallelism": {"data": "auto", "tensor": 2, "pipeline": 1, "context": 2}})
    w = follow_world(r, {"RANK": "8", "LOCAL_RANK": "0", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4"})
    assert (w.usable, w.stands_by) == (8, True)  # data 3 does not split 16 / 4: data 2 x context 2 x tensor 2
    assert w.sit_out_line("el").endswith("el trains on 8 of the 12 processes, data 2 x tensor 2 x pipeline 1 x "
                                         "context 2, the most it can use")
    with pytest.raises(RecipeError) as e:  # one replica is tensor 2 x context 2 = 4 processes
        follow_world(r, {"RANK": "0", "WORLD_SIZE": "3"})
    assert "(tensor 2 x pipeline 1 x context 2, batch.global 16" in e.value.problems[0].format()
    assert "launch at least tensor x pipeline x context processes" in e.value.problems[0].format()


def test_a_recipe_that_cannot_follow_the_world_is_refused_with_its_paths():
    fixed = Recipe.from_dict({**ELASTIC, "parallelism": {"data": 1, "tensor": 2, "pipeline": 1}})
    with pytest.raises(RecipeError) as e:
        follow_world(fixed, {"RANK": "0", "WORLD_SIZE": "2"})
    assert [p.path for p in e.value.problems] == ["$.parallelism.data"]
    with pytest.raises(RecipeError) as e:  # one process cannot hold tensor 2
        follow_world(Recipe.from_dict(ELASTIC), {"RANK": "0", "WORLD_SIZE": "1"})
    assert "no number of processes up to the 1 launched" in e.value.problems[0].format()


def test_the_shared_store_warning_only_when_torchrun_shares_it():
    assert shared_store_warning({}) is None
    assert shared_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning({"TORCHELASTIC_USE_AGENT_STORE": "True"})


def _complete(root, step):
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / MANIFEST).write_text(json.dumps({"complete": True}))
    (d / ".metadata").write_text("")


def test_resume_auto_takes_the_save_directory_once_it_holds_a_complete_step(tmp_path):
    save = tmp_path / "ckpt"
    assert resume_problem("auto", None).startswith("--resume auto resumes from the --save directory")
    assert resume_problem("auto", str(save)) is None and resume_problem("some/dir", None) is None
    assert resume_from("auto", str(save)) is None  # no directory yet: a fresh start
    (save / "step-00000003.partial").mkdir(parents=True)  # a save a crash interrupted
    assert resume_from("auto", str(save)) is None
    _complete(save, 2)
    assert resume_from("auto", str(save)) == str(save)
    assert resume_from("other", str(save)) == "other" and resume_from(None, str(save)) is None


def test_the_ledger_counts_starts_and_times_the_recovery(tmp_path):
    assert read_ledger(tmp_path) is None
    first = Heartbeat(tmp_path, "job")
    assert first.start == 0
    first.begin(True, data=2, processes=4)
    assert first.beat(1, now=100.0) is None and first.beat(2, now=101.5) is None  # a first start recovers nothing
    assert read_ledger(tmp_path) == Ledger("job", 0, 2, 101.5, 2, 4)

    survivor, other = Heartbeat(tmp_path, "job"), Heartbeat(tmp_path, "job")  # every rank reads before rank 0 writes
    survivor.begin(True, data=1, processes=2)
    other.begin(False, data=1, processes=2)
    assert (survivor.start, other.start) == (1, 1)
    assert read_ledger(tmp_path) == Ledger("job", 1, 2, 101.5, 2, 4)  # counted, the last trained step kept
    assert survivor.beat(2, now=131.25) == ("resumed at step 2 after 29.8 s, data 2 -> 1 (start 1; the last step "
                                            "trained before was 2)")
    assert other.beat(2, now=131.25) is not None and survivor.beat(3, now=132.0) is None
    assert read_ledger(tmp_path) == Ledger("job", 1, 3, 132.0, 1, 2)  # rank 0 alone writes


def test_a_restart_before_any_trained_step_is_no_recovery_and_a_torn_ledger_a_fresh_start(tmp_path):
    assert recovery_line(Ledger("", 0, 0, 0.0, 2, 4), 1, 5.0, 1) is None
    (tmp_path / LEDGER).write_text('{"run": "job", "sta')
    assert read_ledger(tmp_path) is None
    write_ledger(tmp_path, Ledger("job", 3, 7, 1.0, 1, 2))
    assert Heartbeat(tmp_path, "job").start == 4 and not list(tmp_path.glob(".*.tmp"))


class Store:
    """A listening socket standing in for the training world's store (rank 0's) for ``lifetime`` seconds: it never
    writes to a client, and at its end it closes every connection, as the process holding torch's TCPStore does."""

    def __init__(self, lifetime: float):
        server = socket.create_server(("127.0.0.1", 0))
        self.address = server.getsockname()
        threading.Thread(target=self._serve, args=(server, time.monotonic() + lifetime), daemon=True).start()

    @staticmethod
    def _serve(server, end):
        conns = []
        while (left := end - time.monotonic()) > 0:
            server.settimeout(left)
            try:
                conns.append(server.accept()[0])
            except TimeoutError:
                break
        server.close()
        for c in conns:
            c.close()


def _nothing_listens() -> tuple[str, int]:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()


def test_hold_returns_when_the_store_ends_and_at_once_when_nothing_listens():
    store = Store(lifetime=0.5)
    start = time.monotonic()
    assert hold(store.address, poll_s=0.1) is True and time.monotonic() - start >= 0.3
    assert hold(store.address, poll_s=0.1) is False  # ended: refused
    assert hold(_nothing_listens(), poll_s=0.1) is False


def test_stand_by_ends_0_with_the_run_and_1_when_no_training_world_comes(tmp_path, capsys):
    env = lambda address: {"MASTER_ADDR": address[0], "MASTER_PORT": str(address[1])}  # noqa: E731
    write_ledger(tmp_path, Ledger("job", 0, 10, 1.0, 2, 4))  # rank 0 trained the last step, then its process ended
    assert finished(tmp_path, 10) and not finished(tmp_path, 11) and not finished(tmp_path / "none", 1)
    assert stand_by(tmp_path, 10, env(Store(lifetime=0.3).address), poll_s=0.1) == 0
    assert stand_by(tmp_path, 10, env(_nothing_listens()), poll_s=0.1, orphan_s=0.0) == 0  # done before it looked
    start = time.monotonic()  # a failed world (step 10 of 20) and no restart coming: it gives up after orphan_s
    assert stand_by(tmp_path, 20, env(Store(lifetime=0.3).address), poll_s=0.1, orphan_s=0.5) == 1
    assert time.monotonic() - start >= 0.8  # the world's 0.3 s, then orphan_s without one
    assert "saw no training world at 127.0.0.1" in capsys.readouterr().err
