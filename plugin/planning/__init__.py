"""Estimates and the layout search, pure (no torch): how much memory, traffic and time a layout costs.

From the parts to the whole: :mod:`.units` (byte sizes for people), :mod:`.dims` (a model's dimensions and
parameter counts), :mod:`.setup` (a layout as the estimates see it), :mod:`.model_states` (ZeRO's model
states), :mod:`.activations` (per block), :mod:`.schedule` (pipeline bubble, micro-batches in flight),
:mod:`.memory` (per rank), :mod:`.traffic` (bytes sent per rank), :mod:`.steptime` (a roofline step time),
:mod:`.for_recipe` (all of it for one recipe: ``python -m plugin estimate``), :mod:`.search` (the fastest layouts
that fit: ``python -m plugin plan``) with :mod:`.reasons` (why each is where it is) and :mod:`.to_recipe` (the
winner as a recipe), and :mod:`.presets` (named models).
"""
