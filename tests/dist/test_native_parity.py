"""The native back end (DDP / ZeroRedundancyOptimizer / FSDP2 / torch.distributed.pipelining) and Accelerate's
own engine compute what one process computes, under ``torchrun`` and under ``accelerate launch``: fp32, per-step
losses and gradient norms within rtol 1e-4 of ``python train.py --recipe cpu_single`` (the losses alone cannot see a
gradient off by a constant factor: clipping and Adam make the same update); a run saved at step 5 and resumed gives
steps 6-10 of the uninterrupted run.

How the launches are spent: a layout runs twice, once per launcher, as the two halves of one save/resume: steps 1-5
and --save under one launcher, --resume and steps 6-10 under the other. So both launchers train it, every step is
compared with the reference, and the checkpoint is resumed by the other launcher's processes. Where ``accelerate
launch`` runs Accelerate's own engine (tensor = pipeline = 1 and ZeRO-0), the checkpoint is Accelerate's: that layout
saves and resumes under accelerate, and torchrun runs it in one go. The numerics of every native layout and schedule
are the spawned engines' (tests/dist/test_native_engine.py) and the checkpoint matrix's; here, the launchers.

Where it runs (marker ``nods``: .ci/run's venv without deepspeed runs what differs there): without deepspeed,
``"auto"`` recipes train on the native back end, so cpu_single itself does, and one layout per family goes through
both launchers: Accelerate's DDP (cpu_dp4 at ZeRO-0), FSDP2 (cpu_zero3_dp4) and tensor x pipeline (cpu_tp2_pp2).
With deepspeed installed (the README's suite): ZeRO-1 under accelerate launch (Accelerate's DeepSpeed plugin)
accumulating 2 micro-batches, and its save/resume (slow); FSDP2's and tensor x pipeline's launches are the nods
step's alone (the same native launches: with deepspeed they only repeated them, forced native by the recipe's
``launcher``).

Also here: Accelerate's bf16 (DDP under autocast), equal to the native back end's bf16 and near fp32 (a measured
tolerance; slow); ``accelerate launch`` where deepspeed is installed but transformers is not (the README's
``.[deepspeed,accelerate]`` install: Accelerate's DeepSpeed plugin imports transformers) training on the native back
end; under torchrun, the refusal of a world that does not fit the recipe; the transformers models (gpt2, llama) at
tp2 x dp2 under torchrun (slow); Accelerate's own engine (DDP) on Hugging Face dict batches (train.py --model llama
--data, the shipped JSONL and tokenizer) against one process.

``PLUGIN_REQUIRE=accelerate`` (:mod:`.needs`) makes a missing accelerate fail the run instead of skipping it.
"""
import importlib.util
import json
import math
import os

import pytest

from .needs import need
from .runs import PARITY_LAYOUTS, ROOT, cpu_env, recipe_variant, train

pytestmark = [pytest.mark.dist, pytest.mark.native]

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
need("accelerate")
STEPS, SAVE_AT, RTOL, TIMEOUT = 10, 5, 1e-4, 300
WITHOUT_DEEPSPEED = "runs in the venv without deepspeed (.ci/run's nods step), where 'auto' trains natively"

ACCUM2 = {"global": 16, "micro": 2}  # data 4 x micro 2 x grad_accum 2: cpu_single's global batch of 16
# Without deepspeed: one layout per family, under both launchers (launchers of the two halves)
WITHOUT_DEEPSPEED_LAYOUTS = {
    "cpu_dp4_zero0": ("accelerate", "accelerate"),  # Accelerate's own engine: its checkpoint is its own
    "cpu_zero3_dp4": ("accelerate", "torchrun"),
    "cpu_tp2_pp2": ("torchrun", "accelerate"),
}
LAYOUTS = {name: PARITY_LAYOUTS[name] for name in ("cpu_dp4_zero0", "cpu_dp4_zero1", "cpu_zero3_dp4", "cpu_tp2_pp2")}
LAYOUTS["cpu_dp4_zero1_accum2"] = ("cpu_dp4", {"batch": ACCUM2})
# Under accelerate launch this one runs Accelerate's own engine (tensor = pipeline = 1, ZeRO-0): torchrun also runs it
# in one go (the native DDP).
ACCELERATE_ENGINE = {"cpu_dp4_zero0"}
# With deepspeed installed: (layout, the recipe's launcher field, launchers of the two halves, or one launcher
# for a single uninterrupted run).
# FSDP2 (cpu_zero3_dp4) under both launchers is the nods step's alone: the same native launches as here, where the
# README suite has FSDP2's numerics in the spawned engine tests and the checkpoint matrix
# cpu_tp2_pp2 (torchrun, then accelerate launch) is the nods step's alone: the same two native launches as here, where
# the README's suite ran them a second time forced native by the recipe's launcher field.
SUBSET_WITH_DEEPSPEED = {
    "cpu_dp4_zero1": ("auto", ("accelerate", "accelerate")),  # Accelerator + its DeepSpeed plugin
    "cpu_dp4_zero1_accum2": ("auto", ("accelerate",)),  # the same, accumulating 2 micro-batches in DeepSpeed
}


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """cpu_single, one plain python process, 10 uninterrupted steps (DeepSpeed's engine where installed)."""
    run = train("cpu_single", 1, tmp_path_factory.mktemp("reference"), launcher="python", steps=STEPS)
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.log()
    assert run.losses[STEPS] < run.losses[1], "the reference must learn something, or parity proves little"
    assert run.backend == ("deepspeed" if HAS_DEEPSPEED else "native"), run.log()
    return run


