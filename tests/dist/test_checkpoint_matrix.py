"""Checkpoints that move between layouts and back ends (issue 13): one 4-rank spawn trains every shipped 4-rank
``cpu_*`` recipe on DeepSpeed and on the native back end (:data:`RING`), and one process the reference, each engine
saving and loading several checkpoints. This is the parity suites' save/resume half, folded into one spawn.

For each (recipe, back end) X (in ring order), in one engine that keeps training: steps 1-4 (parity with one process),
save ckpt[X]@4, steps 5-8 (the uninterrupted X run), load ckpt[X]@4 and redo 5-8 (same layout: bit-identical), load
ckpt[single]@4 and run 5-8 (single -> X), load the previous recipe's ckpt@4 and run 5-8 (a cross pair). One process
then loads every ckpt[X]@4 into cpu_single and runs 5-8 (X -> single). Every loss is compared with an
uninterrupted 8-step one-process run: rel 1e-5 where the layout itself reaches it, the parity suites' 1e-4 for pairs
through tensor parallelism (native tp2 without any checkpoint is already ~2e-5 off one process); the figure of every
pair is printed. Every load goes into an engine that has trained (in-place views of DDP buckets, FSDP2 shards).

The same spawns carry the reference GPT with its head tied to the embedding (:data:`TIED`: pp2 x dp2 on each back
end, the tie across the two stages): one process trains the tied model and saves it at step 4; each tied X saves
at 4, resumes (same layout: bit-identical), loads the one-process checkpoint and the other back end's, and is built
once more on meta (its first steps equal the eager build's, bitwise); one process loads each tied X's checkpoint
and exports it. The tie is stored once, under its canonical name ``embed.weight`` (the manifest records
``head.weight`` as its alias), within fp32 rel 1e-5 of the one-process model's at step 4.
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
# The tied GPT (embedding = head) cut into two stages: the tie crosses the stages (one copy on each), on both back
# ends; each loads the previous one's checkpoint (native -> DeepSpeed, and DeepSpeed -> native closing the ring).
TIED = [("cpu_pp2_dp2", "native"), ("cpu_pp2_dp2", "deepspeed")]


def _engine(name, world, backend="native", *, tied=False, meta=False):
    import torch

    import plugin
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.recipe.checks import load_recipe

    recipe = load_recipe(name)
    config = GPTConfig.from_recipe_model(recipe.model, tie_embeddings=tied)
    if meta:  # each rank materialises its stage, filled by (seed, name): the eager build's values
        return plugin.initialize(lambda: GPT(config), recipe, backend=backend, seed=0)
    torch.manual_seed(0)
    return plugin.initialize(GPT(config), recipe, backend=backend)


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
    t = _engine("cpu_single", 1, tied=True)
    tied = {"first": _steps(t, 0, 4), "norm@4": _grad_norm(t)}
    t.save(f"{root}/{TIED_SINGLE}")
    tied["embed@4"] = t.module.state_dict()["embed.weight"].detach().clone()
    tied["cont"] = _steps(t, 4, 8)
    out["tied"] = tied
    return out


TIED_SINGLE = "tied-cpu_single"


def _grad_norm(engine) -> float:
    """The last step's global gradient norm (the one clipping used): a tie counted twice would change it, where
    Adam's losses barely move (its update is invariant to a gradient's scale)."""
    if engine.backend == "deepspeed":
        return float(engine.ds.get_global_grad_norm())
    return engine.last_grad_norm


def _label(name, backend, tied=False):
    return f"{'tied-' if tied else ''}{backend}:{name}"


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


def _tied(rank, world, root, tied):
    out = {}
    for i, (name, backend) in enumerate(tied):
        label = _label(name, backend, tied=True)
        e = _engine(name, world, backend, tied=True)
        r = {"first": _steps(e, 0, 4), "norm@4": _grad_norm(e)}
        e.save(f"{root}/{label}")
        r["cont"] = _steps(e, 4, 8)
        assert e.load(f"{root}/{label}")["step"] == 4
        r["again"] = _steps(e, 4, 8)
        e.load(f"{root}/{TIED_SINGLE}")
        r["from_single"] = _steps(e, 4, 8)
        if i:
            e.load(f"{root}/{_label(*tied[i - 1], tied=True)}")
            r["from_prev"] = _steps(e, 4, 8)
        out[label] = r
        r["meta"] = _steps(_engine(name, world, backend, tied=True, meta=True), 0, 2)
    if len(tied) > 1:  # closes the ring: the first loads the last one's checkpoint
        e = _engine(tied[0][0], world, tied[0][1], tied=True)
        e.load(f"{root}/{_label(*tied[-1], tied=True)}")
        out[_label(*tied[0], tied=True)]["from_prev"] = _steps(e, 4, 8)
    return out


def _ring_and_tied(rank, world, root, ring, tied):
    return _ring(rank, world, root, ring), _tied(rank, world, root, tied)


def _export_matches(engine, directory, out, tied=False):
    """The CLI on a checkpoint (inspect, check, export) and the export against the loaded one-process model: the
    reference GPT loads it strictly, and every tensor equals the engine's bit for bit."""
    from safetensors.torch import load_file

    from plugin.checkpoint.export import export
    from plugin.cli.main import main
    from plugin.models.gpt import GPT, GPTConfig

    codes = (main(["checkpoint", "inspect", directory]), main(["checkpoint", "check", directory, "cpu_single"]))
    export(directory, out)
    tensors = load_file(f"{out}/model.safetensors")
    GPT(GPTConfig.from_recipe_model(engine.recipe.model, tie_embeddings=tied)).load_state_dict(tensors, strict=True)
    mine = dict(engine.module.state_dict())
    same = sorted(tensors) == sorted(mine) and all(torch_equal(tensors[n], mine[n]) for n in tensors)
    return {"codes": codes, "same": same}


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _replay(rank, world, root, ring, tied):
    e = _engine("cpu_single", 1)
    out = {}
    for name, backend in ring:
        label = _label(name, backend)
        e.load(f"{root}/{label}")
        out[f"export {label}"] = _export_matches(e, f"{root}/{label}", f"{root}/export-{label}")
        out[label] = _steps(e, 4, 8)
    t = _engine("cpu_single", 1, tied=True)
    out["tied"] = {}
    for name, backend in tied:
        label = _label(name, backend, tied=True)
        t.load(f"{root}/{label}")
        r = {"embed@4": t.module.state_dict()["embed.weight"].detach().clone(),
             "export": _export_matches(t, f"{root}/{label}", f"{root}/export-{label}", tied=True)}
        r["cont"] = _steps(t, 4, 8)
        out["tied"][label] = r
    return out


