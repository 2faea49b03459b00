"""launch.sh's brain, pure (no torch): :mod:`.launcher` (validate, pick a launcher, count processes, build the
command), :mod:`.machine` (what this machine offers), :mod:`.hostfile` (DeepSpeed's hostfile, read as its runner
reads it). ``python -m plugin.launch`` runs it.
"""
