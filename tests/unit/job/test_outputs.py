"""--metrics into a directory that does not exist (plugin.job.outputs): its writer makes it before any process group,
a path that cannot be a file is refused with what to change."""
from plugin.job.outputs import metrics_problem


def test_the_writing_rank_makes_the_directory_and_a_path_that_cannot_be_a_file_is_refused(tmp_path):
    assert metrics_problem(str(tmp_path / "runs" / "a" / "m.jsonl"), {}) is None  # one process: rank 0
    assert (tmp_path / "runs" / "a").is_dir()
    assert metrics_problem(str(tmp_path / "b" / "m.jsonl"), {"RANK": "1"}) is None  # rank 0 writes it, not rank 1
    assert not (tmp_path / "b").exists()
    assert metrics_problem(str(tmp_path / "r{rank}" / "m.jsonl"), {"RANK": "1"}) is None  # every rank its own
    assert (tmp_path / "r1").is_dir() and not (tmp_path / "r0").exists()
    assert metrics_problem(str(tmp_path / "runs"), {}) == (
        f"--metrics {tmp_path / 'runs'}: {tmp_path / 'runs'} is a directory -> give a file in it, e.g. "
        f"{tmp_path / 'runs' / 'metrics.jsonl'}")
    (tmp_path / "file").write_text("")
    assert metrics_problem(str(tmp_path / "file" / "m.jsonl"), {}).startswith(
        f"--metrics {tmp_path / 'file' / 'm.jsonl'}: cannot make its directory {tmp_path / 'file'} (")
