"""Blockwise exact attention in PyTorch: the Triton kernel's algorithm in PyTorch ops.

This is the CPU path of LongFlash (and a readable statement of the kernel). It
computes exactly softmax(q k^T * softmax_scale) v without forming the
(seqlen_q, seqlen_k) matrix: a query block of BLOCK_M rows walks over the key
blocks of BLOCK_N columns, keeping a running row maximum m_i, a running sum l_i
and an unnormalized accumulator acc (online softmax, Milakov & Gimelshein 2018;
Dao et al. 2022, Algorithm 1). The log-sum-exp of each row is saved, so the
backward pass recomputes each block of probabilities instead of storing them
(Dao 2023, Algorithm 2). Extra memory is O(BLOCK_M * BLOCK_N) per batch and head
on top of the O(seqlen) inputs, outputs and gradients.

Variable names, block ranges and the order of operations follow
`flash_triton.py`; the kernel runs one (query block, batch * head) program per
grid cell, here batch and heads are batched tensor dimensions and the block
loops run in Python. GQA: query head h reads key/value head h // (nheads //
nheads_kv); tensors are viewed as (batch, nheads_kv, group, seqlen, headdim) so
that keys and values broadcast over the group without being copied.

Autograd is registered once for all implementations in `interface.py`; these
functions take and return plain tensors.
"""

import torch

from ._common import (LN2, LOG2E, accumulator_dtype, empty_like, empty_outputs, key_range,
                      query_range)
from .reference import causal_mask

# Larger tiles than on a GPU: on a CPU each tile is a batched matmul and the
# Python loop overhead is paid per tile.
BLOCK_M = 128
BLOCK_N = 256


def _grouped(x, nheads_kv):
    """(batch, seqlen, nheads, headdim) -> view (batch, nheads_kv, group, seqlen, headdim)."""
    return x.unflatten(2, (nheads_kv, -1)).permute(0, 2, 3, 1, 4)


def _attn_fwd_inner(acc, l_i, m_i, q, k, v, start_m, lo, hi, qk_scale, masked, seqlen_q, seqlen_k,
                    block_n):
    dtype = acc.dtype
    for start_n in range(lo, hi, block_n):
        k_j = k[..., start_n:start_n + block_n, :].to(dtype)  # (B, Hkv, 1, BN, D)
        v_j = v[..., start_n:start_n + block_n, :].to(dtype)
        # -- compute qk --
        qk = q @ k_j.transpose(-1, -2) * qk_scale  # (B, Hkv, G, BM, BN)
        if masked:
            mask = causal_mask(seqlen_q, seqlen_k, range(start_m, start_m + q.shape[-2]),
                               range(start_n, start_n + k_j.shape[-2]), q.device)
            qk = qk.masked_fill(~mask, float("-inf"))
        # -- online softmax: new row max, rescale what was accumulated --
        m_ij = torch.maximum(m_i, qk.amax(-1))
        m_safe = torch.where(m_ij == float("-inf"), 0.0, m_ij)  # rows that saw no key yet
        p = torch.exp2(qk - m_safe[..., None])
        alpha = torch.exp2(m_i - m_safe)
        l_i = l_i * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v_j
        m_i = m_ij
    return acc, l_i, m_i


@torch.no_grad()
def forward(q, k, v, causal, softmax_scale, block_m=None, block_n=None):
    """o: (batch, seqlen_q, nheads, headdim), lse: (batch, nheads, seqlen_q) natural log."""
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    _, seqlen_q, _, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dtype = accumulator_dtype(q.dtype)
    qk_scale = softmax_scale * LOG2E
    o, lse = empty_outputs(q)
    q5, o5 = _grouped(q, nheads_kv), _grouped(o, nheads_kv)  # (B, Hkv, G, Nq, D)
    k5, v5 = _grouped(k, nheads_kv), _grouped(v, nheads_kv)  # (B, Hkv, 1, Nk, D)
    lse4 = lse.unflatten(1, (nheads_kv, -1))  # (B, Hkv, G, Nq)
    for start_m in range(0, seqlen_q, block_m):
        q_i = q5[..., start_m:start_m + block_m, :].to(dtype)
        m_i = q_i.new_full(q_i.shape[:-1], float("-inf"))
        l_i = q_i.new_zeros(q_i.shape[:-1])
        acc = torch.zeros_like(q_i)
        full_hi, hi = key_range(start_m, block_m, block_n, seqlen_q, seqlen_k, causal)
        args = (q_i, k5, v5, start_m)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, *args, 0, full_hi, qk_scale, False,
                                        seqlen_q, seqlen_k, block_n)
        # Tiles here are cut at the sequence ends, so only causal needs a mask (the
        # kernel's masked blocks also mask the columns past seqlen_k).
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, *args, full_hi, hi, qk_scale, causal,
                                        seqlen_q, seqlen_k, block_n)
        # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
        l_safe = torch.where(l_i == 0, 1.0, l_i)
        o5[..., start_m:start_m + block_m, :] = acc / l_safe[..., None]
        lse4[..., start_m:start_m + block_m] = torch.where(
            l_i == 0, float("-inf"), (m_i + torch.log2(l_safe)) * LN2)
    return o, lse


