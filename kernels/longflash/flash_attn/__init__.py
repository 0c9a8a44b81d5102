"""FlashAttention-2's Python API on LongFlash: the functions of `flash_attn` with their
argument names, positional order, defaults and return values, so that code written for
FlashAttention switches with its import line:

    from flash_attn import flash_attn_func, flash_attn_with_kvcache              # before
    from longflash.flash_attn import flash_attn_func, flash_attn_with_kvcache    # after

Each function is a thin call of `longflash.attention`, `attention_varlen` or
`attention_with_kvcache` (backend "auto": the Triton kernels for CUDA tensors, the blockwise
PyTorch path elsewhere), with the same semantics (bottom-right causal alignment, windows,
softcap, ALiBi, GQA, dropout). Differences from flash_attn 2.7:
- return_attn_probs=True returns (out, softmax_lse, None): LongFlash never forms the
  attention matrix, so there is no S_dmask (FlashAttention documents its own as "for testing
  only"). softmax_lse is as in FlashAttention.
- Dropout masks come from LongFlash's counter-based generator, seeded from torch's default
  generator: the same probability and scaling, not FlashAttention's bits.
- Packed qkv / kv are split into views; their gradients are concatenated by autograd.
- flash_attn_varlen_func's block_table (paged keys in the prefill): the kernels read the
  pages in place, as FlashAttention's do, unless a gradient is needed; then the keys in use are
  packed into a copy first (`attention_varlen`).
- CPU tensors and head dims 1 to 256 work (FlashAttention needs CUDA, head dims <= 256), and
  v's head dim may differ from q's and k's (FlashAttention-2 requires them equal), as in
  `longflash.attention` and `attention_with_kvcache`, except for a paged cache in
  flash_attn_varlen_func.
- flash_attn_with_kvcache takes float8 caches with FlashAttention-3's keyword-only
  k_descale and v_descale (after FlashAttention-2's arguments, which keep their order).
`longflash.flash_attn.bert_padding` has flash_attn.bert_padding's helpers (unpad_input,
pad_input, ...) for padded batches, `longflash.flash_attn.layers.rotary`
flash_attn.layers.rotary's rotary embeddings (apply_rotary_emb, RotaryEmbedding, ...).
"""

from ..interface import attention, attention_varlen
from ..kvcache import attention_with_kvcache


def _options(dropout_p, window_size, softcap, alibi_slopes, deterministic):
    return dict(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, deterministic=deterministic)


def _returns(out, lse, return_attn_probs):
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim).
    Returns out like q; with return_attn_probs, (out, softmax_lse (batch, nheads, seqlen_q),
    None)."""
    out, lse = attention(q, k, v, causal, softmax_scale, True,
                         **_options(dropout_p, window_size, softcap, alibi_slopes, deterministic))
    return _returns(out, lse, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """kv: (batch, seqlen_k, 2, nheads_k, headdim); otherwise flash_attn_func."""
    return flash_attn_func(q, *kv.unbind(2), dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv: (batch, seqlen, 3, nheads, headdim); otherwise flash_attn_func."""
    return flash_attn_func(*qkv.unbind(2), dropout_p, softmax_scale, causal, window_size,
                           softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), or with block_table
    (batch, max_pages) int32 paged caches (num_pages, page_size, nheads_k, headdim);
    cu_seqlens_q/k: (batch + 1,) int32. Returns out like q; with return_attn_probs, (out,
    softmax_lse (nheads, total_q), None)."""
    out, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                causal, softmax_scale, True, block_table=block_table,
                                **_options(dropout_p, window_size, softcap, alibi_slopes,
                                           deterministic))
    return _returns(out, lse, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """kv: (total_k, 2, nheads_k, headdim); otherwise flash_attn_varlen_func."""
    return flash_attn_varlen_func(q, *kv.unbind(1), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv: (total, 3, nheads, headdim), one cu_seqlens and max_seqlen for queries and keys;
    otherwise flash_attn_varlen_func."""
    return flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen,
                                  max_seqlen, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, k_descale=None, v_descale=None,
                            qv=None):
    """Decoding over a KV cache, appending k, v in place: `longflash.attention_with_kvcache`
    in FlashAttention's argument order (any page size; no multiple of 256 needed).
    k_descale, v_descale (keyword-only, FlashAttention-3's names; FlashAttention-2 has no
    float8 cache): the scales of a float8_e4m3fn / float8_e5m2 cache, a float or a float32
    tensor broadcastable to (batch, nheads_kv); k, v are quantized by them as they are
    appended. qv (keyword-only, FlashAttention-3's): MLA's absorbed queries against the
    values, (batch, seqlen_q, nheads, headdim_v), each score softmax_scale * (q k^T + qv v^T),
    default scale 1/sqrt(headdim + headdim_v) as FlashAttention-3's."""
    return attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, softmax_scale, causal,
        window_size, softcap, alibi_slopes, return_softmax_lse, num_splits=num_splits,
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, k_descale=k_descale,
        v_descale=v_descale, qv=qv)
