"""The job's life around the training loop (pure: no torch).

:mod:`.interrupt`: SIGINT, SIGTERM or the launcher's exit as a request to stop at the next step boundary, saved
there; a grace period, a second SIGINT that stops at once. :mod:`.lock`: one job per ``--save`` directory.
:mod:`.supervise`: launch.sh's side, the launcher as its child, a stop handed to the workers, no orphan.
"""
