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

A query row that sees no key gives output 0 and lse -inf.
"""

import math

import torch


def causal_mask(seqlen_q, seqlen_k, rows=None, cols=None, device=None):
    """Bool mask, True where query i may see key j (bottom-right aligned).

    rows, cols: `range`s of query and key indices (default: all), so that a blockwise
    caller builds only its (len(rows), len(cols)) tile, never the whole matrix.
    """
    rows = range(seqlen_q) if rows is None else rows
    cols = range(seqlen_k) if cols is None else cols
    i = torch.arange(rows.start, rows.stop, device=device)[:, None]
    j = torch.arange(cols.start, cols.stop, device=device)[None, :]
    return j <= i + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, causal=False, softmax_scale=None, upcast=True):
    """Materializing attention. Returns (o, lse).

    o: (batch, seqlen_q, nheads, headdim) in q's dtype
    lse: (batch, nheads, seqlen_q), natural-log log-sum-exp of the scaled scores
    upcast: compute in float32 (float64 stays float64). With upcast=False the whole
        computation runs in the input dtype, which is the "same computation in low
        precision" that the tolerance rule of the tests compares against.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = (x.float() if x.dtype != torch.float64 else x for x in (q, k, v))
    headdim = q.shape[-1]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)  # (B, Nk, H, D)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale  # (B, H, Nq, Nk)
    if causal:
        mask = causal_mask(q.shape[1], k.shape[1], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float() if scores.dtype != torch.float64 else scores, dim=-1)
    # Rows that see no key: softmax of all -inf is NaN; define it as 0 instead.
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    o = torch.einsum("bhij,bjhd->bihd", p, v)
    return o.to(dtype), lse
