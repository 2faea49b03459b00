"""The silent-wrong-result guard of meta init: every rank must fill its part under the same seed.

Each rank materialises only its own pieces, each from a generator seeded by ``(seed, qualified name)``; a rank with
another seed (``torch.manual_seed(rank)`` before ``initialize``, a per-rank ``seed=``) would train a model no
process ever built whole, and exit 0. One all-gather of one int64 per rank at ``initialize`` finds it; every rank
then raises the same :class:`~plugin.errors.PluginError`, naming the ranks and their seeds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import PluginError


def _to_int64(seed: int) -> int:
    """``seed`` (a uint64, as ``torch.initial_seed()`` may return) as the int64 with the same 64 bits."""
    return (int(seed) + 2**63) % 2**64 - 2**63


def check_same_seed(seed: int, device: torch.device, group=None) -> None:
    """Raise on every rank of ``group`` (default: the world) when the ranks' meta-init seeds differ; a no-op
    without a process group or with one rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor([_to_int64(seed)], dtype=torch.int64, device=device)
    seeds = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seeds, mine, group=group)
    values = [int(s.item()) % 2**64 for s in seeds]
    if len(set(values)) == 1:
        return
    by_seed: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        by_seed.setdefault(value, []).append(dist.get_global_rank(group, rank) if group is not None else rank)
    listed = "; ".join(f"seed {value} on rank(s) {', '.join(map(str, ranks))}" for value, ranks in by_seed.items())
    raise PluginError(
        f"initialize: the model is on the meta device, so every rank fills its own part from the init seed, but "
        f"the ranks have different seeds ({listed}): their parts would come from models no process ever built "
        "whole -> pass the same initialize(..., seed=S) on every rank, or call torch.manual_seed(S) with the same "
        "S everywhere (not a rank-dependent seed) before initialize")
