"""Values with another head dim than the queries and keys (MLA: DeepSeek-V2/V3 attend with
headdim 192 and headdim_v 128), which every kernel takes as it is (HEAD_DIM, HEAD_DIM_V).
Every entry point against the float64 reference, which computes it directly (its einsums take
any head dims): output, lse and the gradients of q, k and v by the tolerance rule, with v
narrower and wider than q, the default softmax scale (from q's headdim) and the options, on
the Triton kernels' pointer, TMA and warp-specialized paths (and dQ by atomics); then the
errors where it is not supported.
"""

import pytest
import torch

import longflash
from longflash import attention_ref, attention_varlen_ref
from conftest import INTERPRET, check_close, check_with_grads, torch_sdpa
from test_variants import kwargs_for, ref_kwargs, tiles_id, use_tiles, use_tma

BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])
# The Triton kernels' pointer, TMA and warp-specialized code paths: each loads v, dO and stores
# o, dV with the values' head dim (HEAD_DIM_V, BLOCK_DV), a tensor descriptor of its own; and
# dK/dV adding dQ (the queries' head dim) by atomics, by pointers and by TMA reductions.
BACKEND_TILES = [("torch", None)] + ([("triton", None), ("triton", "tma"), ("triton", "ws"),
                                      ("triton", "atomic"), ("triton", "atomic-tma")]
                                     if INTERPRET else [])

# (id, shape (B, Nq, Nk, H, Hkv, D, Dv), keyword arguments)
CASES = [
    ("narrow-v-causal", (2, 29, 37, 4, 2, 48, 32), dict(causal=True)),   # MLA's shape of ratio
    ("wide-v-full", (1, 33, 45, 4, 1, 24, 40), dict()),                  # v wider than q, k
    ("odd-all", (2, 47, 53, 4, 2, 59, 40), dict(causal=True, window_size=(12, -1), alibi=(2, 4),
                                               softcap=1.0, dropout_p=0.2, seed=7)),
]


def make_inputs(shape, dtype, seed=0, device="cpu"):
    """q, k, v (leaves) and do."""
    b, nq, nk, h, hkv, d, dv = shape
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, dv), (b, nq, h, dv)]
    q, k, v, do = (torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype)
                   for s in shapes)
    return [x.requires_grad_() for x in (q, k, v)] + [do]


def check(fn, ref_fn, q, k, v, do, dlse):
    o = check_with_grads(fn, ref_fn, (q, k, v), ("q", "k", "v"), do, dlse)[0]
    assert o.shape == do.shape and o.is_contiguous()


# fp32 and fp16 everywhere but on the Triton kernels' tiles without TMA, which run fp16 only: the
# interpreter runs the same loops for both (CI's slowest part); the TMA tiles take both, as
# the row size in bytes decides whether a TMA copy is possible
RUNS = [pytest.param(b, t, d, id=f"{n}-{tiles_id(b, t)}") for b, t in BACKEND_TILES
        for d, n in ((torch.float32, "fp32"), (torch.float16, "fp16"))
        if not (b == "triton" and t in (None, "atomic") and d == torch.float32)]


