"""Context parallelism: the sequence split over the ranks of a context group, attention exact across the split.

Each context rank holds two chunks of every row's sequence (:mod:`.chunks`: chunk i and 2C-1-i of 2C, the causal
work balanced); the model's attention calls :func:`context_attention` (:mod:`.attention`), which attends every
query to the whole sequence by ring (:mod:`.ring`: keys and values passed around point-to-point, partials merged
by log-sum-exp) or by all-to-all (:mod:`.ulysses`); the collectives are :mod:`.comm`'s. :mod:`.batch` cuts an
engine's batch into this rank's chunks, :mod:`.apply` tells a model (the reference GPT, a transformers model
through its attention interface, :mod:`.hf`) that it runs split.
"""
from .attention import ContextParallelContext, context_attention, context_rng
from .chunks import chunk_ids, local_positions, natural_order, take_chunks
from .errors import ContextParallelError

__all__ = ["ContextParallelContext", "context_attention", "context_rng", "chunk_ids", "local_positions",
           "natural_order", "take_chunks", "ContextParallelError"]
