"""Decoding over a KV cache sharded across a process group (context parallelism at inference).

Each of the P ranks of a group holds a part of every sequence's keys and values: the shard
that ring attention's prefill leaves on it (`longflash.nn` with attn_impl="ring"), or any
other split. The new tokens' queries, the same on every rank, attend to every rank's part:
each rank attends to its own (the decoding kernel, `attention_with_kvcache`), and the P
partial outputs are merged exactly by their log-sum-exps, the merge of ring attention and of
the split-KV kernel one level up (as Tree Attention, Shyam et al. 2024, does it on GPUs):

    on every rank r, the same q:
        o_r, lse_r = attention_with_kvcache(q, the cache's shard on r)  # new k, v: on one rank
        m = all_reduce(lse_r, MAX)                                       # (batch, nheads, seqlen_q)
        [num, den] = all_reduce([e^(lse_r - m) o_r, e^(lse_r - m)], SUM)  # float32, one call
        o = num / den,  lse = m + log(den)

Two collectives of o's size a call, whatever P; no rank reads another's cache, so a cache of
N tokens costs N / P memory and bytes per rank and step. Every rank ends with the same o
(an all_reduce's result is the same on every rank).

Positions. Every cached token, on whichever rank, comes before the new ones, so the new
queries see all of them; causal attention among the new tokens applies on the rank that
appends them (`append_rank`), where they are the last keys. Whatever depends on a key's global
position is the caller's, who knows where each rank's tokens lie: rotary embeddings (q and k
come rotated at their global positions; `longflash.nn` does it), and sliding windows, ALiBi or
any other pattern, given as each rank's own `attn_mask` over its part (a boolean window
pos_q - left <= pos_k <= pos_q + right, an ALiBi bias -slope * |pos_q - pos_k| as a float
mask, from the global positions of the rank's cache rows and of the queries).
"""

import torch
import torch.distributed as dist

from ._common import accumulator_dtype, check_learnable_sink, with_learnable_sink
from .kvcache import attention_with_kvcache
from .parallel import LAYOUTS, _check_same_on_all_ranks, _dtype_code, _ring, \
    _slopes_fingerprint


