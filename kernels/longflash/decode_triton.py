"""LongFlash Triton split-KV decoding kernels: attention of a few queries over a KV cache.

Algorithm (Flash-Decoding, Dao, Haziza, Massa, Sizov 2023; `kvcache.py` is the same
algorithm in PyTorch ops, with the same names): program (split, batch * nheads_kv, row block)
runs FlashAttention's online softmax (running max m_i, sum l_i, fp32 accumulator acc, exp2
with the scale pre-multiplied by log2(e)) over one contiguous range of key blocks
[split_lo, split_hi) of its sequence, and writes a partial output normalized by its own sum
plus its log-sum-exp, in float32. A second kernel, `_merge_splits`, combines the splits of
each row exactly: lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s. With one
split the first kernel writes o and lse directly.

GQA packing: the tile rows are (query i, head g of the group) pairs, r = i * group + g, so
the group of query heads that share a KV head reads each key block once, and a decoding
step (seqlen_q = 1) with group 8 fills 8 of the tile's 16 rows instead of 1.

Values may have a head dim of their own (HEAD_DIM_V, MLA): the v tiles, the accumulator and
the outputs take it; q and k keep HEAD_DIM. MLA's absorbed form (HAS_QV): a second query tile
QV of HEAD_DIM_V columns, held through the loop, adds qv v^T to each score; the value tile is
loaded before the scores and serves qv v^T and p v (at 512 columns, tiles of at most 32 rows:
launch_config). The merge kernel covers the head dim in column blocks.

Caches: contiguous (batch, capacity, nheads_kv, headdim), or paged (num_pages, page_size,
nheads_kv, headdim) with block_table (batch, max_pages): the key at position n of sequence b
is in page block_table[b, n // page_size], slot n % page_size (any page size; each row of
the key tile is addressed on its own). Per-sequence lengths come from SEQLENS_K (after the
append). The append comes first, from a kernel of its own, `_append_rotary` (one program per
new key row, and per query row to rotate): it writes the new keys and values into the cache,
the keys turned by the rotary embedding if one is given, and q's rotated copy.

Every key tile is masked (visibility, window, end of split): decoding is memory-bound and the
mask is a few integer operations per score. Key blocks outside the rows' window are skipped.
An attn_mask (BIAS_KIND, flash_triton._bias: boolean as uint8, or float) is read by pointers
through its strides, a (BLOCK_M, BLOCK_N) tile at each packed row's (batch, head, query) and
the tile's key positions, loaded before the key tile: loaded after it, Triton's layout pass
ran the online softmax twice, in the MMA layout and in the mask load's (255 registers and
spills at head dims 64 and 256 for sm_90a with Triton 3.6; loaded first, 150-214 registers
and no spills).

Where it was tested and where it breaks: under TRITON_INTERPRET=1 (Triton 3.9) in fp16 and
fp32, and compiled (not run) for sm_90 and sm_80 by tests/compile_decode_for_gpu.py; at the
launcher's config it is spill-free on sm_90a at head dims 64-256 with Triton 3.6 and 3.9
(experiments/codegen.py, results/codegen/), its 16-row tiles on mma.sync (below wgmma's 64
rows) and its cache loads pipelined with cp.async. It has not run on a GPU: block sizes,
warps, stages and the split heuristic are untuned guesses.
Unlike FlashAttention's flash_attn_with_kvcache, the append and the rotary embedding are a
kernel launched before the attention's, not fused into it (a decoding step is two or three
launches: append, split, merge); cache_batch_idx is served as a paged cache of one page per
row; cache_leftpad is LEFTPAD_K (each sequence's first key).
"""

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ._common import (FP8_DTYPES, LOG2E, empty_outputs, fix_triton_interpreter,
                      group_block_lists)
from .flash_triton import (_bias, _cached_lists, _descale_args, _loop_span, _loop_tile,
                           check_fp8, on_tensor_device, page_rows, smaller_config)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if _INTERPRET:
    fix_triton_interpreter()
MAX_SPLITS = 128


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 without overflow trouble.
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _kv_ptrs(CACHE, BLOCK_TABLE, off_b, off_hk, offs_n, offs_d, n_mask, page_size,
             stride_cb, stride_cn, stride_ch, stride_tb, PAGED: tl.constexpr):
    """Pointers to the (BLOCK_N, BLOCK_D) tile of keys offs_n of sequence off_b, head off_hk."""
    if PAGED:
        rows = page_rows(BLOCK_TABLE + off_b * stride_tb, offs_n, n_mask, page_size, stride_cb,
                         stride_cn)
    else:
        rows = off_b * stride_cb + offs_n.to(tl.int64) * stride_cn
    return CACHE + off_hk * stride_ch + rows[:, None] + offs_d[None, :]


# ----------------------------------------------------------------------------- append kernel

