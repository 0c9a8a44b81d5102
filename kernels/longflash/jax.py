"""LongFlash for JAX: exact attention with a custom VJP, blockwise in linear memory.

    import longflash.jax
    o = longflash.jax.attention(q, k, v, causal=True)   # q: (batch, seqlen, nheads, headdim)
    dq, dk, dv = jax.grad(lambda q, k, v: longflash.jax.attention(q, k, v).sum(),
                          argnums=(0, 1, 2))(q, k, v)
    (o, k_cache, v_cache) = longflash.jax.attention_with_kvcache(q, k_cache, v_cache, k, v,
                                                                 cache_seqlens)  # decoding

Decoding over a KV cache (contiguous or paged) is `jax_kvcache.py`'s, packed
variable-length sequences (cu_seqlens) `jax_varlen.py`'s, both exported here.

The algorithm is `blockwise.py`'s, written with jax.lax, with the same names (read
that file first): a query block of block_m rows walks over the key blocks of block_n
columns, keeping the running row maximum m_i, sum l_i and unnormalized output acc
(online softmax), and saves the log-sum-exp lse of each row. `jax.custom_vjp` saves only
(q, k, v, o, lse) for the backward pass, which recomputes each block of probabilities
from lse: delta = rowsum(o * do), then one pass over the key blocks, each over the query
blocks that see it, accumulating its dK/dV and adding each tile's share of dQ to a float32
buffer of q's size (FlashAttention-2's Algorithm 2, as blockwise.py). Nothing of size
seqlen_q x seqlen_k is ever formed: the query (key) blocks run sequentially under
`lax.map` (`lax.scan`), the inner loops are `lax.fori_loop`s whose bounds come from the same
block ranges as every other implementation (`_common.key_range`, `_common.query_range`), so
causal and sliding-window attention skip the blocks no row sees, and only the blocks that
straddle a mask edge (the diagonal, a window's edge, the sequence end) are masked. Sequences
are padded to whole blocks; the mask covers the padding, and outputs are sliced back. An
attn_mask (PyTorch's, as in `longflash.attention`) becomes an additive bias (0 / -inf for a
boolean one) that each tile slices along the dimensions it has (one of size 1 is broadcast,
never materialized) and adds to every tile, masked or not; a float mask's cotangent, dS
summed over the dimensions it broadcasts, is accumulated tile by tile in the same pass (an
array of the mask's own shape). Dropout draws the same Philox numbers as the other
implementations (`_common.dropout_uniform`, here in uint32 arithmetic) per tile, forward and
backward, so nothing of the mask is stored. Accumulators are float32 (float64 for float64 inputs, with
jax_enable_x64); matmuls use Precision.HIGHEST, so float32 inputs are not rounded to TF32 /
bfloat16 on accelerators.

backend="auto" calls the project's Triton kernels (`flash_triton.py`: _attn_fwd,
_attn_bwd_preprocess, _attn_bwd_dkdv, _attn_bwd_dq) through jax_triton.triton_call when
the arrays are on a GPU, a suitable jax_triton is importable and the dtype is not
float64; otherwise the blockwise JAX path above. THE GPU PATH IS UNTESTED: no GPU was
available; it has never run. It is written against jax-triton 0.4's triton_call
(out_type=, kernel parameters bound by name, the outputs filling the parameters left
out): the kernels' outputs sit between their inputs, which 0.3.1's positional call cannot
express. jax-triton 0.4 needs triton >= 3.7, newer than the 3.6 of our GPU machines (and of
torch 2.11), so there "auto" takes the blockwise path; `jax_triton_missing()` says why the
Triton path is off. It uses one fixed tile per kernel (the autotuner is bypassed). The
blockwise path is tested on CPU against a float64 reference (tests/test_jax.py).

Install: pip install "longflash[jax]" (jax >= 0.4.30). For the GPU path also jax with
CUDA, jax-triton >= 0.4 and triton >= 3.7.
"""

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._common import (LN2, LOG2E, PHILOX_KEY_A, PHILOX_KEY_B, PHILOX_ROUND_A, PHILOX_ROUND_B,
                      check_alibi_shape, check_attn_mask_shape, check_bools, check_real,
                      check_shapes, check_softcap, check_window_size, key_range, query_range,
                      resolve_softmax_scale, triton_problem, visible)

# Tiles for a CPU, where each tile is one batched matmul. Under jit the loops run compiled
# (no per-tile Python as in blockwise.py, hence not its 256 x 256): 64-256 rows and 128-256
# columns timed within 10% of each other (PERFLOG).
BLOCK_M = 128
BLOCK_N = 256
BACKENDS = ("auto", "triton", "jax")
_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
_HIGHEST = lax.Precision.HIGHEST


class _Config(NamedTuple):
    """Static (hashable) options of one call; causal is window_right = 0 as in _common."""
    causal: bool
    softmax_scale: float
    block_m: int
    block_n: int
    backend: str  # "triton" or "jax", resolved
    bias_grad: bool = False  # attn_mask is a float array: its cotangent is computed
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    varlen: bool = False  # packed sequences (attention_varlen): segments is _Packed

    @property
    def window(self):
        return self.window_left, 0 if self.causal else self.window_right


# ----------------------------------------------------------------------------- validation

def _check_inputs(q, k, v, causal, softmax_scale, return_lse, block_m, block_n, backend,
                  window_size=(-1, -1), softcap=0.0):
    """Validate everything before any work; return (q, k, v) as jax arrays and the config."""
    arrays = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} must be a jax.Array (or numpy array), got "
                            f"{type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), "
                             f"got shape {tuple(x.shape)}")
        if x.dtype not in [jnp.dtype(d) for d in _DTYPES]:
            raise TypeError(f"{name} has dtype {x.dtype}; accepted: float16, bfloat16, float32, "
                            f"float64 (with jax_enable_x64)")
        arrays.append(jnp.asarray(x))
    q, k, v = arrays
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_shapes(q.shape, k.shape, v.shape)
    check_bools(causal=causal, return_lse=return_lse)
    check_window_size(window_size)
    check_softcap(softcap)
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[3])
    for name, block in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(block, bool) or not isinstance(block, int) or block < 1:
            raise ValueError(f"{name} must be a positive int, got {block!r}")
    return q, k, v, _Config(causal, float(softmax_scale), block_m, block_n,
                            _resolve_backend(backend, q), window_left=int(window_size[0]),
                            window_right=int(window_size[1]), softcap=float(softcap))


def _on_gpu(x):
    if isinstance(x, jax.core.Tracer):  # inside jit: where the computation will run
        return jax.default_backend() == "gpu"
    return all(d.platform == "gpu" for d in x.devices())


@functools.cache
def jax_triton_missing():
    """Why the Triton path cannot run here (a sentence), or None when it can: jax_triton must
    import (it needs a CUDA jaxlib), its own Triton requirement must hold (jax-triton 0.4
    needs triton >= 3.7: with 3.6, the GPU machines' version, it imports but stubs out its
    NVIDIA backend), and its triton_call must bind kernel parameters by name (out_type=,
    newer than 0.3.1: the kernels' outputs sit between their inputs, which 0.3.1's
    positional call cannot express)."""
    if triton_problem():  # the kernels' own requirement (_common.MIN_TRITON)
        return f"the Triton kernels need {triton_problem()}"
    try:
        import jax_triton
        import triton
    except ImportError as exc:
        return f"jax_triton is not importable ({exc})"
    unmet = _unmet_requirement("jax-triton", "triton", triton.__version__)
    if unmet:
        return f"jax-triton requires {unmet}, this is triton {triton.__version__}"
    if "out_type" not in inspect.signature(jax_triton.triton_call).parameters:
        return "this jax_triton's triton_call has no out_type= (0.3.1 or older)"
    return None


