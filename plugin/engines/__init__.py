"""Back ends behind one :class:`~plugin.engines.base.Engine` interface, each imported only when chosen:
:mod:`plugin.engines.deepspeed` (DeepSpeed ZeRO and PipelineModule) and :mod:`plugin.engines.native`
(DDP / ZeroRedundancyOptimizer / FSDP2 and torch.distributed.pipelining)."""
