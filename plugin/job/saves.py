"""What a training loop saves and resumes from (pure: the engine saves and loads): ``--save``, ``--save-every``,
``--keep`` and ``--resume`` of train.py.

:class:`Saves` knows where the run resumes from (``--resume auto``: the ``--save`` directory's latest complete step,
or a fresh start), loads that checkpoint with the data position it holds, says which steps are saved (every
``--save-every``, the last, and the one a stop ends on) and what rank 0 prints when a stop ended the run.
"""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.directory import step_name
from ..elastic.resume import resume_from
from ..errors import PluginError


class Saves:
    """``save``: the ``--save`` directory (None: nothing is saved); ``every``: ``--save-every``; ``keep``:
    ``--keep``; ``resume``: ``--resume`` as given (a directory, ``auto`` or None). Made before any process group
    (``--resume auto`` looks into ``save``)."""

    def __init__(self, save: str | None, *, every: int | None = None, keep: int | None = None,
                 resume: str | None = None):
        self.dir, self.every, self.keep, self.resume = save, every, keep, resume
        self.resume_dir = resume_from(resume, save)  # --resume auto: None on a fresh start
        self.loader = None  # a StepLoader whose position travels in the checkpoints (train.py --data)

    def load(self, engine, loader=None) -> int:
        """The step this run trains from: 0 on a fresh start, else the checkpoint's, loaded into ``engine`` (and its
        data position into ``loader``). Raises :class:`~plugin.errors.PluginError` when the checkpoint cannot
        continue this run (every rank reads the same checkpoint and reaches the same verdict)."""
        self.loader = loader
        state = engine.load(self.resume_dir) if self.resume_dir else {"step": 0}
        start = state["step"]
        if loader is not None:
            if "data" in state:
                loader.load_state_dict(state["data"])
            elif start:  # restarting the data at step N would train epoch 0's rows again, exit 0
                raise PluginError(f"--resume {self.resume_dir}: the checkpoint (step {start}) holds no --data "
                                  "position -> resume with the data it was trained on, or start without --resume")
        return start

    def resumed_at(self, start: int) -> int | None:
        """The step a resumed run's metrics continue from (their lines after it are dropped); None: a run started
        without ``--resume`` writes them afresh."""
        return start if self.resume else None

    def due(self, step: int, *, last: bool, stop: bool) -> bool:
        """Whether ``step`` (just trained) is saved: the last step, the one a stop ends on, every ``every``."""
        return bool(self.dir) and (last or stop or bool(self.every and step % self.every == 0))

    def save(self, engine) -> None:
        """Save ``engine``'s step into ``--save``, with the data position (so ``--resume`` continues where it
        stopped), keeping the last ``keep`` complete checkpoints."""
        data = {"data": self.loader.state_dict()} if self.loader is not None else None
        engine.save(self.dir, keep=self.keep, client_state=data)

    def stopped_line(self, step: int) -> str:
        """Rank 0's one line after a stop at ``step``: where it is saved and how to resume."""
        saved = (f"saved {Path(self.dir) / step_name(step)}; resume with --resume {self.dir}" if self.dir
                 else "nothing saved (no --save)")
        return f"interrupted at step {step}; {saved}"
