"""Hugging Face transformers: run a model's attention layers with LongFlash.

    import longflash.integrations.transformers
    longflash.integrations.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="LongFlash")

`register()` adds two functions to transformers' registries, both under the name
"LongFlash" (transformers is imported there, not when longflash is imported). Not
"longflash": transformers takes every name containing "flash" for a FlashAttention
kernel to fetch from the hub, and fails.

- an attention function (`AttentionInterface`). Every model that dispatches its attention
  through the registry (Llama, Qwen2, Mistral, GPT-2, ...) calls it per layer with
      query: (batch, nheads, seqlen_q, headdim)
      key, value: (batch, nheads_kv, seqlen_k, headdim), value's headdim may differ (MLA:
          DeepSeek-V3's 192 and 128)
  and the layer's mask, and gets back (attn_output (batch, seqlen_q, nheads, headdim of
  value), None),
  computed by `longflash.attention` or, for padded batches, `longflash.attention_varlen`.
  GQA runs without repeating key and value. `scaling`, `dropout` (training only, as the
  model passes it) and `softcap` are honoured.
- a mask function (`AttentionMaskInterface`): what the model's `create_causal_mask` /
  `create_bidirectional_mask` build for this implementation. It is required: for a name
  with no mask function, transformers passes the attention no mask at all, and padding
  would be silently ignored.

Masks, exactly. On every query that is not padding, a layer computes what the eager
implementation computes:
- causal or full (bidirectional) attention with a 2D padding `attention_mask` (the usual
  case): the mask function returns a `PaddingMask` holding the (batch, seqlen_k) key
  validity, O(seqlen) memory. Without padding, `longflash.attention` runs on the batch.
  With padding (left, right, or both; with or without a KV cache) the valid tokens of each
  sequence are packed and `longflash.attention_varlen` runs, its causal mask aligned to
  each sequence's end. In transformers' causal mask a query sees the keys up to its own
  position; packed, that is the bottom-right rule exactly when the valid keys after a
  sequence's first valid query are its valid queries (true for padding and caches); this
  is checked, O(batch * seqlen); otherwise (valid keys after the queries, as in a cache
  longer than the tokens seen) transformers' dense mask runs as below.
- packed sequences (transformers detects them from position_ids that restart, with no
  attention_mask and no cache: padding-free training batches), sliding windows and chunked
  attention (Llama 4's chunked layers: causal within each chunk), with or without padding,
  on queries that are the keys (training, a prefill): the mask function
  returns a `SegmentMask`, found by building transformers' mask a few rows at a time and
  reducing each row that is not padding to the run of keys it sees (O(seqlen) memory,
  O(seqlen^2) cheap comparisons once per forward); if every such row is causal (optionally
  within a sliding window) or full attention within its sequence, exactly, the sequences
  run as `longflash.attention_varlen`'s (the tokens that are not padding packed) and no
  N x N mask is ever built.
- any other mask function (overlays such as image tokens, a window over padding between
  tokens, a window or chunks past a prefill: decoding steps, whose masks are a row a query),
  and a 4D mask passed by the user: the mask is materialized as for sdpa, a
  (batch, 1, seqlen_q, seqlen_k) boolean (O(seqlen^2) memory,
  as sdpa needs), and read exactly: if it equals valid_q x valid_k x (full | causal |
  causal with the layer's `sliding_window`), aligned per sequence, where valid_q are the
  rows that see some key and valid_k the keys that some row sees (every row that sees a
  key is compared), the valid tokens are packed as above; otherwise (packed sequences in a
  user's 4D mask, chunks, overlays, a window over padding between tokens, a float mask
  with other values than 0 and the dtype's minimum: an attention bias) the kernels read the
  mask itself as `attn_mask`, tile by tile (`longflash.attention`). A float mask's dtype
  minimum then counts as -inf (in float32 and bfloat16; float16's is finite, as in eager).
  A mask of another shape or dtype raises NotImplementedError naming what was found.
- padding queries give output 0: a query whose own token is padding (2D padding mask),
  or a row that sees no key (4D mask). Eager gives such rows an average over masked keys
  (left padding) or attention over the valid keys (right padding); no other position
  sees them, so the logits and gradients of the valid positions are those of eager.
- no mask at all (a model that builds none): causal from the `is_causal` argument or
  `module.is_causal`, sliding window from the `sliding_window` argument, as transformers'
  FlashAttention-2 path does.

Under torch.compile (fullgraph=True), a graph holds no data-dependent size nor branch on the
mask's values, so nothing is packed or compared there: a `PaddingMask` runs with its valid
keys as a broadcast `attn_mask` beside bottom-right causal (O(seqlen)) or, where the queries
are not the last keys (a static cache), transformers' dense mask, padding queries zeroed as
packed; a 4D mask is read by the kernels as it is; a `SegmentMask` (made outside the graph:
generate() builds a static cache's masks before the compiled forward and passes them in)
runs as its dense mask. The mask function returns a PaddingMask or SegmentMask passed back to
it as it is (`ndim` 4 keeps transformers from reading them as 2D padding masks).

Attention sinks (gpt-oss: the `s_aux` argument, or `module.sinks`) run as LongFlash's
`learnable_sink`, forward and backward. `position_bias` (T5's relative position bias, learned)
runs as a float `attn_mask`, its gradient included (with padding, added to the layer's mask
made dense). `output_attentions=True` returns no weights (None), as sdpa.

Tested with transformers 5.23 (mask functions called with q_length / q_offset); the
older call with cache_position (transformers 5.0) is handled too.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..interface import BACKENDS, attention, attention_varlen

# Not "longflash": transformers treats every implementation whose name contains the
# lowercase substring "flash" as a FlashAttention kernel to be loaded from its hub.
NAME = "LongFlash"
_backend = "auto"
# transformers.masking_utils, imported once (by register()): not inside a compiled graph, where
# torch 2.11's Dynamo cannot import from transformers' lazy top-level module
_masking_utils = None


def _masking():
    global _masking_utils
    if _masking_utils is None:
        from transformers import masking_utils
        _masking_utils = masking_utils
    return _masking_utils


@dataclass(frozen=True)
class PaddingMask:
    """What the "LongFlash" mask function gives each attention layer instead of an N x N mask.

    valid_k: (batch, seqlen_k) bool, True for a real (not padding) key; None: no padding.
    causal: transformers' causal rule (query at key position t sees keys <= t) or full.
    q_offset: key position of query 0 (seqlen_k - seqlen_q when the queries are the last
        tokens, as in a forward pass or a decoding step).
    """
    valid_k: Optional[torch.Tensor]
    causal: bool
    q_offset: int

    ndim = 4  # it stands for a (batch, 1, seqlen_q, seqlen_k) mask (see longflash_mask)


@dataclass(frozen=True)
class SegmentMask:
    """What the "LongFlash" mask function gives each attention layer for a mask that is, in
    every batch row, independent sequences one after the other, each with causal (optionally
    sliding-window) or full attention, on the tokens that are not padding: packed sequences
    (padding-free batches, detected by transformers from position_ids that restart), and
    sliding windows with or without padding. Found by reading the mask transformers defines
    a few rows at a time (`_segments`), O(seqlen) memory; the attention runs
    `longflash.attention_varlen` over the segments of the tokens that are not padding,
    packed row after row.

    valid: (batch, seqlen) bool, False for a padding token (seen by no query, output 0).
    cu_seqlens: (segments + 1,) int32, over the packed tokens.
    max_seqlen: the longest segment.
    causal, window_left: within each segment (window_left -1: unbounded).
    first_key, last_key: (tokens,) the run of packed keys each packed query sees (`dense`).
    """
    valid: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    causal: bool
    window_left: int
    first_key: torch.Tensor
    last_key: torch.Tensor

    ndim = 4  # as PaddingMask's

    @property
    def padded(self):
        return self.first_key.numel() < self.valid.numel()

    def dense(self):
        """The mask as transformers defines it on the tokens that are not padding (padding
        queries see no key), (batch, 1, seqlen, seqlen) bool, O(seqlen^2)."""
        packed = _packed_positions(self.valid)[:, None, :]  # (batch, 1, seqlen) of the keys
        # masked_scatter, not indexing by valid: no data-dependent size (torch.compile)
        first = torch.full_like(self.valid, self.first_key.numel(), dtype=packed.dtype) \
            .masked_scatter(self.valid, self.first_key)
        last = torch.full_like(self.valid, -1, dtype=packed.dtype).masked_scatter(
            self.valid, self.last_key)
        return ((packed >= first[..., None]) & (packed <= last[..., None])
                & self.valid[:, None, :])[:, None]


def _packed_positions(valid):
    """(batch, seqlen) bool -> (batch, seqlen) each valid token's place once the valid tokens
    of all rows are packed one after the other."""
    counts = valid.sum(-1)
    return (counts.cumsum(0) - counts)[:, None] + valid.cumsum(-1) - 1


# ----------------------------------------------------------------------------- mask function

def _query_offset(kwargs):
    """Key position of query 0 minus kv_offset, or None if the queries are not one run of
    consecutive positions given as plain numbers."""
    if "cache_position" in kwargs:  # transformers 5.0: the queries' absolute positions
        positions = kwargs["cache_position"]
        if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
            return None
        if torch.compiler.is_compiling() or positions.numel() == 0:
            return None
        first = int(positions[0])
        if not torch.equal(positions, torch.arange(first, first + positions.numel(),
                                                   device=positions.device)):
            return None
    else:
        first = kwargs.get("q_offset", 0)
        if isinstance(first, torch.Tensor):  # static caches pass a 0-d tensor
            if torch.compiler.is_compiling() or first.numel() != 1:
                return None
            first = int(first)
    return first - kwargs.get("kv_offset", 0)


def longflash_mask(**kwargs):
    """The "LongFlash" entry of transformers' AttentionMaskInterface.

    Called by create_causal_mask & co. with batch_size, kv_length, kv_offset, the query
    positions (q_length and q_offset, or cache_position), mask_function and the 2D padding
    attention_mask (batch, >= kv_offset + kv_length). Returns a `PaddingMask` for plain
    causal / full masks, else the (batch, 1, seqlen_q, seqlen_k) boolean mask of sdpa."""
    masking_utils = _masking()

    if isinstance(kwargs.get("attention_mask"), (PaddingMask, SegmentMask)):
        # made by this function for this step already: generate() builds the masks before the
        # forward with a compileable (static) cache, and the forward asks again with them
        # (`ndim` 4 keeps transformers from reading them as 2D padding masks)
        return kwargs["attention_mask"]
    mask_function = kwargs.get("mask_function", masking_utils.causal_mask_function)
    if mask_function is masking_utils.causal_mask_function:
        causal = True
    elif mask_function is getattr(masking_utils, "bidirectional_mask_function", None):
        causal = False
    else:
        causal = None
    q_offset = _query_offset(kwargs)
    if causal is None or q_offset is None:
        kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        segments = _segments(kwargs) if q_offset == 0 else None
        # Another pattern: materialize it (as sdpa would) and let the attention read it.
        return segments if segments is not None else masking_utils.sdpa_mask(**kwargs)
    valid_k = _valid_keys(kwargs)
    if valid_k is not None and not torch.compiler.is_compiling() and bool(valid_k.all()):
        valid_k = None
    return PaddingMask(valid_k, causal, q_offset)


MASK_CHUNK_ELEMENTS = 2**24  # _segments reads the mask this many elements at a time


def _valid_keys(kwargs):
    """The 2D padding attention_mask of a mask function's kwargs as (batch, kv_length) bool,
    True for a real key: columns kv_offset + [0, kv_length); None if there is none."""
    valid_k = kwargs.get("attention_mask")
    if valid_k is None:
        return None
    kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)
    valid_k = valid_k.to(torch.bool)
    missing = kv_offset + kv_length - valid_k.shape[-1]
    if missing > 0:  # static caches: slots not yet written are padding
        valid_k = F.pad(valid_k, (0, missing), value=False)
    return valid_k[:, kv_offset:kv_offset + kv_length]


def _segments(kwargs):
    """A `SegmentMask` equal to the mask that sdpa_mask(**kwargs) would build on every token
    that is not padding, or None if it is not one (or under torch.compile). Queries and keys
    must be the same tokens (no cache). The mask is built a few query rows at a time by
    transformers' own sdpa_mask (the same mask function, padding and offsets). Tokens that
    are padding in the 2D attention_mask are left out, as queries (their output is 0) and as
    keys (sdpa_mask hides them from every query); the others are packed, row after row, and
    each query's keys reduced to one run [first, last] of packed tokens, which must be
    nonempty. Segment starts are the queries that see only themselves (causal) or whose run
    starts anew (full); then the runs must equal, exactly, those of causal attention within
    each segment, under one sliding window (window_left: the largest distance to a first key
    that is not the segment's start), or full attention within each segment."""
    masking_utils = _masking()
    batch, n = kwargs["batch_size"], kwargs.get("q_length")
    if n is None:  # transformers 5.0: cache_position
        n = kwargs["cache_position"].numel()
    if torch.compiler.is_compiling() or n != kwargs["kv_length"] or n == 0:
        return None
    device = kwargs.get("device", "cpu")  # where sdpa_mask builds the mask
    valid = _valid_keys(kwargs)
    valid = torch.ones(batch, n, dtype=torch.bool, device=device) if valid is None else \
        valid.to(device)
    packed = _packed_positions(valid)
    chunk = max(1, MASK_CHUNK_ELEMENTS // (batch * n))
    firsts, lasts = [], []
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        if "cache_position" in kwargs:  # transformers 5.0
            part = dict(kwargs, cache_position=kwargs["cache_position"][start:start + rows])
        else:
            part = dict(kwargs, q_length=rows, q_offset=kwargs.get("q_offset", 0) + start)
        m = masking_utils.sdpa_mask(**part).expand(batch, 1, rows, n)[:, 0].bool()  # (b, rows, n)
        real = valid[:, start:start + rows]  # queries that are not padding
        m = m.view(torch.int8)
        count = m.sum(-1, dtype=torch.int32)
        first = packed.gather(-1, m.max(-1).indices)  # the first visible key (max: the
        last = packed.gather(-1, n - 1 - m.flip(-1).max(-1).indices)  # first of equals)
        if not bool(((count > 0) & (last - first + 1 == count))[real].all()):  # one run
            return None
        firsts.append(first)
        lasts.append(last)
    first, last = torch.cat(firsts, -1)[valid], torch.cat(lasts, -1)[valid]  # (total,)
    total = first.numel()
    if total == 0:
        return None
    queries = torch.arange(total, device=device)
    # (a row's keys are its own: each row's first token starts a segment by the rules below)
    for causal in (True, False):
        if causal:
            if not bool((last == queries).all()):
                continue
            is_start = first == queries
        else:
            is_start = F.pad(first[1:] != first[:-1], (1, 0), value=True)
        starts = torch.where(is_start, queries, 0).cummax(-1).values  # each query's segment
        bound = first > starts  # rows whose first key is set by a window, not the segment
        window_left = int((queries - first)[bound].max()) if bool(bound.any()) else -1
        expected = starts if window_left < 0 else torch.maximum(starts, queries - window_left)
        if not bool((first == expected).all()):
            continue
        if not causal:  # every query of a segment sees up to the segment's end
            ends = torch.where(torch.roll(is_start, -1, -1), queries, total - 1)
            ends = ends.flip(-1).cummin(-1).values.flip(-1)
            if not bool((last == ends).all()):
                continue
        flat = is_start.nonzero().squeeze(1)
        cu_seqlens = torch.cat([flat, flat.new_tensor([total])]).to(torch.int32)
        return SegmentMask(valid, cu_seqlens, int(cu_seqlens.diff().max()), causal,
                           window_left, first, last)
    return None


# ----------------------------------------------------------------------------- reading masks

def _unsupported(what):
    return NotImplementedError(
        f"longflash.integrations.transformers: {what}. Supported: causal or full attention "
        f"with a 2D padding attention_mask (left or right padding, KV caches), causal "
        f"sliding windows given by the layer's sliding_window, and 4D boolean or float masks "
        f"of shape (batch | 1, heads | 1, seqlen_q, seqlen_k); use attn_implementation="
        f"'sdpa' or 'eager' for other masks")


def _plan_padding(mask, batch, seqlen_q, seqlen_k, device):
    """(causal, window_left, valid_q, valid_k) for a PaddingMask; valid_* None: no padding. A
    causal padding mask with valid keys after a sequence's first valid query that are not its
    queries (keys past the last query) is no packed bottom-right problem: (False, -1, None,
    None, its dense mask)."""
    offset = mask.q_offset
    if mask.valid_k is not None and tuple(mask.valid_k.shape) != (batch, seqlen_k):
        raise _unsupported(f"a padding mask of shape {tuple(mask.valid_k.shape)} for a batch "
                           f"of {batch} sequences of {seqlen_k} keys")
    traced = torch.compiler.is_compiling()  # a graph cannot pack: data-dependent sizes
    if not mask.causal:
        if traced and mask.valid_k is not None:  # the valid keys, read by the kernels
            return False, -1, None, None, mask.valid_k.to(device)[:, None, None, :]
        return False, -1, None, mask.valid_k  # every query row attends to the valid keys
    if mask.valid_k is None and offset == seqlen_k - seqlen_q:
        return True, -1, None, None
    if offset < 0 or offset + seqlen_q > seqlen_k:
        raise _unsupported(f"queries at key positions {offset}..{offset + seqlen_q - 1} lie "
                           f"outside the {seqlen_k} keys")
    valid_k = mask.valid_k
    if valid_k is None:
        valid_k = torch.ones(batch, seqlen_k, dtype=torch.bool, device=device)
    positions = torch.arange(offset, offset + seqlen_q, device=valid_k.device)
    valid_q = valid_k[:, positions]  # a query is real iff its own token is
    if traced:  # the mask read by the kernels, padding queries zeroed (_run), as packed
        if offset == seqlen_k - seqlen_q:  # bottom-right causal beside the valid keys: O(N)
            return True, -1, valid_q, None, valid_k.to(device)[:, None, None, :]
        return False, -1, valid_q, None, _padding_dense(mask, batch, seqlen_q, seqlen_k, device)
    # Query r of a sequence sees the keys up to its own position; packed, the bottom-right
    # rule gives it keys up to rank r + nk - nq. Equal iff this count matches for each r.
    keys_seen = valid_k.cumsum(-1)[:, positions]  # (batch, seqlen_q)
    rank_q = valid_q.cumsum(-1)
    nk, nq = valid_k.sum(-1, keepdim=True), valid_q.sum(-1, keepdim=True)
    if not bool(((keys_seen - rank_q == nk - nq) | ~valid_q).all()):
        return False, -1, None, None, _padding_dense(mask, batch, seqlen_q, seqlen_k, device)
    return True, -1, valid_q, valid_k


def _padding_dense(mask, batch, seqlen_q, seqlen_k, device):
    """transformers' own mask for a PaddingMask, (batch, 1, seqlen_q, seqlen_k) bool, O(seqlen^2)
    as sdpa's: a query (key position q_offset + i) sees the valid keys, up to its own position
    if causal."""
    valid_k = mask.valid_k
    if valid_k is None:
        valid_k = torch.ones(batch, seqlen_k, dtype=torch.bool, device=device)
    dense = valid_k.to(device)[:, None, None, :].expand(batch, 1, seqlen_q, seqlen_k)
    if mask.causal:
        keys = torch.arange(seqlen_k, device=device)
        positions = torch.arange(mask.q_offset, mask.q_offset + seqlen_q, device=device)
        dense = dense & (keys <= positions[:, None])
    return dense


def _plan_dense(mask, batch, seqlen_q, seqlen_k, sliding_window):
    """(causal, window_left, valid_q, valid_k) for a (batch | 1, heads | 1, seqlen_q, seqlen_k)
    mask, if it is exactly padding x (full | causal | causal window); else (False, -1, None,
    None, mask): the kernels read the mask. A mask of another shape or dtype raises."""
    if mask.dim() != 4 or tuple(mask.shape[-2:]) != (seqlen_q, seqlen_k):
        raise _unsupported(f"a mask of shape {tuple(mask.shape)} (expected (batch, 1, "
                           f"{seqlen_q}, {seqlen_k}))")
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.is_floating_point():
        allowed = mask == 0
        blocked = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min / 2)
        if not bool((allowed | blocked).all()):  # an attention bias
            return False, -1, None, None, mask
    else:
        raise _unsupported(f"a mask of dtype {mask.dtype}")
    if torch.compiler.is_compiling():  # read by the kernels: a graph has no data-dependent
        return False, -1, None, None, mask  # branch on its values nor packing
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        return False, -1, None, None, mask  # a mask that differs between heads
    allowed = allowed[:, 0].expand(batch, seqlen_q, seqlen_k)
    # A row that sees no key is padding; every other row is compared with the rule below.
    valid_q, valid_k = allowed.any(-1), allowed.any(-2)
    rank_q, rank_k = valid_q.cumsum(-1) - 1, valid_k.cumsum(-1) - 1
    nq, nk = valid_q.sum(-1, keepdim=True), valid_k.sum(-1, keepdim=True)
    diag = (rank_q + nk - nq)[:, :, None]  # bottom-right diagonal of each packed sequence
    rank_k = rank_k[:, None, :]
    padding = valid_q[:, :, None] & valid_k[:, None, :]
    candidates = [(False, -1, padding), (True, -1, padding & (rank_k <= diag))]
    if isinstance(sliding_window, int) and sliding_window > 0:
        left = sliding_window - 1  # transformers: key j is in the window of query i iff j > i - w
        candidates.append((True, left, candidates[1][2] & (rank_k >= diag - left)))
    for causal, window_left, expected in candidates:
        if torch.equal(expected, allowed):
            if bool(valid_q.all()) and bool(valid_k.all()):
                return causal, window_left, None, None
            return causal, window_left, valid_q, valid_k
    # not padding x (full | causal | window): packed sequences, chunks, a custom pattern, or
    # right padding with a sliding window (whose padding rows see part of a window)
    return False, -1, None, None, mask


def _plan_segments(mask, batch, seqlen_q, seqlen_k):
    """A SegmentMask made for these shapes, as it is, or (causal, window_left, None, None)
    if each row is one segment."""
    if tuple(mask.valid.shape) != (batch, seqlen_q) or seqlen_k != seqlen_q:
        raise _unsupported(f"a segment mask of shape {tuple(mask.valid.shape)} for a batch "
                           f"of {batch} sequences of {seqlen_q} queries and {seqlen_k} keys")
    if not mask.padded and mask.cu_seqlens.numel() == batch + 1:  # one segment a row
        return mask.causal, mask.window_left, None, None
    if torch.compiler.is_compiling():  # made outside the graph (generate's masks for a
        return False, -1, None, None, mask.dense()  # static cache); a graph cannot pack
    return mask


def _with_bias(plan, bias, attention_mask, batch, seqlen_q, seqlen_k, device):
    """The plan with an additive bias (T5's position_bias, which may want its gradient) as
    attn_mask: beside causal / window if there is no padding, else added to the layer's mask
    made dense, -inf where it hides a key."""
    if isinstance(plan, SegmentMask):
        plan = (False, -1, None, None, plan.dense())
    if len(plan) == 4 and plan[2] is None and plan[3] is None:
        return (*plan, bias)
    # a PaddingMask's own dense mask: a plan's mask under torch.compile may be its valid keys
    # alone, beside causal (_plan_padding), which the bias would drop
    dense = plan[4] if len(plan) == 5 and not isinstance(attention_mask, PaddingMask) \
        else attention_mask
    if isinstance(dense, PaddingMask):
        dense = _padding_dense(dense, batch, seqlen_q, seqlen_k, device)
    if dense.dtype == torch.bool:
        return False, -1, None, None, bias.masked_fill(~dense, float("-inf"))
    return False, -1, None, None, bias + dense


# ----------------------------------------------------------------------------- attention

def _pack(x, valid):
    """x: (B, N, H, D), valid: (B, N) bool or None -> (tokens, H, D), x's valid rows in order."""
    x = x.reshape(-1, *x.shape[2:])
    return x if valid is None else x.index_select(0, valid.flatten().nonzero().squeeze(1))


def _unpack(o, valid):
    """The inverse of _pack: (tokens, H, D) -> (B, N, H, D), 0 in the rows that are not valid."""
    rows = valid.flatten().nonzero().squeeze(1)
    return o.new_zeros(valid.numel(), *o.shape[1:]).index_copy(0, rows, o).view(
        *valid.shape, *o.shape[1:])


def _run_segments(q, k, v, mask, **kwargs):
    """A SegmentMask's plan: its segments of the tokens that are not padding, packed."""
    valid = mask.valid.to(q.device) if mask.padded else None
    o = attention_varlen(*(_pack(x, valid) for x in (q, k, v)), mask.cu_seqlens.to(q.device),
                         mask.cu_seqlens.to(q.device), mask.max_seqlen, mask.max_seqlen,
                         causal=mask.causal, window_size=(mask.window_left, -1), **kwargs)
    return o.view(*q.shape[:3], v.shape[-1]) if valid is None else _unpack(o, valid)


def _run(q, k, v, causal, window_left, valid_q, valid_k, attn_mask=None, **kwargs):
    """q: (B, Nq, H, D), k: (B, Nk, Hkv, D), v: (B, Nk, Hkv, Dv) views -> o: (B, Nq, H, Dv)."""
    window = (window_left, -1)
    if valid_k is None and (valid_q is None or attn_mask is not None):
        o = attention(q, k, v, causal=causal, window_size=window, attn_mask=attn_mask,
                      **kwargs)
        # valid_q beside a mask (a plan under torch.compile): padding query rows 0, as packed
        return o if valid_q is None else o * valid_q.to(o.device, o.dtype)[:, :, None, None]
    if valid_q is None:
        valid_q = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
    if valid_k is None:
        valid_k = torch.ones(k.shape[:2], dtype=torch.bool, device=q.device)
    valid_q, valid_k = valid_q.to(q.device), valid_k.to(q.device)
    lengths_q, lengths_k = valid_q.sum(-1), valid_k.sum(-1)
    cu_seqlens_q = F.pad(lengths_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_seqlens_k = F.pad(lengths_k.cumsum(0), (1, 0)).to(torch.int32)
    o = attention_varlen(_pack(q, valid_q), _pack(k, valid_k), _pack(v, valid_k),
                         cu_seqlens_q, cu_seqlens_k, int(lengths_q.max()), int(lengths_k.max()),
                         causal=causal, window_size=window, **kwargs)
    return _unpack(o, valid_q)  # padded query rows: 0


def longflash_attention_forward(module, query, key, value, attention_mask, scaling=None,
                                dropout=0.0, softcap=None, sliding_window=None, is_causal=None,
                                **kwargs):
    """The "LongFlash" entry of transformers' AttentionInterface.

    query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k,
    headdim), nheads % nheads_kv == 0; value's headdim may differ. attention_mask: a
    `PaddingMask`, a 4D mask or None (see the module docstring). scaling: default
    1 / sqrt(headdim). dropout: the probability the model passes (0 outside training).
    softcap: tanh soft-capping of the scores (Gemma 2), None for none. s_aux (or, without it,
    `module.sinks`): attention sinks (gpt-oss), (nheads,), passed as `learnable_sink`.
    Returns (attn_output (batch, seqlen_q, nheads, headdim of value), None).
    """
    if kwargs.get("sinks") is not None:
        raise _unsupported("the argument sinks (attention sinks in another form)")
    sink = kwargs.get("s_aux")
    sink = getattr(module, "sinks", None) if sink is None else sink
    seqlen_q, seqlen_k = query.shape[2], key.shape[2]
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window_left = sliding_window - 1 if causal and sliding_window else -1
        plan = (bool(causal), window_left, None, None)
    elif isinstance(attention_mask, PaddingMask):
        plan = _plan_padding(attention_mask, query.shape[0], seqlen_q, seqlen_k, query.device)
    elif isinstance(attention_mask, SegmentMask):
        plan = _plan_segments(attention_mask, query.shape[0], seqlen_q, seqlen_k)
    elif isinstance(attention_mask, torch.Tensor):
        plan = _plan_dense(attention_mask, query.shape[0], seqlen_q, seqlen_k, sliding_window)
    else:
        raise _unsupported(f"a mask of type {type(attention_mask).__name__} (another "
                           f"implementation's mask)")
    bias = kwargs.get("position_bias")  # T5's relative position bias, (1, heads, Nq, Nk)
    if bias is not None:
        plan = _with_bias(plan, bias, attention_mask, query.shape[0], seqlen_q, seqlen_k,
                          query.device)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, N, H, D) views
    options = dict(softmax_scale=scaling, dropout_p=float(dropout), softcap=float(softcap or 0.0),
                   backend=_backend, learnable_sink=sink)
    if isinstance(plan, SegmentMask):
        o = _run_segments(q, k, v, plan, **options)
    else:
        o = _run(q, k, v, *plan, **options)
    return o, None


def register(backend="auto", name=NAME):
    """Register LongFlash in transformers; models then take attn_implementation=name.

    backend: passed to every `longflash.attention` call ("auto": Triton kernels for CUDA
        tensors, the blockwise PyTorch path on CPU). Registering again replaces it.
    name: default "LongFlash". It must not contain "flash" in lowercase: transformers
        (5.x) takes any such name for a FlashAttention kernel and tries to load it from
        the Hugging Face hub, so attn_implementation="longflash" cannot work.
    Returns the name.
    """
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(name, str) or not name or "flash" in name or "/" in name:
        raise ValueError(f"name must be a non-empty str without the substring 'flash' (taken "
                         f"by transformers for FlashAttention kernels) and without '/' (hub "
                         f"kernels), got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("longflash.integrations.transformers needs transformers >= 5.0: "
                          "pip install 'longflash[transformers]'") from e
    _backend = backend
    _masking()
    AttentionInterface.register(name, longflash_attention_forward)
    AttentionMaskInterface.register(name, longflash_mask)
    return name
