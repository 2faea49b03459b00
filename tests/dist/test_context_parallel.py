"""The reference GPT and transformers models trained with a context axis, on both back ends, against one process.

Four launches, 3 steps per layout, fp32, against one process trained on the whole global batch (rel 1e-5 for
the reference GPT):

* 2 gloo processes, ``context = 2`` (the whole world one context group), by ring and by all-to-all: every step's
  loss and gradient norm (before clipping) and every parameter after the last step; then the checkpoints are
  layout-free: the context-2 checkpoint resumes at data 2 (step 4) and that one at context 2 (step 5), both steps
  the reference's.
* 4 processes, native back end, one layout after another: ``context = 4`` alone (ring; loss, norm, parameters),
  ``context 2 x tensor 2`` with sequence parallelism and full activation checkpointing (ring; the recompute replays
  the blocks), ``context 2 x data 2`` with ZeRO-3 (FSDP2 over data x context, all-to-all) and ``context 2 x pipeline
  2`` (1F1B, ring): loss and gradient norm per step (the norm is the whole model's, reduced over the shards, so a
  gradient summed over the wrong group or a loss share not divided shows in it).
* 4 processes, DeepSpeed back end: the same layouts by the other method, and more (``DEEPSPEED``), dropout under
  the ring's recompute, and a checkpoint across three layouts.
* 2 processes, transformers Llama (2 kv heads, rotary; both methods), Qwen2, Mistral and GPT-2 (learned positions)
  at ``context = 2``, through transformers' attention interface, on Hugging Face dict batches padded right and left
  (the key mask travels whole, the chunks get their global ``position_ids``): losses, gradient norms and weights
  against ``model(**batch).loss`` on one process, rel 1e-4 (the tolerance of the other transformers layout tests).

The optimizer is SGD with momentum 0.9 and the clipping threshold sits below the gradient norm on every step
(asserted), so the clipping acts and the norm it reports is compared: a gradient wrong by a uniform factor (a loss
share not divided by the context degree) leaves the clipped update as it was, so the losses and weights alone would
not see it, but the norm does; a gradient wrong in direction (positions of the wrong chunk, a missed K/V block) moves
losses, norms and weights. AdamW would divide both kinds away.
"""
from __future__ import annotations

import pytest
import torch

from .needs import need
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.native]

STEPS, TOL = 3, dict(rtol=1e-5, atol=1e-6)
SGD = {"name": "sgd", "lr": 0.3, "momentum": 0.9}
CLIP = 0.5  # below every step's gradient norm (asserted): the clipping acts
PP = {"schedule": "1f1b", "partition": "uniform"}
WIDE = {  # name -> (parallelism, method, other blocks, whether the module holds whole parameters)
    "cp4": ({"context": 4}, "ring", {}, True),
    "cp2_tp2_sp_full": ({"context": 2, "tensor": 2}, "ring", {"tensor_parallel": {"sequence_parallel": True},
                                                              "activation_checkpointing": {"mode": "full"}}, False),
    "cp2_dp2_zero3": ({"context": 2, "data": 2}, "all_to_all", {"zero": {"stage": 3}}, False),
    "cp2_pp2": ({"context": 2, "pipeline": 2}, "ring", {"pipeline_parallel": PP}, False),
}


