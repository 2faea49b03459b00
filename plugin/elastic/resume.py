"""``train.py --resume auto`` (pure: no torch): one command line for every (re)start of a run.

With ``--save DIR``, ``--resume auto`` resumes from DIR's latest complete step when DIR has one and starts fresh
when it has none (no directory yet, or only a save a crash interrupted), so the first start and every restart of
an elastic job run the same command. Without ``--save`` there is nothing to look in: refused.
"""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.directory import complete_steps

AUTO = "auto"


def resume_problem(resume: str | None, save: str | None) -> str | None:
    """Why ``--resume``/``--save`` cannot be used together as given (None: they can)."""
    if resume == AUTO and not save:
        return ("--resume auto resumes from the --save directory's latest complete step: give --save DIR "
                "(or --resume DIR to resume from a directory of your own)")
    return None


def resume_from(resume: str | None, save: str | None) -> str | None:
    """The directory a run resumes from: ``--resume DIR`` as given, ``--resume auto`` the ``--save`` directory when
    it holds a complete checkpoint, else None (a fresh start)."""
    if resume != AUTO:
        return resume
    return save if complete_steps(Path(save)) else None
