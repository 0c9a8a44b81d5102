"""Decoding over a KV cache in JAX: `longflash.jax.attention_with_kvcache`.

The PyTorch path's split-KV forward (`kvcache.forward`, read it first) with one split, in
jax.lax, with the same names: the query heads that share a KV head are the rows of one tile
(row r = i * group + g for query i and head g of the group), so one read of a key block
serves the whole group even at seqlen_q = 1; the tile walks over the key blocks that some
row of some sequence sees (the bounds are traced values, so a jitted decoding step compiles
once for every length), keeping the running maximum m_i, sum l_i and unnormalized output
acc (online softmax), and masks each key against its own sequence's length, causal
alignment and window. JAX arrays are immutable: the appended caches are returned, and
inside a jitted step whose caches are donated (`jax.jit(step, donate_argnums=...)`) XLA
writes them in place; an eager call, or one without donation, copies each cache.
A float8 cache (k_descale, v_descale) as the PyTorch path keeps one: new keys quantized as
`kvcache.quantize` quantizes them, each tile converted as it is read, the key scale folded
into the softmax scale and the value scale into the output. qv (MLA absorbed) as there: each
score adds qv v^T (times the value scale) from the value tile already read.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._common import LN2, LOG2E, check_bools, check_descale_kind, check_qv, check_rotary, \
    check_softcap, check_window_size, resolve_softmax_scale
from .jax import (_DTYPES, _HIGHEST, _accumulator_dtype, _check_sink, _check_slopes, _mask_array,
                  _with_sink)

BLOCK_N = 256  # keys a tile
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))  # a cache's, as torch's


class _Config(NamedTuple):
    """Static options of one call; causal is window_right = 0."""
    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    block_n: int


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           block_table=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False, *, rotary_cos=None, rotary_sin=None,
                           rotary_interleaved=True, learnable_sink=None, attn_mask=None,
                           k_descale=None, v_descale=None, qv=None, block_n=BLOCK_N):
    """Attention of a few new queries over a KV cache, after appending new keys and values
    (FlashAttention-2's flash_attn_with_kvcache, and `longflash.attention_with_kvcache`, with
    JAX's immutable arrays: the updated caches are returned).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); seqlen_q is small: 1 for decoding, a few for
            speculative decoding or a chunk of a prefill.
        k_cache, v_cache: (batch, capacity, nheads_kv, headdim), or, with block_table, a paged
            cache (num_pages, page_size, nheads_kv, headdim); q's dtype, or both float8
            (jnp.float8_e4m3fn or float8_e5m2: a quantized cache, see k_descale); nheads %
            nheads_kv == 0 (GQA: the cache is never repeated); v_cache's head dim may differ
            (MLA).
        k, v: (batch, seqlen_new, nheads_kv, headdim) or None (v with v_cache's head dim),
            q's dtype: written into the caches at positions cache_seqlens[b] ...
            cache_seqlens[b] + seqlen_new - 1 before attending (into a float8 cache
            quantized: k / k_descale rounded to nearest even, saturated at the format's
            largest finite value, bit for bit as longflash.attention_with_kvcache).
        cache_seqlens: int, or (batch,) integer array: each sequence's length before the
            append; default: the whole capacity (minus seqlen_new). Checked against the
            capacity when its value is known (an int, or a concrete array); a traced one
            (under jit) is not: keys appended past the capacity are dropped.
        block_table: (batch, max_pages) int32 array: page p of sequence b is
            k_cache[block_table[b, p]]; entries past a sequence's length are not read.
        softmax_scale: default 1 / sqrt(headdim).
        causal: bottom-right aligned to each sequence's length after the append,
            seqlen_k = cache_seqlens[b] + seqlen_new: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
        window_size, softcap, alibi_slopes: as in `longflash.jax.attention`, aligned per
            sequence like causal (ALiBi's distance is i + seqlen_k - seqlen_q - j).
        return_lse: also return lse (batch, nheads, seqlen_q), float32 (float64 for float64).
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) floating-point arrays, or None:
            rotary embeddings as FlashAttention applies them (needs k and v): the first
            rotary_dim dims of the new k are rotated before they are written, key t of
            sequence b at position cache_seqlens[b] + t; those of q at cache_seqlens[b] + i
            for query i if causal or windowed, else all at cache_seqlens[b]. Positions past
            seqlen_ro raise when the lengths are known (a traced one reads the last row).
        rotary_interleaved: rotate dims (2i, 2i + 1) together (GPT-J; FlashAttention's
            default) if True, else (i, i + rotary_dim / 2) (GPT-NeoX, Llama).
        learnable_sink: (nheads,) floating-point array, or None: attention sinks, as in
            `longflash.jax.attention`.
        attn_mask: None, or a bool or floating-point array broadcastable to (batch, nheads,
            seqlen_q, L), as in `longflash.attention_with_kvcache`: True where query i may see
            the key, a float added to the scores (after softcap and ALiBi); its last
            dimension is the key's position in its sequence: L = 1, or L at least every
            sequence's key count after the append (checked when the lengths are known; a
            traced length past L reads column L - 1). For tree attention in speculative
            decoding: the draft tokens' tree as a (batch, 1, seqlen_q, L) boolean mask.
            Each tile gathers its entries; a broadcast mask is never materialized.
        k_descale, v_descale: None (1.0), a positive float, or a float32 array broadcastable
            to (batch, nheads_kv), only with a float8 cache: the keys and values attended are
            k_cache * k_descale and v_cache * v_descale, in float32, as in
            `longflash.attention_with_kvcache`.
        qv: None, or (batch, seqlen_q, nheads, headdim of v_cache), q's dtype: MLA's absorbed
            queries against the values, each score softmax_scale * (q k^T + qv v^T), default
            softmax_scale 1 / sqrt(headdim + headdim_v), as in
            `longflash.attention_with_kvcache` (rotary embeddings turn q, not qv).
        block_n: keys a tile (default 256; capped at the capacity).
    Returns (out, k_cache, v_cache): out is o (batch, seqlen_q, nheads, headdim of v_cache),
    or (o, lse) with return_lse; the caches with k and v appended (the same arrays without
    them). A sequence with no key gives o = 0, lse = -inf. Inference only: the key loop's
    bounds are traced, so it is not reverse-differentiable. Works under jax.jit.
    Bad input raises ValueError / TypeError naming the argument, before any work.
    """
    q, k_cache, v_cache, k, v = _check_arrays(q, k_cache, v_cache, k, v)
    seqlen_new = 0 if k is None else k.shape[1]
    capacity = _check_cache(q, k_cache, v_cache, k, v, block_table)
    seqlens, max_seqlen = _check_seqlens(cache_seqlens, q.shape[0], seqlen_new, capacity)
    check_bools(causal=causal, return_lse=return_lse)
    check_window_size(window_size)
    check_softcap(softcap)
    _check_sink(learnable_sink, q.shape[2])
    slopes = _check_slopes(alibi_slopes, q.shape[0], q.shape[2])
    q_in_order = causal or tuple(window_size) != (-1, -1)  # query positions, for rotary
    rotary = _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, max_seqlen,
                           seqlen_new, q_in_order)
    bias = _check_mask(attn_mask, q, None if max_seqlen is None else max_seqlen + seqlen_new)
    descales = [_check_descale(name, x, q.shape[0], k_cache)
                for name, x in (("k_descale", k_descale), ("v_descale", v_descale))]
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1:
        raise ValueError(f"block_n must be a positive int, got {block_n!r}")
    if qv is not None:
        scale = check_qv(qv, q, v_cache.shape[3], lambda x: isinstance(x, (jax.Array, np.ndarray)),
                         "jax.Array (or numpy array)")
        qv, softmax_scale = jnp.asarray(qv), scale if softmax_scale is None else softmax_scale
    cfg = _Config(float(resolve_softmax_scale(softmax_scale, q.shape[3])), int(window_size[0]),
                  0 if causal else int(window_size[1]), float(softcap), block_n)
    if rotary is not None:
        q, k = _rotate(q, k, *rotary, rotary_interleaved, seqlens, q_in_order)
    o, lse, k_cache, v_cache = _kvcache(q, k_cache, v_cache, k, v, seqlens, block_table, slopes,
                                        bias, *descales, qv, cfg)
    if learnable_sink is not None:
        o, lse = _with_sink(o, lse, learnable_sink)
    return ((o, lse) if return_lse else o), k_cache, v_cache


def _check_arrays(q, k_cache, v_cache, k, v):
    """Types, ranks and dtypes; returns them as jax arrays (k, v None or both given)."""
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    arrays = []
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is None:
            arrays.append(None)
            continue
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax.Array (or numpy array), got "
                            f"{type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
        if name == "q" and x.dtype not in [jnp.dtype(d) for d in _DTYPES]:
            raise TypeError(f"q has dtype {x.dtype}; accepted: float16, bfloat16, float32, "
                            f"float64 (with jax_enable_x64)")
        if x.dtype != q.dtype and not (name.endswith("cache") and x.dtype in FP8_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}: they must match (or "
                            f"the caches be float8: float8_e4m3fn, float8_e5m2)")
        arrays.append(jnp.asarray(x))
    if (k_cache.dtype in FP8_DTYPES or v_cache.dtype in FP8_DTYPES) and \
            k_cache.dtype != v_cache.dtype:
        raise TypeError(f"v_cache has dtype {v_cache.dtype}, k_cache has {k_cache.dtype}: a "
                        f"float8 cache's keys and values must have one dtype")
    return arrays


def _check_descale(name, descale, batch, k_cache):
    """k_descale or v_descale -> None or a (batch, nheads_kv) float32 array, as the PyTorch
    path's kvcache.check_descale accepts them."""
    shape = (batch, k_cache.shape[2])  # (batch, nheads_kv)
    kind = check_descale_kind(
        name, descale, shape, k_cache.dtype in FP8_DTYPES, k_cache.dtype,
        lambda x: isinstance(x, (jax.Array, np.ndarray)) and x.dtype == np.float32, "array")
    if kind == "none":
        return None
    if kind == "float":
        return jnp.full(shape, descale, jnp.float32)
    return jnp.broadcast_to(jnp.asarray(descale), shape)


def quantize(x, descale, dtype):
    """x (batch, seqlen, nheads_kv, headdim) as a float8 cache of `dtype` stores it, as
    kvcache.quantize: x / descale in float32, saturated at the format's largest finite value,
    rounded to nearest even. descale: None (1) or (batch, nheads_kv)."""
    x = x.astype(jnp.float32)
    if descale is not None:
        x = x / descale[:, None, :, None]
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -limit, limit).astype(dtype)


