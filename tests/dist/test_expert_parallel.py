"""The reference GPT with MoE blocks trained with an expert axis on the native back end, against one process.

One launch of 4 gloo processes trains, one layout after another, 3 steps each (fp32, SGD with momentum 0.9, the
clipping threshold below every step's gradient norm, asserted, so the clipping acts and the norm it reports, summed
over the expert group, is compared):

* ``expert 4`` over data 4 (one expert per rank, no expert-data reduction), ``expert 2`` over data 4 (expert-data
  groups of 2), ``expert 2 x tensor 2`` (each expert's columns and rows over the tensor group), ``expert 2`` over data
  2 x context 2 (E carved out of data x context), and ``expert 4`` with a routing forced unbalanced (top-1, every
  token of every rank to expert 0, the other experts get no row: dropless shown), expert 2 x tensor 2 built on meta,
  DeepSeek's sigmoid router with its bias moving, and without an expert axis the experts split over tensor 2 and the
  MoE model under ZeRO-3 (FSDP2);
* each against one process on the whole global batch, its micro-batch ``i`` the union of the data ranks' ``i``-th
  micro-batches (the load-balancing loss is computed over those tokens, :mod:`plugin.expert_parallel.router`): the
  losses, the gradient norms, every gradient of the first step (after clipping) and every parameter after the last
  step that the rank holds whole or as an expert slice (tensor-split dense weights are seen through the norm), rel
  1e-5 (1e-4 through tensor parallelism);
* what the axis does not reach (whole experts at tensor 2, the sigmoid router in pipeline stages, DeepSpeed) refused
  on every rank before any group;
* checkpoints across expert degrees: expert 2 trains 2 steps and saves, expert 1 resumes for step 3 and saves,
  expert 4 resumes for step 4, each step one process's loss and gradient norm.

The model has a dense block and a MoE block (4 experts, top-2, ``every`` 2), global batch 16 at micro 2: the data 4
layouts accumulate 2 micro-batches per step, so the per-micro-batch load-balancing term is exercised.
"""
from __future__ import annotations

import pytest
import torch

from .needs import need
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

STEPS = 3
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9}
CLIP = 0.2
MODEL = {"layers": 2, "hidden": 32, "heads": 4, "ffn_hidden": 64, "vocab": 128, "seq_len": 32, "dropout": 0.0,
         "moe": {"experts": 4, "top_k": 2, "every": 2, "ffn_hidden": 48, "aux_loss_coef": 0.1}}
