"""What the three implementations share: constants, the visibility rule, block ranges,
the dropout random numbers, output allocation."""

import math
import numbers
from typing import NamedTuple, Optional

import torch

LOG2E = math.log2(math.e)  # the kernels work in base 2: exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)

# Tests set this to True: every output is then allocated full of NaN, so an element that
# a kernel forgets to write shows up as NaN instead of as stale memory.
POISON_OUTPUTS = False


MAX_HEADDIM = 256
# Decoding's values may be wider (attention_with_kvcache): MLA's absorbed form reads a shared
# latent of 512 per token as the values (DeepSeek-V2/V3's kv_lora_rank), beside 64 rotary dims
# as the keys.
MAX_HEADDIM_V_KVCACHE = 512
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # a KV cache's, in decoding
# Block-sparse attention (block_mask): blocks of this many queries and keys by default
# (FlexAttention's default block), of any multiple of BLOCK_SPARSE_MULTIPLE: each tile of every
# kernel (powers of two, at most 128 x 128; shrunk to divide smaller blocks) lies inside one
# block, so a tile is computed or skipped whole, its bit read once.
BLOCK_SPARSE_UNIT = 128
BLOCK_SPARSE_MULTIPLE = 64


# -- the operators torch.ops.longflash.* --

try:
    from torch.library import infer_schema
except ImportError:  # torch 2.4
    from torch._library.infer_schema import infer_schema

_LIBRARY = torch.library.Library("longflash", "FRAGMENT")


def define_op(name, impl, fake):
    """torch.ops.longflash.<name> (returned: its default overload): schema inferred from
    impl's annotations, impl run on every device, fake giving the outputs' shapes to
    torch.compile. Registered with torch.library's define and impl, not custom_op: each call
    then crosses the dispatcher once, without custom_op's Python layers (an alias check, and,
    with register_autograd, an autograd layer whose argument filling is quadratic in the
    arguments): a training forward's host time 207 -> 59 us, a forward and backward's 381 ->
    180 us on a 2-core EPYC (experiments.host_time, PERFLOG). Autograd, where an op has one,
    is a torch.autograd.Function around it."""
    _LIBRARY.define(name + infer_schema(impl, mutates_args=()))
    _LIBRARY.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"longflash::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.longflash, name).default


# -- validation shared by the PyTorch and JAX front ends (shapes as tuples, plain Python) --

def check_shapes(q_shape, k_shape, v_shape, max_headdim_v=MAX_HEADDIM):
    """q: (batch, seqlen_q, nheads, headdim), k: (batch, seqlen_k, nheads_kv, headdim) and
    v: (batch, seqlen_k, nheads_kv, headdim_v) with nheads % nheads_kv == 0; headdim_v may
    differ from headdim (MLA), up to max_headdim_v. Returns (nheads, nheads_kv, headdim);
    raises naming the argument otherwise."""
    if tuple(k_shape[:3]) != tuple(v_shape[:3]):
        raise ValueError(f"k and v must agree in (batch, seqlen_k, nheads_kv), got shapes "
                         f"{tuple(k_shape)} and {tuple(v_shape)}")
    batch, _, nheads, headdim = q_shape
    if k_shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {k_shape[0]}")
    if k_shape[3] != headdim:
        raise ValueError(f"q and k must have the same headdim, got {headdim} and {k_shape[3]}")
    for name, d, most in (("headdim", headdim, MAX_HEADDIM),
                          ("headdim of v", v_shape[3], max_headdim_v)):
        if not 1 <= d <= most:
            raise ValueError(f"{name} must be between 1 and {most}, got {d}")
    nheads_kv = k_shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads_kv of k and v "
                         f"({nheads_kv}) (GQA / MQA)")
    return nheads, nheads_kv, headdim


def check_bools(**flags):
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_real(name, x, accepted):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {accepted}, got {type(x).__name__}")


def check_window_size(window_size):
    """window_size: a pair of ints (left, right), each >= -1 (-1: unbounded)."""
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if min(window_size) < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {window_size}")


def check_alibi_shape(shape, batch, nheads):
    """ALiBi slopes: (nheads,) or (batch, nheads)."""
    shape = tuple(shape)  # compared entry by entry: `in` (Python's identity-or-equality) on
    # sizes that torch.compile(dynamic=True) made symbolic is False for equal ones, unguarded
    if not ((len(shape) == 1 and shape[0] == nheads)
            or (len(shape) == 2 and shape[0] == batch and shape[1] == nheads)):
        raise ValueError(f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
                         f"got {tuple(shape)}")


