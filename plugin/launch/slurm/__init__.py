"""Slurm, both sides of ``sbatch`` (pure: no torch).

Inside an allocation (``SLURM_JOB_ID`` set), ``launch.sh`` reads it (:mod:`.allocation`), checks it against the
recipe's world before anything starts (:mod:`.fit`) and starts one torchrun per node with ``srun``, a c10d rendezvous
on the first node (:mod:`.srun`). Before it, ``python -m plugin sbatch RECIPE`` writes the batch script
(:mod:`.batch`): nodes, processes and GPUs (or CPUs) per node from the recipe, ``--requeue``, ``--open-mode=append``,
the time limit's signal turned into a requeue, and the launch line with ``--save DIR --resume auto``, so that a job
that Slurm preempts, requeues or stops near its time limit saves its step and resumes from it at the next start.
"""
