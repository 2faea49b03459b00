"""Which back end trains a recipe (plugin.engines.choose): pure decisions, every branch."""
import pytest

from plugin.engines.choose import ACCELERATE_MARK, accelerate_mode, choose, launched_by_accelerate
from plugin.errors import PluginError
from plugin.recipe.checks import check_deepspeed_back_end, check_native_back_end, check_recipe, load_recipe
from plugin.recipe.spec import Recipe

pytestmark = pytest.mark.nods  # also in the venv without deepspeed: the fallback's choice of engine

ACCELERATE = {ACCELERATE_MARK: "no"}


def recipe(name="cpu_dp4", **blocks):
    data = load_recipe(name).to_dict()
    for key, value in blocks.items():
        data[key] = value if not isinstance(value, dict) else {**data.get(key, {}), **value}
    return Recipe.from_dict(data)


def test_accelerate_launch_is_recognised_by_what_every_accelerate_launcher_exports():
    assert launched_by_accelerate({ACCELERATE_MARK: "bf16"})
    assert not launched_by_accelerate({"ACCELERATE_USE_CPU": "true"}), "users export that one themselves"


@pytest.mark.parametrize("has_ds", [True, False])
def test_torchrun_and_plain_python(has_ds):
    assert choose(recipe(), environ={}, has_deepspeed=has_ds, cuda=False) == ("deepspeed" if has_ds else "native")
    assert choose(recipe(launcher="torchrun"), environ={}, has_deepspeed=has_ds, cuda=False) == "native"
    gpipe = recipe("cpu_pp2_dp2", pipeline_parallel={"schedule": "gpipe"})
    assert choose(gpipe, environ={}, has_deepspeed=has_ds, cuda=False) == "native"


def test_under_accelerate_launch():
    for stage, has_ds, want in [(0, False, "accelerate"), (0, True, "accelerate"), (1, True, "accelerate"),
                                (1, False, "native"), (3, False, "native"), (3, True, "accelerate")]:
        r = recipe(zero={"stage": stage})
        assert choose(r, environ=ACCELERATE, has_deepspeed=has_ds, cuda=False) == want, (stage, has_ds)
    assert choose(recipe("cpu_tp2_dp2"), environ=ACCELERATE, has_deepspeed=True, cuda=False) == "native"
    assert choose(recipe(launcher="torchrun"), environ=ACCELERATE, has_deepspeed=True, cuda=False) == "native"
    assert choose(recipe(launcher="deepspeed"), environ=ACCELERATE, has_deepspeed=True, cuda=False) == "deepspeed"


def test_what_accelerate_carries():
    def mode_of(r, cuda, has_ds, has_tf=True):
        return accelerate_mode(r, cuda=cuda, has_deepspeed=has_ds, has_transformers=has_tf)

    assert mode_of(recipe(zero={"stage": 0}), False, False)[0] == "ddp"
    assert mode_of(recipe(zero={"stage": 2}), True, False)[0] == "fsdp"
    assert mode_of(recipe(zero={"stage": 2}), True, True)[0] == "deepspeed"
    mode, why = mode_of(recipe(zero={"stage": 0}, precision="fp16"), False, True)
    assert mode is None and "silently" in why
    mode, why = mode_of(recipe(zero={"stage": 1}), True, False)
    assert mode is None and "ZeroRedundancyOptimizer" in why


@pytest.mark.parametrize("stage, cuda, want", [(1, False, None), (1, True, None), (2, False, None),
                                               (3, False, None), (2, True, "fsdp"), (3, True, "fsdp")])
def test_deepspeed_plugin_is_not_chosen_without_transformers(stage, cuda, want):
    """Accelerate's DeepSpeedPlugin imports transformers: without it, ZeRO >= 1 goes as without deepspeed."""
    mode, why = accelerate_mode(recipe(zero={"stage": stage}), cuda=cuda, has_deepspeed=True, has_transformers=False)
    assert mode == want, why
    assert "transformers is not installed, and Accelerate's DeepSpeed plugin imports it" in why
    assert accelerate_mode(recipe(zero={"stage": 0}), cuda=cuda, has_deepspeed=True,
                           has_transformers=False)[0] == "ddp", "ZeRO-0 is Accelerate's DDP: no transformers needed"


def test_accelerate_launch_without_transformers_trains_native():
    """The README's `pip install '.[deepspeed,accelerate]'` has no transformers: cpu_dp4 under accelerate launch."""
    for stage in (1, 2, 3):
        r = recipe(zero={"stage": stage})
        assert choose(r, environ=ACCELERATE, has_deepspeed=True, has_transformers=False, cuda=False) == "native"
        assert choose(r, environ=ACCELERATE, has_deepspeed=True, has_transformers=True, cuda=False) == "accelerate"
        assert choose(r, environ={}, has_deepspeed=True, has_transformers=False, cuda=False) == "deepspeed", \
            "the plugin's own DeepSpeed engine needs no transformers"


