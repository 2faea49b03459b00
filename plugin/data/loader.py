"""Rows of a map-style dataset for each training step, by data rank: what ``engine.dataloader(dataset)`` returns.

Which rows step ``s`` of epoch ``e`` trains on is a function of (dataset length, global batch, seed, shuffle,
e, s) alone: the epoch's order (``randperm`` from a generator seeded by ``seed`` and ``e``, or 0..n-1 unshuffled)
is cut into global batches, and data rank ``d`` of ``D`` takes the ``d``-th contiguous ``global / D`` of each
(:func:`plugin.engines.batches.shard_rows`'s cut). So the union of one step's rows over the data ranks is the same
global batch in the same order whatever the layout, and a one-process run (``D = 1``) trains on exactly those rows:
the losses of any layout are the losses of one process. Tensor and pipeline peers share a data rank, hence
their rows (the data contract, :mod:`plugin.engines.data_contract`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import PluginError

_STATE_KEYS = ("rows", "global_batch", "seed", "shuffle")  # must match for a state to resume here


def epoch_order(rows: int, epoch: int, *, seed: int, shuffle: bool) -> torch.Tensor:
    """The dataset indices of ``epoch`` in training order (int64)."""
    if not shuffle:
        return torch.arange(rows)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % 2 ** 64)  # its own generator: torch's
    return torch.randperm(rows, generator=gen)  # default stream (dropout, the user's) is left alone


def step_rows(order: torch.Tensor, step: int, *, global_batch: int, data_rank: int, data_size: int) -> list[int]:
    """The indices data rank ``data_rank`` trains on at ``step`` of an epoch whose order is ``order``."""
    share = global_batch // data_size
    start = step * global_batch + data_rank * share
    return order[start:start + share].tolist()


class StepLoader:
    """This data rank's rows of ``dataset`` for each step (``global_batch / data_size`` rows, collated).

    ``dataset``: map-style (``len`` and ``dataset[i]``), e.g. of ``(inputs, labels)`` tuples; each step's rows
    go through ``collate_fn`` (default: torch's ``default_collate``, which stacks a list of tuples into
    ``[inputs, labels]``) and are yielded as it returns them, ready for ``engine.train_step``.

    Epochs: ``for batch in loader`` yields the rest of the current epoch; the next iteration continues with the
    next epoch, shuffled anew (from ``seed`` and the epoch number, never from torch's default generator). An
    iteration left early (a ``break``) is continued where it stopped by the next one; :meth:`stream` goes on
    from epoch to epoch without end, for a loop counted in steps. ``len(loader)`` is the
    steps per epoch: ``len(dataset) // global_batch``. **The last, incomplete global batch of an epoch is
    dropped** (its rows could not be shared equally by the data ranks); with ``shuffle`` they are other rows
    each epoch.

    ``num_workers > 0`` loads through torch's ``DataLoader`` worker processes, which read ahead; the position
    counts batches yielded to the caller, not those the workers loaded, so ``state_dict()`` taken after a step
    resumes at the next one. ``load_state_dict`` takes a state of any layout (the position is in global
    batches), as long as the dataset length, global batch, seed and shuffle are the same. Random transforms
    inside the dataset draw from each worker's RNG, which a resume does not reproduce.
    """

    def __init__(self, dataset, *, global_batch: int, data_rank: int, data_size: int, shuffle: bool = True,
                 seed: int = 0, collate_fn: Callable | None = None, num_workers: int = 0):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise PluginError(f"engine.dataloader needs a map-style dataset (len(dataset) and dataset[i]); got "
                              f"{type(dataset).__name__} -> wrap the rows in a list or a torch Dataset; for a stream, "
                              "build each global batch yourself and pass it to train_step whole")
        if global_batch % data_size:
            raise PluginError(f"a global batch of {global_batch} rows does not split over {data_size} data ranks")
        if not 0 <= data_rank < data_size:
            raise PluginError(f"data rank {data_rank} is outside 0..{data_size - 1}")
        rows = len(dataset)
        if rows < global_batch:
            raise PluginError(f"the dataset has {rows} rows, fewer than one global batch ({global_batch}): no step "
                              "could be drawn -> use a larger dataset or a smaller batch.global")
        if num_workers < 0:
            raise PluginError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset, self.collate_fn, self.num_workers = dataset, collate_fn, num_workers
        self.global_batch, self.data_rank, self.data_size = global_batch, data_rank, data_size
        self.shuffle, self.seed, self.rows = bool(shuffle), int(seed), rows
        self.epoch, self.step = 0, 0  # the next batch to yield: step `step` of epoch `epoch`
        self._order: tuple[int, torch.Tensor | None] = (-1, None)

    def __len__(self) -> int:
        """Steps per epoch (the incomplete last global batch dropped)."""
        return self.rows // self.global_batch

    def _normalise(self) -> None:
        if self.step >= len(self):
            self.epoch, self.step = self.epoch + 1, 0

    def order(self, epoch: int) -> torch.Tensor:
        if self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.rows, epoch, seed=self.seed, shuffle=self.shuffle))
        return self._order[1]

    def indices(self, epoch: int, step: int) -> list[int]:
        """The dataset indices this data rank trains on at ``step`` of ``epoch``."""
        return step_rows(self.order(epoch), step, global_batch=self.global_batch, data_rank=self.data_rank,
                         data_size=self.data_size)

    def __iter__(self) -> Iterator[Any]:
        self._normalise()
        epoch, first = self.epoch, self.step
        from torch.utils.data import DataLoader

        # A generator of our own: DataLoader otherwise draws its workers' base seed from torch's default
        # generator at every iteration, shifting the caller's dropout masks by how often it iterates.
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch * 1_009 + first) % 2 ** 64)
        loader = DataLoader(self.dataset, batch_sampler=_Plan(self, epoch, first), collate_fn=self.collate_fn,
                            num_workers=self.num_workers, generator=gen)
        for batch in loader:
            if (self.epoch, self.step) != (epoch, first):
                raise PluginError("a StepLoader was moved (load_state_dict, or another iteration over it) while "
                                  "this iteration ran -> iterate it again")
            first += 1
            self.step = first  # counted as it reaches the caller, not as the workers read ahead
            yield batch
        self._normalise()

    def stream(self) -> Iterator[Any]:
        """Batches without end, epoch after epoch (for a loop counted in steps); the same position as ``iter``."""
        while True:
            yield from self

    def state_dict(self) -> dict:
        """The position (the next step to yield) and what it is a position in; layout-free."""
        self._normalise()
        return {"epoch": self.epoch, "step": self.step, "rows": self.rows, "global_batch": self.global_batch,
                "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` (of this or any other layout over the same rows)."""
        mine = self.state_dict()
        differ = [f"{k} {state.get(k)!r} (here {mine[k]!r})" for k in _STATE_KEYS if state.get(k) != mine[k]]
        if differ:
            raise PluginError("the data loader state was saved for other data: " + ", ".join(differ) +
                              " -> resume with the same dataset, batch.global, seed and shuffle")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._normalise()


class _Plan:
    """The index lists of an epoch's remaining steps, drawn lazily (DataLoader's ``batch_sampler``): a long
    epoch is not held as Python lists up front."""

    def __init__(self, loader: StepLoader, epoch: int, first: int):
        self.loader, self.epoch, self.first = loader, epoch, first

    def __len__(self) -> int:
        return len(self.loader) - self.first

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.first, len(self.loader)):
            yield self.loader.indices(self.epoch, step)