def _check_cache(q, k_cache, v_cache, k, v, block_table):
    """Shapes of the caches, the new keys and the block table; returns the capacity (keys a
    sequence can hold)."""
    batch, _, nheads, headdim = q.shape
    _, slots, nheads_kv, cache_headdim = k_cache.shape
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"k_cache and v_cache must have the same shape but for the head dim, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if cache_headdim != headdim:
        raise ValueError(f"k_cache headdim {cache_headdim} differs from q's {headdim}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of the nheads_kv of "
                         f"k_cache ({nheads_kv})")
    if k is not None and (tuple(k.shape[:3]) != tuple(v.shape[:3]) or k.shape[0] != batch or
                          tuple(k.shape[2:]) != (nheads_kv, headdim) or
                          v.shape[3] != v_cache.shape[3]):
        raise ValueError(f"k and v must have shapes (batch, seqlen_new, nheads_kv, headdim) = "
                         f"({batch}, *, {nheads_kv}, {headdim}) and (..., {v_cache.shape[3]}) "
                         f"(the caches' head dims), got {tuple(k.shape)} and {tuple(v.shape)}")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]}, q has {batch} (a paged "
                             f"cache needs block_table)")
        return slots
    if not isinstance(block_table, (jax.Array, np.ndarray)) or \
            block_table.dtype != np.int32 or block_table.ndim != 2 or \
            block_table.shape[0] != batch:
        raise TypeError(f"block_table must be an int32 array of shape (batch={batch}, "
                        f"max_pages), got {getattr(block_table, 'dtype', type(block_table))} "
                        f"{tuple(getattr(block_table, 'shape', ()))}")
    return block_table.shape[1] * slots