def _recipe(parallelism: dict, method: str = "ring", blocks: dict | None = None, launcher: str = "torchrun"):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_single").to_dict()
    data.update(parallelism={"data": 1, "tensor": 1, "pipeline": 1, **parallelism},
                context_parallel={"method": method}, optimizer=SGD, gradient_clipping=CLIP, launcher=launcher,
                cluster={"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4}, **(blocks or {}))
    return Recipe.from_dict(data)


def _reference(recipe, steps: int = STEPS):
    """Losses, gradient norms (before clipping) and final parameters of one process on the whole global batch, cut
    into the layout's micro-batches."""
    from plugin.data.text import TextBatches
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import GPT, GPTConfig, gpt_loss

    lay = recipe.layout()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    opt = build_optimizer(model.parameters(), recipe.optimizer, WeightDecay.of(model))
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(steps):
        x, y = data.global_batch(step, lay.global_batch)
        parts = list(zip(x.chunk(lay.grad_accum * lay.data), y.chunk(lay.grad_accum * lay.data), strict=True))
        total = 0.0
        for xs, ys in parts:
            loss = gpt_loss(model(xs), ys)
            (loss / len(parts)).backward()
            total += float(loss.detach()) / len(parts)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(recipe, whole: bool, steps: int = STEPS, backend: str = "native", meta: bool = False):
    """(losses and gradient norms of the engine's first ``steps`` steps, and its parameters when ``whole``: the module
    holds them all), and the engine; ``meta``: the model built on the meta device, each rank materialising its part."""
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig.from_recipe_model(recipe.model)
    engine = plugin.initialize((lambda: GPT(config)) if meta else GPT(config), recipe, backend=backend)
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(steps):
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
        norms.append(engine.last_step.grad_norm)
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()} if whole else None
    return (losses, norms, params), engine


def _context_2(rank, world, directory):
    """Both methods at context 2, then the checkpoints across layouts: the ring run's (3 steps) resumed at data 2 x
    context 1 for step 4, whose checkpoint the all-to-all engine (context 2) loads for step 5."""
    from plugin.data.text import TextBatches

    out, engines = {}, {}
    for method in ("ring", "all_to_all"):
        out[method], engines[method] = _train(_recipe({"context": world}, method), whole=True)
    engines["ring"].save(f"{directory}/cp2")
    _, resumed = _train(_recipe({"data": world}), whole=False, steps=0)
    resumed.load(f"{directory}/cp2")
    data, after = TextBatches(resumed.recipe.model.vocab, resumed.recipe.model.seq_len), []
    for step, engine in ((STEPS, resumed), (STEPS + 1, engines["all_to_all"])):
        if engine is engines["all_to_all"]:
            resumed.save(f"{directory}/dp2")
            engine.load(f"{directory}/dp2")
        loss = engine.train_step(data.global_batch(step, engine.layout.global_batch))
        after.append((loss, engine.last_step.grad_norm))
    out["resumed"] = after
    return out


def _wide(rank, world):
    return {name: _train(_recipe(par, method, blocks), whole)[0] for name, (par, method, blocks, whole) in WIDE.items()}


def _compare(what: str, got, ref, tol=TOL) -> None:
    (losses, norms, params), (ref_losses, ref_norms, ref_params) = got, ref
    print(f"{what}: losses {losses} (reference {ref_losses}), gradient norms {norms} (reference {ref_norms})")
    assert min(ref_norms) > CLIP, f"the clipping must act: gradient norms {ref_norms} against {CLIP}"
    for label, a, b in (("losses", losses, ref_losses), ("gradient norms", norms, ref_norms)):
        torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                                   **tol, msg=lambda m, label=label: f"{what} {label}: {m}")
    if params is not None:
        assert params.keys() == ref_params.keys()
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], **tol, msg=lambda m, name=name: f"{what} {name}: {m}")


def test_context_2_by_ring_and_all_to_all_trains_one_process_weights_and_resumes_across_layouts(tmp_path):
    ref_losses, ref_norms, _ = _reference(_recipe({}), STEPS + 2)
    ref = ref_losses[:STEPS], ref_norms[:STEPS], _reference(_recipe({}))[2]
    for rank, out in enumerate(run(_context_2, 2, str(tmp_path), timeout_s=240)):
        resumed = out.pop("resumed")
        for method, got in out.items():
            _compare(f"context 2 {method} rank {rank}", got, ref)
        print(f"resumed at data 2 (step 4), then at context 2 (step 5), rank {rank}: {resumed}")
        torch.testing.assert_close(torch.tensor(resumed, dtype=torch.float64),
                                   torch.tensor(list(zip(ref_losses, ref_norms, strict=True))[STEPS:],
                                                dtype=torch.float64), **TOL)


@pytest.mark.slow  # context 2 by both methods, on DeepSpeed and on transformers families stays in the README suite
def test_context_4_and_context_with_tensor_data_zero3_and_pipeline_train_one_process_losses():
    results = run(_wide, 4, timeout_s=400)
    for name, (par, method, blocks, _) in WIDE.items():
        ref = _reference(_recipe(par, method, blocks))
        for rank, out in enumerate(results):
            _compare(f"{name} {method} rank {rank}", out[name], ref)


