"""Back ends behind one :class:`~plugin.engines.base.Engine` interface, each imported only when chosen
(:func:`plugin.engine.choose_backend`): :mod:`plugin.engines.deepspeed` (DeepSpeed ZeRO and PipelineModule),
:mod:`plugin.engines.native.data_parallel` (DDP / ZeroRedundancyOptimizer / FSDP2, and :mod:`.native_pipeline` for
torch.distributed.pipelining) and :mod:`plugin.engines.accelerate_engine` (Accelerate's own Accelerator)."""
