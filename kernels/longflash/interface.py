"""Public API: input validation, backend choice, and the ops that autograd differentiates.

Every call goes through `attention`: the arguments are checked once, here, before
any work; the backend is chosen; then `torch.ops.longflash.attention_forward`
runs the chosen implementation. Autograd is one torch.autograd.Function around that
op for all implementations (`_Attention`: its backward is the op
`torch.ops.longflash.attention_backward`); both ops have fake implementations, so
`torch.compile(fullgraph=True)` captures forward and backward without graph breaks.
The ops are registered with torch.library's define and impl (`_common.define_op`),
not custom_op, whose Python layers took about half of a training call's host time
in the H100's profiles (PERFLOG "The ops without custom_op's layers").
"""

import functools
import os
import warnings
from typing import Optional

import torch

from . import blockwise
from ._common import (BLOCK_SPARSE_UNIT, FP8_DTYPES, MAX_HEADDIM, Options, check_alibi_shape,
                      check_attn_mask_shape, check_block_mask_shape, check_block_size,
                      check_bools, check_learnable_sink, check_offsets,
                      check_real, check_shapes, check_softcap, check_window_size, define_op,
                      empty_outputs, paged_rows, resolve_softmax_scale, triton_problem,
                      with_learnable_sink)

BACKENDS = ("auto", "triton", "torch")
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)
# None, or what keeps the Triton kernels from running here: no triton package, or too old a
# one (_common.triton_problem). Then every call runs the PyTorch path.
_TRITON_PROBLEM = triton_problem()
# Read once at import: Triton itself decides at import time whether to interpret.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def gpu_problem(device):
    """None if the Triton kernels can run on this CUDA device, else what stops them: an
    NVIDIA GPU older than compute capability 8.0 (Triton supports 8.0 and newer; compiled for
    sm_75 the forward kernel gets 64 registers a thread and 16-74 KB of spills)."""
    if torch.version.hip:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"a GPU of compute capability 8.0 or newer (this one is {major}.{minor})"
    return None


def _triton_impl():
    from . import flash_triton  # imported on first use: CPU-only installs need no Triton
    return flash_triton


# ----------------------------------------------------------------------------- validation

def _check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, nheads, headdim), "
                         f"got shape {tuple(x.shape)}")


def _check_inputs(q, k, v, causal, softmax_scale, backend, window_size=(-1, -1),
                  alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None, generator=None,
                  deterministic=False, batch=None, learnable_sink=None,
                  max_headdim_v=MAX_HEADDIM):
    """Validate arguments; return (softmax_scale, backend) resolved to concrete values.
    q, k, v are 4-D here (packed sequences arrive with a leading batch of 1); batch is the
    number of sequences for ALiBi slopes (default q.shape[0]); max_headdim_v: v's widest
    head dim (decoding's is wider)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    accepted = "torch.float16, torch.bfloat16, torch.float32 (torch.float64 on backend='torch')"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in _LOW_PRECISION + (torch.float64,):
            raise TypeError(f"{name} has dtype {x.dtype}; accepted: {accepted}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on the same device, got {q.device}, {k.device}, "
                         f"{v.device}")
    nheads, _, _ = check_shapes(q.shape, k.shape, v.shape, max_headdim_v)
    check_bools(causal=causal, deterministic=deterministic)
    softmax_scale = resolve_softmax_scale(softmax_scale, q.shape[3])
    check_window_size(window_size)
    if alibi_slopes is not None:
        batch = q.shape[0] if batch is None else batch
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            raise TypeError("alibi_slopes must be a float32 tensor of shape (nheads,) or "
                            f"(batch, nheads), got {getattr(alibi_slopes, 'dtype', alibi_slopes)}")
        check_alibi_shape(alibi_slopes.shape, batch, nheads)
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes must be on {q.device}, got {alibi_slopes.device}")
    check_softcap(softcap)
    check_real("dropout_p", dropout_p, "a float in [0, 1)")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    check_learnable_sink(learnable_sink, nheads, q.device)
    return float(softmax_scale), _resolve_backend(backend, q)


def _check_attn_mask(attn_mask, q, seqlen_k, keys_at_least=False):
    """attn_mask: None, or a bool or floating-point tensor on q's device, broadcastable to
    (batch, nheads, seqlen_q, seqlen_k); keys_at_least (attention_with_kvcache, whose mask
    spans the cache's key positions): its last dimension may also exceed seqlen_k, the
    longest sequence's keys (None: not known without reading the lengths, not checked)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor) or not (
            attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        raise TypeError(f"attn_mask must be a bool or floating-point tensor, or None, got "
                        f"{getattr(attn_mask, 'dtype', type(attn_mask).__name__)}")
    check_attn_mask_shape(attn_mask.shape, q.shape[0], q.shape[2], q.shape[1], seqlen_k,
                          keys_at_least)
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}: they must match")