DEEPSPEED = {  # the DeepSpeed back end, name -> as WIDE, and whether the README suite runs it (the rest: -m slow):
    # each layout of WIDE by the method WIDE does not use for it, and by the other where DeepSpeed takes another path
    # (ZeRO-3's partitioning, sequence parallelism's slices, meta init)
    "cp2_tp2_a2a": ({"context": 2, "tensor": 2}, "all_to_all", {"zero": {"stage": 1}}, False, True),
    "cp2_dp2_zero3_ring": ({"context": 2, "data": 2}, "ring", {"zero": {"stage": 3}}, False, True),
    "cp2_pp2_a2a_zero1": ({"context": 2, "pipeline": 2}, "all_to_all", {"pipeline_parallel": PP, "zero": {"stage": 1}},
                          False, True),
    "cp4_a2a": ({"context": 4}, "all_to_all", {}, True, False),
    "cp2_tp2_sp_ring": ({"context": 2, "tensor": 2}, "ring",
                        {"tensor_parallel": {"sequence_parallel": True}, "zero": {"stage": 2}}, False, False),
    "cp2_dp2_zero3_ring_meta": ({"context": 2, "data": 2}, "ring", {"zero": {"stage": 3}}, False, False),
    "cp2_dp2_zero2_a2a": ({"context": 2, "data": 2}, "all_to_all", {"zero": {"stage": 2}}, False, False),
}
# Dropout under the ring: what one process cannot draw (its masks cover the whole sequence, the ring's each block;
# tests/dist/test_context_attention.py holds the ring's masks to a whole-sequence attention), so its parity is the
# recompute's: context 2 x data 2 at ZeRO-1 with dropout 0.1, full activation checkpointing against none, bitwise
DROPOUT = ({"context": 2, "data": 2}, "ring", {"zero": {"stage": 1}})


def _dropout(recompute: str):
    par, method, blocks = DROPOUT
    model = {**_recipe(par).to_dict()["model"], "dropout": 0.1}
    return _recipe(par, method, {**blocks, "model": model, "activation_checkpointing": {"mode": recompute}}, "auto")


def _deepspeed(rank, world, directory, fast):
    """The DeepSpeed layouts of the README suite (``fast``) or the others; then the fast ones' checkpoint across
    layouts: context 2 x data 2 at ZeRO-3 (3 steps, ring) resumed at data 4 x context 1 at ZeRO-2 for step 4, whose
    checkpoint the context 2 x pipeline 2 engine (all-to-all, ZeRO-1) loads for step 5; or the dropout runs."""
    from plugin.data.text import TextBatches

    out, engines = {}, {}
    for name, (par, method, blocks, whole, readme) in DEEPSPEED.items():
        if readme == fast:
            out[name], engines[name] = _train(_recipe(par, method, blocks, "auto"), whole, backend="deepspeed",
                                              meta=name.endswith("_meta"))
    if not fast:
        for recompute in ("none", "full"):
            out[f"dropout_{recompute}"] = _train(_dropout(recompute), False, backend="deepspeed")[0][:2]
        return out
    cp = engines["cp2_dp2_zero3_ring"]
    cp.save(f"{directory}/cp2")
    _, resumed = _train(_recipe({"data": world}, blocks={"zero": {"stage": 2}}, launcher="auto"), whole=False,
                        steps=0, backend="deepspeed")
    resumed.load(f"{directory}/cp2")
    data, after = TextBatches(cp.recipe.model.vocab, cp.recipe.model.seq_len), []
    for step, engine in ((STEPS, resumed), (STEPS + 1, engines["cp2_pp2_a2a_zero1"])):
        if engine is not resumed:
            resumed.save(f"{directory}/dp4")
            engine.load(f"{directory}/dp4")
        loss = engine.train_step(data.global_batch(step, engine.layout.global_batch))
        after.append((loss, engine.last_step.grad_norm))
    out["resumed"] = after
    return out


def _compare_deepspeed(results, fast: bool) -> None:
    for name, (par, method, blocks, _, readme) in DEEPSPEED.items():
        if readme == fast:
            ref = _reference(_recipe(par, method, blocks))
            for rank, out in enumerate(results):
                _compare(f"deepspeed {name} {method} rank {rank}", out[name], ref)


@pytest.mark.deepspeed
def test_deepspeed_context_layouts_train_one_process_losses_and_resume_across_layouts(tmp_path):
    """DeepSpeed's sequence-parallel groups carry the context axis (its pipeline grid's data axis, under a pipeline):
    context 2 x tensor 2 at ZeRO-1 (all-to-all), context 2 x data 2 at ZeRO-3 (ring), context 2 x pipeline 2 at ZeRO-1
    (all-to-all), every rank against one process; a checkpoint from context 2 x data 2 at ZeRO-3 through data 4 at
    ZeRO-2 to context 2 x pipeline 2."""
    need("deepspeed")
    results = run(_deepspeed, 4, str(tmp_path), True, timeout_s=600)
    _compare_deepspeed(results, fast=True)
    ref_losses, ref_norms, _ = _reference(_recipe({"context": 2, "data": 2}), STEPS + 2)
    for rank, out in enumerate(results):
        print(f"deepspeed: resumed at data 4 (step 4), then at context 2 x pipeline 2 (step 5), rank {rank}: "
              f"{out['resumed']}")
        torch.testing.assert_close(torch.tensor(out["resumed"], dtype=torch.float64),
                                   torch.tensor(list(zip(ref_losses, ref_norms, strict=True))[STEPS:],
                                                dtype=torch.float64), **TOL)


