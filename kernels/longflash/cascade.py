"""Attention split over parts of the keys, merged exactly: `merge_attention`, and decoding
with a prefix shared by every sequence of the batch, `attention_with_shared_prefix`.

Attention over the union of two key sets is the merge of attention over each, weighted by
their log-sum-exps (the online softmax of FlashAttention one level up, as the split-KV
decoding kernel and ring attention merge their parts):

    lse = log(e^lse_a + e^lse_b),    o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b

A shared prefix (a system prompt, the prompt of several samples) is read once for the whole
batch: every query of every sequence attends to it in one call, as one sequence of batch *
seqlen_q rows (the split-KV decoding path, whatever the batch), then each sequence's own
cache is attended as usual and the two are merged (cascade attention, as FlashInfer's: a
batch of B sequences reads the prefix's P keys once instead of B times).
"""

import torch

from ._common import accumulator_dtype, check_learnable_sink, with_learnable_sink
from .kvcache import attention_with_kvcache


def merge_weights(lse_a, lse_b):
    """(w_a, w_b, lse): the merged lse and each part's weight e^(lse_part - lse); a row that
    has seen no key in either part keeps lse = -inf and weights 0 (not NaN)."""
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = lse.masked_fill(lse == float("-inf"), 0.0)
    return torch.exp(lse_a - lse_safe), torch.exp(lse_b - lse_safe), lse


def merge_attention(o_a, lse_a, o_b, lse_b):
    """Attention over two disjoint sets of keys from attention over each, exactly.

    o_a, o_b: (batch, seqlen_q, nheads, headdim), each normalized over its own keys (the
        outputs of `attention`, `attention_with_kvcache` ...).
    lse_a, lse_b: (batch, nheads, seqlen_q), their natural-log log-sum-exps (return_lse=True);
        -inf for a row that saw no key there.
    Returns (o, lse): o in o_a's dtype, lse in the accumulator dtype (float32, float64 for
    float64), computed in it; a row that saw no key in either part gives o = 0, lse = -inf.
    Differentiable (PyTorch ops).
    """
    for name, o, lse in (("a", o_a, lse_a), ("b", o_b, lse_b)):
        if o.dim() != 4 or lse.shape != (o.shape[0], o.shape[2], o.shape[1]):
            raise ValueError(f"o_{name} must be (batch, seqlen_q, nheads, headdim) and "
                             f"lse_{name} (batch, nheads, seqlen_q), got "
                             f"{tuple(o.shape)} and {tuple(lse.shape)}")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {tuple(o_a.shape)} and "
                         f"{tuple(o_b.shape)}")
    dtype = accumulator_dtype(o_a.dtype)
    w_a, w_b, lse = merge_weights(lse_a.to(dtype), lse_b.to(dtype))
    o = (o_a.to(dtype) * w_a.transpose(1, 2)[..., None]
         + o_b.to(dtype) * w_b.transpose(1, 2)[..., None])
    return o.to(o_a.dtype), lse


def attention_with_shared_prefix(q, prefix_k, prefix_v, k_cache, v_cache, k=None, v=None,
                                 cache_seqlens=None, block_table=None, softmax_scale=None,
                                 causal=True, softcap=0.0, return_lse=False, backend="auto", *,
                                 num_splits=0, cache_batch_idx=None, k_descale=None,
                                 v_descale=None, learnable_sink=None):
    """Decoding over a prefix shared by the whole batch, then each sequence's own KV cache.

    Every query sees all of the prefix (it comes before each sequence's own tokens); the
    sequence's own cache is attended as by `attention_with_kvcache` (the new k, v appended in
    place, causal bottom-right aligned to the sequence's end). Equal to attention_with_kvcache
    over the prefix followed by each sequence's tokens, but the prefix is stored once and read
    once per call, for the whole batch.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), already rotated if the model uses rotary
            embeddings (positions count the prefix: this function applies none).
        prefix_k, prefix_v: (1, prefix_len, nheads_kv, headdim), q's dtype (v's head dim may
            differ, as v_cache's).
        k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits, cache_batch_idx,
        k_descale, v_descale: each sequence's own cache, as in `attention_with_kvcache`.
        softmax_scale, causal, softcap, return_lse, backend, learnable_sink: as in
            `attention_with_kvcache` (the sinks counted once per row, after the merge).
    Returns o: (batch, seqlen_q, nheads, headdim of v), and lse (batch, nheads, seqlen_q) if
    return_lse. Inference only, as attention_with_kvcache.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor (batch, seqlen_q, nheads, headdim), got "
                         f"{getattr(q, 'shape', type(q).__name__)}")
    for name, x in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[0] != 1:
            raise ValueError(f"{name} must be a (1, prefix_len, nheads_kv, headdim) tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    batch, seqlen_q, nheads, headdim = q.shape
    check_learnable_sink(learnable_sink, nheads, q.device)
    # -- the prefix: every query of the batch as one sequence of batch * seqlen_q rows, on the
    # split-KV path (Triton: the prefix's keys split across programs, a KV head's query rows
    # packed in its tiles; the main forward kernel would run one program per query head) --
    o_p, lse_p = attention_with_kvcache(
        q.reshape(1, batch * seqlen_q, nheads, headdim), prefix_k, prefix_v,
        cache_seqlens=prefix_k.shape[1], softmax_scale=softmax_scale, causal=False,
        softcap=softcap, return_lse=True, backend=backend)
    o_p = o_p.view(batch, seqlen_q, nheads, -1)
    lse_p = lse_p.view(nheads, batch, seqlen_q).transpose(0, 1)  # (B, H, Nq)
    # -- each sequence's own cache --
    o_s, lse_s = attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
        softcap=softcap, return_lse=True, backend=backend, num_splits=num_splits,
        cache_batch_idx=cache_batch_idx, k_descale=k_descale, v_descale=v_descale)
    o, lse = merge_attention(o_p, lse_p, o_s, lse_s)
    if learnable_sink is not None:
        o, lse = with_learnable_sink(o, lse, learnable_sink)
    return (o, lse) if return_lse else o
