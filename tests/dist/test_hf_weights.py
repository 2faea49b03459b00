"""A transformers model's saved weights (``save_pretrained``, safetensors) loaded sharded:
``plugin.initialize(meta_model, recipe, weights=DIR)`` at tp2 and at pp2 gives the losses of one process training
``from_pretrained(DIR)``, and each rank asked the files for exactly the bytes of the parameters it holds (its tensor
shards, its stage), counted by :attr:`plugin.materialize.weights.SafetensorsWeights.bytes_read`. Under ZeRO-3 (dp2)
the losses match too and each rank reads its share only, about half the tensors: the native FSDP2 sink exactly the
rows of its dim-0 chunks (the two ranks' reads add up to the tensors' bytes), DeepSpeed's ZeRO-3 sink the rows that
cover its flat range (at most two rows per tensor more); and the sharded parameters, gathered, are bitwise the files'.

One spawn of 2 gloo processes per back end (native, DeepSpeed) trains both layouts; the saved model's values come from
its own eager init (seed 0), not from the plugin's per-unit init, so a unit left at its init would show in the losses.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .needs import need
from .spawn import run
from .test_hf_layouts import padded_batch

need("transformers")
need("safetensors")
pytestmark = pytest.mark.dist

STEPS, REL = 2, 1e-4
LAYOUTS = {"tp2": ("cpu_tp2_dp2", {"data": 1, "tensor": 2, "pipeline": 1}),
           "pp2": ("cpu_pp2_dp2", {"data": 1, "tensor": 1, "pipeline": 2}),
           "zero3_dp2": ("cpu_zero3_dp4", {"data": 2, "tensor": 1, "pipeline": 1})}
SHARED = {"zero3_dp2"}  # FSDP2 / DeepSpeed ZeRO-3: each rank reads its shard of every tensor


def config_of(dims):
    import transformers as tf

    return tf.LlamaConfig(vocab_size=dims["vocab"], hidden_size=dims["hidden"], num_hidden_layers=dims["layers"],
                          num_attention_heads=dims["heads"], num_key_value_heads=2,
                          intermediate_size=dims["ffn_hidden"], max_position_embeddings=dims["seq_len"],
                          tie_word_embeddings=False)


def train_from_weights(rank, world_size, recipes: dict, weights: str, backend: str):
    import transformers as tf

    import plugin
    from plugin.materialize import weights as source_module
    from plugin.recipe.checks import load_recipe

    tf.logging.set_verbosity_error()
    sources = []
    real_init = source_module.SafetensorsWeights.__init__

    def recording_init(self, *args, **kwargs):  # the test's handle on the source initialize opens
        real_init(self, *args, **kwargs)
        sources.append(self)

    source_module.SafetensorsWeights.__init__ = recording_init
    out, engines = {}, []
    for name, path in recipes.items():
        recipe = load_recipe(path)
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(weights))
        engine = plugin.initialize(model, recipe, backend=backend, weights=weights)
        engines.append(engine)
        mine = engine.ds.module if backend == "deepspeed" else engine.container  # this rank's parameters
        if name in SHARED:
            held = (sum(p.to_local().numel() * p.element_size() for p in mine.parameters())
                    if backend == "native" else None)  # DeepSpeed's ds_tensor holds padding: the bounds check it
            out[name + ":differ"] = differ_from_files(mine, weights, backend)
        else:
            held = sum(p.numel() * p.element_size() for p in mine.parameters())
        losses = [engine.train_step(padded_batch(s, engine.layout.global_batch, recipe.model.seq_len,
                                                 recipe.model.vocab)) for s in range(STEPS)]
        out[name] = losses, sources[-1].bytes_read, held
    if backend == "deepspeed":  # the engines stay open (spawn tears the group down): unlink DeepSpeed's shm buffer
        import torch.distributed as dist

        from plugin.engines.shm import release_shm_buffer

        dist.barrier()
        release_shm_buffer(rank)
    return out


def differ_from_files(module, weights: str, backend: str) -> list[str]:
    """The names of ``module``'s sharded parameters whose gathered whole value is not bitwise the files' tensor."""
    from safetensors.torch import load_file

    files = {}
    for f in sorted(Path(weights).glob("*.safetensors")):
        files.update(load_file(str(f)))
    differ = []
    for name, p in module.named_parameters():
        if backend == "native":
            whole = p.full_tensor().detach().cpu()
        else:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                whole = p.detach().clone().cpu()
        if not torch.equal(whole, files[name].to(whole.dtype)):
            differ.append(name)
    return differ


def reference(weights: str, recipe_data):
    import transformers as tf

    model = tf.LlamaForCausalLM.from_pretrained(weights)
    opt = recipe_data["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    losses = []
    for step in range(STEPS):
        batch = padded_batch(step, recipe_data["batch"]["global"], recipe_data["model"]["seq_len"],
                             recipe_data["model"]["vocab"])
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe_data["gradient_clipping"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def tensor_bytes(weights) -> tuple[int, int]:
    """The bytes of the files' tensors, and two rows of each (what a flat range's covering rows may add)."""
    from safetensors import safe_open

    total = slack = 0
    for f in sorted(weights.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_slice(k)
                shape, size = t.get_shape(), h.get_tensor(k).element_size()
                numel = 1
                for n in shape:
                    numel *= n
                total += numel * size
                slack += 2 * (numel // shape[0] if shape else 1) * size
    return total, slack


@pytest.mark.parametrize("backend", [pytest.param("native", marks=pytest.mark.native),
                                     pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_saved_weights_load_sharded_and_train_as_from_pretrained(backend, tmp_path):
    import transformers as tf

    if backend == "deepspeed":
        need("deepspeed")
    from plugin.recipe.load import find_recipe

    from .runs import recipe_variant

    recipes = {}
    for name, (base, parallelism) in LAYOUTS.items():
        model_block = {**json.loads(find_recipe(base).read_text())["model"], "kv_heads": 2}
        recipes[name] = str(recipe_variant(base, tmp_path, name, model=model_block, parallelism=parallelism))
    dims = json.loads(open(recipes["tp2"]).read())["model"]
    torch.manual_seed(0)
    weights = tmp_path / "saved"
    tf.LlamaForCausalLM(config_of(dims)).save_pretrained(weights)
    total = sum(f.stat().st_size for f in weights.glob("*.safetensors"))
    tensors, slack = tensor_bytes(weights)
    results = run(train_from_weights, 2, recipes, str(weights), backend, timeout_s=300)
    reads = [r["zero3_dp2"][1] for r in results]
    print(f"{backend} zero3_dp2 bytes read per rank: {reads} of {tensors} (slack {slack})")
    if backend == "native":  # dim-0 chunks: the ranks read disjoint rows that make up every tensor
        assert sum(reads) == tensors, f"zero3_dp2: the ranks read {reads}, together not the {tensors} bytes"
    else:  # flat ranges: each rank's covering rows, at most two rows a tensor more than its range
        assert tensors <= sum(reads) <= tensors + slack, f"zero3_dp2: the ranks read {reads} of {tensors} bytes"
    for name, path in recipes.items():
        want = reference(str(weights), json.loads(open(path).read()))
        for rank, r in enumerate(results):
            losses, read, held = r[name]
            assert losses == pytest.approx(want, rel=REL), f"{name} rank {rank}: {losses} vs from_pretrained {want}"
            if name in SHARED:
                assert r[name + ":differ"] == [], f"{name} rank {rank}: not the files' values: {r[name + ':differ']}"
                assert abs(read - tensors / 2) <= slack, f"{name} rank {rank}: read {read} of {tensors} bytes"
                if held is not None:
                    assert read == held, f"{name} rank {rank}: read {read} bytes of the files, holds {held}"
                continue
            assert read == held, f"{name} rank {rank}: read {read} bytes of the files, holds {held}"
            assert read < 0.75 * total, f"{name} rank {rank}: read {read} of {total} bytes"