def _probs(q_i, k_j, lse2_i, qk_scale, masked, start_m, start_n, seqlen_q, seqlen_k):
    """Recompute one block of probabilities p = exp(s - lse) from the saved lse."""
    qk = q_i @ k_j.transpose(-1, -2) * qk_scale  # (B, Hkv, G, BM, BN)
    if masked:
        mask = causal_mask(seqlen_q, seqlen_k, range(start_m, start_m + q_i.shape[-2]),
                           range(start_n, start_n + k_j.shape[-2]), q_i.device)
        qk = qk.masked_fill(~mask, float("-inf"))
    return torch.exp2(qk - lse2_i[..., None])


@torch.no_grad()
def backward(do, q, k, v, o, lse, dlse, causal, softmax_scale, block_m=None, block_n=None):
    """Gradients (dq, dk, dv) of sum(o * do) + sum(lse * dlse); dlse may be None."""
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    seqlen_q, seqlen_k, nheads_kv = q.shape[1], k.shape[1], k.shape[2]
    dtype = accumulator_dtype(q.dtype)
    qk_scale = softmax_scale * LOG2E
    # -- preprocess: delta = rowsum(do * o); a gradient of lse enters as -dlse --
    delta = (do.to(dtype) * o.to(dtype)).sum(-1).transpose(1, 2)  # (B, H, Nq)
    if dlse is not None:
        delta = delta - dlse
    # lse = -inf marks a row that saw no key; +inf makes its probabilities exactly 0.
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    q5, do5 = _grouped(q, nheads_kv), _grouped(do, nheads_kv)
    k5, v5 = _grouped(k, nheads_kv), _grouped(v, nheads_kv)
    lse2, delta = lse2.unflatten(1, (nheads_kv, -1)), delta.unflatten(1, (nheads_kv, -1))
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    dq5 = _grouped(dq, nheads_kv)
    dk4, dv4 = dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)  # (B, Hkv, Nk, D)

    # -- dK, dV: one key block at a time, over the query blocks that see it --
    for start_n in range(0, seqlen_k, block_n):
        k_j = k5[..., start_n:start_n + block_n, :].to(dtype)
        v_j = v5[..., start_n:start_n + block_n, :].to(dtype)
        dk_j = k_j.new_zeros(k_j.shape[:2] + k_j.shape[3:])  # (B, Hkv, BN, D)
        dv_j = torch.zeros_like(dk_j)
        lo, full_lo = query_range(start_n, block_m, block_n, seqlen_q, seqlen_k, causal)
        for start_m in range(lo, seqlen_q, block_m):
            q_i = q5[..., start_m:start_m + block_m, :].to(dtype)
            do_i = do5[..., start_m:start_m + block_m, :].to(dtype)
            p = _probs(q_i, k_j, lse2[..., start_m:start_m + block_m], qk_scale,
                       start_m < full_lo, start_m, start_n, seqlen_q, seqlen_k)
            dv_j += (p.transpose(-1, -2) @ do_i).sum(2)  # sum over the query heads of the group
            dp = do_i @ v_j.transpose(-1, -2)
            ds = p * (dp - delta[..., start_m:start_m + block_m, None])
            dk_j += (ds.transpose(-1, -2) @ q_i).sum(2)
        dk4[:, :, start_n:start_n + block_n] = dk_j * softmax_scale
        dv4[:, :, start_n:start_n + block_n] = dv_j

    # -- dQ: one query block at a time, over the key blocks it sees --
    for start_m in range(0, seqlen_q, block_m):
        q_i = q5[..., start_m:start_m + block_m, :].to(dtype)
        do_i = do5[..., start_m:start_m + block_m, :].to(dtype)
        lse2_i, delta_i = lse2[..., start_m:start_m + block_m], delta[..., start_m:start_m + block_m]
        dq_i = torch.zeros_like(q_i)
        full_hi, hi = key_range(start_m, block_m, block_n, seqlen_q, seqlen_k, causal)
        for start_n in range(0, hi, block_n):
            k_j = k5[..., start_n:start_n + block_n, :].to(dtype)
            v_j = v5[..., start_n:start_n + block_n, :].to(dtype)
            p = _probs(q_i, k_j, lse2_i, qk_scale, causal and start_n >= full_hi, start_m, start_n,
                       seqlen_q, seqlen_k)
            dp = do_i @ v_j.transpose(-1, -2)
            ds = p * (dp - delta_i[..., None])
            dq_i += ds @ k_j
        dq5[..., start_m:start_m + block_m, :] = dq_i * softmax_scale
    return dq, dk, dv
