"""Meta-built models materialised unit by unit (plugin.materialize), on one process: the values equal the eager
build's, ties and the plan's marks survive, a layout that skips or cuts units changes nothing else, and a module
that cannot be filled on meta is refused with its name and the fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from plugin.errors import PluginError
from plugin.materialize import capture, materialize
from plugin.materialize.seeds import unit_seed
from plugin.models.gpt import GPT, GPTConfig


def _cfg(**kw):
    return GPTConfig(**{"vocab": 97, "hidden": 16, "layers": 2, "heads": 4, "kv_heads": 2, "seq_len": 8, **kw})


def _meta_gpt(cfg):
    with torch.device("meta"):
        return GPT(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_a_meta_gpt_materialised_equals_the_eager_gpt_of_the_same_seed(tied):
    cfg = _cfg(tie_embeddings=tied)
    torch.manual_seed(5)
    eager = GPT(cfg)
    meta = _meta_gpt(cfg)
    made = materialize(meta, capture(meta), 5, torch.device("cpu"))
    assert made == len([m for m in meta.modules() if list(m.parameters(recurse=False))]) - tied
    for (n, a), (_, b) in zip(eager.named_parameters(), meta.named_parameters(), strict=True):
        assert not b.is_meta and torch.equal(a, b), n
    assert (meta.head.weight is meta.embed.weight) == tied
    tokens = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    assert torch.equal(eager(tokens), meta(tokens))


def test_eager_values_depend_on_the_seed_and_not_on_the_generator_stream():
    torch.manual_seed(3)
    a = GPT(_cfg())
    torch.rand(10)  # the caller's stream moves on; initial_seed() does not
    b = GPT(_cfg())
    torch.manual_seed(4)
    c = GPT(_cfg())
    assert torch.equal(a.blocks[1].mlp.fc.weight, b.blocks[1].mlp.fc.weight)
    assert not torch.equal(a.blocks[1].mlp.fc.weight, c.blocks[1].mlp.fc.weight)


def test_materialising_only_held_tensors_gives_the_same_values_and_leaves_the_rest_on_meta():
    cfg = _cfg()
    full = _meta_gpt(cfg)
    materialize(full, capture(full), 11, torch.device("cpu"))
    part = _meta_gpt(cfg)
    units = capture(part)
    held = {id(p) for p in part.blocks[1].parameters()}  # one pipeline stage's block only
    materialize(part, units, 11, torch.device("cpu"), held=held)
    for n, p in part.named_parameters():
        if n.startswith("blocks.1."):
            assert torch.equal(p, full.get_parameter(n)), n
        else:
            assert p.is_meta, n


def test_marks_on_meta_parameters_survive_and_the_caller_stream_is_untouched():
    meta = _meta_gpt(_cfg())
    meta.blocks[0].attn.qkv.weight.tensor_model_parallel = True
    torch.manual_seed(1)
    before = torch.random.get_rng_state()
    materialize(meta, capture(meta), 0, torch.device("cpu"))
    assert torch.equal(torch.random.get_rng_state(), before) and torch.initial_seed() == 1
    assert meta.blocks[0].attn.qkv.weight.tensor_model_parallel is True


def test_a_cut_is_applied_to_the_whole_values():
    meta = _meta_gpt(_cfg())
    rows = slice(0, 8)

    def cut(dense):  # a stand-in for the tensor-parallel plan's cut: keep rows 0..7
        out = nn.Linear(dense.in_features, 8)
        out.weight, out.bias = nn.Parameter(dense.weight[rows]), nn.Parameter(dense.bias[rows])
        return out

    with torch.device("meta"):
        meta.blocks[0].mlp.fc = nn.Linear(16, 8)  # what a plan's swap leaves: the cut module, on meta
    units = capture(_meta_gpt(_cfg()))
    materialize(meta, units, 2, torch.device("cpu"), cuts={"blocks.0.mlp.fc": cut})
    torch.manual_seed(2)
    eager = GPT(_cfg())
    assert torch.equal(meta.blocks[0].mlp.fc.weight, eager.blocks[0].mlp.fc.weight[rows])


class _NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


class _ComputedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4)))

    def reset_parameters(self):
        pass  # leaves inv_freq unwritten on meta


def test_a_module_nothing_can_fill_is_refused_with_its_name_and_the_fix():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoInit())
    with pytest.raises(PluginError, match=r"module '1' \(_NoInit\).*\['scale'\].*reset_parameters\(\)"):
        capture(model)


def test_a_buffer_computed_in_init_is_caught_by_the_sentinel():
    with torch.device("meta"):
        model = nn.Sequential(_ComputedBuffer())
    with pytest.raises(PluginError, match=r"'0' \(_ComputedBuffer\) left 0.inv_freq unwritten"):
        materialize(model, capture(model), 0, torch.device("cpu"))


def test_unit_seeds_are_pinned():
    assert unit_seed(0, "blocks.0.attn.qkv") == 2279953589064509504
