"""Packed variable-length sequences in JAX: `longflash.jax.attention_varlen`.

FlashAttention's flash_attn_varlen_func (and `longflash.attention_varlen`) for JAX arrays: the
sequences of a batch packed one after another, (total_tokens, nheads, headdim), with
cu_seqlens offsets. It runs `jax.py`'s blockwise path over the packed rows as one batch of
one, where every tile masks from each token's sequence and position in it (`jax._Packed`):
causal, windows and ALiBi are aligned to each sequence's own end, and a query block walks
only over the key blocks between its first row's first visible key and its last row's last
one (the backward's key blocks likewise over their queries), so the work grows with the sum
of the sequences' squared lengths (with causal, half of it), not with the square of the
total, and no padding is computed beyond the last tile's. The offsets may be traced (a jitted
step compiles once for every split of the same totals); the block bounds are computed from
them on the device. Paged keys (block_table, a KV cache's pages, as flash_attn_varlen_func
takes them) are gathered into packed keys first, as `longflash.attention_varlen` does with a
gradient: a copy in linear memory, through which the gradients reach the pages.
"""

import jax
import jax.numpy as jnp
import numpy as np

from ._common import check_offsets
from .jax import (_attention_jit, _check_inputs, _check_sink, _check_slopes, _dropout_seed,
                  _with_sink, BLOCK_M, BLOCK_N)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, softmax_scale=None, return_lse=False, *, block_m=BLOCK_M,
                     block_n=BLOCK_N, backend="auto", window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, learnable_sink=None, dropout_p=0.0, dropout_rng=None,
                     block_table=None):
    """`attention` on a packed batch of variable-length sequences, with no padding computed.

    Arguments:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim) (v's headdim may
            differ, as in `attention`)
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) integer arrays of offsets, starting at 0,
            non-decreasing, ending at total_q / total_k: sequence b is q[cu_seqlens_q[b]:
            cu_seqlens_q[b + 1]] (its keys k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]). Checked
            when concrete; traced ones (under jit) are the caller's to get right.
        max_seqlen_q, max_seqlen_k: ints, the longest sequences (FlashAttention's signature;
            checked against concrete offsets; the computation does not need them).
        causal, softmax_scale, return_lse, block_m, block_n, window_size, softcap,
            learnable_sink, dropout_p, dropout_rng: as in `attention`, per sequence (causal
            and windows aligned to each sequence's own end; dropout draws the numbers of
            `longflash.attention_varlen`: (sequence * nheads + head, query, key), positions
            in the sequence).
        alibi_slopes: (nheads,) or (batch, nheads) floating-point array, or None: sequence
            b's slopes; distances within each sequence.
        backend: "auto" or "jax" (the blockwise JAX path; "triton" raises).
        block_table: (batch, max_pages) int32 array, or None. If given, k and v are a paged
            cache (num_pages, page_size, nheads_kv, headdim), q's dtype, as in
            `longflash.attention_varlen`: key n of sequence b is k[block_table[b, n //
            page_size], n % page_size], cu_seqlens_k giving each sequence's number of keys
            (entries past a sequence's length are not read). The keys in use are gathered into
            a packed copy (cu_seqlens_k[-1] keys; with traced offsets batch * max_seqlen_k, the
            rows past the last offset zeros, which no query sees) and attended as packed keys.
    Returns:
        o: (total_q, nheads, headdim of v), dtype of q
        lse (if return_lse): (nheads, total_q), float32 (float64 for float64 inputs)
    Works under jax.jit, jax.grad and jax.vjp; bad input raises ValueError / TypeError
    naming the argument, before any work.
    """
    if block_table is not None:
        k, v = _packed_pages(q, k, v, block_table, cu_seqlens_k, max_seqlen_k)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, nheads, headdim) "
                             f"for attention_varlen, got shape {getattr(x, 'shape', x)}")
    batch = _check_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           q.shape[0], k.shape[0])
    if backend == "triton":
        raise NotImplementedError("attention_varlen runs on the blockwise JAX path only: use "
                                  "backend='auto' or 'jax'")
    q, k, v, cfg = _check_inputs(q[None], k[None], v[None], causal, softmax_scale, return_lse,
                                 block_m, block_n, "jax", window_size, softcap)
    _check_sink(learnable_sink, q.shape[2])
    slopes = _check_slopes(alibi_slopes, batch, q.shape[2])
    seed = _dropout_seed(dropout_p, dropout_rng)
    cfg = cfg._replace(dropout_p=float(dropout_p), varlen=True)
    offsets = tuple(jnp.asarray(x, jnp.int32) for x in (cu_seqlens_q, cu_seqlens_k))
    o, lse = _attention_jit(q, k, v, None, slopes, offsets, seed, cfg)
    if learnable_sink is not None:
        o, lse = _with_sink(o, lse, learnable_sink)
    return (o[0], lse[0]) if return_lse else o[0]


