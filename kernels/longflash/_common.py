"""What the three implementations share: constants, block ranges, output allocation."""

import math

import torch

LOG2E = math.log2(math.e)  # the kernels work in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)


def accumulator_dtype(dtype):
    """float32 accumulators for 16- and 32-bit inputs; float64 stays float64 (torch path only)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Tests set this to True: every output is then allocated full of NaN, so an element that
# a kernel forgets to write shows up as NaN instead of as stale memory.
POISON_OUTPUTS = False


def empty_like(x):
    out = torch.empty_like(x)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def empty_outputs(q):
    """o like q, lse (batch, nheads, seqlen_q). Shared by every implementation and by the
    fake (meta) implementation of the custom op, so that strides always agree."""
    batch, seqlen_q, nheads, _ = q.shape
    o = empty_like(q)
    lse = q.new_empty((batch, nheads, seqlen_q), dtype=accumulator_dtype(q.dtype))
    return o, lse.fill_(float("nan")) if POISON_OUTPUTS else lse


def key_range(start_m, block_m, block_n, seqlen_q, seqlen_k, causal):
    """Keys visited by the query block [start_m, start_m + block_m).

    Returns (full_hi, hi): keys [0, full_hi) are visible to every row of the block and
    need no mask; keys [full_hi, hi) need the causal / length mask; keys >= hi are never
    visible and are skipped. full_hi is a multiple of block_n. Causal is bottom-right
    aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    """
    if not causal:
        return seqlen_k // block_n * block_n, seqlen_k
    offset = seqlen_k - seqlen_q
    hi = min(max(start_m + block_m + offset, 0), seqlen_k)
    full_hi = min(max(start_m + offset + 1, 0), seqlen_k) // block_n * block_n
    return full_hi, hi


def query_range(start_n, block_m, block_n, seqlen_q, seqlen_k, causal):
    """Queries visited by the key block [start_n, start_n + block_n), for dK and dV.

    Returns (lo, full_lo): queries [lo, full_lo) need the causal mask, queries
    [full_lo, seqlen_q) see the whole key block; queries < lo see none of it.
    lo and full_lo are multiples of block_m.
    """
    if not causal:
        return 0, 0
    offset = seqlen_k - seqlen_q
    lo = min(max(start_n - offset, 0), seqlen_q) // block_m * block_m
    full_lo = max(start_n + block_n - 1 - offset, lo)
    full_lo = (full_lo + block_m - 1) // block_m * block_m
    return lo, full_lo