LAYOUTS = {  # name -> (parallelism, moe overrides, forced expert, rtol)
    "expert4": ({"data": 4, "expert": 4}, {}, None, 1e-5),
    "expert2_edp2": ({"data": 4, "expert": 2}, {}, None, 1e-5),
    "expert2_tensor2": ({"data": 2, "tensor": 2, "expert": 2}, {}, None, 1e-4),
    "expert2_context2": ({"data": 2, "context": 2, "expert": 2}, {}, None, 1e-5),
    "expert4_all_to_expert0": ({"data": 4, "expert": 4}, {"top_k": 1}, 0, 1e-5),
    "expert2_tensor2_meta": ({"data": 2, "tensor": 2, "expert": 2}, {}, None, 1e-4),  # built on meta, cut there
    # sequence parallelism: each MoE layer gathers the tensor group's slices, routes them all, keeps its slice
    "expert2_tensor2_sp": ({"data": 2, "tensor": 2, "expert": 2, "sequence_parallel": True}, {}, None, 1e-4),
    # DeepSeek-V3's router: sigmoid scores, the choice steered by a bias that moves after every step (its final value
    # is compared with the parameters: the loads summed over data x context, as one process counts them)
    "expert2_sigmoid_bias": ({"data": 4, "expert": 2}, {"router": "sigmoid", "bias_update_rate": 0.05}, None, 1e-5),
    # ST-MoE's router z-loss (a coefficient large enough that leaving it out moves the losses)
    "expert2_z_loss": ({"data": 4, "expert": 2}, {"z_loss_coef": 0.5}, None, 1e-5),
    # no expert axis: the experts split over the tensor group only, and sharded with the rest by ZeRO
    "tensor2_split_experts": ({"data": 2, "tensor": 2}, {}, None, 1e-4),
    "zero3_moe": ({"data": 4, "zero_stage": 3}, {}, None, 1e-5),  # FSDP2
    # pipeline stages (1F1B, 4 micro-batches): a MoE block on each stage, whose terms the first stage attaches to its
    # output (the loss is the last stage's), at expert 2 over data 2, and split over tensor 2
    "expert2_pipeline2": ({"data": 2, "pipeline": 2, "expert": 2}, {"every": 1}, None, 1e-5),
    "tensor2_pipeline2_moe": ({"data": 1, "tensor": 2, "pipeline": 2}, {"every": 1}, None, 1e-4),
    # the expert axis under ZeRO: the experts' states (ZeRO-1: ZeroRedundancyOptimizer; edp 1: a plain optimizer) or
    # their gradients and states too (ZeRO-2/3: their own FSDP2 units) over the expert-data group, the rest over data
    "expert2_zero1": ({"data": 4, "expert": 2, "zero_stage": 1}, {}, None, 1e-5),
    "expert4_zero1": ({"data": 4, "expert": 4, "zero_stage": 1}, {}, None, 1e-5),
    "expert2_zero2": ({"data": 4, "expert": 2, "zero_stage": 2}, {}, None, 1e-5),
    "expert2_zero3": ({"data": 4, "expert": 2, "zero_stage": 3}, {}, None, 1e-5),
    "expert2_tensor2_zero3_meta": ({"data": 2, "tensor": 2, "expert": 2, "zero_stage": 3}, {}, None, 1e-4),
}
REFUSED = {  # before any group, on every rank: what the axis does not reach yet
    "expert_tensor_1": ({"data": 2, "tensor": 2, "expert": 2, "expert_tensor": 1}, {}, "$.parallelism.expert_tensor"),
    "pipeline_sigmoid": ({"data": 2, "pipeline": 2, "expert": 2},
                         {"model": {**MODEL, "moe": {**MODEL["moe"], "router": "sigmoid"}}}, "$.model.moe.router"),
    "deepspeed": ({"data": 4, "expert": 2}, {"launcher": "deepspeed"}, "$.parallelism.expert"),
}


def _recipe(parallelism: dict, moe: dict, blocks: dict | None = None):
    from plugin.recipe.spec import Recipe

    parallelism = dict(parallelism)
    zero = parallelism.pop("zero_stage", None)
    if zero is not None:
        blocks = {**(blocks or {}), "zero": {"stage": zero}}
    if parallelism.pop("sequence_parallel", False):
        blocks = {**(blocks or {}), "tensor_parallel": {"sequence_parallel": True}}
    return Recipe.from_dict({
        "name": "moe", "batch": {"global": 16, "micro": 2}, "launcher": "torchrun",
        "parallelism": {"tensor": 1, "pipeline": 1, **parallelism}, "optimizer": SGD, "gradient_clipping": CLIP,
        "model": {**MODEL, "moe": {**MODEL["moe"], **moe}}, **(blocks or {})})


def _model(recipe, forced):
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    for block in model.blocks:
        if hasattr(block, "moe"):
            block.moe.force_expert = forced
    return model


def _micro_steps(x, lay):
    """One process's micro-batch ``i``: the ``i``-th micro-batch of every data rank, together."""
    share = x.shape[0] // lay.data
    return [torch.cat([x[r * share + i * lay.micro_batch:r * share + (i + 1) * lay.micro_batch]
                       for r in range(lay.data)]) for i in range(lay.grad_accum)]


