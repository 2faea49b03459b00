"""The reference GPT: pre-norm decoder, causal (grouped-query) attention, GELU MLP, learned positions.

Built whole on one process (``GPT(config)``, deterministic under ``torch.manual_seed``), then sharded by
``apply_tensor_parallel(model, "auto", tp_group, sequence_parallel=...)`` into a model that computes the
same function, and cut into pipeline stages from :meth:`GPT.to_layers`::

    tokens [batch, seq] --EmbeddingLayer--> x --Block--> ... --Block--> x --HeadLayer--> logits [batch, seq, V]

Between layers ``x`` is ``[seq, batch, hidden]`` (sequence first, like Megatron-LM: a sequence slice is
then contiguous); with sequence parallelism it is this rank's ``[seq/p, batch, hidden]`` slice, which the
vocabulary-split embedding produces directly by a reduce-scatter (positions added inside it). Under
tensor parallelism the logits are split by vocabulary (``[batch, seq, V_padded/p]``, padded entries
``-inf``) and :func:`gpt_loss` with the tensor group computes the loss without gathering them. Under context
parallelism (:meth:`GPT.configure_context_parallel`) ``tokens`` are this rank's two chunks of each row: positions
are the chunks' global ones and attention spans the whole sequence (:func:`plugin.context_parallel.context_attention`).

The fused ``qkv`` projection stores its rows grouped by key/value head: for each of the ``kv_heads``
groups, its ``heads/kv_heads`` query heads, then its key head, then its value head. A contiguous split
by output rows therefore hands every tensor rank whole groups (needs ``kv_heads % tp == 0``).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import context_attention
from ..expert_parallel.layer import MoE
from ..materialize.run import init_in_place
from ..tensor_parallel.comm import allreduce_grads_in_backward, gather_from_sequence_region, scatter_to_sequence_region
from ..tensor_parallel.cross_entropy import token_cross_entropy
from ..tensor_parallel.embedding import VocabParallelEmbedding
from ..tensor_parallel.layers import ColumnParallelLinear
from ..tensor_parallel.random import sharded_region
from ..tensor_parallel.recompute import checkpoint
from .gpt_config import GPTConfig

__all__ = ["GPT", "GPTConfig", "gpt_loss", "EmbeddingLayer", "Block", "HeadLayer"]


def _sequence_parallel(tp) -> bool:
    return tp is not None and tp.sequence_parallel


def _dropout(x: torch.Tensor, p: float, training: bool, sharded_rng=None) -> torch.Tensor:
    """Dropout; inside a sharded region (``sharded_rng`` given) with this tensor rank's own stream."""
    if not training or p == 0.0:
        return x
    with sharded_region(sharded_rng, x.device):
        return F.dropout(x, p, True)


class EmbeddingLayer(nn.Module):
    """tokens ``[batch, seq]`` -> ``[seq, batch, hidden]`` (sequence parallel: this rank's sequence slice)."""

    def __init__(self, embed: nn.Module, pos_embed: nn.Embedding, config: GPTConfig, tp=None):
        super().__init__()
        self.embed, self.pos_embed = embed, pos_embed
        self.config, self.tp = config, tp
        self.cp = None  # the context-parallel context: tokens are this rank's chunks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"GPT input must be token ids [batch, seq] (int64), got {tuple(tokens.shape)} "
                             f"{tokens.dtype}")
        context = 1 if self.cp is None else self.cp.size
        if tokens.shape[1] * context > self.config.seq_len:
            raise ValueError(f"GPT input has {tokens.shape[1] * context} tokens per sequence, more than the "
                             f"configured seq_len {self.config.seq_len}")
        where = (torch.arange(tokens.shape[1], device=tokens.device) if self.cp is None
                 else self.cp.positions(tokens.shape[1], tokens.device))
        positions = self.pos_embed(where)
        if not _sequence_parallel(self.tp):
            x = (self.embed(tokens) + positions).transpose(0, 1).contiguous()
            return _dropout(x, self.config.dropout, self.training)
        if isinstance(self.embed, VocabParallelEmbedding) and self.embed.sequence_parallel:
            # one reduce-scatter straight into this rank's sequence slice, positions added inside it
            x = self.embed(tokens, position_embeddings=positions)
        else:  # a whole embedding: every rank has all of it, keep this rank's slice
            x = scatter_to_sequence_region((self.embed(tokens) + positions).transpose(0, 1).contiguous(),
                                           self.tp.group)
        return _dropout(x, self.config.dropout, self.training, self.tp.rng)


