"""Decoding over a KV cache: `attention_with_kvcache`, FlashAttention-2's
`flash_attn_with_kvcache` semantics (in-place append, paged caches, GQA).

Algorithm (split-KV, "Flash-Decoding", Dao, Haziza, Massa, Sizov 2023): a decoding step has
one (or a few) query rows per sequence, so parallelism over queries is gone. The keys of each
sequence are split into `num_splits` contiguous ranges; each split runs the online softmax of
FlashAttention over its range and leaves a partial output o_s (normalized by its own sum) and
its log-sum-exp lse_s; a merge combines them exactly, in float32:

    lse = log(sum_s exp(lse_s)),    o = sum_s exp(lse_s - lse) * o_s

GQA packing: the `group = nheads // nheads_kv` query heads that share a KV head are the rows
of one tile (row r = i * group + g for query i and head g of the group), so one read of a key
block serves the whole group and the tile's rows are used even when seqlen_q = 1.

MLA's absorbed form (qv, FlashAttention-3's argument): each score adds qv v^T from the value
block already read, so a cache of latents (v) and their rotary part (k) is attended without a
second copy of the latents.

This module holds the public function (validation; the in-place append and rotary embedding,
in PyTorch ops or, on the Triton backend, decode_triton's append kernel) and the PyTorch
implementation of the split-KV forward. Its tensor dimensions are the kernel's grid
(batch, KV head, split); the Python loop is the kernel's loop over the key blocks of one
split. Variable names follow the kernel: m_i, l_i, acc, start_n, split_lo, split_hi.
"""

from typing import Optional

import torch

from ._common import (BLOCK_SPARSE_UNIT, FP8_DTYPES, LN2, LOG2E, MAX_HEADDIM_V_KVCACHE,
                      Options, accumulator_dtype, as_bytes, check_bools, check_descale_kind,
                      check_qv, check_rotary, define_op, empty_outputs, group_block_lists,
                      take)

# The PyTorch path runs one split per sequence unless told otherwise (splits are a tensor
# dimension there, and matmul copies a key block whose (KV head, split) strides do not merge)
# and wide key blocks, so that the Python loop is short: 1024 keys was the fastest of 256,
# 1024 and 4096 for caches of 1K to 32K tokens on a 2-core AMD EPYC (32 query heads, 8 KV
# heads, head dim 128, float32). Where a block of BLOCK_N keys is narrower (fewer KV heads,
# smaller head dims), the loop's cost per block outweighs its compute: blocks grow to hold
# about TILE_ELEMENTS key elements (nheads_kv * headdim a key), up to MAX_BLOCK_N keys (8 KV
# heads of 128: 1024; 2 of 64: 4096, 1.4-1.7x as fast over 128K-1M tokens there; PERFLOG).
BLOCK_N = 1024
TILE_ELEMENTS = 2**19
MAX_BLOCK_N = 8192
MAX_SPLITS = 128


def block_keys(nheads_kv, headdim):
    """Keys a block of the PyTorch path: BLOCK_N, or more (a power of two, at most MAX_BLOCK_N)
    for narrow keys, TILE_ELEMENTS // (nheads_kv * headdim); forward caps it at the keys the
    rows see, rounded up to a power of two (at least BLOCK_N)."""
    wide = 1 << max(0, (TILE_ELEMENTS // max(1, nheads_kv * headdim)).bit_length() - 1)
    return max(BLOCK_N, min(MAX_BLOCK_N, wide))


def key_limits(first, last, seqlen_k, window_left, window_right):
    """Keys [lo, hi) visible to some query whose diagonal (i + seqlen_k - seqlen_q) lies in
    [first, last]; window sides < 0 are unbounded (causal is window_right = 0). Works on
    ints and on integer tensors (per-sequence seqlen_k)."""
    zero = seqlen_k * 0
    hi = seqlen_k if window_right < 0 else torch.clamp(last + window_right + 1 + zero, min=0)
    hi = torch.minimum(torch.as_tensor(hi), torch.as_tensor(seqlen_k))
    lo = zero if window_left < 0 else torch.clamp(first - window_left + zero, min=0)
    return torch.minimum(torch.as_tensor(lo), hi), hi


def _gather(cache, block_table, b, pos):
    """cache rows at key positions pos (B, Hs, S, BN) of sequences b (B, 1, 1, 1), the same
    keys for every KV head (Hs = 1) or each head's own (Hs = nheads_kv, a block_mask's lists):
    (B, nheads_kv, S, BN, headdim), a copy. A contiguous cache is (batch, capacity, Hkv, D); a
    paged one (num_pages, page_size, Hkv, D) read through block_table (batch, max_pages). A
    cache contiguous in memory is read as one (rows, D) matrix by index_select, which copies
    whole rows (on a CPU about 10x as fast as indexing its four dimensions)."""
    slots, nheads_kv, headdim = cache.shape[1:]
    h = torch.arange(nheads_kv, device=pos.device).view(1, -1, 1, 1)
    if block_table is None:
        seq, at = b, pos
    else:
        seq, at = block_table[b, pos // slots].long(), pos % slots
    if not cache.is_contiguous():
        return take(cache, seq, at, h)
    rows = ((seq * slots + at) * nheads_kv + h).flatten()
    out = as_bytes(cache).view(-1, headdim).index_select(0, rows)
    return out.view(cache.dtype).view(*pos.shape[:1], nheads_kv, *pos.shape[2:], headdim)


def _block_view(cache, start_n, split_stride, block_n):
    """The same rows as _gather for a contiguous cache whose splits start at the same key in
    every sequence and head (start_n[b, 0, s] = start_n[0, 0, 0] + s * split_stride), as a
    view: no copy."""
    n_splits = start_n.shape[-1]
    sb, sn, sh, sd = cache.stride()
    return cache.as_strided((cache.shape[0], cache.shape[2], n_splits, block_n, cache.shape[3]),
                            (sb, sh, split_stride * sn, sn, sd),
                            cache.storage_offset() + int(start_n[0, 0, 0]) * sn)


def _runs(row, first, last, cols, per_block, tile, width, end):
    """The visible tiles at positions [first, last) of one list (a row of block_lists, as
    ints), merged where they touch into runs [start, keys] of at most `width` keys, none past
    key `end`."""
    runs = []
    for at in range(first, last):
        start = (row[cols + 1 + at // per_block] * per_block + at % per_block) * tile
        keys = min(start + tile, end) - start
        if runs and sum(runs[-1]) == start and runs[-1][1] + keys <= width:
            runs[-1][1] += keys
        else:
            runs.append([start, keys])
    return runs


def _tiles_before(lists, t, per_block):
    """How many of a row's visible tiles (per_block to a block) come before its tile t: lists
    (..., 2 cols + 1) of _common.block_lists, t (...) int64 (flash_triton._tiles_before)."""
    blk, rem = t // per_block, t % per_block
    before = lists.gather(-1, blk[..., None]).squeeze(-1)
    after = lists.gather(-1, (blk + 1).clamp(max=lists.shape[-1] - 1)[..., None]).squeeze(-1)
    return before * per_block + torch.where(rem > 0, (after - before) * rem, 0)


def _tile_start(lists, cols, at, per_block, block_n):
    """The first key of a row's visible tile at position `at` (...) of its list, clamped to
    the list (flash_triton._sparse_tile)."""
    at = at.clamp(0, cols * per_block - 1)
    index = cols + 1 + at // per_block
    blk = lists.gather(-1, index.reshape(*lists.shape[:-1], -1)).view(index.shape)
    return (blk * per_block + at % per_block) * block_n


@torch.no_grad()
def forward(q, k_cache, v_cache, seqlens_k, block_table, opts, num_splits=0, block_n=None,
            leftpad_k=None, qv=None):
    """Split-KV forward. q: (batch, seqlen_q, nheads, headdim); seqlens_k: (batch,) int, the
    number of keys of each sequence (after any append), or one int for every sequence;
    leftpad_k: (batch,) int or None, the first key of each sequence (keys before it are
    padding; positions are counted from the start of the cache). opts.attn_mask: None, or a
    (batch, nheads, seqlen_q, L) view (broadcast dimensions at stride 0) indexed by key
    position, L = 1 or at least every sequence's key count. opts.k_descale, opts.v_descale:
    None, or (batch, nheads_kv) float32 views: a float8 cache's keys and values are
    k_cache * k_descale and v_cache * v_descale (applied to the scores and to the output, as
    the kernel does, not to the cache). qv: None, or (batch, seqlen_q, nheads, headdim_v):
    MLA's absorbed queries against the values, each score q k^T + qv v^T (the cache's value
    scale on its own term). Returns o like q and lse
    (batch, nheads, seqlen_q), natural log (-inf and o = 0 for a row that sees no key); o has
    v_cache's head dim, which may differ from q's and k_cache's."""
    batch, seqlen_q, nheads, headdim = q.shape
    headdim_v = v_cache.shape[-1]
    if not isinstance(seqlens_k, torch.Tensor):  # one length for every sequence
        seqlens_k = torch.full((batch,), seqlens_k, dtype=torch.long, device=q.device)
    nheads_kv = k_cache.shape[2]
    group = nheads // nheads_kv
    o, lse = empty_outputs(q, headdim_v=headdim_v)
    if o.numel() == 0:
        return o, lse.fill_(float("-inf"))
    if block_table is None and batch > 1:
        # One sequence at a time, so that interior key blocks are views of the cache that
        # matmul reads in place: the (batch, KV head) strides of a (batch, capacity, Hkv, D)
        # cache do not merge into one batch stride, and matmul would copy every block.
        for seq in range(batch):
            one = slice(seq, seq + 1)
            slopes, mask, k_scale, v_scale, blocks = (
                None if x is None else x[one] for x in (opts.alibi_slopes, opts.attn_mask,
                                                        opts.k_descale, opts.v_descale,
                                                        opts.block_mask))
            pad, qv_one = (None if x is None else x[one] for x in (leftpad_k, qv))
            o[one], lse[one] = forward(q[one], k_cache[one], v_cache[one], seqlens_k[one], None,
                                       opts._replace(alibi_slopes=slopes, attn_mask=mask,
                                                     k_descale=k_scale, v_descale=v_scale,
                                                     block_mask=blocks),
                                       num_splits, block_n, pad, qv_one)
        return o, lse
    dtype = accumulator_dtype(q.dtype)
    device = q.device
    seqlens_k = seqlens_k.to(device=device, dtype=torch.long)
    num_splits = num_splits or 1
    # -- GQA packing: rows r = i * group + g, (B, Hkv, M, D) with M = seqlen_q * group --
    M = seqlen_q * group
    q_packed, qv_packed = (
        None if x is None else x.to(dtype).view(batch, seqlen_q, nheads_kv, group, -1).permute(
            0, 2, 1, 3, 4).reshape(batch, nheads_kv, 1, M, x.shape[-1]) for x in (q, qv))
    offs_m = torch.arange(M, device=device)
    i = (offs_m // group)[:, None]  # (M, 1) query position of each row
    qk_scale = opts.softmax_scale  # a float8 cache's key scale folds into it: (B, Hkv, 1, 1, 1)
    if opts.k_descale is not None:
        qk_scale = opts.k_descale.to(dtype).view(batch, nheads_kv, 1, 1, 1) * qk_scale
    qv_scale = opts.softmax_scale  # qv v^T's: the value scale's
    if qv is not None and opts.v_descale is not None:
        qv_scale = opts.v_descale.to(dtype).view(batch, nheads_kv, 1, 1, 1) * qv_scale
    slope = None
    if opts.alibi_slopes is not None:  # (batch, nheads) -> (B, Hkv, 1, M, 1)
        slope = opts.alibi_slopes.to(dtype).view(batch, nheads_kv, 1, group)
        slope = slope.expand(batch, nheads_kv, seqlen_q, group).reshape(
            batch, nheads_kv, 1, M)[..., None]
    bias = opts.attn_mask  # (B, H, Nq, L), read at (batch, head, query, key) of each score
    sparse = opts.block_mask  # (B, H, query blocks, key blocks): each score's block's bit
    if bias is not None or sparse is not None:
        heads = torch.arange(nheads_kv, device=device)[:, None] * group + offs_m % group
        bias_h, bias_i = heads.view(1, nheads_kv, 1, M, 1), i.view(1, 1, 1, M, 1)
    # -- this split's keys: [split_lo, split_hi) of the keys the rows can see --
    offset = seqlens_k - seqlen_q  # (B,) diagonal of query 0
    lo, hi = key_limits(offset, offset + seqlen_q - 1, seqlens_k, opts.window_left,
                        opts.window_right)
    if sparse is not None:  # keys past block_mask's last block are hidden
        hi = hi.clamp(max=sparse.shape[-1] * opts.block_size_k)
        lo = torch.minimum(lo, hi)
    if leftpad_k is not None:
        leftpad_k = leftpad_k.to(device=device, dtype=torch.long)
        lo = torch.minimum(torch.maximum(lo, leftpad_k), hi)
    if block_n is None:  # no wider than the keys a sequence's rows see: a short cache reads no more
        span = int((hi - lo).max()) if batch else 0
        block_n = min(block_keys(nheads_kv, headdim), max(BLOCK_N, 1 << (span - 1).bit_length()))
    split = torch.arange(num_splits, device=device)
    if sparse is None:  # each split's keys [split_lo, split_hi) of [lo, hi): (B, 1, S)
        lo = lo // block_n * block_n
        per_split = ((hi - lo + block_n - 1) // block_n + num_splits - 1) // num_splits
        split_lo = (lo[:, None] + split * per_split[:, None] * block_n)[:, None]
        split_hi = torch.minimum(split_lo + (per_split * block_n)[:, None, None],
                                 hi[:, None, None])
        steps = int(per_split.max()) if batch else 0
    else:  # the kernel's loop: tiles of `tile` keys, each in one of block_mask's blocks, the
        # visible tiles of [lo, hi) in the list of blocks some row of the KV head sees (Hs =
        # nheads_kv lists, or 1 for a mask shared by every head); each split's positions
        # [split_lo, split_hi) in it, (B, Hs, S); a step takes `per_step` of them (block_n keys)
        tile = min(block_n, opts.block_size_k & -opts.block_size_k)
        per_step = block_n // tile
        lo = lo // tile * tile
        lists = group_block_lists(sparse[:, :1] if sparse.stride(1) == 0 else sparse, group,
                                  seqlen_q, M, opts.block_size_q)[:, :, 0]
        if lists.shape[1] > 1 and bool((lists == lists[:, :1]).all()):  # the same for all
            lists = lists[:, :1]
        cols, per_block = sparse.shape[-1], opts.block_size_k // tile
        first, last = (_tiles_before(lists, t[:, None].expand(batch, lists.shape[1]), per_block)
                       for t in (lo // tile, (hi + tile - 1) // tile))
        per_split = (last - first + num_splits - 1) // num_splits  # (B, Hs)
        split_lo = first[..., None] + split * per_split[..., None]
        split_hi = torch.minimum(split_lo + per_split[..., None], last[..., None])
        steps = -(-int(per_split.max()) // per_step) if batch else 0
        in_tile = torch.arange(tile, device=device)
        runs = None  # one list, one split, a contiguous cache (batch 1 here): read through views
        if block_table is None and num_splits == 1 and lists.shape[1] == 1 and batch:
            runs = _runs(lists[0, 0].tolist(), int(first), int(last), cols, per_block, tile,
                         block_n, int(hi))
            steps = len(runs)
    b = torch.arange(batch, device=device)[:, None, None, None]
    diag = (i + offset.view(batch, 1, 1, 1, 1))  # (B, 1, 1, M, 1)

    m_i = q_packed.new_full((batch, nheads_kv, num_splits, M), float("-inf"))
    l_i = torch.zeros_like(m_i)
    acc = q_packed.new_zeros((batch, nheads_kv, num_splits, M, headdim_v))
    # A contiguous cache (batch 1 here, see above) is read through views, not copies: every
    # block inside every split, and with one split also the last, shorter block. Only the
    # blocks of a paged cache, the last blocks of several splits and a block_mask's tiles are
    # gathered and masked; only blocks on a window's edge get the window's mask.
    contiguous = block_table is None
    split_stride = int(split_lo[0, 0, 1] - split_lo[0, 0, 0]) if (
        contiguous and num_splits > 1 and sparse is None) else 0
    split_room = int((split_hi - split_lo).min()) if batch and sparse is None else 0
    diag_lo, diag_hi = (int(offset.min()), int(offset.max()) + seqlen_q - 1) if batch else (0, 0)
    pad_hi = 0 if leftpad_k is None else int(leftpad_k.max())
    # A gathered key outside its split reads row 0 of its sequence, which a sequence without
    # keys does not have (a page's slots past a length may hold anything, NaN too): zeroed
    # then, as p = 0 there would not hide a NaN from p @ v.
    any_empty = bool((hi == 0).any()) if batch else False
    for step in range(steps):
        width = block_n
        if sparse is not None and runs is not None:  # a run of visible tiles, a view
            start, width = runs[step]
            start_n = torch.full((1, 1, 1), start, device=device)
            offs_n = start + torch.arange(width, device=device).view(1, 1, 1, -1)
            k, v = (_block_view(c, start_n, 0, width) for c in (k_cache, v_cache))
            mask = sparse[b[..., None], bias_h, bias_i // opts.block_size_q,
                          (offs_n // opts.block_size_k)[..., None, :]]
            outside, first, last = None, start, start + width - 1
        elif sparse is not None:  # this step's tiles (B, Hs, S, per_step), their keys (.., BN)
            at = (split_lo + step * per_step)[..., None] + torch.arange(per_step, device=device)
            start_n = _tile_start(lists, cols, at, per_block, tile)[..., None] + in_tile
            in_split = (at < split_hi[..., None])[..., None] & (start_n < hi.view(-1, 1, 1, 1, 1))
            offs_n, in_split = start_n.flatten(-2), in_split.flatten(-2)
            # each row's bit of each key's block (B, Hkv, S, M, BN); no row's: not read
            bits = sparse[b[..., None], bias_h, bias_i // opts.block_size_q,
                          (offs_n // opts.block_size_k)[..., None, :]]
            mask = in_split[..., None, :] & bits
            read = mask.any(-2)  # (B, Hkv, S, BN) the keys some row sees
            if not read.any():
                continue
            k, v = (_gather(c, block_table, b, torch.where(in_split, offs_n, 0))
                    for c in (k_cache, v_cache))
            # unseen keys read beside seen ones: as if not read (NaN too)
            outside = None if bool(read.all()) else ~read
            first, last = int(offs_n.min()), int(offs_n.max())
        else:
            start_n = split_lo + step * block_n  # (B, 1, S)
            if contiguous and num_splits == 1:
                width = min(block_n, split_room - step * block_n)
            offs_n = start_n[..., None] + torch.arange(width, device=device)  # (B, 1, S, BN)
            if contiguous and step * block_n + width <= split_room:
                k, v = (_block_view(c, start_n, split_stride, width) for c in (k_cache, v_cache))
                mask = outside = None
            else:
                in_split = offs_n < split_hi[..., None]
                pos = torch.where(in_split, offs_n, 0)
                k, v = (_gather(c, block_table, b, pos) for c in (k_cache, v_cache))
                outside = ~in_split if any_empty else None
                mask = in_split[..., None, :]
            first, last = int(start_n.min()), int(start_n.max()) + width - 1
        window_edge = ((opts.window_right >= 0 and last > diag_lo + opts.window_right)
                       or (opts.window_left >= 0 and first < diag_hi - opts.window_left))
        # (B, Hkv, S, BN, D); a float8 cache's entries as they are
        k, v = k.to(dtype), v.to(dtype)
        if outside is not None:  # v is a gathered copy here
            v = v.masked_fill_(outside[..., None], 0)
        # -- compute scores (B, Hkv, S, M, BN), in FlashAttention-2's order --
        qk = q_packed @ k.transpose(-1, -2) * qk_scale
        if qv_packed is not None:  # MLA absorbed: the value block read once, for both products
            qk = qk + qv_packed @ v.transpose(-1, -2) * qv_scale
        if opts.softcap > 0:
            qk = opts.softcap * torch.tanh(qk / opts.softcap)
        j = offs_n[..., None, :]  # (B, Hs, S, 1, BN)
        if slope is not None:
            qk = qk - slope * (diag - j).abs()
        if bias is not None:  # (B, Hkv, S, M, BN); keys past a sequence's end are masked below
            pos5 = offs_n.clamp(max=bias.shape[-1] - 1)[..., None, :]
            bias_ij = bias[b[..., None], bias_h, bias_i, pos5]
            if bias_ij.dtype == torch.bool:
                mask = bias_ij if mask is None else mask & bias_ij
            else:
                qk = qk + bias_ij.to(dtype)
        if window_edge:
            mask = True if mask is None else mask
            if opts.window_right >= 0:
                mask = mask & (j <= diag + opts.window_right)
            if opts.window_left >= 0:
                mask = mask & (j >= diag - opts.window_left)
        if first < pad_hi:  # a block that starts before some sequence's first key
            mask = True if mask is None else mask
            mask = mask & (j >= leftpad_k.view(batch, 1, 1, 1, 1))
        if mask is not None:
            qk = qk.masked_fill(~mask, float("-inf"))
        qk = qk * LOG2E
        # -- online softmax --
        m_ij = torch.maximum(m_i, qk.amax(-1))
        m_safe = torch.where(m_ij == float("-inf"), 0.0, m_ij)
        p = torch.exp2(qk - m_safe[..., None])
        alpha = torch.exp2(m_i - m_safe)
        l_i = l_i * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ v
        m_i = m_ij
    # -- each split's partial output and lse (log2 units), then the merge --
    l_safe = torch.where(l_i == 0, 1.0, l_i)
    o_partial = acc / l_safe[..., None]
    if opts.v_descale is not None:  # a float8 cache's value scale, (B, Hkv, 1, 1, 1)
        o_partial = o_partial * opts.v_descale.to(dtype).view(batch, nheads_kv, 1, 1, 1)
    lse_partial = torch.where(l_i == 0, float("-inf"), m_i + torch.log2(l_safe))
    o_merged, lse2 = merge(o_partial, lse_partial, dim=2)
    # (B, Hkv, M, Dv) -> (B, seqlen_q, nheads, Dv)
    o.copy_(o_merged.view(batch, nheads_kv, seqlen_q, group, headdim_v).permute(0, 2, 1, 3, 4)
            .reshape(batch, seqlen_q, nheads, headdim_v))
    lse.copy_((lse2 * LN2).view(batch, nheads_kv, seqlen_q, group).transpose(2, 3)
              .reshape(batch, nheads, seqlen_q))
    return o, lse


def merge(o_partial, lse_partial, dim):
    """Combine partial outputs (normalized) and their log2-sum-exp2 over `dim`, exactly:
    lse = log2 sum 2^lse_s, o = sum 2^(lse_s - lse) o_s. A row with every lse_s = -inf gives
    o = 0, lse = -inf."""
    lse_max = lse_partial.amax(dim, keepdim=True)
    lse_max = torch.where(lse_max == float("-inf"), 0.0, lse_max)
    w = torch.exp2(lse_partial - lse_max)
    sum_w = w.sum(dim, keepdim=True)
    sum_safe = torch.where(sum_w == 0, 1.0, sum_w)
    o = (w.unsqueeze(-1) * o_partial).sum(dim) / sum_safe.squeeze(dim).unsqueeze(-1)
    lse = torch.where(sum_w == 0, float("-inf"), lse_max + torch.log2(sum_safe)).squeeze(dim)
    return o, lse


# ----------------------------------------------------------------------------- public API

def _is_int(x):
    return isinstance(x, int) and not isinstance(x, bool)


def _check_per_sequence(name, x, q):
    """x must be a (batch,) int32/int64 tensor on q's device."""
    batch = q.shape[0]
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64) or \
            tuple(x.shape) != (batch,):
        raise TypeError(f"{name} must be an int32/int64 tensor of shape ({batch},), got "
                        f"{getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if x.device != q.device:
        raise ValueError(f"{name} is on {x.device}, q on {q.device}")


def _check_cache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                 table_name="block_table", cache_leftpad=None):
    """Shapes, dtypes and devices of the cache arguments; returns (seqlens, seqlen_new,
    max_seqlen): seqlens the lengths before the append, a Python int when cache_seqlens is an
    int or None (checked on the host: no device work, no sync), else cache_seqlens itself
    (int32 or int64), whose values are read once (one device-to-host copy, with cache_leftpad's if
    given); max_seqlen their maximum as an int (None for a tensor while torch.compile traces,
    or at batch 0). cache_leftpad's values are read too (with an int cache_seqlens, a copy of
    their own), and a paged cache's block_table entries in use (one more copy). Raises naming
    the argument; nothing has been written yet."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is None and name in ("k", "v"):
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions, got shape {tuple(x.shape)}")
        # a float8 cache's pair of dtypes: check_cache_pair
        if x.dtype != q.dtype and not (name.endswith("cache") and x.dtype in FP8_DTYPES):
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}: they must match "
                            f"(or the caches be float8: {', '.join(map(str, FP8_DTYPES))})")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: they must match")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    batch, seqlen_q, nheads, headdim = q.shape
    check_cache_pair(k_cache, v_cache, "k_cache", "v_cache")
    _, slots, nheads_kv, cache_headdim = k_cache.shape
    headdim_v = v_cache.shape[3]
    if cache_headdim != headdim:
        raise ValueError(f"k_cache headdim {cache_headdim} differs from q's {headdim}")
    if nheads_kv == 0 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of the nheads_kv of "
                         f"k_cache ({nheads_kv})")
    seqlen_new = 0
    if k is not None:
        if tuple(k.shape[:3]) != tuple(v.shape[:3]) or k.shape[0] != batch or \
                tuple(k.shape[2:]) != (nheads_kv, headdim) or v.shape[3] != headdim_v:
            raise ValueError(f"k and v must have shapes (batch, seqlen_new, nheads_kv, headdim) = "
                             f"({batch}, *, {nheads_kv}, {headdim}) and (..., {headdim_v}) (the "
                             f"caches' head dims), got {tuple(k.shape)} and {tuple(v.shape)}")
        seqlen_new = k.shape[1]
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache has batch {k_cache.shape[0]}, q has {batch} (a paged "
                             f"cache needs block_table)")
        capacity = slots
    else:
        check_block_table(block_table, batch, q.device)
        capacity = block_table.shape[1] * slots
    if cache_seqlens is None:
        seqlens = capacity - seqlen_new
    elif _is_int(cache_seqlens):
        seqlens = cache_seqlens
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype not in (torch.int32, torch.int64) or \
                tuple(cache_seqlens.shape) != (batch,):
            raise TypeError(f"cache_seqlens must be an int or an int32/int64 tensor of shape "
                            f"({batch},), got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != q.device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device}, q on {q.device}")
        seqlens = cache_seqlens  # int32 or int64 as given: no conversion kernel
    else:
        raise TypeError(f"cache_seqlens must be an int or an integer tensor of shape "
                        f"({batch},), got {type(cache_seqlens).__name__}")
    if cache_leftpad is not None:
        _check_per_sequence("cache_leftpad", cache_leftpad, q)
    reads = not torch.compiler.is_compiling() and batch > 0  # the value checks below may read
    if not _is_int(seqlens) and not reads:
        return seqlens, seqlen_new, None
    lengths, pads = [seqlens] * batch, None
    if cache_leftpad is not None and reads:  # one device-to-host copy of both
        if _is_int(seqlens):
            pads = cache_leftpad.tolist()
        else:
            lengths, pads = torch.stack([seqlens.long(), cache_leftpad.long()]).tolist()
    elif not _is_int(seqlens):
        lengths = seqlens.tolist()  # the one device-to-host copy of cache_seqlens
    lo, hi = (seqlens, seqlens) if _is_int(seqlens) else (min(lengths), max(lengths))
    if lo < 0 or hi + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache "
                         f"capacity), got cache_seqlens in [{lo}, {hi}] and "
                         f"seqlen_new = {seqlen_new}")
    for b, (pad, length) in enumerate(zip(pads or (), lengths)):
        if not 0 <= pad <= length:
            raise ValueError(f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}] = "
                             f"{length}] (sequence {b}'s keys are the cache rows from "
                             f"cache_leftpad to cache_seqlens + seqlen_new)")
    if block_table is not None and batch and not torch.compiler.is_compiling():
        check_pages_in_use(block_table, seqlens + seqlen_new, slots, k_cache.shape[0],
                           table_name, "k_cache")
    return seqlens, seqlen_new, hi


def check_descale(name, descale, batch, k_cache, device, k_name="k_cache"):
    """k_descale or v_descale -> None or a (batch, nheads_kv) float32 view (broadcast
    dimensions at stride 0) on `device`. Accepted: None (1), a positive finite float, or a
    float32 tensor broadcastable to (batch, nheads_kv) (its values are not read)."""
    shape = (batch, k_cache.shape[2])  # (batch, nheads_kv)
    kind = check_descale_kind(
        name, descale, shape, k_cache.dtype in FP8_DTYPES, k_cache.dtype,
        lambda x: isinstance(x, torch.Tensor) and x.dtype == torch.float32, "tensor", k_name)
    if kind == "none":
        return None
    if kind == "float":
        return torch.full((1, 1), descale, dtype=torch.float32, device=device).expand(shape)
    if descale.device != device:
        raise ValueError(f"{name} is on {descale.device}, q on {device}")
    return descale.expand(shape)


def quantize(x, descale, dtype):
    """x (batch, seqlen, nheads_kv, headdim) as a float8 cache of `dtype` stores it:
    x / descale rounded to nearest even, saturated at the format's largest finite value
    (448 for float8_e4m3fn, which has no infinity). descale: None (1) or (batch, nheads_kv)."""
    x = x.float()
    if descale is not None:
        x = x / descale[:, None, :, None]
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def check_cache_pair(k_cache, v_cache, k_name, v_name, same_headdim=False):
    """A KV cache, contiguous or paged: k_cache and v_cache of one shape but for the values'
    head dim, which may differ (MLA) unless same_headdim (a paged cache in attention_varlen,
    whose prefill kernel takes one head dim); a float8 cache's keys and values of one dtype."""
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        raise ValueError(f"{k_name} and {v_name} must have the same shape but for the head dim, "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if (k_cache.dtype in FP8_DTYPES or v_cache.dtype in FP8_DTYPES) and \
            k_cache.dtype != v_cache.dtype:
        raise TypeError(f"{v_name} has dtype {v_cache.dtype}, {k_name} has {k_cache.dtype}: a "
                        f"float8 cache's keys and values must have one dtype")
    if same_headdim and k_cache.shape[3] != v_cache.shape[3]:
        raise NotImplementedError(f"{v_name} has another head dim ({v_cache.shape[3]}) than "
                                  f"{k_name} ({k_cache.shape[3]}): not supported in a paged "
                                  f"cache here; attention_with_kvcache and attention_varlen "
                                  f"without block_table take different value head dims")


def check_block_table(block_table, batch, device):
    """block_table must be a (batch, max_pages) int32 tensor on q's device."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32 or \
            block_table.dim() != 2 or block_table.shape[0] != batch:
        raise TypeError(f"block_table must be an int32 tensor of shape (batch={batch}, "
                        f"max_pages), got {getattr(block_table, 'dtype', type(block_table))} "
                        f"{tuple(getattr(block_table, 'shape', ()))}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device}, q on {device}")


def check_pages_in_use(block_table, lengths, page_size, num_pages, table_name, cache_name):
    """The entries of block_table (batch, max_pages) that sequences of these lengths (an int,
    or a (batch,) tensor) read must be pages of the cache: [0, num_pages). One device-to-host
    copy (of their minimum and maximum)."""
    pages_used = (lengths + page_size - 1) // page_size  # int or (B,)
    if _is_int(pages_used):
        entries = block_table[:, :pages_used]
    else:
        entries = block_table[torch.arange(block_table.shape[1], device=block_table.device)
                              < pages_used[:, None]]
    if entries.numel():
        first, last = torch.stack([entries.min(), entries.max()]).tolist()
        if first < 0 or last >= num_pages:
            raise ValueError(f"{table_name} entries in use must lie in [0, {num_pages}) "
                             f"({cache_name}.shape[0]), got [{first}, {last}]")


def _append(cache, new, seqlens, block_table):
    """cache[b, seqlens[b] + t] = new[b, t], in place (through block_table for a paged cache);
    seqlens an int (every sequence) or a (batch,) tensor."""
    batch, seqlen_new = new.shape[:2]
    if seqlen_new == 0 or batch == 0:
        return
    if _is_int(seqlens):
        pos = torch.arange(seqlens, seqlens + seqlen_new, device=new.device).expand(
            batch, seqlen_new)
    else:
        pos = seqlens[:, None] + torch.arange(seqlen_new, device=new.device)  # (B, Nnew)
    b = torch.arange(batch, device=new.device)[:, None].expand_as(pos)
    if block_table is not None:
        page_size = cache.shape[1]
        b, pos = block_table[b, pos // page_size].long(), pos % page_size
    as_bytes(cache).index_put_((b, pos), as_bytes(new))


def _rows_as_pages(q, cache_batch_idx, block_table):
    """cache_batch_idx as the block_table of a paged cache whose pages are the rows of the
    contiguous cache: (batch, 1) int32. Its values are checked with the pages in use
    (_check_cache)."""
    if block_table is not None:
        raise ValueError("cache_batch_idx selects rows of a contiguous cache; it cannot be "
                         "combined with block_table")
    _check_per_sequence("cache_batch_idx", cache_batch_idx, q)
    return cache_batch_idx.to(torch.int32)[:, None]


def _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, max_seqlen, seqlen_new,
                  q_in_order):
    """The rotary arguments; max_seqlen: the largest length before the append (None: not
    known without reading the device, so the positions go unchecked)."""
    check_bools(rotary_interleaved=rotary_interleaved)
    given = check_rotary(rotary_cos, rotary_sin,
                         lambda x: isinstance(x, torch.Tensor) and x.dim() == 2 and
                         x.is_floating_point(), "tensor", k is not None, q.shape[-1], q.shape[1],
                         max_seqlen, seqlen_new, q_in_order)
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if given and x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}: they must match")


def _rotate(q, k, cos, sin, interleaved, seqlens, q_in_order):
    """q and the new keys k rotated at their positions (see attention_with_kvcache)."""
    from .nn import apply_rotary  # nn imports the public API: import late

    def angles(n):  # (n, R/2) for an int length, (B, n, R/2) for per-sequence lengths
        pos = torch.arange(n, device=q.device)
        pos = seqlens + pos if _is_int(seqlens) else seqlens[:, None] + pos
        return cos[pos], sin[pos]
    q = apply_rotary(q, *angles(q.shape[1] if q_in_order else 1), interleaved)
    return q, apply_rotary(k, *angles(k.shape[1]), interleaved)


def tree_attention_mask(parents, cache_seqlens, length=None, device=None):
    """The attn_mask of tree attention in speculative decoding, for attention_with_kvcache.

    A draft tree of n tokens is appended to each sequence in one call, node t at cache row
    cache_seqlens[b] + t; node t sees the cached tokens, its ancestors and itself.
    Arguments:
        parents: n ints, or a (batch, n) integer tensor (a tree per sequence): node t's
            parent, -1 for a child of the last cached token; parents precede their children
            (-1 <= parents[t] < t).
        cache_seqlens: an int or (batch,) integers: each sequence's length before the append,
            as attention_with_kvcache takes it.
        length: the mask's key dimension L (default max(cache_seqlens) + n, the fewest that
            attention_with_kvcache accepts).
    Returns a bool tensor (batch, 1, n, L) on `device` (default cache_seqlens' or parents'),
    batch 1 for an int cache_seqlens and 1-D parents. For parents [-1, 0, 0, 1] and 2 cached
    tokens:
        1 1 1 0 0 0
        1 1 1 1 0 0
        1 1 1 0 1 0
        1 1 1 1 0 1
    """
    if device is None:
        device = next((x.device for x in (cache_seqlens, parents)
                       if isinstance(x, torch.Tensor)), None)
    parents = torch.as_tensor(parents, device=device)
    if parents.numel() == 0:  # [] reads as float32
        parents = parents.long()
    if parents.dtype not in (torch.int32, torch.int64) or parents.dim() not in (1, 2):
        raise TypeError(f"parents must be n ints or a (batch, n) integer tensor, got "
                        f"{parents.dtype} {tuple(parents.shape)}")
    lengths = torch.as_tensor(cache_seqlens, device=device).long().reshape(-1)  # (B,) or (1,)
    parents = parents.long().view(parents.shape[0] if parents.dim() == 2 else 1,
                                  parents.shape[-1])  # (B or 1, n)
    batch = max(len(lengths), parents.shape[0])
    n = parents.shape[1]
    node = torch.arange(n, device=device)
    if len(lengths) == 0 or (parents < -1).any() or (parents >= node).any() or \
            (lengths < 0).any() or parents.shape[0] not in (1, batch) or \
            len(lengths) not in (1, batch):
        raise ValueError(f"parents ({tuple(parents.shape)}) must satisfy -1 <= parents[t] < t "
                         f"and cache_seqlens ({tuple(lengths.shape)}) be >= 0, with one batch "
                         f"size (or 1)")
    longest = int(lengths.max()) + n
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"length must be at least max(cache_seqlens) + n = {longest}, got "
                         f"{length}")
    # -- ancestors: walk every node up to the root, depth at most n --
    parents = parents.expand(batch, n)
    seen = torch.eye(n, dtype=torch.bool, device=device).expand(batch, n, n).clone()
    up = node.expand(batch, n)
    for _ in range(n):
        up = torch.where(up >= 0, parents.gather(1, up.clamp(min=0)), -1)
        seen |= (up[..., None] == node) & (up[..., None] >= 0)
    # -- key position j of sequence b: cached (j < prefix), or draft node j - prefix --
    prefix = lengths.expand(batch)[:, None, None]  # (B, 1, 1)
    j = torch.arange(length, device=device)
    mask = (j < prefix).expand(batch, n, length)
    if n:
        draft = (j - prefix).clamp(0, n - 1).expand(batch, n, length)
        mask = mask | ((j >= prefix) & (j < prefix + n) & seen.gather(2, draft))
    return mask[:, None]  # (B, 1, n, L)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                           block_table=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           return_lse=False, backend="auto", *, num_splits=0,
                           rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                           cache_batch_idx=None, cache_leftpad=None, learnable_sink=None,
                           attn_mask=None, k_descale=None, v_descale=None, qv=None,
                           block_mask=None, block_size=BLOCK_SPARSE_UNIT):
    """Attention of a few new queries over a KV cache, appending new keys/values in place
    (FlashAttention-2's flash_attn_with_kvcache).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim); seqlen_q is small: 1 for decoding, a few for
            speculative decoding.
        k_cache, v_cache: (batch, capacity, nheads_kv, headdim), or, with block_table, a paged
            cache (num_pages, page_size, nheads_kv, headdim); nheads % nheads_kv == 0 (GQA:
            the cache is never repeated). v_cache's head dim may differ from q's and
            k_cache's (MLA decoding): the kernels take both as they are, nothing is padded.
            q's dtype, or both float8 (torch.float8_e4m3fn or torch.float8_e5m2: a quantized
            cache, half a 16-bit cache's bytes; see k_descale).
        k, v: (batch, seqlen_new, nheads_kv, headdim) or None (v with v_cache's head dim), q's
            dtype. If given, written into the cache in place at positions cache_seqlens[b] ...
            cache_seqlens[b] + seqlen_new - 1 before attending (into a float8 cache quantized:
            k / k_descale rounded to nearest even, saturated at the format's largest finite
            value). cache_seqlens itself is not updated (the caller advances it).
        cache_seqlens: int or (batch,) int32/int64 tensor: each sequence's length before the
            append; default: the whole capacity (minus seqlen_new). An int (or the default)
            is checked on the host and costs no device-to-host synchronization with a
            contiguous cache, and the Triton kernel takes it as an argument (no lengths
            tensor to fill): use it when every sequence has the same length. A tensor's
            values are checked too, which reads them back once per call (a synchronization;
            none under torch.compile, where the value checks are skipped); so are the
            block_table entries of a paged cache.
        block_table: (batch, max_pages) int32: page p of sequence b is k_cache[block_table[b, p]].
            Entries of pages beyond a sequence's length are not read (any value).
        causal: bottom-right aligned to each sequence's length after the append,
            seqlen_k = cache_seqlens[b] + seqlen_new: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
        softmax_scale (default 1/sqrt(headdim)), window_size, softcap, alibi_slopes: as in
            `longflash.attention`, aligned per sequence like causal.
        return_lse: also return lse (batch, nheads, seqlen_q), float32 (float64 for float64).
        backend: "auto" | "triton" | "torch", as in `longflash.attention`.
        num_splits: key splits per sequence; 0 chooses (Triton: from batch, heads, cache
            length and the SM count; the PyTorch path: 1), 1 disables splitting.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2), or None: rotary embeddings as
            FlashAttention applies them (fused into its kernel there; on the Triton backend
            here, one kernel with the append, before the attention's):
            the first rotary_dim dims of the new k are rotated before they are written, key t
            of sequence b at position cache_seqlens[b] + t; those of q at cache_seqlens[b] + i
            for query i if causal or windowed, else all at cache_seqlens[b]. Needs k and v;
            seqlen_ro must exceed every position used.
        rotary_interleaved: rotate dims (2i, 2i + 1) together (GPT-J; FlashAttention's
            default) if True, else (i, i + rotary_dim / 2) (GPT-NeoX, Llama).
        cache_batch_idx: (batch,) int32/int64 tensor, or None: sequence b uses row
            cache_batch_idx[b] of a contiguous cache of any number of rows (serving slots);
            not with block_table. Its values in use are read once to check them. Run as a paged
            cache of one page per row. With repeated rows and k given, which write lands is
            unspecified (as in FlashAttention).
        cache_leftpad: (batch,) int32/int64 tensor, or None: the cache row where each sequence
            starts (left padding): sequence b's keys are rows cache_leftpad[b] ...
            cache_seqlens[b] + seqlen_new - 1, and 0 <= cache_leftpad[b] <= cache_seqlens[b].
            cache_seqlens, the append, causal alignment (to the last key) and rotary
            positions (the rows) are as without it. Its values are read once to check them
            (with a tensor cache_seqlens, in the same copy).
        learnable_sink: (nheads,) floating-point tensor, or None: attention sinks, as in
            `longflash.attention` (one more logit per head in each row's softmax, attending
            to no value; lse includes it).
        attn_mask: None, or a bool or floating-point tensor broadcastable to (batch, nheads,
            seqlen_q, L), as in `longflash.attention` (True: query i may see the key; a float
            is added to the scores after softcap and ALiBi), whose last dimension is the key's
            position in its sequence (cache row, as cache_seqlens and cache_leftpad count
            them): L = 1, or L >= every sequence's key count after the append (entries past a
            sequence's end are not read). Combines with causal, windows and cache_leftpad
            (a key must pass every one). For tree attention in speculative decoding: the
            draft tokens' tree as a (batch, 1, seqlen_q, L) boolean mask. The kernels read it
            in place, tile by tile (a broadcast mask is never materialized). L is checked
            against the lengths where they are read (not under torch.compile with a tensor
            cache_seqlens).
        k_descale, v_descale: None (1.0), a positive float, or a float32 tensor broadcastable
            to (batch, nheads_kv) (FlashAttention-3's shape; per sequence b, as q is indexed,
            also with cache_batch_idx), only with a float8 cache: the keys and values the
            attention sees are k_cache * k_descale and v_cache * v_descale, in float32. The
            kernels fold the key scale into the softmax scale and the value scale into the
            output (the cache is read once, in its 8 bits, and converted to q's dtype for the
            dot products, which is exact). q, k and v stay 16- or 32-bit; o has q's dtype.
        qv: None, or (batch, seqlen_q, nheads, headdim_v), q's dtype (FlashAttention-3's
            argument): queries against the values too, each score
            softmax_scale * (q k^T + qv v^T), default softmax_scale 1/sqrt(headdim + headdim_v).
            MLA decoding in its absorbed form (DeepSeek-V2/V3): v_cache holds each token's
            compressed latent (headdim_v up to 512, one KV head shared by every query head),
            k_cache its rotary part (headdim 64), q the queries' rotary part and qv their
            no-rotary part times the key up-projection; the output is the attention over the
            latents (the value up-projection follows outside). The value tile is read once,
            for both products: the same result as q' = [q, qv] over k' = [k_cache, v_cache],
            without that second copy of the latents. Rotary embeddings turn q, not qv.
            With a float8 cache, v_descale scales qv v^T as it scales the output.
        block_mask: None, or a bool tensor (batch or 1, nheads or 1, ceil(seqlen_q /
            block_size_q), C): block-sparse decoding, as in `longflash.attention` (query i
            sees key j only if block_mask[b, h, i // block_size_q, j // block_size_k]), whose
            last dimension counts key blocks of the sequence's positions (cache rows, as
            attn_mask's L): C >= ceil(every sequence's key count after the append /
            block_size_k), e.g. ceil(capacity / block_size_k) for a mask kept through a
            decoding loop (blocks past a sequence's end are not read; keys past its last
            block are hidden, where a tensor cache_seqlens under torch.compile leaves C
            unchecked). Per head: each query
            head may select key blocks of its own (Quest, MoBA), the group's heads packed
            into one tile as ever. Combines with causal, windows, attn_mask and
            cache_leftpad. Both paths loop over a list, per KV head, of the key blocks some
            row of its group sees (made once per mask on the Triton path), the splits an
            even share of those tiles: a hidden block costs no step, and a split no more
            work than another. Each row's own bit masks its scores; the Triton kernel loads
            nothing of a listed tile that no row of its program sees. The PyTorch path reads
            a mask shared by all heads through views of runs of visible tiles (one split, a
            contiguous cache), else gathers each head's tiles (a copy).
        block_size: an int or (block_size_q, block_size_k), each a multiple of 64, as in
            `longflash.attention`.
    Returns o: (batch, seqlen_q, nheads, headdim of v_cache), and lse if return_lse. A
    sequence with no key (length 0, nothing appended) gives o = 0, lse = -inf. Inference only
    (no autograd in q and the caches; a learnable_sink's gradient flows).
    Errors (ValueError / TypeError naming the argument) are raised before anything is
    written, so the cache is unchanged.
    Eager, the Triton backend appends (and rotates) in one kernel of its own
    (decode_triton.append); the PyTorch path and torch.compile use PyTorch ops for it.
    torch.compile(fullgraph=True) captures a call whole: the append as traced ops, the
    attention as one op (torch.ops.longflash.kvcache_forward). An int cache_seqlens that
    changes between calls becomes symbolic after the first change, so a compiled decoding
    loop compiles twice, not once per token.
    """
    from .interface import (_check_attn_mask, _check_block_mask, _check_inputs,  # it imports
                            _outputs)  # us: late

    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor (batch, seqlen_q, nheads, headdim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    if not _is_int(num_splits) or not 0 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be an int in [0, {MAX_SPLITS}], got {num_splits!r}")
    table_name = "block_table"
    if cache_batch_idx is not None:
        block_table, table_name = _rows_as_pages(q, cache_batch_idx, block_table), \
            "cache_batch_idx"
    seqlens, seqlen_new, max_seqlen = _check_cache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                   block_table, table_name, cache_leftpad)
    if qv is not None:
        scale = check_qv(qv, q, v_cache.shape[-1], torch.is_tensor, "torch.Tensor")
        if qv.device != q.device:
            raise ValueError(f"qv is on {qv.device}, q on {q.device}: they must match")
        softmax_scale = scale if softmax_scale is None else softmax_scale
    k_descale = check_descale("k_descale", k_descale, q.shape[0], k_cache, q.device)
    v_descale = check_descale("v_descale", v_descale, q.shape[0], k_cache, q.device)
    # The remaining checks (dtype, head dims, scale, window, softcap, ALiBi, backend) are
    # attention's, on empty stand-ins for the keys and values (q's dtype: a float8 cache is
    # checked above).
    keys, values = (c.new_empty((q.shape[0], 0, c.shape[2], c.shape[3]), dtype=q.dtype)
                    for c in (k_cache, v_cache))
    softmax_scale, backend = _check_inputs(q, keys, values, causal, softmax_scale, backend,
                                           window_size, alibi_slopes, softcap,
                                           learnable_sink=learnable_sink,
                                           max_headdim_v=MAX_HEADDIM_V_KVCACHE)
    max_seqlen_k = None if max_seqlen is None else max_seqlen + seqlen_new
    _check_attn_mask(attn_mask, q, max_seqlen_k, keys_at_least=True)
    sparse = _check_block_mask(block_mask, block_size, q, q.shape[0], q.shape[1], max_seqlen_k,
                               keys_at_least=True)
    q_in_order = causal or tuple(window_size) != (-1, -1)  # query positions, for rotary
    _check_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved, max_seqlen, seqlen_new,
                  q_in_order)
    if backend == "triton":
        from . import decode_triton
        decode_triton.check_cache(k_cache, v_cache)
    if k is not None and backend == "triton" and not torch.compiler.is_compiling():
        # One launch for both (the PyTorch ops below are a dozen small kernels)
        q = decode_triton.append(q, k, v, k_cache, v_cache, seqlens, block_table, rotary_cos,
                                 rotary_sin, rotary_interleaved, q_in_order, k_descale,
                                 v_descale)
    elif k is not None:  # traced by torch.compile, these fuse
        if rotary_cos is not None:
            q, k = _rotate(q, k, rotary_cos, rotary_sin, rotary_interleaved, seqlens,
                           q_in_order)
        if k_cache.dtype in FP8_DTYPES:
            k, v = quantize(k, k_descale, k_cache.dtype), quantize(v, v_descale, v_cache.dtype)
        _append(k_cache, k, seqlens, block_table)
        _append(v_cache, v, seqlens, block_table)
    # an int stays an int: no tensor to fill, no read back
    seqlens_k = seqlens + seqlen_new if seqlen_new else seqlens
    o, lse = _forward(q, k_cache, v_cache, seqlens_k, block_table, causal, softmax_scale,
                      window_size, softcap, alibi_slopes, num_splits, backend, max_seqlen_k,
                      cache_leftpad, attn_mask, k_descale, v_descale, qv, *sparse)
    return _outputs(o, lse, learnable_sink, return_lse)


def _forward(q, k_cache, v_cache, seqlens_k, block_table, causal, softmax_scale, window_size,
             softcap, alibi_slopes, num_splits, backend, max_seqlen_k=None, leftpad_k=None,
             attn_mask=None, k_descale=None, v_descale=None, qv=None, block_mask=None,
             block_size_q=BLOCK_SPARSE_UNIT, block_size_k=BLOCK_SPARSE_UNIT):
    """Checked arguments -> (o, lse) on the chosen implementation. max_seqlen_k: the largest
    of seqlens_k if the caller knows it (the Triton launcher then reads nothing back from the
    device); None: found from seqlens_k when needed. leftpad_k: each sequence's first key
    (cache_leftpad) or None. attn_mask: None, or broadcastable to (batch, nheads, seqlen_q,
    L), indexed by key position. k_descale, v_descale: None or (batch, nheads_kv) float32, a
    float8 cache's scales. qv: None or (batch, seqlen_q, nheads, headdim_v). block_mask:
    None, or (batch or 1, nheads or 1, query blocks, key blocks) of block_size_q queries and
    block_size_k keys."""
    args = (q, k_cache, v_cache, block_table, leftpad_k, causal, softmax_scale, *window_size,
            float(softcap), alibi_slopes, num_splits, backend, attn_mask, k_descale, v_descale,
            qv, block_mask, block_size_q, block_size_k)
    if not torch.compiler.is_compiling():
        return _run(seqlens_k, max_seqlen_k, *args)
    # Traced by torch.compile: one opaque op, since the PyTorch path loops over as many key
    # blocks as the lengths' values say, and the launcher picks its splits from them. Eager
    # calls skip the op's dispatch (a decoding step over a short cache takes microseconds).
    # Nothing is read back inside the op (CUDA graphs capture it): without a known maximum,
    # the cache's capacity bounds the lengths.
    if max_seqlen_k is None:
        max_seqlen_k = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    tensor = isinstance(seqlens_k, torch.Tensor)
    return torch.ops.longflash.kvcache_forward(
        seqlens_k if tensor else None, 0 if tensor else seqlens_k, max_seqlen_k, *args)


def _run(seqlens_k, max_seqlen_k, q, k_cache, v_cache, block_table, leftpad_k, causal,
         softmax_scale, window_left, window_right, softcap, alibi_slopes, num_splits, backend,
         attn_mask=None, k_descale=None, v_descale=None, qv=None, block_mask=None,
         block_size_q=BLOCK_SPARSE_UNIT, block_size_k=BLOCK_SPARSE_UNIT):
    batch, seqlen_q, nheads, _ = q.shape
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.expand(batch, nheads)
    if attn_mask is not None:  # a view: broadcast dimensions at stride 0
        attn_mask = attn_mask.expand(batch, nheads, seqlen_q,
                                     attn_mask.shape[-1] if attn_mask.dim() else 1)
    if block_mask is not None and backend != "triton":  # the launcher keeps lists per mask
        block_mask = block_mask.expand(batch, nheads, *block_mask.shape[2:])
    opts = Options(softmax_scale, window_left, 0 if causal else window_right, alibi_slopes,
                   softcap, attn_mask=attn_mask, k_descale=k_descale, v_descale=v_descale,
                   block_mask=block_mask, block_size_q=block_size_q, block_size_k=block_size_k)
    if backend == "triton":
        from . import decode_triton
        return decode_triton.forward(q, k_cache, v_cache, seqlens_k, block_table, opts,
                                     num_splits, max_seqlen_k, leftpad_k, qv)
    return forward(q, k_cache, v_cache, seqlens_k, block_table, opts, num_splits,
                   leftpad_k=leftpad_k, qv=qv)


def _kvcache_forward(seqlens_k: Optional[torch.Tensor], seqlen_k: int, max_seqlen_k: int,
                     q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: Optional[torch.Tensor], leftpad_k: Optional[torch.Tensor],
                     causal: bool, softmax_scale: float,
                     window_left: int, window_right: int, softcap: float,
                     alibi_slopes: Optional[torch.Tensor], num_splits: int,
                     backend: str, attn_mask: Optional[torch.Tensor],
                     k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor],
                     qv: Optional[torch.Tensor], block_mask: Optional[torch.Tensor],
                     block_size_q: int, block_size_k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """_run under torch.compile. seqlens_k: (batch,) lengths, or None for one length seqlen_k
    of every sequence."""
    lengths = seqlen_k if seqlens_k is None else seqlens_k
    return _run(lengths, max_seqlen_k, q, k_cache, v_cache, block_table, leftpad_k, causal,
                softmax_scale, window_left, window_right, softcap, alibi_slopes, num_splits,
                backend, attn_mask, k_descale, v_descale, qv, block_mask, block_size_q,
                block_size_k)


def _kvcache_fake(seqlens_k, seqlen_k, max_seqlen_k, q, k_cache, v_cache, *args):
    return empty_outputs(q, headdim_v=v_cache.shape[-1])


define_op("kvcache_forward", _kvcache_forward, _kvcache_fake)  # torch.ops.longflash.*
