"""Standard attention that materializes the N x N matrix (the paper's Algorithm 0).

It is the ground truth of the test suite (run in float64 on CPU) and the naive
baseline of the experiments. Same conventions as `longflash.attention`:

    q: (batch, seqlen_q, nheads, headdim)
    k, v: (batch, seqlen_k, nheads_kv, headdim), nheads % nheads_kv == 0
    causal is bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q

        seqlen_q = 2, seqlen_k = 5, causal:     seqlen_q = 5, seqlen_k = 2, causal:
            1 1 1 1 0                               0 0
            1 1 1 1 1                               0 0
                                                    0 0
                                                    1 0
                                                    1 1

window_size = (left, right) is aligned the same way (-1: unbounded; causal sets
right = 0). Scores in FlashAttention-2's order: scale, softcap, ALiBi, attn_mask, mask. A
query row that sees no key gives output 0 and lse -inf. Dropout uses the same
counter-based mask as the other implementations, materialized here.
"""

import math

import torch

from ._common import BLOCK_SPARSE_UNIT, block_mask_elements, dropout_uniform, visible


def error_bound(err_lowp, ref_absmax, dtype):
    """The tolerance rule of the tests and experiments (FlashAttention's): an implementation's
    max |out - ref64| may be at most 2 * err_lowp + floor, where err_lowp is the max error of
    the same computation done by PyTorch in the input's precision `dtype` and the floor is
    4 ulp of that dtype (at least 1e-5: float32 values that cancel to exactly 0 in the
    reference still carry ~1e-7 of rounding), relative to max(1, max |ref64|)."""
    floor = max(4 * torch.finfo(dtype).eps, 1e-5) * max(1.0, ref_absmax)
    return 2 * err_lowp + floor


def attention_ref(q, k, v, causal=False, softmax_scale=None, window_size=(-1, -1),
                  alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=0, batch_offset=0,
                  upcast=True, learnable_sink=None, attn_mask=None, block_mask=None,
                  block_size=BLOCK_SPARSE_UNIT):
    """Materializing attention. Returns (o, lse).

    o: (batch, seqlen_q, nheads, headdim) in q's dtype
    lse: (batch, nheads, seqlen_q), natural-log log-sum-exp of the scores (before dropout)
    alibi_slopes: (nheads,) or (batch, nheads). seed: the dropout stream; batch_offset: the
        batch index of q[0] in that stream (packed sequence b uses b).
    upcast: compute in float32 (float64 stays float64). With upcast=False the whole
        computation runs in the input dtype, which is the "same computation in low
        precision" that the tolerance rule of the tests compares against.
    learnable_sink: (nheads,) or None: one more column of scores, learnable_sink[h] in every
        row, in the softmax and lse, then dropped (it attends to no value), as gpt-oss does.
    attn_mask: bool or float, broadcastable to (batch, nheads, seqlen_q, seqlen_k), or None:
        False hides a key from a query; a float is added to the scores (after ALiBi).
    block_mask: bool (batch or 1, nheads or 1, query blocks, key blocks), or None: query i
        sees key j only if block_mask[b, h, i // block_size_q, j // block_size_k] (block_size
        an int or (block_size_q, block_size_k)), made elementwise here.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = (x.float() if x.dtype != torch.float64 else x for x in (q, k, v))
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k = k.shape[1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    group = nheads // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # (B, Nk, H, D)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # (B, H, Nq, Nk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seqlen_q, device=q.device)[:, None]
    j = torch.arange(seqlen_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.expand(batch, nheads).to(scores.dtype)[:, :, None, None]
        scores = scores - slopes * (i + seqlen_k - seqlen_q - j).abs()
    if block_mask is not None:
        sizes = (block_size, block_size) if isinstance(block_size, int) else block_size
        hidden = ~block_mask_elements(block_mask, *sizes, seqlen_q, seqlen_k)
        scores = scores.masked_fill(hidden, float("-inf"))
    if attn_mask is not None:  # -inf entries as masked_fill: no gradient through them
        hidden = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask == float("-inf")
        if attn_mask.dtype != torch.bool:
            scores = scores + attn_mask.masked_fill(hidden, 0).to(scores.dtype)
        scores = scores.masked_fill(hidden, float("-inf"))
    left, right = window_size
    if causal or left >= 0 or right >= 0:
        mask = visible(i, j, seqlen_q, seqlen_k, left, 0 if causal else right)
        scores = scores.masked_fill(~mask, float("-inf"))
    if learnable_sink is not None:  # (B, H, Nq, Nk + 1)
        sink = learnable_sink.to(scores.dtype)[None, :, None, None]
        scores = torch.cat([scores, sink.expand(batch, nheads, seqlen_q, 1)], dim=-1)
    lse = torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)
    # Rows that see no key: softmax of all -inf is NaN; define it as 0 instead.
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if learnable_sink is not None:
        p = p[..., :seqlen_k]
    if dropout_p > 0:
        bh = torch.arange(batch_offset * nheads, (batch_offset + batch) * nheads,
                          device=q.device).view(batch, nheads, 1, 1)
        keep = dropout_uniform(seed, bh, i, j) >= dropout_p
        p = p * keep.to(p.dtype) / (1.0 - dropout_p)
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    return o.to(dtype), lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes=None,
                         block_mask=None, **kwargs):
    """Packed sequences (total, nheads, headdim), one `attention_ref` per sequence.
    Returns o (total_q, nheads, headdim) and lse (nheads, total_q). ALiBi slopes
    (batch, nheads), block_mask's rows (batch or 1, ...) and the dropout stream are taken per
    sequence, as in the kernels."""
    outs, lses = [], []
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        slopes = None if alibi_slopes is None else alibi_slopes.expand(len(cu_q) - 1, -1)[b:b + 1]
        if block_mask is not None:
            kwargs["block_mask"] = block_mask[b:b + 1] if block_mask.shape[0] > 1 else block_mask
        o, lse = attention_ref(q[None, rows], k[None, cols], v[None, cols], alibi_slopes=slopes,
                               batch_offset=b, **kwargs)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)