def _reference(recipe, forced, steps=STEPS):
    """Losses, gradient norms, the first step's clipped gradients and the last parameters of one process."""
    from plugin.data.text import TextBatches
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import gpt_loss

    lay = recipe.layout()
    model = _model(recipe, forced)
    opt = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    moes = [b.moe for b in model.blocks if hasattr(b, "moe")]
    coef = recipe.model.moe.aux_loss_coef
    losses, norms, grads = [], [], None
    for step in range(steps):
        x, y = data.global_batch(step, lay.global_batch)
        total = 0.0
        for xs, ys in zip(_micro_steps(x, lay), _micro_steps(y, lay), strict=True):
            loss = gpt_loss(model(xs), ys) + coef * sum(m.aux_loss for m in moes if m.aux_loss is not None) \
                + sum(m.z_loss_coef * m.z_loss for m in moes if m.z_loss is not None)
            (loss / lay.grad_accum).backward()
            total += float(loss.detach()) / lay.grad_accum
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)))
        if grads is None:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        for m in moes:
            m.update_bias()
        losses.append(total)
    return losses, norms, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _piece(name, whole, module, engine):
    """The part of one process's ``whole`` tensor that this rank's ``name`` holds, or None (a tensor-split dense
    weight, seen through the norm)."""
    if ".experts." in name:
        experts = module.get_submodule(name.rsplit(".", 1)[0])
        local = experts.w1.shape[0]
        piece = whole[experts.first:experts.first + local]
        tp, rank = engine.layout.tensor, engine.groups.tp_rank
        if tp > 1:
            cols = whole.shape[2 if name.endswith("w1") else 1] // tp
            piece = piece.narrow(2 if name.endswith("w1") else 1, rank * cols, cols)
        return piece
    p = module.get_parameter(name)
    return whole if p.shape == whole.shape and not getattr(p, "tensor_model_parallel", False) else None


def _layouts(rank, world, path, directory):
    import plugin
    from plugin.data.text import TextBatches

    references = torch.load(path)
    out = {}
    for name, (par, moe, forced, rtol) in LAYOUTS.items():
        recipe = _recipe(par, moe)
        ref_losses, ref_norms, ref_grads, ref_params = references[name]
        meta = name.endswith("_meta")
        engine = plugin.initialize((lambda recipe=recipe, forced=forced: _model(recipe, forced)) if meta
                                   else _model(recipe, forced), recipe, backend="native", seed=0 if meta else None)
        module = engine.whole_model  # names as one process's; a pipeline rank holds its stages' parameters only
        first = {}

        def keep(opt, args, kwargs, engine=engine, first=first):
            if not first:
                first.update({n: p.grad.detach().clone() for n, p in engine.named_local_params().items()
                              if p.grad is not None})

        engine.optimizer.register_step_pre_hook(keep)
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
            norms.append(engine.last_step.grad_norm)
        tol = dict(rtol=rtol, atol=rtol / 10)
        compared, worst = 0, 0.0
        for label, got, ref in (("losses", losses, ref_losses), ("gradient norms", norms, ref_norms)):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                                       **tol, msg=lambda m, label=label, name=name: f"{name} {label}: {m}")
        for label, mine, ref in (("gradient", first, ref_grads),
                                 ("parameter", {n: p.detach() for n, p in engine.named_local_params().items()},
                                  ref_params)):
            held = ref.keys() if engine.layout.pipeline == 1 else mine.keys()
            assert mine.keys() == held and set(held) <= set(ref), (name, label, sorted(set(mine) ^ set(ref)))
            for n, t in mine.items():
                t = t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2's DTensors: gathered, every rank
                piece = _piece(n, ref[n], module, engine)
                if piece is not None:
                    torch.testing.assert_close(t, piece, **tol,
                                               msg=lambda m, n=n, label=label, name=name: f"{name} {label} {n}: {m}")
                    compared += 1
                    worst = max(worst, float((t - piece).abs().max() / piece.abs().max().clamp(min=1e-12)))
        experts = [m for m in engine.container.modules() if type(m).__name__ == "Experts"]
        pairs = zip(losses + norms, ref_losses + ref_norms, strict=True)
        worst = max([worst] + [abs(a - b) / abs(b) for a, b in pairs])
        out[name] = {"losses": losses, "norms": norms, "compared": compared, "worst": worst,
                     "experts": [(m.first, m.w1.shape[0]) for m in experts],
                     "ranks": (engine.groups.expert_ranks, engine.groups.expert_data_ranks)}
    from plugin.engines import initialize as init_module
    from plugin.errors import RecipeError

    init_module.let_rank_0_speak = lambda: None  # every rank refuses alike here: no 15 s wait for rank 0's message
    for name, (par, blocks, path) in REFUSED.items():
        recipe = _recipe(par, {}, blocks)
        backend = "deepspeed" if name == "deepspeed" else "native"
        with pytest.raises(RecipeError) as refused:
            plugin.initialize(_model(recipe, None), recipe, backend=backend)
        out[name] = [p.path for p in refused.value.problems]
        assert path in out[name], (name, out[name])
    out["checkpoints"] = _checkpoints(references["chain"], directory)
    return out


