"""A small causal transformer whose attention can run with the sequence sharded over context parallel.

Each rank holds a contiguous slice of the sequence; attention needs every key and value before it, so
K and V are gathered over the cp axis (a ``gather`` callable passed in by the caller, which the demo
routes through spmd_types on the registry's cp group). With ``gather=None`` the model is the plain
single-rank transformer, which is what the sharded one must agree with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ModelConfig", "SeqGather", "TinyTransformer"]

SeqGather = Callable[[torch.Tensor], torch.Tensor]
"""Gathers a ``[batch, heads, local_seq, head_dim]`` tensor into ``[batch, heads, seq, head_dim]``."""


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo transformer (small on purpose: the demo must run in seconds on 2 cores)."""

    vocab: int = 64
    dim: int = 32
    heads: int = 4
    layers: int = 2
    max_seq: int = 64
    mlp_ratio: int = 2


class Attention(nn.Module):
    """Causal multi-head self-attention over a (possibly cp-sharded) sequence."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, offset: int, gather: SeqGather | None) -> torch.Tensor:
        """``x``: ``[batch, local_seq, dim]`` holding global positions ``offset ..``."""
        batch, local, dim = x.shape
        q, k, v = self.qkv(x).view(batch, local, 3, self.heads, dim // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, local, head_dim]
        if gather is not None:
            k, v = gather(k), gather(v)
        total = k.shape[2]
        # Causal over *global* positions: query offset+i sees keys 0..offset+i.
        q_pos = torch.arange(offset, offset + local, device=x.device)[:, None]
        k_pos = torch.arange(total, device=x.device)[None, :]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=k_pos <= q_pos)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(batch, local, dim))
        return out


class Block(nn.Module):
    """Pre-norm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim),
            nn.GELU(),
            nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim),
        )

    def forward(self, x: torch.Tensor, offset: int, gather: SeqGather | None) -> torch.Tensor:
        """One block on a sequence slice starting at global position ``offset``."""
        x = x + self.attn(self.norm1(x), offset, gather)
        mlp: torch.Tensor = self.mlp(self.norm2(x))
        return x + mlp


class TinyTransformer(nn.Module):
    """Token and position embeddings, ``cfg.layers`` blocks, a final norm and an LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(
        self, tokens: torch.Tensor, offset: int = 0, gather: SeqGather | None = None
    ) -> torch.Tensor:
        """Logits ``[batch, local_seq, vocab]`` for ``tokens`` at global positions ``offset ..``."""
        positions = torch.arange(offset, offset + tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, offset, gather)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits
