"""Cutting layers into stages (plugin.pipeline_parallel.stages): DeepSpeed's cuts, pinned against DeepSpeed where
installed."""
import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugin.pipeline_parallel.stages import (
    PartitionError,
    partition_balanced,
    partition_uniform,
    stage_bounds,
    stages_of_rank,
    type_weights,
)

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
GPT = ["EmbeddingLayer", "Block", "Block", "Block", "Block", "HeadLayer"]
GPT_PARAMS = [12288, 49984, 49984, 49984, 49984, 8320]


def test_uniform():
    assert partition_uniform(6, 2) == [0, 3, 6]
    assert partition_uniform(6, 4) == [0, 2, 4, 5, 6]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]


def test_methods_on_the_reference_gpt():
    assert stage_bounds("uniform", GPT, GPT_PARAMS, 2) == [0, 3, 6]
    assert stage_bounds("parameters", GPT, GPT_PARAMS, 2) == [0, 3, 6]
    assert stage_bounds("type:Block", GPT, GPT_PARAMS, 2) == partition_balanced([0, 1, 1, 1, 1, 0], 2)
    assert stage_bounds("type:block", GPT, GPT_PARAMS, 4)[1:-1] == [2, 3, 4]  # case-insensitive


def test_errors_say_what_to_change():
    with pytest.raises(PartitionError, match="matches none of the layer classes"):
        type_weights("type:Conv", GPT)
    with pytest.raises(PartitionError, match="invalid regular expression"):
        type_weights("type:(", GPT)
    with pytest.raises(PartitionError, match="cannot fill 8 pipeline stages"):
        stage_bounds("uniform", GPT, GPT_PARAMS, 8)
    assert stage_bounds("type:HeadLayer", GPT, GPT_PARAMS, 3) == [0, 4, 5, 6], "never an empty stage"


def test_interleaved_placement():
    assert stages_of_rank(0, 2, 2) == [0, 2] and stages_of_rank(1, 2, 2) == [1, 3]
    assert stages_of_rank(3, 4) == [3]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=12), st.integers(1, 6))
def test_same_cuts_as_deepspeed(weights, parts):
    from deepspeed.runtime import utils

    assert partition_balanced(weights, parts) == list(utils.partition_balanced(weights, parts))
    assert partition_uniform(len(weights), parts) == list(utils.partition_uniform(len(weights), parts))


def test_weights_tied_across_stages_are_named():
    """A weight tied across stages is held by each stage: the engines keep the copies equal (see checks.py)."""
    from plugin.models.gpt import GPT, GPTConfig
    from plugin.pipeline_parallel.checks import Tie, ties_across_stages

    tied = GPT(GPTConfig(vocab=16, hidden=8, layers=2, heads=2, seq_len=4, tie_embeddings=True)).to_layers()
    assert ties_across_stages(tied, [0, 2, 4]) == [Tie((0, 3), ("embed.weight", "head.weight"), (0, 1))]
    assert ties_across_stages(tied, [0, 4]) == []