def _check_block_mask(block_mask, block_size, q, batch, seqlen_q, seqlen_k,
                      keys_at_least=False):
    """block_mask: None, or a bool tensor on q's device of shape (batch or 1, nheads or 1,
    ceil(seqlen_q / block_size_q), ceil(seqlen_k / block_size_k)); keys_at_least: its last
    dimension may be larger (check_block_mask_shape's). Returns the forward op's
    (block_mask, block_size_q, block_size_k)."""
    block_size_q, block_size_k = check_block_size(block_size)
    if block_mask is None:
        return None, block_size_q, block_size_k
    if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool:
        raise TypeError(f"block_mask must be a bool tensor, or None, got "
                        f"{getattr(block_mask, 'dtype', type(block_mask).__name__)}")
    check_block_mask_shape(block_mask.shape, batch, q.shape[-2], seqlen_q, seqlen_k,
                           block_size_q, block_size_k, keys_at_least)
    if block_mask.device != q.device:
        raise ValueError(f"block_mask is on {block_mask.device}, q on {q.device}: they must "
                         f"match")
    return block_mask, block_size_q, block_size_k


def _check_cu_seqlens(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      paged=False):
    """Packed-sequence metadata; returns the number of sequences. paged: k and v are paged
    caches (checked by _check_pages), so cu_seqlens_k's last offset is not k's length."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if paged and name != "q":
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} must be a paged cache of 4 dimensions (num_pages, "
                                 f"page_size, nheads_kv, headdim) with block_table, got "
                                 f"{getattr(x, 'shape', x)}")
        elif not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a tensor of 3 dimensions (total_tokens, nheads, "
                             f"headdim) for attention_varlen, got {getattr(x, 'shape', x)}")
    total_k = None if paged else k.shape[0]
    for name, cu, total, max_len in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 \
                or cu.numel() < 1:
            raise TypeError(f"{name} must be a 1-D torch.int32 tensor of batch + 1 offsets")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {cu.device}")
        max_name = name.replace("cu_seqlens", "max_seqlen")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 0:
            raise TypeError(f"{max_name} must be an int >= 0, got {max_len!r}")
        if torch.compiler.is_compiling():
            continue  # the checks below read the tensor's values: skipped inside a graph
        check_offsets(name, cu.tolist(), total, max_len)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {cu_seqlens_q.numel() - 1} and "
                         f"{cu_seqlens_k.numel() - 1}")
    return cu_seqlens_q.numel() - 1


def _check_pages(q, k, v, block_table, cu_seqlens_k, batch):
    """A paged k, v (num_pages, page_size, nheads_kv, headdim) read through block_table
    (batch, max_pages) int32 for the lengths of cu_seqlens_k (checked already); returns the
    number of keys, cu_seqlens_k[-1]. Reads cu_seqlens_k and the entries in use back."""
    # imported here: kvcache imports this module
    from .kvcache import check_block_table, check_cache_pair, check_pages_in_use
    check_cache_pair(k, v, "k", "v", same_headdim=True)
    check_block_table(block_table, batch, q.device)
    if torch.compiler.is_compiling():
        raise NotImplementedError("attention_varlen with block_table under torch.compile: the "
                                  "lengths and pages in use are checked on the host (values of "
                                  "cu_seqlens_k and block_table), and with a gradient the keys "
                                  "are gathered into a copy whose length is a value of "
                                  "cu_seqlens_k")
    num_pages, page_size = k.shape[:2]
    offsets = cu_seqlens_k.tolist()
    longest = max(b - a for a, b in zip(offsets, offsets[1:])) if batch else 0
    if longest > block_table.shape[1] * page_size:
        raise ValueError(f"cu_seqlens_k has a sequence of {longest} keys, more than block_table "
                         f"holds ({block_table.shape[1]} pages of {page_size})")
    if batch:
        check_pages_in_use(block_table, cu_seqlens_k.diff(), page_size, num_pages,
                           "block_table", "k")
    return offsets[-1]


def _check_fp8_pages(k, v, paged):
    """Whether k and v are float8 pages (their pair of dtypes checked by _check_pages)."""
    if k.dtype not in FP8_DTYPES and v.dtype not in FP8_DTYPES:
        return False
    if not paged:
        raise NotImplementedError(f"float8 k and v ({k.dtype}) are a paged cache's: pass "
                                  f"block_table (or dequantize packed keys first)")
    return True


def _gather_pages(k, v, block_table, cu_seqlens_k, total_k, k_descale=None, v_descale=None,
                  dtype=None):
    """The keys and values in use, packed as attention_varlen takes them: (total_k, nheads_kv,
    headdim) each, a copy (gradients flow back to the pages). Key n of sequence b is page
    block_table[b, n // page_size], slot n % page_size. Float8 pages are dequantized to
    `dtype`: entries times k_descale / v_descale[b] ((batch, nheads_kv); None: 1), in float32."""
    batch = block_table.shape[0]
    device = k.device
    seq = torch.repeat_interleave(torch.arange(batch, device=device), cu_seqlens_k.diff(),
                                  output_size=total_k)  # (total_k,) sequence of each key
    pos = torch.arange(total_k, device=device) - cu_seqlens_k[:-1].long()[seq]
    k, v = paged_rows(k, block_table, seq, pos), paged_rows(v, block_table, seq, pos)
    if k.dtype in FP8_DTYPES:  # (total_k, Hkv, D) in dtype
        k, v = ((x.float() * (1 if s is None else s[seq][..., None])).to(dtype)
                for x, s in ((k, k_descale), (v, v_descale)))
    return k, v


@torch.compiler.disable  # under torch.compile, run eagerly (a graph break), not traced
def _paged_forward(q, k, v, args, block_table, k_descale, v_descale, sparse):
    """(o, lse) over paged keys read in place, without autograd; float8 pages converted tile
    by tile, their scales applied to the scores and the output. args: _forward_impl's after
    q, k, v, up to max_seqlen_k; sparse: (block_mask, block_size_q, block_size_k)."""
    opts = _options(q, *args[:2], *args[3:], block_table, block_mask=sparse[0],
                    block_size_q=sparse[1], block_size_k=sparse[2])
    return _implementation(args[2]).forward(q, k, v, opts._replace(k_descale=k_descale,
                                                                   v_descale=v_descale))


def _resolve_backend(backend, q):
    """'auto' -> Triton for CUDA tensors and under TRITON_INTERPRET=1 (given a Triton the kernels
    compile with: _TRITON_PROBLEM), else the PyTorch path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpretable = _TRITON_INTERPRET and q.dtype != torch.bfloat16  # no bf16 tl.dot there
    problem = _TRITON_PROBLEM
    if (not problem and q.is_cuda and not _TRITON_INTERPRET
            and not torch.compiler.is_compiling()):
        problem = gpu_problem(q.device.index if q.device.index is not None
                              else torch.cuda.current_device())
    if backend == "auto":
        if problem and q.is_cuda and not torch.compiler.is_compiling():
            # not silently: the PyTorch path is much slower there
            warnings.warn(f"longflash's Triton kernels need {problem}: CUDA tensors run "
                          f"on its PyTorch path (exact, linear memory, slower)", stacklevel=4)
        usable = not problem and ((q.is_cuda and not _TRITON_INTERPRET) or interpretable)
        return "triton" if usable and q.dtype != torch.float64 else "torch"
    if backend == "triton":
        if problem:
            raise ValueError(f"backend='triton' needs {problem}; use backend='torch'")
        if q.dtype == torch.float64:
            raise TypeError("backend='triton' does not support torch.float64; use "
                            "backend='torch' or float32")
        if _TRITON_INTERPRET and q.dtype == torch.bfloat16:
            raise NotImplementedError("the Triton interpreter (TRITON_INTERPRET=1) has no bfloat16"
                                      " tl.dot; use float16 / float32 or backend='torch'")
        if not (q.is_cuda or _TRITON_INTERPRET):
            raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1), got "
                             f"device {q.device}; use backend='torch' for the CPU path")
    return backend