def _packed_pages(q, k, v, block_table, cu_seqlens_k, max_seqlen_k):
    """The keys and values in use of a paged k, v, packed: (total_k, nheads_kv, headdim) each,
    total_k = cu_seqlens_k[-1] (concrete offsets) or batch * max_seqlen_k (traced ones: rows
    past the last offset are zeros)."""
    for name, x in (("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must have 4 dimensions (num_pages, page_size, nheads_kv, "
                             f"headdim) with block_table, got shape {getattr(x, 'shape', x)}")
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"k and v must have the same shape with block_table (one head dim), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if not isinstance(block_table, (jax.Array, np.ndarray)) or block_table.dtype != np.int32 \
            or block_table.ndim != 2:
        raise TypeError(f"block_table must be an int32 array of shape (batch, max_pages), got "
                        f"{getattr(block_table, 'dtype', type(block_table))} "
                        f"{tuple(getattr(block_table, 'shape', ()))}")
    if not isinstance(cu_seqlens_k, (jax.Array, np.ndarray)) or cu_seqlens_k.ndim != 1 or \
            cu_seqlens_k.shape[0] != block_table.shape[0] + 1 or \
            not jnp.issubdtype(cu_seqlens_k.dtype, jnp.integer):
        raise TypeError(f"cu_seqlens_k must be a 1-D integer array of batch + 1 = "
                        f"{block_table.shape[0] + 1} offsets (block_table's batch), got "
                        f"{getattr(cu_seqlens_k, 'dtype', type(cu_seqlens_k).__name__)} "
                        f"{getattr(cu_seqlens_k, 'shape', '')}")
    batch, max_pages = block_table.shape
    num_pages, page_size = k.shape[:2]
    if isinstance(max_seqlen_k, int) and max_seqlen_k > max_pages * page_size:
        raise ValueError(f"max_seqlen_k = {max_seqlen_k} is more keys than block_table holds "
                         f"({max_pages} pages of {page_size})")
    concrete = not isinstance(cu_seqlens_k, jax.core.Tracer) and \
        not isinstance(block_table, jax.core.Tracer)
    cu = jnp.asarray(cu_seqlens_k, jnp.int32)
    if concrete:
        total = int(cu[-1])
        lengths = np.diff(np.asarray(cu_seqlens_k))
        table = np.asarray(block_table)
        for b, n in enumerate(lengths.tolist()):
            used = table[b, :-(-n // page_size)] if n > 0 else table[b, :0]
            if len(used) and not ((used >= 0) & (used < num_pages)).all():
                raise ValueError(f"block_table[{b}] has a page outside [0, {num_pages}) among the "
                                 f"{len(used)} that sequence {b}'s {n} keys use")
    else:
        total = batch * max_seqlen_k if isinstance(max_seqlen_k, int) else 0
    n = jnp.arange(total)
    seq = jnp.clip(jnp.searchsorted(cu, n, side="right") - 1, 0, max(batch - 1, 0))
    pos = n - cu[seq]
    page = jnp.asarray(block_table)[seq, jnp.clip(pos // page_size, 0, max_pages - 1)]
    inside = (n < cu[-1])[:, None, None]
    return tuple(jnp.where(inside, jnp.asarray(x)[page, pos % page_size], 0) for x in (k, v))


def _check_offsets(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, total_q, total_k):
    """The packed-sequence metadata checked (values only where concrete); the batch size."""
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        if not isinstance(cu, (jax.Array, np.ndarray)) or cu.ndim != 1 or cu.shape[0] < 1 \
                or not jnp.issubdtype(cu.dtype, jnp.integer):
            raise TypeError(f"{name} must be a 1-D integer array of batch + 1 offsets, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)} "
                            f"{getattr(cu, 'shape', '')}")
        max_name = name.replace("cu_seqlens", "max_seqlen")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise TypeError(f"{max_name} must be an int >= 0, got {max_len!r}")
        if isinstance(cu, jax.core.Tracer):
            continue  # traced offsets: their values are not known here
        check_offsets(name, np.asarray(cu).tolist(), total, max_len)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {cu_seqlens_q.shape[0] - 1} and "
                         f"{cu_seqlens_k.shape[0] - 1}")
    return cu_seqlens_q.shape[0] - 1