def test_the_native_back_end_says_why_under_accelerate_launch(monkeypatch):
    from plugin.engines.native import common
    from plugin.engines.native.common import why_not_accelerate

    monkeypatch.setattr(common, "importable", lambda name: name == "deepspeed")  # no transformers
    note = why_not_accelerate(recipe(), ACCELERATE, cuda=False)
    assert note and "note: accelerate launch: the native back end trains" in note
    assert "transformers is not installed" in note
    assert why_not_accelerate(recipe(), {}, cuda=False) is None, "not under accelerate launch"
    assert why_not_accelerate(recipe(zero={"stage": 0}), ACCELERATE, cuda=False) is None, "Accelerate carries it"
    assert why_not_accelerate(recipe(launcher="torchrun"), ACCELERATE, cuda=False) is None, "the recipe chose"


def test_launcher_deepspeed_without_deepspeed_says_what_to_do():
    with pytest.raises(PluginError, match="pip install deepspeed"):
        choose(recipe(launcher="deepspeed"), environ={}, has_deepspeed=False, cuda=False)


def test_what_the_native_back_end_refuses():
    nvme = recipe("cpu_zero3_dp4", zero={"offload_param": "nvme", "nvme_path": "/nvme"})
    assert [p.path for p in check_native_back_end(nvme, chosen=True)] == ["$.zero"]
    stage1 = recipe(zero={"stage": 1, "offload_optimizer": "cpu"})
    assert [p.path for p in check_native_back_end(stage1, chosen=True)] == ["$.zero.offload_optimizer"]
    assert not list(check_native_back_end(recipe("cpu_zero3_dp4", zero={"offload_param": "cpu"}), chosen=True))


def test_deepspeed_refuses_bf16_sums_at_zero0_only_where_gradients_are_summed():
    def refused(r, **kwargs):
        return [p.path for p in check_deepspeed_back_end(r, r.layout(), **kwargs)]

    bf16 = recipe(zero={"stage": 0}, precision="bf16")  # 4 data ranks
    assert refused(bf16, chosen=True) == ["$.zero.stage"]
    assert not refused(bf16), '"launcher": "auto": refused only once DeepSpeed is chosen'
    assert [p.path for p in check_recipe(recipe(zero={"stage": 0}, precision="bf16", launcher="deepspeed"))
            if p.is_error] == ["$.zero.stage"]
    accumulates = recipe("cpu_single", zero={"stage": 0}, precision="bf16")  # 1 rank, 4 micro-batches
    assert refused(accumulates, chosen=True) == ["$.zero.stage"]
    one = recipe("cpu_single", zero={"stage": 0}, precision="bf16", batch={"global": 4, "micro": 4})
    assert not refused(one, chosen=True), "one micro-batch on one rank: nothing is summed"
    assert not refused(recipe(precision="bf16"), chosen=True), "ZeRO-1 sums in fp32"
    assert not refused(recipe("cpu_pp2_dp2", precision="bf16", zero={"stage": 0}), chosen=True), \
        "the pipeline engine's BF16_Optimizer sums in fp32"
    assert not refused(recipe(zero={"stage": 0}), chosen=True)


def test_interleaved_rounds_must_be_equal():
    r = recipe("cpu_tp2_pp2", pipeline_parallel={"schedule": "interleaved_1f1b", "virtual_stages": 2},
               batch={"global": 20, "micro": 4})  # 5 micro-batches over 2 stages: rounds of 2 and 3
    problems = [p for p in check_recipe(r) if p.path == "$.batch.grad_accum" and p.is_error]
    assert problems and "4 or 6" in problems[0].hint
    ok = recipe("cpu_tp2_pp2", pipeline_parallel={"schedule": "interleaved_1f1b", "virtual_stages": 2})
    assert not [p for p in check_recipe(ok) if p.is_error]


def test_an_auto_recipe_whose_moe_layers_only_the_native_back_end_trains_goes_there():
    from plugin.engines.choose import native_only

    moe = {"experts": 4, "top_k": 2, "every": 2}
    ep2 = recipe(zero={"stage": 0}, parallelism={"expert": 2}, model={"moe": moe})
    one = recipe("cpu_single", model={"moe": moe})  # one data rank: the balance is the process's own
    sigmoid = recipe("cpu_single", model={"moe": {**moe, "router": "sigmoid"}})
    assert "more than one data rank" in native_only(ep2) and native_only(one) is None and native_only(recipe()) is None
    assert "sigmoid" in native_only(sigmoid)
    for env in ({}, ACCELERATE):
        assert choose(ep2, environ=env, has_deepspeed=True, cuda=False) == "native"
        assert choose(one, environ=env, has_deepspeed=True, cuda=False) != "native"
    # the recipe's own word stands: DeepSpeed then refuses it by name (plugin.expert_parallel.checks)
    assert choose(recipe(zero={"stage": 0}, parallelism={"expert": 2}, model={"moe": moe}, launcher="deepspeed"),
                  environ={}, has_deepspeed=True, cuda=False) == "deepspeed"
