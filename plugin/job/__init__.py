"""The job's life around the training loop (pure: no torch).

:mod:`.life`: :class:`~.life.Job`, what train.py opens first: the signals and the ``--save`` lock, given back however
the script ends, a refusal as exit 2. :mod:`.interrupt`: SIGINT, SIGTERM or the launcher's exit as a request to stop at
the next step boundary, saved there; a grace period, a second SIGINT that stops at once. :mod:`.lock`: one job per
``--save`` directory. :mod:`.saves`: ``--save`` / ``--resume`` for a loop. :mod:`.restarts`: an elastic start's surplus
processes, ``--resume auto``'s heartbeat. :mod:`.outputs`: ``--metrics``' directory, made first. :mod:`.supervise`:
launch.sh's side, the launcher as its child, a stop handed to the workers, no orphan.
"""
