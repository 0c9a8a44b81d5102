"""flash_attn.layers.rotary on LongFlash: rotary position embeddings (RoFormer, Su et al.;
XPos, Sun et al.) with flash_attn 2.7's names, arguments, defaults and return values, so code
that rotates q and k with FlashAttention's helpers before calling its attention switches with
its import lines too:

    from flash_attn.layers.rotary import apply_rotary_emb, RotaryEmbedding            # before
    from longflash.flash_attn.layers.rotary import apply_rotary_emb, RotaryEmbedding  # after

    q = apply_rotary_emb(q, cos, sin, seqlen_offsets=cache_seqlens)  # (batch, seqlen, H, D)

The rotation is `longflash.nn.apply_rotary`'s (the model's, and decoding's rotary_cos /
rotary_sin): the first rotary_dim = 2 * cos.shape[1] dims of each head, dim i paired with
i + rotary_dim / 2 (GPT-NeoX) or, interleaved, 2i with 2i + 1 (GPT-J), in float32 (float64
stays float64) and returned in x's dtype; the other dims pass through. Token t of a sequence
takes row t + seqlen_offsets of cos and sin. Plain PyTorch ops, gradients by autograd (the
inverse rotation), where FlashAttention runs a Triton kernel and a hand-written backward.
Differences from flash_attn 2.7:
- a position past cos's rows raises ValueError naming it (FlashAttention's kernel leaves such
  a token unrotated); to check, a tensor seqlen_offsets, and cu_seqlens, are read back once
  (not under torch.compile, which captures a call without a graph break);
- rows of a packed x past cu_seqlens[-1] are returned as they are (FlashAttention leaves them
  unwritten);
- in-place calls write through autograd (x must not be a leaf that requires grad).
"""

import math
from typing import Optional, Tuple, Union

import torch

from ..._common import check_bools, check_offsets, check_rotary_tables
from ...nn import apply_rotary


def _check_table(cos, sin, x):
    check_rotary_tables(cos, sin, lambda t: isinstance(t, torch.Tensor) and t.dim() == 2 and
                        t.is_floating_point(), "tensor", x.shape[-1], names=("cos", "sin"))
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}: they must match")


def _check_offsets(seqlen_offsets, batch, device):
    """seqlen_offsets checked: an int or a (batch,) integer tensor on x's device, >= 0. Returns
    its largest value (a tensor is read back once), None for a tensor under torch.compile or
    an empty batch."""
    if isinstance(seqlen_offsets, torch.Tensor):
        if seqlen_offsets.shape != (batch,) or seqlen_offsets.is_floating_point() or \
                seqlen_offsets.dtype == torch.bool:
            raise ValueError(f"seqlen_offsets must be an int or a (batch,) = ({batch},) integer "
                             f"tensor, got {seqlen_offsets.dtype} "
                             f"{tuple(seqlen_offsets.shape)}")
        if seqlen_offsets.device != device:
            raise ValueError(f"seqlen_offsets is on {seqlen_offsets.device}, x on {device}: "
                             f"they must match")
        if torch.compiler.is_compiling() or not batch:  # no read back in a graph
            return None
        largest = torch.stack(torch.aminmax(seqlen_offsets)).tolist()
    elif isinstance(seqlen_offsets, int) and not isinstance(seqlen_offsets, bool):
        largest = seqlen_offsets, seqlen_offsets
    else:
        raise TypeError(f"seqlen_offsets must be an int or a (batch,) integer tensor, got "
                        f"{type(seqlen_offsets).__name__}")
    if largest[0] < 0:
        raise ValueError(f"seqlen_offsets must be >= 0, got {largest[0]}")
    return largest[1]


