"""The context axis as the pure rooms see it: recipe, layout, checks, show/validate words, exports, back end choice."""
import json

import pytest

from plugin.engines.choose import accelerate_mode
from plugin.interop.accelerate_config import to_accelerate_config
from plugin.interop.deepspeed_config import from_ds_config, to_ds_config
from plugin.recipe.checks import check_recipe
from plugin.recipe.spec import Recipe

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq_len": 64}


def _recipe(par, model=MODEL, **blocks) -> Recipe:
    return Recipe.from_dict({"name": "r", "parallelism": par, "batch": {"global": 8, "micro": 2},
                             **({"model": model} if model else {}), **blocks})


def _errors(recipe, world=None):
    return {p.path: p.format() for p in check_recipe(recipe, world) if p.is_error}


def test_world_and_auto_count_the_context_degree():
    lay = _recipe({"data": "auto", "tensor": 2, "context": 2}).layout(8)
    assert (lay.data, lay.tensor, lay.pipeline, lay.context, lay.world_size) == (2, 2, 1, 2, 8)
    assert lay.words == "data 2 x tensor 2 x pipeline 1 x context 2"
    assert _recipe({"data": 2}).layout().words == "data 2 x tensor 1 x pipeline 1"  # unchanged without the axis
    errors = _errors(_recipe({"data": "auto", "tensor": 2, "context": 3}), 8)
    assert "tensor 2 x pipeline 1 x context 3 = 6 does not divide 8 -> launch 6 or 12 processes" in \
        errors["$.parallelism.data"]
    errors = _errors(_recipe({"data": 2, "context": 2}), 8)
    assert "data 2 x tensor 1 x pipeline 1 x context 2 = 4 processes, but the launcher runs 8" in \
        errors["$.parallelism"]
    assert 'set "data": 4 (or "auto")' in errors["$.parallelism"]


def test_sequence_must_cut_into_two_chunks_per_context_rank():
    assert _errors(_recipe({"data": 1, "context": 4})) == {}  # 64 = 2 x 4 x 8
    errors = _errors(_recipe({"data": 1, "context": 4}, {**MODEL, "seq_len": 36}))
    assert "seq_len 36 is not divisible by 8: the sequence is cut into 2 x context 4 equal chunks" in \
        errors["$.model.seq_len"] and "(32 or 40)" in errors["$.model.seq_len"]
    sp = _recipe({"data": 1, "tensor": 2, "context": 2}, {**MODEL, "seq_len": 36},
                 tensor_parallel={"sequence_parallel": True})
    assert "not divisible by 8" in _errors(sp)["$.model.seq_len"] and "sequence parallelism" in \
        _errors(sp)["$.model.seq_len"]


def test_ulysses_needs_whole_heads_per_rank():
    ring = _recipe({"data": 1, "tensor": 2, "context": 4})
    assert _errors(ring) == {}  # ring attention takes any head count
    ulysses = _recipe({"data": 1, "tensor": 2, "context": 4}, {**MODEL, "kv_heads": 2},
                      context_parallel={"method": "all_to_all"})
    errors = _errors(ulysses)
    assert "heads 4 is not divisible by tensor 2 x context 4 = 8" in errors["$.model.heads"]
    assert "kv_heads 2 is not divisible by tensor 2 x context 4 = 8" in errors["$.model.kv_heads"]
    assert 'use "method": "ring"' in errors["$.model.heads"]
    assert _errors(_recipe({"data": 1, "context": 2}, context_parallel={"method": "all_to_all"})) == {}
    warned = [p for p in check_recipe(_recipe({"data": 1}, context_parallel={"method": "all_to_all"}))]
    assert [p.path for p in warned] == ["$.context_parallel.method"] and not warned[0].is_error


def test_schema_refuses_an_unknown_method(tmp_path):
    from plugin.recipe.checks import validate

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"name": "r", "parallelism": {"data": 1, "context": 2}, "batch": {"micro": 1},
                                "context_parallel": {"method": "ulysses"}}))
    recipe, problems = validate(path)
    assert recipe is None and any(p.path == "$.context_parallel.method" for p in problems)


