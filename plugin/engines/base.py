"""The interface every back end implements, and what they share: batch splitting and loss averaging.

``train_step(batch)`` takes the global batch (``global`` rows) or this data rank's share
(``micro x grad_accum`` rows) as an ``(inputs, labels)`` pair (labels already shifted) or a Hugging Face style
dict (``input_ids``, ``labels`` = input ids shifted inside the loss, ``-100`` ignored, ``attention_mask`` and other
keyword arguments of the model: :mod:`plugin.engines.batches`), runs ``grad_accum`` micro-batches and one
optimizer step, and returns the mean loss over the whole global batch: the same float on every rank.

The default loss (:class:`plugin.tensor_parallel.hooks.TokenLoss`) is token-weighted: the mean over every
non-ignored target token of the global batch, across micro-batches, data ranks and pipeline micro-batches, so
padded batches of uneven lengths train what one process trains. A user ``loss_fn`` is taken per micro-batch and
averaged over micro-batches and data ranks (each micro-batch weighs the same).

The data contract (:mod:`plugin.engines.data_contract`): the global batch the same on every rank, or each data rank's
own share, the same on the ranks of one model replica (tensor peers, pipeline stages, context peers). Every back end
reaches its batch through :meth:`Engine.local_batch` (directly, or through :meth:`Engine.micro_batches`), which checks
it on every step of every layout, so one check covers them all. :meth:`Engine.dataloader` yields rows that keep it.
Under context parallelism each context rank then keeps its two chunks of every row's sequence
(:meth:`Engine.context_share`, :mod:`plugin.context_parallel.batch`), and its loss is its tokens' share of the global
batch's: gradients are reduced over data x context (:attr:`Engine.loss_replicas`).

What each step did is :attr:`Engine.last_step` (a :class:`plugin.monitor.record.StepReport`: loss, lr, the gradient
norm the back end clipped with, tokens, time, memory, MFU): :meth:`Engine.train_step` wraps the back end's
:meth:`Engine._train_step`, steps the recipe's ``lr_schedule`` (:mod:`plugin.engines.lr_schedule`) and measures.
"""
from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PluginError
from .batches import HF, SHIFTED, map_tensors, micro_batches, rows_of, shard_rows, split_batch, target_count
from .data_contract import BatchMismatchError, shapes_of, start_exchange


def _convention_suspect(inputs, labels, convention: str) -> int:
    """1 when the labels look like the other convention's (see :meth:`Engine.prepare_loss`), else 0."""
    if convention == HF:
        ids = inputs["input_ids"]
        if ids.shape != labels.shape or ids.shape[1] < 2 or torch.equal(ids, labels):
            return 0
        return int(torch.equal(labels[:, :-1], ids[:, 1:]))
    if isinstance(inputs, torch.Tensor) and inputs.shape == labels.shape and inputs.dtype == labels.dtype:
        return int(torch.equal(inputs, labels))
    return 0