def _unmet_requirement(dist, name, version):
    """The requirement of installed package `dist` on `name` ("triton>=3.7") if `version` does
    not satisfy it, else None (also when either is unknown)."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
        requires = metadata.requires(dist) or []
    except (ImportError, metadata.PackageNotFoundError):
        return None
    for text in requires:
        req = Requirement(text)
        if req.name == name and not req.marker and version not in req.specifier:
            return str(req)
    return None


def _resolve_backend(backend, q):
    """'auto' -> the Triton kernels for GPU arrays when jax_triton is importable (not for
    float64), else the blockwise JAX path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    usable = q.dtype != jnp.float64 and _on_gpu(q) and jax_triton_missing() is None
    if backend == "auto":
        return "triton" if usable else "jax"
    if backend == "triton" and not usable:
        raise ValueError("backend='triton' needs GPU arrays (not float64) and a usable "
                         f"jax_triton ({jax_triton_missing() or 'present'}); use backend='jax' "
                         "for the blockwise path")
    return backend


# ----------------------------------------------------------------------------- blockwise path

def _accumulator_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _pad_to(x, axis, length, value=0.0):
    """Pad axis of x with value up to length."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def _grouped(x, nheads_kv):
    """(batch, seqlen, nheads, headdim) -> (batch, nheads_kv, group, seqlen, headdim)."""
    batch, seqlen, nheads, headdim = x.shape
    return x.reshape(batch, seqlen, nheads_kv, nheads // nheads_kv, headdim).transpose(
        0, 2, 3, 1, 4)


def _ungrouped(x):
    """(batch, nheads_kv, group, seqlen, headdim) -> (batch, seqlen, nheads, headdim)."""
    batch, nheads_kv, group, seqlen, headdim = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(batch, seqlen, nheads_kv * group, headdim)


class _Ctx(NamedTuple):
    """Shapes and options shared by the loops of one call (all static)."""
    seqlen_q: int
    seqlen_k: int
    block_m: int
    block_n: int
    softmax_scale: float
    window_left: int
    window_right: int
    dtype: object  # accumulator dtype
    softcap: float
    dropout_p: float
    varlen: bool


def _context(q, k, cfg):
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    # Tiles no larger than the sequences: a short sequence is one block, without padding.
    block_m = min(cfg.block_m, max(seqlen_q, 1))
    block_n = min(cfg.block_n, max(seqlen_k, 1))
    return _Ctx(seqlen_q, seqlen_k, block_m, block_n, cfg.softmax_scale, *cfg.window,
                _accumulator_dtype(q.dtype), cfg.softcap, cfg.dropout_p, cfg.varlen)


def _ranges(ctx, keys):
    """(n_blocks, 4) int32: (lo, mid_lo, mid_hi, hi) of each query block (keys=True, for the
    forward and dQ) or key block (keys=False, for dK/dV), from the shared range functions."""
    window = (ctx.window_left, ctx.window_right)
    if keys:
        rows = [key_range(start_m, ctx.block_m, ctx.block_n, ctx.seqlen_q, ctx.seqlen_k, *window)
                for start_m in range(0, max(ctx.seqlen_q, 1), ctx.block_m)]
    else:
        rows = [query_range(start_n, ctx.block_m, ctx.block_n, ctx.seqlen_q, ctx.seqlen_k,
                            *window) for start_n in range(0, max(ctx.seqlen_k, 1), ctx.block_n)]
    return jnp.asarray(np.array(rows, dtype=np.int32).reshape(-1, 4))


def _blocks(x, axis, block):
    """Split axis (a multiple of block) into (n_blocks, ...) leading blocks for lax.map."""
    shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x, axis):
    """Inverse of _blocks: (n_blocks, ..., block, ...) -> (..., n_blocks * block, ...)."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


def _bias_tile(bias, start_m, start_n, block_m, block_n, shape5):
    """attn_mask's tile at (start_m, start_n) as an additive (B or 1, Hkv or 1, G or 1, BM or 1,
    BN or 1) bias: bias is 4-D (batch, nheads, rows, columns), each dimension full (rows and
    columns padded to whole blocks) or 1 (broadcast, never materialized)."""
    if bias.shape[2] > 1:
        bias = lax.dynamic_slice_in_dim(bias, start_m, block_m, axis=2)
    if bias.shape[3] > 1:
        bias = lax.dynamic_slice_in_dim(bias, start_n, block_n, axis=3)
    nheads_kv, group = shape5[1:3]
    if bias.shape[1] > 1:  # (B, H, ...) -> (B, Hkv, G, ...)
        return bias.reshape(bias.shape[0], nheads_kv, group, *bias.shape[2:])
    return bias[:, None]


def _tile(x, start, block, axis=1):
    return lax.dynamic_slice_in_dim(x, start, block, axis=axis)


def _positions(start_m, start_n, block_m, block_n, ctx, segments):
    """A tile's (diag, j), broadcastable to (BM, BN): diag = i + seqlen_k - seqlen_q, the key
    position a query's causal edge is at (visible() with seqlen_q = seqlen_k = 0), j the key
    position; positions in the row, or with ctx.varlen in each packed sequence."""
    if ctx.varlen:
        return (_tile(segments.q_diag, start_m, block_m, 0)[:, None],
                _tile(segments.k_pos, start_n, block_n, 0)[None, :])
    i = start_m + jnp.arange(block_m)[:, None]
    return i + ctx.seqlen_k - ctx.seqlen_q, start_n + jnp.arange(block_n)[None, :]


def _scores(q_i, k_j, start_m, start_n, ctx, masked, bias=None, slopes=None, segments=None):
    """One tile of scores in log2 units (B, Hkv, G, BM, BN), and tanh(s / softcap) for the
    softcap gradient (None without softcap): softcap after the scale, then ALiBi (slopes:
    (B or 1, Hkv, G, BM or 1, 1)), then attn_mask's bias, then the masks; masked tiles also
    hide the padding rows and columns past the sequence ends. segments: None, the (B, rows)
    and (B, columns) segment ids (padded): every tile hides the keys of other segments; or,
    with ctx.varlen, _Packed, whose positions the masks and ALiBi use (every tile masked)."""
    block_m, block_n = q_i.shape[-2], k_j.shape[-2]
    s = jnp.einsum("bhgmd,bhnd->bhgmn", q_i, k_j, precision=_HIGHEST) * ctx.softmax_scale
    t = None
    if ctx.softcap > 0:
        t = jnp.tanh(s / ctx.softcap)
        s = ctx.softcap * t
    if slopes is not None:  # -slope * |i + seqlen_k - seqlen_q - j|
        diag, j = _positions(start_m, start_n, block_m, block_n, ctx, segments)
        if slopes.shape[3] > 1:  # per row (packed sequences)
            slopes = _tile(slopes, start_m, block_m, 3)
        s = s - slopes * jnp.abs(diag - j).astype(s.dtype)
    if bias is not None:
        s = s + _bias_tile(bias, start_m, start_n, block_m, block_n, s.shape)
    if segments is not None:
        q_ids, kv_ids = _tile(segments[0], start_m, block_m), _tile(segments[1], start_n, block_n)
        same = q_ids[:, None, None, :, None] == kv_ids[:, None, None, None, :]
        s = jnp.where(same, s, -jnp.inf)
    if masked:  # (packed: the padding's ids match no query's, hidden above)
        diag, j = _positions(start_m, start_n, block_m, block_n, ctx, segments)
        mask = visible(diag, j, 0, 0, ctx.window_left, ctx.window_right)
        if not ctx.varlen:
            mask = mask & (diag < ctx.seqlen_k) & (j < ctx.seqlen_k)  # i < seqlen_q
        s = jnp.where(mask, s, -jnp.inf)
    return s * LOG2E, t


