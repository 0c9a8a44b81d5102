"""LongFlash: exact, IO-aware attention.

    import longflash
    o = longflash.attention(q, k, v, causal=True)        # q: (batch, seqlen, nheads, headdim)
    o = longflash.scaled_dot_product_attention(q, k, v)  # PyTorch's (batch, nheads, seqlen, headdim)

Three implementations of one function: `reference` (materializes the N x N matrix;
ground truth and naive baseline), `blockwise` (the tiled algorithm in PyTorch ops:
exact attention in linear memory on any device) and `flash_triton` (the Triton
kernels, for CUDA tensors). `attention(..., backend="auto" | "triton" | "torch")`
chooses among them.

Sequence parallelism: `longflash.parallel.ring_attention` (ring attention over a
torch.distributed process group), and `longflash.parallel.attention_with_sharded_kvcache`
(decoding over a KV cache spread across the group's ranks). Decoding: `attention_with_kvcache`, and with a prefix shared
by the batch `attention_with_shared_prefix`; `merge_attention` merges attention over parts of
the keys exactly. FlashAttention-2's
functions with their exact signatures: `from longflash.flash_attn import flash_attn_func`.
"""

from . import parallel  # noqa: F401 - longflash.parallel.ring_attention, shard/unshard_sequence
from .cascade import attention_with_shared_prefix, merge_attention
from .interface import BACKENDS, attention, attention_varlen, scaled_dot_product_attention
from .kvcache import attention_with_kvcache, tree_attention_mask
from .reference import attention_ref, attention_varlen_ref

__version__ = "0.1.0"

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "tree_attention_mask",
           "attention_with_shared_prefix", "merge_attention",
           "scaled_dot_product_attention", "attention_ref", "attention_varlen_ref",
           "parallel", "BACKENDS", "__version__"]
