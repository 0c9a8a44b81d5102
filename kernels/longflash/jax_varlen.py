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
them on the device.
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
                     alibi_slopes=None, learnable_sink=None, dropout_p=0.0, dropout_rng=None):
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
    Returns:
        o: (total_q, nheads, headdim of v), dtype of q
        lse (if return_lse): (nheads, total_q), float32 (float64 for float64 inputs)
    Works under jax.jit, jax.grad and jax.vjp; bad input raises ValueError / TypeError
    naming the argument, before any work.
    """
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