def check_attn_mask_shape(shape, batch, nheads, seqlen_q, seqlen_k, keys_at_least=False):
    """attn_mask's shape: broadcastable to (batch, nheads, seqlen_q, seqlen_k); keys_at_least
    (a decoding mask, over the cache's key positions): its last dimension may also exceed
    seqlen_k, the longest sequence's keys (None: unknown, not checked)."""
    shape, target = tuple(shape), (batch, nheads, seqlen_q, seqlen_k)
    fits = [n == 1 or n == t for n, t in zip(shape[::-1], target[::-1])]  # not `in`: above
    if keys_at_least and shape:
        fits[0] = shape[-1] == 1 or seqlen_k is None or shape[-1] >= seqlen_k
    if len(shape) > 4 or not all(fits):
        keys = "L) with L = 1 or L >= seqlen_k" if keys_at_least else "seqlen_k)"
        raise ValueError(f"attn_mask must be broadcastable to (batch, nheads, seqlen_q, {keys};"
                         f" (batch, nheads, seqlen_q, seqlen_k) = {target}, got shape {shape}")


def check_rotary_tables(cos, sin, is_float_matrix, kind, headdim,
                        names=("rotary_cos", "rotary_sin")):
    """A pair of rotary tables: (seqlen_ro, rotary_dim / 2) floating-point matrices
    (is_float_matrix; kind names them in errors, names the arguments) of one shape, with
    rotary_dim in [2, headdim]. Returns seqlen_ro."""
    for name, x in zip(names, (cos, sin)):
        if not is_float_matrix(x):
            raise TypeError(f"{name} must be a floating-point {kind} of shape (seqlen_ro, "
                            f"rotary_dim / 2), got {getattr(x, 'dtype', type(x).__name__)} "
                            f"{tuple(getattr(x, 'shape', ()))}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"{names[0]} and {names[1]} must have the same shape, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= headdim:
        raise ValueError(f"rotary_dim (2 * {names[0]}.shape[1] = {rotary_dim}) must lie in "
                         f"[2, headdim = {headdim}]")
    return cos.shape[0]


def check_rotary(rotary_cos, rotary_sin, is_float_matrix, kind, has_new_keys, headdim, seqlen_q,
                 max_seqlen, seqlen_new, q_in_order):
    """Decoding's rotary arguments, for both bindings: False if neither is given, True if both
    are, as (seqlen_ro, rotary_dim / 2) floating-point matrices (is_float_matrix; kind names
    them in errors: "tensor", "array") with rotary_dim in [2, headdim] and a row for every
    position used (max_seqlen: the longest length before the append, None if unknown)."""
    if rotary_cos is None and rotary_sin is None:
        return False
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together (or neither)")
    if not has_new_keys:
        raise ValueError("rotary_cos and rotary_sin rotate the new keys as they are appended: "
                         "they need k and v (as in FlashAttention)")
    seqlen_ro = check_rotary_tables(rotary_cos, rotary_sin, is_float_matrix, kind, headdim)
    if max_seqlen is not None:
        last = max_seqlen + max(seqlen_new, seqlen_q if q_in_order else 1) - 1
        if last >= seqlen_ro:
            raise ValueError(f"rotary_cos and rotary_sin have {seqlen_ro} positions, position "
                             f"{last} is needed (cache_seqlens + new tokens)")
    return True


def check_descale_kind(name, descale, shape, cache_is_fp8, cache_dtype, is_float32, kind,
                       k_name="k_cache"):
    """A float8 cache's k_descale or v_descale, for both bindings: "none" (None: 1), "float" (a
    positive finite float) or "array" (is_float32(descale): a float32 tensor / array, here
    checked broadcastable to shape = (batch, nheads_kv); kind names it in errors). Raises
    ValueError for a scale without a float8 cache (cache_dtype: k_cache's) or a float <= 0, or
    not finite, TypeError for anything else."""
    if descale is None:
        return "none"
    if not cache_is_fp8:
        raise ValueError(f"{name} dequantizes a float8 cache (float8_e4m3fn, float8_e5m2); "
                         f"{k_name} has dtype {cache_dtype}")
    if isinstance(descale, (int, float)) and not isinstance(descale, bool):
        if not 0 < descale < float("inf"):
            raise ValueError(f"{name} must be positive and finite, got {descale}")
        return "float"
    # .shape read only of a float32 tensor / array: torch 2.4's Dynamo cannot trace getattr
    # with a default on a tensor (the error's message may)
    dims = tuple(descale.shape) if is_float32(descale) else None
    if dims is None or len(dims) > 2 or any(n != 1 and n != m for n, m in
                                            zip(dims[::-1], shape[::-1])):
        raise TypeError(f"{name} must be a float, or a float32 {kind} broadcastable to (batch, "
                        f"nheads_kv) = {tuple(shape)}, got "
                        f"{getattr(descale, 'dtype', type(descale))} "
                        f"{tuple(getattr(descale, 'shape', ()))}")
    return "array"


def check_block_size(block_size):
    """block_size: an int or (queries, keys), each a positive multiple of
    BLOCK_SPARSE_MULTIPLE. Returns (block_size_q, block_size_k)."""
    sizes = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    try:
        sizes = tuple(sizes)
    except TypeError:
        sizes = ()
    if len(sizes) != 2 or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool)
                                  and n > 0 and n % BLOCK_SPARSE_MULTIPLE == 0 for n in sizes):
        raise ValueError(f"block_size must be a positive multiple of {BLOCK_SPARSE_MULTIPLE}, or "
                         f"a pair of them (queries, keys), got {block_size!r}")
    return int(sizes[0]), int(sizes[1])