def test_deepspeed_export_carries_the_degree_and_import_reads_it_back():
    recipe = _recipe({"data": 2, "context": 2})
    cfg = to_ds_config(recipe)
    assert cfg["sequence_parallel_size"] == 2 and cfg["train_batch_size"] == 8  # the batch counts data ranks only
    assert "sequence_parallel_size" not in to_ds_config(_recipe({"data": 2}))
    back = from_ds_config(cfg, world_size=4)
    assert back["parallelism"] == {"data": 2, "tensor": 1, "pipeline": 1, "context": 2}
    assert back["context_parallel"] == {"method": "all_to_all"}  # DeepSpeed's sequence parallelism is Ulysses
    assert "deepspeed" not in back or "sequence_parallel_size" not in back["deepspeed"]
    clash = _recipe({"data": 2, "context": 2}, deepspeed={"sequence_parallel_size": 4})
    assert "contradicts the recipe's $.parallelism.context, which gives 2" in \
        _errors(clash)["$.deepspeed.sequence_parallel_size"]


def test_accelerate_launches_and_the_native_back_end_trains():
    recipe = _recipe({"data": 2, "context": 2}, zero={"stage": 1})
    mode, why = accelerate_mode(recipe, cuda=True, has_deepspeed=True, has_transformers=True)
    assert mode is None and "context" in why
    yaml = to_accelerate_config(recipe)
    assert "distributed_type: \"MULTI_GPU\"" in yaml and "deepspeed_config" not in yaml
    assert "# context parallelism: accelerate launches, the plugin's native back end trains" in yaml
    keys = [line for line in yaml.splitlines() if not line.startswith("#")]
    assert not [line for line in keys if "parallelism" in line or "cp_size" in line or "sp_size" in line]


@pytest.mark.parametrize("args, want", [(["validate"], "ok: {p}: data 2 x tensor 2 x pipeline 1 x context 2 = 8 "
                                                       "processes; batch 8 = micro 2 x grad_accum 2 x data 2"),
                                        (["show", "--json"], None)])
def test_doors_name_the_context_axis(tmp_path, args, want):
    from tests.unit.cli.test_cli import cli

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"name": "r", "parallelism": {"data": 2, "tensor": 2, "context": 2},
                                "batch": {"global": 8, "micro": 2}, "model": MODEL}))
    out = cli(args[0], path, *args[1:])
    assert out.returncode == 0, out.stderr
    if want:
        assert want.format(p=path) in out.stdout
        return
    shown = json.loads(out.stdout)
    assert shown["resolved"]["layout"] == "data 2 x tensor 2 x pipeline 1 x context 2"
    assert shown["resolved"]["context_parallel"] == "ring"
    row = shown["ranks"][6]
    assert (row["data"], row["context"], row["tensor"]) == (1, 1, 0)
    assert row["context_peers"] == [4, 6] and row["data_peers"] == [2, 6] and row["gradient_peers"] == [0, 2, 4, 6]


def test_deepspeed_trains_every_context_layout_with_its_own_sequence_parallel_accounting():
    from plugin.engines.choose import choose
    from plugin.interop.deepspeed_config import to_ds_config

    pp = {"pipeline_parallel": {"schedule": "1f1b", "micro_batches": 4}}
    for stage in (0, 1, 2, 3):
        assert not _errors(_recipe({"data": 2, "context": 2}, launcher="deepspeed", zero={"stage": stage}))
    assert not _errors(_recipe({"data": 1, "context": 2, "pipeline": 2}, launcher="deepspeed", **pp))

    def chosen(par, **blocks):
        return choose(_recipe(par, **blocks), environ={}, has_deepspeed=True, cuda=True)
    assert chosen({"data": 2, "context": 2}) == "deepspeed"
    assert chosen({"data": 2, "context": 2}, zero={"stage": 3}) == "deepspeed"
    assert chosen({"data": 1, "context": 2, "pipeline": 2}, **pp) == "deepspeed"
    # DeepSpeed's own sequence-parallel accounting: the batch triple counts data ranks, the degree is the context's;
    # at ZeRO-3 the reduce-scatter path, the one that divides every bucket by data x context, is the recipe's
    zero3 = to_ds_config(_recipe({"data": 2, "context": 2}, zero={"stage": 3}), 4)
    assert zero3["sequence_parallel_size"] == 2 and zero3["zero_optimization"]["reduce_scatter"] is True
    assert zero3["train_batch_size"] == zero3["train_micro_batch_size_per_gpu"] * 2 * \
        zero3["gradient_accumulation_steps"]
    assert "reduce_scatter" not in to_ds_config(_recipe({"data": 2, "context": 2}, zero={"stage": 2}), 4)[
        "zero_optimization"]
    errors = _errors(_recipe({"data": 2, "context": 2}, zero={"stage": 3},
                             deepspeed={"zero_optimization": {"reduce_scatter": False}}))
    assert "$.parallelism.context" in errors["$.deepspeed.zero_optimization.reduce_scatter"]