def _check_mask(attn_mask, q, seqlen_k):
    """attn_mask checked and returned 4-D (batch or 1, nheads or 1, seqlen_q or 1, L); None
    stays None. seqlen_k: the longest sequence's keys after the append, None if unknown."""
    return None if attn_mask is None else _mask_array(attn_mask, q, seqlen_k, keys_at_least=True)


def _check_rotary(q, k, rotary_cos, rotary_sin, interleaved, max_seqlen, seqlen_new,
                  q_in_order):
    """The rotary arguments as the PyTorch path checks them (_common.check_rotary); returns
    (cos, sin) as jax arrays, or None. max_seqlen: the largest length before the append, None
    if traced."""
    check_bools(rotary_interleaved=interleaved)
    if not check_rotary(rotary_cos, rotary_sin,
                        lambda x: isinstance(x, (jax.Array, np.ndarray)) and x.ndim == 2 and
                        jnp.issubdtype(x.dtype, jnp.floating), "array", k is not None,
                        q.shape[-1], q.shape[1], max_seqlen, seqlen_new, q_in_order):
        return None
    return jnp.asarray(rotary_cos), jnp.asarray(rotary_sin)


def _rotate(q, k, cos, sin, interleaved, seqlens, q_in_order):
    """q and the new keys k rotated at their positions (nn.apply_rotary's rule, in float32,
    float64 staying float64)."""
    def rotated(x, n):
        pos = seqlens[:, None] + jnp.arange(n)  # (B, n), or (B, 1) for q out of order
        c, s = (t[pos][:, :, None, :] for t in (cos, sin))  # (B, n, 1, rotary_dim / 2)
        dtype = x.dtype
        x = x if dtype == jnp.float64 else x.astype(jnp.float32)
        c, s = c.astype(x.dtype), s.astype(x.dtype)
        rotary_dim = 2 * cos.shape[-1]
        if interleaved:
            x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
            out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(
                *x.shape[:-1], rotary_dim)
        else:
            x1, x2 = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim]
            out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
        return jnp.concatenate([out, x[..., rotary_dim:]], axis=-1).astype(dtype)
    return rotated(q, q.shape[1] if q_in_order else 1), rotated(k, k.shape[1])


