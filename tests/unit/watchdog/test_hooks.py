"""The phase marks (plugin.watchdog.hooks) on a real module and optimizer, in one process: what a step leaves in the
ledger, in order, and that detach leaves the engine as it was."""
import torch
from torch import nn

from plugin.watchdog.hooks import EngineHooks
from plugin.watchdog.ledger import Ledger


class Recording(Ledger):
    def __init__(self):
        super().__init__(0, host="h", pid=1)
        self.seen = []

    def enter(self, phase, detail="", peer=None):
        super().enter(phase, detail, peer)
        self.seen.append((self.step, phase, detail))


class TwoMicroBatches:
    """The part of an Engine the hooks use: a module run once per micro-batch, the optimizer, the public calls."""

    def __init__(self):
        self.module = nn.Linear(4, 2)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.step_count = 0

    def micro_batch_modules(self):
        return [self.module]

    def schedule_optimizer(self):
        return self.optimizer

    def train_step(self, batch):
        for mb in batch.chunk(2):
            self.module(mb).pow(2).sum().backward()
        self.optimizer.step()
        self.step_count += 1
        return 0.0

    def eval_step(self, batch):
        with torch.no_grad():
            return float(self.module(batch).sum())

    def save(self, path):
        return path

    def load(self, path):
        raise RuntimeError("Timed out waiting 20000ms for recv operation to complete")


def test_a_step_marks_each_micro_batch_the_optimizer_and_the_loop():
    engine, ledger = TwoMicroBatches(), Recording()
    hooks = EngineHooks(engine, ledger)
    hooks.attach()
    assert not ledger.stepped.is_set()
    engine.train_step(torch.ones(4, 4))
    assert ledger.stepped.is_set()  # the heartbeat thread publishes the new step at once
    assert ledger.seen == [(0, "step", ""), (0, "forward", "micro-batch 1"), (0, "backward", "micro-batch 1"),
                           (0, "forward", "micro-batch 2"), (0, "backward", "micro-batch 2"), (0, "optimizer", ""),
                           (1, "user", "")]
    ledger.seen.clear()
    ledger.stepped.clear()
    engine.eval_step(torch.ones(2, 4))  # no grad: no micro-batch marks
    engine.save("x")
    assert ledger.seen == [(1, "eval", ""), (1, "user", ""), (1, "checkpoint", ""), (1, "user", "")]
    assert not ledger.stepped.is_set()
    ledger.seen.clear()
    try:
        engine.load("x")
    except RuntimeError:
        pass
    assert ledger.seen == [(1, "checkpoint", "")]  # an exception leaves the phase it came from for the report
    hooks.detach()
    assert "train_step" not in vars(engine) and not engine.module._forward_pre_hooks
    engine.train_step(torch.ones(4, 4))
    assert ledger.seen == [(1, "checkpoint", "")]