@pytest.mark.parametrize("backend, tiles, dtype", RUNS)
@pytest.mark.parametrize("shape, kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_attention(backend, tiles, dtype, shape, kw, monkeypatch):
    itemsize = torch.finfo(dtype).bits // 8
    if tiles in ("tma", "ws", "atomic-tma") and any(d * itemsize % 16 for d in shape[5:]):
        pytest.skip("a TMA copy needs rows of 16-byte multiples (the launcher's _tma_ok)")
    use_tiles(monkeypatch, tiles)
    check_attention(shape, dtype, kw, backend)


def check_attention(shape, dtype, kw, backend, device="cpu"):
    kw = kwargs_for(kw, device)
    q, k, v, do = make_inputs(shape, dtype, device=device)
    dlse = torch.randn(shape[0], shape[3], shape[1],
                       generator=torch.Generator().manual_seed(3)).to(device)
    check(lambda q, k, v: longflash.attention(q, k, v, return_lse=True, backend=backend, **kw),
          lambda q, k, v, **r: attention_ref(q, k, v, **ref_kwargs(kw), **r), q, k, v, do, dlse)


def test_bfloat16_torch_path():
    check_attention(*CASES[-1][1:2], torch.bfloat16, CASES[-1][2], "torch")


@pytest.mark.parametrize("backend", BACKENDS + (["triton-tma"] if INTERPRET else []))
@pytest.mark.parametrize("headdim_v", [16, 40])
def test_varlen(backend, headdim_v, monkeypatch):
    """Packed sequences of different lengths, one empty, causal and windowed (with TMA: a
    descriptor per sequence, the values' of their own head dim)."""
    if backend == "triton-tma":
        use_tma(monkeypatch, ws=True, varlen=True)
        backend = "triton"
    lengths_q, lengths_k = [17, 0, 30], [23, 5, 31]
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)  # noqa: E731
    cu_q, cu_k = cu(lengths_q), cu(lengths_k)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 24, generator=gen).requires_grad_()
    k = torch.randn(sum(lengths_k), 2, 24, generator=gen).requires_grad_()
    v = torch.randn(sum(lengths_k), 2, headdim_v, generator=gen).requires_grad_()
    do = torch.randn(sum(lengths_q), 4, headdim_v, generator=gen)
    dlse = torch.randn(4, sum(lengths_q), generator=gen)
    kw = dict(causal=True, window_size=(9, -1))
    check(lambda q, k, v: longflash.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q),
                                                     max(lengths_k), return_lse=True,
                                                     backend=backend, **kw),
          lambda q, k, v, **r: attention_varlen_ref(q, k, v, cu_q, cu_k, **kw, **r),
          q, k, v, do, dlse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_kv_route_and_sink(backend, monkeypatch):
    """attention()'s split-KV route (short queries over long keys, taken here from 64 keys),
    with attention sinks applied to the sliced output."""
    import longflash.interface as interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 64)
    q, k, v, do = make_inputs((2, 2, 90, 8, 2, 32, 16), torch.float16)
    sink = torch.linspace(-1.0, 4.0, 8).requires_grad_()
    with torch.no_grad():
        o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend,
                                     learnable_sink=sink)
        o_lowp, lse_lowp = attention_ref(q, k, v, causal=True, upcast=False, learnable_sink=sink)
        o_ref, lse_ref = attention_ref(q.double(), k.double(), v.double(), causal=True,
                                       learnable_sink=sink.double())
    check_close("o", o, o_lowp, o_ref)
    check_close("lse", lse, lse_lowp, lse_ref)


@pytest.mark.parametrize("is_causal, seqlen_q, seqlen_k",
                         [(False, 13, 21), (True, 21, 21), (True, 13, 21), (True, 21, 13)])
def test_sdpa_drop_in(is_causal, seqlen_q, seqlen_k):
    """longflash.scaled_dot_product_attention against PyTorch's, in float64, GQA, value head
    dim 40 for query head dim 24 (PyTorch's top-left causal, every seqlen order)."""
    gen = torch.Generator().manual_seed(4)
    query = torch.randn(2, 6, seqlen_q, 24, generator=gen, dtype=torch.float64)
    key = torch.randn(2, 3, seqlen_k, 24, generator=gen, dtype=torch.float64)
    value = torch.randn(2, 3, seqlen_k, 40, generator=gen, dtype=torch.float64)
    got = longflash.scaled_dot_product_attention(query, key, value, is_causal=is_causal,
                                                 enable_gqa=True)
    want = torch_sdpa(query, key, value, is_causal=is_causal, enable_gqa=True)
    assert got.shape == want.shape == (2, 6, seqlen_q, 40)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_compile_fullgraph():
    """Captured whole (the fake implementation gives o v's head dim), without graph breaks."""
    torch._dynamo.reset()
    q, k, v, do = make_inputs((1, 17, 17, 2, 2, 24, 16), torch.float32)
    fn = torch.compile(lambda q, k, v: longflash.attention(q, k, v, causal=True,
                                                           backend="torch"), fullgraph=True)
    o = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    o_ref = longflash.attention(q, k, v, causal=True, backend="torch")
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close((dq, dk, dv), torch.autograd.grad(o_ref, (q, k, v), do))


def _caches(batch, capacity, nheads_kv, headdim, headdim_v, page_size, gen,
            dtype=torch.float16):
    """k_cache, v_cache and a block table: contiguous caches and None, or with page_size,
    paged caches whose pages are shuffled, and the table. logical() reads either back as
    (batch, capacity, nheads_kv, head dim)."""
    k, v = (torch.randn(batch, capacity, nheads_kv, d, generator=gen).to(dtype)
            for d in (headdim, headdim_v))
    if not page_size:
        return k, v, None
    n_pages = batch * capacity // page_size
    perm = torch.randperm(n_pages, generator=gen)
    pages = [torch.empty(n_pages, page_size, *x.shape[2:], dtype=x.dtype) for x in (k, v)]
    for x, paged in zip((k, v), pages):
        paged[perm] = x.reshape(n_pages, page_size, *x.shape[2:])
    return (*pages, perm.view(batch, -1).to(torch.int32))


def logical(cache, table):
    if table is None:
        return cache
    return cache[table.long()].reshape(table.shape[0], -1, *cache.shape[2:])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [0, 8], ids=["contiguous", "paged8"])
def test_kvcache(backend, page_size):
    """attention_with_kvcache over values of head dim 16 for keys of 40 (the decoding kernels
    take both as they are: no padding): new keys and values appended in place, per-sequence
    lengths, GQA, causal, three splits and their merge; against the reference over the keys in
    use of each sequence."""
    check_kvcache(backend, page_size, [30, 45], 48, (40, 16), num_splits=3)