CHAIN = ((2, 3, (0, 1), None, "e2"), (1, 0, (2,), "e2", "e1"), (2, 1, (3,), "e1", "e2z1"), (4, 2, (4,), "e2z1", None))


# transformers families: their own router, shared experts and dense layers whole on every rank, their experts module
# cut to each rank's experts behind the dispatch (plugin/expert_parallel/hf.py); 4 experts, top-2 (tests/hf_families)
HF_LAYOUTS = {  # family -> (parallelism, ZeRO stage)
    "mixtral": ({"data": 4, "expert": 2}, 0),
    "qwen2_moe": ({"data": 4, "expert": 4}, 1),  # a shared expert and its gate, whole on every rank
    "deepseek_v3": ({"data": 4, "expert": 2}, 3),  # sigmoid routing over groups with its correction bias; FSDP2
    "olmoe": ({"data": 4, "expert": 2}, 2),  # FSDP2 at ZeRO-2 (context parallelism runs other families)
    # zero-computation (identity) experts: their choices sent to real experts with weight 0, their output added
    # by the block
    "longcat_flash": ({"data": 4, "expert": 4}, 0),
}
HF_ROWS, HF_SEQ, HF_LR, HF_CLIP = 8, 16, 2.0, 0.02


def _hf_batch(vocab):
    return torch.randint(0, vocab, (HF_ROWS, HF_SEQ), generator=torch.Generator().manual_seed(1000))


def _hf_reference(family):
    """Losses, norms and the last weights of the family's tiny model on one process, the whole batch at once (no
    load-balancing loss: output_router_logits is off in these configs, so the micro-batches do not matter)."""
    from tests.hf_families import tiny_model

    model = tiny_model(family, seed=0)
    assert not model.config.output_router_logits
    opt = torch.optim.SGD(model.parameters(), lr=HF_LR, momentum=0.9)
    ids = _hf_batch(model.config.vocab_size)
    losses, norms = [], []
    for _ in range(STEPS):
        logits = model(input_ids=ids, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), HF_CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert min(norms) > 2 * HF_CLIP, f"{family}: gradient norms {norms}: the clipping must act"
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_families(rank, world, path):
    import transformers as tf

    import plugin
    from plugin.checkpoint.adapt import param_boxes
    from plugin.recipe.spec import Recipe
    from tests.hf_families import tiny_model

    tf.logging.set_verbosity_error()
    references = torch.load(path)
    out = {}
    for family, (par, stage) in HF_LAYOUTS.items():
        ref_losses, ref_norms, ref_params = references[family]
        model = tiny_model(family, seed=0)
        recipe = Recipe.from_dict({"name": f"ep_{family}", "launcher": "torchrun", "zero": {"stage": stage},
                                   "parallelism": {"tensor": 1, "pipeline": 1, **par},
                                   "batch": {"global": HF_ROWS, "micro": 1},
                                   "optimizer": {"name": "sgd", "lr": HF_LR, "momentum": 0.9},
                                   "gradient_clipping": HF_CLIP})
        engine = plugin.initialize(model, recipe, backend="native")
        ids = _hf_batch(model.config.vocab_size)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(engine.train_step({"input_ids": ids, "labels": ids}))
            norms.append(engine.last_step.grad_norm)
        torch.testing.assert_close(torch.tensor(losses + norms, dtype=torch.float64),
                                   torch.tensor(ref_losses + ref_norms, dtype=torch.float64), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, family=family: f"{family} losses and norms: {m}")
        compared, experts = 0, 0
        boxes = param_boxes(engine.container)
        for n, p in engine.container.named_parameters():
            t = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
            ref = ref_params[n]
            box = boxes.get(n)
            if box is not None:  # this rank's experts: their rows of the stacked tensor
                ref, experts = ref[box[0]:box[0] + t.shape[0]], experts + 1
            torch.testing.assert_close(t, ref, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, f=family: f"{f} {n}: {m}")
            compared += 1
        out[family] = {"losses": losses, "norms": norms, "compared": compared, "expert_tensors": experts}
    return out


