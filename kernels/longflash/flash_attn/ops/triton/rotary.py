"""flash_attn.ops.triton.rotary on LongFlash: `apply_rotary`, the function under
flash_attn.layers.rotary that code also calls directly, with its arguments (conjugate
included: the inverse rotation, as a backward pass takes it). It is
`longflash.flash_attn.layers.rotary.apply_rotary_emb` (PyTorch ops, differentiable, the same
checks), its arguments in this function's order."""

from typing import Optional, Union

import torch

from ...layers.rotary import apply_rotary_emb


def apply_rotary(x, cos, sin, seqlen_offsets: Union[int, torch.Tensor] = 0,
                 cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                 interleaved=False, inplace=False, conjugate=False) -> torch.Tensor:
    """x: (batch, seqlen, nheads, headdim), or (total_seqlen, nheads, headdim) with cu_seqlens;
    cos, sin: (seqlen_ro, rotary_dim / 2). conjugate: rotate by the negated angles (sin
    negated). Otherwise as apply_rotary_emb."""
    if not isinstance(conjugate, bool):
        raise TypeError(f"conjugate must be a bool, got {type(conjugate).__name__}")
    return apply_rotary_emb(x, cos, -sin if conjugate and isinstance(sin, torch.Tensor) else sin,
                            interleaved, inplace, seqlen_offsets, cu_seqlens, max_seqlen)
