"""The tensor-parallel GPT under DeepSpeed, against the unsharded model on the whole batch.

1. ParallelGroups as the mpu: tp2 x dp2 under ``deepspeed.initialize(..., mpu=groups)`` at ZeRO 0, 1 and
   2, with gradient clipping active (the norm must count sharded parameters on every tensor rank and
   replicated ones once).
2. DeepSpeed's own pipeline: pp2 x tp2 from ``GPT.to_layers()`` in a PipelineModule, sharded afterwards
   with the tensor group of the PipelineModule's grid (``ParallelGroups.from_deepspeed_grid``), with and
   without sequence parallelism. Under sequence parallelism DeepSpeed's activation partitioning between
   stages (``pipe_partitioned``/``grad_partitioned``, on by default) must be off: it assumes activations
   replicated across tensor ranks, and silently mixes sequence slices otherwise.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from .needs import need
from .spawn import run

need("deepspeed")
pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]

CLIP = 0.05  # small enough that every step clips


def train(groups, stage, steps=3):
    import deepspeed

    from plugin.models import GPT, GPTConfig, gpt_loss
    from plugin.tensor_parallel import apply_tensor_parallel, full_state_dict

    config = GPTConfig(vocab=37, hidden=16, layers=1, heads=4, seq_len=8, tie_embeddings=True)
    torch.manual_seed(0)
    ref = GPT(config)
    torch.manual_seed(0)
    model = apply_tensor_parallel(GPT(config), "auto", groups.tensor_group)
    engine, *_ = deepspeed.initialize(
        model=model, mpu=groups, optimizer=torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        config={"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                "gradient_clipping": CLIP, "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, config.vocab, (4, config.seq_len), generator=data)
        targets = torch.randint(0, config.vocab, (4, config.seq_len), generator=data)
        mine = slice(2 * groups.dp_rank, 2 * groups.dp_rank + 2)
        loss = gpt_loss(engine(tokens[mine]), targets[mine], groups.tensor_group)
        engine.backward(loss)
        engine.step()
        loss_ref = gpt_loss(ref(tokens), targets)
        loss_ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        assert norm > CLIP, f"the reference norm {norm} should need clipping"
        opt_ref.step()
        opt_ref.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=groups.data_group)
        torch.testing.assert_close(mean / groups.dp_size, loss_ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"ZeRO {stage} step {step} loss: {m}")
    weights = full_state_dict(engine.module, groups.tensor_group)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(weights[name], p.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"ZeRO {stage} weight {name} after {steps} steps: {m}")
    engine.destroy()


def pipeline(sequence_parallel, steps=2):
    import functools

    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from plugin.distributed.groups import ParallelGroups
    from plugin.models import GPT, GPTConfig, gpt_loss
    from plugin.tensor_parallel import apply_tensor_parallel

    config = GPTConfig(vocab=37, hidden=16, layers=2, heads=4, seq_len=8)
    torch.manual_seed(0)
    ref = GPT(config)
    torch.manual_seed(0)
    gpt = GPT(config)
    pipe = PipelineModule(layers=gpt.to_layers(), partition_method="uniform",
                          topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))
    groups = ParallelGroups.from_deepspeed_grid(pipe._grid)
    apply_tensor_parallel(gpt, "auto", groups.tensor_group, sequence_parallel=sequence_parallel)
    pipe.loss_fn = functools.partial(gpt_loss, tp_group=groups.tensor_group)
    engine, *_ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.5),
        config={"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                "steps_per_print": 10**9, "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}})
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, config.vocab, (4, config.seq_len), generator=data)
        targets = torch.randint(0, config.vocab, (4, config.seq_len), generator=data)
        loss = engine.train_batch(iter([(tokens[:2], targets[:2]), (tokens[2:], targets[2:])]))
        loss_ref = gpt_loss(ref(tokens), targets)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, step=step: f"pipeline sp={sequence_parallel} step {step} loss: {m}")
    engine.destroy()


def deepspeed_worker(rank, world_size):
    import deepspeed

    from plugin.distributed.groups import build_groups
    from plugin.distributed.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")
    groups = build_groups(Topology(dp_size=2, tp_size=2))
    for stage in (0, 1, 2):
        train(groups, stage)
    for sequence_parallel in (False, True):
        pipeline(sequence_parallel)
    return "ok"


def test_deepspeed_mpu_at_tp2_dp2_and_deepspeed_pipeline_at_pp2_tp2():
    assert run(deepspeed_worker, 4) == ["ok"] * 4
