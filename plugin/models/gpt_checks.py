"""Which tensor-parallel plans the reference GPT can run, checked before anything is swapped.

A plan is a list of module styles; the GPT adds what only it knows: attention splits by whole
key/value groups, a column layer must feed a row layer inside each block (or both stay whole), sequence
parallelism needs all four of a block's linears split (and the position embedding whole), and the head must be split
by vocabulary so that ``gpt_loss(logits, targets, tp_group)`` always receives vocabulary-split logits under TP.
"""
from __future__ import annotations

import re
from collections.abc import Mapping


def _kind(style) -> str:
    if style is None:
        return "whole"
    if style.kind == "column" and not style.gather_output and style.parts == 1:
        return "column"
    if style.kind == "row":
        return "row"
    if style.kind == "vocab" and not style.gather_output:
        return "vocab"
    return style.text


def check_gpt_plan(config, styles: Mapping[str, object], tp: int, sequence_parallel: bool) -> list[str]:
    """Problems with splitting a GPT of ``config`` as ``styles`` (module name -> style) over ``tp`` ranks."""
    if tp == 1:
        return []
    problems: list[str] = []
    pairs = (("attn.qkv", "attn.proj"), ("mlp.fc", "mlp.proj"))
    for i in range(config.layers):
        # a MoE block has no mlp: its experts are split by plugin.expert_parallel, its input gathered under SP
        for first, second in pairs[:1] if config.is_moe_block(i) else pairs:
            a = _kind(styles.get(f"blocks.{i}.{first}"))
            b = _kind(styles.get(f"blocks.{i}.{second}"))
            if (a, b) not in (("column", "row"), ("whole", "whole")):
                problems.append(f"GPT blocks.{i}: {first} is {a!r} and {second} is {b!r}; split them as "
                                f"'column' then 'row' (or leave both whole)")
            elif sequence_parallel and a == "whole":
                problems.append(f"GPT blocks.{i}.{first}/{second}: sequence parallelism needs them split "
                                f"('column' then 'row'), since the residual stream is split by sequence")
        if _kind(styles.get(f"blocks.{i}.attn.qkv")) == "column" and config.kv_heads_resolved % tp:
            problems.append(f"GPT: kv_heads {config.kv_heads_resolved} cannot be split whole over tensor size "
                            f"{tp} (each rank needs whole key/value groups); use a tensor size that divides "
                            f"{config.kv_heads_resolved}")
            break
    head = _kind(styles.get("head"))
    if head not in ("vocab", "column"):
        problems.append(f"GPT head is {head!r}; under tensor parallelism split it by vocabulary (style "
                        f"'vocab'), which gpt_loss(logits, targets, tp_group) expects")
    if sequence_parallel and "pos_embed" in styles:
        problems.append(f"GPT pos_embed is {_kind(styles['pos_embed'])!r}; under sequence parallelism leave it "
                        f"whole ('replicate'): its rows are added inside the embedding's reduce-scatter")
    if sequence_parallel and config.seq_len % tp:
        problems.append(f"GPT: sequence parallelism splits the sequence, but seq_len {config.seq_len} is not "
                        f"divisible by tensor size {tp}; use a multiple of {tp}")
    unknown = [n for n in styles if not re.fullmatch(
        r"embed|pos_embed|head|blocks\.\d+\.(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)", n)]
    if unknown:
        problems.append(f"GPT: the plan splits {unknown}, which the reference GPT cannot run split; "
                        f"split only embed, head and the blocks' attn.qkv/attn.proj/mlp.fc/mlp.proj")
    return problems