@pytest.mark.deepspeed
@pytest.mark.slow
def test_deepspeed_context_by_the_other_method_on_meta_and_with_dropout_under_recompute(tmp_path):
    """context 4 (ZeRO-0, whole parameters compared; all-to-all), context 2 x tensor 2 with sequence parallelism at
    ZeRO-2 (ring), context 2 x data 2 at ZeRO-3 built on meta (ring) and at ZeRO-2 (all-to-all), every rank against
    one process; the ring's dropout under full recompute equal to no recompute, bitwise, and other than dropout 0."""
    need("deepspeed")
    results = run(_deepspeed, 4, str(tmp_path), False, timeout_s=600)
    _compare_deepspeed(results, fast=False)
    ref_losses = _reference(_recipe(DROPOUT[0]))[0]
    for rank, out in enumerate(results):
        print(f"deepspeed ring with dropout 0.1, rank {rank}: no recompute {out['dropout_none']}, full recompute "
              f"{out['dropout_full']}")
        assert out["dropout_none"] == out["dropout_full"], f"rank {rank}: the recompute drew other dropout masks"
        assert out["dropout_none"][0][1:] != ref_losses[1:], f"rank {rank}: dropout 0.1 drew no mask"


HF_DIMS = {"vocab": 128, "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn_hidden": 128, "seq_len": 32}
HF_TOL = dict(rtol=1e-4, atol=1e-5)


def _llama():
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    d = HF_DIMS
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=d["layers"], num_attention_heads=d["heads"],
        num_key_value_heads=d["kv_heads"], intermediate_size=d["ffn_hidden"], max_position_embeddings=d["seq_len"],
        tie_word_embeddings=False, attn_implementation="sdpa"))


def _padded(step: int, rows: int = 8):
    """Step ``step``'s batch: rows of uneven lengths (8..seq), every third left-padded, the rest right-padded; labels
    -100 at the padding."""
    from tests.hf_families import padded_batch

    return padded_batch(rows, HF_DIMS["vocab"], HF_DIMS["seq_len"], seed=100 + step, shortest=8)


def _hf_recipe(method: str, context: int):
    from plugin.recipe.spec import Recipe

    return Recipe.from_dict({"name": "llama_cp", "parallelism": {"data": 1, "tensor": 1, "pipeline": 1,
                                                                   "context": context},
                             "context_parallel": {"method": method}, "batch": {"global": 8, "micro": 4},
                             "optimizer": SGD, "gradient_clipping": CLIP, "launcher": "torchrun", "model": HF_DIMS,
                             "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_memory_gb": 4}})


# family -> the methods it is trained by at context 2: Llama by both; Qwen2, Mistral (its sliding window off: the
# context attention refuses a window) and GPT-2 (no grouped-query heads, learned positions) by one each
HF_FAMILIES = {"llama": ("ring", "all_to_all"), "qwen2": ("all_to_all",), "mistral": ("ring",), "gpt2": ("ring",)}


def _family(family: str):
    if family == "llama":
        return _llama()
    from plugin.recipe.spec import Model
    from tests.hf_families import tiny_model

    model = tiny_model(family, window=None, dims=Model(**HF_DIMS))
    if family == "mistral":
        model.config.sliding_window = None
    model.set_attn_implementation("sdpa")
    return model


def _hf_reference(family: str = "llama"):
    model = _family(family)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    losses, norms = [], []
    for step in range(STEPS):
        loss = model(**_padded(step), use_cache=False).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _hf_context_2(rank, world):
    import plugin

    out = {}
    for family, methods in HF_FAMILIES.items():
        for method in methods:
            engine = plugin.initialize(_family(family), _hf_recipe(method, world), backend="native")
            losses, norms = [], []
            for step in range(STEPS):
                losses.append(engine.train_step(_padded(step)))
                norms.append(engine.last_step.grad_norm)
            out[family, method] = losses, norms, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return out


def test_transformers_families_at_context_2_train_one_process_on_padded_batches():
    pytest.importorskip("transformers")
    results = run(_hf_context_2, 2, timeout_s=300)
    for family in HF_FAMILIES:
        ref = _hf_reference(family)
        for rank, out in enumerate(results):
            for (name, method), got in out.items():
                if name == family:
                    _compare(f"{family} context 2 {method} rank {rank}", got, ref, HF_TOL)