class Attention(nn.Module):
    """Causal self-attention over this rank's query groups (all of them when unsharded)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.head_dim, self.q_per_kv = config.head_dim, config.q_per_kv
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, (config.heads + 2 * config.kv_heads_resolved) * config.head_dim,
                             bias=config.bias)
        self.proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=config.bias)
        self.rng = None  # this tensor rank's dropout stream, set by GPT.configure_tensor_parallel
        self.recompute_core = False  # selective recompute, set by GPT.configure_selective_recompute
        self.cp = None  # the context-parallel context, set by GPT.configure_context_parallel

    def forward(self, x: torch.Tensor, out_bias: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv(x)  # [seq, batch, groups * (q_per_kv + 2) * head_dim]: whole sequence even under SP
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, -1, self.q_per_kv + 2, self.head_dim)
        q = qkv[:, :, :, :self.q_per_kv].reshape(s, b, -1, self.head_dim).permute(1, 2, 0, 3)
        k = qkv[:, :, :, self.q_per_kv].permute(1, 2, 0, 3)
        v = qkv[:, :, :, self.q_per_kv + 1].permute(1, 2, 0, 3)
        if self.q_per_kv > 1 and self.cp is None:  # the context attention takes kv_heads (fewer bytes on the ring)
            k = k.repeat_interleave(self.q_per_kv, dim=1)
            v = v.repeat_interleave(self.q_per_kv, dim=1)
        if self.recompute_core and self.training and torch.is_grad_enabled():
            # the core's saved tensors (the softmax and its dropout on SDPA's math kernel) are dropped and
            # recomputed in backward from q, k, v, this rank's dropout streams replayed
            rngs = [r for r in (self.rng, getattr(self.cp, "rng", None)) if r is not None]
            y = checkpoint(self._core, q, k, v, rngs=rngs)
        else:
            y = self._core(q, k, v)
        y = y.permute(2, 0, 1, 3).reshape(s, b, -1)
        return self.proj(y) if out_bias is None else self.proj(y, bias=out_bias)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal) with dropout, times v: the attention core (over the whole sequence
        split across the context group under context parallelism, with the context rank's dropout stream)."""
        p = self.dropout if self.training else 0.0
        if self.cp is not None:
            return context_attention(q, k, v, self.cp, dropout_p=p)
        with sharded_region(self.rng if p else None, q.device):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden, config.ffn_hidden_resolved, bias=config.bias)
        self.proj = nn.Linear(config.ffn_hidden_resolved, config.hidden, bias=config.bias)

    def forward(self, x: torch.Tensor, out_bias: torch.Tensor | None = None) -> torch.Tensor:
        y = F.gelu(self.fc(x))
        return self.proj(y) if out_bias is None else self.proj(y, bias=out_bias)


