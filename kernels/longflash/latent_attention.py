"""Multi-head latent attention (DeepSeek-V2/V3) as a module: longflash.nn.MultiheadLatentAttention.

    attn = longflash.nn.MultiheadLatentAttention(embed_dim=2048, num_heads=16)
    y = attn(x)                                          # training, a prompt: (B, N, E)
    cache = attn.make_cache(batch, capacity)             # the latents and rotary keys only
    y = attn(prompt, kv_cache=cache); y = attn(token, kv_cache=cache)   # generation

Each token's keys and values come from one compressed latent c (kv_lora_rank dims, RMS-normed)
and one rotary key k_r shared by every head (qk_rope_head_dim): head h's key is
[W_UK[h] c, k_r] and its value W_UV[h] c; its query [q_nope, q_rope] (qk_nope_head_dim +
qk_rope_head_dim). The softmax scale is 1/sqrt(qk_nope_head_dim + qk_rope_head_dim).

Without a cache (training, a prompt) the keys and values are expanded per head and attended by
`longflash.attention` (head dims 192 and 128 at DeepSeek-V3's sizes: the kernels take values
of another head dim as they are). With a cache the module keeps what MLA was designed to keep:
c and k_r a token (576 numbers at DeepSeek-V3's sizes, against 2 x 128 x 192 for the expanded
keys and values of 128 heads), and decodes in the absorbed form: W_UK[h] moves into the query,
qv = W_UK[h]^T q_nope (so q_nope . W_UK[h] c = qv . c), and longflash.attention_with_kvcache
attends q_rope over the rotary keys and qv over the latents (qv=: each latent tile read once
for both products), its output in the latent space, which W_UV[h] then maps to head h's value
space. The first call with an empty cache (the prompt) runs the expanded form and stores its c
and k_r; the later ones append theirs in the decoding kernel's append.
"""

import torch
from torch import nn

from ._common import MAX_HEADDIM_V_KVCACHE
from .interface import attention
from .kvcache import attention_with_kvcache
from .nn import KVCache, apply_rotary, rotary_cos_sin
from .reference import attention_ref


