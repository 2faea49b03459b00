"""The hang guard: a stuck or missing rank stops the whole job within the recipe's ``watchdog.timeout_s``, and the
report names it, where it runs and what it was doing.

Pure parts (no torch): :mod:`.settings` (intervals, NCCL's environment, the job's directory), :mod:`.ledger` (what a
rank records at its phase boundaries, coordinates and group names in the recipe's words), :mod:`.verdict` (who holds
the job, from the ledgers: the one line and the triage report). With torch: :mod:`.store` (the c10d store the
ledgers travel through), :mod:`.collectives` (torch's view of the rank's groups: sequence numbers, flight recorder,
timeouts, abort), :mod:`.preflight`, :mod:`.hooks` (the engine's phases) and :mod:`.guard` (one rank's guard, its
heartbeat thread and its timeout). :func:`plugin.engines.initialize.initialize` sets it up for every world of more
than one process; ``docs/guard.md`` is the user's side.

For other rooms (elastic restarts): :func:`plugin.watchdog.guard.prepare` / ``Guard.join`` / ``Guard.attach`` /
``Guard.stop``, ``Guard.ledger.enter(phase, detail)`` for a phase of one's own, ``Guard.stall(cause)`` to stop the job
with the report, and :data:`plugin.watchdog.settings.EXIT_HUNG`, the exit code of every process it stops.
"""
