"""``python -m plugin``, pure (no torch): :mod:`.main` (the parser), one module per command (:mod:`.validate`,
:mod:`.show`, :mod:`.export`, :mod:`.import_`, :mod:`.estimate`, :mod:`.plan`: ``register`` and ``run``), and
:mod:`.common` (what they share).
"""
