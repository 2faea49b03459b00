"""The recipe, pure (no torch): JSON text -> schema -> frozen dataclasses -> resolved sizes -> cross-field checks.

Read in this order: :mod:`.paths` (where schemas/ and the shipped recipes are), :mod:`.jsontext` (strict JSON
text), :mod:`.schema` (JSON Schema errors as problems with a fix), :mod:`.spec` (the frozen dataclasses),
:mod:`.load` (find, read and schema-check a recipe), :mod:`.layout` (the data degree and the batch triple),
:mod:`.checks` (every cross-field rule, ``validate`` and ``load_recipe``), with :mod:`.deepspeed_block` (the
raw ``deepspeed`` block's rule).
"""
