"""initialize() refuses, before any process group exists, what would fail minutes later."""
import pytest
import torch

import plugin
from plugin.engines.initialize import choose_backend, layers_of
from plugin.errors import PluginError, RecipeError
from plugin.models.gpt import GPT, GPTConfig
from plugin.recipe.checks import load_recipe

pytestmark = pytest.mark.nods  # also in the venv without deepspeed: the back end chosen where deepspeed is missing


@pytest.fixture
def launched_as(monkeypatch):
    def launched(world):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
    return launched


def test_world_size_mismatch(launched_as, capsys):
    launched_as(2)
    with pytest.raises(RecipeError) as e:
        plugin.initialize(torch.nn.Linear(2, 2), "cpu_dp4")
    assert "but the launcher runs 2" in str(e.value)
    assert "launch 4 processes" in capsys.readouterr().err, "rank 0 prints the problem"
    assert not torch.distributed.is_initialized()


def test_model_dims_against_the_recipe(launched_as):
    launched_as(4)
    model = GPT(GPTConfig(vocab=128, hidden=66, layers=4, heads=3, seq_len=64))
    with pytest.raises(RecipeError) as e:
        plugin.initialize(model, "cpu_tp2_dp2")
    text = str(e.value)
    assert "model GPT has heads 3, not divisible by tensor 2" in text
    assert not torch.distributed.is_initialized()


def test_explicit_world_size_must_match(launched_as):
    launched_as(4)
    with pytest.raises(RecipeError, match="initialize\\(world_size=8\\)"):
        plugin.initialize(torch.nn.Linear(2, 2), "cpu_dp4", world_size=8)


def test_backend_choice():
    import importlib.util

    has_ds = importlib.util.find_spec("deepspeed") is not None
    assert choose_backend(load_recipe("cpu_dp4")) == ("deepspeed" if has_ds else "native")
    data = load_recipe("cpu_tp2_pp2").to_dict()
    data["pipeline_parallel"]["schedule"] = "gpipe"
    assert choose_backend(plugin.Recipe.from_dict(data)) == "native"
    data["launcher"] = "torchrun"
    assert choose_backend(plugin.Recipe.from_dict(data)) == "native"


def test_layers_of():
    model = GPT(GPTConfig(vocab=16, hidden=8, layers=2, heads=2, seq_len=4))
    assert len(layers_of(model)) == 4
    assert len(layers_of(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))) == 2
    with pytest.raises(PluginError, match="ordered list of layers"):
        layers_of(torch.nn.Linear(2, 2))


def test_a_list_of_layers_is_one_module_for_every_back_end():
    from plugin.engines.initialize import as_module

    layers = [torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1)]
    for given in (layers, tuple(layers)):
        module = as_module(given)
        assert isinstance(module, torch.nn.Sequential) and all(a is b for a, b in zip(module, layers, strict=True))
        assert module.to(torch.device("cpu")) is module  # what a back end does with it at pipeline 1
        assert layers_of(module) == layers  # and a pipeline cuts the very same layer objects
    model = torch.nn.Linear(2, 2)
    assert as_module(model) is model
    with pytest.raises(PluginError, match="holding function -> every layer must be an nn.Module"):
        as_module([torch.nn.Linear(2, 2), lambda x: x])


def test_initialize_wraps_a_list_before_the_back_end_sees_it(launched_as):
    """The wrap is initialize's own (before the back end is chosen); a layer list that cannot be one module is
    refused before any process group."""
    launched_as(4)
    with pytest.raises(PluginError, match="every layer must be an nn.Module"):
        plugin.initialize([torch.nn.Linear(2, 2), lambda x: x], "cpu_dp4")
    assert not torch.distributed.is_initialized()


def test_shared_parameters_across_stages_are_named():
    from plugin.pipeline_parallel.checks import Tie, cut_layers, ties_across_stages

    embed, mid, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = embed.weight
    layers = [embed, mid, head]
    assert ties_across_stages(layers, [0, 2, 3]) == [Tie((0, 2), ("weight", "weight"), (0, 1))]
    assert ties_across_stages(layers, [0, 3]) == []  # one stage holds both: still tied
    assert cut_layers(layers, "uniform", 2) == [0, 2, 3]


def test_weights_tied_across_stages_are_found_with_their_holders():
    """The reference GPT's tied embedding and head: one tie between the first and the last stage."""
    from plugin.pipeline_parallel.checks import Tie, check_stage_cut

    recipe = load_recipe("cpu_pp2_dp2")
    layers = GPT(GPTConfig.from_recipe_model(recipe.model, tie_embeddings=True)).to_layers()
    bounds, ties = check_stage_cut(layers, "uniform", 2, "test")
    n = len(layers) - 1
    assert ties == [Tie((0, n), ("embed.weight", "head.weight"), (0, 1))] and ties[0].ranks(2) == (0, 1)
    assert check_stage_cut(layers, "uniform", 1, "test")[1] == []  # one stage holds both: nothing to keep equal


def test_a_tie_two_stages_of_one_rank_would_hold_is_refused():
    """Interleaved stages 0 and 2 sit on pipeline rank 0 of 2: one copy per rank cannot serve both."""
    from plugin.pipeline_parallel.checks import check_stage_cut

    embed, mid = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4)
    head, out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)
    head.weight = embed.weight
    with pytest.raises(PluginError, match=r"tied across pipeline stages \[0, 2\] \(Embedding \(layer 0\).weight, "
                                          r"Linear \(layer 2\).weight\) would sit twice on one pipeline rank of 2"):
        check_stage_cut([embed, mid, head, out], "uniform", 4, "torch.distributed.pipelining", pipeline=2)
    assert check_stage_cut([embed, mid, head, out], "uniform", 2, "test")[1][0].stages == (0, 1)


def test_deepspeed_refuses_a_layer_in_two_ties():
    """One TiedLayerSpec key per layer: a layer holding weights tied to two different layers is named."""
    from plugin.engines.deepspeed.tied import check_ties
    from plugin.pipeline_parallel.checks import ties_across_stages

    a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight, c.bias = a.weight, a.bias  # a's weight tied to b, its bias to c
    layers = [a, b, c]
    ties = ties_across_stages(layers, [0, 1, 2, 3])
    assert len(ties) == 2
    with pytest.raises(PluginError, match=r"Linear \(layer 0\) holds weights tied to different layers"):
        check_ties(ties, layers)
