"""A compact GPT (decoder-only transformer) in the spirit of nanoGPT, with pluggable attention.

    from longflash.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, attn_impl="longflash"))
    logits, loss = model(idx, targets)       # idx, targets: (batch, seqlen) int64

Pre-norm blocks (LayerNorm, self-attention, LayerNorm, 4x GELU MLP), rotary position embeddings
(so no maximum context is baked into the weights), tied input/output embeddings, byte-level
vocabulary by default. `attn_impl` is "longflash", "sdpa" or "standard" (materialized); the
rest of the model is identical, so differences in memory or loss come from attention alone.
`checkpoint=True` recomputes each block in the backward pass (activation checkpointing).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..nn import MultiheadSelfAttention


@dataclass
class GPTConfig:
    vocab_size: int = 256          # bytes
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int | None = None   # None: multi-head; fewer: grouped-query attention
    n_embd: int = 256
    dropout: float = 0.0           # residual and attention dropout
    bias: bool = False             # biases in Linear and LayerNorm
    attn_impl: str = "longflash"   # "longflash" | "sdpa" | "standard"
    checkpoint: bool = False       # activation checkpointing per block


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiheadSelfAttention(config.n_embd, config.n_head, config.n_head_kv,
                                           causal=True, bias=config.bias, rotary=True,
                                           dropout=config.dropout, attn_impl=config.attn_impl)
        self.dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):  # (B, N, C) -> (B, N, C)
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("out_proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None):
        """idx: (batch, seqlen) int64 -> logits (batch, seqlen, vocab_size), and the mean
        cross-entropy against targets (batch, seqlen) if given (else None)."""
        x = self.drop(self.wte(idx))  # (B, N, C)
        for block in self.blocks:
            if self.config.checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, N, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss
