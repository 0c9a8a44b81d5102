"""Public API: input validation, backend choice, and the custom ops that carry autograd.

Every call goes through `attention`: the arguments are checked once, here, before
any work; the backend is chosen; then `torch.ops.longflash.attention_forward`
runs the chosen implementation. Autograd is registered once on that op for all
implementations (its backward is the op `torch.ops.longflash.attention_backward`),
and both ops have fake implementations, so `torch.compile(fullgraph=True)`
captures forward and backward without graph breaks.
"""

import importlib.util
import math
import numbers
import os
from typing import Optional

import torch

from . import blockwise
from ._common import empty_outputs

BACKENDS = ("auto", "triton", "torch")
MAX_HEADDIM = 256
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float32)
_HAS_TRITON = importlib.util.find_spec("triton") is not None
# Read once at import: Triton itself decides at import time whether to interpret.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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


def _check_inputs(q, k, v, causal, softmax_scale, backend):
    """Validate arguments; return (softmax_scale, backend) resolved to concrete values."""
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
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (batch, seqlen_k, nheads_kv, headdim),"
                         f" got {tuple(k.shape)} and {tuple(v.shape)}")
    batch, _, nheads, headdim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {k.shape[0]}")
    if k.shape[3] != headdim:
        raise ValueError(f"q and k must have the same headdim, got {headdim} and {k.shape[3]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"headdim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    nheads_kv = k.shape[2]
    if nheads_kv == 0 or nheads % nheads_kv != 0:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads_kv of k and v "
                         f"({nheads_kv}) (GQA / MQA)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a positive float or None, "
                        f"got {type(softmax_scale).__name__}")
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float or None, "
                         f"got {softmax_scale}")
    return float(softmax_scale), _resolve_backend(backend, q)