def test_the_estimate_divides_activations_and_shards_by_context_and_counts_its_traffic():
    from plugin.planning.for_recipe import estimate_recipe

    def est(par, **blocks):
        return estimate_recipe(_recipe(par, **blocks))

    one, cp2 = est({"data": 1}), est({"data": 1, "context": 2})
    assert cp2.setup.world_size == 2 and one.setup.world_size == 1
    for term in ("activations", "embedding_activations", "output_layer_activations"):
        assert cp2.memory.get(term) == one.memory.get(term) / 2, term  # s/C tokens per rank, every term linear
    assert cp2.time.get("compute") == one.time.get("compute") / 2
    zero1 = est({"data": 1, "context": 2}, zero={"stage": 1}).memory.get("optimizer_states")
    assert zero1 == est({"data": 2}, zero={"stage": 1}).memory.get("optimizer_states")  # sharded over data x context
    # ring: keys and values (2 x s/C x b x h values, fp32) forward and backward, fp32 dK/dV C times; 2 layers, m = 4
    kv, m, layers, w = 2 * (64 // 2) * 2 * 64, 4, 2, 4
    ring = {c.name: c for c in cp2.communication}["context_ring_kv"]
    assert ring.group == "context" and ring.bytes == m * layers * (2 * 1 * kv * w + 2 * kv * 4)
    ulysses = est({"data": 1, "context": 2}, context_parallel={"method": "all_to_all"})
    a2a = {c.name: c for c in ulysses.communication}["context_all_to_all"]
    q = (64 // 2) * 2 * 64  # queries and the output, all heads; each all-to-all sends (C-1)/C
    assert a2a.bytes == m * layers * 2 * 0.5 * (2 * q + kv) * w and a2a.calls == m * layers * 8
    assert "context_communication" in dict(ulysses.time.terms) and "context_communication" not in dict(one.time.terms)


@pytest.mark.parametrize("model, backend, said", [
    ("linear", "native", "Linear has no configure_context_parallel(ctx) and is no transformers model"),
    ("linear", "deepspeed", "Linear has no configure_context_parallel(ctx) and is no transformers model"),
    ("gpt", "accelerate", "Accelerate's Accelerator takes no custom process groups"),
])
def test_initialize_refuses_what_cannot_train_a_context_axis_before_any_group(monkeypatch, capsys, model, backend,
                                                                              said):
    import torch

    import plugin
    from plugin.errors import RecipeError
    from plugin.models.gpt import GPT, GPTConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    recipe = _recipe({"data": 2, "context": 2}, cluster={"nodes": 1, "gpus_per_node": 4, "gpu_memory_gb": 4})
    module = torch.nn.Linear(2, 2) if model == "linear" else GPT(GPTConfig.from_recipe_model(recipe.model))
    with pytest.raises(RecipeError):
        plugin.initialize(module, recipe, backend=backend)
    assert said in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_a_transformers_family_the_context_attention_cannot_reproduce_is_refused_by_name():
    """Gemma2's attention soft-caps its scores (an argument the context attention would drop): under context
    parallelism it would train its local chunks without an error; refused before any group, naming the families."""
    import pytest

    pytest.importorskip("transformers")
    import torch
    import transformers as tf

    from plugin.context_parallel.errors import ContextParallelError
    from plugin.context_parallel.hf import configure_hf
    from tests.hf_families import tiny_config

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tiny_config("gemma2"))
    with pytest.raises(ContextParallelError, match=r"\(gemma2\) under context parallelism is not supported.*llama"):
        configure_hf(model, None)
