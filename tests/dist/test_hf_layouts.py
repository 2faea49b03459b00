"""transformers causal LMs (Llama, Qwen2; GPT-2 where it fits) in every layout on padded dict batches: the losses and
the last step's gradient norm of one process training the same model with its own Hugging Face loss.

The batches are Hugging Face style dicts (``input_ids``, ``attention_mask``, ``labels`` = input ids with ``-100`` at
the padding) of uneven lengths, right and left padded, so the loss must be the token-weighted mean over the whole
global batch (:class:`plugin.tensor_parallel.hooks.TokenLoss`): a mean of per-micro-batch means is ~1e-3 off.
The reference is ``model(**batch).loss`` (transformers' own shift and mean) on the whole global batch, torch's
AdamW with the recipe's settings and clipping, on one process, in the test itself.

One spawn of 4 gloo processes per back end: each trains every layout in turn, each layout two or three models, the
engines closed once at the end (two ``plugin.initialize`` in one process work: design/issue-14 exp16).

Weights tied across pipeline stages: GPT-2 keeps its default ``tie_word_embeddings=True`` (``wte`` on the first
stage, ``lm_head`` on the last), and ``gpt_tied`` is the reference GPT with ``tie_embeddings``, built on the meta
device (each stage materialises its own copy), its reference built eagerly with the same seed. Besides the losses,
every rank returns its copy of the tied weight after the last step: the copies of one tensor rank are bitwise equal
on both stages and all data ranks. The bytes all-reduced over the tie's group in the last step are recorded and
compared with the planner's ``tied_embedding_grad_allreduce`` term for the tied reference GPT of the recipe's dims
(a ring of 2 sends the whole buffer once: the estimate's bytes sent equal the buffer's bytes).
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
    "pp2_dp2": ("cpu_pp2_dp2", {"gradient_clipping": 0.3}),  # below the norms (0.5-0.6): clipping acts, so the
    "tp2_pp2": ("cpu_tp2_pp2", {"gradient_clipping": 0.3}),  # losses see each stage's norm, a tied copy counted once
}
MODELS = {"dp4_zero1_gas2": ("llama", "qwen2"), "zero3_dp4_gas2": ("llama", "gpt2"), "tp2_dp2": ("llama", "qwen2"),
          "pp2_dp2": ("llama", "mistral", "gpt2"), "tp2_pp2": ("qwen2", "llama", "gpt_tied")}
TIED = {"gpt2": lambda m: m.lm_head.weight, "gpt_tied": lambda m: m.head.weight}  # the last stage's name of the tie


def gpt_config(dims):
    from plugin.models.gpt import GPTConfig

    return GPTConfig(vocab=dims["vocab"], hidden=dims["hidden"], layers=dims["layers"], heads=dims["heads"],
                     seq_len=dims["seq_len"], ffn_hidden=dims["ffn_hidden"], dropout=0.0, tie_embeddings=True)


def build(kind, dims):
    import transformers as tf

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt_tied":  # eager here (the reference); the engines get it on meta, filled by the same seed
        from plugin.models.gpt import GPT

        return GPT(gpt_config(dims))
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
    """Step ``step``'s batch: rows of uneven lengths (8..seq), every third left-padded, the rest right-padded."""
    from tests.hf_families import padded_batch as padded

    return padded(rows, vocab, seq, seed=100 + step, shortest=8)


def gpt_batch(batch):
    """The reference GPT takes token ids only: the same rows without the mask (padding is labelled -100)."""
    return {k: v for k, v in batch.items() if k != "attention_mask"}


def hf_loss(model, kind, batch):
    if kind != "gpt_tied":
        return model(**batch, use_cache=False).loss
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())


def reference(kind, recipe_data):
    """One process: the model's own HF loss on the whole global batch, AdamW and clipping as the recipe says."""
    dims, opt = recipe_data["model"], recipe_data["optimizer"]
    model = build(kind, dims)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    losses, norm = [], None
    for step in range(STEPS):
        batch = padded_batch(step, recipe_data["batch"]["global"], dims["seq_len"], dims["vocab"])
        loss = hf_loss(model, kind, gpt_batch(batch) if kind == "gpt_tied" else batch)
        loss.backward()
        n = torch.nn.utils.clip_grad_norm_(model.parameters(), recipe_data["gradient_clipping"])
        norm = float(n)  # the last step's, as the engine's last_grad_norm
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norm


