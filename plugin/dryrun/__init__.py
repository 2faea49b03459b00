"""The dry run: every rank of a job built and stepped in one process, on the meta device, over a recording process
group (``python -m plugin dryrun``; docs/dry-run.md).

Pure here: :mod:`.ranks` (rank lists read and written compressed), :mod:`.args` (the command's options),
:mod:`.checks` (what the simulated ranks must agree on) and :mod:`.report` (the table and the JSON). With torch:
:mod:`.backend` (the recording process group, the meta values read as zeros), :mod:`.simulate` (one rank through
the real ``initialize`` and one ``train_step``) and ``python -m plugin.dryrun``.
"""
