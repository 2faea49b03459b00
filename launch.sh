#!/usr/bin/env bash
# Validate a recipe, pick a launcher (deepspeed, else accelerate, else torchrun), start the training.
#   ./launch.sh [--launcher auto|deepspeed|accelerate|torchrun] [--nproc N]
#               [--nodes N --node-rank R --master ADDR:PORT | --hostfile FILE
#                | --elastic MIN:MAX [--max-restarts K] --master ADDR:PORT] [--dry-run] [RECIPE] [-- TRAIN_ARGS]
# With no arguments it trains the default CPU recipe (cpu_dp4) on this machine. Exit 2: invalid recipe.
# Paths (RECIPE, --hostfile, TRAIN_ARGS such as --save DIR) are relative to the directory it is run from;
# a bare name (cpu_tp2_dp2) is a shipped recipe. Python: $PYTHON, else the checkout's .venv, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x "$here/.venv/bin/python" ]; then py="$here/.venv/bin/python"; else py="python3"; fi
fi
# The checkout's plugin package, importable from any working directory (no cd: the user's paths stay theirs)
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" -m plugin.launch "$@"