@pytest.fixture(scope="module")
def reference(single):
    """The one-process run's losses."""
    return single.losses


@pytest.fixture(scope="module")
def reference_norms(single):
    """The one-process run's gradient norms before clipping: the losses alone cannot see a gradient off by a constant
    factor (clipping below the norm and Adam's scale invariance make the same update), the norm can."""
    norms = {r["step"]: r["grad_norm"] for r in single.records}
    assert all(isinstance(n, float) and n > 0 for n in norms.values()), norms
    return norms


def assert_same_losses(run, want: dict, steps, norms: dict | None = None):
    """The run's losses (and, given the reference's ``norms``, its gradient norms) equal the reference's."""
    got_norms = {r["step"]: r["grad_norm"] for r in run.records}
    for step in steps:
        assert step in run.losses, f"step {step} missing\n{run.log()}"
        got = run.losses[step]
        assert math.isclose(got, want[step], rel_tol=RTOL, abs_tol=0), \
            f"step {step}: {got!r} != reference {want[step]!r} (rtol {RTOL})\n{run.log()}"
        if norms is not None:
            assert math.isclose(got_norms[step], norms[step], rel_tol=RTOL, abs_tol=0), \
                f"step {step}: gradient norm {got_norms[step]!r} != reference {norms[step]!r} (rtol {RTOL})"


def expected_backend(name: str, launcher: str) -> str:
    if launcher == "accelerate" and (name in ACCELERATE_ENGINE or
                                     (HAS_DEEPSPEED and name in ("cpu_dp4_zero1", "cpu_dp4_zero1_accum2"))):
        return "accelerate"
    return "native"


def assert_backend(run, name: str, launcher: str) -> None:
    """The back end train.py's summary names, and under Accelerate the note saying which of its modes trains."""
    want = expected_backend(name, launcher)
    assert run.backend == want, run.log()
    if want == "accelerate":
        mode = "DistributedDataParallel" if "zero0" in name else "DeepSpeed plugin"
        assert "note: accelerate launch: ZeRO-" in run.stderr and f"Accelerate's {mode}" in run.stderr, run.log()


def split_run(name, recipe, launchers, reference, tmp_path, norms=None):
    """Steps 1-5 and --save under launchers[0], --resume and steps 6-10 under launchers[1]."""
    ckpt = tmp_path / "ckpt"
    first = train(recipe, 4, tmp_path, launcher=launchers[0], steps=SAVE_AT, extra=["--save", ckpt], timeout=TIMEOUT)
    assert_backend(first, name, launchers[0])
    assert_same_losses(first, reference, range(1, SAVE_AT + 1), norms)
    second = train(recipe, 4, tmp_path, launcher=launchers[1], steps=STEPS, extra=["--resume", ckpt], timeout=TIMEOUT)
    assert_backend(second, name, launchers[1])
    assert sorted(second.losses) == list(range(SAVE_AT + 1, STEPS + 1)), second.log()
    assert_same_losses(second, reference, range(SAVE_AT + 1, STEPS + 1), norms)


def whole_run(name, recipe, launcher, reference, tmp_path, norms=None):
    run = train(recipe, 4, tmp_path, launcher=launcher, steps=STEPS, timeout=TIMEOUT)
    assert_backend(run, name, launcher)
    assert_same_losses(run, reference, range(1, STEPS + 1), norms)