class Block(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``, with dropout on each residual branch; a MoE block
    (``config.is_moe_block``) has ``moe`` (router and experts, :class:`plugin.expert_parallel.layer.MoE`) in place of
    ``mlp``."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        if config.is_moe_block(index):
            self.moe = MoE(config.hidden, config.moe_experts, config.moe_top_k, config.moe_ffn_hidden_resolved,
                           router=config.moe_router, bias_update_rate=config.moe_bias_update_rate,
                           aux_loss_coef=config.moe_aux_loss_coef, z_loss_coef=config.moe_z_loss_coef)
        else:
            self.mlp = MLP(config)
        self.dropout = config.dropout
        self.tp = None

    def _replicated(self):
        """ln1/ln2 weights and biases and the two output biases. Under sequence parallelism each rank
        sees a slice of the tokens, so these replicated parameters get partial gradients: they are
        routed through one autograd all-reduce of their gradients, one collective per block backward
        of ``6 * hidden`` floats (``2 * hidden`` without biases; 24 KiB at hidden 1024 in fp32).

        A deliberate deviation from Megatron-LM, which sums these once per step, after backward
        (``finalize_model_grads`` -> ``_allreduce_non_tensor_model_parallel_grads``): summing inside
        autograd makes the gradient whole before any engine's gradient hook sees it. DeepSpeed ZeRO-2/3
        reduce-scatter gradients over data parallelism from hooks during backward, so a sum after backward
        would come too late for them; here every engine, pipeline schedule, activation checkpointing
        (the block recomputes this node) and gradient accumulation get the exact gradient. The price is
        one small, latency-bound all-reduce per block and micro-batch instead of one per step."""
        ln = [self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias]
        if not _sequence_parallel(self.tp):
            return ln + [None, None]
        tensors = ln + [self.attn.proj.bias, self.mlp.proj.bias if hasattr(self, "mlp") else None]
        present = [t for t in tensors if t is not None]
        synced = iter(allreduce_grads_in_backward(present, self.tp.group))
        return [None if t is None else next(synced) for t in tensors]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ln1_w, ln1_b, ln2_w, ln2_b, attn_b, mlp_b = self._replicated()
        rng = self.tp.rng if _sequence_parallel(self.tp) else None  # residual stream is sharded under SP
        h = F.layer_norm(x, self.ln1.normalized_shape, ln1_w, ln1_b, self.ln1.eps)
        x = x + _dropout(self.attn(h, out_bias=attn_b), self.dropout, self.training, rng)
        h = F.layer_norm(x, self.ln2.normalized_shape, ln2_w, ln2_b, self.ln2.eps)
        ffn = self.mlp if hasattr(self, "mlp") else self.moe
        return x + _dropout(ffn(h, out_bias=mlp_b), self.dropout, self.training, rng)


class HeadLayer(nn.Module):
    """``[seq(/p), batch, hidden]`` -> final norm -> logits ``[batch, seq, V]`` (vocabulary-split under TP)."""

    def __init__(self, norm: nn.LayerNorm, head: nn.Module, tp=None):
        super().__init__()
        self.norm, self.head, self.tp = norm, head, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.norm.weight, self.norm.bias
        if _sequence_parallel(self.tp):
            weight, bias = allreduce_grads_in_backward([weight, bias], self.tp.group) if bias is not None \
                else (allreduce_grads_in_backward([weight], self.tp.group)[0], None)
        x = F.layer_norm(x, self.norm.normalized_shape, weight, bias, self.norm.eps)
        gathers_itself = isinstance(self.head, ColumnParallelLinear) and self.head.sequence_parallel
        if _sequence_parallel(self.tp) and not gathers_itself:
            x = gather_from_sequence_region(x, self.tp.group, tensor_parallel_output_grad=False)
        return self.head(x).transpose(0, 1)


class GPT(nn.Module):
    """The reference GPT. Module names (the plan's globs match them): ``embed``, ``pos_embed``,
    ``blocks.<i>.{ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj}``, ``norm``, ``head``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.pos_embed = nn.Embedding(config.seq_len, config.hidden)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=config.bias)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight
        self.tp = None
        self.cp = None
        # The two wrapper layers of to_layers(), made once (a tuple: not registered as submodules, so
        # names and state_dict stay the GPT's own); their children are this model's modules.
        self._ends = (EmbeddingLayer(self.embed, self.pos_embed, config), HeadLayer(self.norm, self.head))
        # The same per-(seed, name) rule as a model built on the meta device and materialised by initialize
        # (plugin.materialize): an eager GPT equals a meta-built one for the same seed, on every layout.
        init_in_place(self, torch.initial_seed())

    def init_module(self, name: str, module: nn.Module) -> None:
        """Fill ``module``'s own parameters (``recurse=False``), called ``name`` in this model, from torch's default
        generator (seeded for this module by :func:`plugin.materialize.run.seeded`): biases zero, norms one, the
        residual projections normal(0, std / sqrt(2 layers)), everything else normal(0, std)."""
        std = self.config.init_std
        for pname, p in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            if pname in ("bias", "score_bias"):
                nn.init.zeros_(p)
            elif ".ln" in full or full.startswith("norm"):
                nn.init.ones_(p)
            elif full.endswith(("attn.proj.weight", "mlp.proj.weight", "moe.experts.w2")):
                nn.init.normal_(p, 0.0, std / (2 * self.config.layers) ** 0.5)
            else:
                nn.init.normal_(p, 0.0, std)

    def to_layers(self) -> list[nn.Module]:
        """The model as a list of single-tensor-in, single-tensor-out layers; composed in order on token
        ids they give the logits. The layers are this model's own modules, the same objects on every
        call, and sharding the model later (``apply_tensor_parallel``) updates them in place: a pipeline
        engine may build its stages first and shard afterwards, with its own grid's tensor group.
        A tied head shares the embedding's weight: if a pipeline puts them on different stages, their
        gradients must be summed across those stages (as DeepSpeed's TiedLayerSpec does)."""
        self._sync_ends()
        embedding, head = self._ends
        return [embedding, *self.blocks, head]

    def _sync_ends(self) -> None:
        embedding, head = self._ends
        for wrapper, names in ((embedding, ("embed", "pos_embed")), (head, ("norm", "head"))):
            for name in names:
                if getattr(wrapper, name) is not getattr(self, name):  # swapped by a tensor-parallel plan
                    setattr(wrapper, name, getattr(self, name))
            wrapper.tp = self.tp
        embedding.cp = getattr(self, "cp", None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens
        for layer in self.to_layers():
            x = layer(x)
        return x

    # -- the tensor-parallel protocol used by plugin.tensor_parallel.apply_tensor_parallel (and .hooks)
    # Under tensor parallelism the head is split by vocabulary (check_tensor_parallel refuses any plan that does
    # not split it), so forward returns this rank's slice of the logits: the default loss must be vocab-parallel.
    vocab_parallel_logits = True

    def tensor_parallel_plan(self) -> dict[str, str]:
        """The MLPs split column then row (a MoE block's experts are split by
        :func:`plugin.expert_parallel.apply.apply_expert_parallel`, its router left whole)."""
        mlp = {"blocks.*.mlp.fc": "column", "blocks.*.mlp.proj": "row"} \
            if any(hasattr(b, "mlp") for b in self.blocks) else {}
        return {"embed": "vocab", "blocks.*.attn.qkv": "column", "blocks.*.attn.proj": "row", **mlp,
                "head": "vocab"}

    def check_tensor_parallel(self, styles: Mapping[str, object], tp_size: int, sequence_parallel: bool) -> list[str]:
        from .gpt_checks import check_gpt_plan

        return check_gpt_plan(self.config, styles, tp_size, sequence_parallel)

    def configure_selective_recompute(self, enabled: bool = True) -> None:
        """Selective recompute (the recipe's ``activation_checkpointing.mode`` ``"selective"``): each block's
        attention core runs under the plugin's checkpoint, the rest of the block keeps its activations."""
        for block in self.blocks:
            block.attn.recompute_core = bool(enabled)

    def configure_context_parallel(self, ctx) -> None:
        """Context parallelism (:mod:`plugin.context_parallel`): inputs are this rank's chunks of each row; the
        embedding adds their global positions and every attention core spans the whole sequence over ``ctx.group``."""
        self.cp = ctx
        for block in self.blocks:
            block.attn.cp = ctx
        self._sync_ends()

    def configure_tensor_parallel(self, ctx) -> None:
        self.tp = ctx
        for block in self.blocks:
            block.tp = ctx
            block.attn.rng = ctx.rng
        self._sync_ends()


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Mean cross-entropy over every token of ``targets [batch, seq]``.

    ``tp_group``: the tensor group when the logits are split by vocabulary (every sharded reference GPT:
    its plan must split the head); the loss then never gathers them. ``None`` for whole logits.
    """
    return token_cross_entropy(logits, targets, tp_group, name="gpt_loss")
