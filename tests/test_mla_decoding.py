"""MLA decoding in its absorbed form: attention_with_kvcache's qv (FlashAttention-3's argument).

Each score is softmax_scale * (q k^T + qv v^T), the default scale 1/sqrt(headdim + headdim_v):
the attention of q' = [q, qv] over k' = [k_cache, v_cache] with values v_cache. That is the
float64 reference here (attention_ref on the concatenations, sequence by sequence), against
which both backends are checked by the tolerance rule: output and lse, on contiguous and paged
caches, appending, with the options (causal, window, softcap, ALiBi, cache_leftpad), over
float8 caches (v_descale scaling qv v^T as it scales the output), with rotary embeddings
(which turn q and the new keys, never qv), under torch.compile, and the errors for a bad qv.
"""

import pytest
import torch

import longflash
from longflash import attention_ref, kvcache
from longflash.flash_attn import flash_attn_with_kvcache
from conftest import INTERPRET, check_close
from test_kvcache import (BACKENDS, FP8, _compile_recorded, _ops, bits, expected_cache,
                          make_descales, rotate_ref, seq_keys)

# (id, batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v, page_size (None: contiguous),
#  capacity (slots a sequence, or pages a sequence), lengths, seqlen_new, kwargs)
CASES = [
    ("decode-H8/1-D16-V80-leftpad", 2, 1, 8, 1, 16, 80, None, 40, [33, 0], 1,
     dict(causal=True, leftpad=[5, 0])),
    ("spec3-H4/1-D32-V48-paged6-window-softcap", 2, 3, 4, 1, 32, 48, 6, 6, [20, 9], 2,
     dict(causal=True, window_size=(11, -1), softcap=0.7, softmax_scale=0.11)),
    ("noappend-H4/2-D16-V24-alibi", 3, 2, 4, 2, 16, 24, None, 30, [29, 7, 0], 0,
     dict(alibi=(4,))),
    ("latent512-H4/1-D16-V512", 1, 1, 4, 1, 16, 512, None, 40, [37], 1, dict(causal=True)),
]


def case_id(case):
    return case[0]


def make_mla(case, dtype, seed=0):
    """q, qv, k_cache, v_cache, k, v, cache_seqlens, block_table, kwargs of a case."""
    (_, batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v, page_size, capacity, lengths,
     new, kw) = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    q, qv = rand(batch, seqlen_q, nheads, headdim), rand(batch, seqlen_q, nheads, headdim_v)
    rows = (batch, capacity) if page_size is None else (batch * capacity + 2, page_size)
    k_cache, v_cache = rand(*rows, nheads_kv, headdim), rand(*rows, nheads_kv, headdim_v)
    block_table = None
    if page_size is not None:
        block_table = torch.randperm(rows[0], generator=gen)[:batch * capacity].view(
            batch, capacity).to(torch.int32)
    k = rand(batch, new, nheads_kv, headdim) if new else None
    v = rand(batch, new, nheads_kv, headdim_v) if new else None
    kw = dict(kw)
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(kw.pop("alibi"), generator=gen) * 0.5
    if "leftpad" in kw:
        kw["cache_leftpad"] = torch.tensor(kw.pop("leftpad"), dtype=torch.int32)
    return q, qv, k_cache, v_cache, k, v, torch.tensor(lengths, dtype=torch.int32), \
        block_table, kw


def mla_ref(q, qv, keys, values, upcast=True, **kw):
    """The absorbed attention as the plain one of [q, qv] over [keys, values], values values."""
    scale = kw.pop("softmax_scale", None) or (q.shape[-1] + qv.shape[-1]) ** -0.5
    return attention_ref(torch.cat([q, qv], -1), torch.cat([keys, values], -1), values,
                         softmax_scale=scale, upcast=upcast, **kw)


