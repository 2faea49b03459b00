"""Who holds the job, judged from made-up ledgers (plugin.watchdog.verdict, pure): a stopped rank, a rank asleep in
the user's loop, a pipeline chain, a rank that never started, a killed rank; a silent store, a rendezvous some rank
never reached; and the words of the line and the report."""
from plugin.distributed.topology import Topology
from plugin.watchdog.ledger import Ledger, coord_words, doing, group_kind
from plugin.watchdog.verdict import judge, layout_disagreement, rendezvous_line, store_silent_line

TP2_DP2 = Topology(pp_size=1, dp_size=2, tp_size=2)
GROUPS = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3]}
NOW = 1000.0


def _entry(rank, step=3, phase="backward", detail="micro-batch 2", seqs=None, pending=(), t=NOW, peer=None,
           in_phase_s=20.0):
    return {"rank": rank, "host": "a" if rank < 2 else "b", "pid": 100 + rank, "step": step, "phase": phase,
            "detail": detail, "peer": peer, "in_phase_s": in_phase_s, "t": t, "seqs": seqs or {},
            "pending": list(pending)}


def _op(group, seq, op="all_reduce", age_s=20.0, p2p=False):
    return {"group": group, "seq": seq, "op": op, "p2p": p2p, "age_s": age_s, "done": False}


def test_a_stopped_rank_is_named_with_its_coordinates_and_the_chain_behind_it():
    ledgers = {0: _entry(0, seqs={"0": 10, "1": 164, "3": 19}, pending=[_op("3", 19)]),
               1: _entry(1, seqs={"0": 10, "1": 164, "4": 19}, pending=[_op("4", 19)]),
               2: _entry(2, seqs={"0": 10, "2": 126, "3": 18}, pending=[_op("2", 126, age_s=19.0)]),
               3: _entry(3, step=2, seqs={"0": 8, "2": 125, "4": 18}, t=NOW - 23)}
    v = judge(TP2_DP2, ledgers, {0, 1, 2}, GROUPS, now=NOW, timeout_s=20, cause="rank 2 heard no heartbeat",
              states={3: "stopped"}, run_dir="/j/watchdog/run")
    assert v.named_ranks == [3] and v.named[0].why == "stopped"
    line = v.line(1)
    assert line.startswith("watchdog: rank 1 stops, the job is held by rank 3: data 1, tensor 1, pipeline 0 (stopped")
    assert "no heartbeat for 23 s" in line
    report = v.report()
    assert "rank 3: data 1, tensor 1, pipeline 0 on b (pid 103): stopped" in report
    assert "at its last heartbeat: step 3, backward of micro-batch 2" in report
    # rank 0 waits for rank 2 on the data group, which itself waits for rank 3 on the tensor group
    assert "rank 0: data 0, tensor 0, pipeline 0 waits in all_reduce #19 on the data group [0, 2] for 20 s: for " \
           "rank 2 (waiting itself)" in report
    assert "rank 2: data 1, tensor 0, pipeline 0 waits in all_reduce #126 on the tensor group [2, 3] for 19 s: " \
           "for rank 3" in report
    assert "hosts: a: ranks 0-1; b: ranks 2-3" in report and "/j/watchdog/run" in report
    assert report.startswith("watchdog: the job stopped after 20 s without progress: rank 2 heard no heartbeat")
    # a stopped process on the reporter's host is ended after the report: the launcher would wait for it
    assert "      ended with SIGKILL after this report" in report


def test_a_killed_rank_is_named_dead_and_the_job_stops_at_once():
    ledgers = {0: _entry(0, t=NOW - 1), 1: _entry(1, seqs={"0": 21})}
    v = judge(Topology(dp_size=2), ledgers, {1}, {"0": [0, 1]}, now=NOW, timeout_s=10,
              cause="rank 1: Connection closed by peer [127.0.0.1]:5", states={0: "gone"})
    assert [(n.rank, n.why) for n in v.named] == [(0, "gone")]
    assert "held by rank 0: data 0, tensor 0, pipeline 0 (dead (its process has exited): no heartbeat for 1 s)" \
        in v.line(1)
    assert v.report().startswith("watchdog: the job stopped at once, a peer lost: rank 1: Connection closed by peer")
    assert "SIGKILL" not in v.report()  # only a stopped process is ended by the guard


def test_a_silent_store_names_rank_0_and_a_failed_rendezvous_the_missing_ranks():
    line = store_silent_line(3, TP2_DP2, 0, {"host": "a", "pid": 9}, None, "a:7", 20.4, agent=True)
    assert line.startswith("watchdog: rank 3 stops, the job is held by rank 0: data 0, tensor 0, pipeline 0 on a "
                           "(pid 9) (its host stopped, or out of reach; the watchdog's store at a:7, served by "
                           "torchrun's agent on its host, has not answered for 20 s")
    assert "(its process runs; the watchdog's store at a:7, served by a process rank 0 forked" in store_silent_line(
        3, TP2_DP2, 0, {"host": "a", "pid": 9}, "running", "a:7", 20.4, agent=False)
    assert "rank 0: data 0, tensor 0, pipeline 0; rank 3: data 1, tensor 1, pipeline 0 never reached it (ranks 1-2 " \
           "did) -> start them" in rendezvous_line(1, TP2_DP2, {1, 2}, "a:7", 20)
    assert rendezvous_line(2, TP2_DP2, None, "b:7", 21, "[Errno -2] Name or service not known").startswith(
        "watchdog: rank 2 stops, it could not reach the rendezvous at b:7 (its MASTER_ADDR:MASTER_PORT) in 21 s "
        "([Errno -2] Name or service not known) -> give every rank rank 0's address and port")


