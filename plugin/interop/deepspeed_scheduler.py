"""The recipe's ``lr_schedule`` <-> DeepSpeed's nearest ``scheduler`` block (pure: no deepspeed import).

The plugin applies the recipe's schedule itself on every back end (:mod:`plugin.engines.lr_schedule`), DeepSpeed's
included: the engine drops this block from the config it runs. The block is for a DeepSpeed script of your own that
reads the exported config, and it is DeepSpeed's nearest, not the same:

* ``constant`` with a warmup: ``WarmupLR``; ``linear``: ``WarmupDecayLR``; ``cosine``: ``WarmupCosineLR``, each with
  ``"warmup_type": "linear"`` (DeepSpeed's default warms up logarithmically).
* DeepSpeed builds its scheduler at index -1 and steps it after each update (``engine._take_model_step``), so its
  update ``s`` uses index ``s - 2``: it trains at 0 on steps 1 and 2 and reaches the peak two steps after the recipe;
  ``WarmupDecayLR``'s linear decay also ends two steps late, ``WarmupCosineLR``'s cosine one step late (its progress
  counts from index ``W - 1``), never exactly at the peak (measured against DeepSpeed 0.19.8's classes, the test pins
  it); ``warmup_num_steps`` is at least 2 there (``max(2, W)``) and at least 1 in the config, so a recipe without
  warmup exports 1 (DeepSpeed then warms up over 2 steps).
* ``WarmupDecayLR`` warms up from ``warmup_min_lr`` and decays to the same value: the export writes the recipe's
  ``min_lr`` there, so with ``min_lr`` > 0 DeepSpeed's warmup starts at ``min_lr``, not at 0. ``WarmupCosineLR`` says
  both ends as ratios of the optimizer's lr (``warmup_min_ratio`` 0, ``cos_min_ratio`` = ``min_lr / lr``).

:func:`to_ds_scheduler` writes the block and :func:`scheduler_differences` says what differs in words (``export``
prints them as warnings); :func:`from_ds_scheduler` reads those three blocks back (``import``), linear warmups only;
anything else stays a raw ``deepspeed.scheduler``, which only the DeepSpeed back end runs.
"""
from __future__ import annotations

from collections.abc import Mapping

from ..errors import WARNING, Problem


def _warmup(schedule) -> int:
    return max(1, schedule.warmup_steps)  # DeepSpeed refuses warmup_num_steps <= 0


def to_ds_scheduler(recipe) -> dict | None:
    """DeepSpeed's nearest ``scheduler`` block for the recipe's ``lr_schedule`` (None: none, or a constant lr)."""
    s, lr = recipe.lr_schedule, recipe.optimizer.lr
    if s is None or (s.decay == "constant" and s.warmup_steps == 0):
        return None
    if s.decay == "constant":
        return {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": lr,
                                               "warmup_num_steps": _warmup(s), "warmup_type": "linear"}}
    if s.decay == "linear":
        return {"type": "WarmupDecayLR", "params": {"total_num_steps": s.decay_steps, "warmup_min_lr": s.min_lr,
                                                    "warmup_max_lr": lr, "warmup_num_steps": _warmup(s),
                                                    "warmup_type": "linear"}}
    return {"type": "WarmupCosineLR", "params": {"total_num_steps": s.decay_steps, "warmup_min_ratio": 0.0,
                                                 "warmup_num_steps": _warmup(s), "cos_min_ratio": s.min_lr / lr,
                                                 "warmup_type": "linear"}}