# ----------------------------------------------------------------------------- custom ops

def _implementation(backend):
    return _triton_impl() if backend == "triton" else blockwise


def _options(q, causal, softmax_scale, window_left, window_right, alibi_slopes, softcap, dropout_p,
             seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table=None,
             deterministic=False, attn_mask=None, attn_mask_grad=None, block_mask=None,
             block_size_q=BLOCK_SPARSE_UNIT, block_size_k=BLOCK_SPARSE_UNIT):
    if alibi_slopes is not None:  # (nheads,) -> (batch, nheads), a view
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.numel() - 1
        alibi_slopes = alibi_slopes.expand(batch, alibi_slopes.shape[-1])
    seed, row0, col0 = ((0, 0, 0) if seed is None else
                        (*torch.as_tensor(seed).reshape(-1).tolist(), 0, 0)[:3])
    return Options(softmax_scale, window_left, 0 if causal else window_right, alibi_slopes,
                   softcap, dropout_p, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, block_table, deterministic, attn_mask, attn_mask_grad,
                   dropout_row0=row0, dropout_col0=col0, block_mask=block_mask,
                   block_size_q=block_size_q, block_size_k=block_size_k)


# The leading arguments (q, k, v, causal, softmax_scale, backend) are the stable core; the
# variants follow with defaults. seed is a 0-d int64 tensor so that torch.compile can draw it
# inside a graph, or (3,): (seed, first row, first key), a block of a larger attention whose
# dropout it reproduces (Options.dropout_row0; ring attention's calls), in the same schema.
def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: float, backend: str, window_left: int = -1,
                  window_right: int = -1, alibi_slopes: Optional[torch.Tensor] = None,
                  softcap: float = 0.0, dropout_p: float = 0.0,
                  seed: Optional[torch.Tensor] = None,
                  cu_seqlens_q: Optional[torch.Tensor] = None,
                  cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
                  max_seqlen_k: int = 0, block_table: Optional[torch.Tensor] = None,
                  deterministic: bool = False, attn_mask: Optional[torch.Tensor] = None,
                  block_mask: Optional[torch.Tensor] = None,
                  block_size_q: int = BLOCK_SPARSE_UNIT, block_size_k: int = BLOCK_SPARSE_UNIT
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # block_table: always None since paged calls leave the op (_paged_forward); kept in the
    # schema because torch.compile's on-disk caches key a graph on the op's name, not its
    # schema (pytorch/pytorch#187319): a changed schema would replay, from a warm cache, code
    # compiled for the old one (found here: "expected at most 18 argument(s)"); new arguments
    # go last, with defaults
    opts = _options(q, causal, softmax_scale, window_left, window_right, alibi_slopes, softcap,
                    dropout_p, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    block_table, attn_mask=attn_mask, block_mask=block_mask,
                    block_size_q=block_size_q, block_size_k=block_size_k)
    return _implementation(backend).forward(q, k, v, opts)


