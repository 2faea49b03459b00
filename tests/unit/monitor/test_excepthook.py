"""A PluginError that ends a user's script is said as its message, once per rank, without a traceback
(plugin.monitor.excepthook, installed by plugin.initialize); every other exception keeps its traceback."""
import os
import subprocess
import sys
import textwrap

import pytest

from plugin.errors import PluginError, RecipeError
from plugin.monitor import excepthook

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# the user's own loop: a recipe of one process, its engine, then a batch of 3 rows where the global batch is 8
USER_LOOP = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    import plugin

    torch.manual_seed(0)
    engine = plugin.initialize(torch.nn.Linear(4, 3), sys.argv[1], loss_fn=F.cross_entropy, backend="native")
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    print("loss", engine.train_step((x, y)), flush=True)
    engine.train_step((x[:3], y[:3]))
""")
RECIPE = '{"name": "one", "parallelism": {"data": 1, "tensor": 1, "pipeline": 1}, "batch": {"global": 8, "micro": 8}}'


def test_the_row_count_check_in_a_users_loop_is_its_message_without_a_traceback(tmp_path):
    (tmp_path / "one.json").write_text(RECIPE)
    (tmp_path / "loop.py").write_text(USER_LOOP)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", excepthook.SHOW_TRACEBACK)}
    out = subprocess.run([sys.executable, "loop.py", "one.json"], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert out.returncode == 1 and "loss" in out.stdout, (out.returncode, out.stderr)
    said = [line for line in out.stderr.splitlines() if "every rank got 3 rows" in line]
    assert len(said) == 1 and said[0].startswith("BatchMismatchError: train_step: every rank got 3 rows") and \
        said[0].endswith("(PLUGIN_TRACEBACK=1 shows the traceback)"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr


@pytest.fixture
def previous(monkeypatch):
    """The hook found before install (Python's own, here one that records what it is given); restored after."""
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, value, tb: seen.append(value))
    monkeypatch.delenv(excepthook.SHOW_TRACEBACK, raising=False)
    excepthook.install()
    excepthook.install()  # a second initialize in the same process: still one hook
    return seen


def test_a_plugin_error_is_said_and_everything_else_chained(previous, capsys):
    sys.excepthook(RecipeError, RecipeError([]), None)
    assert capsys.readouterr().err.startswith("RecipeError: 0 problems in the recipe:") and previous == []
    for error in (ValueError("the user's own bug"), KeyboardInterrupt()):
        sys.excepthook(type(error), error, None)
        assert previous[-1] is error and capsys.readouterr().err == ""


def test_plugin_traceback_1_shows_it(previous, monkeypatch, capsys):
    monkeypatch.setenv(excepthook.SHOW_TRACEBACK, "1")
    error = PluginError("refused")
    sys.excepthook(PluginError, error, None)
    assert previous == [error] and capsys.readouterr().err == ""


def test_each_rank_says_which_it_is():
    error = PluginError("refused -> fix")
    assert excepthook.said(error, {"RANK": "3", "WORLD_SIZE": "8"}) == \
        "rank 3: PluginError: refused -> fix (PLUGIN_TRACEBACK=1 shows the traceback)"
    assert excepthook.said(error, {"RANK": "0", "WORLD_SIZE": "1"}).startswith("PluginError: refused")