def scheduler_differences(recipe) -> list[Problem]:
    """How DeepSpeed's block from :func:`to_ds_scheduler` differs from the recipe's schedule, one warning each."""
    block = to_ds_scheduler(recipe)
    if block is None:
        return []
    s, lr = recipe.lr_schedule, recipe.optimizer.lr
    start = s.min_lr if s.decay == "linear" else 0.0
    out = [f"$.lr_schedule: DeepSpeed builds its {block['type']} at index -1 and steps it after each update, so its "
           f"update s uses index s - 2: it trains at lr {start:g} on steps 1 and 2 and its warmup runs two steps "
           f"behind the recipe's (peak {lr:g} at step {max(1, s.warmup_steps)}); the plugin's engines apply the "
           "recipe's schedule themselves and drop this block"]
    if s.decay == "linear":
        out.append(f"$.lr_schedule.decay: DeepSpeed's linear decay runs 2 steps late too: {s.min_lr:g} at step "
                   f"{s.decay_steps + 2}, not {s.decay_steps}")
    elif s.decay == "cosine":
        out.append(f"$.lr_schedule.decay: DeepSpeed's cosine counts its progress from index warmup - 1: 1 step late, "
                   f"{s.min_lr:g} at step {s.decay_steps + 1}, not {s.decay_steps}, and never exactly at the peak")
    if s.warmup_steps < 2:
        out.append(f"$.lr_schedule.warmup_steps: {s.warmup_steps} is written as warmup_num_steps "
                   f"{_warmup(s)}; DeepSpeed warms up over at least 2 steps")
    if s.decay == "linear" and s.min_lr > 0:
        out.append(f"$.lr_schedule.min_lr: WarmupDecayLR warms up from warmup_min_lr and decays to it: written as "
                   f"{s.min_lr:g}, so DeepSpeed's warmup starts at {s.min_lr:g}, not 0")
    fix = "train with the plugin's engines (train.py, plugin.initialize) for the recipe's schedule exactly"
    return [Problem(*text.split(": ", 1), fix, WARNING) for text in out]


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _steps(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def from_ds_scheduler(section, lr: float) -> tuple[dict | None, float | None]:
    """``(lr_schedule as JSON data, the peak lr it implies or None)`` for a DeepSpeed ``scheduler`` block that
    :func:`to_ds_scheduler` could have written (linear warmup from 0, or from ``min_lr`` for WarmupDecayLR);
    ``(None, None)`` for any other block, which then stays raw. ``lr``: the optimizer's lr read from the config."""
    if not isinstance(section, Mapping) or set(section) - {"type", "params"}:
        return None, None
    p = section.get("params", {})
    if not isinstance(p, Mapping) or p.get("warmup_type") != "linear" or not _steps(p.get("warmup_num_steps", 1000)):
        return None, None
    w = p.get("warmup_num_steps", 1000)
    warmup = {"warmup_steps": w} if w > 1 else {}  # 1 step of warmup from 0 is the peak at step 1: none
    kind = section.get("type")
    if kind == "WarmupLR" and set(p) <= {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"}:
        peak = p.get("warmup_max_lr", lr)
        if p.get("warmup_min_lr", 0) != 0 or not _num(peak) or peak <= 0:
            return None, None
        return {**warmup, "decay": "constant"}, float(peak)
    if kind == "WarmupDecayLR" and set(p) <= {"total_num_steps", "warmup_min_lr", "warmup_max_lr",
                                               "warmup_num_steps", "warmup_type"}:
        peak, floor, total = p.get("warmup_max_lr", 0.001), p.get("warmup_min_lr", 0.0), p.get("total_num_steps")
        if not (_num(peak) and _num(floor) and _steps(total)) or not 0 <= floor <= peak or peak <= 0 or total < w:
            return None, None
        return {**warmup, "decay": "linear", "decay_steps": total, "min_lr": float(floor)}, float(peak)
    if kind == "WarmupCosineLR" and set(p) <= {"total_num_steps", "warmup_min_ratio", "warmup_num_steps",
                                                "cos_min_ratio", "warmup_type"}:
        ratio, total = p.get("cos_min_ratio", 0.0001), p.get("total_num_steps")
        if p.get("warmup_min_ratio", 0) != 0 or not (_num(ratio) and _steps(total)) or not 0 <= ratio <= 1 \
                or total < w:
            return None, None
        return {**warmup, "decay": "cosine", "decay_steps": total, "min_lr": float(f"{ratio * lr:.12g}")}, None
    return None, None
