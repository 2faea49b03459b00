"""transformers causal LMs (Llama, Qwen2; GPT-2 where it fits) in every layout on padded dict batches: the losses and
the last step's gradient norm of one process training the same model with its own Hugging Face loss.

The batches are Hugging Face style dicts (``input_ids``, ``attention_mask``, ``labels`` = input ids with ``-100`` at
the padding) of uneven lengths, right and left padded, so the loss must be the token-weighted mean over the whole
global batch (:class:`plugin.tensor_parallel.hooks.TokenLoss`): a mean of per-micro-batch means is ~1e-3 off.
The reference is ``model(**batch).loss`` (transformers' own shift and mean) on the whole global batch, torch's
AdamW with the recipe's settings and clipping, on one process, in the test itself.

One spawn of 4 gloo processes per back end: each trains every layout in turn, each layout two models, the engines
closed once at the end (two ``plugin.initialize`` in one process work: design/issue-14 exp16).
"""
from __future__ import annotations

import json

import pytest
import torch

from .needs import need
from .spawn import run

need("transformers")
pytestmark = pytest.mark.dist

STEPS = 3
REL = 1e-4
# name -> (shipped recipe, replaced blocks); micro 2 at data 4 gives grad_accum 2
LAYOUTS = {
    "dp4_zero1_gas2": ("cpu_dp4", {"batch": {"global": 16, "micro": 2}}),
    "zero3_dp4_gas2": ("cpu_zero3_dp4", {"batch": {"global": 16, "micro": 2}}),
    "tp2_dp2": ("cpu_tp2_dp2", {}),
    "pp2_dp2": ("cpu_pp2_dp2", {}),
    "tp2_pp2": ("cpu_tp2_pp2", {}),
}
MODELS = {"dp4_zero1_gas2": ("llama", "qwen2"), "zero3_dp4_gas2": ("llama", "gpt2"), "tp2_dp2": ("llama", "qwen2"),
          "pp2_dp2": ("llama", "mistral"), "tp2_pp2": ("qwen2", "llama")}


def build(kind, dims):
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=dims["vocab"], n_embd=dims["hidden"], n_layer=dims["layers"], n_head=dims["heads"],
            n_inner=dims["ffn_hidden"], n_positions=dims["seq_len"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    common = dict(vocab_size=dims["vocab"], hidden_size=dims["hidden"], num_hidden_layers=dims["layers"],
                  num_attention_heads=dims["heads"], num_key_value_heads=2, intermediate_size=dims["ffn_hidden"],
                  max_position_embeddings=dims["seq_len"], tie_word_embeddings=False)
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=24))


def padded_batch(step, rows, seq, vocab):
    """Rows of uneven lengths (8..seq), every third left-padded, the rest right-padded."""
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(1, vocab, (rows, seq), generator=gen)
    mask = torch.zeros(rows, seq, dtype=torch.int64)
    for r in range(rows):
        n = int(torch.randint(8, seq + 1, (1,), generator=gen))
        if r % 3 == 2:
            mask[r, seq - n:] = 1
        else:
            mask[r, :n] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def reference(kind, recipe_data):
    """One process: the model's own HF loss on the whole global batch, AdamW and clipping as the recipe says."""
    dims, opt = recipe_data["model"], recipe_data["optimizer"]
    model = build(kind, dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    losses, norm = [], None
    for step in range(STEPS):
        loss = model(**padded_batch(step, recipe_data["batch"]["global"], dims["seq_len"], dims["vocab"]),
                     use_cache=False).loss
        loss.backward()
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe_data["gradient_clipping"])
        norm = float(n)  # the last step's, as the engine's last_grad_norm
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norm


def train_layouts(rank, world_size, recipes: dict, backend: str):
    import plugin
    from plugin.recipe.checks import load_recipe

    out, engines = {}, []
    for name, path in recipes.items():
        recipe = load_recipe(path)
        for kind in MODELS[name]:
            engine = plugin.initialize(build(kind, json.loads(open(path).read())["model"]), recipe, backend=backend)
            engines.append(engine)
            losses = [engine.train_step(padded_batch(s, engine.layout.global_batch, recipe.model.seq_len,
                                                     recipe.model.vocab)) for s in range(STEPS)]
            out[name, kind] = losses, getattr(engine, "last_grad_norm", None)
    return out


def _recipes(tmp_path):
    from plugin.recipe.load import find_recipe

    from .runs import recipe_variant

    out = {}
    for name, (base, changes) in LAYOUTS.items():
        model = {**json.loads(find_recipe(base).read_text())["model"], "kv_heads": 2}  # the models' 2 kv heads
        out[name] = str(recipe_variant(base, tmp_path, name, model=model, **changes))
    return out


def _check(results, recipes):
    for (name, kind), (losses, norm) in results[0].items():
        ref_losses, ref_norm = reference(kind, json.loads(open(recipes[name]).read()))
        for r in results:
            assert r[name, kind][0] == losses, f"{name} {kind}: ranks report different losses"
        assert losses == pytest.approx(ref_losses, rel=REL), f"{name} {kind}: {losses} vs one process {ref_losses}"
        if norm is not None:
            assert norm == pytest.approx(ref_norm, rel=REL), f"{name} {kind}: grad norm {norm} vs {ref_norm}"


def test_native_layouts_train_one_process_losses_on_padded_dict_batches(tmp_path):
    recipes = _recipes(tmp_path)
    _check(run(train_layouts, 4, recipes, "native", timeout_s=300), recipes)


@pytest.mark.deepspeed
def test_deepspeed_layouts_train_one_process_losses_on_padded_dict_batches(tmp_path):
    need("deepspeed")
    recipes = _recipes(tmp_path)
    _check(run(train_layouts, 4, recipes, "deepspeed", timeout_s=400), recipes)
