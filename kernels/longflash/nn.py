"""Attention as a module for model code: multi-head / grouped-query self-attention.

    attn = longflash.nn.MultiheadSelfAttention(embed_dim=768, num_heads=12, num_heads_kv=4,
                                                rotary=True)
    y = attn(x)                              # x, y: (batch, seqlen, embed_dim)

`attn_impl` picks the attention function, so one model can be run with each of the three
that the experiments compare, or across the ranks of a process group:
    "longflash"  longflash.attention (Triton on CUDA, the blockwise path on CPU): O(N) memory
    "sdpa"       torch.nn.functional.scaled_dot_product_attention (PyTorch's own backends)
    "standard"   longflash.attention_ref: materializes the (seqlen x seqlen) matrix
    "ring"       longflash.parallel.ring_attention (context parallelism): x is this rank's
                 shard of the sequence (longflash.parallel.shard_sequence, over ring_group,
                 default the default process group, in ring_layout, default zigzag), rotary
                 embeddings at the shard's global positions (shard_positions); every rank of
                 the group calls the module on its shard. Attention dropout drops what
                 "longflash" drops on the whole sequence when the group's first rank's
                 generator is in the state that one device's would be (its draw is the seed)

Rotary position embeddings (Su et al., RoFormer) use the half-split layout of GPT-NeoX and
Llama: dimension i of the first half pairs with dimension i of the second half.

Generation: `forward(x, kv_cache=KVCache(...))` appends the new tokens' keys and values to the
cache and attends over everything cached (longflash.attention_with_kvcache: the split-KV
decoding kernel, with the append and rotary embedding in one kernel on a GPU). With
attn_impl="ring" each rank's cache holds its part of the sequence: the prompt's shard (run by
ring attention), then a share of the new tokens, which every rank passes and which attend to
every rank's part (longflash.parallel.attention_with_sharded_kvcache). Under a sliding window,
KVCache(rolling=True) keeps the window's tokens only, its rows a ring buffer.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .interface import _seed_tensor, attention
from ._common import FP8_DTYPES, as_bytes, check_window_size, take, visible
from .kvcache import _append as kvcache_append
from .kvcache import attention_with_kvcache, check_descale, quantize
from .parallel import attention_with_sharded_kvcache, ring_attention, shard_positions
from .reference import attention_ref

ATTN_IMPLEMENTATIONS = ("longflash", "sdpa", "standard", "ring")


def rotary_cos_sin(seqlen, headdim, base=10000.0, device=None, positions=None):
    """cos, sin of the rotary angles: each (seqlen, headdim // 2), float32.

    Position p and frequency i give the angle p * base^(-2i / headdim); positions: (seqlen,)
    the tokens' positions (default 0 .. seqlen - 1; a ring shard's: shard_positions)."""
    inv_freq = base ** (-torch.arange(0, headdim // 2, device=device, dtype=torch.float32)
                        * 2 / headdim)
    positions = torch.arange(seqlen, device=device) if positions is None else positions
    angles = torch.outer(positions.to(device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin, interleaved=False):
    """Rotate the first rotary_dim = 2 * cos.shape[-1] dims of x: (batch, seqlen, nheads,
    headdim) by position; the other dims pass through. cos, sin: (seqlen, rotary_dim // 2), or
    (batch, seqlen, rotary_dim // 2) where each sequence has its own positions.
    Layout: dim i pairs with dim i + rotary_dim // 2 (GPT-NeoX, Llama), or, if interleaved,
    dim 2i with dim 2i + 1 (GPT-J). Computed in float32 and returned in x's dtype (float64
    stays float64)."""
    dtype = x.dtype
    x = x if dtype == torch.float64 else x.float()
    rotary_dim = 2 * cos.shape[-1]
    cos, sin = (c.to(x.dtype).unsqueeze(-2) for c in (cos, sin))  # (..., N, 1, rotary_dim / 2)
    if interleaved:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)  # (B, N, H, rotary_dim / 2) each
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1).to(dtype)


def attention_function(attn_impl, backend="auto", group=None, layout="zigzag"):
    """The attention of `attn_impl`, as f(q, k, v, causal, dropout_p, learnable_sink=None,
    window_size=(-1, -1)) on (batch, seqlen, nheads, headdim) tensors; k, v may have fewer
    heads (GQA); window_size as in longflash.attention ("sdpa": as a boolean mask, O(N^2)).
    "sdpa" takes no learnable_sink. group, layout: "ring"'s process group (None: the default)
    and layout."""
    if attn_impl == "longflash":
        return lambda q, k, v, causal, dropout_p, learnable_sink=None, window_size=(-1, -1): \
            attention(q, k, v, causal=causal, dropout_p=dropout_p, backend=backend,
                      learnable_sink=learnable_sink, window_size=window_size)
    if attn_impl == "standard":
        def standard(q, k, v, causal, dropout_p, learnable_sink=None, window_size=(-1, -1)):
            # the seed drawn as "longflash" and "ring" draw it
            seed = int(_seed_tensor(dropout_p, None, None)) if dropout_p > 0 else 0
            return attention_ref(q, k, v, causal=causal, dropout_p=dropout_p, seed=seed,
                                 upcast=False, learnable_sink=learnable_sink,
                                 window_size=window_size)[0]
        return standard
    if attn_impl == "ring":
        def ring(q, k, v, causal, dropout_p, learnable_sink=None, window_size=(-1, -1)):
            return ring_attention(q, k, v, causal=causal, backend=backend, group=group,
                                  layout=layout, learnable_sink=learnable_sink,
                                  dropout_p=dropout_p, window_size=window_size)
        return ring
    if attn_impl == "sdpa":
        def sdpa(q, k, v, causal, dropout_p, window_size=(-1, -1)):
            group = q.shape[2] // k.shape[2]
            if group > 1:  # enable_gqa= needs torch >= 2.5
                k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
            mask = None
            if tuple(window_size) != (-1, -1):  # causal folded in: SDPA takes one or the other
                i = torch.arange(q.shape[1], device=q.device)[:, None]
                j = torch.arange(k.shape[1], device=q.device)[None, :]
                mask = visible(i, j, q.shape[1], k.shape[1], window_size[0],
                               0 if causal else window_size[1])  # (Nq, Nk)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), attn_mask=mask,
                                               dropout_p=dropout_p,
                                               is_causal=causal and mask is None)  # (B, H, N, D)
            return o.transpose(1, 2)
        return sdpa
    raise ValueError(f"attn_impl must be one of {ATTN_IMPLEMENTATIONS}, got {attn_impl!r}")


class _Shared:
    """A value that copies of a module share (copy.deepcopy: an EMA copy, say): a process group
    cannot be copied."""

    def __init__(self, value):
        self.value = value

    def __deepcopy__(self, memo):
        return self


class KVCache:
    """One attention layer's keys and values for generation: k, v (batch, capacity, nheads_kv,
    headdim), the first `seqlen` positions filled (the same number for every sequence), and
    the rotary tables of positions [0, capacity), made once. MultiheadSelfAttention.forward
    appends to it and advances seqlen and `position`, the tokens seen so far (the whole
    sequence's; seqlen too, but where the cache is one rank's part of a sharded one,
    attn_impl="ring"). A float8 dtype (torch.float8_e4m3fn or float8_e5m2)
    keeps them quantized, with k_descale, v_descale as attention_with_kvcache takes them (a
    float or a float32 tensor broadcastable to (batch, nheads_kv); None: 1): half a 16-bit
    cache's memory and bytes read per step. headdim_v: the values' head dim, if not headdim's
    (MultiheadLatentAttention's cache: the rotary keys and the latents).

    rolling=True (a layer with a sliding window, attn_impl "longflash"): the rows are a ring
    buffer holding the last `capacity` tokens only, token p at row p % capacity (seqlen is
    then the rows filled, at most capacity), so the cache's memory stays the window's,
    however long the generation. A window of w keys before each token needs capacity > w;
    with capacity w + c, a call with up to c new tokens appends and attends in place (the
    decoding kernel over the rows, a mask from their positions where some row is out of a
    query's window), a longer one (a prompt, say) attends over a copy of the w rows it needs
    and its own keys. capacity w + 1 is enough for decoding one token at a time."""

    def __init__(self, batch, capacity, nheads_kv, headdim, dtype=None, device=None,
                 k_descale=None, v_descale=None, rolling=False, headdim_v=None):
        self.k = torch.zeros(batch, capacity, nheads_kv, headdim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, capacity, nheads_kv, headdim_v or headdim, dtype=dtype,
                             device=device)
        self.k_descale, self.v_descale = k_descale, v_descale
        self.rolling = bool(rolling)
        self.seqlen = self.position = 0
        self.ranks_checked = False  # attn_impl "ring": the ranks' arguments compared once
        # attn_impl "ring": each row's position in the whole sequence (a rank's rows are not
        # consecutive positions), for sliding windows; -1 where no token is stored. Also on
        # the host (set_row_positions), to find a window's first row with no device read
        self.row_positions = torch.full((capacity,), -1, dtype=torch.long, device=device)
        self._host_positions = torch.full((capacity,), -1, dtype=torch.long)
        self._in_order = True  # the rows' positions increase (they do as the module stores)
        self._rotary = {}

    @property
    def capacity(self):
        return self.k.shape[1]

    def store(self, k, v, positions=None):
        """Write k, v (batch, n, nheads_kv, headdim) at rows seqlen .. seqlen + n - 1 (quantized
        as the decoding kernel's append quantizes, for a float8 cache) and advance seqlen.
        positions: (n,) the tokens' positions in the whole sequence (row_positions), if
        given; a rolling cache needs them: token p goes to row p % capacity."""
        n = k.shape[1]
        if self.rolling and (positions is None or n > self.capacity):
            raise ValueError(f"a rolling cache stores at most its capacity ({self.capacity}) "
                             f"tokens at a time, with their positions; got {n} tokens, "
                             f"positions {'None' if positions is None else 'given'}")
        if not self.rolling and self.seqlen + n > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens a sequence; {self.seqlen} "
                             f"are stored and {n} more do not fit")
        rows = positions % self.capacity if self.rolling else None
        for new, cache in zip(self.as_stored(k, v, quantized=True), (self.k, self.v)):
            if rows is None:
                kvcache_append(cache, new, self.seqlen, None)  # as attention_with_kvcache does
            else:
                as_bytes(cache).index_copy_(1, rows, as_bytes(new))
        if rows is not None:
            self.row_positions.index_copy_(0, rows, positions)
        elif positions is not None:
            self.set_row_positions(positions)
        self.seqlen = min(self.seqlen + n, self.capacity) if self.rolling else self.seqlen + n

    def set_row_positions(self, positions, host=None):
        """Rows seqlen .. seqlen + n - 1 hold the tokens at positions (n,) (not rolling); host:
        the same on the CPU, if at hand (else read: a ring's prompt, once)."""
        n, host = positions.shape[0], positions.cpu() if host is None else host
        self.row_positions[self.seqlen:self.seqlen + n] = positions
        self._host_positions[self.seqlen:self.seqlen + n] = host
        if n:
            last = self._host_positions[self.seqlen - 1] if self.seqlen else -1
            self._in_order = self._in_order and bool((host.diff() > 0).all()) and \
                bool(host[0] > last)

    def first_row_at(self, position):
        """The first of the stored rows whose position is at least `position`, if the rows are
        in position order (else 0), from the host's copy of the positions."""
        if not self._in_order:
            return 0
        return int(torch.searchsorted(self._host_positions[:self.seqlen], position))

    def as_stored(self, k, v, quantized=False):
        """k, v as the cache holds them: a float8 cache's quantized values (kvcache.quantize)
        if quantized, else those values times their scales in k's dtype (what the attention
        over the cache sees); a 16- or 32-bit cache's, k and v in its dtype."""
        out = []
        for name, cache, new, descale in (("k_descale", self.k, k, self.k_descale),
                                          ("v_descale", self.v, v, self.v_descale)):
            if cache.dtype not in FP8_DTYPES:
                out.append(new.to(cache.dtype))
                continue
            scale = check_descale(name, descale, new.shape[0], cache, new.device)
            stored = quantize(new, scale, cache.dtype)
            out.append(stored if quantized else self._dequantize(stored, scale, new.dtype))
        return out

    @staticmethod
    def _dequantize(x, scale, dtype):
        x = x.float()
        return (x if scale is None else x * scale[:, None, :, None]).to(dtype)

    def rows_in_order(self, first, last, dtype):
        """Keys and values of positions first .. last - 1 (all stored), in order, as the
        attention over the cache sees them (a float8 cache's times their scales), in dtype."""
        rows = torch.arange(first, last, device=self.k.device)
        if self.rolling:
            rows = rows % self.capacity
        out = []
        for name, cache, descale in (("k_descale", self.k, self.k_descale),
                                     ("v_descale", self.v, self.v_descale)):
            x = take(cache, slice(None), rows)
            if cache.dtype in FP8_DTYPES:
                x = self._dequantize(x, check_descale(name, descale, x.shape[0], cache,
                                                      x.device), dtype)
            out.append(x.to(dtype))
        return out

    def rotary_tables(self, base):
        """cos, sin (capacity, headdim // 2) of rotary_cos_sin, for every position."""
        if base not in self._rotary:
            self._rotary[base] = rotary_cos_sin(self.k.shape[1], self.k.shape[3], base,
                                                self.k.device)
        return self._rotary[base]


class MultiheadSelfAttention(nn.Module):
    """Multi-head (num_heads_kv = num_heads), grouped-query or multi-query (num_heads_kv = 1)
    self-attention with input and output projections.

    Arguments:
        embed_dim: model width; headdim = embed_dim // num_heads.
        num_heads: query heads. num_heads_kv: key/value heads (default num_heads); must divide
            num_heads.
        causal: a token attends to itself and earlier tokens only (default True).
        bias: biases in the projections (default False).
        rotary: rotary position embeddings on q and k (default False); rotary_base: 10000.
        dropout: attention dropout probability, applied in training mode only.
        window_size: (left, right), a sliding window as in longflash.attention (a token sees
            the keys from left before it to right after it; right is 0 with causal; -1:
            unbounded), in every attn_impl and with a KV cache (default (-1, -1): none).
        sinks: a learned attention sink per query head (`self.sinks`, (num_heads,), zeros at
            first), as in gpt-oss: one more logit in every row's softmax, attending to no value
            (`learnable_sink` of longflash.attention). Not with attn_impl="sdpa".
        attn_impl: "longflash" (default), "sdpa", "standard" or "ring" (see the module
            docstring).
        backend: longflash's backend ("auto", "triton", "torch") when attn_impl="longflash";
            setting `module.backend` later switches both paths (with and without a KV cache).
        ring_group, ring_layout: attn_impl="ring" only: the process group whose ranks hold the
            sequence's shards (None: the default group; under data x context parallelism, the
            context-parallel group) and its layout ("zigzag" or "contiguous").
    forward(x, kv_cache=None): x (batch, seqlen, embed_dim) -> (batch, seqlen, embed_dim).
        With a KVCache (inference, causal, attn_impl "longflash" or "ring"), x holds the tokens
        after the cached ones: their keys and values are appended and they attend to every
        cached token, at positions kv_cache.position onwards (no dropout). "ring": the first
        call (an empty cache) takes this rank's shard of the prompt, as without a cache, and
        its cache keeps the shard's keys and values; later calls take the new tokens, the
        same on every rank, whose keys and values go to one rank's cache (rank position % P
        of the group, so the ranks' parts grow in turn) and which attend to every rank's
        (attention_with_sharded_kvcache).
    """

    def __init__(self, embed_dim, num_heads, num_heads_kv=None, causal=True, bias=False,
                 rotary=False, rotary_base=10000.0, dropout=0.0, attn_impl="longflash",
                 backend="auto", device=None, dtype=None, sinks=False, ring_group=None,
                 ring_layout="zigzag", window_size=(-1, -1)):
        super().__init__()
        check_window_size(window_size)
        num_heads_kv = num_heads if num_heads_kv is None else num_heads_kv
        if num_heads < 1 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads "
                             f"({num_heads})")
        if num_heads_kv < 1 or num_heads % num_heads_kv:
            raise ValueError(f"num_heads_kv ({num_heads_kv}) must divide num_heads "
                             f"({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        if sinks and attn_impl == "sdpa":
            raise ValueError("sinks=True needs attn_impl 'longflash' or 'standard': PyTorch's "
                             "scaled_dot_product_attention has no attention sinks")
        self.embed_dim, self.num_heads, self.num_heads_kv = embed_dim, num_heads, num_heads_kv
        self.headdim = embed_dim // num_heads
        if rotary and self.headdim % 2:
            raise ValueError(f"rotary needs an even head dim, got {self.headdim}")
        self.causal, self.rotary, self.rotary_base = causal, rotary, rotary_base
        self.dropout, self.attn_impl = dropout, attn_impl
        self.window_size = tuple(window_size)
        self._ring_group, self.ring_layout = _Shared(ring_group), ring_layout
        self.backend = backend  # sets self.attn; raises on a bad attn_impl
        factory = dict(device=device, dtype=dtype)
        self.qkv_proj = nn.Linear(embed_dim, (num_heads + 2 * num_heads_kv) * self.headdim,
                                  bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None

    @property
    def backend(self):
        return self._backend

    @property
    def ring_group(self):
        return self._ring_group.value

    @backend.setter
    def backend(self, backend):  # the attention without a cache follows it as the cached one does
        self._backend = backend
        self.attn = attention_function(self.attn_impl, backend, self.ring_group, self.ring_layout)

    def forward(self, x, kv_cache=None):
        batch, seqlen, _ = x.shape
        qkv = self.qkv_proj(x).view(batch, seqlen, self.num_heads + 2 * self.num_heads_kv,
                                    self.headdim)  # (B, N, H + 2 Hkv, D)
        q, k, v = qkv.split([self.num_heads, self.num_heads_kv, self.num_heads_kv], dim=2)
        if kv_cache is not None and (self.attn_impl not in ("longflash", "ring")
                                     or not self.causal):
            raise NotImplementedError(f"kv_cache needs causal=True and attn_impl 'longflash' "
                                      f"or 'ring' (the decoding kernel), got causal="
                                      f"{self.causal}, attn_impl={self.attn_impl!r}")
        if kv_cache is not None and kv_cache.rolling and (
                self.attn_impl != "longflash" or not 0 <= self.window_size[0] < kv_cache.capacity):
            raise ValueError(f"a rolling kv_cache needs attn_impl 'longflash' and a sliding "
                             f"window shorter than its capacity (0 <= window_size[0] < "
                             f"{kv_cache.capacity}), got attn_impl={self.attn_impl!r}, "
                             f"window_size={self.window_size}")
        prompt_shard = self.attn_impl == "ring" and kv_cache is not None and \
            kv_cache.position == 0  # attended by the ring, as without a cache
        if kv_cache is not None and not prompt_shard:
            o = self._attend_cached(q, k, v, kv_cache)
            return self.out_proj(o.reshape(batch, seqlen, self.embed_dim))  # (B, N, E)
        positions = shard_positions(seqlen, self.ring_layout, self.ring_group, x.device) \
            if self.attn_impl == "ring" else None  # a ring shard's: its global positions
        if self.rotary:
            cos, sin = rotary_cos_sin(seqlen, self.headdim, self.rotary_base, x.device,
                                      positions)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        options = {} if self.sinks is None else dict(learnable_sink=self.sinks)
        if self.window_size != (-1, -1):
            options["window_size"] = self.window_size
        o = self.attn(q, k, v, self.causal, self.dropout if self.training else 0.0, **options)
        if prompt_shard:  # the keys and values stay on this rank, for the steps after it
            kv_cache.store(k, v, positions)
            kv_cache.position = seqlen * dist.get_world_size(self.ring_group)
        return self.out_proj(o.reshape(batch, seqlen, self.embed_dim))  # (B, N, E)

    def _attend_cached(self, q, k, v, kv_cache):
        if self.attn_impl == "ring":
            return self._attend_sharded(q, k, v, kv_cache)
        if kv_cache.rolling:
            return self._attend_rolling(q, k, v, kv_cache)
        rotary = {}
        if self.rotary:  # positions kv_cache.seqlen onwards, half-split as in forward
            cos, sin = kv_cache.rotary_tables(self.rotary_base)
            rotary = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False)
        o = attention_with_kvcache(q, kv_cache.k, kv_cache.v, k, v, kv_cache.seqlen,
                                   causal=self.causal, window_size=self.window_size,
                                   backend=self.backend,
                                   learnable_sink=self.sinks, k_descale=kv_cache.k_descale,
                                   v_descale=kv_cache.v_descale, **rotary)
        kv_cache.seqlen += q.shape[1]
        kv_cache.position += q.shape[1]
        return o

    def _attend_rolling(self, q, k, v, kv_cache):
        """New tokens over a rolling cache (KVCache(rolling=True)), their keys and values
        stored at rows position % capacity: a query at position p sees positions p - w .. p
        (w = window_size[0]), all of them in the cache. A call of at most capacity - w tokens
        stores them, then attends over the rows in place (a mask from the rows' positions
        where some row is out of a query's window; none for one token over w + 1 rows); a
        longer one attends over a copy of the w rows before it and its own keys, then stores
        its last capacity tokens."""
        n, first, w = q.shape[1], kv_cache.position, self.window_size[0]
        positions = torch.arange(first, first + n, device=q.device)
        if self.rotary:  # at their positions: rows are not positions in a rolling cache
            cos, sin = rotary_cos_sin(n, self.headdim, self.rotary_base, q.device, positions)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if n <= kv_cache.capacity - w:
            kv_cache.store(k, v, positions)
            oldest = max(0, first + n - kv_cache.capacity)  # the position of the oldest row
            mask = None
            if n > 1 or oldest < first - w:  # (1, 1, n, capacity): query i, row j
                mask = visible(positions[:, None], kv_cache.row_positions[None, :], 0, 0, w,
                               0)[None, None]
            o = attention_with_kvcache(
                q, kv_cache.k, kv_cache.v, cache_seqlens=kv_cache.seqlen, backend=self.backend,
                learnable_sink=self.sinks, attn_mask=mask, k_descale=kv_cache.k_descale,
                v_descale=kv_cache.v_descale)
        else:
            k_old, v_old = kv_cache.rows_in_order(max(0, first - w), first, q.dtype)
            k_new, v_new = kv_cache.as_stored(k, v)  # what the rows will hold
            options = {} if self.sinks is None else dict(learnable_sink=self.sinks)
            o = self.attn(q, torch.cat([k_old, k_new], 1), torch.cat([v_old, v_new], 1), True,
                          0.0, window_size=(w, 0), **options)
            keep = min(n, kv_cache.capacity)
            kv_cache.store(k[:, n - keep:], v[:, n - keep:], positions[n - keep:])
        kv_cache.position += n
        return o

    def _attend_sharded(self, q, k, v, kv_cache):
        """New tokens (the same on every rank) over every rank's part of the cache; their keys
        and values appended on rank position % P. The ranks' arguments are compared at the
        first step only (check_ranks: a host synchronization), not at every token. A sliding
        window is each rank's mask over its rows, from their positions (row_positions)."""
        n = q.shape[1]
        positions = torch.arange(kv_cache.position, kv_cache.position + n, device=q.device)
        if self.rotary:  # at their positions in the whole sequence
            cos, sin = rotary_cos_sin(n, self.headdim, self.rotary_base, q.device, positions)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        append_rank = kv_cache.position % dist.get_world_size(self.ring_group)
        appends = dist.get_rank(self.ring_group) == append_rank
        first, mask = 0, None
        if self.window_size != (-1, -1):
            # Rows before the first query's window are left out (a view from the first row in
            # it: no block of them is read); with one query every row after is in its window.
            first = kv_cache.first_row_at(kv_cache.position - self.window_size[0])
        if appends:
            kv_cache.set_row_positions(positions, torch.arange(kv_cache.position,
                                                               kv_cache.position + n))
        if self.window_size != (-1, -1) and (n > 1 or first == 0):
            # (1, 1, n, capacity - first): query i, this rank's row first + j
            mask = visible(positions[:, None], kv_cache.row_positions[None, first:], 0, 0,
                           self.window_size[0], 0)[None, None]
        o = attention_with_sharded_kvcache(
            q, kv_cache.k[:, first:], kv_cache.v[:, first:], k, v, kv_cache.seqlen - first,
            causal=True, backend=self.backend, group=self.ring_group, append_rank=append_rank,
            learnable_sink=self.sinks, attn_mask=mask, k_descale=kv_cache.k_descale,
            v_descale=kv_cache.v_descale, check_ranks=not kv_cache.ranks_checked)
        kv_cache.ranks_checked = True
        if appends:
            kv_cache.seqlen += n
        kv_cache.position += n
        return o

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_heads_kv={self.num_heads_kv}, causal={self.causal}, "
                f"rotary={self.rotary}, sinks={self.sinks is not None}, "
                f"window_size={self.window_size}, "
                f"attn_impl={self.attn_impl!r}")


def __getattr__(name):
    """longflash.nn.MultiheadLatentAttention, from its own module (which builds on this one's
    KVCache and rotary helpers), imported when first asked for."""
    if name == "MultiheadLatentAttention":
        from .latent_attention import MultiheadLatentAttention
        return MultiheadLatentAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MultiheadSelfAttention", "MultiheadLatentAttention", "KVCache",
           "attention_function", "apply_rotary", "rotary_cos_sin", "ATTN_IMPLEMENTATIONS"]