def check_mla(case, dtype, backend, num_splits, device="cpu", fp8=None,
              fn=longflash.attention_with_kvcache):
    """One case on `device` against the float64 reference on the CPU; fp8: (float8 dtype,
    descale kind) for a quantized cache; fn: attention_with_kvcache or a compiled one."""
    q, qv, k_cache, v_cache, k, v, cache_seqlens, block_table, kw = make_mla(case, dtype)
    lengths, new = cache_seqlens.tolist(), 0 if k is None else k.shape[1]
    k_new, v_new = k, v
    scales = (torch.ones(q.shape[0], k_cache.shape[2]),) * 2
    if fp8 is not None:
        cache_dtype, descale_kind = fp8
        k_cache, v_cache = k_cache.float().to(cache_dtype), v_cache.float().to(cache_dtype)
        descale_kw, scales = make_descales(descale_kind, q, k_cache.shape[2])
        kw.update(descale_kw)
        if k is not None:
            k_new, v_new = (kvcache.quantize(x, s, cache_dtype) for x, s in zip((k, v), scales))
    k_after = expected_cache(k_cache, k_new, block_table, lengths)
    v_after = expected_cache(v_cache, v_new, block_table, lengths)
    on = (lambda x: x if not isinstance(x, torch.Tensor) else x.to(device))  # noqa: E731
    caches = [on(k_cache), on(v_cache)]
    o, lse = fn(on(q), *caches, on(k), on(v), on(cache_seqlens), on(block_table),
                return_lse=True, backend=backend, num_splits=num_splits, qv=on(qv),
                **{key: on(val) for key, val in kw.items()})
    (k_cache, v_cache), o, lse = [c.cpu() for c in caches], o.cpu(), lse.cpu()
    assert torch.equal(bits(k_cache), bits(k_after)) and torch.equal(bits(v_cache), bits(v_after))
    assert o.shape == qv.shape and o.dtype == dtype
    pads = kw.get("cache_leftpad", torch.zeros(len(lengths), dtype=torch.int32)).tolist()
    ref_kw = {key: val for key, val in kw.items()
              if key not in ("alibi_slopes", "cache_leftpad", "k_descale", "v_descale")}
    for b, n in enumerate(lengths):
        keys, values = (seq_keys(c, block_table, b, n + new)[:, pads[b]:].double()
                        * s[b].double()[:, None] for c, s in zip((k_cache, v_cache), scales))
        if "alibi_slopes" in kw:
            ref_kw["alibi_slopes"] = kw["alibi_slopes"].expand(q.shape[0], q.shape[2])[b:b + 1]
        one = slice(b, b + 1)
        ref = mla_ref(q[one].double(), qv[one].double(), keys, values, **ref_kw)
        low = mla_ref(q[one], qv[one], keys.to(dtype), values.to(dtype), upcast=False,
                      **ref_kw)
        check_close(f"o[{b}]", o[one], low[0], ref[0])
        check_close(f"lse[{b}]", lse[one], low[1], ref[1])