def grad_norm(engine):
    """The last step's global gradient norm: the native engines'; DeepSpeed's pipeline engine records it under
    ZeRO-1 (``get_global_grad_norm``; not at ZeRO-0)."""
    if engine.backend != "deepspeed":
        return engine.last_grad_norm
    norm = engine.ds.get_global_grad_norm() if engine.pipelined else None
    return None if norm is None else float(norm)


def tie_groups(engine) -> list:
    """The groups over which the copies of a weight tied across pipeline stages sum their gradients."""
    if engine.backend == "deepspeed":
        return [c["group"] for c in getattr(engine.ds.module, "tied_comms", {}).values()]
    return [group for _, group, _, _ in engine.tied.copies] if hasattr(engine, "tied") else []


def tied_bytes_in_step(engine, batch) -> tuple[float, int]:
    """(loss, bytes all-reduced over the tie groups) of one train_step."""
    import torch.distributed as dist

    groups, sent, real = tie_groups(engine), [0], dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        if any(group is g for g in groups):
            sent[0] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counting
    try:
        return engine.train_step(batch), sent[0]
    finally:
        dist.all_reduce = real


def estimated_tied_bytes(recipe, stage: int) -> float:
    import dataclasses

    from plugin.planning.for_recipe import setup_from_recipe, spec_from_recipe
    from plugin.planning.traffic import communication_per_rank

    spec = dataclasses.replace(spec_from_recipe(recipe), tied_embeddings=True)
    terms = communication_per_rank(spec, setup_from_recipe(recipe, 4), stage=stage)
    return sum(t.bytes for t in terms if t.name == "tied_embedding_grad_allreduce")


def train_layouts(rank, world_size, recipes: dict, backend: str):
    import plugin
    from plugin.recipe.checks import load_recipe

    out, engines = {}, []
    for name, path in recipes.items():
        recipe = load_recipe(path)
        dims = json.loads(open(path).read())["model"]
        for kind in MODELS[name]:
            if kind == "gpt_tied":
                from plugin.models.gpt import GPT

                with torch.device("meta"):
                    model = GPT(gpt_config(dims))
                engine = plugin.initialize(model, recipe, backend=backend, seed=0)
            else:
                model = build(kind, dims)
                engine = plugin.initialize(model, recipe, backend=backend)
            engines.append(engine)
            batches = [padded_batch(s, engine.layout.global_batch, recipe.model.seq_len, recipe.model.vocab)
                       for s in range(STEPS)]
            batches = [gpt_batch(b) if kind == "gpt_tied" else b for b in batches]
            losses = [engine.train_step(b) for b in batches[:-1]]
            loss, sent = tied_bytes_in_step(engine, batches[-1])
            losses.append(loss)
            tied = None
            if kind in TIED and engine.layout.pipeline > 1:  # tied across stages (gpt2 at ZeRO-3 is one stage)
                tied = (engine.groups.tp_rank, TIED[kind](model).detach().clone(), sent,
                        estimated_tied_bytes(recipe, engine.groups.pp_rank) if kind == "gpt_tied" else None)
            out[name, kind] = losses, grad_norm(engine), tied
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
    for (name, kind), (losses, norm, tied) in results[0].items():
        ref_losses, ref_norm = reference(kind, json.loads(open(recipes[name]).read()))
        for r in results:
            assert r[name, kind][0] == losses, f"{name} {kind}: ranks report different losses"
        if tied is not None:  # every rank's copy of the tied weight (both stages, every data rank), per tensor rank
            copies = {}
            for r in results:
                tp_rank, t, sent, estimate = r[name, kind][2]
                copies.setdefault(tp_rank, []).append(t)
                assert sent == t.numel() * t.element_size(), f"{name} {kind}: {sent} bytes all-reduced over the tie"
                if estimate is not None:
                    assert sent == estimate, f"{name} {kind}: {sent} bytes over the tie, the planner says {estimate}"
            for tp_rank, ts in copies.items():
                assert all(torch.equal(ts[0], t) for t in ts), f"{name} {kind}: tied copies differ (tensor {tp_rank})"
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
