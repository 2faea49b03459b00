"""Checkpoints that move between layouts and back ends (issue 13): one 4-rank spawn trains every shipped 4-rank
``cpu_*`` recipe on DeepSpeed and on the native back end (:data:`RING`), and one process the reference, each engine
saving and loading several checkpoints. This is the parity suites' save/resume half, folded into one spawn.

For each (recipe, back end) X (in ring order), in one engine that keeps training: steps 1-4 (parity with one process), save
ckpt[X]@4, steps 5-8 (the uninterrupted X run), load ckpt[X]@4 and redo 5-8 (same layout: bit-identical), load
ckpt[single]@4 and run 5-8 (single -> X), load the previous recipe's ckpt@4 and run 5-8 (a cross pair). One process
then loads every ckpt[X]@4 into cpu_single and runs 5-8 (X -> single). Every loss is compared with an
uninterrupted 8-step one-process run: rel 1e-5 where the layout itself reaches it, the parity suites' 1e-4 for pairs
through tensor parallelism (native tp2 without any checkpoint is already ~2e-5 off one process); the figure of every
pair is printed. Every load goes into an engine that has trained (in-place views of DDP buckets, FSDP2 shards).
"""
from __future__ import annotations

import pytest

from plugin.engines.choose import importable

from . import spawn

pytestmark = [pytest.mark.dist, pytest.mark.native]  # without deepspeed: the native half of the ring

# (recipe, back end) in ring order: each loads the previous one's step-4 checkpoint, so the arrows give DeepSpeed ->
# native and native -> DeepSpeed at every step, tensor -> pipeline (tp2_dp2 -> pp2_dp2), ZeRO-3 <-> pipelines.
RING = [("cpu_tp2_dp2", "deepspeed"), ("cpu_pp2_dp2", "native"), ("cpu_zero3_dp4", "deepspeed"),
        ("cpu_tp2_pp2", "native"), ("cpu_dp4", "deepspeed"), ("cpu_zero3_dp4", "native"),
        ("cpu_pp2_dp2", "deepspeed"), ("cpu_tp2_dp2", "native"), ("cpu_tp2_pp2", "deepspeed"), ("cpu_dp4", "native"),
        ("cpu_tp2_sp_pp2", "deepspeed"), ("cpu_tp2_sp_pp2", "native")]
TP = {"cpu_tp2_dp2", "cpu_tp2_pp2", "cpu_tp2_sp_pp2"}


def _engine(name, world, backend="native"):
    import torch

    import plugin
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe

    recipe = load_recipe(name)
    torch.manual_seed(0)
    return plugin.initialize(GPT(GPTConfig.from_recipe_model(recipe.model)), recipe, backend=backend)


def _steps(engine, a, b):
    from plugin.data.text import TextBatches

    m = engine.recipe.model
    data = TextBatches(m.vocab, m.seq_len, seed=0)
    return [engine.train_step(data.global_batch(s, engine.layout.global_batch)) for s in range(a, b)]


def _single(rank, world, root):
    e = _engine("cpu_single", 1)
    out = {"first": _steps(e, 0, 4)}
    e.save(f"{root}/cpu_single")
    out["cont"] = _steps(e, 4, 8)
    assert e.load(f"{root}/cpu_single")["step"] == 4
    out["again"] = _steps(e, 4, 8)
    return out


def _label(name, backend):
    return f"{backend}:{name}"


def _ring(rank, world, root, ring):
    out = {}
    for i, (name, backend) in enumerate(ring):
        label = _label(name, backend)
        e = _engine(name, world, backend)
        r = {"first": _steps(e, 0, 4)}
        e.save(f"{root}/{label}", client_state={"data": {"epoch": 0, "steps": 4}})
        r["cont"] = _steps(e, 4, 8)
        r["client"] = e.load(f"{root}/{label}")
        r["again"] = _steps(e, 4, 8)
        e.load(f"{root}/cpu_single")
        r["from_single"] = _steps(e, 4, 8)
        if i:
            e.load(f"{root}/{_label(*ring[i - 1])}")
            r["from_prev"] = _steps(e, 4, 8)
        out[label] = r
    e = _engine(ring[0][0], world, ring[0][1])  # closes the ring: the first loads the last one's checkpoint
    _steps(e, 0, 2)
    e.load(f"{root}/{_label(*ring[-1])}")
    out[_label(*ring[0])]["from_prev"] = _steps(e, 4, 8)
    return out


