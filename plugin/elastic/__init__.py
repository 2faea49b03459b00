"""Elastic runs (pure: no torch): a job whose launcher restarts it with another world, and the script that must find
its own way back. :mod:`.world` (which processes train at this start, and the surplus that sit out), :mod:`.resume`
(``--resume auto``: the save directory's latest complete step, or a fresh start), :mod:`.ledger` (the run's
heartbeat in the save directory: the restart count, and how long the job stood still between two trained steps).
"""