def _check_seqlens(cache_seqlens, batch, seqlen_new, capacity):
    """cache_seqlens as a (batch,) int32 array, its values checked against the capacity when
    they are known (not traced); and their maximum (None when traced)."""
    if cache_seqlens is None:
        cache_seqlens = capacity - seqlen_new
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = np.full((batch,), cache_seqlens)
    elif isinstance(cache_seqlens, (jax.Array, np.ndarray)) and \
            jnp.issubdtype(cache_seqlens.dtype, jnp.integer) and \
            tuple(cache_seqlens.shape) == (batch,):
        lengths = None if isinstance(cache_seqlens, jax.core.Tracer) else \
            np.asarray(cache_seqlens)
    else:
        raise TypeError(f"cache_seqlens must be an int or an integer array of shape ({batch},), "
                        f"got {getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                        f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    if lengths is not None and batch and (lengths.min() < 0 or
                                          lengths.max() + seqlen_new > capacity):
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache "
                         f"capacity), got cache_seqlens in [{lengths.min()}, {lengths.max()}] "
                         f"and seqlen_new = {seqlen_new}")
    max_seqlen = None if lengths is None else int(lengths.max(initial=0))
    return jnp.broadcast_to(jnp.asarray(cache_seqlens, jnp.int32), (batch,)), max_seqlen


@functools.partial(jax.jit, static_argnames="cfg")
def _kvcache(q, k_cache, v_cache, k, v, seqlens, block_table, slopes, bias, k_descale,
             v_descale, qv, cfg):
    """Checked arguments -> (o, lse, k_cache, v_cache)."""
    seqlen_new = 0
    if k is not None:
        seqlen_new = k.shape[1]
        if k_cache.dtype in FP8_DTYPES:
            k, v = quantize(k, k_descale, k_cache.dtype), quantize(v, v_descale, v_cache.dtype)
        k_cache = _append(k_cache, k, seqlens, block_table)
        v_cache = _append(v_cache, v, seqlens, block_table)
    o, lse = _forward(q, k_cache, v_cache, seqlens + seqlen_new, block_table, slopes, bias,
                      k_descale, v_descale, qv, cfg)
    return o, lse, k_cache, v_cache


