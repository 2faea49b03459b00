"""From a checked recipe and a model to a running engine.

:mod:`.initialize` (``initialize(model, recipe)``: the checks, then the chosen back end's build),
:mod:`.choose` (pure: which back end), :mod:`.model_checks` (the model against the recipe), :mod:`.context`
(:class:`~.context.BuildContext`, the one argument of every back end's ``build``), :mod:`.base` (the
:class:`~.base.Engine` interface) with :mod:`.batches` and :mod:`.data_contract` (splitting a batch; the peers'
rows check), :mod:`.precision`, :mod:`.optim`, :mod:`.memory`, :mod:`.rng_state` and :mod:`.shm`. The back ends,
each imported only when chosen: :mod:`.deepspeed` (DeepSpeed ZeRO and PipelineModule), :mod:`.native`
(DDP / ZeroRedundancyOptimizer / FSDP2, torch.distributed.pipelining) and :mod:`.accelerate` (Accelerate's own
Accelerator)."""