def attention_with_sharded_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                   block_table=None, softmax_scale=None, causal=False,
                                   softcap=0.0, return_lse=False, backend="auto", *,
                                   group=None, append_rank=0, num_splits=0,
                                   cache_batch_idx=None, cache_leftpad=None,
                                   learnable_sink=None, attn_mask=None, k_descale=None,
                                   v_descale=None, qv=None, check_ranks=True):
    """Attention of new queries over a KV cache whose tokens are spread over the ranks of a
    process group, appending the new keys/values on one rank.

    Call it on every rank of group:
        q: (batch, seqlen_q, nheads, headdim), the same on every rank: the new tokens' queries,
            rotated at their global positions if the model uses rotary embeddings.
        k_cache, v_cache, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
            num_splits, k_descale, v_descale: this rank's part of the cache, as
            `attention_with_kvcache` takes a whole cache (cache_seqlens: this rank's number of
            keys of each sequence, 0 allowed). Ranks may hold different numbers of keys, and
            caches of different capacities, layouts (paged or not) and float8 scales.
        k, v: (batch, seqlen_new, nheads_kv, headdim) or None, the same on every rank: the new
            tokens' keys and values (rotated), written into the cache of rank `append_rank` only
            (at its cache_seqlens, as attention_with_kvcache writes them); the other ranks
            ignore theirs. Every rank advances its own cache_seqlens.
        causal: the new queries see every cached key of every rank, and the new keys up to
            their own (query i sees new key j iff j <= i + seqlen_new - seqlen_q, the decoding
            kernel's bottom-right rule on the appending rank). With seqlen_q > 1 it needs k, v
            (the queries' own keys); with one query it changes nothing.
        softmax_scale (default 1/sqrt(headdim), with qv 1/sqrt(headdim + headdim_v)), softcap,
            backend, learnable_sink (counted once per row, after the merge), qv (MLA's absorbed
            queries, the same on every rank, as q): as in `attention_with_kvcache`.
        attn_mask: this rank's own mask over its part, as `attention_with_kvcache` takes it
            (boolean or float, broadcastable to (batch, nheads, seqlen_q, L), the last
            dimension this rank's cache rows, on the appending rank after the append); ranks
            pass different masks, or None. How a sliding window or ALiBi over the global
            sequence is given (module docstring). A row that sees no key of this rank's part
            adds nothing to the merge.
        group: the process group (default: the default group); P = its size.
        append_rank: the rank of group that appends k, v (default 0). A caller that rotates it
            from step to step keeps the ranks' parts balanced.
        check_ranks: compare q's shape and dtype, k's and qv's shapes, causal, softmax_scale,
            softcap, append_rank and learnable_sink across ranks first (default True: one all_gather
            of a few numbers, and after the attention a flag read back to the host, which makes
            every rank raise when one rank's call raised); False skips both (no host
            synchronization), for the steps of a decoding loop whose first step was checked:
            a rank's error then leaves the other ranks waiting in the merge's collective.
    Returns o: (batch, seqlen_q, nheads, headdim of v_cache), the same on every rank, and lse
    (batch, nheads, seqlen_q), float32 (float64 for float64), if return_lse. A sequence with no
    key on any rank gives o = 0 and lse = -inf. Inference only, as attention_with_kvcache.

    Raises: ValueError if no process group is initialized or this rank is not in group, for an
    append_rank outside [0, P), and on every rank if the compared arguments differ between
    ranks; NotImplementedError for causal with seqlen_q > 1 and no k; then this rank's errors
    of attention_with_kvcache, before anything is written; with check_ranks, when some rank's
    call raised, the other ranks raise RuntimeError (the appending rank's, if it was not the
    one that raised, has then written k, v).
    """
    ring = _ring(group, LAYOUTS[0])  # the group and this rank; no layout is used
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor (batch, seqlen_q, nheads, headdim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if isinstance(append_rank, bool) or not isinstance(append_rank, int) or \
            not 0 <= append_rank < ring.world_size:
        raise ValueError(f"append_rank must be a rank of the group, an int in [0, "
                         f"{ring.world_size}), got {append_rank!r}")
    if causal and q.shape[1] > 1 and k is None:
        raise NotImplementedError("causal=True with seqlen_q > 1 needs k and v, the queries' own "
                                  "keys (appended on append_rank, where they are the last keys)")
    check_learnable_sink(learnable_sink, q.shape[2], q.device)
    if check_ranks:
        dims = q.shape[-1] + (0 if not isinstance(qv, torch.Tensor) else qv.shape[-1])
        scale = dims ** -0.5 if softmax_scale is None else float(softmax_scale)
        _check_same_on_all_ranks(
            ring, q.device, q_shape=q.shape, dtype=_dtype_code(q.dtype),
            k_shape=(-1,) * 4 if k is None else k.shape,
            qv_shape=(-1,) * 4 if not isinstance(qv, torch.Tensor) else qv.shape,
            causal=(bool(causal),),
            softmax_scale=(scale,), softcap=(float(softcap),), append_rank=(append_rank,),
            learnable_sink=_slopes_fingerprint(learnable_sink))
    appends = ring.rank == append_rank
    try:
        o, lse = attention_with_kvcache(
            q, k_cache, v_cache, k if appends else None, v if appends else None, cache_seqlens,
            block_table, softmax_scale, causal and appends, softcap=softcap, return_lse=True,
            backend=backend, num_splits=num_splits, cache_batch_idx=cache_batch_idx,
            cache_leftpad=cache_leftpad, attn_mask=attn_mask, k_descale=k_descale,
            v_descale=v_descale, qv=qv)
        error = None
    except Exception as e:  # noqa: BLE001 - raised below, after the others have been told
        error, o, lse = e, None, None
    o, lse = _merge_over_ranks(ring, q, o, lse, error, check_ranks)
    if learnable_sink is not None:
        o, lse = with_learnable_sink(o, lse, learnable_sink)
    return (o, lse) if return_lse else o


def _merge_over_ranks(ring, q, o, lse, error, check):
    """(o, lse) of attention over every rank's keys from this rank's (o, lse), in the
    accumulator dtype (o then in q's dtype). A rank whose call raised (error) joins the first
    collective with a flag and raises, so that every rank raises instead of waiting on it (the
    others read the flag if check)."""
    dtype = accumulator_dtype(q.dtype)
    batch, seqlen_q, nheads, _ = q.shape
    failed = torch.full((1,), float(error is not None), dtype=dtype, device=q.device)
    if error is not None:  # lse's shape is q's, the same on every rank (o's is not needed)
        lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=dtype, device=q.device)
    m = torch.cat([lse.to(dtype).flatten(), failed])
    if ring.world_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ring.group)
    if error is not None:
        raise error
    if check and m[-1] > 0:  # a read back to the host
        raise RuntimeError("attention_with_sharded_kvcache failed on another rank of the group "
                           "(its error is raised there)")
    m = m[:-1].view(batch, nheads, seqlen_q)
    m_safe = m.masked_fill(m == float("-inf"), 0.0)  # no key anywhere: weights 0, not NaN
    weight = torch.exp(lse.to(dtype) - m_safe).transpose(1, 2)[..., None]  # (B, Nq, H, 1)
    parts = torch.cat([o.to(dtype) * weight, weight], dim=-1)  # (B, Nq, H, Dv + 1)
    if ring.world_size > 1:
        dist.all_reduce(parts, group=ring.group)
    num, den = parts[..., :-1], parts[..., -1:]
    o = (num / den.clamp(min=torch.finfo(dtype).tiny)).to(q.dtype)  # 0 where no key
    lse = m + torch.log(den[..., 0].transpose(1, 2))  # -inf where no key
    return o, lse


__all__ = ["attention_with_sharded_kvcache"]
