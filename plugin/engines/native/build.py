"""The native back end's entry: ``build(ctx)`` (the one argument of every back end's build, :mod:`..context`).

It says why it trains under ``accelerate launch`` (rank 0, one line), cuts a pipeline's stages before any process
group exists (so every rank refuses a bad cut alike), joins the rendezvous, builds the groups, then hands the
model to :mod:`.pipeline` (pipeline > 1) or :mod:`.data_parallel`.
"""
from __future__ import annotations

import os
import sys

from ...distributed.groups import build_groups
from ...pipeline_parallel.checks import check_stage_cut
from ..context import BuildContext
from .common import NativeEngine, init_process_group, why_not_accelerate
from .data_parallel import build_data_parallel
from .pipeline import build_pipeline, virtual_stages


def build(ctx: BuildContext) -> NativeEngine:
    """Shard ``ctx.model`` per ``ctx.recipe`` on torch's own machinery."""
    recipe, layout, device = ctx.recipe, ctx.layout, ctx.device
    note = why_not_accelerate(recipe, os.environ, device.type == "cuda") if ctx.env.is_main else None
    if note:
        print(note, file=sys.stderr, flush=True)
    bounds = ties = None
    if layout.pipeline > 1:  # counted on the whole model, before tensor sharding, as DeepSpeed counts them
        bounds, ties = check_stage_cut(ctx.layers_of(ctx.model), recipe.pipeline_parallel.partition,
                                       layout.pipeline * virtual_stages(recipe), "torch.distributed.pipelining",
                                       pipeline=layout.pipeline)
    init_process_group(device, ctx.pg_timeout)
    ctx.joined()  # the hang guard starts, and checks that every rank runs this recipe at this layout
    groups = build_groups(ctx.topology, timeout=ctx.pg_timeout)
    if layout.pipeline > 1:
        return build_pipeline(ctx, groups, bounds, ties)
    return build_data_parallel(ctx, groups)
