"""torch's ``nn.MultiheadAttention`` split by heads over the tp group (plan style ``"heads"``, Megatron's split).

Each rank holds ``h_r`` of the ``H`` heads (``E_r = h_r * head_dim`` features): their rows of q, k and v in the
fused ``in_proj_weight`` -- ``[3E, E]`` is the three stacked, so the rank's piece is its rows of each,
``[3 E_r, E]`` (a :class:`~lightning_shm.parallel.placement.Split` of 3 blocks) -- and their columns of
``out_proj.weight`` (``[E, E_r]``, a row layer); ``out_proj.bias`` is whole. Data movement, x whole on every rank::

    q, k, v = x W_{q,k,v; r}^T + b       [B, h_r, L, d] each: this rank's heads, no communication
    o_r = attention(q, k, v, mask)       [B, L, E_r]
    o_r W_o[:, r]^T   --all-reduce-->    [B, L, E] on every rank, + out_proj.bias once
    weights (need_weights)               the rank's heads' [B, h_r, L, S]: summed over the ranks / H (averaged),
                                         or gathered along the heads

Masks are taken as torch's ``MultiheadAttention`` takes them (bool or float; ``key_padding_mask`` added to
``attn_mask``; a 3-D ``attn_mask`` ``[B*H, L, S]`` cut to the rank's heads; ``is_causal`` as torch honours it), and
the two paths are torch's: explicit softmax when the weights are asked for, ``scaled_dot_product_attention``
otherwise. Dropout on the weights draws each rank's own mask (as between any column and row layer).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lightning_shm.parallel.tp.layers import RowParallelLinear, _enter, _leave, _slice
from lightning_shm.parallel.tp.mappings import copy_to_tp, gather_from_tp, reduce_from_tp
from lightning_shm.parallel.tp.rng import SplitRegionRandom
from lightning_shm.runtime import Group


def heads_unsupported(m: nn.MultiheadAttention) -> str:
    """Why ``m`` cannot be split by heads here ('' if it can)."""
    if not m._qkv_same_embed_dim:
        return f"kdim={m.kdim} / vdim={m.vdim} (separate q, k and v weights)"
    if m.bias_k is not None or m.add_zero_attn:
        return "add_bias_kv / add_zero_attn"
    return ""


class HeadParallelMultiheadAttention(nn.MultiheadAttention):
    """An ``nn.MultiheadAttention`` computing this rank's heads; ``sizes``: features per rank (heads x head_dim)."""

    split_dims = {"in_proj_weight": 0, "in_proj_bias": 0}
    split_blocks = {"in_proj_weight": 3, "in_proj_bias": 3}  # q, k and v stacked: the rank's rows of each

    def __init__(self, full: nn.MultiheadAttention, group: Group, sizes: Sequence[int],
                 random: Optional[SplitRegionRandom] = None) -> None:
        nn.Module.__init__(self)  # not MultiheadAttention's: it would allocate the whole weights
        why = heads_unsupported(full)
        if why:
            raise ValueError(f"an nn.MultiheadAttention with {why} cannot be split by heads here")
        self.group, self.sizes, self.random = group, list(sizes), random
        self.embed_dim = self.kdim = self.vdim = full.embed_dim
        self._qkv_same_embed_dim, self.batch_first, self.dropout = True, full.batch_first, full.dropout
        self.head_dim, self.full_num_heads = full.head_dim, full.num_heads
        self.num_heads = self.sizes[group.index] // full.head_dim  # this rank's
        self.first_head = sum(self.sizes[:group.index]) // full.head_dim
        self.in_proj_weight = _slice(full.in_proj_weight, 0, self.sizes, group, blocks=3)  # q, k, v
        self.in_proj_bias = _slice(full.in_proj_bias, 0, self.sizes, group, blocks=3)
        for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
            self.register_parameter(name, None)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.out_proj = RowParallelLinear(full.out_proj, group, self.sizes)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[torch.Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if query.is_nested or key.is_nested or value.is_nested:
            return self._per_sample(query, key, value, attn_mask, need_weights)
        key_padding_mask = F._canonical_mask(mask=key_padding_mask, mask_name="key_padding_mask",
                                             other_type=F._none_or_dtype(attn_mask), other_name="attn_mask",
                                             target_type=query.dtype)
        attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None, other_name="",
                                      target_type=query.dtype, check_other=False)
        batched = query.dim() == 3
        if self.batch_first and batched:  # [B, L, E] -> [L, B, E], keeping "key is query" as torch does
            query, key, value = _transposed(query, key, value)
        if not batched:  # [L, E] -> [L, 1, E]
            query, key, value = _transposed(query, key, value, lambda t: t.unsqueeze(1))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
                               "method `generate_square_subsequent_mask` to create this mask.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # scaled_dot_product_attention's causal path, as torch takes it
        elif key_padding_mask is not None:
            is_causal = False
        out, weights = self._attend(query, key, value, key_padding_mask, attn_mask, need_weights,
                                    average_attn_weights, is_causal)
        if not batched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        elif self.batch_first:
            out = out.transpose(1, 0)
        return out, weights

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: Optional[torch.Tensor], attn_mask: Optional[torch.Tensor], need_weights: bool,
                average: bool, is_causal: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """[L, B, E] inputs -> ([L, B, E] output, the weights as torch gives them)."""
        L, B, E = query.shape
        S, h, d = key.shape[0], self.num_heads, self.head_dim
        q_in = copy_to_tp(query, self.group)  # whole on every rank; its gradient is summed over the heads' ranks
        k_in = q_in if key is query else copy_to_tp(key, self.group)
        v_in = k_in if value is key else q_in if value is query else copy_to_tp(value, self.group)
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(q_in, w_q, b_q).view(L, B, h, d).permute(1, 2, 0, 3)  # [B, h, L, d]
        k = F.linear(k_in, w_k, b_k).view(S, B, h, d).permute(1, 2, 0, 3)
        v = F.linear(v_in, w_v, b_v).view(S, B, h, d).permute(1, 2, 0, 3)
        _enter(self.random)
        if attn_mask is not None:  # [L, S] for every head, or [B*H, L, S]: this rank's heads of it
            attn_mask = (attn_mask.view(1, 1, L, S) if attn_mask.dim() == 2 else
                         attn_mask.view(B, self.full_num_heads, L, S)[:, self.first_head:self.first_head + h])
        if key_padding_mask is not None:
            kpm = key_padding_mask.view(B, 1, 1, S)
            attn_mask = kpm if attn_mask is None else attn_mask + kpm
        p = self.dropout if self.training else 0.0
        weights: Optional[torch.Tensor] = None
        if need_weights:  # torch's explicit path
            scores = (q * math.sqrt(1.0 / d)) @ k.transpose(-2, -1)
            weights = torch.softmax(scores if attn_mask is None else attn_mask + scores, dim=-1)
            o = (F.dropout(weights, p=p) if p > 0.0 else weights) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask, p, is_causal)
        o = o.permute(2, 0, 1, 3).reshape(L * B, h * d)  # [L*B, E_r]
        out = RowParallelLinear.forward(self.out_proj, o).view(L, B, E)  # all-reduce, bias once (no hooks: torch
        # reads out_proj's weights without calling it)
        _leave(self.random)
        if weights is not None:
            if average:
                weights = reduce_from_tp(weights.sum(1), self.group) / self.full_num_heads
            else:
                heads = tuple(n // d for n in self.sizes)
                weights = gather_from_tp(weights.movedim(1, -1), self.group, heads).movedim(-1, 1)
        return out, weights

    def _per_sample(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: Optional[torch.Tensor], need_weights: bool) -> tuple[torch.Tensor, None]:
        """A nested tensor (torch's encoder in inference, the padding dropped): each sample on its own."""
        if not (query is key and key is value) or need_weights:
            raise ValueError("a head-split nn.MultiheadAttention takes a nested tensor only as torch's encoder "
                             "layers hand it one: self-attention without the weights")
        outs = [self.forward(s.unsqueeze(0), s.unsqueeze(0), s.unsqueeze(0), need_weights=False,
                             attn_mask=attn_mask)[0].squeeze(0) for s in query.unbind()]
        return torch.nested.as_nested_tensor(outs, layout=torch.strided), None

    def extra_repr(self) -> str:
        return (f"heads {self.first_head}..{self.first_head + self.num_heads - 1} of {self.full_num_heads}, "
                f"embed_dim={self.embed_dim}, tp={self.group.size}")


def _transposed(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                fn: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.transpose(1, 0)
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` of each, keeping which of them are the same tensor (the projections take that as self-attention)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else q if value is query else fn(value)
    return q, k, v
