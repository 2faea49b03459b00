"""Where a process sits in the job and how it talks to its peers.

:mod:`.topology` (pure rank math: rank <-> (pipeline, data, tensor), group rank lists) and :mod:`.env` (pure:
the launcher's environment, the launched world checked against the recipe) import no torch; :mod:`.groups`
(the only creator of process groups) and :mod:`.clipping` (the global gradient norm over them) do.
"""
