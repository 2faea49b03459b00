"""Where DeepSpeed's fused FP16_Optimizer (fp16 at ZeRO-0 under DeepSpeed's FusedAdam) keeps each parameter's fp32
master and moments, as :mod:`plugin.engines.deepspeed.state` reads them for checkpoints: the parameter's range of
its group's ``fp32_groups_flat``, in ``fp16_groups`` order. DeepSpeed picks this optimizer only around its FusedAdam
(a CUDA op), so the engine never builds it on a CPU: here the real FP16_Optimizer wraps torch's AdamW (its
``fused_adam_legacy`` off, the path it steps any optimizer by), inside a stand-in for the engine's few attributes.
FP16_UnfusedOptimizer (torch's AdamW, what the engine gets) trains and resumes in tests/dist/test_checkpoint_fp16.py.
"""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")


def _engine():
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()
    decay = [model[0].weight, model[1].weight]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": [model[0].bias, model[1].bias], "weight_decay": 0.0}]
    opt = FP16_Optimizer(torch.optim.AdamW(groups, lr=0.1), dynamic_loss_scale=True, verbose=False)
    ds = SimpleNamespace(optimizer=opt, module=model, zero_optimization_stage=lambda: 0, lr_scheduler=None)
    return SimpleNamespace(ds=ds, tp_layouts={}, groups=SimpleNamespace(tp_rank=0), layout=SimpleNamespace(
        tensor=1, global_batch=4, grad_accum=1), recipe=SimpleNamespace(precision="fp16")), model, opt


def test_each_parameter_is_its_range_of_the_group_flat():
    from plugin.engines.deepspeed import state

    engine, model, opt = _engine()
    masters = state.fp16_masters(engine)
    assert set(masters) == {id(p) for p in model.parameters()}
    # the inner optimizer steps the flats (gradients on them, as FP16_Optimizer.step sets them): masters and moments
    # move away from the fp16 copies, so a wrong range or order cannot match by chance
    for flat in opt.fp32_groups_flat:
        flat.grad = torch.linspace(-1, 1, flat.numel())
    opt.optimizer.step()
    for i, (group, flat) in enumerate(zip(opt.fp16_groups, opt.fp32_groups_flat, strict=True)):
        start = 0
        for p in group:
            want = flat.detach()[start:start + p.numel()].view(p.shape)
            got = state._master_of(engine, masters, p, None)
            assert got.shape == p.shape and got.dtype == torch.float32 and torch.equal(got, want), (i, start)
            m = opt.optimizer.state[flat]["exp_avg"][start:start + p.numel()].view(p.shape)
            assert torch.equal(state._master_of(engine, masters, p, "exp_avg"), m), (i, start)
            start += p.numel()
    # pieces are views: a load writes the master in place
    w = model[1].weight
    (piece,) = state.checkpoint_pieces(engine, "1.weight", w, tuple(w.shape), None)
    piece.view.fill_(0.25)
    assert torch.all(state._master_of(engine, masters, w, None) == 0.25)
    # after a load the fp16 parameters are the masters' copies, as FP16_Optimizer.step leaves them
    state.after_load(engine, {"step": 1})
    for p in model.parameters():
        assert torch.equal(p.detach(), state._master_of(engine, masters, p, None).half())
    assert torch.all(w.detach() == 0.25)


def test_its_scaler_is_the_loss_scale_config():
    from plugin.engines.deepspeed import state

    engine, _, opt = _engine()
    engine.ds.skipped_steps, engine.step_count = 0, 3
    scale = state.loss_scale(engine)
    opt.loss_scale_config.cur_scale, opt.loss_scale_config.cur_iter = 1024.0, 3
    saved = scale.state_dict()
    assert saved["cur_scale"] == 1024.0 and saved["cur_iter"] == 3 and saved["dynamic"] is True, saved
    opt.loss_scale_config.cur_scale = 2.0
    scale.load_state_dict(saved)
    assert opt.loss_scale_config.cur_scale == 1024.0
    assert state.unapplied_loss_scale(engine.ds) == 1024.0  # FP16_Optimizer's backward scale, applied by the engine