def _export_matches(engine, directory, out):
    """The CLI on a checkpoint (inspect, check, export) and the export against the loaded one-process model: the
    reference GPT loads it strictly, and every tensor equals the engine's bit for bit."""
    from safetensors.torch import load_file

    from plugin.checkpoint.export import export
    from plugin.cli.main import main
    from plugin.models.gpt import GPT, GPTConfig

    codes = (main(["checkpoint", "inspect", directory]), main(["checkpoint", "check", directory, "cpu_single"]))
    export(directory, out)
    tensors = load_file(f"{out}/model.safetensors")
    GPT(GPTConfig.from_recipe_model(engine.recipe.model)).load_state_dict(tensors, strict=True)
    mine = dict(engine.module.state_dict())
    same = sorted(tensors) == sorted(mine) and all(torch_equal(tensors[n], mine[n]) for n in tensors)
    return {"codes": codes, "same": same}


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _replay(rank, world, root, ring):
    e = _engine("cpu_single", 1)
    out = {}
    for name, backend in ring:
        label = _label(name, backend)
        e.load(f"{root}/{label}")
        out[f"export {label}"] = _export_matches(e, f"{root}/{label}", f"{root}/export-{label}")
        out[label] = _steps(e, 4, 8)
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    single = spawn.run(_single, 1, root)[0]
    ring = RING if importable("deepspeed") else [r for r in RING if r[1] == "native"]
    out = spawn.run(_ring, 4, root, ring, timeout_s=900)
    replay = spawn.run(_replay, 1, root, ring)[0]
    return single, out, replay


def _rel(got, want):
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def _tol(*names):
    return 1e-4 if TP & set(names) else 1e-5


def test_same_layout_resume_is_bit_exact(matrix):
    single, ring, _ = matrix
    assert single["again"] == single["cont"]
    for rank, out in enumerate(ring):
        for name, r in out.items():
            assert r["again"] == r["cont"], f"rank {rank}: {name} -> {name}"
            assert r["client"] == {"step": 4, "data": {"epoch": 0, "steps": 4}}


def test_every_layout_matches_one_process(matrix):
    single, ring, _ = matrix
    want = single["first"] + single["cont"]
    for name, r in ring[0].items():
        rel = _rel(r["first"] + r["cont"], want)
        print(f"uninterrupted {name}: rel {rel:.2e}")
        assert rel < _tol(name.split(":")[1]), name


def test_single_to_every_layout(matrix):
    single, ring, _ = matrix
    for name, r in ring[0].items():
        rel = _rel(r["from_single"], single["cont"])
        print(f"cpu_single -> {name}: rel {rel:.2e}")
        assert rel < _tol(name.split(":")[1]), name


def test_every_layout_to_single(matrix):
    single, _, replay = matrix
    for name, losses in replay.items():
        if name.startswith("export "):
            continue
        rel = _rel(losses, single["cont"])
        print(f"{name} -> cpu_single: rel {rel:.2e}")
        assert rel < _tol(name.split(":")[1]), name


def test_cross_pairs(matrix):
    single, ring, _ = matrix
    labels = list(ring[0])
    for i, label in enumerate(labels):
        prev = labels[i - 1]
        rel = _rel(ring[0][label]["from_prev"], single["cont"])
        print(f"{prev} -> {label}: rel {rel:.2e}")
        assert rel < _tol(prev.split(":")[1], label.split(":")[1]), f"{prev} -> {label}"


def test_cli_and_export_on_every_back_ends_checkpoint(matrix):
    _, _, replay = matrix
    for key, r in replay.items():
        if key.startswith("export "):
            assert r["codes"] == (0, 0), key
            assert r["same"], f"{key}: the export differs from the model that loaded the checkpoint"