# Accelerate's DeepSpeed plugin: the README's suite runs it accumulating in one launch; its save and resume under
# accelerate launch (two launches) is the slow step's
SLOW = {"cpu_dp4_zero1"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.nods) if n in WITHOUT_DEEPSPEED_LAYOUTS else
                                  pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_layout_matches_single_process_under_both_launchers(name, reference, reference_norms, tmp_path):
    base, blocks = LAYOUTS[name]
    if HAS_DEEPSPEED:
        if name not in SUBSET_WITH_DEEPSPEED:
            pytest.skip(WITHOUT_DEEPSPEED)
        launcher_field, launchers = SUBSET_WITH_DEEPSPEED[name]
        recipe = recipe_variant(base, tmp_path, name, **blocks, launcher=launcher_field)
        if len(launchers) == 1:
            whole_run(name, recipe, launchers[0], reference, tmp_path, reference_norms)
        else:
            split_run(name, recipe, launchers, reference, tmp_path, reference_norms)
        return
    if name not in WITHOUT_DEEPSPEED_LAYOUTS:
        pytest.skip("Accelerate's DeepSpeed plugin needs deepspeed")
    recipe = recipe_variant(base, tmp_path, name, **blocks)
    split_run(name, recipe, WITHOUT_DEEPSPEED_LAYOUTS[name], reference, tmp_path, reference_norms)
    if name in ACCELERATE_ENGINE:
        whole_run(name, recipe, "torchrun", reference, tmp_path, reference_norms)


@pytest.mark.nods
def test_native_single_process_matches_and_resumes(reference, tmp_path):
    """cpu_single on the native back end: DeepSpeed's numbers where it is installed; its own save/resume."""
    recipe = recipe_variant("cpu_single", tmp_path, "cpu_single_native", launcher="torchrun")
    if HAS_DEEPSPEED:
        run = train(recipe, 1, tmp_path, launcher="python", steps=STEPS, timeout=TIMEOUT)
        assert run.backend == "native", run.log()
        assert_same_losses(run, reference, range(1, STEPS + 1))
        return
    ckpt = tmp_path / "ckpt"
    train(recipe, 1, tmp_path, launcher="python", steps=SAVE_AT, extra=["--save", ckpt], timeout=TIMEOUT)
    second = train(recipe, 1, tmp_path, launcher="python", steps=STEPS, extra=["--resume", ckpt], timeout=TIMEOUT)
    assert second.backend == "native", second.log()
    assert_same_losses(second, reference, range(SAVE_AT + 1, STEPS + 1))


BF16_STEPS, BF16_RTOL = 6, 1e-3


@pytest.mark.slow
def test_accelerate_bf16_equals_native_bf16_and_tracks_fp32(reference, tmp_path):
    """cpu_dp4 at ZeRO-0 in bf16: Accelerate's DDP with its CPU bf16 autocast (accelerate launch) against the
    native back end's DDP under torch.autocast (torchrun).

    Measured here: the two bf16 runs are bit-identical over 10 steps (autocast casts the same ops), so they are
    held to the fp32 parity rtol 1e-4. Against the fp32 reference, bf16 deviates by at most 4.6e-4 over steps
    1-6 (5.6e-5 at step 2, 1.9e-4 at step 5), so rtol 1e-3 there; at step 7 the fp32 run spikes (3.84 -> 3.95)
    and the bf16 runs do not (-5.8% apart), so later steps are not compared with fp32. A bf16 that silently
    ran in fp32 would equal the reference to 1e-4 at every step: that is refused too. Forced native by the
    recipe's ``launcher`` under torchrun, Accelerate's DDP under accelerate launch, with or without deepspeed."""
    blocks = dict(zero={"stage": 0}, precision="bf16")
    acc = train(recipe_variant("cpu_dp4", tmp_path, "cpu_dp4_zero0_bf16", **blocks), 4, tmp_path,
                launcher="accelerate", steps=STEPS, timeout=TIMEOUT)
    nat = train(recipe_variant("cpu_dp4", tmp_path, "cpu_dp4_zero0_bf16_native", **blocks, launcher="torchrun"), 4,
                tmp_path, launcher="torchrun", steps=STEPS, timeout=TIMEOUT)
    assert (acc.backend, nat.backend) == ("accelerate", "native"), acc.log() + nat.log()
    assert "ZeRO-0, bf16" in acc.stderr, acc.log()
    assert_same_losses(acc, nat.losses, range(1, STEPS + 1))
    deviation = {s: abs(acc.losses[s] / reference[s] - 1) for s in range(1, BF16_STEPS + 1)}
    assert max(deviation.values()) <= BF16_RTOL, f"bf16 against fp32: {deviation}\n{acc.log()}"
    assert max(deviation.values()) > RTOL, f"bf16 equals fp32 to {RTOL}: mixed precision is off\n{acc.log()}"
    assert acc.losses[STEPS] < acc.losses[1], acc.log()