def _resolve_backend(backend, q):
    """'auto' -> Triton for CUDA tensors and under TRITON_INTERPRET=1, else the PyTorch path."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    interpretable = _TRITON_INTERPRET and q.dtype != torch.bfloat16  # no bf16 tl.dot there
    if backend == "auto":
        usable = _HAS_TRITON and ((q.is_cuda and not _TRITON_INTERPRET) or interpretable)
        return "triton" if usable and q.dtype != torch.float64 else "torch"
    if backend == "triton":
        if not _HAS_TRITON:
            raise ValueError("backend='triton' needs the triton package; use backend='torch'")
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


@torch.library.custom_op("longflash::attention_forward", mutates_args=())
def _attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       softmax_scale: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _implementation(backend).forward(q, k, v, causal, softmax_scale)


@_attention_forward.register_fake
def _(q, k, v, causal, softmax_scale, backend):
    return empty_outputs(q)


@torch.library.custom_op("longflash::attention_backward", mutates_args=())
def _attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, dlse: Optional[torch.Tensor],
                        causal: bool, softmax_scale: float,
                        backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _implementation(backend).backward(do, q, k, v, o, lse, dlse, causal, softmax_scale)


@_attention_backward.register_fake
def _(do, q, k, v, o, lse, dlse, causal, softmax_scale, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.softmax_scale, ctx.backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)


def _backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:  # only lse was used
        do = torch.zeros_like(o)
    dq, dk, dv = _attention_backward(do, q, k, v, o, lse, dlse, ctx.causal, ctx.softmax_scale,
                                     ctx.backend)
    return dq, dk, dv, None, None, None


_attention_forward.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- public API

def attention(q, k, v, causal=False, softmax_scale=None, return_lse=False, backend="auto"):
    """Exact softmax attention, computed block by block without the N x N matrix.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim)
        k, v: (batch, seqlen_k, nheads_kv, headdim); nheads % nheads_kv == 0 (GQA / MQA:
            query head h uses key/value head h // (nheads // nheads_kv))
        causal: bottom-right aligned, as in FlashAttention 2.1+: query i sees key j iff
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5:
                1 1 1 1 0
                1 1 1 1 1
            A row that sees no key (seqlen_q > seqlen_k) gives output 0, lse -inf and zero
            gradients.
        softmax_scale: default 1 / sqrt(headdim).
        return_lse: also return the log-sum-exp of each row (gradients flow through it).
        backend: "auto" (Triton for CUDA tensors and under TRITON_INTERPRET=1, except bfloat16
            under the interpreter; the blockwise PyTorch path otherwise), "triton" or "torch".
    Returns:
        o: (batch, seqlen_q, nheads, headdim), dtype of q
        lse (if return_lse): (batch, nheads, seqlen_q), float32 (float64 for float64 inputs),
            natural log
    dtypes: float16, bfloat16, float32; float64 on the PyTorch path. headdim 1..256.
    Empty inputs: seqlen_q = 0 or batch = 0 gives empty outputs; seqlen_k = 0 means no row sees
        a key (o = 0, lse = -inf).
    The backward pass is deterministic on every backend (no atomics).
    """
    softmax_scale, backend = _check_inputs(q, k, v, causal, softmax_scale, backend)
    o, lse = _attention_forward(q, k, v, causal, softmax_scale, backend)
    return (o, lse) if return_lse else o


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, with PyTorch's semantics.

    query: (batch, nheads, seqlen_q, headdim); key, value: (batch, nheads_kv, seqlen_k, headdim)
    is_causal: top-left aligned, as in PyTorch: query i sees key j iff j <= i. (Note the
        difference from `attention(causal=True)`, which is bottom-right aligned.)
    scale: default 1 / sqrt(headdim). enable_gqa: allow nheads_kv < nheads.
    Returns (batch, nheads, seqlen_q, headdim).
    Not supported (NotImplementedError): attn_mask, dropout_p > 0, 3-D inputs, and value
    head dims that differ from the query's; use torch.nn.functional.scaled_dot_product_attention
    or FlexAttention for those.
    """
    if attn_mask is not None:
        raise NotImplementedError("attn_mask is not supported by longflash; use is_causal=True for"
                                  " causal masks, or torch.nn.functional.scaled_dot_product_"
                                  "attention / FlexAttention for arbitrary masks")
    if dropout_p != 0.0:
        raise NotImplementedError("dropout_p > 0 is not supported yet; use "
                                  "torch.nn.functional.scaled_dot_product_attention")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if isinstance(x, torch.Tensor) and x.dim() != 4:
            raise NotImplementedError(f"{name} must be 4-D (batch, nheads, seqlen, headdim), got "
                                      f"shape {tuple(x.shape)}; use torch.nn.functional."
                                      f"scaled_dot_product_attention for other ranks")
    if isinstance(value, torch.Tensor) and isinstance(query, torch.Tensor) \
            and value.shape[-1] != query.shape[-1]:
        raise NotImplementedError("value headdim must equal query headdim; use torch.nn.functional"
                                  ".scaled_dot_product_attention")
    if isinstance(key, torch.Tensor) and isinstance(query, torch.Tensor) \
            and key.dim() == 4 and key.shape[1] != query.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads and key {key.shape[1]}: pass "
                         f"enable_gqa=True for grouped-query attention")
    q, k, v = (x.transpose(1, 2) if isinstance(x, torch.Tensor) else x
               for x in (query, key, value))  # (B, N, H, D) views, no copy
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if not is_causal or seqlen_q == seqlen_k:
        o = attention(q, k, v, causal=is_causal, softmax_scale=scale)
    elif seqlen_q < seqlen_k:
        # Top-left causal never reaches keys >= seqlen_q: bottom-right causal on the first
        # seqlen_q keys is the same function.
        o = attention(q, k[:, :seqlen_q], v[:, :seqlen_q], causal=True, softmax_scale=scale)
    else:
        # Rows >= seqlen_k see every key; the first seqlen_k rows are a square causal problem.
        o = torch.cat([attention(q[:, :seqlen_k], k, v, causal=True, softmax_scale=scale),
                       attention(q[:, seqlen_k:], k, v, causal=False, softmax_scale=scale)], dim=1)
    return o.transpose(1, 2)
