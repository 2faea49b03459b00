"""The gradient norm DeepSpeed clips with, kept for ``engine.last_step``, and counted once per parameter.

DeepSpeed's ZeRO, bf16 and fp16 optimizers keep the global norm they clip with (``engine.get_global_grad_norm()``)
and leave the copies of a weight tied across pipeline stages out of it (``ds_pipe_replicated``: counted on the
first holder only). Its fp32 path without ZeRO (``engine.clip_fp32_gradients``) calls
``deepspeed.runtime.utils.clip_grad_norm_``, which does neither: it drops the norm it returns, without clipping
it computes none, and it counts a tied weight once per stage holding it (DeepSpeed 0.19.8; measured on the tied
reference GPT at tp2 x pp2: 0.702 where one process clips with 0.569, so every clipped update was too small).
:func:`keep_grad_norm` replaces that path with the same call over the parameters that count (the tied copies left
out, as the other optimizers do), then scales every gradient, the copies included, by the same coefficient
(``min(1, max_norm / (norm + 1e-6))``, DeepSpeed's formula), so the copies stay equal; without clipping it only
measures.
"""
from __future__ import annotations


def _counted(params: list) -> list:
    """The parameters a global norm counts: a tied weight's copies on later stages are counted on the first."""
    return [p for p in params if not getattr(p, "ds_pipe_replicated", False)]


def keep_grad_norm(ds) -> None:
    """Let ``ds.get_global_grad_norm()`` answer on DeepSpeed's fp32 path without ZeRO too, counting each weight
    once (see the module)."""
    if ds.fp16_enabled() or ds.bfloat16_enabled() or ds.zero_optimization():
        return  # their optimizers keep it (DeepSpeedEngine._take_model_step copies optimizer._global_grad_norm)
    import torch
    from deepspeed.runtime import engine as ds_engine_module

    def clip_and_keep(max_norm: float) -> None:
        params = [p for p in ds.module.parameters() if p.grad is not None]
        # max_norm inf: clip_grad_norm_ only measures (its clip_coef min(1, inf) = 1)
        norm = ds_engine_module.clip_grad_norm_(parameters=_counted(params), max_norm=float("inf"), mpu=ds.mpu)
        ds._global_grad_norm = float(norm)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for p in params:
                p.grad.data.mul_(coef.to(p.grad.device))

    ds.clip_fp32_gradients = lambda: clip_and_keep(ds.gradient_clipping())
    if ds.gradient_clipping() > 0:
        return
    take_model_step = ds._take_model_step

    def measured_step(*args, **kwargs):  # no clipping: DeepSpeed calls no clip_fp32_gradients, so measure here
        clip_and_keep(0.0)
        return take_model_step(*args, **kwargs)

    ds._take_model_step = measured_step