def _forward_fake(q, k, v, causal, softmax_scale, backend, window_left=-1, window_right=-1,
                  alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None, cu_seqlens_q=None,
                  cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, block_table=None,
                  deterministic=False, attn_mask=None, block_mask=None,
                  block_size_q=BLOCK_SPARSE_UNIT, block_size_k=BLOCK_SPARSE_UNIT):
    return empty_outputs(q, varlen=cu_seqlens_q is not None, headdim_v=v.shape[-1])


def _backward_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   o: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                   causal: bool, softmax_scale: float, backend: str, window_left: int = -1,
                   window_right: int = -1, alibi_slopes: Optional[torch.Tensor] = None,
                   softcap: float = 0.0, dropout_p: float = 0.0,
                   seed: Optional[torch.Tensor] = None,
                   cu_seqlens_q: Optional[torch.Tensor] = None,
                   cu_seqlens_k: Optional[torch.Tensor] = None, max_seqlen_q: int = 0,
                   max_seqlen_k: int = 0, deterministic: bool = False,
                   attn_mask: Optional[torch.Tensor] = None, attn_mask_grad: bool = False,
                   block_mask: Optional[torch.Tensor] = None,
                   block_size_q: int = BLOCK_SPARSE_UNIT, block_size_k: int = BLOCK_SPARSE_UNIT
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dscores): dscores (batch, nheads, seqlen_q, seqlen_k) float32, the scores'
    gradient (an attn_mask's before the sum over its broadcast dimensions) if attn_mask_grad,
    else empty."""
    dscores = _scores_grad(q, k, attn_mask_grad, torch.zeros)
    opts = _options(q, causal, softmax_scale, window_left, window_right, alibi_slopes, softcap,
                    dropout_p, seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    deterministic=deterministic, attn_mask=attn_mask,
                    attn_mask_grad=dscores if attn_mask_grad else None, block_mask=block_mask,
                    block_size_q=block_size_q, block_size_k=block_size_k)
    return (*_implementation(backend).backward(do, q, k, v, o, lse, dlse, opts), dscores)


def _scores_grad(q, k, wanted, make):
    """The backward's dscores output: (batch, nheads, seqlen_q, seqlen_k) float32, or empty."""
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1]) if wanted else (0,)
    return make(shape, dtype=torch.float32, device=q.device)


def _backward_fake(do, q, k, v, o, lse, dlse, causal, softmax_scale, backend, window_left=-1,
                   window_right=-1, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None,
                   cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                   deterministic=False, attn_mask=None, attn_mask_grad=False, block_mask=None,
                   block_size_q=BLOCK_SPARSE_UNIT, block_size_k=BLOCK_SPARSE_UNIT):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            _scores_grad(q, k, attn_mask_grad, torch.empty))


# torch.ops.longflash.attention_forward / attention_backward (define_op: one dispatcher hop
# each, fake implementations for torch.compile); autograd is _Attention, around them.
_forward_op = define_op("attention_forward", _forward_impl, _forward_fake)
_backward_op = define_op("attention_backward", _backward_impl, _backward_fake)


