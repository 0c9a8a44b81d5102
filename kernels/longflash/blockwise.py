"""Blockwise exact attention in PyTorch: the Triton kernel's algorithm in PyTorch ops.

This is the CPU path of LongFlash (and a readable statement of the kernel). It
computes exactly softmax(scores) v without forming the (seqlen_q, seqlen_k)
matrix: a query block of BLOCK_M rows walks over the key blocks of BLOCK_N
columns, keeping a running row maximum m_i, a running sum l_i and an
unnormalized accumulator acc (online softmax, Milakov & Gimelshein 2018; Dao et
al. 2022, Algorithm 1). The log-sum-exp of each row is saved, so the backward
pass recomputes each block of probabilities instead of storing them (Dao 2023,
Algorithm 2). Extra memory is O(BLOCK_M * BLOCK_N) per batch and head on top of
the O(seqlen) inputs, outputs and gradients.

Scores, in FlashAttention-2's order: s = q k^T * softmax_scale; with softcap,
s = softcap * tanh(s / softcap); with ALiBi, s -= slope * |i + seqlen_k - seqlen_q - j|;
with an attn_mask (PyTorch's), s += mask, or -inf where a boolean mask is False; then the
window / causal mask. Dropout multiplies the probabilities by keep / (1 - p)
after the softmax (the lse is of the undropped row), with the keep mask drawn from
a counter-based generator (`_common.dropout_uniform`), so the backward pass
regenerates it tile by tile.

Variable names, block ranges and the order of operations follow
`flash_triton.py`; the kernel runs one (query block, batch * head) program per
grid cell, here batch and heads are batched tensor dimensions and the block
loops run in Python. One difference: the backward is one pass over the key
blocks that also adds each tile's dQ (FlashAttention-2's Algorithm 2), where the
kernel gives dQ a pass of its own so that its programs need no atomic adds.
GQA: query head h reads key/value head h // (nheads // nheads_kv); tensors are
viewed as (batch, nheads_kv, group, seqlen, headdim) so that keys and values
broadcast over the group without being copied. Packed
variable-length batches run sequence by sequence, so no padding is computed; paged keys
(opts.block_table) are read one sequence at a time through the block table, where the
kernel reads each key block's rows through it; float8 pages' tiles are converted as they are
read, their scales (opts.k_descale, opts.v_descale) applied to the scores and the output.

Autograd is registered once for all implementations in `interface.py`; these
functions take and return plain tensors.
"""

import math

import torch

from ._common import (LN2, LOG2E, accumulator_dtype, block_mask_elements, dropout_uniform,
                      empty_like, empty_outputs, key_range, paged_rows, query_range, visible)

# Larger tiles than on a GPU: on a CPU each tile is a batched matmul and the
# Python loop overhead is paid per tile. 256 x 256 rather than 128 x 256: 12-23% faster on
# a 2-core AMD EPYC (1 thread) at 1-2 (batch x heads), about the same at 16-64 forward and
# backward; larger tiles gained more at 1-2 and lost at 64 (PERFLOG).
BLOCK_M = 256
BLOCK_N = 256


def _grouped(x, nheads_kv):
    """(batch, seqlen, nheads, headdim) -> view (batch, nheads_kv, group, seqlen, headdim)."""
    return x.unflatten(2, (nheads_kv, -1)).permute(0, 2, 3, 1, 4)


def _group_mm(a, b):
    """a (B, Hkv, G, M, K) @ b (B, Hkv, 1, K, N) -> (B, Hkv, G, M, N): the G query heads of a
    KV head folded into the rows of one matmul (a broadcast matmul copies b for each of them,
    which costs more than the product itself when M is small: decoding, a few queries)."""
    batch, nheads_kv, group, m, k = a.shape
    return (a.reshape(batch, nheads_kv, group * m, k) @ b[:, :, 0]).view(
        batch, nheads_kv, group, m, b.shape[-1])


def _group_mm_t(a, b):
    """sum over the group of a^T @ b: a (B, Hkv, G, M, N), b (B, Hkv, G, M, D) -> (B, Hkv, N, D),
    one matmul over the group's G * M rows (the gradient of a KV head's keys or values)."""
    return a.flatten(2, 3).transpose(-1, -2) @ b.flatten(2, 3)