def _check_positions(last, seqlen_ro):
    """last: the largest position used (None: not known without reading the device)."""
    if last is not None and last >= seqlen_ro:
        raise ValueError(f"cos and sin have {seqlen_ro} rows, position {last} is needed "
                         f"(seqlen_offsets + the token's place in its sequence)")


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
                     seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None):
    """x: (batch, seqlen, nheads, headdim), or packed (total_seqlen, nheads, headdim) with
    cu_seqlens (batch + 1,) int32 (max_seqlen: the longest sequence, checked); cos, sin:
    (seqlen_ro, rotary_dim / 2). seqlen_offsets: an int or (batch,): each sequence's first
    token takes row seqlen_offsets[b] (a KV cache's length). interleaved: GPT-J pairs (2i,
    2i + 1) instead of GPT-NeoX's (i, i + rotary_dim / 2). Returns x rotated, a new tensor, or
    x itself written in place if inplace."""
    check_bools(interleaved=interleaved, inplace=inplace)
    if not isinstance(x, torch.Tensor) or x.dim() != (4 if cu_seqlens is None else 3):
        raise ValueError(f"x must be (batch, seqlen, nheads, headdim), or (total_seqlen, "
                         f"nheads, headdim) with cu_seqlens, got "
                         f"{tuple(getattr(x, 'shape', ()))}"
                         f"{'' if cu_seqlens is None else ' with cu_seqlens'}")
    _check_table(cos, sin, x)
    seqlen_ro = cos.shape[0]
    if cu_seqlens is None:
        batch, seqlen = x.shape[:2]
        largest = _check_offsets(seqlen_offsets, batch, x.device)
        _check_positions(None if largest is None or not seqlen else largest + seqlen - 1,
                         seqlen_ro)
        pos = torch.arange(seqlen, device=x.device)  # (N,) or, per sequence, (B, N)
        pos = pos + (seqlen_offsets[:, None] if isinstance(seqlen_offsets, torch.Tensor)
                     else seqlen_offsets)
        out = apply_rotary(x, cos[pos], sin[pos], interleaved)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or \
                cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be a (batch + 1,) int32 tensor, got "
                             f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                             f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
        total, batch = x.shape[0], cu_seqlens.numel() - 1
        largest = _check_offsets(seqlen_offsets, batch, x.device)
        if not torch.compiler.is_compiling():  # the offsets read back once to check them
            offsets = cu_seqlens.tolist()
            check_offsets("cu_seqlens", offsets, None, math.inf if max_seqlen is None
                          else max_seqlen)
            if offsets[-1] > total:
                raise ValueError(f"cu_seqlens ends at {offsets[-1]}, past x's {total} tokens")
            longest = max((b - a for a, b in zip(offsets, offsets[1:])), default=0)
            _check_positions(None if largest is None or not longest else largest + longest - 1,
                             seqlen_ro)
        if batch == 0:  # no sequence: every row is past the last one
            return x if inplace else x.clone()
        cu_seqlens = cu_seqlens.to(x.device)
        token = torch.arange(total, device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:], token, right=True).clamp(max=batch - 1)
        inside = token < cu_seqlens[-1]
        pos = token - cu_seqlens[seq] + (seqlen_offsets[seq] if isinstance(
            seqlen_offsets, torch.Tensor) else seqlen_offsets)
        pos = torch.where(inside, pos, 0)  # (total,); rows past the last sequence: unrotated
        out = apply_rotary(x[None], cos[pos][None], sin[pos][None], interleaved)[0]
        out = torch.where(inside[:, None, None], out, x)
    return x.copy_(out) if inplace else out


apply_rotary_emb_func = apply_rotary_emb  # flash_attn's older name


def _split_qkv(qkv, num_heads_q):
    """Views q, k of a packed qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen,
    num_heads_q + 2 * num_heads_k, headdim)."""
    if isinstance(qkv, torch.Tensor) and qkv.dim() == 5 and qkv.shape[2] == 3:
        return qkv[:, :, 0], qkv[:, :, 1]
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError(f"qkv must be (batch, seqlen, 3, nheads, headdim) or (batch, seqlen, "
                         f"num_heads_q + 2 * num_heads_k, headdim), got "
                         f"{tuple(getattr(qkv, 'shape', ()))}")
    heads = qkv.shape[2]
    if not isinstance(num_heads_q, int) or not 0 < num_heads_q < heads or \
            (heads - num_heads_q) % 2:
        raise ValueError(f"num_heads_q (got {num_heads_q}) must be given for a 4-D qkv and "
                         f"leave an even number of its {heads} heads for k and v")
    num_heads_k = (heads - num_heads_q) // 2
    return qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q:num_heads_q + num_heads_k]


