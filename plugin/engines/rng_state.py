"""The random state a rank's checkpoint carries, the same on every back end: torch's CPU generator, every CUDA
device's generator (where CUDA is available), and the tensor-parallel dropout streams the model holds
(:func:`plugin.tensor_parallel.random.tensor_parallel_rngs`). With it a resumed run draws the dropout masks the
uninterrupted run would have drawn."""
from __future__ import annotations

import torch

from ..errors import PluginError
from ..tensor_parallel.random import tensor_parallel_rngs


def rng_state(module: torch.nn.Module) -> dict:
    """This rank's generators, and the tensor-parallel streams of ``module`` (the rank's part of the model)."""
    state = {"torch_rng": torch.get_rng_state(), "tp_rng": [r.state_dict() for r in tensor_parallel_rngs(module)]}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(module: torch.nn.Module, state: dict, source: str) -> None:
    """Put back what :func:`rng_state` saved; ``source`` names the file in errors."""
    rngs = tensor_parallel_rngs(module)
    saved = state.get("tp_rng", [])
    if len(saved) != len(rngs):
        raise PluginError(f"{source} holds {len(saved)} tensor-parallel dropout stream(s), this rank's model "
                          f"{len(rngs)} -> resume with the model and recipe that wrote the checkpoint")
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    for rng, states in zip(rngs, saved, strict=True):
        rng.load_state_dict(states)
