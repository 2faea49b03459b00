"""Random streams for dropout under tensor parallelism.

Two kinds of region need two kinds of randomness:

* replicated region (the residual stream without sequence parallelism, norms, embeddings): every tensor
  rank holds the same activations, so their dropout masks must agree, or the replicas drift apart. That
  is torch's default generator, seeded the same on every rank of the tensor group.
* sharded region (attention probabilities of this rank's heads, and with sequence parallelism the
  residual stream on this rank's slice of the sequence): each rank holds different numbers, and their
  masks must be independent, or heads on different ranks are dropped in lockstep.

:class:`TensorParallelRNG` keeps the second stream and :meth:`TensorParallelRNG.fork` swaps it in for the
duration of a ``with`` block, leaving the default stream exactly where it was. No global state: the object
is held by the model that uses it.

Seeds follow Megatron-LM: its training loop first offsets the common seed by pipeline stage
(``seed + 100 * pp_rank``, ``_set_random_seed``), then ``model_parallel_cuda_manual_seed`` seeds the
tensor-parallel stream ``+ 2718 + tp_rank``. So the sharded stream here is
``seed + 100 * pp_rank + 2718 + tp_rank``: different on every tensor rank and on every pipeline stage (two
stages hold different layers and must not draw the same masks), equal across data-parallel replicas.
As in Megatron, streams stay distinct while ``tp_size <= 100``. The pipeline rank is passed in, never looked
up. The default stream, for replicated regions, is the caller's: the engines never reseed it (a user's own
data drawn from it must stay the same on every stage); train.py offsets it per stage after ``initialize``
(:func:`offset_default_stream_by_stage`), as Megatron does after building its model.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100


def sharded_stream_seed(seed: int, tp_rank: int, pp_rank: int = 0) -> int:
    """The seed of the sharded-region stream: ``seed + 100 * pp_rank + 2718 + tp_rank`` (Megatron's scheme)."""
    if tp_rank < 0 or pp_rank < 0:
        raise ValueError(f"tp_rank and pp_rank must be >= 0, got tp_rank={tp_rank}, pp_rank={pp_rank}")
    return int(seed) + PIPELINE_SEED_STRIDE * int(pp_rank) + SEED_OFFSET + int(tp_rank)


def offset_default_stream_by_stage(pp_rank: int) -> None:
    """Reseed torch's default generator (every device) with ``initial_seed + 100 * pp_rank``, Megatron's
    pipeline offset, so replicated-region dropout on different stages does not draw the same masks in lockstep.

    Call once (it offsets from ``torch.initial_seed()``, so a second call adds again), after the model is built
    and sharded (the sharded stream has taken its seed from the common one) and before training; stage 0
    keeps its stream untouched. Data-parallel replicas of a stage stay equal. Only for scripts whose data does
    not come from torch's default generator (train.py's has its own): stages would otherwise draw different
    inputs and labels.
    """
    if pp_rank < 0:
        raise ValueError(f"pp_rank must be >= 0, got {pp_rank}")
    if pp_rank:
        torch.manual_seed(torch.initial_seed() + PIPELINE_SEED_STRIDE * int(pp_rank))


def _device_module(device: torch.device):
    return None if device.type == "cpu" else getattr(torch, device.type)


def _get_state(device: torch.device) -> torch.Tensor:
    module = _device_module(device)
    return torch.get_rng_state() if module is None else module.get_rng_state(device)


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    module = _device_module(device)
    if module is None:
        torch.set_rng_state(state)
    else:
        module.set_rng_state(state, device)


class TensorParallelRNG:
    """The per-tensor-rank random stream for dropout inside sharded regions.

    ``seed`` must be the same on every rank (``torch.initial_seed()`` after a common ``torch.manual_seed``
    is); the stream's seed is :func:`sharded_stream_seed` ``(seed, tp_rank, pp_rank)``, so tensor ranks and
    pipeline stages differ and a rerun with the same seed repeats. ``pp_rank``: this rank's pipeline stage
    (0 without pipeline parallelism). One state is kept per device (CPU, ``cuda:0``...), created on first use.
    """

    def __init__(self, seed: int, tp_rank: int, pp_rank: int = 0):
        self.seed = sharded_stream_seed(seed, tp_rank, pp_rank)
        self._states: dict[str, torch.Tensor] = {}

    def _initial_state(self, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed)
        return generator.get_state()

    @contextlib.contextmanager
    def fork(self, device: torch.device | str | None = None) -> Iterator[None]:
        """Inside the block, ``device``'s default generator is this rank's stream (CPU if not given)."""
        device = torch.device(device if device is not None else "cpu")
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, _device_module(device).current_device())
        key = str(device)
        saved = _get_state(device)
        state = self._states.get(key)
        _set_state(device, state if state is not None else self._initial_state(device))
        try:
            yield
        finally:
            self._states[key] = _get_state(device)
            _set_state(device, saved)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The stream's state per device, for checkpoints (an unused stream has none yet)."""
        return {key: state.clone() for key, state in self._states.items()}

    def load_state_dict(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {key: state.clone() for key, state in states.items()}


def sharded_region(rng: TensorParallelRNG | None, device=None):
    """``rng.fork(device)``, or a no-op context without tensor parallelism (``rng`` is None)."""
    return contextlib.nullcontext() if rng is None else rng.fork(device)


def tensor_parallel_rngs(module: torch.nn.Module) -> list[TensorParallelRNG]:
    """The tensor-parallel dropout streams ``module``'s submodules hold (``.rng``, ``.tp.rng`` or a context-parallel
    attention's ``.cp.rng``), each once, in a stable order: what checkpoints save and activation checkpointing
    replays."""
    found, seen = [], set()
    for m in module.modules():
        for holder in (m, getattr(m, "tp", None), getattr(m, "cp", None)):
            rng = getattr(holder, "rng", None)
            if isinstance(rng, TensorParallelRNG) and id(rng) not in seen:
                seen.add(id(rng))
                found.append(rng)
    return found
