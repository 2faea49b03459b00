"""A model built on the meta device, in one launch of 4 gloo processes: each rank materialises only its part.

For ZeRO-3 dp4 (native FSDP2, DeepSpeed, Accelerate's DeepSpeed plugin) and tp2 x pp2 (native and DeepSpeed), on the
tiny reference GPT:

* the bytes each rank keeps are its share: about whole / dp under ZeRO-3 (FSDP2's local shards, DeepSpeed's
  ``ds_tensor`` partitions, the full parameters emptied), its stage's tensor shards under tp2 x pp2 (the same bytes
  as the eagerly built model sharded by the same layout), never the whole model;
* what is made whole on the way is one init unit at a time (the dense twin of :func:`plugin.materialize.run`
  is dropped before the next one is made), and under a pipeline only the units of this rank's stage;
* the values equal the one-process eager init of the same seed: under ZeRO-3 every parameter gathered back
  (``full_tensor()``, ``GatheredParameters``) equals the eager GPT's; under tp2 x pp2 every local shard equals the
  eagerly built model's after the same layout's cut;
* FSDP2's uneven dim-0 shards (padded, or empty past the last chunk) get the FSDP2 sink's own cut of the values:
  FSDP2's all-gather (``unshard``) gives them back;
* native ZeRO-3 wraps one FSDP2 unit per transformer block plus the root, for the reference GPT and for a
  transformers Llama built from a config (its ``_no_split_modules`` decoder layers);
* ranks with different seeds are refused by a PluginError on every rank naming the ranks and their seeds.
"""
import pytest

from .needs import need
from .spawn import run

pytestmark = [pytest.mark.dist, pytest.mark.deepspeed]
need("deepspeed")
need("transformers")

SEED = 3


def _gpt_cfg(recipe):
    from plugin.models.gpt import GPTConfig

    return GPTConfig.from_recipe_model(recipe.model)