def apply_rotary_emb_qkv_(qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False,
                          seqlen_offsets: Union[int, torch.Tensor] = 0,
                          num_heads_q: Optional[int] = None):
    """Rotates q and k of a packed qkv in place: (batch, seqlen, 3, nheads, headdim), or (GQA)
    (batch, seqlen, num_heads_q + 2 * num_heads_k, headdim) with num_heads_q. cos_k, sin_k:
    k's tables if they differ from q's (XPos). Returns qkv."""
    q, k = _split_qkv(qkv, num_heads_q)
    apply_rotary_emb(q, cos, sin, interleaved, True, seqlen_offsets)
    apply_rotary_emb(k, cos if cos_k is None else cos_k, sin if sin_k is None else sin_k,
                     interleaved, True, seqlen_offsets)
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False,
                         seqlen_offsets: Union[int, torch.Tensor] = 0):
    """Rotates k of a packed kv (batch, seqlen, 2, nheads, headdim) in place; returns kv."""
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (batch, seqlen, 2, nheads, headdim), got "
                         f"{tuple(getattr(kv, 'shape', ()))}")
    apply_rotary_emb(kv[:, :, 0], cos, sin, interleaved, True, seqlen_offsets)
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary embeddings with cached cos / sin tables, as flash_attn's: inverse frequencies
    base^(-2i / dim) for i < dim / 2; with scale_base (XPos), q's tables times and k's divided
    by ((2i + 0.4 dim) / (1.4 dim))^((t - n // 2) / scale_base), n the table's length. The
    tables are kept in the input's dtype, computed in float32, and grow to the longest
    position asked for."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None,
                 device=None):
        super().__init__()
        if not isinstance(dim, int) or dim < 2 or dim % 2:
            raise ValueError(f"dim (the rotary dim) must be an even int >= 2, got {dim}")
        self.dim, self.base = dim, float(base)
        self.interleaved, self.scale_base = interleaved, scale_base
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.register_buffer("scale", None if scale_base is None else self._scale(device),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None):
        exponents = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim
        return 1.0 / self.base ** exponents  # (dim / 2,)

    def _scale(self, device=None):
        i2 = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
        return (i2 + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        """Tables of at least seqlen rows, on device in dtype (computed again when longer ones
        are needed, the device or dtype changes, or tables made in inference mode meet
        training)."""
        cached = self._cos_cached
        if seqlen <= self._seq_len_cached and cached is not None and \
                cached.device == device and cached.dtype == dtype and \
                not (self.training and cached.is_inference()):
            return
        self._seq_len_cached = seqlen
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else \
            self._inv_freq(device)  # float32 even if the module was cast
        freqs = torch.outer(t, inv_freq.to(device))  # (seqlen, dim / 2)
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if self.scale is None:
            self._cos_cached, self._sin_cached = cos.to(dtype), sin.to(dtype)
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._scale(device)
        power = (t - seqlen // 2) / self.scale_base
        scale = scale.to(device) ** power[:, None]  # (seqlen, dim / 2)
        self._cos_cached, self._sin_cached = (cos * scale).to(dtype), (sin * scale).to(dtype)
        self._cos_k_cached, self._sin_k_cached = (cos / scale).to(dtype), (sin / scale).to(dtype)

    def forward(self, qkv: torch.Tensor, kv: Optional[torch.Tensor] = None,
                seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None,
                num_heads_q: Optional[int] = None
                ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Rotates in place and returns qkv (packed as in apply_rotary_emb_qkv_), or, given kv
        (batch, seqlen, 2, nheads, headdim), q = qkv (batch, seqlen, nheads, headdim) and k of
        kv: returns (q, kv). seqlen_offset: an int, or (batch,) with max_seqlen (the tables'
        length to reach; without it the tables kept must already be long enough)."""
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device,
                                       dtype=qkv.dtype)
        if self._cos_cached is None:
            raise ValueError("a tensor seqlen_offset needs max_seqlen (the tables' length) on "
                             "the first call")
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else self._cos_cached
        sin_k = self._sin_k_cached if xpos else self._sin_cached
        if kv is None:
            return apply_rotary_emb_qkv_(qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                                         self.interleaved, seqlen_offset, num_heads_q)
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved, True,
                             seqlen_offset)
        return q, apply_rotary_emb_kv_(kv, cos_k, sin_k, self.interleaved, seqlen_offset)