def test_a_live_rank_in_its_own_code_is_named_and_a_waiting_one_is_not():
    ledgers = {0: _entry(0, phase="user", detail="", step=4, seqs={"0": 12, "3": 30}, in_phase_s=21.0),
               1: _entry(1, seqs={"0": 12, "4": 31}, pending=[_op("4", 31)]),
               2: _entry(2, seqs={"0": 12, "3": 31}, pending=[_op("3", 31)]),
               3: _entry(3, seqs={"0": 12, "4": 31}, pending=[_op("4", 31)])}
    v = judge(TP2_DP2, ledgers, {0, 1, 2, 3}, GROUPS, now=NOW, timeout_s=20, cause="a collective timed out")
    assert v.named_ranks == [0] and v.named[0].why == "behind"
    assert "in the training loop after step 4 (not inside the engine) for 21 s" in v.line(2)
    assert "rank 2: data 1, tensor 0, pipeline 0 waits in all_reduce #31 on the data group [0, 2] for 20 s: " \
           "for rank 0" in v.report()
    # ranks 1 and 3 wait on a group whose members have all entered it: a waiter, never a culprit
    assert "rank 1: data 0, tensor 1, pipeline 0 waits in all_reduce #31 on the data group [1, 3] for 20 s: every " \
           "member has entered it" in v.report()


def test_pipeline_waits_come_from_the_ledger_where_the_flight_recorder_has_no_p2p_ops():
    topo = Topology(pp_size=2, dp_size=1, tp_size=2)  # stage 0: ranks 0, 1; stage 1: ranks 2, 3
    groups = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3]}
    ledgers = {0: _entry(0, phase="forward", detail="micro-batch 1", seqs={"1": 151}, pending=[_op("1", 151)]),
               1: _entry(1, step=1, phase="optimizer", detail="", seqs={"1": 42}, t=NOW - 23),
               2: _entry(2, phase="recv", detail="activations of micro-batch 1 from stage 0", peer=0),
               3: _entry(3, phase="recv", detail="activations of micro-batch 1 from stage 0", peer=1)}
    v = judge(topo, ledgers, {0, 2, 3}, groups, now=NOW, timeout_s=20, cause="timed out", states={1: "stopped"})
    assert v.named_ranks == [1]
    report = v.report()
    assert "rank 2: data 0, tensor 0, pipeline 1 waits in pipeline recv of activations of micro-batch 1 from stage 0 " \
           "(rank 0) for 20 s: for rank 0 (waiting itself)" in report
    assert "rank 0: data 0, tensor 0, pipeline 0 waits in all_reduce #151 on the tensor group [0, 1] for 20 s: for " \
           "rank 1" in report


def test_a_rank_without_any_ledger_never_started_and_none_named_says_so():
    ledgers = {0: _entry(0), 1: _entry(1), 2: _entry(2)}
    v = judge(TP2_DP2, ledgers, {0, 1, 2}, GROUPS, now=NOW, timeout_s=20, cause="pre-flight")
    assert [(n.rank, n.why) for n in v.named] == [(3, "never started")]
    quiet = judge(TP2_DP2, {r: _entry(r) for r in range(4)}, {0, 1, 2, 3}, GROUPS, now=NOW, timeout_s=20,
                  cause="a store failure", run_dir="/j")
    assert quiet.named == [] and "no rank could be named" in quiet.line(0) and "/j" in quiet.line(0)


def test_ledger_words_coordinates_and_group_kinds():
    ledger = Ledger(3, host="h", pid=7)
    ledger.step = 4
    ledger.enter("recv", "gradients of micro-batch 2 from stage 2", peer=9)
    entry = ledger.record(now=ledger.since + 1.5)
    assert (entry["peer"], entry["in_phase_s"], entry["host"]) == (9, 1.5, "h")
    assert doing(entry) == "step 5, pipeline recv of gradients of micro-batch 2 from stage 2"
    assert doing({"step": 2, "phase": "checkpoint"}) == "a checkpoint after step 2"
    topo = Topology(pp_size=2, dp_size=2, tp_size=2)
    assert coord_words(topo, 7) == "data 1, tensor 1, pipeline 1"
    assert group_kind(topo, [0, 1, 4, 5]) == "model" and group_kind(topo, [0, 4]) == "pipeline"


def test_ranks_launched_with_other_layouts_are_listed_by_layout_and_host():
    text = layout_disagreement([(1, 2, 2, 5)] * 3 + [(1, 4, 1, 5)], {0: "a", 1: "a", 2: "a", 3: "b"})
    assert "ranks 0-2 on a: data 2 x tensor 2 x pipeline 1" in text and "rank 3 on b: data 4 x tensor 1" in text
