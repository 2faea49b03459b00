"""transformers causal-LM families (tests/hf_families.py's ``TP_FAMILIES``: every style of transformers' causal-LM
tensor-parallel plans among them) trained at tensor 2 and tensor 2 x data 2, on the native and the DeepSpeed back
ends, against one process: the same losses and gradient norms, step by step.

Each family's tiny model (random weights, seed 0, built whole on every rank) goes through ``plugin.initialize`` with a
recipe of its own dims, sharded by its plan ("auto", or the explicit entries ``TP_FAMILIES`` gives). The optimizer is
SGD with momentum and the clipping is below every step's gradient norm (the reference asserts it acts), so a gradient
that is wrong in any parameter moves the next losses: Adam would divide most such errors away. The reference is the
same model on one process, cross entropy of its logits over the whole global batch (the engines' token mean).

One spawn per layout and back end trains every family in turn (2 processes for tensor 2, 4 for tensor 2 x data 2,
native only: BACK_ENDS).
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.hf_families import TP_FAMILIES

from .needs import need
from .spawn import run

need("transformers")
pytestmark = pytest.mark.dist

STEPS = 3
ROWS, SEQ = 8, 16
SGD = {"name": "sgd", "lr": 4.0, "momentum": 0.9, "weight_decay": 0.0}
CLIP = 0.01  # below every family's gradient norm at every step (the reference checks it): 1-3 % a step
REL = 1e-4
LAYOUTS = {"tp2": (1, 2), "tp2_dp2": (2, 4)}  # name -> (data, processes)
# tensor 2 x data 2 on the native back end only (DDP around the split model: a routed model's unused parameters);
# DeepSpeed's data parallelism over the families is the ZeRO-3 matrix's (test_family_matrix.py), the suite's time
BACK_ENDS = {"tp2": ("native", "deepspeed"), "tp2_dp2": ("native",)}
FAMILIES = list(TP_FAMILIES)  # every layout trains them all (docs/models-and-data.md's table: tests/family_table.py)


def tokens(vocab: int) -> torch.Tensor:
    """The one batch every step trains on: on random tokens only a repeated batch lets an update move the next loss
    (a fresh batch of uniform tokens sits at ln(vocab) whatever the weights, 6e-5 apart after a step)."""
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000))


def next_token_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


@functools.cache
def reference(family: str) -> tuple[list[float], list[float], dict]:
    """(losses, gradient norms before clipping, the trained weights by name) of the family's tiny model trained on one
    process."""
    from tests.hf_families import tiny_model

    model = tiny_model(family, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"])
    losses, norms = [], []
    for _ in range(STEPS):
        loss = next_token_loss(model, tokens(model.config.vocab_size))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert min(norms) > 2 * CLIP, f"{family}: gradient norms {norms}: clipping at {CLIP} would not act"
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def recipes(tmp_path, layout: str) -> dict[str, str]:
    """family -> the path of its recipe: the layout, SGD, clipping, the family's own dims, its plan."""
    import transformers as tf

    from plugin.engines.model_checks import model_dims
    from tests.hf_families import TINY, TP_FAMILIES, tiny_config, tp_plan

    from .runs import recipe_variant

    data, world = LAYOUTS[layout]
    out = {}
    for family in TP_FAMILIES:
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(tiny_config(family))
        dims = {**model_dims(model), "seq_len": TINY.seq_len, "dropout": 0.0}
        out[family] = str(recipe_variant(
            "cpu_tp2_dp2", tmp_path, f"{layout}_{family}", parallelism={"data": data, "tensor": 2, "pipeline": 1},
            batch={"global": ROWS, "micro": ROWS // data // 2}, optimizer=SGD, gradient_clipping=CLIP, model=dims,
            tensor_parallel={"plan": tp_plan(model, family)},
            cluster={"nodes": 1, "gpus_per_node": world, "gpu_memory_gb": 4}))
    return out


def train_families(rank, world_size, paths: dict, backend: str, keep_weights: bool = False):
    import transformers as tf

    import plugin
    from tests.hf_families import tiny_model

    tf.logging.set_verbosity_error()
    out = {}
    for family, path in paths.items():
        model = tiny_model(family, seed=0)
        engine = plugin.initialize(model, path, backend=backend)
        ids = tokens(model.config.vocab_size)
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(engine.train_step({"input_ids": ids, "labels": ids}))
            norms.append(engine.grad_norm())
        # and the weights every rank holds whole (norms, routers, grad_sum's q/k norms): a gradient the losses hardly
        # see (qwen3's q/k norms summed over the tensor group: 3e-7 on a loss) moves them
        weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()} if keep_weights else None
        out[family] = (losses, norms, weights) if keep_weights else (losses, norms)
    return out


def check(results: list[dict]) -> None:
    wrong = []
    for family, (losses, norms, weights) in results[0].items():
        assert all(r[family][0] == losses for r in results), f"{family}: ranks report different losses"
        ref_losses, ref_norms, ref_weights = reference(family)
        whole = [n for n, w in weights.items() if n in ref_weights and w.shape == ref_weights[n].shape]
        assert any(n.endswith("norm.weight") for n in whole), f"{family}: no replicated weight compared: {whole}"
        off = [n for n in whole if not torch.allclose(weights[n], ref_weights[n], rtol=REL, atol=1e-6)]
        if off:
            worst = max(off, key=lambda n: float((weights[n] - ref_weights[n]).abs().max()))
            wrong.append(f"{family}: {len(off)} weights held whole are off one process after {STEPS} steps, e.g. "
                         f"{worst} by {float((weights[worst] - ref_weights[worst]).abs().max()):.1e}")
        if losses != pytest.approx(ref_losses, rel=REL):
            wrong.append(f"{family}: losses {losses} vs one process {ref_losses}")
        if None in norms or norms != pytest.approx(ref_norms, rel=REL):
            wrong.append(f"{family}: gradient norms {norms} vs one process {ref_norms}")
    assert not wrong, "\n".join(wrong)


# the README suite trains tensor 2 x data 2 (every family split, then reduced over data); tensor 2 alone is slow
@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.slow) if n == "tp2" else n for n in LAYOUTS])
def test_native_families_train_one_process_losses_at_tensor_2(tmp_path, layout):
    check(run(train_families, LAYOUTS[layout][1], recipes(tmp_path, layout), "native", True, timeout_s=300))


@pytest.mark.deepspeed
@pytest.mark.slow
@pytest.mark.parametrize("layout", [layout for layout, ends in BACK_ENDS.items() if "deepspeed" in ends])
def test_deepspeed_families_train_one_process_losses_at_tensor_2(tmp_path, layout):
    need("deepspeed")
    check(run(train_families, LAYOUTS[layout][1], recipes(tmp_path, layout), "deepspeed", True, timeout_s=400))