@pytest.fixture
def small_blocks(monkeypatch):  # several key blocks a sequence on the PyTorch path
    monkeypatch.setattr(kvcache, "BLOCK_N", 8)
    monkeypatch.setattr(kvcache, "MAX_BLOCK_N", 8)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path(dtype, case, num_splits, small_blocks):
    check_mla(case, dtype, "torch", num_splits)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("num_splits", [0, 3], ids=["splits-auto", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_interpreter(dtype, case, num_splits):
    check_mla(case, dtype, "triton", num_splits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES[:3], ids=case_id)
def test_fp8_cache(backend, case, cache_dtype, small_blocks):
    """The key and value scales on their own products: (k_descale, v_descale) (0.7, 1.3) or
    per-sequence tensors."""
    descales = ["tensors", "floats"][CASES.index(case) % 2]
    check_mla(case, torch.float32, backend, 2, fp8=(cache_dtype, descales))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
def test_rotary_turns_q_not_qv(backend, interleaved):
    """With rotary_cos/rotary_sin, the result of rotating q and the new keys by hand and
    passing qv as it is (float32, to rounding)."""
    case = ("rotary", 2, 2, 4, 1, 16, 40, None, 24, [9, 3], 2, dict(causal=True))
    q, qv, k_cache, v_cache, k, v, seqlens, _, kw = make_mla(case, torch.float32)
    angles = torch.rand(16, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cos, sin = angles.cos().float(), angles.sin().float()
    caches, ref_caches = [k_cache, v_cache], [k_cache.clone(), v_cache.clone()]
    o = longflash.attention_with_kvcache(q, *caches, k, v, seqlens, backend=backend, qv=qv,
                                         rotary_cos=cos, rotary_sin=sin,
                                         rotary_interleaved=interleaved, **kw)
    pos = [[n + i for i in range(2)] for n in seqlens.tolist()]
    q_r, k_r = (rotate_ref(x, pos, cos, sin, interleaved).float() for x in (q, k))
    want = longflash.attention_with_kvcache(q_r, *ref_caches, k_r, v, seqlens, backend=backend,
                                            qv=qv, **kw)
    torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5)
    for got, ref in zip(caches, ref_caches):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    """qv an input of the decoding op under torch.compile(fullgraph=True), within the
    tolerance rule, at two tensor lengths (one graph, the second dynamic)."""
    step, graphs = _compile_recorded(longflash.attention_with_kvcache, "aot_eager")
    for lengths in ([30, 11], [31, 12]):
        case = ("compiled", 2, 1, 8, 1, 16, 48, None, 40, lengths, 1, dict(causal=True))
        check_mla(case, torch.float32, backend, 0, fn=step)
    assert graphs and all("longflash.kvcache_forward" in _ops(g) for g in graphs)


def test_flash_attn_binding_passes_qv():
    case = CASES[0]
    q, qv, k_cache, v_cache, k, v, seqlens, _, kw = make_mla(case, torch.float32)
    caches = [k_cache.clone(), v_cache.clone()]
    o, lse = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=seqlens, causal=True,
                                     cache_leftpad=kw["cache_leftpad"], qv=qv,
                                     return_softmax_lse=True)
    want, want_lse = longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens,
                                                      causal=True, return_lse=True, qv=qv,
                                                      cache_leftpad=kw["cache_leftpad"])
    assert torch.equal(o, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("bad, error, match", [
    (lambda qv: qv.numpy(), TypeError, "qv must be a torch.Tensor"),
    (lambda qv: qv[..., :-1], ValueError, r"qv must have shape \(batch, seqlen_q, nheads"),
    (lambda qv: qv[:, :, :2], ValueError, "qv must have shape"),
    (lambda qv: qv.double(), TypeError, "qv has dtype torch.float64, q has torch.float32"),
], ids=["numpy", "headdim", "heads", "dtype"])
def test_bad_qv_is_refused_before_the_append(bad, error, match):
    q, qv, k_cache, v_cache, k, v, seqlens, _, _ = make_mla(CASES[0], torch.float32)
    before = [k_cache.clone(), v_cache.clone()]
    with pytest.raises(error, match=match):
        longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens, qv=bad(qv))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_latents_beyond_512_are_refused():
    q, qv = torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 520)
    k_cache, v_cache = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 520)
    with pytest.raises(ValueError, match="headdim"):
        longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=4, qv=qv)


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_cache_batch_idx_attn_mask_and_sink(backend):
    """qv beside the options that take another route: serving slots (cache_batch_idx), a
    boolean attn_mask over the keys and a learnable sink, as the concatenated call gives them
    (float32, to rounding)."""
    case = ("slots", 2, 2, 4, 1, 16, 24, None, 30, [17, 9], 2, dict(causal=True))
    q, qv, k_cache, v_cache, k, v, seqlens, _, kw = make_mla(case, torch.float32)
    gen = torch.Generator().manual_seed(9)
    rows = torch.tensor([2, 0])  # sequence b's row of a cache of 3
    k_slots, v_slots = (torch.randn(3, 30, 1, x.shape[-1], generator=gen) for x in (k, v))
    mask = torch.rand(2, 1, 2, 19, generator=gen) < 0.8
    sink = torch.randn(4, generator=gen)
    extra = dict(cache_batch_idx=rows, attn_mask=mask, learnable_sink=sink, **kw)
    kv = [k_slots.clone(), v_slots.clone()]
    o = longflash.attention_with_kvcache(q, *kv, k, v, seqlens, backend=backend, qv=qv, **extra)
    cat = [torch.cat([k_slots, v_slots], -1), v_slots.clone()]
    want = longflash.attention_with_kvcache(
        torch.cat([q, qv], -1), *cat, torch.cat([k, v], -1), v, seqlens, backend=backend,
        softmax_scale=40 ** -0.5, **extra)
    torch.testing.assert_close(o, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kv[1], cat[1])
    torch.testing.assert_close(kv[0], cat[0][..., :16])