@triton.jit
def _rotated(X, offs_d, d_mask, COS, SIN, pos, stride_cos, rotary_dim,
             INTERLEAVED: tl.constexpr):
    """The row X[offs_d] turned by the angles of position pos, in float32: each pair (x1, x2)
    of its first rotary_dim dims becomes (x1 cos - x2 sin, x2 cos + x1 sin), pairs (i,
    i + rotary_dim / 2) or, if INTERLEAVED, (2i, 2i + 1); later dims pass through (cos 1,
    sin 0). Written as x * cos + sign * partner * sin, one gather of the partner dims."""
    half = rotary_dim // 2
    in_rot = offs_d < rotary_dim
    if INTERLEAVED:
        first = offs_d % 2 == 0
        partner = offs_d ^ 1
        j = offs_d // 2
    else:
        first = offs_d < half
        partner = tl.where(first, offs_d + half, offs_d - half)
        j = tl.where(first, offs_d, offs_d - half)
    x = tl.load(X + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    x_partner = tl.load(X + partner, mask=d_mask & in_rot, other=0.0).to(tl.float32)
    angles = pos.to(tl.int64) * stride_cos + j
    cos = tl.load(COS + angles, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(SIN + angles, mask=in_rot, other=0.0).to(tl.float32)
    return x * cos + tl.where(first, -x_partner, x_partner) * sin


@triton.jit
def _quantized(x, descale, FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr,
               FP8_MAX: tl.constexpr):
    """x / descale (float32) rounded to the float8 format with FP8_MANT mantissa bits and
    smallest normal exponent FP8_EMIN, to nearest even, saturated at +-FP8_MAX: kvcache's
    quantize. Rounded here, in float32 arithmetic, so that the conversion to float8 after it
    is exact: adding c = 2^(e - FP8_MANT + 23), e the value's exponent (at least FP8_EMIN),
    leaves the sum's last bit worth the format's spacing there (Triton 3.9's interpreter
    rounds some values up across a power of two to half the result)."""
    x = tl.clamp(x / descale, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    c = ((tl.maximum(e, FP8_EMIN) - FP8_MANT + 150) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(x) + c) - c).to(tl.int32, bitcast=True)
    # x's sign bit put back by hand, so that -0 stays -0: Triton 3.6's unary minus is 0 - r,
    # which turns -(+0) into +0 (the fourth window's H100 found it; 3.9's is fneg)
    return (r | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["seqlen_all"])
def _append_rotary(Q, Q_ROT, K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, SEQLENS, COS, SIN,
                   stride_qb, stride_qn, stride_qh, stride_rb, stride_rn, stride_rh,
                   stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
                   stride_kcb, stride_kcn, stride_kch, stride_vcb, stride_vcn, stride_vch,
                   stride_tb, stride_cos, nheads, nheads_kv, seqlen_new, seqlen_all,
                   page_size, rotary_dim,
                   UNIFORM_SEQLEN: tl.constexpr, PAGED: tl.constexpr, ROTARY: tl.constexpr,
                   INTERLEAVED: tl.constexpr, Q_IN_ORDER: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                   BLOCK_DV: tl.constexpr, FP8: tl.constexpr = False,
                   FP8_MANT: tl.constexpr = 0, FP8_EMIN: tl.constexpr = 0,
                   FP8_MAX: tl.constexpr = 0.0, K_DESCALE=None, V_DESCALE=None, stride_kdb=0,
                   stride_kdh=0, stride_vdb=0, stride_vdh=0):
    """One program per (row, sequence): rows t * nheads_kv + h write new key/value t of KV
    head h into the cache at position seqlen + t (the key rotated first if ROTARY); with
    ROTARY, the rows after them turn query i of head h into Q_ROT, at position seqlen + i
    (Q_IN_ORDER: causal or windowed) or seqlen. seqlen: the sequence's length before the
    append (SEQLENS, or seqlen_all for every sequence). FP8: the cache is float8, the row
    quantized (_quantized) by K_DESCALE / V_DESCALE[b, h] (broadcast strides may be 0)."""
    row = tl.program_id(0)
    off_b = tl.program_id(1).to(tl.int64)
    seqlen = seqlen_all
    if not UNIFORM_SEQLEN:
        seqlen = tl.load(SEQLENS + off_b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if row < seqlen_new * nheads_kv:
        t, off_h = row // nheads_kv, row % nheads_kv
        pos = seqlen + t
        # -- the cache slot of key position pos: through the page table, or row pos --
        if PAGED:
            page = tl.load(BLOCK_TABLE + off_b * stride_tb + pos // page_size).to(tl.int64)
            slot = (pos % page_size).to(tl.int64)
        else:
            page, slot = off_b, pos.to(tl.int64)
        k_row = K_NEW + off_b * stride_kb + t * stride_kn + off_h * stride_kh
        if ROTARY:
            k = _rotated(k_row, offs_d, d_mask, COS, SIN, pos, stride_cos, rotary_dim,
                         INTERLEAVED)
        else:
            k = tl.load(k_row + offs_d, mask=d_mask)
        if FP8:  # the key as k's dtype holds it (rotated: rounded), then quantized
            k = _quantized(k.to(K_NEW.dtype.element_ty).to(tl.float32),
                           tl.load(K_DESCALE + off_b * stride_kdb + off_h * stride_kdh),
                           FP8_MANT, FP8_EMIN, FP8_MAX)
        tl.store(K_CACHE + page * stride_kcb + slot * stride_kcn + off_h * stride_kch + offs_d,
                 k.to(K_CACHE.dtype.element_ty), mask=d_mask)
        offs_dv = tl.arange(0, BLOCK_DV)  # values: a head dim of their own (MLA)
        dv_mask = offs_dv < HEAD_DIM_V
        v = tl.load(V_NEW + off_b * stride_vb + t * stride_vn + off_h * stride_vh + offs_dv,
                    mask=dv_mask)
        if FP8:
            v = _quantized(v.to(tl.float32),
                           tl.load(V_DESCALE + off_b * stride_vdb + off_h * stride_vdh),
                           FP8_MANT, FP8_EMIN, FP8_MAX)
        tl.store(V_CACHE + page * stride_vcb + slot * stride_vcn + off_h * stride_vch + offs_dv,
                 v.to(V_CACHE.dtype.element_ty), mask=dv_mask)
    elif ROTARY:
        row -= seqlen_new * nheads_kv
        i, off_h = row // nheads, row % nheads
        pos = seqlen
        if Q_IN_ORDER:
            pos += i
        q = _rotated(Q + off_b * stride_qb + i * stride_qn + off_h * stride_qh, offs_d, d_mask,
                     COS, SIN, pos, stride_cos, rotary_dim, INTERLEAVED)
        tl.store(Q_ROT + off_b * stride_rb + i * stride_rn + off_h * stride_rh + offs_d,
                 q.to(Q_ROT.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------- split kernel

# seqlen_k_all grows by one per decoding step, and so may an attn_mask's length and strides
@triton.jit(do_not_specialize=["seqlen_k_all", "stride_bb", "stride_bh", "stride_bm",
                               "mask_len"])
def _fwd_splitkv(Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQLENS_K, LEFTPAD_K, ALIBI, O, LSE,
                 O_PARTIAL, LSE_PARTIAL,
                 stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_tb, stride_ob, stride_on, stride_oh,
                 stride_lb, stride_lh, stride_ab, stride_ah,
                 stride_ps, stride_pb, stride_ph, stride_pn, stride_qs, stride_qsb, stride_qsh,
                 nheads_kv, group_size, seqlen_q, seqlen_k_all, num_splits, page_size,
                 window_left, window_right, qk_scale, softmax_scale, softcap,
                 UNIFORM_SEQLEN: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
                 HAS_LEFTPAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                 BIAS_KIND: tl.constexpr = 0, BIAS=None, stride_bb=0, stride_bh=0, stride_bm=0,
                 stride_bn=0, mask_len=0, HAS_DESCALE: tl.constexpr = False, K_DESCALE=None,
                 V_DESCALE=None, stride_kdb=0, stride_kdh=0, stride_vdb=0, stride_vdh=0,
                 HAS_QV: tl.constexpr = False, QV=None, stride_qvb=0, stride_qvn=0,
                 stride_qvh=0, BLOCK_SPARSE: tl.constexpr = False, SPARSE=None, stride_sb=0,
                 stride_sh=0, stride_sm=0, stride_sn=0, sparse_cols=0, sparse_bq=1,
                 sparse_bk=1, LISTS=None, stride_listb=0, stride_listh=0,
                 stride_listm=0):
    """BIAS_KIND, BIAS: attn_mask (flash_triton._bias), (batch, nheads, seqlen_q, mask_len)
    through its strides, indexed by key position. A float8 cache's tiles are converted to
    q's dtype as they are loaded (exact); HAS_DESCALE: its scales K_DESCALE, V_DESCALE
    (batch, nheads_kv), the key's folded into the softmax scale, the value's into the
    output. HAS_QV: QV (batch, seqlen_q, nheads, HEAD_DIM_V), MLA's absorbed queries: each
    score adds qv v^T (times the value scale), the value tile loaded before the scores.
    BLOCK_SPARSE: SPARSE (batch, nheads, query blocks, sparse_cols) uint8 through its
    strides, block_mask of sparse_bq queries by sparse_bk keys (a multiple of BLOCK_N: each
    key tile lies in one block), and LISTS (batch, nheads_kv, programs along BLOCK_M, 2
    sparse_cols + 1) int32, the program's lists of the blocks some of its rows see
    (_common.group_block_lists): the loop runs over those tiles only, the splits share them
    out evenly, each row's bit of a tile's block masks its scores, and a listed tile that no
    row sees (a superset's) loads nothing (its loads predicated off)."""
    split = tl.program_id(0)
    off_bhk = tl.program_id(1).to(tl.int64)
    start_m = tl.program_id(2) * BLOCK_M
    off_b, off_hk = off_bhk // nheads_kv, off_bhk % nheads_kv
    seqlen_k = seqlen_k_all  # UNIFORM_SEQLEN: every sequence has this many keys
    if not UNIFORM_SEQLEN:
        seqlen_k = tl.load(SEQLENS_K + off_b)
    leftpad = 0  # keys before it are padding (cache_leftpad): the sequence starts there
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD_K + off_b)
    # -- GQA packing: row r is query i = r // group of head off_hk * group + r % group --
    offs_m = start_m + tl.arange(0, BLOCK_M)
    rows = seqlen_q * group_size
    m_mask = offs_m < rows
    i = offs_m // group_size
    off_h = off_hk * group_size + offs_m % group_size
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, BLOCK_DV)  # values and outputs: HEAD_DIM_V columns (MLA: fewer)
    dv_mask = offs_dv < HEAD_DIM_V
    q_ptrs = Q + off_b * stride_qb + (i.to(tl.int64) * stride_qn + off_h * stride_qh)[:, None] \
        + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if HAS_QV:
        qv = tl.load(QV + off_b * stride_qvb + (i.to(tl.int64) * stride_qvn
                                                + off_h * stride_qvh)[:, None] + offs_dv[None, :],
                     mask=m_mask[:, None] & dv_mask[None, :], other=0.0)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah, mask=m_mask, other=0.0)
    diag = i + (seqlen_k - seqlen_q)  # (BLOCK_M,) key aligned with each row
    if HAS_DESCALE:
        k_scale = tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh)
        v_scale = tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
        if not HAS_QV:  # with qv, each product takes its own scale in the loop
            qk_scale *= k_scale
            softmax_scale *= k_scale
    bias = Q  # attn_mask's row of each (query, head) pair (BIAS_KIND); never read without one
    if BIAS_KIND != 0:
        bias = BIAS + off_b * stride_bb + off_h[:, None].to(tl.int64) * stride_bh
    sparse = Q  # block_mask's row of each (query, head) pair (BLOCK_SPARSE); likewise
    row = SEQLENS_K  # the program's lists of blocks (BLOCK_SPARSE); likewise
    if BLOCK_SPARSE:
        sparse = SPARSE + off_b * stride_sb + off_h.to(tl.int64) * stride_sh \
            + (i // sparse_bq).to(tl.int64) * stride_sm
        row = LISTS + off_b * stride_listb + off_hk * stride_listh \
            + tl.program_id(2) * stride_listm

    # -- this split's keys: [split_lo, split_hi) of the keys the block's rows can see --
    first = start_m // group_size + (seqlen_k - seqlen_q)
    last = (tl.minimum(start_m + BLOCK_M, rows) - 1) // group_size + (seqlen_k - seqlen_q)
    hi = tl.where(window_right >= 0,
                  tl.minimum(tl.maximum(last + window_right + 1, 0), seqlen_k), seqlen_k)
    if BLOCK_SPARSE:  # keys past block_mask's last block are hidden
        hi = tl.minimum(hi, sparse_cols * sparse_bk)
    lo = tl.where(window_left >= 0, tl.maximum(first - window_left, 0), 0)
    lo = tl.minimum(tl.maximum(lo, leftpad), hi) // BLOCK_N * BLOCK_N
    # the loop's tiles: [lo, hi) in steps of BLOCK_N, or with BLOCK_SPARSE the positions of
    # its visible tiles in the program's list; each split an equal share of them
    span_lo, span_hi = _loop_span(lo, hi, row, BLOCK_N, sparse_bk, BLOCK_SPARSE)
    step = 1 if BLOCK_SPARSE else BLOCK_N
    per_split = tl.cdiv(tl.cdiv(span_hi - span_lo, step), num_splits) * step
    split_lo = span_lo + split * per_split
    split_hi = tl.minimum(split_lo + per_split, span_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for t in range(split_lo, split_hi, step):
        start_n = _loop_tile(t, row, sparse_cols, BLOCK_N, sparse_bk, BLOCK_SPARSE)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        tile_hi = hi
        if BLOCK_SPARSE:  # each row's bit of the tile's key block; no row's: nothing loaded
            seen = tl.load(sparse + start_n // sparse_bk * stride_sn, mask=m_mask, other=0) != 0
            tile_hi = tl.where(tl.max(seen.to(tl.int32), 0) > 0, hi, start_n)
        n_mask = offs_n < tile_hi
        # -- compute scores --
        if BIAS_KIND != 0:  # loaded first: then Triton keeps the softmax in the MMA layout
            b_ij = _bias(bias, i[:, None], offs_n[None, :], seqlen_q, mask_len, stride_bm,
                         stride_bn, BIAS_KIND)
        k = tl.load(_kv_ptrs(K_CACHE, BLOCK_TABLE, off_b, off_hk, offs_n, offs_d, n_mask,
                             page_size, stride_kb, stride_kn, stride_kh, stride_tb, PAGED),
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        if HAS_QV:  # the value tile serves both products
            v = tl.load(_kv_ptrs(V_CACHE, BLOCK_TABLE, off_b, off_hk, offs_n, offs_dv, n_mask,
                                 page_size, stride_vb, stride_vn, stride_vh, stride_tb, PAGED),
                        mask=n_mask[:, None] & dv_mask[None, :], other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        if HAS_QV and HAS_DESCALE:
            qk = qk * k_scale + tl.dot(qv, tl.trans(v), input_precision=INPUT_PRECISION) \
                * v_scale
        elif HAS_QV:
            qk = tl.dot(qv, tl.trans(v), qk, input_precision=INPUT_PRECISION)
        if HAS_SOFTCAP:
            s = _tanh(qk * (softmax_scale / softcap)) * (softcap * 1.4426950408889634)
        else:
            s = qk * qk_scale
        if HAS_ALIBI:
            distance = tl.abs(diag[:, None] - offs_n[None, :]).to(tl.float32)
            s = s - (slope[:, None] * 1.4426950408889634) * distance
        if BIAS_KIND != 0:
            s = s + b_ij
        visible = n_mask[None, :] & ((window_right < 0) | (offs_n[None, :] <= diag[:, None]
                                                            + window_right))
        visible = visible & ((window_left < 0) | (offs_n[None, :] >= diag[:, None]
                                                  - window_left))
        if HAS_LEFTPAD:
            visible = visible & (offs_n[None, :] >= leftpad)
        if BLOCK_SPARSE:
            visible = visible & seen[:, None]
        s = tl.where(visible, s, float("-inf"))
        # -- online softmax: new row max, rescale what was accumulated --
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update output accumulator --
        if not HAS_QV:
            v = tl.load(_kv_ptrs(V_CACHE, BLOCK_TABLE, off_b, off_hk, offs_n, offs_dv, n_mask,
                                 page_size, stride_vb, stride_vn, stride_vh, stride_tb, PAGED),
                        mask=n_mask[:, None] & dv_mask[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_ij

    # -- epilogue: normalize by this split's sum; no key seen gives o = 0, lse = -inf --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if HAS_DESCALE:
        acc = acc * v_scale
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    out_mask = m_mask[:, None] & dv_mask[None, :]
    if SPLIT:  # partials (num_splits, batch, nheads, seqlen_q, headdim_v), float32
        base = split.to(tl.int64) * stride_ps + off_b * stride_pb
        rows_p = off_h * stride_ph + i.to(tl.int64) * stride_pn
        tl.store(O_PARTIAL + base + rows_p[:, None] + offs_dv[None, :], acc, mask=out_mask)
        tl.store(LSE_PARTIAL + split.to(tl.int64) * stride_qs + off_b * stride_qsb
                 + off_h * stride_qsh + i, lse, mask=m_mask)
    else:
        rows_o = i.to(tl.int64) * stride_on + off_h * stride_oh
        tl.store(O + off_b * stride_ob + rows_o[:, None] + offs_dv[None, :],
                 acc.to(O.dtype.element_ty), mask=out_mask)
        tl.store(LSE + off_b * stride_lb + off_h * stride_lh + i, lse, mask=m_mask)


# ----------------------------------------------------------------------------- merge kernel

@triton.jit
def _merge_splits(O_PARTIAL, LSE_PARTIAL, O, LSE,
                  stride_ps, stride_pb, stride_ph, stride_pn, stride_qs, stride_qsb, stride_qsh,
                  stride_ob, stride_on, stride_oh, stride_lb, stride_lh,
                  nheads, num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """One program per (batch * nheads, query, BLOCK_D columns of the head dim): o and lse
    from the splits' partials, fp32 (every column block writes the same lse)."""
    off_bh = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_s = tl.load(LSE_PARTIAL + offs_s * stride_qs + off_b * stride_qsb + off_h * stride_qsh
                    + i, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse_s, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse_s - lse_max)
    sum_w = tl.sum(w, 0)
    sum_safe = tl.where(sum_w == 0.0, 1.0, sum_w)
    o_s = tl.load(O_PARTIAL + (offs_s * stride_ps + off_b * stride_pb + off_h * stride_ph
                               + i * stride_pn)[:, None] + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(w[:, None] * o_s, 0) / sum_safe
    tl.store(O + off_b * stride_ob + i * stride_on + off_h * stride_oh + offs_d,
             o.to(O.dtype.element_ty), mask=d_mask)
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + i,
             tl.where(sum_w == 0.0, float("-inf"), lse_max + tl.log(sum_safe)))


# ----------------------------------------------------------------------------- launcher

def _num_sms(device):
    if _INTERPRET or device.type != "cuda":
        return 4  # the interpreter: a pretend GPU, so that small tests split
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits_heuristic(programs, max_seqlen_k, block_n, num_sms, min_blocks_per_split=4):
    """Splits per sequence: enough programs for about two per SM, while each split keeps at
    least min_blocks_per_split key blocks (a split's fixed cost: loading q, writing a
    partial) and no more than MAX_SPLITS. One split once the grid already fills the GPU."""
    if programs >= num_sms:
        return 1
    n_blocks = _cdiv(max(max_seqlen_k, 1), block_n)
    by_sms = _cdiv(2 * num_sms, programs)
    by_length = max(1, n_blocks // min_blocks_per_split)
    return max(1, min(by_sms, by_length, MAX_SPLITS))


def _cdiv(a, b):  # triton.cdiv's host-side call costs microseconds: this is on every step
    return -(-a // b)


def _block_d(headdim):
    return max(16, triton.next_power_of_2(headdim))


@functools.lru_cache(maxsize=None)  # read-only Configs, looked up on every decoding step
def launch_config(seqlen_q, group, headdim, headdim_v=None, masked=False, qv=False,
                  block_size_k=None):
    """The split kernel's tile sizes and launch options: BLOCK_M (packed rows: at least 16,
    the smallest tl.dot), BLOCK_N, BLOCK_D, BLOCK_DV (values' head dim, default headdim's);
    masked: with an attn_mask (its tile of scores' bias); qv: with MLA's absorbed queries (a
    (BLOCK_M, BLOCK_DV) tile of them held through the loop); block_size_k: a block_mask's key
    blocks, which BLOCK_N divides (a tile inside one block). One place for forward() and
    experiments.codegen."""
    block_m = min(64, max(16, triton.next_power_of_2(seqlen_q * group)))
    block_d, block_dv = _block_d(headdim), _block_d(headdim_v or headdim)
    block_n = 16 if _INTERPRET else (128 if max(block_d, block_dv) <= 64 else 64)
    warps = 4
    # 64 packed rows (many queries a KV head: speculative decoding, a shared prefix's call)
    # spilled on sm_90a with Triton 3.6 at head dim 256 (120-200 B) and with a mask (52-512 B
    # at every head dim); 8 warps, and with a mask half the keys a tile, compile spill-free
    # (results/codegen/, config 64/...)
    if block_m == 64 and (masked or qv or max(block_d, block_dv) > 128):
        warps = 8
    if block_m == 64 and masked and not _INTERPRET:
        block_n = 64 if max(block_d, block_dv) <= 128 else 32
    # MLA's 512-dim latents (with qv, its tile too): 64 rows spilled on sm_90a with Triton 3.6
    # at every tile and warp count tried (68-4200 B); 32 rows of 32 keys in 8 warps, 3 stages:
    # 176 registers, 110 KiB of shared memory, no spill (experiments/codegen.py, flags mla)
    if block_dv > 256:
        block_m, warps = min(block_m, 32), 8
        block_n = 16 if _INTERPRET else 32
    if block_size_k:
        block_n = math.gcd(block_n, block_size_k)
    return triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                              BLOCK_DV=block_dv), num_warps=warps,
                         num_stages=1 if _INTERPRET else 3)


@functools.lru_cache(maxsize=None)
def append_config(headdim, headdim_v=None):
    """The append kernel's launch: a program writes one row of headdim (and of headdim_v,
    default headdim, for the value), with one warp."""
    return triton.Config(dict(BLOCK_D=_block_d(headdim), BLOCK_DV=_block_d(headdim_v or headdim)),
                         num_warps=1)


@functools.lru_cache(maxsize=None)
def merge_config(num_splits, headdim):
    """The merge kernel's launch: all splits of a row in one tile, (BLOCK_S, BLOCK_D) at most
    8192 partial outputs (64 registers a thread in 4 warps), the head dim in column blocks
    of BLOCK_D (at 128 splits and MLA's 512 dims, 8 programs a row of 64 columns)."""
    block_s = max(2, triton.next_power_of_2(num_splits))
    block_d = max(16, min(_block_d(headdim), 8192 // block_s))
    return triton.Config(dict(BLOCK_S=block_s, BLOCK_D=block_d), num_warps=4)


def _bias_args(mask):
    """attn_mask, a (batch, nheads, seqlen_q, L) view indexed by key position, as _fwd_splitkv
    reads it: a boolean mask as uint8; L = 1 is read at stride 0 for every key."""
    bias = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    length = bias.shape[-1]
    return dict(BIAS_KIND=2 if mask.dtype == torch.bool else 1, BIAS=bias,
                stride_bb=bias.stride(0), stride_bh=bias.stride(1), stride_bm=bias.stride(2),
                stride_bn=bias.stride(3) if length > 1 else 0,
                mask_len=length if length > 1 else 2**31 - 1)


def _sparse_args(opts, batch, nheads, nheads_kv, seqlen_q, block_m, block_n):
    """block_mask (batch or 1, nheads or 1, query blocks, key blocks) as _fwd_splitkv reads
    it: as uint8, through the strides of a (batch, nheads, ...) view (broadcast dimensions at
    stride 0), and its programs' lists of blocks (_common.group_block_lists, made once per
    mask and tiling: flash_triton._cached_lists), a (batch, nheads_kv, programs, ...) view."""
    assert opts.block_size_k % block_n == 0, (opts.block_size_k, block_n)  # tile in one block
    mask, group = opts.block_mask, nheads // nheads_kv
    bits = mask.view(torch.uint8).expand(batch, nheads, *mask.shape[2:])
    lists = _cached_lists(mask, ("decode", group, seqlen_q, block_m, opts.block_size_q),
                          lambda: group_block_lists(mask, group, seqlen_q, block_m,
                                                    opts.block_size_q))
    lists = lists.expand(batch, nheads_kv, *lists.shape[2:])
    return dict(BLOCK_SPARSE=True, SPARSE=bits, stride_sb=bits.stride(0),
                stride_sh=bits.stride(1), stride_sm=bits.stride(2), stride_sn=bits.stride(3),
                sparse_cols=bits.shape[3], sparse_bq=opts.block_size_q,
                sparse_bk=opts.block_size_k, LISTS=lists, stride_listb=lists.stride(0),
                stride_listh=lists.stride(1), stride_listm=lists.stride(2))


_FITTED = {}  # (device, launch_config's tiles, warps, stages) -> a smaller config that fits


def _fitted_key(cfg):
    k = cfg.kwargs
    return (torch.cuda.current_device() if torch.cuda.is_available() else 0, k["BLOCK_M"],
            k["BLOCK_N"], k["BLOCK_D"], k["BLOCK_DV"], cfg.num_warps, cfg.num_stages)


def _launch_fitted(kernel, grid, cfg, *args, **kwargs):
    """kernel[grid](*args, **kwargs) with cfg's tiles and launch options, or, where the
    compiled kernel needs more shared memory than the GPU has (Triton's OutOfResources at its
    first launch, before anything runs: on GPUs of 99 KB a block, sm_86/89/120, at head dim
    256, 141 KB with 3 stages, and MLA's 512-dim latents, 110 KB), with cfg a pipeline stage
    fewer, then half the keys a tile (flash_triton.smaller_config; BLOCK_M, the grid's,
    kept), until it fits; the config that fits is kept per device and config (looked up
    only once one was needed: no host time where every config fits)."""
    from triton.runtime.errors import OutOfResources
    key = None
    if _FITTED:
        key = _fitted_key(cfg)
        cfg = _FITTED.get(key, cfg)
    while True:
        try:
            return kernel[grid](*args, **kwargs, **cfg.kwargs, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
        except OutOfResources:
            key = key or _fitted_key(cfg)
            cfg = smaller_config(cfg, rows_fixed=True)
            if cfg is None:
                raise
            _FITTED[key] = cfg


def check_cache(k_cache, v_cache):
    """What the Triton backend needs of a cache beyond kvcache's checks."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"k_cache and v_cache must have a contiguous last dimension (headdim) on "
                         f"the Triton backend, got strides {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    check_fp8(k_cache)


@functools.lru_cache(maxsize=None)
def _fp8_format(dtype):
    """A float8 cache's format for the append kernel's rounding (_quantized)."""
    info = torch.finfo(dtype)
    return dict(FP8=True, FP8_MANT=round(-math.log2(info.eps)),
                FP8_EMIN=round(math.log2(info.tiny)), FP8_MAX=float(info.max))


@on_tensor_device
def append(q, k, v, k_cache, v_cache, seqlens, block_table, rotary_cos=None, rotary_sin=None,
           rotary_interleaved=True, q_in_order=False, k_descale=None, v_descale=None):
    """kvcache's _rotate, quantize and _append in one launch: k and v (batch, seqlen_new,
    nheads_kv, headdim) written into the cache in place at positions seqlens[b] + t (seqlens:
    an int, or the (batch,) lengths before the append), k rotated first if rotary_cos is
    given, both quantized by k_descale and v_descale into a float8 cache; returns q, rotated
    into a new tensor if rotary_cos is given. Arguments checked by the caller."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    batch, seqlen_new, nheads_kv, headdim = k.shape
    headdim_v = v.shape[-1]
    rotary = rotary_cos is not None
    nheads = q.shape[2]
    rows = seqlen_new * nheads_kv + (q.shape[1] * nheads if rotary else 0)
    if batch == 0 or rows == 0:
        return q
    q_rot = torch.empty_like(q, memory_format=torch.contiguous_format) if rotary else q
    cos, sin = (rotary_cos, rotary_sin) if rotary else (q, q)  # unread pointers without
    if rotary and (cos.stride(1) != 1 or sin.stride() != cos.stride()):
        cos, sin = cos.contiguous(), sin.contiguous()
    uniform = not isinstance(seqlens, torch.Tensor)
    paged = block_table is not None
    cfg = append_config(headdim, headdim_v)
    fp8 = {}
    if k_cache.dtype in FP8_DTYPES:
        fp8 = dict(**_fp8_format(k_cache.dtype), **_descale_args(k_descale, v_descale, q.device))
    _append_rotary[(rows, batch)](
        q, q_rot, k, v, k_cache, v_cache, block_table if paged else k,
        k if uniform else seqlens, cos, sin,
        *q.stride()[:3], *q_rot.stride()[:3], *k.stride()[:3], *v.stride()[:3],
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0) if paged else 0,
        cos.stride(0) if rotary else 0, nheads, nheads_kv, seqlen_new,
        seqlens if uniform else 0, k_cache.shape[1] if paged else 0,
        2 * cos.shape[1] if rotary else 0,
        UNIFORM_SEQLEN=uniform, PAGED=paged, ROTARY=rotary, INTERLEAVED=rotary_interleaved,
        Q_IN_ORDER=q_in_order, HEAD_DIM=headdim, HEAD_DIM_V=headdim_v, **fp8, **cfg.kwargs,
        num_warps=cfg.num_warps)
    return q_rot


@on_tensor_device
def forward(q, k_cache, v_cache, seqlens_k, block_table, opts, num_splits=0, max_seqlen_k=None,
            leftpad_k=None, qv=None):
    """o like q (v_cache's head dim) and lse (batch, nheads, seqlen_q), float32; seqlens_k
    (batch,) after the append, or an int when every sequence has that many keys (a kernel
    argument: no tensor to fill, no fill kernel in a decoding step). max_seqlen_k:
    max(seqlens_k) as an int, for the split heuristic (num_splits 0) without a device-to-host
    read; None: read from seqlens_k (a synchronization; under torch.compile, kvcache passes
    the cache's capacity instead).
    leftpad_k: (batch,) integer tensor or None: sequence b's keys are [leftpad_k[b],
    seqlens_k[b]), positions counted from the start of the cache. qv: None, or (batch,
    seqlen_q, nheads, headdim_v), MLA's absorbed queries (kvcache.forward's)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv, headdim_v = k_cache.shape[2], v_cache.shape[3]
    group = nheads // nheads_kv
    o, lse = empty_outputs(q, headdim_v=headdim_v)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    check_cache(k_cache, v_cache)
    cfg = launch_config(seqlen_q, group, headdim, headdim_v, opts.attn_mask is not None,
                        qv is not None, opts.block_mask is not None and opts.block_size_k)
    block_m, block_n = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
    m_blocks = _cdiv(seqlen_q * group, block_m)
    uniform = not isinstance(seqlens_k, torch.Tensor)  # an int
    if uniform:
        seqlen_k_all = max_seqlen_k = seqlens_k
        seqlens_k = lse  # an unread pointer
    else:
        seqlen_k_all, seqlens_k = 0, seqlens_k.to(device=q.device, dtype=torch.int32)
    if num_splits == 0:
        if max_seqlen_k is None:
            max_seqlen_k = int(seqlens_k.max())
        num_splits = num_splits_heuristic(batch * nheads_kv * m_blocks, max_seqlen_k, block_n,
                                          _num_sms(q.device))
    split = num_splits > 1
    if split:
        o_partial = q.new_empty((num_splits, batch, nheads, seqlen_q, headdim_v),
                                dtype=torch.float32)
        lse_partial = q.new_empty((num_splits, batch, nheads, seqlen_q), dtype=torch.float32)
    else:
        o_partial = lse_partial = lse  # unused pointers
    alibi = opts.alibi_slopes
    if leftpad_k is not None:
        leftpad_k = leftpad_k.to(device=q.device, dtype=torch.int32)
    paged = block_table is not None
    page_size = k_cache.shape[1] if paged else 0
    optional = {} if opts.attn_mask is None else _bias_args(opts.attn_mask)
    if opts.k_descale is not None or opts.v_descale is not None:
        optional.update(HAS_DESCALE=True, **_descale_args(opts.k_descale, opts.v_descale, q.device))
    if qv is not None:
        qv = qv if qv.stride(-1) == 1 else qv.contiguous()
        optional.update(HAS_QV=True, QV=qv, stride_qvb=qv.stride(0), stride_qvn=qv.stride(1),
                        stride_qvh=qv.stride(2))
    if opts.block_mask is not None:
        optional.update(_sparse_args(opts, batch, nheads, nheads_kv, seqlen_q, block_m,
                                     block_n))
    _launch_fitted(
        _fwd_splitkv, (num_splits, batch * nheads_kv, m_blocks), cfg, q, k_cache, v_cache,
        block_table if paged else seqlens_k, seqlens_k,
        seqlens_k if leftpad_k is None else leftpad_k, lse if alibi is None else alibi, o, lse,
        o_partial, lse_partial,
        *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_table.stride(0) if paged else 0, *o.stride()[:3], *lse.stride()[:2],
        0 if alibi is None else alibi.stride(0), 0 if alibi is None else alibi.stride(1),
        *(o_partial.stride()[:4] if split else (0, 0, 0, 0)),
        *(lse_partial.stride()[:3] if split else (0, 0, 0)),
        nheads_kv, group, seqlen_q, seqlen_k_all, num_splits, page_size, opts.window_left,
        opts.window_right, opts.softmax_scale * LOG2E, opts.softmax_scale, opts.softcap,
        UNIFORM_SEQLEN=uniform, PAGED=paged, SPLIT=split, HAS_LEFTPAD=leftpad_k is not None,
        HAS_SOFTCAP=opts.softcap > 0,
        HAS_ALIBI=alibi is not None, HEAD_DIM=headdim, HEAD_DIM_V=headdim_v,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **optional)
    if split:
        merge = merge_config(num_splits, headdim_v)
        _merge_splits[(batch * nheads, seqlen_q, _cdiv(headdim_v, merge.kwargs["BLOCK_D"]))](
            o_partial, lse_partial, o, lse, *o_partial.stride()[:4], *lse_partial.stride()[:3],
            *o.stride()[:3], *lse.stride()[:2], nheads, num_splits, HEAD_DIM=headdim_v,
            **merge.kwargs, num_warps=merge.num_warps)
    return o, lse