class _Tile:
    """Index vectors and per-head constants of one (query block, key block) tile."""

    def __init__(self, start_m, size_m, start_n, size_n, seqlen_q, seqlen_k, batch_start, slopes,
                 bias, device, sparse=None):
        self.i = torch.arange(start_m, start_m + size_m, device=device)[:, None]
        self.j = torch.arange(start_n, start_n + size_n, device=device)[None, :]
        self.seqlen_q, self.seqlen_k, self.batch_start, self.slopes = (
            seqlen_q, seqlen_k, batch_start, slopes)
        # attn_mask's tile (B, Hkv, G, BM, BN), a view, or None
        self.bias = None if bias is None else \
            bias[..., start_m:start_m + size_m, start_n:start_n + size_n]
        # block_mask's share of the tile: skip (False for every batch row and head: nothing to
        # compute, as the kernels skip it), or blocks, the (B, Hkv, G, BM, BN) keys it hides
        # (None: none): where the tile spans blocks (tiles given by the caller), or its block
        # is kept for some batch rows or heads of the batched tile and not for others
        self.skip, self.blocks = False, None
        if sparse is not None:
            blocks, bq, bk = sparse  # (B, Hkv, G, query blocks, key blocks)
            first_m, first_n = start_m // bq, start_n // bk
            bits = blocks[..., first_m:-(-(start_m + size_m) // bq),
                          first_n:-(-(start_n + size_n) // bk)]
            self.skip = not bool(bits.any())
            if not self.skip and not bool(bits.all()):  # (B, Hkv, G, 1, 1): one block, broadcast
                self.blocks = bits if bits.shape[-2:] == (1, 1) else block_mask_elements(
                    bits, bq, bk, size_m, size_n, start_m - first_m * bq, start_n - first_n * bk)


def _scores(q_i, k_j, tile, opts, masked):
    """One tile of scores in log2 units (B, Hkv, G, BM, BN), and tanh(s / softcap) for the
    softcap gradient (None without softcap). attn_mask after ALiBi: a boolean one hides the
    keys where it is False, a float one is added."""
    s = _group_mm(q_i, k_j.transpose(-1, -2))
    if opts.softcap == 0 and tile.slopes is None and tile.bias is None:
        # the kernel's qk_scale: the scale and log2(e) in one pass, in place (on a CPU each
        # pass over a tile costs about as much as a small matmul)
        s.mul_(opts.softmax_scale * LOG2E)
        if masked:
            s.masked_fill_(~visible(tile.i, tile.j, tile.seqlen_q, tile.seqlen_k,
                                    opts.window_left, opts.window_right), float("-inf"))
        if tile.blocks is not None:
            s.masked_fill_(~tile.blocks, float("-inf"))
        return s, None
    s = s * opts.softmax_scale
    t = None
    if opts.softcap > 0:
        t = torch.tanh(s / opts.softcap)
        s = opts.softcap * t
    if tile.slopes is not None:  # (B, Hkv, G)
        distance = (tile.i + (tile.seqlen_k - tile.seqlen_q) - tile.j).abs()
        s = s - tile.slopes[..., None, None] * distance
    if tile.bias is not None:
        s = (s.masked_fill(~tile.bias, float("-inf")) if tile.bias.dtype == torch.bool
             else s + tile.bias.to(s.dtype))
    if masked:
        mask = visible(tile.i, tile.j, tile.seqlen_q, tile.seqlen_k, opts.window_left,
                       opts.window_right)
        s = s.masked_fill(~mask, float("-inf"))
    if tile.blocks is not None:
        s = s.masked_fill(~tile.blocks, float("-inf"))
    return s * LOG2E, t


def _dropout_scale(p, tile, opts):
    """keep / (1 - dropout_p) for the tile, broadcast like p (B, Hkv, G, BM, BN)."""
    batch, nheads_kv, group = p.shape[:3]
    nheads = nheads_kv * group
    b = torch.arange(tile.batch_start, tile.batch_start + batch, device=p.device)
    h = torch.arange(nheads, device=p.device).view(nheads_kv, group)
    bh = (b[:, None, None] * nheads + h)[..., None, None]  # (B, Hkv, G, 1, 1)
    keep = dropout_uniform(opts.seed, bh, tile.i + opts.dropout_row0,
                           tile.j + opts.dropout_col0) >= opts.dropout_p
    return keep.to(p.dtype) / (1.0 - opts.dropout_p)


def _attn_fwd_inner(acc, l_i, m_i, q_i, k, v, start_m, lo, hi, masked, opts, ctx):
    dtype = acc.dtype
    for start_n in range(lo, hi, ctx["block_n"]):
        size_n = min(ctx["block_n"], k.shape[-2] - start_n)
        tile = _Tile(start_m, q_i.shape[-2], start_n, size_n, *ctx["tile_args"])
        if tile.skip:  # block_mask hides it whole
            continue
        k_j = k[..., start_n:start_n + ctx["block_n"], :].to(dtype)  # (B, Hkv, 1, BN, D)
        v_j = v[..., start_n:start_n + ctx["block_n"], :].to(dtype)
        # -- compute scores --
        qk, _ = _scores(q_i, k_j, tile, opts, masked)
        # -- online softmax: new row max, rescale what was accumulated --
        m_ij = torch.maximum(m_i, qk.amax(-1))
        m_safe = torch.where(m_ij == float("-inf"), 0.0, m_ij)  # rows that saw no key yet
        p = qk.sub_(m_safe[..., None]).exp2_()  # in place: qk is this tile's own
        alpha = torch.exp2(m_i - m_safe)
        l_i = l_i * alpha + p.sum(-1)
        if opts.dropout_p > 0:
            p = p * _dropout_scale(p, tile, opts)
        acc = acc.mul_(alpha[..., None]).add_(_group_mm(p, v_j))
        m_i = m_ij
    return acc, l_i, m_i


def _context(q, k, opts, batch_start, block_m, block_n):
    batch, seqlen_q, nheads = q.shape[:3]
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    slopes = bias = sparse = None
    if opts.alibi_slopes is not None:  # (batch, nheads) -> (B, Hkv, G) for this slice
        slopes = opts.alibi_slopes[batch_start:batch_start + q.shape[0]]
        slopes = slopes.unflatten(1, (nheads_kv, -1)).to(accumulator_dtype(q.dtype))
    if opts.attn_mask is not None:  # -> (B, Hkv, G, Nq, Nk), a view (padded batches only)
        bias = opts.attn_mask.expand(batch, nheads, seqlen_q, seqlen_k)
        bias = bias.unflatten(1, (nheads_kv, -1))
    block_m, block_n = block_m or BLOCK_M, block_n or BLOCK_N
    if opts.block_mask is not None:  # -> (B, Hkv, G, query blocks, key blocks), this slice's
        blocks = opts.block_mask
        if blocks.shape[0] > 1:  # a packed sequence's row, or every row of a padded batch
            blocks = blocks[batch_start:batch_start + batch]
        blocks = blocks.expand(batch, nheads, *blocks.shape[2:]).unflatten(1, (nheads_kv, -1))
        sparse = (blocks, opts.block_size_q, opts.block_size_k)
        # tiles that divide the blocks (128 x 128 for blocks of 128), as the kernels' do: each
        # then lies inside one block, computed or skipped whole
        block_m, block_n = math.gcd(block_m, opts.block_size_q), math.gcd(block_n,
                                                                           opts.block_size_k)
    return dict(block_m=block_m, block_n=block_n,
                tile_args=(seqlen_q, seqlen_k, batch_start, slopes, bias, q.device, sparse))


def _forward_dense(q, k, v, opts, o, lse, batch_start=0, block_m=None, block_n=None):
    """Writes o (B, Nq, H, Dv) and lse (B, H, Nq) for one padded-free batch."""
    seqlen_q, seqlen_k, nheads_kv = q.shape[1], k.shape[1], k.shape[2]
    dtype = accumulator_dtype(q.dtype)
    ctx = _context(q, k, opts, batch_start, block_m, block_n)
    block_m, block_n = ctx["block_m"], ctx["block_n"]
    q5, o5 = _grouped(q, nheads_kv), _grouped(o, nheads_kv)  # (B, Hkv, G, Nq, D)
    k5, v5 = _grouped(k, nheads_kv), _grouped(v, nheads_kv)  # (B, Hkv, 1, Nk, D)
    lse4 = lse.unflatten(1, (nheads_kv, -1))  # (B, Hkv, G, Nq)
    window = (opts.window_left, opts.window_right)
    # float8 pages' scales, (B, Hkv, 1, 1, 1): the keys' folds into the softmax scale, the
    # values' into the output (their tiles convert to dtype exactly in _attn_fwd_inner)
    k_scale, v_scale = (None if x is None else
                        x[batch_start:batch_start + q.shape[0], :, None, None, None].to(dtype)
                        for x in (opts.k_descale, opts.v_descale))
    if k_scale is not None:
        opts = opts._replace(softmax_scale=k_scale * opts.softmax_scale)
    for start_m in range(0, seqlen_q, block_m):
        q_i = q5[..., start_m:start_m + block_m, :].to(dtype)
        m_i = q_i.new_full(q_i.shape[:-1], float("-inf"))
        l_i = q_i.new_zeros(q_i.shape[:-1])
        acc = q_i.new_zeros(q_i.shape[:-1] + v.shape[-1:])  # (B, Hkv, G, BM, Dv)
        lo, mid_lo, mid_hi, hi = key_range(start_m, block_m, block_n, seqlen_q, seqlen_k, *window)
        for a, b, masked in ((lo, mid_lo, True), (mid_lo, mid_hi, False), (mid_hi, hi, True)):
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q_i, k5, v5, start_m, a, b, masked,
                                            opts, ctx)
        # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
        l_safe = torch.where(l_i == 0, 1.0, l_i)
        acc = acc / l_safe[..., None]
        o5[..., start_m:start_m + block_m, :] = acc if v_scale is None else acc * v_scale
        lse4[..., start_m:start_m + block_m] = torch.where(
            l_i == 0, float("-inf"), (m_i + torch.log2(l_safe)) * LN2)


def _sequences(opts):
    """(b, q rows, k rows) of each packed sequence."""
    cu_q, cu_k = opts.cu_seqlens_q.tolist(), opts.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        yield b, slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def _keys(x, b, cols, opts):
    """Sequence b's keys (or values) (1, n, Hkv, D): rows cols of the packed x, or, with
    opts.block_table, its n keys read from the pages of x (a copy of this sequence's only)."""
    if opts.block_table is None:
        return x[None, cols]
    pos = torch.arange(cols.stop - cols.start, device=x.device)
    return paged_rows(x, opts.block_table, b, pos)[None]


@torch.no_grad()
def forward(q, k, v, opts, block_m=None, block_n=None):
    """o like q (v's head dim); lse (batch, nheads, seqlen_q), or (nheads, total_q) for packed
    sequences, natural log."""
    o, lse = empty_outputs(q, opts.varlen, v.shape[-1])
    if not opts.varlen:
        _forward_dense(q, k, v, opts, o, lse, 0, block_m, block_n)
        return o, lse
    for b, rows, cols in _sequences(opts):  # (total, H, D) slices -> (1, n, H, D)
        lse_b = lse.new_empty((1, q.shape[1], rows.stop - rows.start))
        _forward_dense(q[None, rows], _keys(k, b, cols, opts), _keys(v, b, cols, opts), opts,
                       o[None, rows], lse_b, b, block_m, block_n)
        lse[:, rows] = lse_b[0]
    return o, lse


def _probs(q_i, k_j, lse2_i, tile, opts, masked):
    """Recompute one block of probabilities p = exp(s - lse) from the saved lse."""
    qk, t = _scores(q_i, k_j, tile, opts, masked)
    return qk.sub_(lse2_i[..., None]).exp2_(), t  # in place: qk is this tile's own


def _grad_scores(p, dp, delta_i, t, tile, opts):
    """dL/d(q k^T): dS = p * (dP - delta) through dropout, softcap and the scale; and dL/ds,
    the scores' gradient before softcap and the scale (an attn_mask's)."""
    if opts.dropout_p > 0:
        dp = dp * _dropout_scale(p, tile, opts)
    ds = dp.sub_(delta_i[..., None]).mul_(p)  # in place: dp is the caller's fresh product
    ds_qk = ds * (1 - t * t) if t is not None else ds  # d softcap * tanh(s / softcap) / ds
    return ds_qk * opts.softmax_scale, ds


def _backward_dense(do, q, k, v, o, lse, dlse, opts, dq, dk, dv, batch_start=0, block_m=None,
                    block_n=None):
    seqlen_q, seqlen_k, nheads_kv = q.shape[1], k.shape[1], k.shape[2]
    dtype = accumulator_dtype(q.dtype)
    ctx = _context(q, k, opts, batch_start, block_m, block_n)
    block_m, block_n = ctx["block_m"], ctx["block_n"]
    window = (opts.window_left, opts.window_right)
    # -- preprocess: delta = rowsum(do * o); a gradient of lse enters as -dlse --
    delta = (do.to(dtype) * o.to(dtype)).sum(-1).transpose(1, 2)  # (B, H, Nq)
    if dlse is not None:
        delta = delta - dlse
    # lse = -inf marks a row that saw no key; +inf makes its probabilities exactly 0.
    lse2 = torch.where(lse == float("-inf"), float("inf"), lse) * LOG2E
    q5, do5 = _grouped(q, nheads_kv), _grouped(do, nheads_kv)
    k5, v5 = _grouped(k, nheads_kv), _grouped(v, nheads_kv)
    lse2, delta = lse2.unflatten(1, (nheads_kv, -1)), delta.unflatten(1, (nheads_kv, -1))
    dq5 = _grouped(dq, nheads_kv)
    dmask5 = None if opts.attn_mask_grad is None else \
        opts.attn_mask_grad.unflatten(1, (nheads_kv, -1))  # (B, Hkv, G, Nq, Nk)
    dk4, dv4 = dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)  # (B, Hkv, Nk, D)

    # -- one pass over the key blocks (FlashAttention-2's Algorithm 2): dK, dV of a key block
    # over the query blocks that see it, and each tile's share of dQ added to its rows. The
    # kernel gives dQ a pass of its own (programs in parallel would need atomic adds); here
    # the tiles run one after another, and one pass saves recomputing every tile's
    # probabilities and dP a second time: five matmuls a tile, not seven. --
    dq_acc = torch.zeros(q5.shape, dtype=dtype, device=q.device)  # (B, Hkv, G, Nq, D)
    for start_n in range(0, seqlen_k, block_n):
        cols = slice(start_n, start_n + block_n)
        k_j, v_j = k5[..., cols, :].to(dtype), v5[..., cols, :].to(dtype)
        dk_j = k_j.new_zeros(k_j.shape[:2] + k_j.shape[3:])  # (B, Hkv, BN, D)
        dv_j = v_j.new_zeros(v_j.shape[:2] + v_j.shape[3:])  # (B, Hkv, BN, Dv)
        lo, mid_lo, mid_hi, hi = query_range(start_n, block_m, block_n, seqlen_q, seqlen_k,
                                             *window)
        for start_m in range(lo, hi, block_m):
            rows = slice(start_m, start_m + block_m)
            tile = _Tile(start_m, min(block_m, seqlen_q - start_m), start_n, k_j.shape[-2],
                         *ctx["tile_args"])
            if tile.skip:  # block_mask hides it whole
                continue
            q_i, do_i = q5[..., rows, :].to(dtype), do5[..., rows, :].to(dtype)
            masked = not mid_lo <= start_m < mid_hi
            p, t = _probs(q_i, k_j, lse2[..., rows], tile, opts, masked)
            p_kept = p * _dropout_scale(p, tile, opts) if opts.dropout_p > 0 else p
            dv_j += _group_mm_t(p_kept, do_i)  # summed over the group's heads
            ds, ds_scores = _grad_scores(p, _group_mm(do_i, v_j.transpose(-1, -2)),
                                         delta[..., rows], t, tile, opts)
            dk_j += _group_mm_t(ds, q_i)
            dq_acc[..., rows, :] += _group_mm(ds, k_j)
            if dmask5 is not None:  # the mask's gradient: each tile's, written once
                dmask5[..., rows, cols] = ds_scores
        dk4[:, :, cols] = dk_j
        dv4[:, :, cols] = dv_j
    dq5.copy_(dq_acc)


@torch.no_grad()
def backward(do, q, k, v, o, lse, dlse, opts, block_m=None, block_n=None):
    """Gradients (dq, dk, dv) of sum(o * do) + sum(lse * dlse); dlse may be None."""
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    if not opts.varlen:
        _backward_dense(do, q, k, v, o, lse, dlse, opts, dq, dk, dv, 0, block_m, block_n)
        return dq, dk, dv
    for b, rows, cols in _sequences(opts):
        lse_b = lse[None, :, rows]
        dlse_b = None if dlse is None else dlse[None, :, rows]
        _backward_dense(do[None, rows], q[None, rows], k[None, cols], v[None, cols], o[None, rows],
                        lse_b, dlse_b, opts, dq[None, rows], dk[None, cols], dv[None, cols], b,
                        block_m, block_n)
    return dq, dk, dv
