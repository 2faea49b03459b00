"""ZeRO-2 on whole parameters, as DeepSpeed's stage 2 keeps them: each data rank computes with the whole parameters,
but keeps the gradient and the optimizer states of its own rows only.

Every trainable parameter is cut into row chunks over the data group (dim 0, ``torch.chunk``'s split, FSDP2's
``Shard(0)``): rank ``r`` owns rows ``[r c, r c + n_r)``, ``c = ceil(rows / D)``. Per step:

* backward: the parameters are grouped into buckets (reverse registration order, the order backward reaches them,
  at most :data:`BUCKET_ELEMENTS` each); once every gradient of a bucket is in (``post_accumulate_grad`` hooks) its
  gradients are copied rank by rank into one buffer (``torch._chunk_cat``, FSDP2's copy-in), freed, and the buffer
  reduce-scattered asynchronously, buckets started in one order on every rank. After the micro-batch's backward
  :meth:`RowShards.reduce` starts what is left (a parameter without a gradient on this rank contributes zeros),
  waits, and adds this rank's rows, divided by ``D``, to its gradient shard. So the whole gradients live a bucket
  at a time, and only this rank's rows stay through the accumulation (DeepSpeed's ``reduce_scatter`` path);
* the update: the optimizer steps views of this rank's rows of the parameters, their gradients views of the shard
  (fp32 whole parameters are their own masters: bf16 / fp16 compute under autocast, as ZeRO-0/1 natively);
* :meth:`RowShards.gather`: one all-gather per bucket brings every rank the others' updated rows.

Collectives per step: one reduce-scatter per bucket and micro-batch, one all-gather per bucket; the reference GPT
of the ``cpu_*`` recipes is one bucket. FSDP2 with ``reshard_after_forward=False`` made one all-gather and one
reduce (an all-reduce on gloo) per block and per step, and stepped DTensors (``bench/native_vs_deepspeed.py``).

Checkpoints: :meth:`RowShards.pieces` gives a row view its box of the TP-local tensor, so each rank writes and reads
its rows of the parameters and of the optimizer states (the checkpoint room's format, any layout); after a load,
:meth:`gather` refreshes the other rows.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...errors import PluginError

# torch 2.13 names them *_single (and deprecates the *_tensor names the older releases have)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
BUCKET_ELEMENTS = 2 ** 25  # gradients whole at once at most (128 MiB in fp32): DDP's idea, fewer, larger buckets


class _Slot:
    """One parameter: its rows, the elements per row, the chunk of rows each rank owns, this rank's row view."""

    def __init__(self, param: nn.Parameter, rank: int, world: int):
        self.param = param
        self.rows = param.shape[0] if param.dim() else 1
        self.inner = param.numel() // self.rows
        self.chunk = -(-self.rows // world)  # rows per rank, the last ones short or empty (torch.chunk's split)
        self.mine = max(0, min(self.chunk, self.rows - rank * self.chunk))
        self.first_row = rank * self.chunk
        if not param.is_contiguous():  # internal invariant: the row view must be the parameter's own memory
            raise PluginError(f"ZeRO-2: a parameter of shape {list(param.shape)} is not contiguous")
        rows = param.detach().reshape(self.rows, self.inner)[self.first_row:self.first_row + self.mine]
        shape = (self.mine, *param.shape[1:]) if param.dim() else (() if self.mine else (0,))
        self.shard = rows.view(shape)  # a view: the optimizer's step writes this rank's rows of the parameter
        self.offset = 0  # in its bucket's per-rank region (set by _Bucket)

    @property
    def width(self) -> int:
        """Elements of one rank's chunk, padding included."""
        return self.chunk * self.inner


class _Bucket:
    def __init__(self, slots: list[_Slot]):
        self.slots = slots
        offset = 0
        for s in slots:
            s.offset, offset = offset, offset + s.width
        self.region = offset  # elements each rank receives
        self.ready: set[int] = set()
        self.pending = None  # (work, send buffer, received) while a reduce-scatter runs
        self.grad: torch.Tensor | None = None  # this rank's rows of the gradients, summed over the micro-batches


class RowShards:
    """The trainable parameters of ``module`` cut into row shards over ``group`` (see the module docstring)."""

    def __init__(self, module: nn.Module, group, *, bucket_elements: int = BUCKET_ELEMENTS):
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        params = [p for p in module.parameters() if p.requires_grad and p.numel()]
        self.slots = {id(p): _Slot(p, self.rank, self.world) for p in params}
        self.buckets: list[_Bucket] = []
        current, size, key = [], 0, None
        for p in reversed(params):  # backward reaches the last layers first
            slot = self.slots[id(p)]
            if current and (size + slot.width * self.world > bucket_elements or (p.dtype, p.device) != key):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(slot)
            size, key = size + slot.width * self.world, (p.dtype, p.device)
        if current:
            self.buckets.append(_Bucket(current))
        self.bucket_of = {id(s.param): b for b in self.buckets for s in b.slots}
        self.started = 0  # buckets whose reduce-scatter this backward has started, in order
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # ------------------------------------------------------------------ what the optimizer and the checkpoint see
    def shards(self) -> list[torch.Tensor]:
        """This rank's row views, one per trainable parameter (in the module's order): what the optimizer steps."""
        return [s.shard for s in self.slots.values()]

    def shard_of(self, param: torch.Tensor) -> torch.Tensor | None:
        slot = self.slots.get(id(param))
        return None if slot is None else slot.shard

    # ------------------------------------------------------------------ backward: gradients into row shards
    def _on_grad(self, param: torch.Tensor) -> None:
        bucket = self.bucket_of[id(param)]
        if id(param) in bucket.ready or bucket.pending is not None:
            raise PluginError(f"ZeRO-2: the gradient of a parameter of shape {list(param.shape)} was accumulated "
                              "twice in one backward (a reentrant checkpoint around a shared weight?) -> use "
                              "non-reentrant checkpointing or ZeRO-3")
        bucket.ready.add(id(param))
        while self.started < len(self.buckets) and \
                len(self.buckets[self.started].ready) == len(self.buckets[self.started].slots):
            self._start(self.buckets[self.started])
            self.started += 1

    def _start(self, bucket: _Bucket) -> None:
        grads = [s.param.grad if s.param.grad is not None else torch.zeros_like(s.param) for s in bucket.slots]
        send = torch._chunk_cat([g.reshape(s.rows, s.inner) for g, s in zip(grads, bucket.slots, strict=True)],
                                0, self.world)  # [world, region]: rank j's chunks of every gradient, padded
        for s in bucket.slots:
            s.param.grad = None
        received = send.new_empty(bucket.region)
        work = _reduce_scatter(received, send.view(-1), group=self.group, async_op=True)
        bucket.pending = (work, send, received)

    def reduce(self) -> None:
        """After a micro-batch's backward: start the buckets not started yet (in order), wait for every
        reduce-scatter, and add this rank's rows (averaged over the group) to its gradient shards."""
        for bucket in self.buckets[self.started:]:
            self._start(bucket)
        self.started = 0
        for bucket in self.buckets:
            work, _, received = bucket.pending
            work.wait()
            received.div_(self.world)
            bucket.pending, bucket.ready = None, set()
            if bucket.grad is None:
                bucket.grad = received
                for s in bucket.slots:
                    s.shard.grad = received.narrow(0, s.offset, s.mine * s.inner).view(s.shard.shape)
            else:
                bucket.grad.add_(received)

    # ------------------------------------------------------------------ after the update: the rows everywhere
    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's rows to every rank (after the optimizer's step, or a load); the gradient shards are
        dropped (the optimizer's ``zero_grad`` has let go of its views)."""
        for bucket in self.buckets:
            bucket.grad = None
            mine = torch.empty(bucket.region, dtype=bucket.slots[0].param.dtype, device=bucket.slots[0].param.device)
            for s in bucket.slots:
                mine.narrow(0, s.offset, s.mine * s.inner).copy_(s.shard.reshape(-1))
            every = mine.new_empty(self.world * bucket.region)
            _all_gather(every, mine, group=self.group)
            every = every.view(self.world, bucket.region)
            for s in bucket.slots:
                whole = s.param.detach().view(-1)
                chunks = every.narrow(1, s.offset, s.width)
                if s.rows == s.chunk * self.world:  # no padding: one copy
                    whole.view(self.world, s.width).copy_(chunks)
                    continue
                for j in range(self.world):
                    n = max(0, min(s.chunk, s.rows - j * s.chunk)) * s.inner
                    if n:
                        whole.narrow(0, j * s.width, n).copy_(chunks[j, :n])

    def drop_grads(self) -> None:
        """Forget this step's gradient shards (a step refused after its backward: nothing of it is kept)."""
        for bucket in self.buckets:
            bucket.grad = None
            for s in bucket.slots:
                s.shard.grad = None

    # ------------------------------------------------------------------ checkpoints
    def pieces(self, param: torch.Tensor, t: torch.Tensor, segments) -> list:
        """``t`` (this rank's row view of ``param``, or an optimizer state shaped like it; ``param`` itself when it
        is not sharded) as checkpoint pieces: its box in the TP-local ``param``, composed with the tensor-parallel
        ``segments`` (:func:`plugin.checkpoint.boxes.tp_segments`)."""
        from ...checkpoint.boxes import compose

        if t.numel() == 0:
            return []
        slot = self.slots.get(id(param))
        first = 0 if slot is None else slot.first_row
        offsets = (first,) + (0,) * (t.dim() - 1) if param.dim() else ()
        return compose([(offsets, t.detach())], segments)

    def optimizer(self, module: nn.Module, recipe, decay) -> torch.optim.Optimizer:
        """The recipe's optimizer over this rank's row views, grouped by ``decay`` as the whole parameters are."""
        from ..optim import optimizer_class_and_kwargs

        cls, kwargs = optimizer_class_and_kwargs(recipe.optimizer)
        groups = decay.groups(module.parameters(), recipe.optimizer.weight_decay)
        for group in groups:
            group["params"] = [self.slots[id(p)].shard for p in group["params"] if id(p) in self.slots]
        return cls([g for g in groups if g["params"]], **kwargs)