def test_accelerate_launch_without_transformers_trains_native(reference, tmp_path):
    """deepspeed installed, transformers not (the README's `pip install '.[deepspeed,accelerate]'`): ZeRO-1 under
    accelerate launch must not pick Accelerate's DeepSpeed plugin, which imports transformers and crashed there.
    transformers is hidden from the launched processes by a sitecustomize (``sys.modules["transformers"] = None``:
    ``find_spec`` answers None and ``import transformers`` fails, as where it is not installed)."""
    if not HAS_DEEPSPEED:
        pytest.skip("only where deepspeed is installed does accelerate launch consider Accelerate's DeepSpeed plugin")
    hide = tmp_path / "hide_transformers"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text('import sys\nsys.modules["transformers"] = None\n')
    env = cpu_env(ACCELERATE_USE_CPU="true", PYTHONPATH=os.pathsep.join(filter(None, [str(hide),
                                                                                       os.environ.get("PYTHONPATH")])))
    run = train("cpu_dp4", 4, tmp_path, launcher="accelerate", steps=3, timeout=TIMEOUT, env=env)
    assert run.backend == "native", run.log()
    assert "note: accelerate launch: the native back end trains (ZeRO-1 (transformers is not installed" \
        in run.stderr, run.log()
    assert_same_losses(run, reference, range(1, 4))


def test_world_size_mismatch_is_refused_under_torchrun(tmp_path):
    """As the DeepSpeed suite's test, under torchrun: rank 0 alone prints the problem, and the launch fails.
    torchrun stops the other ranks once one fails, so it cannot show that each rank exits by itself: the
    hand-started test below does."""
    run = train("cpu_dp4", 2, tmp_path, launcher="torchrun", steps=1, expect_ok=False, timeout=90)
    assert run.returncode != 0, run.log()
    text = run.stdout + run.stderr
    assert text.count("but the launcher runs 2") == 1, "rank 0 alone prints the problem, once\n" + run.log()
    assert "launch 4 processes" in text, run.log()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_transformers_models_match_single_process_under_torchrun(model, tmp_path):
    """train.py --model gpt2/llama on the native back end (forced by the recipes' launcher field): transformers models
    sharded by their auto plan, tp2 x dp2."""
    need("transformers")
    single = recipe_variant("cpu_single", tmp_path, "cpu_single_native", launcher="torchrun")
    layout = recipe_variant("cpu_tp2_dp2", tmp_path, "cpu_tp2_dp2_native", launcher="torchrun")
    ref = train(single, 1, tmp_path, launcher="python", steps=4, extra=["--model", model], timeout=TIMEOUT)
    got = train(layout, 4, tmp_path, launcher="torchrun", steps=4, extra=["--model", model], timeout=TIMEOUT)
    assert ref.backend == got.backend == "native", got.log()
    assert_same_losses(got, ref.losses, range(1, 5))
    assert ref.losses[4] < ref.losses[1], ref.log()


def test_accelerate_engine_trains_hf_dict_batches_as_one_process(tmp_path):
    """Accelerate's own engine (DDP, ZeRO-0) on Hugging Face dict batches: train.py --model llama on the shipped JSONL
    through the shipped tokenizer (``{"input_ids", "labels"}`` dicts, labels shifted inside the token-weighted loss),
    accumulating 2 micro-batches per data rank, gives one process's losses; in both venvs (with deepspeed installed,
    ZeRO-0 under accelerate launch is still Accelerate's DDP)."""
    need("transformers")
    need("datasets")
    from plugin.recipe.load import find_recipe

    data = ROOT / "tests" / "data"
    extra = ["--model", "llama", "--data", data / "corpus" / "stdlib_docs.jsonl", "--tokenizer", data / "tokenizer"]
    model = {**json.loads(find_recipe("cpu_single").read_text())["model"], "vocab": 512}  # the tokenizer's 512
    single = recipe_variant("cpu_single", tmp_path, "cpu_single_hf", model=model, launcher="torchrun")
    name = "cpu_dp4_zero0_hf"
    recipe = recipe_variant("cpu_dp4", tmp_path, name, model=model, zero={"stage": 0}, batch=ACCUM2)
    ref = train(single, 1, tmp_path, launcher="python", steps=4, extra=extra, timeout=TIMEOUT)
    got = train(recipe, 4, tmp_path, launcher="accelerate", steps=4, extra=extra, timeout=TIMEOUT)
    assert got.backend == "accelerate" and "Accelerate's DistributedDataParallel" in got.stderr, got.log()
    assert_same_losses(got, ref.losses, range(1, 5))
    assert ref.losses[4] < ref.losses[1], ref.log()
