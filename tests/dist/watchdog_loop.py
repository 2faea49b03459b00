"""A user's own training loop for the hang guard's tests (tests/dist/test_watchdog.py), under any launcher:

    torchrun --nproc_per_node 2 tests/dist/watchdog_loop.py --recipe R.json --sleep-rank 1 --sleep-at 3
    ... --other-recipe Q.json --other-rank 3     # that rank alone is launched with another layout

``--sleep-rank R --sleep-at S``: after step S, rank R sleeps in this loop (not in the engine) for an hour.
``--other-rank R --other-recipe Q``: rank R runs recipe Q instead: its groups cannot match its peers'.
``--preflight-stall-rank R --preflight-stall-group tensor``: rank R, alive (its guard beats on), stalls for an hour as
it reaches the pre-flight of its first tensor group, before that group's all-reduce (as a rank whose link to one peer
is down would): its peers in that group wait in it.
Prints ``step N`` per step on rank 0, ``sleeping`` on the sleeper before it sleeps, and ``stalls in the pre-flight``
on the staller.
"""
import argparse
import os
import sys
import time

import torch

import plugin
from plugin.data.text import TextBatches
from plugin.errors import RecipeError
from plugin.models.gpt import GPT, GPTConfig

p = argparse.ArgumentParser()
p.add_argument("--recipe", required=True)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--sleep-rank", type=int)
p.add_argument("--sleep-at", type=int, default=0)
p.add_argument("--other-rank", type=int)
p.add_argument("--other-recipe")
p.add_argument("--preflight-stall-rank", type=int)
p.add_argument("--preflight-stall-group", default="tensor")
args, _ = p.parse_known_args()  # the deepspeed launcher adds --local_rank

rank = int(os.environ.get("RANK", "0"))
if rank == args.preflight_stall_rank:  # the pre-flight marks each group in the ledger before its all-reduce
    from plugin.watchdog.ledger import Ledger

    enter = Ledger.enter

    def stalling(self, phase, detail="", peer=None):
        enter(self, phase, detail, peer)
        if phase == "preflight" and detail.startswith(f"the {args.preflight_stall_group} group"):
            print(f"rank {rank} stalls in the pre-flight of {detail}", flush=True)
            time.sleep(3600)

    Ledger.enter = stalling
recipe = plugin.load_recipe(args.other_recipe if rank == args.other_rank else args.recipe)
with torch.device("meta"):
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
try:
    engine = plugin.initialize(model, recipe, seed=0)
except RecipeError:
    sys.exit(2)
data = TextBatches(recipe.model.vocab, recipe.model.seq_len, seed=0)
for step in range(args.steps):
    engine.train_step(data.global_batch(step, engine.layout.global_batch))
    if engine.is_main:
        print(f"step {step + 1}", flush=True)
    if rank == args.sleep_rank and step + 1 == args.sleep_at:
        print(f"rank {rank} sleeping", flush=True)
        time.sleep(3600)
engine.close()
