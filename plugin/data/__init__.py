"""Data for training: :mod:`.text` (real text on every machine without a download: the standard library's bytes)
and :mod:`.loader` (:class:`~.loader.StepLoader`, the rows of a dataset each data rank trains on at each step:
what ``engine.dataloader`` returns)."""
