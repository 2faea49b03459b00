"""The interface every back end implements, and what they share: batch splitting and loss averaging.

``train_step(batch)`` takes the global batch (``global`` rows) or this data rank's share
(``micro x grad_accum`` rows) as an ``(inputs, labels)`` pair, runs ``grad_accum`` micro-batches and one
optimizer step, and returns the mean loss over the whole global batch: the same float on every rank.

The data contract (:mod:`plugin.engines.data_contract`): the ranks of one model replica (tensor peers, pipeline stages)
must hold the same rows. Every back end reaches its batch through :meth:`Engine.local_batch` (directly, or
through :meth:`Engine.micro_batches`), which checks it on every step of a layout with tensor or pipeline > 1,
so one check covers them all. :meth:`Engine.dataloader` yields rows that keep it.
"""
from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .batches import micro_batches, shard_rows
from .data_contract import check_same_rows


class Engine(abc.ABC):
    """A model sharded per a recipe, with its optimizer, ready to train."""

    backend: str = "?"
    # The data contract's check (local_batch); bench/data_contract.py turns it off to time what it costs.
    check_peer_rows: bool = True
    # The dtype floating inputs must have on entering the module: None keeps them as given (fp32, or autocast
    # in the back end); a back end that casts the model itself to bf16/fp16 (DeepSpeed) sets it.
    input_dtype: torch.dtype | None = None

    def __init__(self, recipe, layout, topology, groups, module: torch.nn.Module, device: torch.device):
        self.recipe = recipe
        self.layout = layout
        self.topology = topology
        self.groups = groups
        self.module = module
        self.device = device
        self.step_count = 0

    # ------------------------------------------------------------------ the public interface
    @abc.abstractmethod
    def train_step(self, batch) -> float:
        """One optimizer step over ``batch``; returns the global batch's mean loss (equal on every rank)."""

    @abc.abstractmethod
    def eval_step(self, batch) -> float:
        """The global batch's mean loss without updating anything."""

    @abc.abstractmethod
    def save(self, directory: str, client_state: dict | None = None) -> None:
        """Write a checkpoint every rank can resume from (all ranks must call it)."""

    @abc.abstractmethod
    def load(self, directory: str) -> dict:
        """Restore a checkpoint written by :meth:`save`; returns the ``client_state`` saved with it."""

    def close(self) -> None:
        """Wait for every rank, then tear the process groups down (all ranks, once, at the end).

        Without it a gloo job can hang or abort at exit: a process group destroyed while the interpreter holds
        the GIL (garbage collection, finalisation) joins its worker threads, and a worker still releasing a
        finished work's tensors waits for that GIL (gloo's barrier keeps the previous works alive until its
        own release). The pause lets the workers drop them before anything is destroyed.
        """
        if dist.is_initialized():
            dist.barrier()
            time.sleep(0.1)  # let gloo's workers drop the finished works' tensors first (see above)
            dist.destroy_process_group()

    # ------------------------------------------------------------------ shared helpers
    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel coordinate: which share of the global batch it trains on (its tensor and
        pipeline peers share it). For sharding by hand: ``DistributedSampler(dataset,
        num_replicas=engine.data_size, rank=engine.data_rank)``."""
        return self.groups.dp_rank

    @property
    def data_size(self) -> int:
        """The number of data-parallel replicas (the recipe's data degree), not the number of processes."""
        return self.layout.data

    def dataloader(self, dataset, *, shuffle: bool = True, seed: int = 0, collate_fn: Callable | None = None,
                   num_workers: int = 0):
        """This data rank's rows of ``dataset`` for each step: a :class:`plugin.data.loader.StepLoader`.

        Each step's rows over all data ranks are one global batch, the same whatever the layout (a run on any
        layout gives the losses of one process on the same dataset); tensor and pipeline peers get the same
        rows. Shuffled per epoch from ``seed`` and the epoch; an incomplete last global batch is dropped; its
        ``state_dict()`` resumes mid-epoch. See :class:`~plugin.data.loader.StepLoader`.
        """
        from ..data.loader import StepLoader

        return StepLoader(dataset, global_batch=self.layout.global_batch, data_rank=self.data_rank,
                          data_size=self.data_size, shuffle=shuffle, seed=seed, collate_fn=collate_fn,
                          num_workers=num_workers)

    @property
    def rank(self) -> int:
        """This process's global rank (0 in a world of one)."""
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def to_inputs(self, inputs: torch.Tensor) -> torch.Tensor:
        """``inputs`` as the module takes them: on the engine's device, and a floating tensor in
        :attr:`input_dtype` when the back end set one (integer token ids are left as they are)."""
        inputs = inputs.to(self.device, non_blocking=True)
        if self.input_dtype is not None and inputs.is_floating_point():
            inputs = inputs.to(self.input_dtype)
        return inputs

    def local_batch(self, batch, call: str | None = None):
        """This data rank's share of ``batch`` (given whole, or already split), on the engine's device, its
        inputs as the module takes them (:meth:`to_inputs`); labels keep their dtype.

        With tensor or pipeline > 1, the share's fingerprint is compared over the model replica first
        (:func:`plugin.engines.data_contract.check_same_rows`, one all-gather of 3 int64 per rank over the world): a
        mismatch, or a wrong row count on any rank, raises on every rank before anything is trained."""
        call = call or ("train_step" if torch.is_grad_enabled() else "eval_step")  # every eval_step runs no_grad
        rows = batch[0].shape[0]
        lay = self.layout
        local_rows = lay.micro_batch * lay.grad_accum
        wrong = None
        # At data 1 the global batch is the local share: nothing to cut, and the check below sees the same rows.
        if rows == lay.global_batch and rows != local_rows:
            batch = shard_rows(batch, self.dp_rank, lay.data)
        elif rows != local_rows:
            wrong = (f"{call} got {rows} rows; expected the global batch ({lay.global_batch}) or this rank's share "
                     f"(micro {lay.micro_batch} x grad_accum {lay.grad_accum} = {local_rows})")
        inputs, *rest = batch
        inputs, rest = inputs.to(self.device, non_blocking=True), [t.to(self.device, non_blocking=True) for t in rest]
        if lay.tensor * lay.pipeline > 1 and self.check_peer_rows:  # no peers at tensor = pipeline = 1
            check_same_rows(None if wrong else (inputs, *rest), rows, self.topology, call=call,
                            global_rows=lay.global_batch, local_rows=local_rows, device=self.device)
        if wrong:
            raise ValueError(wrong)
        return (self.to_inputs(inputs), *rest)

    def micro_batches(self, batch, call: str | None = None) -> list:
        return micro_batches(self.local_batch(batch, call), self.layout.grad_accum)

    def mean_over_data(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data-parallel group (tensor/pipeline peers hold the same)."""
        return self.start_mean_over_data(value)()

    def start_mean_over_data(self, value: torch.Tensor) -> Callable[[], float]:
        """Start averaging a per-rank scalar over the data-parallel group without waiting; the returned
        function waits and gives the float. Started before a backward pass, the reduction hides behind it."""
        value = value.detach().float().reshape(1).to(self.device)
        if self.layout.data == 1:
            return lambda: float(value.item())
        work = dist.all_reduce(value, group=self.groups.data_group, async_op=True)

        def finish() -> float:
            work.wait()
            return float(value.item()) / self.layout.data

        return finish

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (see each back end)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        lay = self.layout
        return {"backend": self.backend, "data": lay.data, "tensor": lay.tensor, "pipeline": lay.pipeline,
                "zero": self.recipe.zero.stage, "precision": self.recipe.precision,
                "global_batch": lay.global_batch, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum}