def check_block_mask_shape(shape, batch, nheads, seqlen_q, seqlen_k, block_size_q,
                           block_size_k, keys_at_least=False):
    """block_mask's shape: (batch or 1, nheads or 1, ceil(seqlen_q / block_size_q),
    ceil(seqlen_k / block_size_k)) (packed sequences: of the longest); keys_at_least (a
    decoding mask, over the cache's key positions): its last dimension may also be larger
    (seqlen_k None: unknown, not checked)."""
    blocks = (-(-seqlen_q // block_size_q),
              None if seqlen_k is None else -(-seqlen_k // block_size_k))
    shape = tuple(shape)
    fits = len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, nheads) and \
        shape[2] == blocks[0]
    if fits and keys_at_least:
        fits = blocks[1] is None or shape[3] >= blocks[1]
    elif fits:
        fits = shape[3] == blocks[1]
    if not fits:
        keys = "at least " if keys_at_least else ""
        raise ValueError(f"block_mask must have shape (batch or 1, nheads or 1, "
                         f"ceil(seqlen_q / {block_size_q}), {keys}ceil(seqlen_k / "
                         f"{block_size_k})) = ({batch} or 1, {nheads} or 1, {blocks[0]}, "
                         f"{keys}{blocks[1]}), got {shape}")


def block_mask_elements(block_mask, block_size_q, block_size_k, seqlen_q, seqlen_k,
                        start_m=0, start_n=0):
    """The (.., seqlen_q, seqlen_k) boolean mask that block_mask (.., query blocks, key
    blocks) stands for: query i sees key j iff block_mask[.., i // block_size_q,
    j // block_size_k]; of queries start_m.. and keys start_n.. (one tile), a copy."""
    i = torch.arange(start_m, start_m + seqlen_q, device=block_mask.device) // block_size_q
    j = torch.arange(start_n, start_n + seqlen_k, device=block_mask.device) // block_size_k
    return block_mask[..., i[:, None], j[None, :]]


def block_lists(bits):
    """bits (..., rows, cols) bool -> (..., rows, 2 cols + 1) int32: for each row, the
    exclusive running count of its True columns (cols + 1 entries: how many come before each
    column, then the total), then the True columns' indices in increasing order (the first
    `total` of cols entries; the rest are the False ones, never read). On the device, no
    synchronization: a cumsum and a stable argsort. The Triton kernels' loops read them
    (flash_triton._sparse_span, _sparse_tile), as does the IO simulator (experiments/io_sim.py)."""
    counts = bits.to(torch.int32).cumsum(-1, dtype=torch.int32)
    prefix = torch.nn.functional.pad(counts, (1, 0))
    order = torch.argsort((~bits).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return torch.cat([prefix, order], -1)


def group_block_lists(block_mask, group, seqlen_q, block_m, block_size_q):
    """A split-KV decoding program's block_lists: block_mask (batch or 1, nheads or 1, query
    blocks, key blocks), its key blocks that some row of the program may see. A program holds
    block_m of the seqlen_q * group packed rows of one KV head (row r: query r // group, query
    head r % group of the KV head's group): its bits are the union of its group's heads' and of
    its rows' query blocks' (all the group's heads even where block_m < group: a superset, each
    row's own bit still masks its scores). Returns (batch or 1, nheads_kv or 1, programs,
    2 key blocks + 1) int32, programs = ceil(seqlen_q * group / block_m)."""
    batch, heads, n_qblocks, n_kblocks = block_mask.shape
    bits = block_mask  # one mask for every head, or the union of each group's
    if heads > 1:
        bits = block_mask.reshape(batch, heads // group, group, n_qblocks, n_kblocks).any(2)
    programs = -(-seqlen_q * group // block_m)
    if n_qblocks == 1:  # every row in the one query block (decoding): one list for every program
        return block_lists(bits).expand(-1, -1, programs, -1)
    rows = torch.arange(seqlen_q * group, device=block_mask.device)
    covers = torch.zeros(programs, n_qblocks, device=block_mask.device)  # program x query block
    covers[rows // block_m, rows // group // block_size_q] = 1
    union = torch.einsum("pq,bhqk->bhpk", covers, bits.to(covers.dtype)) > 0
    return block_lists(union)


def check_qv(qv, q, headdim_v, is_array, kind):
    """MLA's absorbed queries for both bindings' attention_with_kvcache: is_array(qv) (a
    tensor / array, kind names it), of shape (batch, seqlen_q, nheads, headdim_v) = q's first
    three dims and v_cache's head dim, and q's dtype. Returns the default softmax scale with
    qv, 1 / sqrt(headdim + headdim_v) (FlashAttention-3's)."""
    if not is_array(qv):
        raise TypeError(f"qv must be a {kind} or None, got {type(qv).__name__}")
    shape = (*q.shape[:3], headdim_v)
    if tuple(qv.shape) != shape:
        raise ValueError(f"qv must have shape (batch, seqlen_q, nheads, headdim_v of v_cache) "
                         f"= {shape}, got {tuple(qv.shape)}")
    if qv.dtype != q.dtype:
        raise TypeError(f"qv has dtype {qv.dtype}, q has {q.dtype}: they must match")
    return (q.shape[3] + headdim_v) ** -0.5


def check_offsets(name, offsets, total, max_len):
    """Packed sequences' offsets (a list of ints, cu_seqlens' values): from 0 to total (None:
    any end), non-decreasing, no sequence longer than max_len."""
    max_name = name.replace("cu_seqlens", "max_seqlen")
    if offsets[0] != 0 or (total is not None and offsets[-1] != total):
        raise ValueError(f"{name} must start at 0 and end at the number of tokens "
                         f"({'any' if total is None else total}), got {offsets[0]} ... "
                         f"{offsets[-1]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing")
    if lengths and max(lengths) > max_len:
        raise ValueError(f"{max_name} = {max_len} is smaller than the longest sequence "
                         f"({max(lengths)})")


def check_softcap(softcap):
    """softcap: a finite real >= 0 (0: no softcap)."""
    check_real("softcap", softcap, "a float >= 0")
    if not 0 <= softcap < math.inf:  # comparisons, not math.isfinite: a SymFloat under
        # torch.compile(dynamic=True) (which makes float arguments and defaults symbolic)
        raise ValueError(f"softcap must be a finite float >= 0 (0: no softcap), got {softcap}")


def resolve_softmax_scale(softmax_scale, headdim):
    """softmax_scale as a float: default 1 / sqrt(headdim); must be positive and finite."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    check_real("softmax_scale", softmax_scale, "a positive float or None")
    if not 0 < softmax_scale < math.inf:  # comparisons: check_softcap
        raise ValueError(f"softmax_scale must be a positive finite float or None, "
                         f"got {softmax_scale}")
    return float(softmax_scale)


# The oldest Triton that compiles the kernels (tests/compile_for_gpu.py and
# compile_decode_for_gpu.py for sm_80 and sm_90 with triton==3.4.0). 3.0-3.3 have no
# tl.make_tensor_descriptor, which Triton's dependency finder looks up at every launch (the TMA
# branches untaken or not); with it stubbed out, 3.0-3.2 reject the kernels' starred arguments
# and 3.3 a chained boolean operator.
MIN_TRITON = (3, 4)


def triton_problem():
    """None if the Triton kernels can run here, else what stops them: no triton package (macOS,
    Windows), or one older than MIN_TRITON. Read from the package's metadata (the "triton"
    distribution, or PyTorch's nightly "pytorch-triton"), without importing it."""
    import importlib.metadata
    import importlib.util
    import re

    if importlib.util.find_spec("triton") is None:
        return "the triton package (Linux only)"
    for name in ("triton", "pytorch-triton"):
        try:
            version = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        return None  # a triton without metadata (a source tree on the path): trusted
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_TRITON:
        return (f"triton >= {'.'.join(map(str, MIN_TRITON))} (found triton {version}; "
                f"torch >= 2.8 comes with one)")
    return None


def fix_triton_interpreter():
    """Let TRITON_INTERPRET=1 run what the kernels use. The interpreter only: compiled kernels
    never pass through here.

    - A tensor descriptor's atomic_add (a TMA reduction on Hopper), which the interpreter lacks
      (Triton 3.6 to 3.9): done as the masked atomic adds of the tile's elements in bounds.
    - NumPy >= 2.5 with Triton < 3.7 (the GPU image's Triton 3.6 with NumPy 2.5, say): their
      interpreter turns a scalar into a loop bound with int() of a NumPy array of shape (1,),
      which NumPy 2.5 refuses ("only 0-dimensional arrays can be converted to Python scalars").
      Triton 3.7 squeezes the array first; this does the same for older Tritons."""
    import triton
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_descriptor_reduce"):
        def create_descriptor_reduce(self, kind, desc, value, indices):
            if kind != interpreter._ir.DESCRIPTOR_REDUCE_KIND.ADD:
                raise NotImplementedError(f"tensor descriptor reduction {kind} (interpreter)")
            ptrs, mask = desc.materialize_pointers(indices)
            return self.create_atomic_rmw(interpreter._ir.ATOMIC_OP.FADD, ptrs, value, mask,
                                          interpreter._ir.MEM_SEMANTIC.RELAXED, None)

        builder.create_descriptor_reduce = create_descriptor_reduce
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if version >= (3, 7) or patch is None or getattr(patch, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, *args):
        patch(tensor, *args)
        tensor.__index__ = lambda self: int(self.handle.data.squeeze())

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def accumulator_dtype(dtype):
    """float32 accumulators for 16- and 32-bit inputs; float64 stays float64 (torch path only)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def empty_like(x, dtype=None):
    out = torch.empty_like(x, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def empty_outputs(q, varlen=False, headdim_v=None):
    """o like q (with headdim_v columns if given: values of another head dim); lse (batch,
    nheads, seqlen_q), or (nheads, total_q) for packed sequences. Shared by every
    implementation and by the fake (meta) implementation of the custom op, so that shapes and
    strides always agree."""
    o = empty_like(q) if headdim_v in (None, q.shape[-1]) else empty_like(
        q.new_empty((*q.shape[:-1], headdim_v)))
    shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = q.new_empty(shape, dtype=accumulator_dtype(q.dtype))
    return o, lse.fill_(float("nan")) if POISON_OUTPUTS else lse


# ----------------------------------------------------------------------------- sinks

def check_learnable_sink(learnable_sink, nheads, device):
    """learnable_sink: None, or a floating-point (nheads,) tensor on q's device."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor) or not learnable_sink.is_floating_point():
        raise TypeError(f"learnable_sink must be a floating-point tensor of shape (nheads,) or "
                        f"None, got {getattr(learnable_sink, 'dtype', type(learnable_sink))}")
    if tuple(learnable_sink.shape) != (nheads,):
        raise ValueError(f"learnable_sink must have shape (nheads,) = ({nheads},), got "
                         f"{tuple(learnable_sink.shape)}")
    if learnable_sink.device != device:
        raise ValueError(f"learnable_sink is on {learnable_sink.device}, q on {device}: they "
                         f"must match")


def with_learnable_sink(o, lse, learnable_sink):
    """Attention whose softmax has one more logit per head, learnable_sink[h], that attends to
    no value (gpt-oss's attention sinks), from attention without it: the softmax's normalizer
    becomes lse' = log(exp(lse) + exp(sink)), so every probability, and o, is scaled by
    exp(lse - lse') = sigmoid(lse - sink). Exact, differentiable in o, lse and the sink (the
    kernels' backward takes the gradient of lse), and costs one elementwise pass over o.
    o: (..., seqlen_q, nheads, headdim), lse: (..., nheads, seqlen_q) -> (o', lse'), same shapes.
    A row that sees no key keeps o = 0 and gets lse' = sink; a sink of -inf is no sink."""
    sink = learnable_sink.to(lse.dtype)[:, None]  # (H, 1)
    # clamped: an empty row (lse -inf) with a -inf sink has share 0, not NaN
    keys_share = torch.sigmoid(lse - sink.clamp(min=torch.finfo(lse.dtype).min))  # (..., H, Nq)
    # o (its dtype) times float32: autograd keeps o itself, not a float32 copy
    o = (o * keys_share.transpose(-1, -2)[..., None]).to(o.dtype)
    return o, torch.logaddexp(lse, sink)


# ----------------------------------------------------------------------------- visibility

def visible(i, j, seqlen_q, seqlen_k, window_left, window_right):
    """True where query i may see key j. Windows are aligned bottom-right, like causal:
    i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
    a negative side meaning unbounded. causal is window_right = 0. Works on ints and on
    broadcastable tensors."""
    diag = i + (seqlen_k - seqlen_q)
    ok = (j <= diag + window_right) if window_right >= 0 else (j == j)
    if window_left >= 0:
        ok = ok & (j >= diag - window_left)
    return ok


def as_bytes(x):
    """x, or a float8 tensor's uint8 view (the same bytes), to index: torch 2.4 has no indexing
    kernels for float8 on CPU; moving bytes is exact on every version."""
    return x.view(torch.uint8) if x.dtype in FP8_DTYPES else x


def take(x, *index):
    """x[index], a copy (differentiable), float8 moved as bytes (as_bytes)."""
    return as_bytes(x)[index].view(x.dtype) if x.dtype in FP8_DTYPES else x[index]


def paged_rows(pages, block_table, b, pos):
    """Rows at key positions pos of sequences b (broadcasting index tensors, or ints) of a
    paged tensor (num_pages, page_size, ...): key n of sequence b lives in page
    block_table[b, n // page_size], slot n % page_size. A copy."""
    page_size = pages.shape[1]
    return take(pages, block_table[b, pos // page_size].long(), pos % page_size)


def _floor(x, block):
    return x // block * block


def _ceil(x, block):
    return (x + block - 1) // block * block


def key_range(start_m, block_m, block_n, seqlen_q, seqlen_k, window_left, window_right):
    """Keys visited by the query block [start_m, start_m + block_m).

    Returns (lo, mid_lo, mid_hi, hi): keys [lo, mid_lo) and [mid_hi, hi) need the mask,
    keys [mid_lo, mid_hi) are visible to every row of the block and need none, keys
    outside [lo, hi) are visible to no row and are skipped. lo, mid_lo and mid_hi are
    multiples of block_n.
    """
    offset = seqlen_k - seqlen_q
    first, last = start_m + offset, start_m + block_m - 1 + offset  # diagonals of the rows
    clamp = lambda x: min(max(x, 0), seqlen_k)  # noqa: E731
    hi = seqlen_k if window_right < 0 else clamp(last + window_right + 1)
    lo = 0 if window_left < 0 else _floor(clamp(first - window_left), block_n)
    mid_lo = lo if window_left < 0 else min(_ceil(max(last - window_left, lo), block_n),
                                            _ceil(hi, block_n))
    every_row_hi = seqlen_k if window_right < 0 else clamp(first + window_right + 1)
    mid_hi = max(_floor(every_row_hi, block_n), mid_lo)
    return lo, mid_lo, mid_hi, hi


def query_range(start_n, block_m, block_n, seqlen_q, seqlen_k, window_left, window_right):
    """Queries visited by the key block [start_n, start_n + block_n), for dK and dV.

    Returns (lo, mid_lo, mid_hi, hi) as key_range does. Query i sees key j iff
    j - offset - window_right <= i <= j - offset + window_left: the same rule with queries
    and keys swapped, the offset negated and the window mirrored, so it is key_range so.
    """
    return key_range(start_n, block_n, block_m, seqlen_k, seqlen_q, window_right, window_left)


# ----------------------------------------------------------------------------- dropout

PHILOX_ROUND_A, PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
PHILOX_KEY_A, PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF


def _mul_hi_lo(a, b):
    """High and low 32 bits of a * b for uint32 values held in int64, without overflow."""
    a_hi, a_lo, b_hi, b_lo = a >> 16, a & 0xFFFF, b >> 16, b & 0xFFFF
    lo_lo, hi_hi = a_lo * b_lo, a_hi * b_hi
    mid = a_hi * b_lo + a_lo * b_hi
    return hi_hi + ((mid + (lo_lo >> 16)) >> 16), ((mid << 16) + lo_lo) & _U32


def dropout_uniform(seed, bh, i, j):
    """Uniform [0, 1) numbers for dropout, one per (batch * nheads + head, query, key).

    Philox-4x32-10 (Salmon et al. 2011) with counter (j, i, bh, 0) and key (seed low and
    high 32 bits), the first output word's top 24 bits scaled to [0, 1): exact in float32.
    The Triton kernels compute the same function (flash_triton._dropout_uniform), so every
    implementation drops the same elements for the same seed, and the backward pass
    regenerates the forward's mask instead of storing it.
    """
    c0, c1, c2 = (torch.as_tensor(x, dtype=torch.int64) for x in (j, i, bh))
    c0, c1, c2 = torch.broadcast_tensors(c0, c1, c2)
    c3 = torch.zeros_like(c0)
    k0, k1 = seed & _U32, (seed >> 32) & _U32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(torch.full_like(c2, PHILOX_ROUND_B), c2)
        hi_a, lo_a = _mul_hi_lo(torch.full_like(c0, PHILOX_ROUND_A), c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _U32, (k1 + PHILOX_KEY_B) & _U32
    return (c0 >> 8).to(torch.float32) * (1.0 / 2**24)


# ----------------------------------------------------------------------------- options

class Options(NamedTuple):
    """Everything but the tensors q, k, v: checked and normalized by interface.py.

    window_left, window_right: -1 is unbounded; causal arrives as window_right = 0.
    alibi_slopes: (batch, nheads) float32 or None (a (nheads,) input is broadcast).
    softcap: 0 for none. dropout_p: 0 for none; seed: the dropout stream (an int).
    dropout_row0, dropout_col0: added to the query and key indices of the dropout counter
    (dropout_uniform), so that a call over a block of a larger attention (a ring's) drops what
    that attention drops there (packed sequences: each sequence's indices alike).
    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 for packed sequences, else None.
    block_table: (batch, max_pages) int32 or None; if given (packed queries only), k and v are
    paged (num_pages, page_size, nheads_kv, headdim), read in place through it (`paged_rows`),
    and cu_seqlens_k gives each sequence's number of keys. Forward only.
    deterministic: the backward must give bit-identical gradients run after run (no atomics).
    attn_mask: None, or a bool or floating tensor broadcastable to (batch, nheads, seqlen_q,
    seqlen_k), PyTorch's attn_mask (True: the query may see the key; a float: added to the
    scores after softcap and ALiBi, before the window mask). Not with packed sequences.
    attn_mask_grad: None, or a (batch, nheads, seqlen_q, seqlen_k) float32 tensor of zeros into
    which the backward writes the gradient of the scores, dL/ds (a float attn_mask's, before
    the sum over its broadcast dimensions). Backward only.
    k_descale, v_descale: None, or (batch, nheads_kv) float32: a float8 KV cache's keys and
    values are the cache's entries times these (decoding, and paged keys: forward only).
    """
    softmax_scale: float
    window_left: int = -1
    window_right: int = -1
    alibi_slopes: Optional[torch.Tensor] = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: int = 0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    block_table: Optional[torch.Tensor] = None
    deterministic: bool = False
    attn_mask: Optional[torch.Tensor] = None
    attn_mask_grad: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None
    dropout_row0: int = 0
    dropout_col0: int = 0
    block_mask: Optional[torch.Tensor] = None
    block_size_q: int = BLOCK_SPARSE_UNIT
    block_size_k: int = BLOCK_SPARSE_UNIT

    @property
    def varlen(self):
        return self.cu_seqlens_q is not None
