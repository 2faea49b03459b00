"""Pipeline stages' shape metadata across simulated ranks.

Stages exchange their tensors' metadata once, on their first step (``recv_object_list``: pickled objects, whose
bytes meta tensors cannot carry). :class:`StageMetadata` hands a stage's forward metadata to the next stage's
simulation (ranks are simulated in rank order, stage by stage; the data coordinate does not change it), and answers
the backward metadata as a stage without user-given shapes derives it: the gradients of its outputs, shaped as the
outputs.
"""
from __future__ import annotations

import contextlib

import torch.distributed as dist


class MissingStage(RuntimeError):
    """A pipeline stage's simulation needs the forward metadata of the stage before it, not simulated yet."""


class StageMetadata:
    """What pipeline stages would send each other as pickled objects on their first step, kept across the
    simulated ranks of one dry run: keyed by (from stage, to stage, the rank's place within its stage)."""

    def __init__(self) -> None:
        self.forward: dict = {}

    @contextlib.contextmanager
    def patched(self, inner: int):
        """Inside: ``PipelineStage``'s metadata send and receive go through this object; ``inner`` is the number of
        ranks of one stage of one replica (tensor x context), so that ``rank % inner`` is a rank's place."""
        from torch.distributed.pipelining import stage as stage_module
        from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

        cls = stage_module.PipelineStage
        send, recv = cls._send_meta, cls._recv_meta
        forward = self.forward

        def send_meta(stage, meta, dst_stage):
            if isinstance(meta, _StageForwardMeta):
                forward[(stage.stage_index, dst_stage, dist.get_rank() % inner)] = meta

        def recv_meta(stage, src_stage):
            if src_stage > stage.stage_index:  # the backward metadata: the gradients of this stage's outputs
                return _StageBackwardMeta(backward_metas=stage_module._derive_grad_metas(stage._stage_meta.outputs))
            key = (src_stage, stage.stage_index, dist.get_rank() % inner)
            if key not in forward:
                raise MissingStage(f"pipeline stage {stage.stage_index} takes its input shapes from stage {src_stage}, "
                                   "which this dry run has not simulated yet")
            return forward[key]

        cls._send_meta, cls._recv_meta = send_meta, recv_meta
        try:
            yield
        finally:
            cls._send_meta, cls._recv_meta = send, recv
