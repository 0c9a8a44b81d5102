"""longflash.flash_attn: FlashAttention-2's Python API (flash_attn 2.7's signatures) on LongFlash.

The signatures are compared with FlashAttention's, written out below (parameter names, order
and defaults), so code written for flash_attn keeps its meaning, positional arguments
included; each function's results are compared with the native call they stand for, bit for
bit, gradients of the packed forms included.
"""

import importlib
import inspect

import pytest
import torch

import longflash
from longflash import flash_attn as fa

_OPTIONS = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
            ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
            ("deterministic", False), ("return_attn_probs", False)]
_REQUIRED = inspect.Parameter.empty
_VARLEN = [("cu_seqlens_q", _REQUIRED), ("cu_seqlens_k", _REQUIRED),
           ("max_seqlen_q", _REQUIRED), ("max_seqlen_k", _REQUIRED)]
# flash_attn/flash_attn_interface.py (flash_attn 2.7): (name, default) in order
FLASH_ATTN_SIGNATURES = {
    "flash_attn_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _OPTIONS,
    "flash_attn_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _OPTIONS,
    "flash_attn_qkvpacked_func": [("qkv", _REQUIRED)] + _OPTIONS,
    "flash_attn_varlen_func": [("q", _REQUIRED), ("k", _REQUIRED), ("v", _REQUIRED)] + _VARLEN
    + _OPTIONS + [("block_table", None)],
    "flash_attn_varlen_kvpacked_func": [("q", _REQUIRED), ("kv", _REQUIRED)] + _VARLEN
    + _OPTIONS,
    "flash_attn_varlen_qkvpacked_func": [("qkv", _REQUIRED), ("cu_seqlens", _REQUIRED),
                                         ("max_seqlen", _REQUIRED)] + _OPTIONS,
    "flash_attn_with_kvcache": [
        ("q", _REQUIRED), ("k_cache", _REQUIRED), ("v_cache", _REQUIRED), ("k", None),
        ("v", None), ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None),
        ("cache_batch_idx", None), ("cache_leftpad", None), ("block_table", None),
        ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False)],
}


# Keyword-only arguments after FlashAttention-2's (FlashAttention-3's names), which cannot
# shift a positional call's meaning.
KEYWORD_ONLY = {"flash_attn_with_kvcache": [("k_descale", None), ("v_descale", None),
                                             ("qv", None)]}


@pytest.mark.parametrize("name", list(FLASH_ATTN_SIGNATURES))
def test_signature_is_flash_attn_s(name):
    params = list(inspect.signature(getattr(fa, name)).parameters.values())
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == FLASH_ATTN_SIGNATURES[name]
    assert [(p.name, p.default) for p in params[len(positional):]] == KEYWORD_ONLY.get(name, [])
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional):])
    # FlashAttention's module path too: flash_attn.flash_attn_interface
    assert getattr(importlib.import_module("longflash.flash_attn.flash_attn_interface"),
                   name) is getattr(fa, name)


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


# Positional, in FlashAttention's order: dropout_p, softmax_scale, causal, window_size,
# softcap, alibi_slopes, deterministic, return_attn_probs.
POSITIONAL = [
    pytest.param((0.0, 0.3, True), {}, id="scale-causal"),
    pytest.param((0.0, None, False, (5, 2), 0.7), dict(window_size=(5, 2), softcap=0.7),
                 id="window-softcap"),
    pytest.param((0.25,), dict(dropout_p=0.25), id="dropout"),
]


@pytest.mark.parametrize("args, kw", POSITIONAL)
def test_flash_attn_func_is_attention(args, kw):
    gen = torch.Generator().manual_seed(0)
    q, k, v = _randn(gen, 2, 37, 6, 24), _randn(gen, 2, 53, 2, 24), _randn(gen, 2, 53, 2, 24)
    native_kw = dict(kw, softmax_scale=args[1] if len(args) > 1 else None,
                     causal=args[2] if len(args) > 2 else False)
    torch.manual_seed(7)  # the dropout seed is drawn from torch's default generator
    out, lse, probs = fa.flash_attn_func(q, k, v, *args, return_attn_probs=True)
    torch.manual_seed(7)
    want_out, want_lse = longflash.attention(q, k, v, return_lse=True, **native_kw)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and probs is None
    torch.manual_seed(7)
    assert torch.equal(fa.flash_attn_func(q, k, v, *args), want_out)


