"""The DeepSpeed back end: :mod:`.engine` (the engine and its ``build(ctx)``), :mod:`.config` (the ds_config it runs:
the export and what the engine adjusts), :mod:`.optimizer` (torch's optimizer, or DeepSpeed's CPUAdam where an
offloaded Adam needs it). Nothing here imports deepspeed until ``build`` runs."""
