"""Cutting an ordered list of layers into pipeline stages: pure arithmetic, no torch.

The recipe's ``pipeline_parallel.partition`` has DeepSpeed's ``PipelineModule`` meaning, and the cuts are
the ones DeepSpeed 0.19 makes (``deepspeed.runtime.utils.partition_uniform`` / ``partition_balanced``,
ported here so the native back end needs no deepspeed; a unit test pins them against DeepSpeed):

* ``"uniform"``: equal numbers of layers per stage (the first ``n % parts`` stages get one more).
* ``"parameters"``: stages balanced by trainable parameter count (the linear-partition dynamic
  programme minimising the spread between the heaviest and the lightest stage), counted on the
  whole model, before tensor-parallel sharding, as DeepSpeed counts them.
* ``"type:REGEX"``: balanced by the number of layers whose class name matches REGEX (case-insensitive,
  searched anywhere in the name, like DeepSpeed's ``type:`` method): ``"type:Block"`` spreads transformer
  blocks evenly and lets the embedding and head ride along.

A cut is a list of ``parts + 1`` boundaries: stage ``s`` holds layers ``[bounds[s], bounds[s + 1])``.
With ``virtual`` model chunks per rank (interleaved 1F1B) the layers are cut into ``pipeline x virtual``
stages and rank ``r`` of the pipeline group holds stages ``r, r + pipeline, r + 2 x pipeline, ...``
(the "loop" placement torch.distributed.pipelining's interleaved schedules expect).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..errors import PluginError


class PartitionError(PluginError):
    """A layer list cannot be cut as the recipe asks (the message says what to change)."""


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_items`` cut into ``num_parts`` runs of (nearly) equal length; the first
    ``num_items % num_parts`` runs get one more.

    >>> partition_uniform(10, 4)
    [0, 3, 6, 8, 10]
    """
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    parts = [p * chunk for p in range(num_parts + 1)]
    for i in range(residual):
        for j in range(i + 1, num_parts + 1):
            parts[j] += 1
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of ``weights`` cut into ``num_parts`` contiguous runs, minimising (heaviest - lightest).

    The same dynamic programme, tie-breaking included, as ``deepspeed.runtime.utils.partition_balanced``.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)
    dp_max[0][0] = 0
    dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], run)
                min_sum = min(dp_min[k][j - 1], run)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    parts.reverse()
    return parts


def type_weights(method: str, layer_types: Sequence[str]) -> list[int]:
    """1 for each layer whose class name matches the regex after ``type:``, else 0."""
    pattern = method.split(":", 1)[1]
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise PartitionError(f'partition "{method}": invalid regular expression ({e}) -> write "type:" '
                             'followed by a regex of layer class names, e.g. "type:Block"') from None
    weights = [1 if regex.search(name) else 0 for name in layer_types]
    if not any(weights):
        names = ", ".join(sorted(set(layer_types)))
        raise PartitionError(f'partition "{method}" matches none of the layer classes ({names}) -> use a '
                             'regex that matches the repeated layer, or "parameters"')
    return weights


def stage_bounds(method: str, layer_types: Sequence[str], param_counts: Sequence[int], num_stages: int) -> list[int]:
    """Boundaries of ``num_stages`` stages over the layers described by their class names and parameter counts.

    ``"type:Block"`` balances the blocks and lets the embedding and the head ride along:

    >>> stage_bounds("type:Block", ["Embed", "Block", "Block", "Block", "Block", "Head"], [10, 1, 1, 1, 1, 10], 2)
    [0, 3, 6]
    """
    if len(layer_types) != len(param_counts):
        raise ValueError("layer_types and param_counts must describe the same layers")
    n = len(layer_types)
    if n < num_stages:
        raise PartitionError(f"{n} layers cannot fill {num_stages} pipeline stages -> use pipeline x "
                             f"virtual_stages <= {n}")
    name = method.lower()
    if name == "uniform":
        bounds = partition_uniform(n, num_stages)
    elif name == "parameters":
        bounds = partition_balanced(list(param_counts), num_stages)
    elif name.startswith("type:"):
        bounds = partition_balanced(type_weights(method, layer_types), num_stages)
    else:
        raise PartitionError(f'unknown partition method "{method}" -> use "parameters", "uniform" or "type:REGEX"')
    return bounds  # with at least as many layers as stages, every stage gets one


def stages_of_rank(pp_rank: int, pp_size: int, virtual: int = 1) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds: ``pp_rank + i * pp_size`` for each virtual chunk.

    >>> stages_of_rank(1, pp_size=4, virtual=2)
    [1, 5]
    """
    if not 0 <= pp_rank < pp_size or virtual < 1:
        raise ValueError(f"pp_rank {pp_rank} of {pp_size}, virtual {virtual}")
    return [pp_rank + i * pp_size for i in range(virtual)]


def describe_cut(bounds: Sequence[int], layer_types: Sequence[str]) -> list[str]:
    """One line per stage: ``stage 0: layers 0-2 (EmbeddingLayer, Block, Block)``."""
    lines = []
    for s in range(len(bounds) - 1):
        lo, hi = bounds[s], bounds[s + 1]
        lines.append(f"stage {s}: layers {lo}-{hi - 1} ({', '.join(layer_types[lo:hi])})")
    return lines