class _Attention(torch.autograd.Function):
    """The forward op, with the backward op as its gradient. Dynamo traces it (forward and
    backward, one op each), so torch.compile(fullgraph=True) captures both without graph
    breaks. attn_mask: an input of its own (a float one may want its gradient). args: the
    forward op's other arguments after q, k, v, in one tuple: Dynamo refuses an
    autograd.Function that gets one tensor as two of its inputs (cu_seqlens_q and
    cu_seqlens_k are often one tensor), and none of these has a gradient; its last three,
    (block_mask, block_size_q, block_size_k), follow attn_mask in both ops."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, args):
        args, sparse = args[:-3], args[-3:]
        o, lse = _forward_op(q, k, v, *args, attn_mask, *sparse)
        ctx.save_for_backward(q, k, v, o, lse, attn_mask)
        ctx.args = args[:13] + args[14:]  # less block_table (args[13], None), which the
        # backward op does not take
        ctx.sparse = sparse
        # an unused lse gets no gradient (None: no zeros to fill and subtract), nor an unused o
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: a clear error
    def backward(ctx, do, dlse):
        q, k, v, o, lse, attn_mask = ctx.saved_tensors
        do = torch.zeros_like(o) if do is None else do  # only lse was used
        mask_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dscores = _backward_op(do, q, k, v, o, lse, dlse, *ctx.args, attn_mask,
                                           mask_grad, *ctx.sparse)
        # the mask's gradient: the scores' summed over the dimensions it broadcasts
        dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
        return dq, dk, dv, dmask, None


def _attention_forward(q, k, v, causal, softmax_scale, backend, window_left=-1, window_right=-1,
                       alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None,
                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0,
                       deterministic=False, attn_mask=None,
                       sparse=(None, BLOCK_SPARSE_UNIT, BLOCK_SPARSE_UNIT)):
    """(o, lse) of checked arguments, differentiable in q, k, v and a float attn_mask. sparse:
    (block_mask, block_size_q, block_size_k)."""
    if torch.compiler.is_compiling():
        # attention(x, x, x): each its own alias, Dynamo refusing one tensor as two inputs
        k = k.view_as(k) if k is q else k
        v = v.view_as(v) if v is q or v is k else v
    return _Attention.apply(q, k, v, attn_mask, (causal, softmax_scale, backend, window_left,
                                                 window_right, alibi_slopes, softcap, dropout_p,
                                                 seed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                 max_seqlen_k, None, deterministic,
                                                 *sparse))


# ----------------------------------------------------------------------------- decoding route

# Short queries over long keys (decoding, speculative decoding) run on the split-KV kernel of
# `attention_with_kvcache`, which splits the keys across programs and packs the query heads
# of a KV head into one tile: the main kernel would launch one program per (batch, head)
# using one row of its tile. Only on the Triton backend (on a CPU the blockwise path already
# batches every head), only without dropout, and only when no gradient is needed (the
# split-KV path is inference only). The result obeys the same tolerance rule.
SPLIT_KV_MAX_SEQLEN_Q = 16
SPLIT_KV_MIN_SEQLEN_K = 1024


def _needs_grad(*tensors):
    """tensors: tensors or None."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _use_split_kv(backend, seqlen_q, seqlen_k, dropout_p, *tensors):
    return (backend == "triton" and dropout_p == 0 and 0 < seqlen_q <= SPLIT_KV_MAX_SEQLEN_Q
            and seqlen_k >= SPLIT_KV_MIN_SEQLEN_K and not _needs_grad(*tensors))


def _split_kv(q, k, v, seqlens_k, block_table, causal, softmax_scale, window_size, softcap,
              alibi_slopes, backend, max_seqlen_k, attn_mask=None, k_descale=None,
              v_descale=None):
    """seqlens_k: (batch,) tensor, or an int for every sequence; max_seqlen_k: max(seqlens_k),
    known here, so the launcher reads nothing back."""
    from .kvcache import _forward  # imported on first use: kvcache imports this module
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    return _forward(q, k, v, seqlens_k, block_table, causal, softmax_scale, window_size,
                    float(softcap), alibi_slopes, 0, backend, max_seqlen_k,
                    attn_mask=attn_mask, k_descale=k_descale, v_descale=v_descale)


# ----------------------------------------------------------------------------- public API

def _seed_tensor(dropout_p, seed, generator):
    """The dropout stream as a 0-d int64 tensor (None without dropout)."""
    if dropout_p == 0:
        return None
    if seed is not None:
        return torch.tensor(seed, dtype=torch.int64)
    return torch.randint(0, 2**62, (), dtype=torch.int64, generator=generator)


