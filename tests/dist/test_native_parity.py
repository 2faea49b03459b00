"""The native back end (DDP / ZeroRedundancyOptimizer / FSDP2 / torch.distributed.pipelining) and Accelerate's
own engine compute what one process computes, under ``torchrun`` and under ``accelerate launch``: every
layout of the DeepSpeed parity suite plus the schedules only the native back end runs (GPipe, interleaved
1F1B); fp32, per-step losses within rtol 1e-4 of ``python train.py --recipe cpu_single``; a run saved at step
5 and resumed gives steps 6-10 of the uninterrupted run.

How the launches are spent (the suite must fit in about 6 minutes on 2 cores): each layout runs twice, once
per launcher, as the two halves of one save/resume: steps 1-5 and --save under one launcher, --resume and
steps 6-10 under the other, alternating which launcher goes first from layout to layout. So both launchers
train every layout, every step of every layout is compared with the reference, and every checkpoint is
resumed by the other launcher's processes (a native checkpoint does not depend on the launcher). Where
``accelerate launch`` runs Accelerate's own engine (tensor = pipeline = 1 and ZeRO-0 without deepspeed), the
checkpoint is Accelerate's: that layout saves and resumes under accelerate, and torchrun runs it in one go.

Where it runs: all of it in an environment without deepspeed (``.ci/run`` builds one), where cpu_single itself
trains on the native back end. With deepspeed installed, "auto" recipes would train on DeepSpeed, so only a
representative subset runs, forced native by the recipe's ``launcher`` field (about 1.5 minutes): the native
cpu_single against DeepSpeed's own; tp2 x pp2 (1F1B with tensor parallelism) and ZeRO-3 (FSDP2), split over
the two launchers; ZeRO-1 under accelerate launch (Accelerate's DeepSpeed plugin) with its save/resume.
The other layouts are skipped with that reason.
"""
import importlib.util
import math

import pytest

from .runs import PARITY_LAYOUTS, recipe_variant, train

pytestmark = [pytest.mark.dist, pytest.mark.native]

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
pytest.importorskip("accelerate")
STEPS, SAVE_AT, RTOL, TIMEOUT = 10, 5, 1e-4, 300
FULL_SUITE = "the full native suite runs where deepspeed is not installed (.ci/run's second venv)"

PP_GPIPE = {"schedule": "gpipe", "partition": "uniform"}
PP_INTERLEAVED = {"schedule": "interleaved_1f1b", "virtual_stages": 2, "partition": "uniform"}
LAYOUTS = {**PARITY_LAYOUTS,  # the DeepSpeed suite's layouts, then native-only schedules
           "cpu_pp2_dp2_gpipe": ("cpu_pp2_dp2", {"pipeline_parallel": PP_GPIPE}),
           "cpu_tp2_pp2_interleaved": ("cpu_tp2_pp2", {"pipeline_parallel": PP_INTERLEAVED})}
# Under accelerate launch these run Accelerate's own engine (tensor = pipeline = 1, ZeRO-0, no deepspeed).
ACCELERATE_ENGINE = {"cpu_dp4_zero0"}
# With deepspeed installed: (layout, the recipe's launcher field, launchers of the two halves).
SUBSET_WITH_DEEPSPEED = {
    "cpu_tp2_pp2": ("torchrun", ("torchrun", "accelerate")),
    "cpu_zero3_dp4": ("torchrun", ("accelerate", "torchrun")),
    "cpu_dp4_zero1": ("auto", ("accelerate", "accelerate")),  # Accelerator + its DeepSpeed plugin
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """cpu_single, one plain python process, 10 uninterrupted steps (DeepSpeed's engine where installed)."""
    run = train("cpu_single", 1, tmp_path_factory.mktemp("reference"), launcher="python", steps=STEPS)
    assert sorted(run.losses) == list(range(1, STEPS + 1)), run.log()
    assert run.losses[STEPS] < run.losses[1], "the reference must learn something, or parity proves little"
    assert run.backend == ("deepspeed" if HAS_DEEPSPEED else "native"), run.log()
    return run.losses


def assert_same_losses(run, want: dict, steps):
    for step in steps:
        assert step in run.losses, f"step {step} missing\n{run.log()}"
        got = run.losses[step]
        assert math.isclose(got, want[step], rel_tol=RTOL, abs_tol=0), \
            f"step {step}: {got!r} != reference {want[step]!r} (rtol {RTOL})\n{run.log()}"


def expected_backend(name: str, launcher: str) -> str:
    if launcher == "accelerate" and (name in ACCELERATE_ENGINE or (HAS_DEEPSPEED and name == "cpu_dp4_zero1")):
        return "accelerate"
    return "native"


def split_run(name, recipe, launchers, reference, tmp_path):
    """Steps 1-5 and --save under launchers[0], --resume and steps 6-10 under launchers[1]."""
    ckpt = tmp_path / "ckpt"
    first = train(recipe, 4, tmp_path, launcher=launchers[0], steps=SAVE_AT, extra=["--save", ckpt], timeout=TIMEOUT)
    assert first.backend == expected_backend(name, launchers[0]), first.log()
    assert_same_losses(first, reference, range(1, SAVE_AT + 1))
    second = train(recipe, 4, tmp_path, launcher=launchers[1], steps=STEPS, extra=["--resume", ckpt], timeout=TIMEOUT)
    assert second.backend == expected_backend(name, launchers[1]), second.log()
    assert sorted(second.losses) == list(range(SAVE_AT + 1, STEPS + 1)), second.log()
    assert_same_losses(second, reference, range(SAVE_AT + 1, STEPS + 1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process_under_both_launchers(name, reference, tmp_path):
    base, blocks = LAYOUTS[name]
    if HAS_DEEPSPEED:
        if name not in SUBSET_WITH_DEEPSPEED:
            pytest.skip(FULL_SUITE)
        launcher_field, launchers = SUBSET_WITH_DEEPSPEED[name]
        split_run(name, recipe_variant(base, tmp_path, name, **blocks, launcher=launcher_field), launchers,
                  reference, tmp_path)
        return
    recipe = recipe_variant(base, tmp_path, name, **blocks)
    if name in ACCELERATE_ENGINE:  # Accelerate's checkpoint is its own: save/resume under accelerate
        split_run(name, recipe, ("accelerate", "accelerate"), reference, tmp_path)
        whole = train(recipe, 4, tmp_path, launcher="torchrun", steps=STEPS, timeout=TIMEOUT)
        assert whole.backend == "native", whole.log()
        assert_same_losses(whole, reference, range(1, STEPS + 1))
        return
    order = ("torchrun", "accelerate") if list(LAYOUTS).index(name) % 2 == 0 else ("accelerate", "torchrun")
    split_run(name, recipe, order, reference, tmp_path)


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
