"""Several optimizers stepped as one (plugin/engines/native/optimizers.py, the native ZeRO-1 with an expert axis): the
lr schedule reaches every part, a step hook runs once a step, the parts' states read and clear as one."""
from __future__ import annotations

import torch

from plugin.engines.native.optimizers import Optimizers


def test_schedule_hooks_and_states_reach_every_part():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = Optimizers([torch.optim.SGD([a], lr=1.0, momentum=0.9), torch.optim.SGD([b], lr=1.0, momentum=0.9)])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 ** i)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    for _ in range(2):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        opt.step()
        schedule.step()
        opt.zero_grad()
    assert [g["lr"] for o in opt.parts for g in o.param_groups] == [0.25, 0.25]
    # SGD with momentum 0.9: 1 - 1.0 x 1, then - 0.5 x (0.9 + 1)
    torch.testing.assert_close(a.detach(), torch.full((2,), 1 - 1.0 - 0.5 * 1.9))
    torch.testing.assert_close(b.detach(), torch.full((3,), 1 - 1.0 - 0.5 * 1.9))
    assert len(calls) == 2 and a.grad is None and b.grad is None
    assert set(opt.state) == {a, b} and len(opt.state) == 2 and "momentum_buffer" in opt.state[b]
    opt.state.clear()
    assert not opt.parts[0].state and not opt.parts[1].state
