"""A compact GPT (decoder-only transformer) in the spirit of nanoGPT, with pluggable attention.

    from longflash.models import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, attn_impl="longflash"))
    logits, loss = model(idx, targets)       # idx, targets: (batch, seqlen) int64
    out = model.generate(idx, max_new_tokens=100, temperature=0.8, top_k=50)

Pre-norm blocks (LayerNorm, self-attention, LayerNorm, 4x GELU MLP), rotary position embeddings
(so no maximum context is baked into the weights), tied input/output embeddings, byte-level
vocabulary by default. `attn_impl` is "longflash", "sdpa" or "standard" (materialized); the
rest of the model is identical, so differences in memory or loss come from attention alone.
"ring" trains with context parallelism: every rank of the process group (`GPT(config,
ring_group)`, default the default group) passes its shard of idx and of targets
(longflash.parallel.shard_sequence, in config.ring_layout), the loss is the mean
over its tokens, and the ranks' gradients are averaged (as DDP does) to give the gradient of
the whole sequence's loss.
`checkpoint=True` recomputes each block in the backward pass (activation checkpointing);
`window_left` gives every layer a causal sliding window (Mistral's layers), in training and
generation, "ring" included.
`generate` samples with a KV cache (longflash.nn.KVCache per block): the prompt once, then one
decoding step (attention_with_kvcache) per new token; with window_left, a rolling cache of the
window's tokens (its memory independent of the length generated). With "ring", every rank
passes the whole prompt; each keeps its shard's keys and values and a share of the new
tokens' (context parallelism at inference: attention_with_sharded_kvcache), and every rank
returns the same tokens.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..nn import KVCache, MultiheadSelfAttention
from ..parallel import shard_positions, shard_sequence


@dataclass
class GPTConfig:
    vocab_size: int = 256          # bytes
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int | None = None   # None: multi-head; fewer: grouped-query attention
    n_embd: int = 256
    dropout: float = 0.0           # residual and attention dropout
    bias: bool = False             # biases in Linear and LayerNorm
    attn_impl: str = "longflash"   # "longflash" | "sdpa" | "standard" | "ring"
    checkpoint: bool = False       # activation checkpointing per block
    attn_sinks: bool = False       # a learned attention sink per head (gpt-oss)
    ring_layout: str = "zigzag"    # attn_impl "ring": how the sequence is sharded
    window_left: int = -1          # sliding window: a token sees itself and the window_left
                                   # tokens before it, in every layer (-1: all before it)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config, ring_group=None):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = MultiheadSelfAttention(config.n_embd, config.n_head, config.n_head_kv,
                                           causal=True, bias=config.bias, rotary=True,
                                           dropout=config.dropout, attn_impl=config.attn_impl,
                                           sinks=config.attn_sinks, ring_group=ring_group,
                                           ring_layout=config.ring_layout,
                                           window_size=(config.window_left, 0)
                                           if config.window_left >= 0 else (-1, -1))
        self.dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):  # (B, N, C) -> (B, N, C)
        x = x + self.dropout(self.attn(self.ln_1(x), kv_cache))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT(config, ring_group=None): ring_group, with attn_impl "ring", the process group that
    holds the sequence's shards (None: the default group)."""

    def __init__(self, config, ring_group=None):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, ring_group) for _ in range(config.n_layer))
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

    def forward(self, idx, targets=None, kv_cache=None):
        """idx: (batch, seqlen) int64 -> logits (batch, seqlen, vocab_size), and the mean
        cross-entropy against targets (batch, seqlen) if given (else None). kv_cache: a list of
        one KVCache per block (new_kv_cache) for inference: idx are then the tokens after the
        cached ones, and are appended to the cache (attn_impl "ring": the first call, on empty
        caches, takes this rank's shard of the prompt; later ones the new tokens, the same on
        every rank, longflash.nn.MultiheadSelfAttention)."""
        x = self.drop(self.wte(idx))  # (B, N, C)
        for i, block in enumerate(self.blocks):
            if kv_cache is not None:
                x = block(x, kv_cache[i])
            elif self.config.checkpoint and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, N, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss

    def new_kv_cache(self, batch, capacity, dtype=None, k_descale=None, v_descale=None,
                     rolling=False):
        """An empty KV cache for `capacity` tokens per sequence: one KVCache per block, on the
        model's device, in the model's dtype or `dtype` (a float8 one with its scales:
        longflash.nn.KVCache); rolling: the last `capacity` tokens only (KVCache's rolling,
        with window_left < capacity)."""
        weight = self.wte.weight
        return [KVCache(batch, capacity, block.attn.num_heads_kv, block.attn.headdim,
                        dtype=dtype or weight.dtype, device=weight.device, k_descale=k_descale,
                        v_descale=v_descale, rolling=rolling) for block in self.blocks]

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, generator=None,
                 kv_cache_dtype=None, k_descale=None, v_descale=None):
        """Continue each prompt of idx (batch, seqlen) by max_new_tokens sampled tokens:
        logits / temperature, restricted to the top_k most likely if given; temperature 0
        picks the most likely (greedy). The prompt runs once into a fresh KV cache, then each
        token is one decoding step over it; with window_left (attn_impl "longflash") a rolling
        cache of window_left + 1 tokens, whatever the length. kv_cache_dtype, k_descale,
        v_descale: the cache's dtype (default the model's; a float8 one quantizes it) and a
        float8 cache's scales, as new_kv_cache takes them. Returns (batch, seqlen +
        max_new_tokens). Call it in eval mode (dropout would apply otherwise).
        attn_impl "ring": call it on every rank of the group with the same idx; the prompt's
        length must be divisible by the layout's chunks (2P zigzag, P contiguous). Each rank's
        caches hold its shard of the prompt and every P-th new token; the group's first rank
        samples (with its generator) and sends each token to the others, so every rank returns
        the same tokens."""
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        group = None  # the context-parallel group, with "ring"
        step, capacity = idx, idx.shape[1] + max_new_tokens
        if self.config.attn_impl == "ring":
            group = self.blocks[0].attn.ring_group or dist.group.WORLD
            world = dist.get_world_size(group)
            step = shard_sequence(idx, self.config.ring_layout, group)
            capacity = step.shape[1] + -(-max_new_tokens // world)  # its share of the new ones
        rolling = self.config.attn_impl == "longflash" and \
            0 <= self.config.window_left < capacity - 1  # the window's keys are all it keeps
        if rolling:
            capacity = self.config.window_left + 1
        cache = self.new_kv_cache(idx.shape[0], capacity, kv_cache_dtype, k_descale, v_descale,
                                  rolling)
        tokens = [idx]
        for t in range(max_new_tokens):
            logits = self(step, kv_cache=cache)[0][:, -1].float()  # (B, V)
            if group is not None and t == 0:  # the prompt's last token's, from its rank
                positions = shard_positions(step.shape[1], self.config.ring_layout, group)
                if int(positions[-1]) != idx.shape[1] - 1:
                    logits = torch.zeros_like(logits)
                dist.all_reduce(logits, group=group)
            if temperature == 0:
                step = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                step = torch.multinomial(logits.softmax(-1), 1, generator=generator)
            if group is not None:  # the first rank's draw
                dist.broadcast(step, src=dist.get_global_rank(group, 0), group=group)
            tokens.append(step)
        return torch.cat(tokens, dim=1)
