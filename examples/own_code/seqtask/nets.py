"""A small causal transformer over bytes (nanoGPT-shaped, built from torch's own layers)."""

from __future__ import annotations

import torch
from torch import nn


class TinyTransformer(nn.Module):
    """Byte embeddings + learned positions → ``depth`` pre-norm causal self-attention blocks → next-byte logits."""

    def __init__(self, vocab: int = 256, dim: int = 64, depth: int = 2, heads: int = 4, block: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(block, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.pos[:t]
        h = self.blocks(h, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(h))