def _checkpoints(reference, directory):
    """Expert 2 at ZeRO-3 trains 2 steps and saves (FSDP2 shards of the experts); expert 1 at ZeRO-0 loads it and
    trains step 3, saves; expert 2 at ZeRO-1 (the experts' states partitioned over the expert-data group) loads that,
    trains step 4, saves; expert 4 at ZeRO-2 loads it and trains step 5: each step's loss and norm one process's
    (the experts' momentum buffers travel with them). The FSDP2 ones are built on meta, as train.py builds them."""
    import plugin
    from plugin.data.text import TextBatches

    got = []
    for expert, stage, steps, load, save in CHAIN:
        recipe = _recipe({"data": 4, "expert": expert, "zero_stage": stage}, {})
        engine = plugin.initialize((lambda recipe=recipe: _model(recipe, None)) if stage >= 2 else _model(recipe, None),
                                   recipe, backend="native", seed=0 if stage >= 2 else None)
        if load:
            engine.load(f"{directory}/{load}")
        data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
        for step in steps:
            got.append((engine.train_step(data.global_batch(step, engine.layout.global_batch)),
                        engine.last_step.grad_norm))
        if save:
            engine.save(f"{directory}/{save}")
    ref_losses, ref_norms = reference[0], reference[1]
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(list(zip(ref_losses, ref_norms, strict=True)), dtype=torch.float64),
                               rtol=1e-5, atol=1e-6, msg=lambda m: f"expert 2 -> 1 -> 2 -> 4 checkpoints: {m}")
    return got


def test_expert_layouts_train_one_process_losses_gradients_and_weights(tmp_path):
    references = {name: _reference(_recipe(par, moe), forced) for name, (par, moe, forced, _) in LAYOUTS.items()}
    for name, (_, norms, _, _) in references.items():
        assert min(norms) > CLIP, f"{name}: the clipping must act: gradient norms {norms} against {CLIP}"
    references["chain"] = _reference(_recipe({"data": 4, "expert": 2}, {}), None, steps=5)
    torch.save(references, tmp_path / "references.pt")  # a file: tensors passed as arguments would travel as fds
    results = run(_layouts, 4, str(tmp_path / "references.pt"), str(tmp_path), timeout_s=120)
    for name in LAYOUTS:
        print(f"{name}: losses {results[0][name]['losses']} (reference {references[name][0]}), norms "
              f"{results[0][name]['norms']} (reference {references[name][1]}); groups by rank "
              f"{[r[name]['ranks'] for r in results]}; worst relative difference "
              f"{max(r[name]['worst'] for r in results):.1e} over {sum(r[name]['compared'] for r in results)} tensors")
        assert all(r[name]["compared"] > 10 for r in results)
    assert results[0]["expert4"]["experts"] == [(0, 1)] and results[3]["expert4"]["experts"] == [(3, 1)]
    assert results[1]["expert2_edp2"]["ranks"] == ((0, 1), (1, 3))
    moved = references["expert2_sigmoid_bias"][3]["blocks.1.moe.score_bias"]
    assert moved.abs().min() > 0, f"the sigmoid router's bias must have moved: {moved}"
    print(f"expert 2 (ZeRO-3) -> 1 (ZeRO-0) -> 2 (ZeRO-1) -> 4 (ZeRO-2) through checkpoints: (loss, norm) per step "
          f"{results[0]['checkpoints']} (reference "
          f"{list(zip(references['chain'][0], references['chain'][1], strict=True))})")


@pytest.mark.slow  # .ci/run's slow step: the README suite's budget
def test_transformers_moe_families_at_an_expert_axis_train_one_process_losses_and_weights(tmp_path):
    need("transformers")
    references = {family: _hf_reference(family) for family in HF_LAYOUTS}
    torch.save(references, tmp_path / "hf_references.pt")
    results = run(_hf_families, 4, str(tmp_path / "hf_references.pt"), timeout_s=120)
    for family, (par, stage) in HF_LAYOUTS.items():
        got = results[0][family]
        print(f"{family} at {par}, ZeRO-{stage}: losses {got['losses']} (reference {references[family][0]}), "
              f"norms {got['norms']}; {sum(r[family]['compared'] for r in results)} tensors compared")
        assert all(r[family]["expert_tensors"] >= 2 for r in results), family  # each rank held experts