def _philox_uniform(seed, bh, i, j):
    """_common.dropout_uniform in uint32 jax arithmetic (the same numbers, so the same
    elements drop as in longflash.attention with the same seed): Philox-4x32-10 with counter
    (j, i, bh, 0) and key seed (uint32 (2,): the seed's low and high 32 bits)."""
    u32 = jnp.uint32
    c0, c1, c2 = jnp.broadcast_arrays(*(jnp.asarray(x).astype(u32) for x in (j, i, bh)))
    c3 = jnp.zeros_like(c0)
    k0, k1 = seed[0], seed[1]

    def mul_hi_lo(a, b):  # b a constant; no 64-bit integers needed
        a_hi, a_lo, b_hi, b_lo = a >> 16, a & 0xFFFF, u32(b >> 16), u32(b & 0xFFFF)
        t = a_lo * b_lo
        u = a_hi * b_lo + (t >> 16)
        w = (u & 0xFFFF) + a_lo * b_hi
        return a_hi * b_hi + (u >> 16) + (w >> 16), a * u32(b)

    for _ in range(10):
        hi_b, lo_b = mul_hi_lo(c2, PHILOX_ROUND_B)
        hi_a, lo_a = mul_hi_lo(c0, PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = k0 + u32(PHILOX_KEY_A), k1 + u32(PHILOX_KEY_B)
    return (c0 >> 8).astype(jnp.float32) * (1.0 / 2**24)


def _dropout_scale(seed, start_m, start_n, shape5, ctx, segments):
    """keep / (1 - dropout_p) of a tile (B, Hkv, G, BM, BN): element (b, h, i, j) is kept iff
    its uniform number (batch * nheads + head, query, key) is at least dropout_p; packed
    sequences (ctx.varlen): b the sequence, i and j positions in it, as attention_varlen."""
    batch, nheads_kv, group, block_m, block_n = shape5
    heads = jnp.arange(nheads_kv * group).reshape(nheads_kv, group)[..., None, None]
    if ctx.varlen:
        b = _tile(segments.q_ids[0], start_m, block_m, 0)[:, None]  # (BM, 1)
        i, j = (_tile(x, start, n, 0) for x, start, n in ((segments.q_pos, start_m, block_m),
                                                          (segments.k_pos, start_n, block_n)))
        bh, i, j = b * (nheads_kv * group) + heads, i[:, None], j[None, :]
    else:
        bh = jnp.arange(batch)[:, None, None, None, None] * (nheads_kv * group) + heads
        i = start_m + jnp.arange(block_m)[:, None]
        j = start_n + jnp.arange(block_n)[None, :]
    keep = _philox_uniform(seed, bh, i, j) >= ctx.dropout_p
    return jnp.where(keep, 1.0 / (1.0 - ctx.dropout_p), 0.0).astype(ctx.dtype)


def _block_loop(lo, hi, block, body, carry):
    """body over the blocks [lo, hi) of a range (lo a multiple of block)."""
    return lax.fori_loop(lo // block, (hi + block - 1) // block, body, carry)


def _attn_fwd_inner(acc, l_i, m_i, q_i, k, v, start_m, lo, hi, masked, ctx, bias, slopes,
                    segments, seed):
    def body(n, carry):
        acc, l_i, m_i = carry
        start_n = n * ctx.block_n
        k_j = lax.dynamic_slice_in_dim(k, start_n, ctx.block_n, axis=2)  # (B, Hkv, BN, D)
        v_j = lax.dynamic_slice_in_dim(v, start_n, ctx.block_n, axis=2)
        # -- compute scores --
        qk, _ = _scores(q_i, k_j, start_m, start_n, ctx, masked, bias, slopes, segments)
        # -- online softmax: new row max, rescale what was accumulated --
        m_ij = jnp.maximum(m_i, qk.max(-1))
        m_safe = jnp.where(m_ij == -jnp.inf, 0.0, m_ij)  # rows that saw no key yet
        p = jnp.exp2(qk - m_safe[..., None])
        alpha = jnp.exp2(m_i - m_safe)
        l_i = l_i * alpha + p.sum(-1)  # the lse is of the undropped row
        if ctx.dropout_p > 0:
            p = p * _dropout_scale(seed, start_m, start_n, p.shape, ctx, segments)
        acc = acc * alpha[..., None] + jnp.einsum("bhgmn,bhnd->bhgmd", p, v_j,
                                                  precision=_HIGHEST)
        return acc, l_i, m_ij
    return _block_loop(lo, hi, ctx.block_n, body, (acc, l_i, m_i))


def _padded_bias(bias, ctx, padded_q, padded_k):
    """attn_mask's 4-D bias in the accumulator dtype, its full rows and columns padded to
    whole blocks (with 0: padding is masked anyway); None stays None."""
    if bias is None:
        return None
    bias = bias.astype(ctx.dtype)
    if bias.shape[2] > 1:
        bias = _pad_to(bias, 2, padded_q)
    return _pad_to(bias, 3, padded_k) if bias.shape[3] > 1 else bias


class _Packed(NamedTuple):
    """Packed sequences (attention_varlen) per token, padded to whole blocks: the sequence of
    each query (1, rows) and key (1, columns) (-1 and -2 for padding, which match nothing),
    their positions in it (q_pos, k_pos), q_diag = q_pos + seqlen_k - seqlen_q of the query's
    sequence; the (lo, hi, hi, hi) key range of each query block (ranges_q) and query range
    of each key block (ranges_k), every tile masked."""
    q_ids: jax.Array
    k_ids: jax.Array
    q_pos: jax.Array
    q_diag: jax.Array
    k_pos: jax.Array
    ranges_q: jax.Array
    ranges_k: jax.Array


def _packed(cu_seqlens_q, cu_seqlens_k, ctx, padded_q, padded_k):
    """_Packed from the (batch + 1,) offsets (traced under jit: the ranges are loop bounds).
    A query block's keys run from its first row's sequence's first visible key to its last
    row's sequence's last visible one (the blocks between hold the sequences between); a key
    block's queries likewise, so nothing outside the blocks that hold a sequence's visible
    pairs is computed."""
    def tokens(cu, padded, pad_id):  # sequence and position of each token
        n = jnp.arange(padded)
        ids = jnp.clip(jnp.searchsorted(cu, n, side="right") - 1, 0, cu.shape[0] - 2)
        return ids, n - cu[ids], jnp.where(n < cu[-1], ids, pad_id)

    cu_q, cu_k = (jnp.asarray(x, jnp.int32) for x in (cu_seqlens_q, cu_seqlens_k))
    len_q, len_k = jnp.diff(cu_q), jnp.diff(cu_k)
    q_seq, q_pos, q_ids = tokens(cu_q, padded_q, -1)
    k_seq, k_pos, k_ids = tokens(cu_k, padded_k, -2)
    shift = len_k - len_q  # a query's diag is its position + its sequence's shift
    left, right = ctx.window_left, ctx.window_right

    def ranges(first, last, block, cu_other, len_other, lower, upper):
        """(lo, hi, hi, hi), whole blocks of `block`, of the blocks starting at first with
        last their last real token: lower(seq, pos) / upper(...) the first / one past the
        last visible position (other side) of a token, None meaning the sequence's end."""
        (seq0, pos0), (seq1, pos1) = first, last
        lo = cu_other[seq0] + (0 if lower is None else jnp.clip(lower(seq0, pos0), 0,
                                                               len_other[seq0]))
        hi = cu_other[seq1] + (len_other[seq1] if upper is None else
                               jnp.clip(upper(seq1, pos1), 0, len_other[seq1]))
        lo, hi = lo // block * block, -(-hi // block) * block
        lo = jnp.where(hi > lo, lo, 0)
        hi = jnp.where(hi > lo, hi, 0)
        return jnp.stack([lo, hi, hi, hi], -1).astype(jnp.int32)

    def blocks(seq, pos, total, block):  # first and last real token of each block
        starts = jnp.arange(0, seq.shape[0], block)
        ends = jnp.clip(jnp.minimum(starts + block, total) - 1, 0, seq.shape[0] - 1)
        return (seq[starts], pos[starts]), (seq[ends], pos[ends])

    ranges_q = ranges(*blocks(q_seq, q_pos, cu_q[-1], ctx.block_m), ctx.block_n, cu_k, len_k,
                      None if left < 0 else lambda b, i: i + shift[b] - left,
                      None if right < 0 else lambda b, i: i + shift[b] + right + 1)
    ranges_k = ranges(*blocks(k_seq, k_pos, cu_k[-1], ctx.block_n), ctx.block_m, cu_q, len_q,
                      None if right < 0 else lambda b, j: j - shift[b] - right,
                      None if left < 0 else lambda b, j: j - shift[b] + left + 1)
    return _Packed(q_ids[None], k_ids[None], q_pos, q_pos + shift[q_seq], k_pos, ranges_q,
                   ranges_k)


def _padded_segments(segments, ctx, padded_q, padded_k):
    """The (queries', keys') segment ids padded to whole blocks (with 0, as the bias: the tiles
    that hold padding are the masked ones, which hide it); with ctx.varlen, _Packed from the
    (cu_seqlens_q, cu_seqlens_k) pair; None stays None."""
    if segments is None:
        return None
    if ctx.varlen:
        return _packed(*segments, ctx, padded_q, padded_k)
    return tuple(_pad_to(x.astype(jnp.int32), 1, n) for x, n in zip(segments, (padded_q, padded_k)))


def _grouped_slopes(slopes, nheads_kv, dtype, segments):
    """ALiBi slopes (B or 1, H) as (B or 1, Hkv, G, 1, 1) in the accumulator dtype; packed
    sequences' (batch, H) as (1, Hkv, G, rows, 1), each row its sequence's; None stays None."""
    if slopes is None:
        return None
    slopes = slopes.astype(dtype)
    if isinstance(segments, _Packed) and slopes.shape[0] > 1:
        rows = slopes[jnp.clip(segments.q_ids[0], 0, None)].T  # (H, rows)
        return rows.reshape(1, nheads_kv, -1, rows.shape[1], 1)
    return slopes.reshape(slopes.shape[0], nheads_kv, -1, 1, 1)


def _forward_dense(q, k, v, cfg, bias=None, slopes=None, segments=None, seed=None):
    """o (B, Nq, H, Dv) in q's dtype and lse (B, H, Nq) in the accumulator dtype. bias: None,
    or attn_mask as a 4-D additive bias (-inf hides a key; dimensions of 1 broadcast).
    slopes: None, or ALiBi's (B or 1, H). segments: None, or the segment ids (B, Nq) of the
    queries and (B, Nk) of the keys. seed: None, or dropout's (uint32 (2,))."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k.shape[2]
    ctx = _context(q, k, cfg)
    padded_q = -(-max(seqlen_q, 1) // ctx.block_m) * ctx.block_m
    padded_k = -(-max(ctx.seqlen_k, 1) // ctx.block_n) * ctx.block_n
    q5 = _pad_to(_grouped(q, nheads_kv).astype(ctx.dtype), 3, padded_q)  # (B, Hkv, G, Nq, D)
    k4 = _pad_to(k.transpose(0, 2, 1, 3).astype(ctx.dtype), 2, padded_k)  # (B, Hkv, Nk, D)
    v4 = _pad_to(v.transpose(0, 2, 1, 3).astype(ctx.dtype), 2, padded_k)
    bias = _padded_bias(bias, ctx, padded_q, padded_k)
    segments = _padded_segments(segments, ctx, padded_q, padded_k)
    slopes = _grouped_slopes(slopes, nheads_kv, ctx.dtype, segments)

    def query_block(args):
        start_m, q_i, (lo, mid_lo, mid_hi, hi) = args
        m_i = jnp.full(q_i.shape[:-1], -jnp.inf, ctx.dtype)
        l_i = jnp.zeros(q_i.shape[:-1], ctx.dtype)
        acc = jnp.zeros(q_i.shape[:-1] + v.shape[-1:], ctx.dtype)  # (B, Hkv, G, BM, Dv)
        for a, b, masked in ((lo, mid_lo, True), (mid_lo, mid_hi, False), (mid_hi, hi, True)):
            acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q_i, k4, v4, start_m, a, b, masked,
                                            ctx, bias, slopes, segments, seed)
        # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
        l_safe = jnp.where(l_i == 0, 1.0, l_i)
        o_i = acc / l_safe[..., None]
        lse_i = jnp.where(l_i == 0, -jnp.inf, (m_i + jnp.log2(l_safe)) * LN2)
        return o_i, lse_i

    starts_m = jnp.arange(0, padded_q, ctx.block_m)
    ranges = segments.ranges_q if ctx.varlen else _ranges(ctx, True)
    o5, lse4 = lax.map(query_block, (starts_m, _blocks(q5, 3, ctx.block_m), ranges))
    o5, lse4 = _unblocks(o5, 3)[..., :seqlen_q, :], _unblocks(lse4, 3)[..., :seqlen_q]
    return _ungrouped(o5).astype(q.dtype), lse4.reshape(batch, nheads, seqlen_q)


def _probs(q_i, k_j, lse2_i, start_m, start_n, ctx, masked, bias, slopes, segments):
    """Recompute one block of probabilities p = exp(s - lse) from the saved lse; and
    tanh(s / softcap) (_scores)."""
    s, t = _scores(q_i, k_j, start_m, start_n, ctx, masked, bias, slopes, segments)
    return jnp.exp2(s - lse2_i[..., None]), t


def _grad_scores(p, dp, delta_i):
    """dL/ds, the gradient of the scores (an attn_mask's): dS = p * (dP - delta)."""
    return p * (dp - delta_i[..., None])


def _grad_qk(ds, t, ctx):
    """dL/d(q k^T) from dL/ds: through softcap (d softcap * tanh(x / softcap) / dx = 1 - t^2)
    and the scale."""
    return (ds if t is None else ds * (1 - t * t)) * ctx.softmax_scale


def _sum_to_bias(ds, bias_shape):
    """A tile of dS (B, Hkv, G, BM, BN) summed over the dimensions attn_mask's bias broadcasts
    (4-D, each full or 1): (B or 1, H or 1, BM or 1, BN or 1)."""
    ds = ds.reshape(ds.shape[0], -1, *ds.shape[3:])  # (B, H, BM, BN)
    axes = tuple(a for a in range(4) if bias_shape[a] == 1)
    return ds.sum(axes, keepdims=True)


def _add_bias_tile(dbias, tile, start_m, start_n):
    """dbias (B or 1, H or 1, rows or 1, columns or 1) with a tile of dS summed to its shape
    (_sum_to_bias) added at (start_m, start_n) along the dimensions it does not broadcast."""
    starts = tuple(jnp.asarray(x, jnp.int32) for x in  # one index type (start_n's may be int64)
                   (0, 0, start_m if dbias.shape[2] > 1 else 0, start_n if dbias.shape[3] > 1 else 0))
    return lax.dynamic_update_slice(dbias, lax.dynamic_slice(dbias, starts, tile.shape) + tile,
                                    starts)


def _backward_dense(do, dlse, q, k, v, o, lse, cfg, bias=None, slopes=None, segments=None,
                    seed=None):
    """dq, dk, dv and, with cfg.bias_grad, the gradient of attn_mask's 4-D bias (dL/ds summed
    over the dimensions it broadcasts; else None)."""
    batch, seqlen_q, nheads, headdim = q.shape
    nheads_kv = k.shape[2]
    ctx = _context(q, k, cfg)
    block_m, block_n = ctx.block_m, ctx.block_n
    padded_q = -(-max(seqlen_q, 1) // block_m) * block_m
    padded_k = -(-max(ctx.seqlen_k, 1) // block_n) * block_n
    # -- preprocess: delta = rowsum(do * o); a gradient of lse enters as -dlse --
    delta = (do.astype(ctx.dtype) * o.astype(ctx.dtype)).sum(-1).transpose(0, 2, 1)  # (B, H, Nq)
    delta = delta - dlse.astype(ctx.dtype)
    # lse = -inf marks a row that saw no key; +inf makes its probabilities exactly 0 (and
    # the padding rows get +inf too).
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse).astype(ctx.dtype) * LOG2E
    lse2 = _pad_to(lse2.reshape(batch, nheads_kv, -1, seqlen_q), 3, padded_q, jnp.inf)
    delta = _pad_to(delta.reshape(batch, nheads_kv, -1, seqlen_q), 3, padded_q)
    q5 = _pad_to(_grouped(q, nheads_kv).astype(ctx.dtype), 3, padded_q)  # (B, Hkv, G, Nq, D)
    do5 = _pad_to(_grouped(do, nheads_kv).astype(ctx.dtype), 3, padded_q)
    k4 = _pad_to(k.transpose(0, 2, 1, 3).astype(ctx.dtype), 2, padded_k)  # (B, Hkv, Nk, D)
    v4 = _pad_to(v.transpose(0, 2, 1, 3).astype(ctx.dtype), 2, padded_k)
    bias_shape = None if bias is None else bias.shape
    bias = _padded_bias(bias, ctx, padded_q, padded_k)
    segments = _padded_segments(segments, ctx, padded_q, padded_k)
    slopes = _grouped_slopes(slopes, nheads_kv, ctx.dtype, segments)
    # the float attn_mask's gradient, in the padded bias's shape (its broadcast dimensions 1)
    dbias = jnp.zeros(bias.shape, ctx.dtype) if bias is not None and cfg.bias_grad else None

    # -- one pass over the key blocks (FlashAttention-2's Algorithm 2, as blockwise.py): dK,
    # dV of a key block over the query blocks that see it, each tile's share of dQ (and of
    # the mask's gradient) added to its rows. The Triton kernels give dQ a pass of its own
    # (programs in parallel would need atomic adds); here the tiles run one after another,
    # and one pass saves recomputing each tile's probabilities and dP: five matmuls a tile,
    # not seven. --
    def key_block(carry, args):
        start_n, k_j, v_j, (lo, mid_lo, mid_hi, hi) = args

        def body(masked):
            def step(m, carry):
                dk_j, dv_j, dq, dbias = carry
                start_m = m * block_m
                q_i, do_i, lse2_i, delta_i = (lax.dynamic_slice_in_dim(x, start_m, block_m, 3)
                                              for x in (q5, do5, lse2, delta))
                p, t = _probs(q_i, k_j, lse2_i, start_m, start_n, ctx, masked, bias, slopes,
                              segments)
                keep = 1.0 if ctx.dropout_p == 0 else \
                    _dropout_scale(seed, start_m, start_n, p.shape, ctx, segments)
                # sum over the group's heads, which share this key head
                dv_j += jnp.einsum("bhgmn,bhgmd->bhnd", p * keep, do_i, precision=_HIGHEST)
                dp = jnp.einsum("bhgmd,bhnd->bhgmn", do_i, v_j, precision=_HIGHEST) * keep
                ds = _grad_scores(p, dp, delta_i)
                if dbias is not None:
                    dbias = _add_bias_tile(dbias, _sum_to_bias(ds, dbias.shape), start_m,
                                           start_n)
                ds = _grad_qk(ds, t, ctx)
                dk_j += jnp.einsum("bhgmn,bhgmd->bhnd", ds, q_i, precision=_HIGHEST)
                dq_i = lax.dynamic_slice_in_dim(dq, start_m, block_m, 3) + jnp.einsum(
                    "bhgmn,bhnd->bhgmd", ds, k_j, precision=_HIGHEST)
                return dk_j, dv_j, lax.dynamic_update_slice_in_dim(dq, dq_i, start_m, 3), dbias
            return step

        carry = (jnp.zeros_like(k_j), jnp.zeros_like(v_j), *carry)  # dK, dV (B, Hkv, BN, D)
        for a, b, masked in ((lo, mid_lo, True), (mid_lo, mid_hi, False), (mid_hi, hi, True)):
            carry = _block_loop(a, b, block_m, body(masked), carry)
        dk_j, dv_j, dq, dbias = carry
        return (dq, dbias), (dk_j, dv_j)

    starts_n = jnp.arange(0, padded_k, block_n)
    (dq5, dbias), (dk4, dv4) = lax.scan(
        key_block, (jnp.zeros_like(q5), dbias),
        (starts_n, _blocks(k4, 2, block_n), _blocks(v4, 2, block_n),
         segments.ranges_k if ctx.varlen else _ranges(ctx, False)))
    dq = _ungrouped(dq5[..., :seqlen_q, :])
    dk = _unblocks(dk4, 2)[:, :, :ctx.seqlen_k].transpose(0, 2, 1, 3)  # (B, Nk, Hkv, D)
    dv = _unblocks(dv4, 2)[:, :, :ctx.seqlen_k].transpose(0, 2, 1, 3)
    if dbias is not None:  # the padding's rows and columns dropped
        dbias = dbias[:, :, :bias_shape[2], :bias_shape[3]]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


# ----------------------------------------------------------------------------- Triton path

def _triton_launch(q, k, v, cfg):
    """Strides-free scalars shared by the three kernels, as flash_triton._launch_args."""
    from . import flash_triton

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    window_left, window_right = cfg.window
    wide = max(headdim, v.shape[3])
    return dict(
        stride_lb=nheads * seqlen_q, stride_lh=seqlen_q, stride_ab=0, stride_ah=0,
        nheads=nheads, group_size=nheads // nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        seqlen_bucket=flash_triton.seqlen_bucket(seqlen_q, seqlen_k), tma_ok=0, ws_ok=0,
        window_left=window_left, window_right=window_right,
        qk_scale=cfg.softmax_scale * LOG2E, softmax_scale=cfg.softmax_scale,
        softcap=cfg.softcap, dropout_p=0.0, seed_lo=0, seed_hi=0,
        drop_row0=0, drop_col0=0,
        **flash_triton.constexprs(headdim, q.dtype == jnp.float32, softcap=cfg.softcap > 0,
                                  headdim_v=v.shape[3]),
        # one fixed tile (the PyTorch launcher autotunes); 32 x 32 for large head dims; pointer
        # loads, so no warp specialization either (a TMA descriptor made on the device needs
        # Triton's allocator, which jax-triton's launch does not set up)
        BLOCK_M=64 if wide <= 128 else 32, BLOCK_N=64 if wide <= 128 else 32, USE_TMA=False,
        WARP_SPECIALIZE=False, FULL_TILES=False, num_warps=4, num_stages=2)


def _triton_strides(name, x):
    """(batch, seqlen, head) strides of a contiguous (batch, seqlen, nheads, headdim) array."""
    _, seqlen, nheads, headdim = x.shape
    return {f"stride_{name}b": seqlen * nheads * headdim, f"stride_{name}n": nheads * headdim,
            f"stride_{name}h": headdim}


def _triton_unused():
    """Valid pointers (and strides) for the disabled ALiBi, varlen, attn_mask and block_mask
    arguments (BIAS_KIND 0, BLOCK_SPARSE False: the binding takes neither mask); never read."""
    return dict(ALIBI=jnp.zeros((1,), jnp.float32), CU_Q=jnp.zeros((2,), jnp.int32),
                CU_K=jnp.zeros((2,), jnp.int32), BIAS=jnp.zeros((1,), jnp.float32),
                stride_bb=0, stride_bh=0, stride_bm=0, stride_bn=0,
                SPARSE=jnp.zeros((1,), jnp.int32), stride_sb=0, stride_sh=0, stride_sr=0,
                sparse_cols=0, sparse_bq=128, sparse_bk=128)


def _triton_forward(q, k, v, cfg):
    import jax_triton
    import triton

    from . import flash_triton

    batch, seqlen_q, nheads, _ = q.shape
    launch = _triton_launch(q, k, v, cfg)
    o_shape = jax.ShapeDtypeStruct((*q.shape[:3], v.shape[3]), q.dtype)
    o, lse = jax_triton.triton_call(
        kernel=flash_triton.jit_function(flash_triton._attn_fwd),
        out_type=(o_shape,
                  jax.ShapeDtypeStruct((batch, nheads, seqlen_q), jnp.float32)),
        grid=(triton.cdiv(seqlen_q, launch["BLOCK_M"]), batch * nheads),
        Q=q, K=k, V=v, **_triton_unused(), **_triton_strides("q", q), **_triton_strides("k", k),
        **_triton_strides("v", v), **_triton_strides("o", o_shape),
        **{**flash_triton.constexpr_defaults(flash_triton._attn_fwd), **launch},  # PIPELINE off
        TABLE=_triton_unused()["CU_K"], stride_tb=0, page_size=1, PAGED=False,  # keys not paged
        K_DESCALE=_triton_unused()["BIAS"], V_DESCALE=_triton_unused()["BIAS"], stride_kdb=0,
        stride_kdh=0, stride_vdb=0, stride_vdh=0)  # (float8 pages' scales: HAS_DESCALE off)
    return o, lse


def _triton_backward(do, dlse, q, k, v, o, lse, cfg):
    import jax_triton
    import triton

    from . import flash_triton

    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    launch = _triton_launch(q, k, v, cfg)
    # -- preprocess: delta = rowsum(do * o), over the values' head dim; a gradient of lse
    # enters as -dlse --
    delta = jax_triton.triton_call(
        kernel=flash_triton._attn_bwd_preprocess,
        out_type=jax.ShapeDtypeStruct(lse.shape, jnp.float32),
        grid=(triton.cdiv(seqlen_q, 128), batch * nheads),
        O=o, DO=do, CU_Q=_triton_unused()["CU_Q"], **_triton_strides("o", o),
        **_triton_strides("do", do), stride_lb=launch["stride_lb"], stride_lh=launch["stride_lh"],
        nheads=nheads, seqlen_q=seqlen_q, IS_VARLEN=False, HEAD_DIM=launch["HEAD_DIM_V"],
        BLOCK_D=launch["BLOCK_DV"], BLOCK_M=128, num_warps=4, num_stages=1)
    delta = delta - dlse.astype(jnp.float32)
    tensors = dict(Q=q, K=k, V=v, DO=do, LSE=lse, Delta=delta, **_triton_unused())
    strides = {**_triton_strides("q", q), **_triton_strides("k", k), **_triton_strides("v", v),
               **_triton_strides("do", do)}
    dk, dv = jax_triton.triton_call(  # dQ by its own kernel below: no atomics (atomic_dq=0)
        kernel=flash_triton.jit_function(flash_triton._attn_bwd_dkdv),
        out_type=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
        grid=(triton.cdiv(seqlen_k, launch["BLOCK_N"]), batch * nheads_kv),
        **tensors, **strides, **_triton_strides("dk", k), **_triton_strides("dv", v),
        DQ_ACC=_triton_unused()["ALIBI"], stride_dqb=0, stride_dqn=0, stride_dqh=0, atomic_dq=0,
        **{**flash_triton.constexpr_defaults(flash_triton._attn_bwd_dkdv), **launch})
    dq = jax_triton.triton_call(
        kernel=flash_triton.jit_function(flash_triton._attn_bwd_dq),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(triton.cdiv(seqlen_q, launch["BLOCK_M"]), batch * nheads),
        **tensors, **strides, **_triton_strides("dq", q), DBIAS=_triton_unused()["BIAS"],
        stride_dbh=0, stride_dbm=0,
        **{**flash_triton.constexpr_defaults(flash_triton._attn_bwd_dq), **launch})
    return dq, dk, dv


# ----------------------------------------------------------------------------- custom VJP

def _forward(q, k, v, bias, slopes, segments, seed, cfg):
    if 0 in q.shape[:2] or 0 in k.shape[:2]:  # empty: o = 0, lse = -inf (no key seen)
        batch, seqlen_q, nheads, _ = q.shape
        return (jnp.zeros((*q.shape[:3], v.shape[3]), q.dtype),
                jnp.full((batch, nheads, seqlen_q), -jnp.inf, _accumulator_dtype(q.dtype)))
    if cfg.backend == "triton":  # (no attn_mask or ALiBi there: attention() takes "jax")
        return _triton_forward(q, k, v, cfg)
    return _forward_dense(q, k, v, cfg, bias, slopes, segments, seed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, bias, slopes, segments, seed, cfg):
    return _forward(q, k, v, bias, slopes, segments, seed, cfg)


def _attention_fwd(q, k, v, bias, slopes, segments, seed, cfg):
    o, lse = _forward(q, k, v, bias, slopes, segments, seed, cfg)
    # saved for backward: O(seqlen), nothing N x N (and attn_mask's bias, the caller's)
    return (o, lse), (q, k, v, bias, slopes, segments, seed, o, lse)


def _attention_bwd(cfg, residuals, cotangents):
    """dq, dk, dv, a float attn_mask's gradient (None for a boolean one), None for the ALiBi
    slopes (not differentiated, as in FlashAttention), the segment ids and dropout's seed."""
    q, k, v, bias, slopes, segments, seed, o, lse = residuals
    do, dlse = cotangents
    if 0 in q.shape[:2] or 0 in k.shape[:2]:
        return (jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v),
                None if bias is None or not cfg.bias_grad else jnp.zeros_like(bias), None, None,
                None)
    if cfg.backend == "triton":
        return (*_triton_backward(do, dlse, q, k, v, o, lse, cfg), None, None, None, None)
    dq, dk, dv, dbias = _backward_dense(do, dlse, q, k, v, o, lse, cfg, bias, slopes, segments,
                                        seed)
    return dq, dk, dv, None if dbias is None else dbias.astype(bias.dtype), None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
_attention_jit = jax.jit(_attention, static_argnums=7)


def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, *, block_m=BLOCK_M,
              block_n=BLOCK_N, backend="auto", learnable_sink=None, attn_mask=None,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, segment_ids=None,
              dropout_p=0.0, dropout_rng=None):
    """Exact softmax attention, computed block by block; differentiable (custom VJP).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k, v: (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0 (GQA / MQA:
            query head h uses key/value head h // (nheads // nheads_kv)); v's headdim may
            differ (MLA), as in longflash.attention
        causal: bottom-right aligned, as longflash.attention and FlashAttention 2.1+: query i
            sees key j iff j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q > seqlen_k) gives output 0, lse -inf and zero
            gradients.
        softmax_scale: default 1 / sqrt(headdim).
        return_lse: also return the log-sum-exp of each row (gradients flow through it).
        block_m, block_n: query and key tile sizes of the blockwise path (default 128, 256;
            capped at the sequence lengths). Memory beyond inputs and outputs is
            O(batch * nheads * block_m * block_n).
        backend: "auto" (the Triton kernels through jax_triton for GPU arrays when it is
            installed, UNTESTED; the blockwise JAX path otherwise), "triton" or "jax".
        learnable_sink: (nheads,) floating-point array, or None: attention sinks, as in
            `longflash.attention` (one more logit per head in every row's softmax, attending
            to no value; lse includes it; differentiable).
        window_size: (left, right), -1 meaning unbounded, as in `longflash.attention`: query i
            sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q +
            right (with causal, right is 0). Key blocks outside every row's window are
            skipped (the shared block ranges), so a window's cost grows linearly in seqlen.
        softcap: > 0 replaces the scores s by softcap * tanh(s / softcap) (Gemma-2, Grok), as
            in `longflash.attention`; 0: none.
        alibi_slopes: (nheads,) or (batch, nheads) floating-point array, or None: adds
            -slope * |i + seqlen_k - seqlen_q - j| to the scores (after softcap), as in
            `longflash.attention`; not differentiated. Blockwise JAX path only.
        attn_mask: None, or a bool or floating-point array broadcastable to (batch, nheads,
            seqlen_q, seqlen_k), as in `longflash.attention` (PyTorch's attn_mask; the bias
            and mask of jax.nn.dot_product_attention): True where query i may see key j; a
            float is added to the scores (-inf hides a key). Combines with causal. Each tile
            reads its part of it; dimensions of size 1 are never broadcast in memory. A
            float mask is differentiable: its cotangent is dL/ds summed over the dimensions
            it broadcasts, an array of its own shape (computed in the backward for every
            float mask). Blockwise JAX path only ("auto" takes it; "triton" raises).
        segment_ids: None, or integer arrays (q_segment_ids, kv_segment_ids) of shapes (batch,
            seqlen_q) and (batch, seqlen_k), or one (batch, seqlen) array for both when
            seqlen_q == seqlen_k: query i sees key j only if their ids are equal (packed
            sequences, as the segment ids of splash attention; padding: an id no query has).
            Combines with causal, windows and attn_mask, which keep their positions in the
            row (for sequences packed one after the other, causal within each). Each tile
            masks from the ids, O(seqlen) memory; every tile the other masks leave is
            computed (no tile is skipped for lying across segments: `attention_varlen`, for
            sequences packed one after the other, skips them). Blockwise JAX path only.
        dropout_p: the probability of dropping each attention probability (training); kept
            ones are scaled by 1 / (1 - dropout_p); lse is of the undropped row. The backward
            pass regenerates the mask tile by tile (nothing N x N is stored). Blockwise JAX
            path only.
        dropout_rng: with dropout_p > 0: a jax.random key (its bits choose the stream; a
            traced key under jit), or an int seed in [0, 2^64), which drops exactly the
            elements that `longflash.attention(..., dropout_p, seed=)` drops (the same
            Philox numbers per (batch * nheads + head, query, key)).
    Returns:
        o: (batch, seqlen_q, nheads, headdim of v), dtype of q
        lse (if return_lse): (batch, nheads, seqlen_q), float32 (float64 for float64 inputs),
            natural log
    dtypes: float16, bfloat16, float32, float64 (jax_enable_x64). headdims 1..256.
    Bad input raises ValueError / TypeError naming the argument, before any work.
    Works under jax.jit, jax.vmap, jax.grad and jax.vjp (the blockwise path; the Triton
    path has no batching rule).
    """
    blockwise_only = attn_mask is not None or alibi_slopes is not None or \
        segment_ids is not None or (not isinstance(dropout_p, bool) and dropout_p != 0)
    if blockwise_only and backend == "triton":
        raise NotImplementedError("attn_mask, alibi_slopes, segment_ids and dropout run on the "
                                  "blockwise JAX path only: use backend='auto' or 'jax'")
    q, k, v, cfg = _check_inputs(q, k, v, causal, softmax_scale, return_lse, block_m, block_n,
                                 "jax" if blockwise_only else backend, window_size, softcap)
    _check_sink(learnable_sink, q.shape[2])
    slopes = _check_slopes(alibi_slopes, q.shape[0], q.shape[2])
    bias = _mask_bias(attn_mask, q, k)
    segments = _check_segment_ids(segment_ids, q, k)
    seed = _dropout_seed(dropout_p, dropout_rng)
    cfg = cfg._replace(dropout_p=float(dropout_p))
    if bias is not None:  # a float mask's cotangent is computed, a boolean one's is not
        cfg = cfg._replace(bias_grad=attn_mask.dtype != np.bool_)
    o, lse = _attention_jit(q, k, v, bias, slopes, segments, seed, cfg)
    if learnable_sink is not None:
        o, lse = _with_sink(o, lse, learnable_sink)
    return (o, lse) if return_lse else o


def _check_segment_ids(segment_ids, q, k):
    """segment_ids checked, as (q_segment_ids, kv_segment_ids) arrays; None stays None."""
    if segment_ids is None:
        return None
    pair = tuple(segment_ids) if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
    shapes = ((q.shape[0], q.shape[1]), (k.shape[0], k.shape[1]))
    for name, ids, shape in zip(("q_segment_ids", "kv_segment_ids"), pair, shapes):
        if len(pair) != 2 or not isinstance(ids, (jax.Array, np.ndarray)) or \
                not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"segment_ids must be an integer array (batch, seqlen) or a pair "
                            f"(q_segment_ids, kv_segment_ids) of them, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if tuple(ids.shape) != shape:
            raise ValueError(f"{name} must have shape (batch, seqlen) = {shape}, got "
                             f"{tuple(ids.shape)}")
    return tuple(jnp.asarray(x) for x in pair)


def _dropout_seed(dropout_p, dropout_rng):
    """dropout_p checked; dropout's key as uint32 (2,) (None without dropout)."""
    check_real("dropout_p", dropout_p, "a float in [0, 1)")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0:
        return None
    if isinstance(dropout_rng, int) and not isinstance(dropout_rng, bool):
        if not 0 <= dropout_rng < 2**64:
            raise ValueError(f"dropout_rng as an int seed must lie in [0, 2^64), got {dropout_rng}")
        return jnp.asarray([dropout_rng & 0xFFFFFFFF, dropout_rng >> 32], jnp.uint32)
    is_key = isinstance(dropout_rng, (jax.Array, np.ndarray)) and (
        jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key) or
        (dropout_rng.dtype == np.uint32 and dropout_rng.shape == (2,)))
    if not is_key:
        raise TypeError(f"dropout_p > 0 needs dropout_rng: a jax.random key or an int seed (JAX "
                        f"has no global random state), got {type(dropout_rng).__name__}")
    return jax.random.bits(dropout_rng, (2,), jnp.uint32)


def _check_slopes(alibi_slopes, batch, nheads):
    """ALiBi's slopes checked, as a (1 or batch, nheads) array; None stays None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, (jax.Array, np.ndarray)) or \
            not jnp.issubdtype(alibi_slopes.dtype, jnp.floating):
        raise TypeError(f"alibi_slopes must be a floating-point array of shape (nheads,) or "
                        f"(batch, nheads), got "
                        f"{getattr(alibi_slopes, 'dtype', type(alibi_slopes).__name__)}")
    check_alibi_shape(alibi_slopes.shape, batch, nheads)
    return jnp.asarray(alibi_slopes).reshape(-1, nheads)


def _mask_array(attn_mask, q, seqlen_k, keys_at_least=False):
    """attn_mask checked (type; shape broadcastable to (batch, nheads, seqlen_q, seqlen_k), or
    with keys_at_least a last dimension of 1 or >= seqlen_k, None: unknown) and returned 4-D,
    leading dimensions of 1 added."""
    if not isinstance(attn_mask, (jax.Array, np.ndarray)) or not (
            attn_mask.dtype == np.bool_ or jnp.issubdtype(attn_mask.dtype, jnp.floating)):
        raise TypeError(f"attn_mask must be a bool or floating-point array, or None, got "
                        f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    shape = tuple(attn_mask.shape)
    check_attn_mask_shape(shape, q.shape[0], q.shape[2], q.shape[1], seqlen_k, keys_at_least)
    return jnp.asarray(attn_mask).reshape((1,) * (4 - len(shape)) + shape)


def _mask_bias(attn_mask, q, k):
    """attn_mask checked (before any work) and returned as a 4-D additive bias (batch or 1,
    nheads or 1, seqlen_q or 1, seqlen_k or 1): a boolean one as 0 / -inf in the accumulator
    dtype, a float one as it is; None stays None."""
    if attn_mask is None:
        return None
    bias = _mask_array(attn_mask, q, k.shape[1])
    if bias.dtype == jnp.bool_:
        return jnp.where(bias, 0.0, -jnp.inf).astype(_accumulator_dtype(q.dtype))
    return bias


def _check_sink(learnable_sink, nheads):
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, (jax.Array, np.ndarray)) or \
            not jnp.issubdtype(learnable_sink.dtype, jnp.floating):
        raise TypeError(f"learnable_sink must be a floating-point array of shape (nheads,) or "
                        f"None, got {getattr(learnable_sink, 'dtype', type(learnable_sink))}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got "
                         f"{tuple(learnable_sink.shape)}")


def _with_sink(o, lse, learnable_sink):
    """_common.with_learnable_sink in JAX: o * sigmoid(lse - sink), logaddexp(lse, sink)."""
    sink = jnp.asarray(learnable_sink).astype(lse.dtype)[:, None]  # (H, 1)
    share = jax.nn.sigmoid(lse - jnp.maximum(sink, jnp.finfo(lse.dtype).min))  # (B, H, Nq)
    o = (o * jnp.swapaxes(share, -1, -2)[..., None]).astype(o.dtype)
    return o, jnp.logaddexp(lse, sink)


def attention_ref(q, k, v, causal=False, softmax_scale=None, learnable_sink=None,
                  attn_mask=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                  dropout_p=0.0, dropout_rng=None):
    """Standard attention that materializes the (seqlen_q, seqlen_k) matrix, in the inputs'
    dtype, with the same conventions as `attention`. Returns (o, lse). The ground truth of
    the tests (run in float64) and the naive baseline. learnable_sink: (nheads,) or None, a
    column of scores appended to every row, then dropped. attn_mask, window_size, softcap,
    alibi_slopes, dropout_p, dropout_rng: as in `attention` (the same elements dropped).
    Compiled as one function (jit; causal, softmax_scale, window_size, softcap and dropout_p
    are static): run op by op, each new shape compiled some twenty ops one at a time."""
    seed = _dropout_seed(dropout_p, dropout_rng)  # checked here: an int seed stays a number
    return _attention_ref(q, k, v, bool(causal), softmax_scale, learnable_sink, attn_mask,
                          tuple(window_size), float(softcap), alibi_slopes, float(dropout_p),
                          seed)


@functools.partial(jax.jit, static_argnums=(3, 4, 7, 8, 10))
def _attention_ref(q, k, v, causal, softmax_scale, learnable_sink, attn_mask, window_size,
                   softcap, alibi_slopes, dropout_p, seed):
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else softmax_scale
    k = jnp.repeat(k, nheads // nheads_kv, axis=2)  # (B, Nk, H, D)
    v = jnp.repeat(v, nheads // nheads_kv, axis=2)
    scores = jnp.einsum("bihd,bjhd->bhij", q, k, precision=_HIGHEST) * scale  # (B, H, Nq, Nk)
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    if alibi_slopes is not None:  # (H,) or (B, H) -> (B or 1, H, 1, 1)
        slopes = jnp.asarray(alibi_slopes).reshape(-1, nheads)[:, :, None, None]
        i = jnp.arange(seqlen_q)[:, None]
        j = jnp.arange(seqlen_k)[None, :]
        scores = scores - slopes.astype(scores.dtype) * jnp.abs(i + seqlen_k - seqlen_q - j)
    if attn_mask is not None:
        scores = (jnp.where(attn_mask, scores, -jnp.inf) if attn_mask.dtype == jnp.bool_
                  else scores + attn_mask.astype(scores.dtype))
    window_left, window_right = window_size[0], 0 if causal else window_size[1]
    if (window_left, window_right) != (-1, -1):
        i = jnp.arange(seqlen_q)[:, None]
        j = jnp.arange(seqlen_k)[None, :]
        scores = jnp.where(visible(i, j, seqlen_q, seqlen_k, window_left, window_right),
                           scores, -jnp.inf)
    if learnable_sink is not None:  # (B, H, Nq, Nk + 1)
        sink = jnp.broadcast_to(learnable_sink.astype(scores.dtype)[None, :, None, None],
                                (batch, nheads, seqlen_q, 1))
        scores = jnp.concatenate([scores, sink], axis=-1)
    # softmax with the row max subtracted; a row that sees no key gets p = 0, lse = -inf
    # (written so that no NaN arises, in values or in gradients)
    m = lax.stop_gradient(scores.max(-1, keepdims=True))
    e = jnp.exp(scores - jnp.where(jnp.isneginf(m), 0.0, m))
    l = e.sum(-1, keepdims=True)  # noqa: E741
    l_safe = jnp.where(l == 0, 1.0, l)
    p = e / l_safe
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(l_safe))[..., 0]
    p = p[..., :seqlen_k]
    if dropout_p > 0:
        bh = jnp.arange(batch * nheads).reshape(batch, nheads, 1, 1)
        i, j = jnp.arange(seqlen_q)[:, None], jnp.arange(seqlen_k)[None, :]
        keep = _philox_uniform(seed, bh, i, j) >= dropout_p
        p = p * keep / (1.0 - dropout_p)
    o = jnp.einsum("bhij,bjhd->bihd", p, v, precision=_HIGHEST)
    return o.astype(q.dtype), lse


# decoding over a KV cache and packed sequences: files of their own, which import this one's
# helpers
from .jax_kvcache import attention_with_kvcache  # noqa: E402
from .jax_varlen import attention_varlen  # noqa: E402

__all__ = ["attention", "attention_ref", "attention_varlen", "attention_with_kvcache",
           "jax_triton_missing"]