class Engine(abc.ABC):
    """A model sharded per a recipe, with its optimizer, ready to train."""

    backend: str = "?"
    # The data contract's check (local_batch); bench/data_contract.py turns it off to time what it costs.
    check_peer_rows: bool = True
    # The dtype floating inputs must have on entering the module: None keeps them as given (fp32, or autocast
    # in the back end); a back end that casts the model itself to bf16/fp16 (DeepSpeed) sets it.
    input_dtype: torch.dtype | None = None
    # A transformers model: dict batches are passed as keyword arguments, with use_cache=False (initialize sets it)
    calls_with_kwargs: bool = False
    loss_fn: Callable | None = None
    # The recipe's lr_schedule over schedule_optimizer() (plugin.engines.lr_schedule; initialize sets it), and what the
    # last train_step did (plugin.monitor.record.StepReport)
    lr_schedule = None
    last_step = None
    # The hang guard (plugin.watchdog.guard.Guard; initialize sets it in a world of more than one), stopped by close()
    guard = None
    _step_tokens: int = 0
    _rows = None  # the data contract's check in flight: local_batch starts it, rows_checked waits for it
    _accepted = None  # (shapes_of, the batch as given: kept) of the last train_step batch the data contract accepted
    # True when the back end calls rows_checked after its backward and before its update, and can drop what a refused
    # step's backward left (discard_step): local_batch may then defer the data contract's verdict to there
    checks_rows_after_backward: bool = False
    # this rank's wish to stop (plugin.job sets it): last_step.stop_requested is then any rank's, the same everywhere
    stop_request: Callable[[], bool] | None = None
    _meter = None

    def __init__(self, recipe, layout, topology, groups, module: torch.nn.Module, device: torch.device):
        self.recipe = recipe
        self.layout = layout
        self.topology = topology
        self.groups = groups
        self.module = module
        self.device = device
        self.step_count = 0

    # ------------------------------------------------------------------ the public interface
    def train_step(self, batch) -> float:
        """One optimizer step over ``batch``; returns the global batch's mean loss (equal on every rank).

        The back end's :meth:`_train_step` runs the step; then the recipe's ``lr_schedule`` moves to the next step and
        :attr:`last_step` records what this one did (one small all-reduce for the largest memory of any rank, which
        also tells every rank whether any :attr:`stop_request` is set: ``last_step.stop_requested``)."""
        start = time.perf_counter()
        lr = self.current_lr()  # what this step's update uses: the schedule set it after the previous step
        loss = self._train_step(batch)
        assert self._rows is None, f"{type(self).__name__} stepped before the data contract's verdict (rows_checked)"
        seconds = time.perf_counter() - start
        if self.lr_schedule is not None:
            self.lr_schedule.step()
        norm = self.grad_norm()
        self.last_step = self.meter.report(step=self.step_count, loss=loss, lr=lr, seconds=seconds,
                                           grad_norm=None if norm is None else float(norm), tokens=self._step_tokens,
                                           stop=self.stop_request is not None and self.stop_request())
        return loss

    def _train_step(self, batch) -> float:
        """The back end's step (:meth:`train_step` without the schedule and the report)."""
        raise NotImplementedError

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
        if self.guard is not None:  # the job ends normally: no more beats (each rank, before the last barrier)
            self.guard.stop()
        if dist.is_initialized():
            dist.barrier()
            time.sleep(0.1)  # let gloo's workers drop the finished works' tensors first (see above)
            dist.destroy_process_group()
        if self.guard is not None:
            self.guard.release()  # rank 0: the watchdog's store server (plugin.watchdog.store)
            self.guard = None

    # ------------------------------------------------------------------ what a step reports
    def schedule_optimizer(self):
        """The torch optimizer whose param groups' ``lr`` the update reads (the lr schedule sets it there)."""
        return None

    def current_lr(self) -> float | None:
        opt = self.schedule_optimizer()
        return float(opt.param_groups[0]["lr"]) if opt is not None and opt.param_groups else None

    def grad_norm(self) -> float | None:
        """The global gradient norm before clipping that the back end computed for its last step (None: none)."""
        return getattr(self, "last_grad_norm", None)

    @property
    def meter(self):
        if self._meter is None:
            from ..monitor.meter import StepMeter

            self._meter = StepMeter(self.recipe, self.device, self.topology.world_size)
        return self._meter

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
        layout gives the losses of one process on the same dataset); tensor, pipeline and context peers get the same
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

    def to_inputs(self, inputs):
        """``inputs`` (a tensor or a dict of them) as the module takes them: on the engine's device, and floating
        tensors in :attr:`input_dtype` when the back end set one (integer token ids and masks are left as they are)."""
        def move(t):
            t = t.to(self.device, non_blocking=True)
            if self.input_dtype is not None and t.is_floating_point():
                t = t.to(self.input_dtype)
            return t

        return map_tensors(inputs, move)

    def call_model(self, module, inputs):
        """``module``'s output for ``inputs``: a transformers model gets a dict as keyword arguments and
        ``use_cache=False`` (in training HF would build a cache, and then reads packed ``position_ids`` otherwise);
        another model gets the tensor, or a dict's ``input_ids`` (the only key it can take)."""
        if isinstance(inputs, dict):
            if self.calls_with_kwargs:
                return module(**{"use_cache": False, **inputs})
            extra = sorted(set(inputs) - {"input_ids"})
            if extra:
                raise PluginError(f"a dict batch holds {extra}, but {type(self.module).__name__} is not a "
                                  "transformers model and takes input_ids only -> drop those keys (padding: label "
                                  "it -100, right-padded rows need no mask in a causal model)")
            return module(inputs["input_ids"])
        return module(inputs, use_cache=False) if self.calls_with_kwargs else module(inputs)

    def first_stage_input(self, inputs):
        """What a pipeline's first stage takes: a tensor (a dict's ``input_ids``) for a layer list, or for a
        transformers model's stage list (:mod:`plugin.models.hf_stages`) the tuple ``(input_ids, attention_mask
        int64 or [B, 1] when none, position_ids)`` that travels between its stages. Other keys are refused: only
        those tensors cross stage boundaries."""
        ids = inputs["input_ids"] if isinstance(inputs, dict) else inputs
        shape = tuple(ids.shape)
        # DeepSpeed sends activation shapes once and torch's schedules infer them on their first step: a batch of
        # another [rows, seq] later would fail deep inside (or mis-shape a buffer), so say it here
        seen = self.__dict__.setdefault("_stage_input_shape", shape)
        if seen != shape:
            raise PluginError(f"pipeline stages need every batch of one shape: the first had {list(seen)}, this one "
                              f"{list(shape)} -> pad every batch to one length (e.g. the recipe's seq_len)")
        if self.calls_with_kwargs:
            from ..models.hf_stages import first_stage_inputs

            return first_stage_inputs(inputs)
        if isinstance(inputs, dict):
            extra = sorted(set(inputs) - {"input_ids"})
            if extra:
                raise PluginError(f"a dict batch holds {extra}, but the pipeline's first stage takes input_ids only "
                                  "-> drop those keys")
            return inputs["input_ids"]
        return inputs

    def local_batch(self, batch, call: str | None = None):
        """This data rank's share of ``batch`` (given whole, or already split) as ``(inputs, labels)``, on the
        engine's device, its inputs as the module takes them (:meth:`to_inputs`); labels keep their dtype.

        It starts the data contract's check (:mod:`plugin.engines.data_contract`), on every layout: one collective
        that gives every rank every rank's fingerprint of what it was given and its share's target tokens. Rows that
        break the contract, or a wrong row count on any rank, raise
        :class:`~plugin.engines.data_contract.BatchMismatchError` on every rank before any update. A ``train_step``
        given the global batch (whose token count every rank knows) with the shapes of the last accepted one, on a
        back end that checks after its backward (:attr:`checks_rows_after_backward`), does not wait for it: the back
        end calls :meth:`rows_checked` after its backward, so the collective runs behind forward and backward.
        Otherwise (an ``eval_step``; a share, whose count the default loss needs summed over the data ranks: that
        sum is the same collective's; other shapes, which peers must not meet in a collective; DeepSpeed's pipeline,
        whose ``train_batch`` updates inside; Accelerate, which cannot drop a step) it waits here. Under context
        parallelism the share is then cut into this rank's chunks (:meth:`context_share`)."""
        call = call or ("train_step" if torch.is_grad_enabled() else "eval_step")  # every eval_step runs no_grad
        inputs, labels, convention = split_batch(batch)
        rows = rows_of(inputs)
        lay = self.layout
        local_rows = lay.micro_batch * lay.grad_accum
        given = (inputs, labels)
        wrong = rows not in (lay.global_batch, local_rows)
        inputs, labels, whole = self._share(inputs, labels)
        first = inputs if call == "train_step" and not wrong else None
        if not self.check_peer_rows:  # bench/data_contract.py's baseline: the loss's own count, as before the check
            if wrong:
                raise BatchMismatchError(f"{call} got {rows} rows; expected the global batch ({lay.global_batch}) or "
                                         f"this rank's share ({local_rows})")
            self._count_before_the_check(labels, convention, whole, first)
            return self._context_cut(inputs, labels, convention)
        shapes = shapes_of(given)
        later = (call == "train_step" and self.checks_rows_after_backward and rows == lay.global_batch
                 and self._accepted is not None and self._accepted[0] == shapes)
        tokens = torch.zeros((), dtype=torch.int64) if wrong else target_count(labels, convention)
        exchange = start_exchange(None if wrong else given, rows, tokens, self._suspect(first, labels, convention),
                                  self.topology, global_rows=lay.global_batch, local_rows=local_rows,
                                  device=self.device, deferred=later)
        if later:  # the verdict after the backward (rows_checked); the count is this batch's own
            self._rows = (exchange, call, convention, shapes, batch)
            self._give_loss(int(target_count(whole if whole is not None else labels, convention)), convention)
            return self._context_cut(inputs, labels, convention)
        verdict = exchange.finish(call)
        if verdict.error is None:
            self.prepare_loss(verdict.tokens, verdict.suspect, convention)
            if call == "train_step":
                self._accepted = (shapes, batch)
            return self._context_cut(inputs, labels, convention)
        if not verdict.deferred or self._accepted is None:
            raise verdict.error
        # Peers deferred their verdict: their batch has the last accepted shapes and they run forward and backward
        # now. Run the last accepted rows beside them, so that every collective meets its peer, and refuse with them
        # after the backward (rows_checked).
        self._rows = verdict.error
        inputs, labels, convention = split_batch(self._accepted[1])
        inputs, labels, whole = self._share(inputs, labels)
        self._give_loss(int(target_count(whole if whole is not None else labels, convention)), convention)
        return self._context_cut(inputs, labels, convention)

    def _share(self, inputs, labels):
        """``(inputs, labels, whole)``: this data rank's rows of what was given, on the engine's device; ``whole``
        the labels of the global batch when it was given (None for a share, and at data 1: nothing to cut)."""
        lay, whole = self.layout, None
        if rows_of(inputs) == lay.global_batch and lay.global_batch != lay.micro_batch * lay.grad_accum:
            whole = labels
            inputs, labels = shard_rows((inputs, labels), self.dp_rank, lay.data)
        inputs = map_tensors(inputs, lambda t: t.to(self.device, non_blocking=True))
        self._step_tokens = whole.numel() if whole is not None else labels.numel() * lay.data  # the global batch's
        return inputs, labels.to(self.device, non_blocking=True), whole

    def _context_cut(self, inputs, labels, convention: str):
        if self.layout.context > 1:  # after the verdict: the default loss's denominator is known
            inputs, labels = self.context_share(inputs, labels, convention)
        return self.to_inputs(inputs), labels

    @property
    def loss_replicas(self) -> int:
        """Over how many ranks the back end averages the summed gradients (and the loss): data x context. The
        default loss's denominator and :meth:`mean_over_data` divide by it, so every rank's loss is its tokens' share
        of the global batch's mean."""
        return self.layout.data * self.layout.context

    def context_share(self, inputs, labels, convention: str):
        """This context rank's chunks of the data share (:func:`plugin.context_parallel.batch.context_share`); the
        default loss then reads Hugging Face labels as shifted, since the cut shifted them first."""
        from ..context_parallel.batch import context_share

        inputs, labels = context_share(inputs, labels, convention == HF, self.groups.cp_rank, self.layout.context,
                                       positions=self.calls_with_kwargs)
        if convention == HF and hasattr(self.loss_fn, "prepare"):
            self.loss_fn.prepare(self.loss_fn.denominator, SHIFTED)
        return inputs, labels

    def rows_checked(self) -> None:
        """Take the data contract's verdict that :meth:`local_batch` deferred, and raise on every rank when the rows
        break it or their labels fail :meth:`check_labels` (after :meth:`discard_step`: nothing of the refused
        step is left to train on); then nothing is pending (a second call returns at once). A back end whose
        :attr:`checks_rows_after_backward` calls it after its (last) backward and before its update; every back end
        calls it before its update (a pipeline: before its schedule), so nothing is updated before the verdict;
        :meth:`train_step` asserts it did."""
        pending, self._rows = self._rows, None
        if pending is None:
            return
        try:
            if isinstance(pending, BatchMismatchError):  # this rank ran the last accepted rows beside its peers
                raise pending
            exchange, call, convention, shapes, batch = pending
            verdict = exchange.finish(call)
            if verdict.error is not None:
                raise verdict.error
            self.check_labels(verdict.tokens, verdict.suspect, convention)
        except PluginError:
            self.discard_step()
            raise
        self._accepted = (shapes, batch)

    def discard_step(self) -> None:
        """Drop what this step's backward left (gradients, a back end's accumulation state), so that a step refused
        after its backward changes nothing. A back end whose :attr:`checks_rows_after_backward` implements it."""
        raise NotImplementedError(f"{type(self).__name__} checks rows after its backward but cannot discard a step")

    def _suspect(self, inputs, labels, convention: str) -> int:
        """1 when the first train_step's (``inputs`` given) labels look like the other convention's, else 0."""
        return _convention_suspect(inputs, labels, convention) if inputs is not None and self.step_count == 0 else 0

    def _give_loss(self, n: int, convention: str) -> None:
        """The default loss's (one with ``prepare``) denominator for this step: ``N / (data x grad_accum)``."""
        if hasattr(self.loss_fn, "prepare"):
            self.loss_fn.prepare(n / (self.loss_replicas * self.layout.grad_accum), convention)

    def prepare_loss(self, n: int, suspect: int, convention: str) -> None:
        """:meth:`check_labels`, then give the default loss (one with ``prepare``) its denominator ``N / (data x
        grad_accum)``, ``N`` = ``n``, the non-ignored targets of the global batch."""
        self.check_labels(n, suspect, convention)
        self._give_loss(n, convention)

    def check_labels(self, n: int, suspect: int, convention: str) -> None:
        """For the default loss (one with ``prepare``): ``n``, the non-ignored targets of the global batch, and
        ``suspect``, whether any rank's labels looked like the other convention's, are the world's (the data
        contract's collective), so every rank raises alike: on ``n == 0``, and on the first ``train_step`` when the
        labels' convention looks wrong, since a wrong one trains without any error: tuple labels equal to the inputs
        (the model would learn to copy its input), or dict labels equal to ``input_ids`` shifted by one (shifted
        twice)."""
        if not hasattr(self.loss_fn, "prepare"):
            return
        if suspect and convention == HF:
            raise PluginError("the dict batch's labels look already shifted (labels[:, t] == input_ids[:, t + 1]): "
                              "dict batches take labels = input_ids, shifted inside the loss -> pass "
                              "labels=input_ids (-100 where nothing is to be predicted)")
        if suspect:
            raise PluginError("the batch's labels equal its inputs: (inputs, labels) tuples take labels already "
                              "shifted, so the model would learn to copy its input -> pass {'input_ids': x, "
                              "'labels': x} (shifted inside the loss), or (x[:, :-1], x[:, 1:])")
        if n == 0:
            raise PluginError(f"step {self.step_count + 1}: the global batch has no target token (every label is "
                              "-100" + (", and the shift drops each row's first label" if convention == HF else "")
                              + ") -> check the labels' padding")

    def micro_batch_modules(self) -> list:
        """The modules the back end runs once per micro-batch (the hang guard's phase hooks sit on them): the model;
        a pipelined back end's local stages."""
        return [self.module]

    def _count_before_the_check(self, labels, convention: str, whole, inputs) -> None:
        """What the loss's count cost before the data contract carried it (``check_peer_rows`` off, the bench's
        baseline): counted on ``whole`` (or at data 1), else this share's count summed over the data group."""
        if not hasattr(self.loss_fn, "prepare"):
            return
        if whole is not None or self.layout.data == 1:
            n = int(target_count(whole if whole is not None else labels, convention))
            suspect = self._suspect(inputs, labels, convention)
        else:
            count = torch.stack([target_count(labels, convention).to(self.device),
                                 torch.tensor(self._suspect(inputs, labels, convention), dtype=torch.int64,
                                              device=self.device)])
            dist.all_reduce(count, group=self.groups.data_group)
            n, suspect = (int(v) for v in count.tolist())
        self.prepare_loss(n, suspect, convention)

    def micro_batches(self, batch, call: str | None = None) -> list:
        return micro_batches(self.local_batch(batch, call), self.layout.grad_accum)

    def mean_over_data(self, value: torch.Tensor) -> float:
        """Average a per-rank scalar over the data-parallel group (tensor/pipeline peers hold the same); with a context
        axis, sum over data x context and divide by :attr:`loss_replicas` (each context rank's loss is its share)."""
        return self.start_mean_over_data(value)()

    def start_mean_over_data(self, value: torch.Tensor) -> Callable[[], float]:
        """Start averaging a per-rank scalar over the data-parallel group without waiting; the returned
        function waits and gives the float. Started before a backward pass, the reduction hides behind it."""
        value = value.detach().float().reshape(1).to(self.device)
        if self.layout.data * self.layout.context == 1:
            return lambda: float(value.item())
        work = dist.all_reduce(value, group=self.groups.data_context_group, async_op=True)

        def finish() -> float:
            work.wait()
            return float(value.item()) / self.loss_replicas

        return finish

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer states (see each back end)."""
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        lay = self.layout
        return {"backend": self.backend, "data": lay.data, "tensor": lay.tensor, "pipeline": lay.pipeline,
                "context": lay.context, "zero": self.recipe.zero.stage, "precision": self.recipe.precision,
                "global_batch": lay.global_batch, "micro_batch": lay.micro_batch, "grad_accum": lay.grad_accum}