def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, backend="auto", *,
              window_size=(-1, -1), alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None,
              generator=None, deterministic=False, learnable_sink=None, attn_mask=None,
              block_mask=None, block_size=BLOCK_SPARSE_UNIT):
    """Exact softmax attention, computed block by block without the N x N matrix.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k, v: (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0 (GQA / MQA:
            query head h uses key/value head h // (nheads // nheads_kv)). v's headdim may
            differ from q's and k's (MLA: DeepSeek-V3's 192 and 128); every kernel takes
            both (HEAD_DIM, HEAD_DIM_V).
        causal: bottom-right aligned, as in FlashAttention 2.1+: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q > seqlen_k) gives output 0, lse -inf and zero
            gradients.
        softmax_scale: default 1 / sqrt(headdim).
        return_lse: also return the log-sum-exp of each row (gradients flow through it).
        backend: "auto" (Triton for CUDA tensors and under TRITON_INTERPRET=1, except bfloat16
            under the interpreter; the blockwise PyTorch path otherwise, and, with a warning, for
            CUDA tensors where triton >= 3.4 is missing), "triton" or "torch".
    Keyword-only, as in FlashAttention-2's flash_attn_func:
        window_size: (left, right), -1 meaning unbounded: query i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. With causal,
            right is 0. Key blocks outside every row's window are skipped.
        alibi_slopes: (nheads,) or (batch, nheads) float32; adds
            -slope * |i + seqlen_k - seqlen_q - j| to the scores.
        softcap: > 0 replaces the scores s by softcap * tanh(s / softcap) (before ALiBi).
        dropout_p: probability of dropping an attention weight (after the softmax; kept weights
            scaled by 1 / (1 - dropout_p)). The mask comes from a counter-based generator keyed
            by `seed` (an int), or by a seed drawn from `generator` (default: torch's global
            generator); the backward pass regenerates it, nothing N x N is stored. The same
            seed gives the same mask on every backend.
        deterministic: True asks for bit-identical gradients run after run, as in
            FlashAttention-2 (torch.use_deterministic_algorithms(True) asks the same). False,
            the default, lets the Triton backward compute dQ in its dK/dV kernel with atomic
            adds (flash_triton.ATOMIC) where its config table holds such candidates for the
            GPU and head dim; no table does yet, so every backward is deterministic today.
        learnable_sink: (nheads,) floating-point tensor, or None: attention sinks (gpt-oss;
            FlashAttention's `learnable_sink`): each row's softmax gets one more logit,
            learnable_sink[h], compared with the final scores (after scale, softcap, ALiBi)
            and attending to no value, so the probabilities of the keys sum to less than 1.
            Gradients flow to it. Applied to the output and lse of attention without it
            (`_common.with_learnable_sink`): one more elementwise pass over o.
        attn_mask: None, or a bool or floating-point tensor broadcastable to (batch, nheads,
            seqlen_q, seqlen_k), as torch.nn.functional.scaled_dot_product_attention's
            (note the (B, H, Nq, Nk) order, as lse's): True where query i may see key j; a
            float mask is added to the scores (after softcap and ALiBi; -inf hides a key).
            Combines with causal and window_size (a key must pass both). The kernels read it
            tile by tile through its strides, so a broadcast mask ((batch, 1, 1, seqlen_k)
            padding, (seqlen_q, seqlen_k) shared by every head) costs only its own memory
            (expand, never materialize it). A row that sees no key gives o = 0 and lse -inf;
            a float mask's entries below about -2.4e38 act as -inf (they overflow in the
            kernels' log2 units). A float mask that requires grad gets its gradient (the
            scores' gradient, dL/ds, summed over the dimensions it broadcasts; the backward
            then writes a float32 (batch, nheads, seqlen_q, seqlen_k) buffer: O(N^2) memory,
            as PyTorch's memory-efficient backend). No warp-specialized candidates run with
            a mask.
        block_mask: None, or a bool tensor (batch or 1, nheads or 1, ceil(seqlen_q /
            block_size_q), ceil(seqlen_k / block_size_k)): block-sparse attention (the
            block-sparse FlashAttention of Dao et al. 2022, Section 3.3). Query i sees key j
            only if block_mask[b, h, i // block_size_q, j // block_size_k] (blocks counted
            from the first query and the first key, top-left, whatever causal's alignment);
            combines with causal, window_size and attn_mask (a key must pass each). The
            kernels skip a False block's tiles whole, forward and backward: no loads, no
            matmuls, so the work and the memory traffic scale with the fraction of True
            blocks (`block_mask` itself is (N / block_size)^2 bits' worth of bools, read once
            per tile). A row that sees no key gives o = 0 and lse -inf. No gradient.
            No warp-specialized candidates run with it; not on the split-KV decoding route.
        block_size: an int or (block_size_q, block_size_k), each a multiple of 64 (every
            kernel tile then lies inside one block: blocks that are not multiples of 128 get
            tiles shrunk to divide them, 64 x 64 for blocks of 64), default 128
            (FlexAttention's).
    Returns:
        o: (batch, seqlen_q, nheads, headdim of v), dtype of q
        lse (if return_lse): (batch, nheads, seqlen_q), float32 (float64 for float64 inputs),
            natural log, of the scores before dropout (the sink's logit included)
    dtypes: float16, bfloat16, float32; float64 on the PyTorch path. headdim 1..256.
    Empty inputs: seqlen_q = 0 or batch = 0 gives empty outputs; seqlen_k = 0 means no row sees
        a key (o = 0, lse = -inf).
    """
    softmax_scale, backend = _check_inputs(q, k, v, causal, softmax_scale, backend, window_size,
                                           alibi_slopes, softcap, dropout_p, seed, generator,
                                           deterministic, learnable_sink=learnable_sink)
    _check_attn_mask(attn_mask, q, k.shape[1])
    sparse = _check_block_mask(block_mask, block_size, q, q.shape[0], q.shape[1], k.shape[1])
    if block_mask is None and _use_split_kv(backend, q.shape[1], k.shape[1], dropout_p, q, k,
                                            v, attn_mask):
        o, lse = _split_kv(q, k, v, k.shape[1], None, causal, softmax_scale, window_size, softcap,
                           alibi_slopes, backend, k.shape[1], attn_mask)
    else:
        o, lse = _attention_forward(q, k, v, causal, softmax_scale, backend, *window_size,
                                    alibi_slopes, float(softcap), float(dropout_p),
                                    _seed_tensor(dropout_p, seed, generator),
                                    deterministic=deterministic, attn_mask=attn_mask,
                                    sparse=sparse)
    return _outputs(o, lse, learnable_sink, return_lse)


