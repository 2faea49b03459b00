"""The checkpoint room: one format for every layout and back end, on torch.distributed.checkpoint.

:mod:`.boxes` (pieces: where a rank's memory lies in the global tensors), :mod:`.dcp_io` (our DCP planners, the
reader that runs no code), :mod:`.directory` and :mod:`.manifest` (pure: the step directories, the JSON manifest,
compatibility), :mod:`.store` (the crash-safe save and the checked load), :mod:`.adapt` (an engine's parameters
and optimizer as pieces; the save/load the back ends call), :mod:`.export` (one safetensors model).
"""