def check_kvcache(backend, page_size, lengths, capacity, headdims, num_splits=0,
                  dtype=torch.float16, device="cpu"):
    gen = torch.Generator().manual_seed(7)
    batch, nheads, nheads_kv, new, (headdim, headdim_v) = len(lengths), 8, 2, 2, headdims
    q, k_new = (torch.randn(batch, new, h, headdim, generator=gen).to(device, dtype)
                for h in (nheads, nheads_kv))
    v_new = torch.randn(batch, new, nheads_kv, headdim_v, generator=gen).to(device, dtype)
    k_cache, v_cache, table = (None if x is None else x.to(device) for x in _caches(
        batch, capacity, nheads_kv, headdim, headdim_v, page_size, gen, dtype))
    o, lse = longflash.attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, block_table=table, causal=True, return_lse=True,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        backend=backend, num_splits=num_splits)
    assert o.shape == (batch, new, nheads, headdim_v)
    keys, values = logical(k_cache, table), logical(v_cache, table)
    for b, n in enumerate(lengths):
        assert torch.equal(keys[b, n:n + new], k_new[b]) and torch.equal(values[b, n:n + new],
                                                                          v_new[b])
        one = slice(b, b + 1)
        args = (q[one], keys[one, :n + new], values[one, :n + new])
        lowp = attention_ref(*args, causal=True, upcast=False)
        ref = attention_ref(*(x.double() for x in args), causal=True)
        for name, got, low, r in zip(("o", "lse"), (o[one], lse[one]), lowp, ref):
            check_close(name, got, low, r)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels run under TRITON_INTERPRET=1")
def test_kvcache_rotary_triton_is_torch():
    """The append kernel's rotary embedding with values of another head dim: the Triton
    backend's step (append, split, merge) equals the PyTorch path's (tested against the
    reference in test_kvcache)."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 4, 32, generator=gen).half()
    k_new = torch.randn(2, 1, 2, 32, generator=gen).half()
    v_new = torch.randn(2, 1, 2, 24, generator=gen).half()
    caches = _caches(2, 40, 2, 32, 24, 0, gen)[:2]
    angles = torch.arange(40.0)[:, None] / 10000 ** (torch.arange(8.0) / 8)  # rotary dim 16
    outs = []
    for backend in ("torch", "triton"):
        k_cache, v_cache = (c.clone() for c in caches)
        o = longflash.attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=33, causal=True, backend=backend,
            rotary_cos=angles.cos(), rotary_sin=angles.sin(), num_splits=2)
        outs.append((o, k_cache, v_cache))
    for name, a, b in zip(("o", "k_cache", "v_cache"), *outs):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_split_kv_route(backend, monkeypatch):
    """attention_varlen's split-KV route (equal short queries over packed keys, no gradient)
    with values of another head dim."""
    import longflash.interface as interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 64)
    gen = torch.Generator().manual_seed(9)
    lengths_k = [70, 90]
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 160], dtype=torch.int32)
    q = torch.randn(4, 4, 32, generator=gen).half()
    k = torch.randn(160, 2, 32, generator=gen).half()
    v = torch.randn(160, 2, 48, generator=gen).half()
    with torch.no_grad():
        o, lse = longflash.attention_varlen(q, k, v, cu_q, cu_k, 2, max(lengths_k), causal=True,
                                            return_lse=True, backend=backend)
    lowp = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    ref = attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True)
    assert o.shape == (4, 4, 48)
    for name, got, low, r in zip(("o", "lse"), (o, lse), lowp, ref):
        check_close(name, got, low, r)


def test_errors_name_the_argument():
    q, k, v, _ = make_inputs((1, 4, 6, 2, 2, 8, 16), torch.float32)
    with pytest.raises(ValueError, match="headdim of v must be between 1 and 256"):
        longflash.attention(q, k, torch.zeros(1, 6, 2, 300))
    with pytest.raises(ValueError, match="k and v must agree in"):
        longflash.attention(q, k, v[:, :5])
    # decoding takes latents up to 512 (MLA absorbed: qv, tests/test_mla_decoding.py)
    with pytest.raises(ValueError, match="headdim of v must be between 1 and 512"):
        longflash.attention_with_kvcache(q, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 600),
                                         cache_seqlens=4)
    with pytest.raises(ValueError, match=r"\(\.\.\., 16\) \(the caches' head dims\)"):
        longflash.attention_with_kvcache(q, torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 16),
                                         k[:, :1], torch.zeros(1, 1, 2, 8), cache_seqlens=4)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="v has another head dim .* paged cache here"):
        longflash.attention_varlen(q[0], torch.zeros(2, 4, 2, 8), torch.zeros(2, 4, 2, 16), cu,
                                   cu, 4, 4, block_table=table)
