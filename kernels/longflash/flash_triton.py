"""LongFlash Triton kernels: exact attention, forward and backward, never forming the N x N matrix.

Algorithm (Dao et al. 2022, "FlashAttention", Algorithm 1; Dao 2023, FlashAttention-2):
each program owns one block of BLOCK_M query rows of one (batch, head) and walks
over the key/value blocks of BLOCK_N columns in on-chip memory, keeping the
running row max m_i, running sum l_i and unnormalized output acc in fp32
(online softmax). Scores are scaled by softmax_scale * log2(e) once, so every
exponential is an exp2. Causal attention (bottom-right aligned: query i sees key
j iff j <= i + seqlen_k - seqlen_q) visits only key blocks that some row can
see, and masks only the blocks that straddle the diagonal or the sequence end.
The forward saves the log-sum-exp per row; the backward recomputes the
probabilities from it: a preprocessing step delta = rowsum(dO * O), one kernel
for dK/dV (a program per key block, looping over query blocks and, for GQA,
over the query heads that share the key head) and one for dQ (a program per
query block). Neither uses atomics, so gradients are deterministic.

`blockwise.py` is the same algorithm in PyTorch ops, with the same names and
block ranges (`_common.key_range`, `_common.query_range`); read it first.

Layout: (batch, seqlen, nheads, headdim), any strides with a contiguous last
dim. Head dims 1..256, padded inside the kernel to a power of two >= 16.
Address arithmetic: program ids and block starts are cast to int64 before
multiplying by strides, so tensors over 2^31 elements are addressed safely.

Where it was tested and where it breaks:
- Tested on CPU under TRITON_INTERPRET=1 (Triton 3.9) in fp16 and fp32; the GPU
  tests (marker `gpu`) target H100/H200 with Triton >= 3.0 but have not been run
  at the time of writing: see the closing notes of the issues.
- The autotune space below has not been tuned on a GPU yet; it is the usual
  FlashAttention-2 Triton space (Triton tutorial 06), pruned for large head dims.
- Unlike CUDA FlashAttention: no dropout, no sliding window, no ALiBi, no varlen
  (see the open issues); fp32 inputs use IEEE fp32 dot products (no TF32), which
  matches PyTorch's default for matmul.
"""

import os

import torch
import triton
import triton.language as tl

from ._common import LOG2E, empty_like, empty_outputs

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs():
    if _INTERPRET:
        # One small, asymmetric tile, so block-boundary logic is exercised on tiny shapes.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
        for bm in (64, 128)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for s in (2, 3, 4)
    ]


def _prune(configs, named_args, **kwargs):
    """Drop tiles whose Q tile plus pipelined K/V tiles cannot fit in this GPU's shared
    memory (about 164 KiB on A100, 227 KiB on H100), so one space serves Ampere and Hopper."""
    block_d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    q = named_args["Q"]
    try:
        limit = triton.runtime.driver.active.utils.get_device_properties(
            q.device.index)["max_shared_mem"]
    except (AttributeError, KeyError, TypeError):  # another driver API: the autotuner itself
        return configs                              # skips configs that run out of resources
    kept = [c for c in configs
            if (c.kwargs["BLOCK_M"] + 2 * c.kwargs["BLOCK_N"] * c.num_stages) * block_d
            * q.element_size() <= limit]
    return kept or [min(configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_stages))]


def _autotune(fn):
    if _INTERPRET:  # one config: nothing to prune or benchmark
        return triton.autotune(configs=_configs(), key=[])(fn)
    # Keyed on the head dim, causality and the sequence lengths rounded to a power of
    # two, so variable-length workloads do not re-tune for every length.
    return triton.autotune(configs=_configs(), key=["HEAD_DIM", "CAUSAL", "seqlen_bucket"],
                           prune_configs_by={"early_config_prune": _prune})(fn)


