"""A small transformer for MNIST that reads the image's 28 rows as 28 tokens.

``nn.Sequential(RowEmbedding, Block x depth, Head)``: a pipeline cuts it between blocks, FSDP makes
each block a unit, tensor parallelism splits attention by whole heads and the MLP by its hidden
features. Nothing in it knows about parallelism; the attention derives its number of heads from
the width of its projections (``view(B, T, -1, head_dim)``), so it runs unchanged on the heads a
tensor-parallel rank holds.

Shapes (B images, T = 28 tokens, d = dim)::

    [B, 1, 28, 28] -> RowEmbedding -> [B, 28, d] -> Block ... Block -> [B, 28, d] -> Head -> [B, 10]
    Block:  x + Attention(LayerNorm(x)),  then  x + MLP(LayerNorm(x))          (pre-norm)
    Head:   LayerNorm -> mean over tokens -> Linear(d, 10)
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

TOKENS = 28


class RowEmbedding(nn.Module):
    """Each of the 28 pixel rows becomes a token: a Linear(28, d) plus a learned position."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(28, dim)
        self.position = nn.Parameter(torch.randn(TOKENS, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.reshape(x.shape[0], TOKENS, 28)) + self.position


class Attention(nn.Module):
    """Multi-head self-attention; the number of heads follows from the projections' width."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # [B, heads here, T, head_dim]
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(OrderedDict(fc1=nn.Linear(dim, mlp_ratio * dim), act=nn.GELU(),
                                             fc2=nn.Linear(mlp_ratio * dim, dim)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(x).mean(dim=1))


def build_transformer(dim: int = 64, depth: int = 4, heads: int = 4, mlp_ratio: int = 4,
                      num_classes: int = 10) -> nn.Sequential:
    if min(dim, depth, heads, mlp_ratio) < 1:
        raise ValueError(f"dim, depth, heads and mlp_ratio must be positive, got {dim}, {depth}, {heads}, {mlp_ratio}")
    return nn.Sequential(RowEmbedding(dim), *(Block(dim, heads, mlp_ratio) for _ in range(depth)),
                         Head(dim, num_classes))


# module paths relative to a LightningModule holding the Sequential as ``net``; "*" is one block.
# q, k, v split by whole heads (the attention's head_dim), o takes the heads back (row); the MLP
# splits its hidden features.
TRANSFORMER_TP_PLAN = {
    "net.*.attn.q": "column", "net.*.attn.k": "column", "net.*.attn.v": "column", "net.*.attn.o": "row",
    "net.*.mlp.fc1": "column", "net.*.mlp.fc2": "row",
}
