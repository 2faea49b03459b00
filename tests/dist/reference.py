"""The one-process run every in-process layout test compares with: the reference GPT on the whole global batch."""
from __future__ import annotations


def gpt_reference(recipe, steps: int, seed: int = 0, decay=None) -> tuple[list[float], list[float]]:
    """(per-step losses, per-step gradient norms before clipping) of the reference GPT (``seed``) trained on one
    process with the recipe's optimizer (``decay(model)``: its weight-decay groups, by default the plugin's
    :class:`~plugin.engines.optim.WeightDecay`) and clipping, each global batch cut into the layout's data x grad_accum
    micro-batches as the engines cut it (the loss is their mean, as the engines report it)."""
    import torch

    from plugin.data.text import TextBatches
    from plugin.engines.optim import WeightDecay, build_optimizer
    from plugin.models.gpt import GPT, GPTConfig, gpt_loss

    lay = recipe.layout()
    torch.manual_seed(seed)
    model = GPT(GPTConfig.from_recipe_model(recipe.model))
    opt = build_optimizer(model.parameters(), recipe.optimizer, (decay or WeightDecay.of)(model))
    data = TextBatches(recipe.model.vocab, recipe.model.seq_len)
    losses, norms = [], []
    for step in range(steps):
        x, y = data.global_batch(step, lay.global_batch)
        n = lay.grad_accum * lay.data
        parts = list(zip(x.chunk(n), y.chunk(n), strict=True))  # micro-batches
        total = 0.0
        for xs, ys in parts:
            loss = gpt_loss(model(xs), ys)
            (loss / len(parts)).backward()
            total += float(loss) / len(parts)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.gradient_clipping)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms
