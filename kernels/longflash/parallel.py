"""Ring attention: exact attention over a sequence sharded across a process group.

Each of the P ranks of a group holds 1/P of the sequence: its query shard, which stays,
and its key/value shard, which travels around the ring (rank r sends to r + 1 and
receives from r - 1). After P steps every query shard has met every key/value shard, and
the partial outputs, merged with their log-sum-exp, are exactly softmax attention over
the whole sequence (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers"; the merge is FlashAttention's online softmax one level up). No rank holds
more than two key/value shards, so per-rank memory is O(seqlen / P).

    forward on rank r; at step t = 0 .. P-1 it holds the k, v shard of rank r - t (mod P):
        post   send(k, v) -> r + 1,  recv(k', v') <- r - 1     # the next shard is in flight
        o_t, lse_t = attention_forward(q, k, v)                 # while this one computes
        o, lse = merge(o, lse, o_t, lse_t)                      # in float32, never bf16
        wait;  k, v = k', v'
    backward: the same ring. With the FINAL o and lse, p = exp(q k^T * scale - lse) is each
        block's exact share of the softmax, so attention_backward(do, q, k, v, o, lse) gives
        the block's term of dq and the exact dk, dv of the shard in hand; no per-step output
        is stored. dk, dv (float32) travel with k, v and are back with their owner after P
        steps. (A window may need fewer steps, and lanes both ways round the ring: _lanes.)

Layouts. The global sequence is cut into chunks of equal length:
    "contiguous": P chunks, rank r holds chunk r. Causal work is unbalanced: the last rank
        attends to every chunk, the first to its own only (efficiency -> 1/2 as P grows).
    "zigzag": 2P chunks, rank r holds chunks r and 2P-1-r, in sequence order, so that every
        rank does the same causal work (as in ring-flash-attn's zigzag ring):

            P = 4:   chunk   0  1  2  3  4  5  6  7
                     rank    0  1  2  3  3  2  1  0

        Causal steps: t = 0 is the local causal block; when the shard in hand comes from a
        rank before this one, all of q sees its first chunk (its second lies in the future);
        from a rank after, the second chunk of q sees all of it. Half a block either way.
Chunk pairs that causal masks entirely are skipped (no compute; the shard still travels).

Precision: each block's output and gradients come from the kernel in the input dtype
(rounded once per block, as in ring-flash-attn); the running output, lse, dq and the
travelling dk, dv are float32, so roundings do not compound from step to step.

Communication is torch.distributed's own (`batch_isend_irecv`; gloo on CPU, NCCL on GPU);
attention is computed by the custom ops of `longflash.interface`, never re-implemented
here. Tested with gloo process groups of 1, 2 and 4 ranks on CPU (tests/test_parallel.py;
the blockwise path, and the Triton kernels interpreted at 2 ranks); not yet run with NCCL on
several GPUs. Sliding windows: each step computes the chunk pairs
the window reaches, each as one call whose rows, keys and window are cut to the pair's
distance (_window_span), and the shards travel only as far as some rank's window reaches
them, each way round the ring at once where that takes fewer transfers (_lanes: a short
causal window, two steps, one transfer forward over the contiguous layout, one each way
over zigzag; then dK/dV go straight back to their owners); softcap applies per score,
block by block.
Packed sequences
(cu_seqlens over the global sequence, batch 1): each block runs as one attention_varlen call
over the documents both shards hold, a document's rows against its keys (_packed_block);
with a window, per pair of chunks, the documents of a chunk against themselves as one
windowed call, and the one document two chunks can share as one call cut to the window
(_packed_window_blocks).
ALiBi over the global sequence: a call per pair of chunks; where its keys are its rows (a chunk
against itself) the kernels' ALiBi, else, keys all before or all after the rows, ALiBi split
into a key term passed as the call's attn_mask and a row term added to its lse
(_alibi_terms).
Dropout over the global sequence: a call per pair of chunks, as for ALiBi, each told where
its rows and keys stand in the whole sequence (the kernels' dropout counter counts from
there), so each rank drops exactly what one device running the whole sequence drops with
the same seed.
Generation over the shards a ring leaves: attention_with_sharded_kvcache (sharded_kvcache.py).
Limits: causal, windows, ALiBi, dropout and packed sequences need seqlen_q == seqlen_k
(self-attention); no dropout over packed sequences; the backward is not captured by
torch.compile (a torch.autograd.Function with communication inside).
"""

import functools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ._common import accumulator_dtype
from .cascade import merge_weights
from .interface import _check_inputs, _outputs, _seed_tensor  # registers torch.ops.longflash.*

LAYOUTS = ("zigzag", "contiguous")
# Sent across ranks as their index, to compare dtypes (unlisted ones compare as "other").
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_MAX_DIMS = 8  # of a tensor passed to unshard_sequence: its shape is sent padded to this length


# ----------------------------------------------------------------------------- the ring

class _Ring(NamedTuple):
    group: object
    rank: int        # in group
    world_size: int
    layout: str
    send_to: int     # global ranks of the neighbours
    recv_from: int


def _ring(group, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("longflash.parallel needs torch.distributed: call "
                           "torch.distributed.init_process_group first")
    group = dist.group.WORLD if group is None else group
    world_size = dist.get_world_size(group)
    if world_size <= 0:  # -1: this rank is not a member of group
        raise ValueError(f"group has no ranks that include this one (size {world_size}); pass a "
                         f"process group that this rank belongs to, or None for the default group")
    rank = dist.get_rank(group)
    peer = lambda r: dist.get_global_rank(group, r % world_size)  # noqa: E731
    return _Ring(group, rank, world_size, layout, peer(rank + 1), peer(rank - 1))


def _chunks_per_rank(layout):
    return 2 if layout == "zigzag" else 1


def _rank_chunks(ring, rank):
    """Indices of the global chunks that rank holds, in sequence order."""
    return (rank, 2 * ring.world_size - 1 - rank) if ring.layout == "zigzag" else (rank,)


def _exchange(ring, *tensors, shift=1):
    """Post: send tensors to the rank `shift` places on (default the next), receive as many
    of the same shapes from the rank `shift` places back. Returns (received, requests); the
    received tensors are valid after _wait."""
    if shift % ring.world_size == 0:
        return tensors, []
    send_to, recv_from = ring.send_to, ring.recv_from
    if shift != 1:
        send_to, recv_from = (dist.get_global_rank(ring.group, (ring.rank + s) % ring.world_size)
                              for s in (shift, -shift))
    received = [torch.empty_like(x) for x in tensors]
    ops = [dist.P2POp(dist.isend, x, send_to, ring.group) for x in tensors]
    ops += [dist.P2POp(dist.irecv, x, recv_from, ring.group) for x in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests):
    for req in requests:
        req.wait()


def _step_plan(ring, src, causal, seqlen):
    """What this rank computes against the k/v shard of rank src: (q rows, k/v rows, causal)
    as slices of the local shards, or None when causal masks every pair."""
    everything = slice(None)
    if not causal:
        return everything, everything, False
    if src == ring.rank:
        # Own shard: the chunks are in sequence order on both sides, so the local causal mask
        # is the global one (for zigzag, chunk 2P-1-r sees all of chunk r, r sees none of it).
        return everything, everything, True
    mine, theirs = _rank_chunks(ring, ring.rank), _rank_chunks(ring, src)
    rows = [i for i, a in enumerate(mine) if any(b < a for b in theirs)]
    cols = [j for j, b in enumerate(theirs) if any(b < a for a in mine)]
    if not rows:
        return None
    # Distinct chunks never share a diagonal; in both layouts the visible pairs form one
    # rectangle of whole chunks, computed without a mask.
    assert all(theirs[j] < mine[i] for i in rows for j in cols)
    chunk = seqlen // len(mine)
    return (slice(rows[0] * chunk, (rows[-1] + 1) * chunk),
            slice(cols[0] * chunk, (cols[-1] + 1) * chunk), False)


class _Block(NamedTuple):
    """One attention call of a ring step: query rows and key/value rows (slices of the local
    shard and of the shard in hand) and its mask (window sides < 0: unbounded; the kernels'
    rule, the diagonal aligned to the bottom right of the block). Packed sequences: rows and
    cols are index tensors (batch 1) and varlen the call's (cu_seqlens_q, cu_seqlens_k,
    max_seqlen_q, max_seqlen_k), one sequence per document that both sides hold. q_pos,
    k_pos: the global positions of the first row and the first key of a call per pair of
    chunks (where the call's dropout counts from, _dropout_of), -1 elsewhere (_step_plan's
    rectangles, a packed chunk against itself); apart: the pair's chunks differ, so its keys
    all precede or all follow its rows (ALiBi, _alibi_terms)."""
    rows: object
    cols: object
    causal: bool
    window_left: int = -1
    window_right: int = -1
    varlen: tuple = ()
    q_pos: int = -1
    k_pos: int = -1
    apart: bool = False


def _window_sides(causal, window, pairs=False):
    """The window's (left, right) sides over the global sequence (causal: right 0; < 0:
    unbounded), or None where there is no window (causal alone is _step_plan's) unless pairs
    (ALiBi, dropout: a call per pair of chunks all the same)."""
    if window[0] < 0 and (causal or window[1] < 0) and not pairs:
        return None
    return window[0], 0 if causal else window[1]


def _step_blocks(ring, src, causal, window, seqlen, pairs=False):
    """The calls this rank makes against the k/v shard of rank src. Without a window (and not
    pairs), _step_plan's one call (or none). With one, a call per pair of chunks (this rank's
    queries, src's keys) that the window lets see each other, its rows and keys cut to
    those the window reaches and its window moved to the chunks' distance (_window_span)."""
    sides = _window_sides(causal, window, pairs)
    if sides is None:
        plan = _step_plan(ring, src, causal, seqlen)
        return [] if plan is None else [_Block(*plan)]
    window_left, window_right = sides
    chunk = seqlen // _chunks_per_rank(ring.layout)
    blocks = []
    for x, a in enumerate(_rank_chunks(ring, ring.rank)):
        for y, b in enumerate(_rank_chunks(ring, src)):
            span = _window_span((a - b) * chunk, window_left, window_right, chunk, chunk)
            if span is not None:
                (r0, r1), (c0, c1), left, right = span
                blocks.append(_Block(slice(x * chunk + r0, x * chunk + r1),
                                     slice(y * chunk + c0, y * chunk + c1), False, left, right,
                                     (), a * chunk + r0, b * chunk + c0, a != b))
    return blocks


def _doc_ranges(ring, rank, docs, seqlen):
    """{document: (first, end)} local rows of each document that rank's shard holds. docs:
    the documents' global (start, end); seqlen: tokens per rank. A document is one run of
    the shard's rows: its chunks follow in sequence order, and a document that reaches two
    of them (zigzag) holds every token between them."""
    chunk = seqlen // _chunks_per_rank(ring.layout)
    ranges = {}
    for x, c in enumerate(_rank_chunks(ring, rank)):
        g0 = c * chunk
        for d, (start, end) in enumerate(docs):
            lo, hi = max(start, g0), min(end, g0 + chunk)
            if lo < hi:
                first, last = x * chunk + lo - g0, x * chunk + hi - g0
                ranges[d] = (ranges[d][0], last) if d in ranges else (first, last)
    return ranges


def _packed_block(ring, src, block, docs, seqlen, device):
    """A block of _step_blocks over packed sequences: within it, each document's rows see
    its keys only, as the block's mask says (a causal block is a rank's own: a document's
    rows and keys coincide there, so the bottom-right diagonal is the global one; the other
    blocks' keys all precede their rows, or the attention is not causal). None: no document
    on both sides."""
    mine, theirs = (_doc_ranges(ring, r, docs, seqlen) for r in (ring.rank, src))
    r0, r1, _ = block.rows.indices(seqlen)
    c0, c1, _ = block.cols.indices(seqlen)
    row_runs, col_runs = [], []
    for d in sorted(mine.keys() & theirs.keys()):
        qa, qb = max(mine[d][0], r0), min(mine[d][1], r1)
        ka, kb = max(theirs[d][0], c0), min(theirs[d][1], c1)
        if qa < qb and ka < kb:
            row_runs.append((qa, qb))
            col_runs.append((ka, kb))
    if not row_runs:
        return None
    (rows, cu_q, max_q), (cols, cu_k, max_k) = (_packed(r, device) for r in (row_runs, col_runs))
    return block._replace(rows=rows, cols=cols, varlen=(cu_q, cu_k, max_q, max_k))


def _packed(runs, device):
    """runs ((first, end), ...) of rows -> (their index tensor, cu_seqlens, longest run)."""
    lengths = [b - a for a, b in runs]
    index = torch.cat([torch.arange(a, b) for a, b in runs]).to(device)
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)
    return index, cu_seqlens, max(lengths)


def _packed_window_blocks(ring, src, window_left, window_right, seqlen, docs, device):
    """The calls against the k/v shard of rank src with a window over packed sequences, per
    pair of chunks (this rank's queries, src's keys). A chunk against itself: its documents as
    one attention_varlen call under the window (each document's rows are its keys there, so
    each one's bottom-right diagonal is the global one). Two chunks: documents are runs of the
    sequence, so at most one holds tokens of both; its rows against its keys as one call, cut
    to what the window reaches over their global distance (_window_span)."""
    chunk = seqlen // _chunks_per_rank(ring.layout)
    blocks = []
    for x, a in enumerate(_rank_chunks(ring, ring.rank)):
        for y, b in enumerate(_rank_chunks(ring, src)):
            runs = [(max(start, a * chunk), min(end, (a + 1) * chunk),
                     max(start, b * chunk), min(end, (b + 1) * chunk)) for start, end in docs]
            runs = [(qa, qb, ka, kb) for qa, qb, ka, kb in runs if qa < qb and ka < kb]
            local_q, local_k = (x - a) * chunk, (y - b) * chunk  # global -> local row
            if a == b and runs:
                (rows, cu_q, max_q), (cols, cu_k, max_k) = (
                    _packed([(lo + local_q, hi + local_q) for lo, hi, _, _ in runs], device),
                    _packed([(lo + local_k, hi + local_k) for _, _, lo, hi in runs], device))
                blocks.append(_Block(rows, cols, False, window_left, window_right,
                                     (cu_q, cu_k, max_q, max_k)))
            elif runs:
                (qa, qb, ka, kb), = runs
                span = _window_span(qa - ka, window_left, window_right, qb - qa, kb - ka)
                if span is not None:
                    (r0, r1), (c0, c1), left, right = span
                    blocks.append(_Block(slice(qa + local_q + r0, qa + local_q + r1),
                                         slice(ka + local_k + c0, ka + local_k + c1), False,
                                         left, right, (), qa + r0, ka + c0, True))
    return blocks


def _calls(ring, src, causal, window, seqlen, docs, device, pairs=False):
    """The blocks of a step (_step_blocks), over packed sequences if docs is not None; with
    pairs, a call per pair of chunks (ALiBi and dropout need each call's rows and keys to be
    runs of the global sequence)."""
    sides = _window_sides(causal, window, pairs=pairs)
    if docs is not None and sides is not None:
        return _packed_window_blocks(ring, src, *sides, seqlen, docs, device)
    blocks = _step_blocks(ring, src, causal, window, seqlen, pairs=pairs)
    if docs is None:
        return blocks
    blocks = [_packed_block(ring, src, b, docs, seqlen, device) for b in blocks]
    return [b for b in blocks if b is not None]


def _lanes(ring, causal, window, seqlen):
    """The ring's lanes, ((direction, last step), ...), the same on every rank (a function of
    the ring's shape and the options alone). The forward lane (direction +1): at step t = 0 ..
    last, rank r holds the shard of rank r - t, received from r - 1. With a window, maybe also
    a backward lane (-1): at step t = 1 .. last, the shard of rank r + t, received from r + 1,
    at the same steps as the forward lane's (both directions of each link busy at once).

    Without a window: the whole ring forward, ((1, P - 1),). With one: the fewest transfers of
    a shard that bring every rank each shard its window reaches (ties: the forward lane
    longer), after which the shards stop travelling. A causal window within a chunk: one step
    forward over the contiguous layout; one each way over zigzag, whose second chunk 2P-1-r
    needs chunk 2P-2-r, held by rank r + 1 (one way only: the whole ring)."""
    if window == (-1, -1):
        return ((1, ring.world_size - 1),)
    return _window_lanes(ring.world_size, ring.layout, causal, window, seqlen)


@functools.lru_cache(maxsize=64)  # O(P^2) chunk pairs, the same at every layer and step
def _window_lanes(world_size, layout, causal, window, seqlen):
    ring = _Ring(None, 0, world_size, layout, None, None)
    needed = {step for rank in range(world_size) for step in range(1, world_size)
              if _step_blocks(ring._replace(rank=rank), (rank - step) % world_size, causal,
                              window, seqlen)}

    def backward_steps(forward):  # what the forward lane's first `forward` steps leave
        return max((world_size - s for s in needed if s > forward), default=0)

    forward = min(range(world_size), key=lambda f: (f + backward_steps(f), -f))
    backward = backward_steps(forward)
    return ((1, forward),) + (((-1, backward),) if backward else ())


def _lane_srcs(ring, lanes, step):
    """(direction, src) of each lane that computes at this step: the rank whose shard it
    holds. The backward lane starts at step 1 (its step 0 is the forward lane's: this rank's
    own shard)."""
    return [(direction, (ring.rank - direction * step) % ring.world_size)
            for direction, last in lanes if step <= last and (direction == 1 or step > 0)]


def _post_shards(ring, lanes, held, step):
    """Each lane's next shard, posted before this step's compute, which the transfer overlaps:
    {direction: (received, requests)}."""
    return {direction: _exchange(ring, *held[direction], shift=direction)
            for direction, last in lanes if step < last}


def _next_shards(held, posted):
    for direction, (received, requests) in posted.items():
        _wait(requests)
        held[direction] = received


def _window_span(offset, window_left, window_right, n_rows, n_keys):
    """A run of n_rows queries whose first stands `offset` tokens after the first of a run of
    n_keys keys sees key j from query i (local indices) iff lo <= j - i <= hi, lo = offset -
    window_left, hi = offset + window_right (a side < 0 unbounded). As one call with the
    kernels' window rule: ((first row, end), (first key, end), window_left, window_right), or
    None if no pair is visible. The rows that see no key and the keys that no row sees are
    cut (a window whose lower side lies right of the diagonal, lo > 0, leaves out the last lo
    rows and the first lo keys; one whose upper side lies left of it, hi < 0, the first -hi
    rows and the last -hi keys), so the block's diagonal, aligned to its bottom right, is
    where the window's sides put it; a side that bounds no pair left is unbounded (-1), so the
    kernels mask no block for it."""
    lo = -math.inf if window_left < 0 else offset - window_left
    hi = math.inf if window_right < 0 else offset + window_right
    r0, r1 = max(0, -hi), min(n_rows, n_keys - lo)
    c0, c1 = max(0, lo), min(n_keys, n_rows + hi)
    if r0 >= r1 or c0 >= c1:
        return None
    rows, keys = r1 - r0, c1 - c0
    lo, hi = lo + r0 - c0, hi + r0 - c0  # in the cut block's indices
    left = -1 if lo <= 1 - rows else keys - rows - lo
    right = -1 if hi >= keys - 1 else hi - (keys - rows)
    return (r0, r1), (c0, c1), left, right


# ----------------------------------------------------------------------------- forward / backward

def _alibi_terms(slopes, block, n_rows, n_keys, dtype):
    """ALiBi's bias -slope * |p - s| of a call whose keys (global positions s) all precede or
    all follow its rows (positions p), the kernels' ALiBi being aligned to a block's bottom
    right, as a row term plus a key term: with r the key nearest the rows, |p - s| = |p - r| +
    |r - s|. The key term is passed as an attn_mask (batch or 1, nheads, 1, n_keys), read in
    place; the row term (batch or 1, nheads, n_rows), the same for every key of a row, leaves
    the row's softmax alone and is added to its lse (forward) or taken from the final lse
    (backward). The key term is 0 at the nearest key and falls away from it, so the keys that
    weigh most carry the least rounding."""
    p = block.q_pos + torch.arange(n_rows, device=slopes.device, dtype=dtype)
    s = block.k_pos + torch.arange(n_keys, device=slopes.device, dtype=dtype)
    r = s[-1] if block.k_pos < block.q_pos else s[0]
    slopes = slopes.to(dtype).reshape(-1, slopes.shape[-1], 1)  # (batch or 1, nheads, 1)
    return -slopes * (p - r).abs(), (-slopes * (r - s).abs())[:, :, None, :]


def _alibi_of(alibi_slopes, block, n_rows, n_keys, dtype):
    """(the call's alibi_slopes, its attn_mask, the row term) for one block: the kernels'
    ALiBi where rows and keys are the same positions (a chunk against itself), else
    _alibi_terms."""
    if alibi_slopes is None or not block.apart:
        return alibi_slopes, None, None
    row, key = _alibi_terms(alibi_slopes, block, n_rows, n_keys, dtype)
    return None, key, row


def _dropout_of(dropout, block):
    """The dropout arguments of one block's call: dropout = (dropout_p, seed); the seed passed
    with the block's global first row and key (the ops' (3,) seed), so that each call drops
    exactly what attention over the whole sequence drops there, on any number of ranks."""
    dropout_p, seed = dropout
    if dropout_p == 0:
        return {}
    assert block.q_pos >= 0 and block.k_pos >= 0, block  # a call per pair of chunks
    return dict(dropout_p=dropout_p,
                seed=torch.tensor([seed, block.q_pos, block.k_pos], dtype=torch.int64))


def _pairs(alibi_slopes, dropout):
    return alibi_slopes is not None or dropout[0] > 0


def _merge_(o, lse, o_blk, lse_blk):
    """In place: (o, lse) <- attention over the keys behind (o, lse) and behind (o_blk, lse_blk).

    o: (B, N, H, Dv) and lse: (B, H, N) in the accumulator dtype (float32, or float64);
    o_blk in the input dtype. o = (e^lse o + e^lse_blk o_blk) / e^lse_new.
    """
    w, w_blk, lse_new = merge_weights(lse, lse_blk)  # cascade.merge_attention's, in place
    w, w_blk = (x.transpose(1, 2).unsqueeze(-1) for x in (w, w_blk))  # (B, N, H, 1)
    o.mul_(w).add_(o_blk.to(o.dtype) * w_blk)
    lse.copy_(lse_new)


def _take(x, index, dim, varlen):
    """x's rows index (slice or index tensor) along dim; packed (batch 1): without batch."""
    x = x[(slice(None),) * dim + (index,)]
    return x[0] if varlen else x


def _ring_forward(q, k, v, causal, softmax_scale, backend, ring, window, softcap, docs,
                  alibi_slopes, dropout):
    batch, seqlen_q, nheads, _ = q.shape
    acc = accumulator_dtype(q.dtype)
    o = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)  # v's head dim
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=acc, device=q.device)
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    lanes = _lanes(ring, causal, window, k.shape[1])
    held = {direction: (k, v) for direction, _ in lanes}  # the shard in hand in each lane
    for step in range(max(last for _, last in lanes) + 1):
        posted = _post_shards(ring, lanes, held, step)
        for direction, src in _lane_srcs(ring, lanes, step):
            k_in, v_in = held[direction]
            for b in _calls(ring, src, causal, window, k.shape[1], docs, q.device,
                            _pairs(alibi_slopes, dropout)):
                packed = bool(b.varlen)
                q_blk, k_blk = _take(q, b.rows, 1, packed), _take(k_in, b.cols, 1, packed)
                alibi, key_bias, row_bias = _alibi_of(alibi_slopes, b, q_blk.shape[-3],
                                                      k_blk.shape[-3], acc)
                o_blk, lse_blk = torch.ops.longflash.attention_forward(
                    q_blk, k_blk, _take(v_in, b.cols, 1, packed), b.causal, softmax_scale,
                    backend, b.window_left, b.window_right, alibi, softcap,
                    *((0.0, None, *b.varlen) if packed else ()), attn_mask=key_bias,
                    **_dropout_of(dropout, b))
                if row_bias is not None:
                    lse_blk = lse_blk + row_bias
                if packed:  # rows gathered: merged, then written back
                    o_rows, lse_rows = o[:, b.rows], lse[:, :, b.rows]
                    _merge_(o_rows, lse_rows, o_blk[None], lse_blk[None])
                    o[:, b.rows], lse[:, :, b.rows] = o_rows, lse_rows
                else:
                    _merge_(o[:, b.rows], lse[:, :, b.rows], o_blk, lse_blk)
        _next_shards(held, posted)
    return o.to(q.dtype), lse


def _ring_backward(do, dlse, q, k, v, o, lse, causal, softmax_scale, backend, ring, window,
                   softcap, docs, alibi_slopes, dropout):
    acc = accumulator_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k, v = k.contiguous(), v.contiguous()
    lanes = _lanes(ring, causal, window, k.shape[1])
    held = {direction: (k, v) for direction, _ in lanes}
    # dk, dv of the shard in hand travel along its lane with it, in float32 (each rank adds
    # its blocks' terms: a low-precision sum would round once per rank), back to the shard's
    # owner after the lane's last step. Each lane's first accumulators start here, at zero:
    # {direction: ((dk, dv), requests)}.
    travelling = {direction: ([torch.zeros(x.shape, dtype=acc, device=x.device)
                               for x in (k, v)], []) for direction, _ in lanes}
    for step in range(max(last for _, last in lanes) + 1):
        posted = _post_shards(ring, lanes, held, step)
        for direction, src in _lane_srcs(ring, lanes, step):
            k_in, v_in = held[direction]
            grads = []
            for b in _calls(ring, src, causal, window, k.shape[1], docs, q.device,
                            _pairs(alibi_slopes, dropout)):
                rows, packed = b.rows, bool(b.varlen)
                rows_of = lambda x: _take(x, rows, 1, packed)  # noqa: E731
                q_blk, k_blk, lse_blk = rows_of(q), _take(k_in, b.cols, 1, packed), \
                    _take(lse, rows, 2, packed)
                alibi, key_bias, row_bias = _alibi_of(alibi_slopes, b, q_blk.shape[-3],
                                                      k_blk.shape[-3], acc)
                if row_bias is not None:  # the final lse less this block's row term
                    lse_blk = lse_blk - row_bias
                dq_blk, dk_blk, dv_blk, _ = torch.ops.longflash.attention_backward(
                    rows_of(do), q_blk, k_blk, _take(v_in, b.cols, 1, packed), rows_of(o),
                    lse_blk, None if dlse is None else _take(dlse, rows, 2, packed), b.causal,
                    softmax_scale, backend, b.window_left, b.window_right, alibi, softcap,
                    *((0.0, None, *b.varlen) if packed else ()), attn_mask=key_bias,
                    **_dropout_of(dropout, b))
                if packed:  # (rows, H, D) of batch 1
                    dq_blk, dk_blk, dv_blk = dq_blk[None], dk_blk[None], dv_blk[None]
                dq[:, rows] += dq_blk
                grads.append((b.cols, dk_blk, dv_blk))
            (dk, dv), requests = travelling[direction]
            _wait(requests)
            for cols, dk_blk, dv_blk in grads:
                dk[:, cols] += dk_blk
                dv[:, cols] += dv_blk
            # on along the lane; after its last step, back to the shard's owner, src (the next
            # rank when the shards went the whole ring)
            shift = -direction * step if step == dict(lanes)[direction] else direction
            travelling[direction] = _exchange(ring, dk, dv, shift=shift)
        _next_shards(held, posted)
    for _, requests in travelling.values():  # each lane's share of dk, dv, back home
        _wait(requests)
    (dk, dv), *others = [dkv for dkv, _ in travelling.values()]
    for dk_lane, dv_lane in others:
        dk += dk_lane
        dv += dv_lane
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, backend, ring, window, softcap, docs,
                alibi_slopes, dropout):
        o, lse = _ring_forward(q, k, v, causal, softmax_scale, backend, ring, window, softcap,
                               docs, alibi_slopes, dropout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, softmax_scale, backend, ring, window, softcap, docs, alibi_slopes,
                    dropout)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient, not a zero one
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do
        dq, dk, dv = _ring_backward(do, dlse, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, *(None,) * 9


# ----------------------------------------------------------------------------- checks

def _check_seqlen(name, x, ring):
    per_rank = _chunks_per_rank(ring.layout)
    if x.shape[1] % per_rank:
        raise ValueError(f"{name} has {x.shape[1]} tokens on this rank; layout {ring.layout!r} "
                         f"needs a multiple of {per_rank} (the global seqlen a multiple of "
                         f"{per_rank * ring.world_size}, {per_rank} chunks per rank): pad the "
                         f"sequence")


def _check_cu_seqlens(cu_seqlens, q, k, ring):
    """The documents' global (start, end), from a checked cu_seqlens (one read to the host)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
            cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.numel() < 2:
        raise TypeError(f"cu_seqlens must be a 1-D int32 / int64 tensor of (documents + 1) "
                        f"offsets, got {getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                        f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if q.shape[0] != 1 or q.shape[1] != k.shape[1]:
        raise ValueError(f"cu_seqlens (packed sequences) needs batch 1 and seqlen_q == seqlen_k, "
                         f"got q {tuple(q.shape)} and k {tuple(k.shape)}")
    offsets = cu_seqlens.tolist()
    total = q.shape[1] * ring.world_size
    decreasing = any(b < a for a, b in zip(offsets, offsets[1:]))
    if offsets[0] != 0 or offsets[-1] != total or decreasing:
        raise ValueError(f"cu_seqlens must go from 0 to the global seqlen {total} (this rank's "
                         f"{q.shape[1]} tokens x {ring.world_size} ranks), non-decreasing, got "
                         f"{offsets[:4]}{' ...' if len(offsets) > 4 else ''} ending at "
                         f"{offsets[-1]}")
    return tuple((a, b) for a, b in zip(offsets, offsets[1:]) if b > a)


def _fingerprint(docs):
    """A few numbers that differ when two ranks' documents differ (for the all_gather)."""
    if docs is None:
        return (-1.0, -1.0)
    return (float(len(docs)), float(sum(i * (b - a) for i, (a, b) in enumerate(docs))))


def _slopes_fingerprint(slopes):
    """Three numbers that differ when two ranks' ALiBi slopes differ (one read to the host;
    always three, as every rank's all_gather must be of one size)."""
    if slopes is None:
        return (0.0, 0.0, 0.0)
    x = slopes.detach().double().flatten()
    weights = torch.arange(1, len(x) + 1, dtype=torch.float64, device=x.device)
    return (float(len(x)), *(float(t) for t in torch.stack([x.sum(), (x * weights).sum()])))


def _ring_seed(ring, dropout_p, seed, generator, device):
    """The dropout seed (an int, None without dropout), the same on every rank: seed, else one
    drawn from generator on the group's first rank and broadcast to the others."""
    if dropout_p == 0:
        return None
    if seed is not None:
        return seed
    drawn = _seed_tensor(dropout_p, None, generator).reshape(1)
    if ring.world_size > 1:
        drawn = drawn.to(device)  # NCCL sends CUDA tensors only
        dist.broadcast(drawn, src=dist.get_global_rank(ring.group, 0), group=ring.group)
    return int(drawn.item())


def _dtype_code(dtype):
    return (_DTYPES.index(dtype) if dtype in _DTYPES else len(_DTYPES),)


def _show(name, values):
    if name == "dtype":
        return _DTYPES[int(values[0])] if values[0] < len(_DTYPES) else "another dtype"
    return tuple(int(x) if x.is_integer() else x for x in values if x != -1)


def _check_same_on_all_ranks(ring, device, **meta):
    """Raise ValueError on every rank if meta (name -> tuple of numbers) differs between ranks.
    One small all_gather, so that a mismatch fails loudly instead of corrupting the result."""
    if ring.world_size == 1:
        return
    mine = torch.tensor([float(x) for value in meta.values() for x in value],
                        dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ring.world_size)]
    dist.all_gather(gathered, mine, group=ring.group)
    names = [name for name, value in meta.items() for _ in value]  # one per number
    for other_rank, other in enumerate(gathered):
        differ = (other != mine).nonzero()
        if len(differ):
            name = names[differ[0].item()]
            a, b = ([x for n, x in zip(names, t.tolist()) if n == name] for t in (mine, other))
            raise ValueError(f"{name} differs across ranks: {_show(name, a)} on rank {ring.rank},"
                             f" {_show(name, b)} on rank {other_rank}; every rank must pass "
                             f"shards of the same shape, dtype and options")


# ----------------------------------------------------------------------------- public API

def ring_attention(q, k, v, causal=False, softmax_scale=None, group=None, layout="zigzag",
                   return_lse=False, backend="auto", *, window_size=(-1, -1), softcap=0.0,
                   alibi_slopes=None, learnable_sink=None, cu_seqlens=None, dropout_p=0.0,
                   seed=None, generator=None):
    """Exact attention over a sequence sharded across the ranks of a process group.

    Call it on every rank of group with this rank's shards (see `shard_sequence`):
        q: (batch, seqlen_q / P, nheads, headdim)
        k, v: (batch, seqlen_k / P, nheads_kv, headdim); nheads % nheads_kv == 0 (GQA / MQA);
            v's headdim may differ, as in `longflash.attention`
    causal: over the global sequence, as in `longflash.attention`; needs seqlen_q == seqlen_k.
    softmax_scale: default 1 / sqrt(headdim).
    group: the process group (default: the default group); P = its size.
    layout: how the global sequence is sharded, "zigzag" (balanced causal work, the default)
        or "contiguous"; must match the layout of shard_sequence / unshard_sequence. The
        global seqlen must be divisible by 2P (zigzag) or P (contiguous).
    return_lse, backend: as in `longflash.attention` (backend runs each block).
    window_size: (left, right) over the global sequence, as in `longflash.attention` (sliding
        window; with causal, right is 0); needs seqlen_q == seqlen_k. Each step computes only
        the chunk pairs the window reaches, and a shard travels only as far as some rank's
        window reaches it, sent both ways round the ring at once where that takes fewer
        transfers: a causal window within a chunk takes two steps and one transfer of each
        shard over the contiguous layout, two (one each way) over zigzag, whose second chunk's
        predecessor is on the next rank; a two-sided window, one each way.
    softcap: as in `longflash.attention` (each block's scores capped as they are computed).
    alibi_slopes: (nheads,) or (batch, nheads) float32, the same on every rank, as in
        `longflash.attention`: -slope * |i - j| over the global sequence's positions (needs
        seqlen_q == seqlen_k). Each step then computes a call per pair of chunks (not the one
        rectangle of the causal plan).
    Returns o: (batch, seqlen_q / P, nheads, headdim of v), this rank's shard of the output, and if
        return_lse, lse: (batch, nheads, seqlen_q / P), float32 (float64 for float64 inputs).
    Differentiable in q, k, v (and through lse); the backward runs the ring again.
    learnable_sink: (nheads,) attention sinks, as in `longflash.attention`, the same on every
        rank, applied to the merged output and lse; its gradient on each rank is that rank's
        rows' share (sum it over the group, as for any parameter replicated across shards).
    cu_seqlens: packed sequences (documents) over the global sequence: (documents + 1,)
        int32 / int64 offsets from 0 to the global seqlen, non-decreasing, the same on every
        rank (as attention_varlen's cu_seqlens_q, here for both sides); batch must be 1 and
        seqlen_q == seqlen_k. Each token attends within its document only (causal: to the
        document's tokens up to itself). Each block of a step runs as one attention_varlen
        call over the documents both shards hold; a rank that holds no part of a document
        in hand skips it. With window_size, the window applies within each document.
    dropout_p, seed, generator: attention dropout as in `longflash.attention`, over the global
        sequence: each rank drops exactly the weights that `longflash.attention` on the whole
        sequence drops with the same seed (a mask of the global query and key positions), so
        the result does not depend on the number of ranks or the layout. seed: an int, the
        same on every rank; None draws one from generator (default torch's global one) on the
        group's first rank and broadcasts it (one more small collective). As with ALiBi, each
        step then computes a call per pair of chunks. Needs seqlen_q == seqlen_k; not with
        cu_seqlens.

    Raises, before any communication: the errors of `longflash.attention`; ValueError for an
    unknown layout, a seqlen that the layout cannot split, a group this rank is not in;
    NotImplementedError for causal, a window, ALiBi or dropout with seqlen_q != seqlen_k, and
    for dropout with cu_seqlens; cu_seqlens: the errors above (TypeError / ValueError naming
    it). Then, on every rank, ValueError if shapes, dtype, causal, softmax_scale, window_size,
    softcap, alibi_slopes, dropout_p, seed, layout, backend or cu_seqlens differ between ranks
    (checked with one all_gather of a few numbers).
    """
    ring = _ring(group, layout)
    softmax_scale, backend = _check_inputs(q, k, v, causal, softmax_scale, backend,
                                           window_size=window_size, softcap=softcap,
                                           alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                           seed=seed, generator=generator,
                                           learnable_sink=learnable_sink)
    window = tuple(int(x) for x in window_size)
    _check_seqlen("q", q, ring)
    _check_seqlen("k", k, ring)
    needs_self = causal or window != (-1, -1) or alibi_slopes is not None or dropout_p > 0
    if needs_self and q.shape[1] != k.shape[1]:
        what = ("causal=True" if causal else f"window_size={window}" if window != (-1, -1)
                else "alibi_slopes" if alibi_slopes is not None else "dropout_p")
        raise NotImplementedError(f"ring_attention with {what} needs seqlen_q == seqlen_k "
                                  f"(self-attention), got {q.shape[1]} and {k.shape[1]} per rank")
    if dropout_p > 0 and cu_seqlens is not None:
        raise NotImplementedError("ring_attention has no dropout over packed sequences "
                                  "(cu_seqlens): set dropout_p=0")
    docs = None if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, q, k, ring)
    seed = _ring_seed(ring, dropout_p, seed, generator, q.device)
    _check_same_on_all_ranks(ring, q.device, q_shape=q.shape, k_shape=k.shape, v_shape=v.shape,
                             dtype=_dtype_code(q.dtype), causal=(causal,),
                             softmax_scale=(softmax_scale,), window_size=window,
                             softcap=(float(softcap),), layout=(LAYOUTS.index(layout),),
                             backend=(("triton", "torch").index(backend),),
                             cu_seqlens=_fingerprint(docs),
                             alibi_slopes=_slopes_fingerprint(alibi_slopes),
                             dropout_p=(float(dropout_p),),
                             seed=(0, 0) if seed is None else (seed & 0xFFFFFFFF, seed >> 32))
    o, lse = _RingAttention.apply(q, k, v, causal, softmax_scale, backend, ring, window,
                                  float(softcap), docs, alibi_slopes, (float(dropout_p), seed))
    return _outputs(o, lse, learnable_sink, return_lse)


def shard_sequence(x, layout="zigzag", group=None):
    """This rank's shard of a full (batch, seqlen, ...) tensor: (batch, seqlen / P, ...).

    The chunks of `layout` that this rank holds, concatenated in sequence order (for zigzag,
    chunks r and 2P-1-r of 2P). No communication: every rank passes the same full tensor.
    ValueError if seqlen is not divisible by the layout's chunk count (P or 2P).
    """
    ring = _ring(group, layout)
    n_chunks = _chunks_per_rank(layout) * ring.world_size
    if x.dim() < 2 or x.shape[1] % n_chunks:
        raise ValueError(f"x must be (batch, seqlen, ...) with seqlen divisible by {n_chunks} "
                         f"(layout {layout!r} on {ring.world_size} ranks), got shape "
                         f"{tuple(x.shape)}: pad the sequence")
    chunks = x.split(x.shape[1] // n_chunks, dim=1)
    return torch.cat([chunks[i] for i in _rank_chunks(ring, ring.rank)], dim=1)


def shard_positions(seqlen_local, layout="zigzag", group=None, device=None):
    """(seqlen_local,) int64: the global positions of the tokens of this rank's shard
    (`shard_sequence`'s), in order: what position-dependent code on the shard needs (rotary
    embeddings, position ids), since with zigzag a shard is two runs of the sequence.
    ValueError if seqlen_local is not a multiple of the layout's chunks per rank."""
    ring = _ring(group, layout)
    per_rank = _chunks_per_rank(layout)
    if seqlen_local % per_rank:
        raise ValueError(f"seqlen_local must be a multiple of {per_rank} (layout {layout!r}), "
                         f"got {seqlen_local}")
    chunk = seqlen_local // per_rank
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in _rank_chunks(ring, ring.rank)])


def unshard_sequence(x_local, layout="zigzag", group=None):
    """The full (batch, seqlen, ...) tensor, on every rank, from each rank's (batch, seqlen / P,
    ...) shard: the inverse of `shard_sequence` (one all_gather; not differentiable).

    ValueError, on every rank, if the shards differ in shape or dtype across ranks.
    """
    ring = _ring(group, layout)
    if not 2 <= x_local.dim() <= _MAX_DIMS:
        raise ValueError(f"x_local must be (batch, seqlen / P, ...) with at most {_MAX_DIMS} "
                         f"dimensions, got shape {tuple(x_local.shape)}")
    _check_seqlen("x_local", x_local, ring)
    shape = tuple(x_local.shape) + (-1,) * (_MAX_DIMS - x_local.dim())  # same length everywhere
    _check_same_on_all_ranks(ring, x_local.device, shape=shape, dtype=_dtype_code(x_local.dtype))
    x_local = x_local.contiguous()
    shards = [torch.empty_like(x_local) for _ in range(ring.world_size)]
    dist.all_gather(shards, x_local, group=ring.group)
    chunks = {}
    for rank, shard in enumerate(shards):
        pieces = shard.chunk(_chunks_per_rank(layout), dim=1)
        chunks.update(zip(_rank_chunks(ring, rank), pieces))
    return torch.cat([chunks[i] for i in sorted(chunks)], dim=1)


# Decoding over a KV cache sharded across the group: a module of its own, on the helpers above.
from .sharded_kvcache import attention_with_sharded_kvcache  # noqa: E402,F401
