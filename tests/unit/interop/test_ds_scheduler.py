"""lr_schedule <-> DeepSpeed's scheduler block: the export, what differs (checked against DeepSpeed's own classes),
import, and the engine config that drops the block (the plugin's LambdaLR sets the lr)."""
import pytest

from plugin.interop.deepspeed_config import from_ds_config, to_ds_config
from plugin.interop.deepspeed_scheduler import from_ds_scheduler, scheduler_differences, to_ds_scheduler
from plugin.recipe.checks import load_recipe
from plugin.recipe.lr_schedule import lr_at
from plugin.recipe.spec import Recipe

BASE = load_recipe("cpu_single").to_dict()
SCHEDULES = [{"warmup_steps": 4, "decay": "cosine", "decay_steps": 10, "min_lr": 0.0003},
             {"warmup_steps": 4, "decay": "linear", "decay_steps": 10},
             {"warmup_steps": 4, "decay": "linear", "decay_steps": 10, "min_lr": 0.0003},
             {"warmup_steps": 5}, {"decay": "cosine", "decay_steps": 10}]


def _recipe(schedule):
    return Recipe.from_dict({**BASE, "lr_schedule": schedule})


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_export_then_import_gives_the_schedule_back(schedule):
    recipe = _recipe(schedule)
    cfg = to_ds_config(recipe, 1)
    assert cfg["scheduler"]["params"]["warmup_type"] == "linear"
    back = from_ds_config(cfg, 1)
    want = {"decay": "constant", **schedule} if "decay" not in schedule else dict(schedule)
    if want.get("decay") != "constant":
        want.setdefault("min_lr", 0.0)
    assert back["lr_schedule"] == want and back["optimizer"]["lr"] == recipe.optimizer.lr
    assert "deepspeed" not in back or "scheduler" not in back["deepspeed"]
    assert to_ds_config(Recipe.from_dict({**back, "name": recipe.name}), 1)["scheduler"] == cfg["scheduler"]


def test_no_schedule_or_a_constant_lr_exports_no_block():
    assert "scheduler" not in to_ds_config(load_recipe("cpu_single"), 1)
    assert to_ds_scheduler(_recipe({"decay": "constant"})) is None


def test_blocks_that_are_not_the_recipes_stay_raw():
    log_warmup = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}  # DeepSpeed's default warmup is logarithmic
    assert from_ds_scheduler(log_warmup, 1e-3) == (None, None)
    assert from_ds_scheduler({"type": "OneCycle", "params": {"cycle_min_lr": 0}}, 1e-3) == (None, None)
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "scheduler": log_warmup}
    recipe = from_ds_config(cfg, 1)
    assert "lr_schedule" not in recipe and recipe["deepspeed"]["scheduler"] == log_warmup
    # a WarmupLR with its own peak: the recipe's lr becomes DeepSpeed's warmup_max_lr
    peak = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 7, "warmup_type": "linear"}}
    recipe = from_ds_config({**cfg, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": peak}, 1)
    assert recipe["lr_schedule"] == {"warmup_steps": 7, "decay": "constant"} and recipe["optimizer"]["lr"] == 0.01


@pytest.mark.parametrize("schedule", SCHEDULES[:4])
def test_what_the_warnings_say_is_what_deepspeeds_classes_do(schedule):
    """DeepSpeed's class for the exported block, stepped as its engine steps it (built at index -1, stepped after each
    update): the lr of update s against the recipe's."""
    torch = pytest.importorskip("torch")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    recipe = _recipe(schedule)
    block, s, lr = to_ds_scheduler(recipe), recipe.lr_schedule, recipe.optimizer.lr
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = getattr(lr_schedules, block["type"])(opt, **block["params"])
    theirs = {}
    for step in range(1, 16):
        theirs[step] = opt.param_groups[0]["lr"]
        scheduler.step()
    ours = {step: lr_at(s, lr, step) for step in theirs}
    start = s.min_lr if s.decay == "linear" else 0.0
    assert theirs[1] == theirs[2] == pytest.approx(start)  # "trains at lr {start} on steps 1 and 2"
    for step in range(3, s.warmup_steps + 2):  # "its warmup runs two steps behind": from lr 0 (min_lr for linear)
        assert theirs[step] == pytest.approx(start + (lr - start) * (step - 2) / s.warmup_steps)
    late = {"linear": 2, "cosine": 1}.get(s.decay)
    if late:  # "runs 2 steps late", "1 step late": the decay part shifted
        for step in range(s.warmup_steps + 3, 16):
            assert theirs[step] == pytest.approx(ours[step - late], abs=1e-12), (step, theirs, ours)
    words = " ".join(p.message for p in scheduler_differences(recipe))
    assert f"trains at lr {start:g} on steps 1 and 2" in words
    assert {"linear": "2 steps late", "cosine": "1 step late"}.get(s.decay, "") in words


def test_the_engine_config_drops_the_block_and_says_so():
    from plugin.engines.deepspeed.config import ENGINE_ADJUSTED_KEYS, engine_config

    recipe = _recipe(SCHEDULES[0])
    assert "scheduler" in to_ds_config(recipe, 1) and "scheduler" not in engine_config(recipe, 1,
                                                                                       use_ds_optimizer=False)
    assert "scheduler" in ENGINE_ADJUSTED_KEYS
    raw = Recipe.from_dict({**BASE, "deepspeed": {"scheduler": {"type": "WarmupLR", "params": {}}}})
    assert engine_config(raw, 1, use_ds_optimizer=False)["scheduler"] == {"type": "WarmupLR", "params": {}}
