"""The recipe in other tools' words, pure (no torch, no deepspeed, no accelerate).

:mod:`.deepspeed_config` (recipe <-> ds_config), :mod:`.accelerate_config` (recipe -> Accelerate's launch
YAML) and :mod:`.accelerate_import` (that YAML -> recipe), :mod:`.precision` (the one precision table every back end
and launcher reads).
"""