def _append(cache, new, seqlens, block_table):
    """cache with new (B, Nnew, Hkv, D) written at rows seqlens[b] + t of each sequence;
    writes past the capacity are dropped."""
    pos = seqlens[:, None] + jnp.arange(new.shape[1])  # (B, Nnew)
    if block_table is None:
        b = jnp.arange(new.shape[0])[:, None]
        return cache.at[b, pos].set(new, mode="drop")
    page_size = cache.shape[1]
    page = jnp.take_along_axis(block_table, pos // page_size, axis=1, mode="fill",
                               fill_value=cache.shape[0])  # past the table: a page out of range
    return cache.at[page, pos % page_size].set(new, mode="drop")


def _read(cache, block_table, start_n, block_n):
    """Keys start_n ... start_n + block_n - 1 of every sequence as (B, Hkv, BN, D): a slice
    of a contiguous cache, or rows gathered through the block table."""
    if block_table is None:
        x = lax.dynamic_slice_in_dim(cache, start_n, block_n, axis=1)
    else:
        page_size = cache.shape[1]
        pos = start_n + jnp.arange(block_n)
        x = cache[block_table[:, pos // page_size], pos % page_size]  # (B, BN, Hkv, D)
    return x.transpose(0, 2, 1, 3)


def _forward(q, k_cache, v_cache, seqlens_k, block_table, slopes, bias, k_descale, v_descale,
             qv, cfg):
    """o (B, Nq, H, Dv) in q's dtype and lse (B, H, Nq) in the accumulator dtype, over the
    first seqlens_k[b] keys of each sequence. slopes: None or ALiBi's (B or 1, H); bias: None
    or attn_mask, 4-D (B or 1, H or 1, Nq or 1, L); k_descale, v_descale: None or a float8
    cache's scales, (B, Hkv) float32; qv: None or MLA's absorbed queries (B, Nq, H, Dv)."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv, headdim_v = k_cache.shape[2], v_cache.shape[3]
    group = nheads // nheads_kv
    dtype = _accumulator_dtype(q.dtype)
    capacity = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    block_n = max(min(cfg.block_n, capacity), 1)
    # -- GQA packing: rows r = i * group + g, (B, Hkv, M, D) with M = seqlen_q * group --
    M = seqlen_q * group
    q_packed, qv_packed = (
        None if x is None else x.astype(dtype).reshape(batch, seqlen_q, nheads_kv, group, -1)
        .transpose(0, 2, 1, 3, 4).reshape(batch, nheads_kv, M, x.shape[3]) for x in (q, qv))
    i = jnp.arange(M) // group  # query position of each row
    qk_scale = cfg.softmax_scale  # a float8 cache's key scale folds into it: (B, Hkv, 1, 1)
    if k_descale is not None:
        qk_scale = k_descale.astype(dtype)[:, :, None, None] * qk_scale
    qv_scale = cfg.softmax_scale  # qv v^T's: the value scale's
    if v_descale is not None:
        qv_scale = v_descale.astype(dtype)[:, :, None, None] * qv_scale
    offset = seqlens_k - seqlen_q  # (B,) diagonal of query 0
    diag = (offset[:, None] + i)[:, None, :, None]  # (B, 1, M, 1)
    if slopes is not None:  # (B or 1, H) -> (B or 1, Hkv, M, 1): row r's head's slope
        slopes = jnp.broadcast_to(slopes.astype(dtype).reshape(-1, nheads_kv, 1, group),
                                  (slopes.shape[0], nheads_kv, seqlen_q, group))
        slopes = slopes.reshape(-1, nheads_kv, M, 1)
    if bias is not None:  # indices of row r's (batch, head, query) in attn_mask, or 0
        bias_b = jnp.arange(batch)[:, None, None, None] if bias.shape[0] > 1 else 0
        heads = jnp.arange(nheads_kv)[:, None] * group + jnp.arange(M) % group
        bias_h = heads[None, :, :, None] if bias.shape[1] > 1 else 0
        bias_i = i[None, None, :, None] if bias.shape[2] > 1 else 0
    # -- the keys some row of some sequence sees: [lo, hi), as kvcache.key_limits --
    hi = seqlens_k if cfg.window_right < 0 else \
        jnp.clip(offset + seqlen_q + cfg.window_right, 0, seqlens_k)
    lo = 0 * hi if cfg.window_left < 0 else jnp.clip(offset - cfg.window_left, 0, hi)

    def body(n, carry):
        acc, l_i, m_i = carry
        start_n = n * block_n
        # the last block ends at the capacity (it may overlap the one before: keys below
        # start_n are masked, so none counts twice)
        start = jnp.minimum(start_n, capacity - block_n)
        j = start + jnp.arange(block_n)
        in_seq = (j >= start_n) & (j < seqlens_k[:, None])  # (B, BN)
        k_j, v_j = (_read(c, block_table, start, block_n).astype(dtype)
                    for c in (k_cache, v_cache))
        # rows past a sequence's end may hold anything (NaN too): p = 0 must not meet them
        v_j = jnp.where(in_seq[:, None, :, None], v_j, 0)
        # -- compute scores (B, Hkv, M, BN), in FlashAttention-2's order --
        qk = jnp.einsum("bhmd,bhnd->bhmn", q_packed, k_j, precision=_HIGHEST) * qk_scale
        if qv_packed is not None:  # MLA absorbed: the value block serves both products
            qk = qk + jnp.einsum("bhmd,bhnd->bhmn", qv_packed, v_j, precision=_HIGHEST) * qv_scale
        if cfg.softcap > 0:
            qk = cfg.softcap * jnp.tanh(qk / cfg.softcap)
        if slopes is not None:
            qk = qk - slopes * jnp.abs(diag - j).astype(dtype)
        mask = in_seq[:, None, None, :]
        if bias is not None:  # (B, Hkv, M, BN), each key at its position (the last column's
            # past the end: masked anyway)
            bias_ij = bias[bias_b, bias_h, bias_i, jnp.minimum(j, bias.shape[3] - 1)]
            if bias_ij.dtype == jnp.bool_:
                mask = mask & bias_ij
            else:
                qk = qk + bias_ij.astype(dtype)
        if cfg.window_right >= 0:
            mask = mask & (j <= diag + cfg.window_right)
        if cfg.window_left >= 0:
            mask = mask & (j >= diag - cfg.window_left)
        qk = jnp.where(mask, qk, -jnp.inf) * LOG2E
        # -- online softmax --
        m_ij = jnp.maximum(m_i, qk.max(-1))
        m_safe = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)
        p = jnp.exp2(qk - m_safe[..., None])
        alpha = jnp.exp2(m_i - m_safe)
        l_i = l_i * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("bhmn,bhnd->bhmd", p, v_j, precision=_HIGHEST)
        return acc, l_i, m_ij

    m_i = jnp.full((batch, nheads_kv, M), -jnp.inf, dtype)
    l_i = jnp.zeros_like(m_i)
    acc = jnp.zeros((batch, nheads_kv, M, headdim_v), dtype)
    if batch and M and capacity:
        acc, l_i, m_i = lax.fori_loop(lo.min() // block_n, (hi.max() + block_n - 1) // block_n,
                                      body, (acc, l_i, m_i))
    # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
    l_safe = jnp.where(l_i == 0, 1.0, l_i)
    o = acc / l_safe[..., None]
    if v_descale is not None:  # a float8 cache's value scale, (B, Hkv, 1, 1)
        o = o * v_descale.astype(dtype)[:, :, None, None]
    lse = jnp.where(l_i == 0, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
    # (B, Hkv, M, Dv) -> (B, seqlen_q, nheads, Dv); (B, Hkv, M) -> (B, nheads, seqlen_q)
    o = o.reshape(batch, nheads_kv, seqlen_q, group, headdim_v).transpose(0, 2, 1, 3, 4)
    lse = lse.reshape(batch, nheads_kv, seqlen_q, group).transpose(0, 1, 3, 2)
    return (o.reshape(batch, seqlen_q, nheads, headdim_v).astype(q.dtype),
            lse.reshape(batch, nheads, seqlen_q))
