"""The native back end, on PyTorch's own machinery (no DeepSpeed): :mod:`.build` (its ``build(ctx)``),
:mod:`.data_parallel` (pipeline 1: DDP, ZeroRedundancyOptimizer or FSDP2 over the data group), :mod:`.fsdp` (FSDP2's
units and sharding), :mod:`.pipeline` (torch.distributed.pipelining stages), :mod:`.common` (what they share: the
optimizer step, the one DDP wrap, the fp16 scaler) and :mod:`.state` (checkpoints)."""