@triton.jit
def _visible(offs_m, offs_n, seqlen_q, seqlen_k, CAUSAL: tl.constexpr):
    """True where query offs_m may see key offs_n (broadcast shapes; bottom-right causal)."""
    mask = (offs_m < seqlen_q) & (offs_n < seqlen_k)
    if CAUSAL:
        mask = mask & (offs_n <= offs_m + (seqlen_k - seqlen_q))
    return mask


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys of query block start_m, as _common.key_range: [0, full_hi) unmasked,
    [full_hi, hi) masked, the rest never visible."""
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + offset, 0), seqlen_k)
        full_hi = tl.minimum(tl.maximum(start_m + offset + 1, 0), seqlen_k) // BLOCK_N * BLOCK_N
    else:
        hi = seqlen_k
        full_hi = seqlen_k // BLOCK_N * BLOCK_N
    return full_hi, hi


@triton.jit
def _query_range(start_n, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Queries of key block start_n, as _common.query_range: [lo, full_lo) masked,
    [full_lo, seqlen_q) unmasked, below lo never visible."""
    if CAUSAL:
        offset = seqlen_k - seqlen_q
        lo = tl.minimum(tl.maximum(start_n - offset, 0), seqlen_q) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(start_n + BLOCK_N - 1 - offset, lo)
        full_lo = (full_lo + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo


@triton.jit
def _block_ptrs(base, start, stride, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    return base + tl.cast(start, tl.int64) * stride + rows[:, None] * stride + cols[None, :]


@triton.jit
def _block_mask(start, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr):
    rows = start + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    return (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)


@triton.jit
def _load_block(base, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of a (seqlen, headdim) slice; zeros past the ends."""
    ptrs = _block_ptrs(base, start, stride, BLOCK_ROWS, BLOCK_D)
    return tl.load(ptrs, mask=_block_mask(start, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D), other=0.0)


@triton.jit
def _store_block(base, x, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    ptrs = _block_ptrs(base, start, stride, BLOCK_ROWS, BLOCK_D)
    tl.store(ptrs, x.to(base.dtype.element_ty),
             mask=_block_mask(start, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D))


@triton.jit
def _load_rows(base, start, n_rows, BLOCK_ROWS: tl.constexpr, other):
    """Per-row statistics (lse, delta) of rows [start, start + BLOCK_ROWS)."""
    offs = start + tl.arange(0, BLOCK_ROWS)
    return tl.load(base + offs, mask=offs < n_rows, other=other)


# ----------------------------------------------------------------------------- forward

@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, start_m, lo, hi, qk_scale,
                    seqlen_q, seqlen_k, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # -- compute qk --
        k = _load_block(K, start_n, stride_kn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            qk = tl.where(_visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, CAUSAL),
                          qk, float("-inf"))
        # -- online softmax: new row max, rescale what was accumulated --
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # rows that saw no key yet
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update output accumulator --
        v = _load_block(V, start_n, stride_vn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_ij
    return acc, l_i, m_i


@_autotune
@triton.jit
def _attn_fwd(Q, K, V, O, LSE, qk_scale,
              stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
              nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket,
              CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    off_hk = off_h // group_size
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    O += off_b * stride_ob + off_h * stride_oh

    q = _load_block(Q, start_m, stride_qn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, start_m, 0,
                                    full_hi, qk_scale, seqlen_q, seqlen_k, CAUSAL, False, HEAD_DIM,
                                    BLOCK_D, BLOCK_M, BLOCK_N, INPUT_PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, start_m,
                                    full_hi, hi, qk_scale, seqlen_q, seqlen_k, CAUSAL, True,
                                    HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, INPUT_PRECISION)

    # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    _store_block(O, acc, start_m, stride_on, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(LSE + off_bh * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)


# ----------------------------------------------------------------------------- backward

@triton.jit
def _attn_bwd_preprocess(O, DO, Delta, stride_ob, stride_on, stride_oh,
                         stride_dob, stride_don, stride_doh, nheads, seqlen_q,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    o = _load_block(O + off_b * stride_ob + off_h * stride_oh, start_m, stride_on, seqlen_q,
                    HEAD_DIM, BLOCK_M, BLOCK_D)
    do = _load_block(DO + off_b * stride_dob + off_h * stride_doh, start_m, stride_don, seqlen_q,
                     HEAD_DIM, BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(Delta + off_bh * seqlen_q + offs_m, delta, mask=offs_m < seqlen_q)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, stride_qn, stride_don, start_n, lo, hi,
                         qk_scale, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = _load_block(Q, start_m, stride_qn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
        # lse = -inf marks a row that saw no key; +inf makes its probabilities exactly 0.
        lse = _load_rows(LSE, start_m, seqlen_q, BLOCK_M, float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        # -- recompute p^T from the saved lse --
        qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION) * qk_scale  # (BN, BM)
        if MASKED:
            qkT = tl.where(_visible(offs_m[None, :], offs_n[:, None], seqlen_q, seqlen_k, CAUSAL),
                           qkT, float("-inf"))
        pT = tl.math.exp2(qkT - lse[None, :] * 1.4426950408889634)
        # -- dV += p^T dO --
        do = _load_block(DO, start_m, stride_don, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        # -- dS = p * (dP - delta); dK += dS^T q --
        delta = _load_rows(Delta, start_m, seqlen_q, BLOCK_M, 0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@_autotune
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, qk_scale, softmax_scale,
                   stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                   stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                   stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                   nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket,
                   CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1).to(tl.int64)
    nheads_kv = nheads // group_size
    off_b, off_hk = off_bhk // nheads_kv, off_bhk % nheads_kv
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    k = _load_block(K, start_n, stride_kn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
    v = _load_block(V, start_n, stride_vn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    lo, full_lo = _query_range(start_n, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    # GQA: the query heads of this key head take turns; no atomics, so dK, dV are deterministic.
    for g in range(group_size):
        off_h = off_hk * group_size + g
        Q_h = Q + off_b * stride_qb + off_h * stride_qh
        DO_h = DO + off_b * stride_dob + off_h * stride_doh
        LSE_h = LSE + (off_b * nheads + off_h) * seqlen_q
        Delta_h = Delta + (off_b * nheads + off_h) * seqlen_q
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_h, DO_h, LSE_h, Delta_h, stride_qn,
                                      stride_don, start_n, lo, full_lo, qk_scale, seqlen_q,
                                      seqlen_k, CAUSAL, True, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                      INPUT_PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Q_h, DO_h, LSE_h, Delta_h, stride_qn,
                                      stride_don, start_n, full_lo, seqlen_q, qk_scale, seqlen_q,
                                      seqlen_k, CAUSAL, False, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                                      INPUT_PRECISION)
    _store_block(DK + off_b * stride_dkb + off_hk * stride_dkh, dk * softmax_scale, start_n,
                 stride_dkn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
    _store_block(DV + off_b * stride_dvb + off_hk * stride_dvh, dv, start_n, stride_dvn, seqlen_k,
                 HEAD_DIM, BLOCK_N, BLOCK_D)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, start_m, lo, hi,
                       qk_scale, seqlen_q, seqlen_k, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_block(K, start_n, stride_kn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
        v = _load_block(V, start_n, stride_vn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
        # -- recompute p from the saved lse --
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale
        if MASKED:
            qk = tl.where(_visible(offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, CAUSAL),
                          qk, float("-inf"))
        p = tl.math.exp2(qk - lse[:, None])
        # -- dS = p * (dP - delta); dQ += dS k --
        dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@_autotune
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, qk_scale, softmax_scale,
                 stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                 stride_dqb, stride_dqn, stride_dqh,
                 nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket,
                 CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    off_hk = off_h // group_size
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    q = _load_block(Q + off_b * stride_qb + off_h * stride_qh, start_m, stride_qn, seqlen_q,
                    HEAD_DIM, BLOCK_M, BLOCK_D)
    do = _load_block(DO + off_b * stride_dob + off_h * stride_doh, start_m, stride_don, seqlen_q,
                     HEAD_DIM, BLOCK_M, BLOCK_D)
    lse = _load_rows(LSE + off_bh * seqlen_q, start_m, seqlen_q, BLOCK_M, float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    delta = _load_rows(Delta + off_bh * seqlen_q, start_m, seqlen_q, BLOCK_M, 0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, start_m, 0, full_hi,
                            qk_scale, seqlen_q, seqlen_k, CAUSAL, False, HEAD_DIM, BLOCK_D,
                            BLOCK_M, BLOCK_N, INPUT_PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, start_m, full_hi,
                            hi, qk_scale, seqlen_q, seqlen_k, CAUSAL, True, HEAD_DIM, BLOCK_D,
                            BLOCK_M, BLOCK_N, INPUT_PRECISION)
    _store_block(DQ + off_b * stride_dqb + off_h * stride_dqh, dq * softmax_scale, start_m,
                 stride_dqn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)


# ----------------------------------------------------------------------------- launchers

def _last_dim_contiguous(*xs):
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _meta(q, k, causal):
    """Compile-time parameters shared by every launch."""
    headdim = q.shape[-1]
    seqlen = max(q.shape[1], k.shape[1], 1)
    return dict(
        seqlen_bucket=triton.next_power_of_2(seqlen),
        CAUSAL=causal,
        HEAD_DIM=headdim,
        BLOCK_D=max(16, triton.next_power_of_2(headdim)),
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


def _strides(*xs):
    return [s for x in xs for s in x.stride()[:3]]


def forward(q, k, v, causal, softmax_scale):
    """o: (batch, seqlen_q, nheads, headdim), lse: (batch, nheads, seqlen_q) float32."""
    q, k, v = _last_dim_contiguous(q, k, v)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    o, lse = empty_outputs(q)
    if o.numel() == 0:
        return o, lse
    grid = lambda META: (triton.cdiv(seqlen_q, META["BLOCK_M"]), batch * nheads)  # noqa: E731
    _attn_fwd[grid](q, k, v, o, lse, softmax_scale * LOG2E, *_strides(q, k, v, o),
                    nheads, nheads // nheads_kv, seqlen_q, seqlen_k, **_meta(q, k, causal))
    return o, lse


def backward(do, q, k, v, o, lse, dlse, causal, softmax_scale):
    """Gradients (dq, dk, dv) of sum(o * do) + sum(lse * dlse); dlse may be None."""
    do, q, k, v, o = _last_dim_contiguous(do, q, k, v, o)
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    meta = _meta(q, k, causal)
    # -- preprocess: delta = rowsum(do * o); a gradient of lse enters as -dlse --
    delta = torch.empty_like(lse)
    block_m = 32 if _INTERPRET else 128
    _attn_bwd_preprocess[(triton.cdiv(seqlen_q, block_m), batch * nheads)](
        o, do, delta, *_strides(o, do), nheads, seqlen_q, HEAD_DIM=headdim,
        BLOCK_D=meta["BLOCK_D"], BLOCK_M=block_m)
    if dlse is not None:
        delta -= dlse
    group_size = nheads // nheads_kv
    args = (q, k, v, do, lse.contiguous(), delta)
    scales = (softmax_scale * LOG2E, softmax_scale)
    grid_kv = lambda META: (triton.cdiv(seqlen_k, META["BLOCK_N"]), batch * nheads_kv)  # noqa: E731
    _attn_bwd_dkdv[grid_kv](*args, dk, dv, *scales, *_strides(q, k, v, do, dk, dv),
                            nheads, group_size, seqlen_q, seqlen_k, **meta)
    grid_q = lambda META: (triton.cdiv(seqlen_q, META["BLOCK_M"]), batch * nheads)  # noqa: E731
    _attn_bwd_dq[grid_q](*args, dq, *scales, *_strides(q, k, v, do, dq),
                         nheads, group_size, seqlen_q, seqlen_k, **meta)
    return dq, dk, dv