def test_value_headdim_may_differ():
    """Unlike FlashAttention-2, v's head dim may differ (MLA), as in longflash.attention."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = _randn(gen, 1, 17, 4, 24), _randn(gen, 1, 17, 2, 24), _randn(gen, 1, 17, 2, 16)
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 17, 4, 16)
    assert torch.equal(out, longflash.attention(q, k, v, causal=True))


def test_packed_forms_and_their_gradients():
    """kvpacked and qkvpacked give the unpacked call's output, and the packed tensor's gradient
    is the unpacked gradients stacked."""
    gen = torch.Generator().manual_seed(1)
    qkv = _randn(gen, 2, 29, 3, 4, 16).requires_grad_()
    slopes = torch.rand(4, generator=gen)
    out = fa.flash_attn_qkvpacked_func(qkv, 0.0, None, True, alibi_slopes=slopes)
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv.unbind(2))
    want = longflash.attention(q, k, v, causal=True, alibi_slopes=slopes)
    assert torch.equal(out, want)
    grad = _randn(gen, *out.shape)
    out.backward(grad)
    want.backward(grad)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], 2))
    kv = torch.stack([k.detach(), v.detach()], 2)[:, :, :, :2].contiguous()  # GQA: 2 KV heads
    got = fa.flash_attn_kvpacked_func(q.detach(), kv, causal=True)
    assert torch.equal(got, longflash.attention(q.detach(), *kv.unbind(2), causal=True))


def test_varlen_forms():
    gen = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 10, 40], dtype=torch.int32)
    q, k, v = _randn(gen, 30, 4, 16), _randn(gen, 40, 2, 16), _randn(gen, 40, 2, 16)
    out, lse, probs = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 13, 30, 0.0, None, True,
                                                return_attn_probs=True)
    want_out, want_lse = longflash.attention_varlen(q, k, v, cu_q, cu_k, 13, 30, causal=True,
                                                    return_lse=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and probs is None
    kv = torch.stack([k, v], 1)
    assert torch.equal(fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, 13, 30,
                                                          causal=True), want_out)
    qkv = torch.stack([q, _randn(gen, 30, 4, 16), _randn(gen, 30, 4, 16)], 1)
    assert torch.equal(fa.flash_attn_varlen_qkvpacked_func(qkv, cu_q, 13, window_size=(3, 0)),
                       longflash.attention_varlen(*qkv.unbind(1), cu_q, cu_q, 13, 13,
                                                  window_size=(3, 0)))


def test_flash_attn_with_kvcache_is_attention_with_kvcache():
    """Every argument in FlashAttention's positional order, rotary and left padding included;
    both calls append the same keys to their own copy of the cache."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = _randn(gen, 2, 1, 8, 32), _randn(gen, 2, 1, 2, 32), _randn(gen, 2, 1, 2, 32)
    k_cache, v_cache = _randn(gen, 3, 40, 2, 32), _randn(gen, 3, 40, 2, 32)
    angles = torch.rand(64, 8, generator=gen) * 6.3
    cos, sin = angles.cos(), angles.sin()
    lengths, rows, pads = (torch.tensor(x, dtype=torch.int32) for x in ([30, 12], [2, 0], [4, 11]))
    slopes = torch.rand(8, generator=gen)
    caches = [k_cache.clone(), v_cache.clone()]
    out, lse = fa.flash_attn_with_kvcache(q, *caches, k, v, cos, sin, lengths, rows, pads, None,
                                          0.2, True, (20, 0), 0.9, False, slopes, 2, True)
    want_caches = [k_cache.clone(), v_cache.clone()]
    want = longflash.attention_with_kvcache(
        q, *want_caches, k, v, lengths, None, 0.2, True, (20, 0), 0.9, slopes, True,
        num_splits=2, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False,
        cache_batch_idx=rows, cache_leftpad=pads)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))
    assert not torch.equal(caches[0], k_cache)  # the append happened


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_flash_attn_with_kvcache_float8_cache(cache_dtype):
    """A float8 cache with FlashAttention-3's k_descale / v_descale: the same output, lse and
    appended bytes as attention_with_kvcache's."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = _randn(gen, 2, 1, 8, 32), _randn(gen, 2, 1, 2, 32), _randn(gen, 2, 1, 2, 32)
    k_cache, v_cache = (_randn(gen, 2, 40, 2, 32).to(cache_dtype) for _ in range(2))
    lengths = torch.tensor([30, 12], dtype=torch.int32)
    k_scale, v_scale = torch.rand(2, 2, generator=gen) + 0.5, 0.25
    caches = [k_cache.clone(), v_cache.clone()]
    out, lse = fa.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lengths, causal=True,
                                          return_softmax_lse=True, k_descale=k_scale,
                                          v_descale=v_scale)
    want_caches = [k_cache.clone(), v_cache.clone()]
    want = longflash.attention_with_kvcache(q, *want_caches, k, v, lengths, causal=True,
                                            return_lse=True, k_descale=k_scale,
                                            v_descale=v_scale)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    for a, b in zip(caches, want_caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not torch.equal(caches[0].view(torch.uint8), k_cache.view(torch.uint8))


# ----------------------------------------------------------------------------- bert_padding

# flash_attn/bert_padding.py (flash_attn 2.7): (name, default) in order
BERT_PADDING_SIGNATURES = {
    "index_first_axis": [("input", _REQUIRED), ("indices", _REQUIRED)],
    "index_put_first_axis": [("values", _REQUIRED), ("indices", _REQUIRED),
                             ("first_axis_dim", _REQUIRED)],
    "unpad_input": [("hidden_states", _REQUIRED), ("attention_mask", _REQUIRED),
                    ("unused_mask", None)],
    "unpad_input_for_concatenated_sequences": [("hidden_states", _REQUIRED),
                                               ("attention_mask_in_length", _REQUIRED)],
    "pad_input": [("hidden_states", _REQUIRED), ("indices", _REQUIRED), ("batch", _REQUIRED),
                  ("seqlen", _REQUIRED)],
}


@pytest.mark.parametrize("name", list(BERT_PADDING_SIGNATURES))
def test_bert_padding_signature_is_flash_attn_s(name):
    from longflash.flash_attn import bert_padding
    params = inspect.signature(getattr(bert_padding, name)).parameters.values()
    assert [(p.name, p.default) for p in params] == BERT_PADDING_SIGNATURES[name]


def test_unpad_and_pad_input():
    """unpad_input keeps the masked-in tokens in order (rows without any, and full rows), with
    int32 offsets and the longest length; pad_input puts them back, zeros elsewhere; the
    gradient reaches exactly the kept tokens; unused_mask keeps tokens but not in seqused."""
    from longflash.flash_attn.bert_padding import pad_input, unpad_input
    gen = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x = _randn(gen, 3, 5, 2, 4).requires_grad_()
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask)
    assert torch.equal(packed, x[mask]) and indices.tolist() == [0, 1, 3, 10, 11, 12, 13, 14]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 8] and max_seqlen == 5
    assert seqused.tolist() == [3, 0, 5]
    padded = pad_input(packed, indices, 3, 5)
    assert torch.equal(padded, x * mask[..., None, None])
    padded.sum().backward()
    assert torch.equal(x.grad, mask[..., None, None].expand_as(x).float())
    unused = torch.zeros_like(mask)
    unused[0, 4] = True
    packed, indices, cu, max_seqlen, seqused = unpad_input(x, mask, unused)
    assert cu.tolist() == [0, 4, 4, 9] and seqused.tolist() == [3, 0, 5]


def test_unpad_input_for_concatenated_sequences():
    """flash_attn's documented example: rows of several short sequences each."""
    from longflash.flash_attn.bert_padding import unpad_input_for_concatenated_sequences
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x = torch.arange(18.0).view(3, 6, 1)
    packed, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and max_seqlen == 6
    assert torch.equal(packed[:, 0], indices.float())


def test_padded_batch_through_varlen_attention():
    """The FlashAttention recipe for a padded batch (unpad, varlen attention, pad) gives each
    sequence its own attention and zeros at the padding."""
    from longflash.flash_attn.bert_padding import pad_input, unpad_input
    gen = torch.Generator().manual_seed(5)
    lengths = [7, 2, 11]
    mask = torch.arange(11)[None] < torch.tensor(lengths)[:, None]
    q, k, v = (_randn(gen, 3, 11, 4, 16) for _ in range(3))
    q_packed, indices, cu, max_seqlen, _ = unpad_input(q, mask)
    k_packed, v_packed = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out = pad_input(fa.flash_attn_varlen_func(q_packed, k_packed, v_packed, cu, cu, max_seqlen,
                                              max_seqlen, causal=True), indices, 3, 11)
    for b, n in enumerate(lengths):
        want = longflash.attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        torch.testing.assert_close(out[b:b + 1, :n], want, atol=1e-6, rtol=1e-6)
        assert not out[b, n:].any()
