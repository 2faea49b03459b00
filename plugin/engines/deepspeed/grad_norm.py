"""The gradient norm DeepSpeed clips with, kept for ``engine.last_step``, on every DeepSpeed path.

DeepSpeed's ZeRO, bf16 and fp16 optimizers keep the global norm they clip with (``engine.get_global_grad_norm()``).
Its fp32 path without ZeRO (``engine.clip_fp32_gradients``) calls ``deepspeed.runtime.utils.clip_grad_norm_`` and
drops the norm it returns, and without clipping computes none: :func:`keep_grad_norm` makes that path keep it, by
the same call with the same arguments (``max_norm`` inf when the recipe does not clip: the norm, a scale of 1).
"""
from __future__ import annotations


def keep_grad_norm(ds) -> None:
    """Let ``ds.get_global_grad_norm()`` answer on DeepSpeed's fp32 path without ZeRO too (see the module)."""
    if ds.fp16_enabled() or ds.bfloat16_enabled() or ds.zero_optimization():
        return  # their optimizers keep it (DeepSpeedEngine._take_model_step copies optimizer._global_grad_norm)
    from deepspeed.runtime import engine as ds_engine_module

    def clip_fp32_gradients():  # DeepSpeedEngine.clip_fp32_gradients, keeping what clip_grad_norm_ returns
        norm = ds_engine_module.clip_grad_norm_(parameters=ds.module.parameters(), max_norm=ds.gradient_clipping(),
                                                mpu=ds.mpu)
        ds._global_grad_norm = float(norm)

    ds.clip_fp32_gradients = clip_fp32_gradients
    if ds.gradient_clipping() > 0:
        return
    take_model_step = ds._take_model_step

    def measured_step(*args, **kwargs):  # no clipping: measure with max_norm inf (clip_coef min(1, inf) = 1)
        norm = ds_engine_module.clip_grad_norm_(parameters=ds.module.parameters(), max_norm=float("inf"), mpu=ds.mpu)
        ds._global_grad_norm = float(norm)
        return take_model_step(*args, **kwargs)

    ds._take_model_step = measured_step