class _Twins:
    """Records every dense twin :func:`plugin.materialize.run.materialize` makes, and how many were alive at
    once (each twin's tensors held by weak reference: a twin still alive when the next one is made counts)."""

    def __init__(self):
        import weakref

        import plugin.materialize.run as run_module

        self.weakref, self.module, self.original = weakref, run_module, run_module.twin
        self.bytes, self.alive_max, self.live, self.held_max, self.model = [], 0, [], 0, None
        run_module.twin = self._twin

    def builder(self, make):
        """A zero-argument builder that also remembers the model it built (to weigh what it holds)."""
        def build():
            self.model = make()
            return self.model
        return build

    def _held(self) -> int:
        """Bytes of the model's parameters already materialised on this rank: FSDP2's local shards, DeepSpeed's
        partitions plus whatever full data a parameter still has, plain tensors whole."""
        from torch.distributed.tensor import DTensor

        total = 0
        for p in self.model.parameters():
            if p.is_meta:
                continue
            local = p.to_local() if isinstance(p, DTensor) else p.data
            total += _bytes([local]) + (_bytes([p.ds_tensor]) if hasattr(p, "ds_tensor") else 0)
        return total

    def _twin(self, unit, device):
        t = self.original(unit, device)
        tensors = [*t._parameters.values(), *t._buffers.values()]
        self.live = [r for r in self.live if r() is not None]
        self.alive_max = max(self.alive_max, len(self.live) + 1)
        self.live.append(self.weakref.ref(tensors[0]))
        self.bytes.append(sum(x.numel() * x.element_size() for x in tensors if x is not None))
        if self.model is not None:  # what the rank holds besides this twin, as the next unit is made
            self.held_max = max(self.held_max, self._held())
        return t

    def reset(self):
        self.bytes, self.alive_max, self.live, self.held_max, self.model = [], 0, [], 0, None


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _check(rank, world_size):
    import dataclasses

    import deepspeed
    import torch
    from torch.distributed.fsdp import FSDPModule

    import plugin
    from plugin.errors import PluginError
    from plugin.models.gpt import GPT
    from plugin.recipe.checks import load_recipe

    twins = _Twins()
    out = {}
    z3, tp_pp = load_recipe("cpu_zero3_dp4"), load_recipe("cpu_tp2_pp2")
    cfg = _gpt_cfg(z3)
    torch.manual_seed(SEED)
    eager = GPT(cfg)  # the one-process init of this seed
    whole = _bytes(eager.parameters())
    largest_unit = max(_bytes(m.parameters(recurse=False)) for m in eager.modules())
    out["whole"], out["largest_unit"] = whole, largest_unit

    # ZeRO-3 dp4, native FSDP2
    twins.reset()
    engine = plugin.initialize(twins.builder(lambda: GPT(cfg)), z3, seed=SEED, backend="native")
    module = engine.container
    local = _bytes(p.to_local() for p in module.parameters())
    same = all(torch.equal(p.full_tensor(), dict(eager.named_parameters())[n]) for n, p in module.named_parameters())
    units = [n for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    out["native_z3"] = {"local": local, "twins": len(twins.bytes), "alive_max": twins.alive_max,
                        "twin_max": max(twins.bytes), "equal": same, "units": units,
                        "held_max": twins.held_max}

    # FSDP2's uneven dim-0 shards (the last ranks padded or empty) filled by the sink's own cut: FSDP2's all-gather
    # of what the sink wrote gives the values back
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plugin.materialize.sinks import FSDP2Sink

    shapes = {"a": (5, 3), "b": (3,), "c": (2, 7), "d": (13, 4), "e": (8, 2)}
    with torch.device("meta"):
        odd = torch.nn.Module()
        for k, shape in shapes.items():
            odd.register_parameter(k, torch.nn.Parameter(torch.empty(shape)))
    fully_shard(odd, mesh=init_device_mesh("cpu", (world_size,)))
    sink = FSDP2Sink(odd, torch.device("cpu"))
    sink.prepare()
    values = {k: torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, (k, shape) in
              enumerate(shapes.items())}
    for k, v in values.items():
        sink.put(odd, "param", k, v)
    odd.unshard()
    out["uneven_equal"] = {k: torch.equal(odd._parameters[k].detach(), v) for k, v in values.items()}
    odd.reshard()

    # ZeRO-3 dp4, DeepSpeed
    twins.reset()
    engine = plugin.initialize(twins.builder(lambda: GPT(cfg)), z3, seed=SEED, backend="deepspeed")
    params = dict(engine.ds.module.named_parameters())
    local = _bytes(p.ds_tensor for p in params.values())
    full_left = sum(p.data.numel() for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        same = all(torch.equal(p.data, dict(eager.named_parameters())[n]) for n, p in params.items())
    out["deepspeed_z3"] = {"local": local, "full_left": full_left, "twins": len(twins.bytes),
                           "alive_max": twins.alive_max, "twin_max": max(twins.bytes), "equal": same,
                           "held_max": twins.held_max}

    # ZeRO-3 dp4 through Accelerate's DeepSpeed plugin: partitioned as made, as on the DeepSpeed engine
    twins.reset()
    engine = plugin.initialize(twins.builder(lambda: GPT(cfg)), z3, seed=SEED, backend="accelerate")
    params = dict(engine.ds.module.named_parameters())
    local = _bytes(p.ds_tensor for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        same = all(torch.equal(p.data, dict(eager.named_parameters())[n]) for n, p in params.items())
    out["accelerate_z3"] = {"local": local, "full_left": sum(p.data.numel() for p in params.values()),
                            "twins": len(twins.bytes), "alive_max": twins.alive_max, "twin_max": max(twins.bytes),
                            "equal": same, "mode": engine.mode, "held_max": twins.held_max}

    # tp2 x pp2: the meta-built stage shards against the eagerly built model cut by the same layout
    for backend in ("native", "deepspeed"):
        torch.manual_seed(SEED)
        ref = plugin.initialize(GPT(cfg), tp_pp, backend=backend)
        twins.reset()
        engine = plugin.initialize(twins.builder(lambda: GPT(cfg)), tp_pp, seed=SEED, backend=backend)
        def held(e, backend=backend):
            return dict((e.ds.module if backend == "deepspeed" else e.container).named_parameters())
        mine, theirs = held(engine), held(ref)
        out[f"{backend}_tp2_pp2"] = {
            "local": _bytes(mine.values()), "ref_local": _bytes(theirs.values()),
            "names_equal": sorted(mine) == sorted(theirs),
            "equal": all(torch.equal(mine[n], theirs[n]) for n in mine if n in theirs),
            "twins": len(twins.bytes), "alive_max": twins.alive_max, "held_max": twins.held_max}

    # a transformers Llama from a config under native ZeRO-3: one FSDP2 unit per decoder layer, plus the root
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_cfg = LlamaConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn_hidden_resolved,
                            num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                            num_key_value_heads=cfg.heads, vocab_size=cfg.vocab, max_position_embeddings=cfg.seq_len)
    engine = plugin.initialize(lambda: LlamaForCausalLM(llama_cfg), z3, seed=SEED, backend="native")
    module = engine.container
    # fully_shard makes each unit an FSDP<class> subclass: the class it was is the one after the prefix
    out["llama_units"] = sorted(type(m).__name__.removeprefix("FSDP") for m in module.modules()
                                if isinstance(m, FSDPModule))
    out["llama_local"] = _bytes(p.to_local() for p in module.parameters())
    out["llama_whole"] = sum(p.numel() * p.element_size() for p in module.parameters())  # DTensor: global shape

    # different seeds on different ranks: refused on every rank, naming ranks and seeds
    bad = dataclasses.replace(z3)
    try:
        plugin.initialize(lambda: GPT(cfg), bad, seed=SEED if rank < 2 else SEED + 4, backend="native")
        out["seed_error"] = None
    except PluginError as e:
        out["seed_error"] = str(e)
    return out


def test_each_rank_materialises_its_part_with_the_one_process_values():
    results = run(_check, 4, timeout_s=300)
    r0 = results[0]
    whole, largest = r0["whole"], r0["largest_unit"]
    layers = 4
    for rank, r in enumerate(results):
        assert r["accelerate_z3"]["mode"] == "deepspeed", rank
        for key in ("native_z3", "deepspeed_z3", "accelerate_z3"):
            z = r[key]
            assert z["equal"], (key, rank)
            # its share (DeepSpeed pads each partition by at most dp - 1 elements per parameter)
            assert whole / 4 <= z["local"] <= whole / 4 + 4 * 4 * 64, (key, rank, z["local"], whole)
            assert z["alive_max"] == 1 and z["twin_max"] <= largest, (key, rank, z)
            # while materialising, besides the one whole unit: its share, never the whole model
            assert 0 < z["held_max"] <= z["local"] + largest, (key, rank, z)
        for key in ("deepspeed_z3", "accelerate_z3"):  # no whole parameter kept besides the partitions
            assert r[key]["full_left"] == 0, (key, rank)
        assert all(r["uneven_equal"].values()), (rank, r["uneven_equal"])
        assert sorted(r["native_z3"]["units"]) == sorted(["", *(f"blocks.{i}" for i in range(layers))]), rank
        for key in ("native_tp2_pp2", "deepspeed_tp2_pp2"):
            t = r[key]
            assert t["names_equal"] and t["equal"], (key, rank)
            assert t["local"] == t["ref_local"] and t["local"] < whole / 2, (key, rank, t["local"], whole)
            assert t["alive_max"] == 1 and 0 < t["held_max"] <= t["local"], (key, rank, t)
        assert r["llama_units"] == ["LlamaDecoderLayer"] * layers + ["LlamaForCausalLM"], (rank, r["llama_units"])
        assert r["llama_local"] * 4 == r["llama_whole"], (rank, r["llama_local"], r["llama_whole"])
        msg = r["seed_error"]
        assert msg and "seed 3 on rank(s) 0, 1" in msg and "seed 7 on rank(s) 2, 3" in msg, (rank, msg)
    # a pipeline stage makes only its own units: the two stages together make every unit once per tensor rank
    for key in ("native_tp2_pp2", "deepspeed_tp2_pp2"):
        made = [r[key]["twins"] for r in results]
        assert made[0] == made[1] and made[2] == made[3] and made[0] + made[2] == results[0]["native_z3"]["twins"], \
            (key, made)