def _available(layouts):
    return layouts if importable("deepspeed") else [r for r in layouts if r[1] == "native"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    single = spawn.run(_single, 1, root)[0]
    ring, tied = _available(RING), _available(TIED)
    out = spawn.run(_ring_and_tied, 4, root, ring, tied, timeout_s=900)
    replay = spawn.run(_replay, 1, root, ring, tied)[0]
    return {"root": root, "single": single, "ring": [r for r, _ in out], "tied": [t for _, t in out],
            "replay": replay}


@pytest.fixture(scope="module")
def matrix(runs):
    replay = {k: v for k, v in runs["replay"].items() if k != "tied"}
    return runs["single"], runs["ring"], replay


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


def test_tied_across_stages_resumes_and_moves_between_back_ends(runs):
    """pp2 x dp2 with the head tied to the embedding: same-layout resume bitwise on both back ends; a meta build's
    first steps are the eager build's, bitwise; one process -> X within fp32 rel 1e-5 of the uninterrupted
    one-process run. What continues from a pipelined step-4 state (X uninterrupted, X -> the other back end, X -> one
    process) gets 1e-4: those states are as close to one process's as untied ones (embed.weight 4.3e-6 of its largest
    value, untied 2.7e-6), but the tied model amplifies that at step 6 to 4.1e-5 (untied 1.3e-7; steps 5 and 7:
    0 and 6e-7), and one process continuing from X's state gives X's own losses: the state, not the steps after it.
    The step-4 gradient norm (clipping is active: about 2.3 against 1.0) within rel 1e-5 of one process's: the tie
    is counted once."""
    single = runs["single"]["tied"]
    assert len(runs["tied"][0]) == len(_available(TIED))
    for rank, out in enumerate(runs["tied"]):
        for label, r in out.items():
            assert r["again"] == r["cont"], f"rank {rank}: {label} -> {label}"
            assert r["meta"] == r["first"][:2], f"rank {rank}: {label} on meta"
    labels = list(runs["tied"][0])
    for i, label in enumerate(labels):
        r = runs["tied"][0][label]
        figures = {"from one process": (_rel(r["from_single"], single["cont"]), 1e-5),
                   "uninterrupted": (_rel(r["first"] + r["cont"], single["first"] + single["cont"]), 1e-4),
                   "to one process": (_rel(runs["replay"]["tied"][label]["cont"], single["cont"]), 1e-4)}
        if len(labels) > 1:
            figures[f"from {labels[i - 1]}"] = (_rel(r["from_prev"], single["cont"]), 1e-4)
        figures["gradient norm at step 4"] = (abs(r["norm@4"] - single["norm@4"]) / single["norm@4"], 1e-5)
        print(f"{label}: " + ", ".join(f"{k} rel {v:.2e}" for k, (v, _) in figures.items()))
        assert all(v < tol for v, tol in figures.values()), (label, figures)


def test_tied_weight_is_stored_once_under_its_canonical_name(runs):
    from plugin.checkpoint.directory import resolve
    from plugin.checkpoint.manifest import read_manifest

    want = runs["single"]["tied"]["embed@4"]
    for label, r in runs["replay"]["tied"].items():
        manifest = read_manifest(resolve(f"{runs['root']}/{label}"))
        params = {n for n, t in manifest["tensors"].items() if t["role"] == "param"}
        assert "embed.weight" in params and "head.weight" not in params, (label, sorted(params))
        assert manifest["model"]["tied"] == {"head.weight": "embed.weight"}, label
        assert r["export"]["codes"] == (0, 0) and r["export"]["same"], label
        got = r["embed@4"]
        rel = ((got - want).abs().max() / want.abs().max()).item()
        print(f"{label}: embed.weight at step 4 against one process: max abs diff / max abs {rel:.2e}")
        assert got.shape == want.shape and rel < 1e-5, label