class MultiheadLatentAttention(nn.Module):
    """Causal multi-head latent attention with input and output projections.

    Arguments:
        embed_dim: model width.
        num_heads: query heads (each with its own key and value head, from the shared latent).
        kv_lora_rank: the latent's dims (DeepSeek-V3: 512). q_lora_rank: the queries' own
            compression before their up-projection (DeepSeek-V3: 1536), or None (default): one
            projection from x.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: the query and key dims without and
            with rotary embedding, and the values' (DeepSeek-V3: 128, 64, 128).
        rotary_base: the rotary embedding's base (half-split layout, as MultiheadSelfAttention).
        attn_impl: "longflash" (default) or "standard" (longflash.attention_ref: the
            materializing reference; no cache).
        backend: longflash's backend ("auto", "triton", "torch").
    forward(x, kv_cache=None): x (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim).
        kv_cache: None, or a KVCache from make_cache (inference, attn_impl "longflash"): x holds
        the tokens after the cached ones, at positions kv_cache.position onwards.
    """

    def __init__(self, embed_dim, num_heads, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=None, rotary_base=10000.0,
                 attn_impl="longflash", backend="auto", device=None, dtype=None):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                            ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got "
                             f"{qk_rope_head_dim}")
        if attn_impl not in ("longflash", "standard"):
            raise ValueError(f"attn_impl must be 'longflash' or 'standard', got {attn_impl!r}")
        self.embed_dim, self.num_heads, self.kv_lora_rank = embed_dim, num_heads, kv_lora_rank
        self.nope, self.rope, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rotary_base, self.attn_impl, self.backend = rotary_base, attn_impl, backend
        self.softmax_scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        f = dict(device=device, dtype=dtype, bias=False)
        q_dim = num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(embed_dim, q_dim, **f)
        else:
            self.q_proj = nn.Sequential(nn.Linear(embed_dim, q_lora_rank, **f),
                                        nn.RMSNorm(q_lora_rank, device=device, dtype=dtype),
                                        nn.Linear(q_lora_rank, q_dim, **f))
        self.kv_down = nn.Linear(embed_dim, kv_lora_rank + qk_rope_head_dim, **f)  # c, k_r
        self.kv_norm = nn.RMSNorm(kv_lora_rank, device=device, dtype=dtype)
        self.k_up = nn.Linear(kv_lora_rank, num_heads * qk_nope_head_dim, **f)  # W_UK
        self.v_up = nn.Linear(kv_lora_rank, num_heads * v_head_dim, **f)  # W_UV
        self.out_proj = nn.Linear(num_heads * v_head_dim, embed_dim, **f)

    def make_cache(self, batch, capacity, dtype=None, device=None, **kwargs):
        """A KVCache for this layer: the rotary keys (batch, capacity, 1, qk_rope_head_dim) as
        its k, the latents (..., kv_lora_rank) as its v; kwargs: KVCache's (k_descale,
        v_descale for a float8 cache)."""
        if self.kv_lora_rank > MAX_HEADDIM_V_KVCACHE:
            raise ValueError(f"kv_lora_rank {self.kv_lora_rank}: the decoding kernel takes "
                             f"latents of at most {MAX_HEADDIM_V_KVCACHE} dims")
        weight = self.kv_down.weight
        return KVCache(batch, capacity, 1, self.rope, dtype=dtype or weight.dtype,
                       device=device or weight.device, headdim_v=self.kv_lora_rank, **kwargs)

    def _project(self, x, positions):
        """q_nope, q_rope (B, N, H, .), the latent c (B, N, 1, kv_lora_rank) and the rotary key
        k_r (B, N, 1, rope), q_rope and k_r rotated at positions unless positions is None."""
        batch, seqlen, _ = x.shape
        q = self.q_proj(x).view(batch, seqlen, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c, k_rope = self.kv_down(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c, k_rope = self.kv_norm(c)[:, :, None], k_rope[:, :, None]
        if positions is not None:
            cos, sin = rotary_cos_sin(seqlen, self.rope, self.rotary_base, x.device, positions)
            q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        return q_nope, q_rope, c, k_rope

    def forward(self, x, kv_cache=None):
        batch, seqlen, _ = x.shape
        if kv_cache is not None and self.attn_impl != "longflash":
            raise NotImplementedError("kv_cache needs attn_impl 'longflash' (the decoding kernel)")
        if kv_cache is not None and kv_cache.seqlen > 0:
            o = self._decode(x, kv_cache)
            return self.out_proj(o.reshape(batch, seqlen, -1))
        start = 0 if kv_cache is None else kv_cache.position
        positions = torch.arange(start, start + seqlen, device=x.device)
        q_nope, q_rope, c, k_rope = self._project(x, positions)
        heads = (batch, seqlen, self.num_heads)
        k = torch.cat([self.k_up(c[:, :, 0]).view(*heads, self.nope),
                       k_rope.expand(*heads, self.rope)], dim=-1)
        v = self.v_up(c[:, :, 0]).view(*heads, self.v_head_dim)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.attn_impl == "standard":
            o = attention_ref(q, k, v, causal=True, softmax_scale=self.softmax_scale,
                              upcast=False)[0]
        else:
            o = attention(q, k, v, causal=True, softmax_scale=self.softmax_scale,
                          backend=self.backend)
        if kv_cache is not None:  # the prompt: its latents and rotary keys, for the steps after
            kv_cache.store(k_rope, c)
            kv_cache.position += seqlen
        return self.out_proj(o.reshape(batch, seqlen, -1))

    def _decode(self, x, kv_cache):
        """The absorbed form over the cache: qv = W_UK[h]^T q_nope, the attention's output in
        the latent space, then W_UV[h]; the new latents and rotary keys appended (and rotated,
        with q_rope, at positions kv_cache.position onwards) by attention_with_kvcache."""
        q_nope, q_rope, c, k_rope = self._project(x, None)
        w_uk = self.k_up.weight.view(self.num_heads, self.nope, self.kv_lora_rank)
        qv = torch.einsum("bnhd,hdc->bnhc", q_nope, w_uk)
        if kv_cache.position != kv_cache.seqlen:
            raise ValueError(f"kv_cache holds {kv_cache.seqlen} tokens but is at position "
                             f"{kv_cache.position}: a latent cache must hold every token")
        cos, sin = kv_cache.rotary_tables(self.rotary_base)
        o = attention_with_kvcache(q_rope, kv_cache.k, kv_cache.v, k_rope, c, kv_cache.seqlen,
                                   softmax_scale=self.softmax_scale, causal=True,
                                   backend=self.backend, rotary_cos=cos, rotary_sin=sin,
                                   rotary_interleaved=False, k_descale=kv_cache.k_descale,
                                   v_descale=kv_cache.v_descale, qv=qv)  # (B, N, H, latent)
        kv_cache.seqlen += x.shape[1]
        kv_cache.position += x.shape[1]
        w_uv = self.v_up.weight.view(self.num_heads, self.v_head_dim, self.kv_lora_rank)
        return torch.einsum("bnhc,hvc->bnhv", o, w_uv)

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.nope}, "
                f"qk_rope_head_dim={self.rope}, v_head_dim={self.v_head_dim}, "
                f"attn_impl={self.attn_impl!r}")


__all__ = ["MultiheadLatentAttention"]