def _outputs(o, lse, learnable_sink, return_lse):
    """What a public function returns: o (and lse), with the attention sinks if any."""
    if learnable_sink is not None:
        o, lse = with_learnable_sink(o, lse, learnable_sink)
    return (o, lse) if return_lse else o


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     causal=False, softmax_scale=None, return_lse=False, backend="auto", *,
                     window_size=(-1, -1), alibi_slopes=None, softcap=0.0, dropout_p=0.0,
                     seed=None, generator=None, deterministic=False, block_table=None,
                     learnable_sink=None, k_descale=None, v_descale=None, block_mask=None,
                     block_size=BLOCK_SPARSE_UNIT):
    """`attention` on a packed batch of variable-length sequences, with no padding computed.

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim) (v's headdim may
        differ, as in `attention`, except with block_table)
    cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets of each sequence, starting at 0,
        non-decreasing, ending at total_q / total_k (sequence b is q[cu_seqlens_q[b]:
        cu_seqlens_q[b + 1]]). max_seqlen_q, max_seqlen_k: the longest sequence lengths.
    Every keyword works as in `attention`, per sequence (causal and windows aligned to each
    sequence's own end, alibi_slopes (batch, nheads) indexed by sequence; learnable_sink
    (nheads,) the same for every sequence; block_mask (batch or 1, nheads or 1,
    ceil(max_seqlen_q / block_size_q), ceil(max_seqlen_k / block_size_k)), each sequence's
    blocks counted from its own first query and key).
    block_table: (batch, max_pages) int32, or None. If given, k and v are paged caches
        (num_pages, page_size, nheads_kv, headdim), as in flash_attn_with_kvcache, and
        cu_seqlens_k gives each sequence's number of keys: key n of sequence b is
        k[block_table[b, n // page_size], n % page_size]. Without a gradient the kernels read
        the pages in place (equal short queries on the Triton backend: the split-KV kernel of
        decoding); with one, the keys in use are gathered into a packed copy first (linear
        memory, total_k keys; gradients flow back to the pages). Reads cu_seqlens_k and the
        entries in use back to check them; torch.compile runs such a call eagerly (a graph
        break: those checks, and the copy's length, are values of the tensors), and
        fullgraph=True refuses it. The pages may be float8 (torch.float8_e4m3fn or
        float8_e5m2, both), with k_descale and v_descale as in attention_with_kvcache
        (scales per sequence and KV head): without a gradient read in place too, each tile
        converted to q's dtype (exact), the keys' scale folded into the softmax scale and the
        values' into the output; with one, attended over a packed copy dequantized to q's
        dtype.
    Returns o: (total_q, nheads, headdim of v) and, with return_lse, lse: (nheads, total_q).
    """
    paged = block_table is not None
    batch = _check_cu_seqlens(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              paged)
    if paged:
        total_k = _check_pages(q, k, v, block_table, cu_seqlens_k, batch)
    from .kvcache import check_descale  # kvcache imports this module: late
    fp8 = _check_fp8_pages(k, v, paged)
    k_descale, v_descale = (check_descale(name, x, batch, k, q.device, "k")
                            for name, x in (("k_descale", k_descale), ("v_descale", v_descale)))
    # (1, total_k, nheads_kv, headdim); paged: the checks need no keys, an empty stand-in (in
    # q's dtype for float8 pages)
    keys, values = (x.new_empty((1, 0, *x.shape[2:]), dtype=q.dtype if fp8 else x.dtype)
                    if paged else x[None] for x in (k, v))
    softmax_scale, backend = _check_inputs(
        q[None], keys, values, causal, softmax_scale,
        backend, window_size, alibi_slopes, softcap, dropout_p, seed, generator, deterministic,
        batch=batch, learnable_sink=learnable_sink)
    sparse = _check_block_mask(block_mask, block_size, q, batch, max_seqlen_q, max_seqlen_k)
    if block_mask is None and _use_split_kv(backend, max_seqlen_q, max_seqlen_k, dropout_p, q,
                                            k, v) and not torch.compiler.is_compiling():
        lengths_q = cu_seqlens_q.diff()
        if batch and bool((lengths_q == max_seqlen_q).all()):  # the same seqlen_q everywhere
            pages = (k, v, block_table)
            if not paged:  # the packed keys as a paged cache of one-token pages: sequence
                # b's key n is row cu_seqlens_k[b] + n
                table = cu_seqlens_k[:-1, None] + torch.arange(
                    max_seqlen_k, device=q.device, dtype=torch.int32)
                table = table.clamp_(max=max(k.shape[0] - 1, 0))  # unread entries
                pages = (k[:, None], v[:, None], table.to(torch.int32))
            o, lse = _split_kv(q.reshape(batch, max_seqlen_q, *q.shape[1:]), *pages[:2],
                               cu_seqlens_k.diff(), pages[2], causal, softmax_scale,
                               window_size, softcap, alibi_slopes, backend, max_seqlen_k,
                               k_descale=k_descale, v_descale=v_descale)
            o = o.view(*q.shape[:2], v.shape[-1])  # (total_q, H, Dv)
            lse = lse.permute(1, 0, 2).reshape(q.shape[1], -1)  # (H, total_q)
            return _outputs(o, lse, learnable_sink, return_lse)
    args = (causal, softmax_scale, backend, *window_size, alibi_slopes, float(softcap),
            float(dropout_p), _seed_tensor(dropout_p, seed, generator), cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if paged and not _needs_grad(q, k, v):  # the kernels read the pages in place: no autograd
        o, lse = _paged_forward(q, k, v, args, block_table, k_descale, v_descale, sparse)
    else:
        if paged:  # the backward kernels take packed keys (float8 pages: dequantized)
            k, v = _gather_pages(k, v, block_table, cu_seqlens_k, total_k, k_descale,
                                 v_descale, q.dtype)
        o, lse = _attention_forward(q, k, v, *args, deterministic=deterministic, sparse=sparse)
    return _outputs(o, lse, learnable_sink, return_lse)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, with PyTorch's semantics.

    query: (batch, nheads, seqlen_q, headdim); key: (batch, nheads_kv, seqlen_k, headdim);
        value: (batch, nheads_kv, seqlen_k, headdim_v)
    is_causal: top-left aligned, as in PyTorch: query i sees key j iff j <= i. (Note the
        difference from `attention(causal=True)`, which is bottom-right aligned.)
    scale: default 1 / sqrt(headdim). enable_gqa: allow nheads_kv < nheads.
    Returns (batch, nheads, seqlen_q, headdim_v).
    attn_mask: bool (True: take part) or float (added to the scores), broadcastable to
        (batch, nheads, seqlen_q, seqlen_k), as in PyTorch; not with is_causal (PyTorch
        refuses both too). A float mask may require grad. A row that sees no key gives 0, as
        in PyTorch (a float mask of finite entries only: their softmax, as in PyTorch).
    dropout_p: as in `attention` (a counter-based mask; seed drawn from torch's generator).
    Not supported (NotImplementedError): 3-D inputs; use
    torch.nn.functional.scaled_dot_product_attention for those.
    """
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True together: pass one of them (fold the "
                         "causal mask into attn_mask), as PyTorch requires")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if isinstance(x, torch.Tensor) and x.dim() != 4:
            raise NotImplementedError(f"{name} must be 4-D (batch, nheads, seqlen, headdim), got "
                                      f"shape {tuple(x.shape)}; use torch.nn.functional."
                                      f"scaled_dot_product_attention for other ranks")
    if isinstance(key, torch.Tensor) and isinstance(query, torch.Tensor) \
            and key.dim() == 4 and key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass "
                         f"enable_gqa=True for grouped-query attention")
    q, k, v = (x.transpose(1, 2) if isinstance(x, torch.Tensor) else x
               for x in (query, key, value))  # (B, N, H, D) views, no copy
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if not is_causal or seqlen_q == seqlen_k:
        o = attention(q, k, v, causal=is_causal, softmax_scale=scale, dropout_p=dropout_p,
                      attn_mask=attn_mask)
    elif seqlen_q < seqlen_k:
        # Top-left causal never reaches keys >= seqlen_q: bottom-right causal on the first
        # seqlen_q keys is the same function.
        o = attention(q, k[:, :seqlen_q], v[:, :seqlen_q], causal=True, softmax_scale=scale,
                      dropout_p=dropout_p)
    else:
        # Rows >= seqlen_k see every key; the first seqlen_k rows are a square causal problem.
        o = torch.cat([attention(q[:, :seqlen_k], k, v, causal=True, softmax_scale=scale,
                                 dropout_p=dropout_p),
                       attention(q[:, seqlen_k:], k, v, causal=False, softmax_scale=scale,
                                 dropout_p=dropout_p)], dim=1)
    return o.transpose(1, 2)
