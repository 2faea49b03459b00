"""The reference GPT trained with a context axis on the native back end against one process.

Three launches, 3 steps per layout, fp32, against one process trained on the whole global batch (rel 1e-5 for
the reference GPT):

* 2 gloo processes, ``context = 2`` (the whole world one context group), by ring and by all-to-all: every step's
  loss and gradient norm (before clipping) and every parameter after the last step; then the checkpoints are
  layout-free: the context-2 checkpoint resumes at data 2 (step 4) and that one at context 2 (step 5), both steps
  the reference's.
* 4 processes, one layout after another: ``context = 4`` alone (ring; loss, norm, parameters), ``context 2 x
  tensor 2`` with sequence parallelism and full activation checkpointing (ring; the recompute replays the blocks),
  ``context 2 x data 2`` with ZeRO-3 (FSDP2 over data x context, all-to-all) and ``context 2 x pipeline 2`` (1F1B,
  ring): loss and gradient norm per step (the norm is the whole model's, reduced over the shards, so a gradient
  summed over the wrong group or a loss share not divided shows in it).
* 2 processes, a transformers Llama (2 kv heads, rotary) at ``context = 2`` by both methods, through transformers'
  attention interface, on Hugging Face dict batches padded right and left (the key mask travels whole, the chunks get
  their global ``position_ids``): losses, gradient norms and weights against ``model(**batch).loss`` on one process,
  rel 1e-4 (the tolerance of the other transformers layout tests).

The optimizer is SGD with momentum 0.9 and the clipping threshold sits below the gradient norm on every step
(asserted), so the clipping acts and the norm it reports is compared: a gradient wrong by a uniform factor (a loss
share not divided by the context degree) leaves the clipped update as it was, so the losses and weights alone would
not see it, but the norm does; a gradient wrong in direction (positions of the wrong chunk, a missed K/V block) moves
losses, norms and weights. AdamW would divide both kinds away.
"""
from __future__ import annotations

import pytest
import torch

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


def _recipe(parallelism: dict, method: str = "ring", blocks: dict | None = None):
    from plugin.recipe.checks import load_recipe
    from plugin.recipe.spec import Recipe

    data = load_recipe("cpu_single").to_dict()
    data.update(parallelism={"data": 1, "tensor": 1, "pipeline": 1, **parallelism},
                context_parallel={"method": method}, optimizer=SGD, gradient_clipping=CLIP, launcher="torchrun",
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


def _train(recipe, whole: bool, steps: int = STEPS):
    """(losses and gradient norms of the engine's first ``steps`` steps, and its parameters when ``whole``: the module
    holds them all), and the engine."""
    import plugin
    from plugin.data.text import TextBatches
    from plugin.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine = plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend="native")
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(steps):
        losses.append(engine.train_step(data.global_batch(step, engine.layout.global_batch)))
        norms.append(engine.last_grad_norm)
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
        after.append((engine.train_step(data.global_batch(step, engine.layout.global_batch)), engine.last_grad_norm))
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


def test_context_4_and_context_with_tensor_data_zero3_and_pipeline_train_one_process_losses():
    results = run(_wide, 4, timeout_s=400)
    for name, (par, method, blocks, _) in WIDE.items():
        ref = _reference(_recipe(par, method, blocks))
        for rank, out in enumerate(results):
            _compare(f"{name} {method} rank {rank}", out[name], ref)


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


def _hf_reference():
    model = _llama()
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
    for method in ("ring", "all_to_all"):
        engine = plugin.initialize(_llama(), _hf_recipe(method, world), backend="native")
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(engine.train_step(_padded(step)))
            norms.append(engine.last_grad_norm)
        out[method] = losses, norms, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return out


def test_transformers_llama_at_context_2_trains_one_process_on_padded_batches():
    pytest.importorskip("transformers")
    ref = _hf_reference()
    for rank, out in enumerate(run(_hf_context_2, 2, timeout_s=240)):
        for method, got in out.items():
            _compare(f"llama context 2 {method} rank {rank}", got, ref, HF_TOL)
