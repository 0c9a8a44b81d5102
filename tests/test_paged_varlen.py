"""attention_varlen with block_table: packed queries over paged keys (FlashAttention-2's
flash_attn_varlen_func(block_table=...), chunked prefill into a paged KV cache).

The same keys, once packed as attention_varlen takes them and once scattered over the shuffled
pages of a cache, give the same output, lse and gradients, bit for bit: with a gradient the
paged call packs the keys in use and runs the same kernel; without one, the same kernel reads
the pages in place through the block table, or, for equal short queries on the Triton
backend, the split-KV kernel does (the packed call's route too, over one-token pages). The packed call itself is checked against the float64
reference in test_variants.
"""

import pytest
import torch

import longflash
from longflash import flash_attn as fa
from conftest import INTERPRET
from test_kvcache import route_small, seq_keys  # noqa: F401 (route_small: a fixture)

BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])
# fp32 and fp16 on the PyTorch path, fp16 on the Triton kernels: the interpreter runs the same
# loads and loops for both (the float8 tests below take fp32 there), and it is CI's slowest part
BACKEND_DTYPES = [pytest.param(b, d, id=f"{b}-{n}") for b in BACKENDS
                  for d, n in ((torch.float32, "fp32"), (torch.float16, "fp16"))
                  if not (b == "triton" and d == torch.float32)]


def make_paged(lengths_q, lengths_k, nheads, nheads_kv, headdim, page_size, dtype, seed=0):
    """q (total_q, H, D), the packed k, v (total_k, Hkv, D), cu_seqlens_q/k, and the same keys
    in a paged cache (num_pages, page_size, Hkv, D) with a shuffled block_table, whose other
    slots (and a few spare pages) hold noise."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    def offsets(lengths):
        return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    q = randn(int(cu_q[-1]), nheads, headdim)
    k, v = (randn(int(cu_k[-1]), nheads_kv, headdim) for _ in range(2))
    batch, max_pages = len(lengths_k), -(-max(lengths_k + [1]) // page_size)
    num_pages = batch * max_pages + 3
    table = torch.randperm(num_pages, generator=gen)[:batch * max_pages].view(
        batch, max_pages).to(torch.int32)
    k_pages, v_pages = (randn(num_pages, page_size, nheads_kv, headdim) for _ in range(2))
    for b, n in enumerate(lengths_k):
        pos = torch.arange(n)
        rows = int(cu_k[b]) + pos
        k_pages[table[b, pos // page_size].long(), pos % page_size] = k[rows]
        v_pages[table[b, pos // page_size].long(), pos % page_size] = v[rows]
    return q, k, v, cu_q, cu_k, k_pages, v_pages, table


def gathered(pages, table, cu_k):
    """The packed (total_k, ...) rows of a paged tensor (for gradients)."""
    return torch.cat([seq_keys(pages, table, b, int(cu_k[b + 1] - cu_k[b]))[0]
                      for b in range(table.shape[0])])


@pytest.mark.parametrize("page_size", [4, 16], ids=["pages4", "pages16"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 2), softcap=2.0), {}],
                         ids=["causal", "window-softcap", "full"])
@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
def test_paged_keys_give_what_packed_keys_give(backend, dtype, kw, page_size):
    """Output, lse and gradients (the pages' gradients at the slots in use; zero elsewhere)
    equal the packed call's, with sequences of no keys, of no queries, and longer than a
    page, and GQA."""
    lengths_q, lengths_k = [3, 1, 0, 6, 2], [7, 0, 9, 21, 2]
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        lengths_q, lengths_k, 4, 2, 16, page_size, dtype)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    runs = []
    for keys in ((k, v), (k_pages, v_pages)):
        leaves = [x.detach().clone().requires_grad_() for x in (q, *keys)]
        paged = keys[0] is k_pages
        o, lse = longflash.attention_varlen(*leaves, *args, return_lse=True, backend=backend,
                                            block_table=table if paged else None, **kw)
        (o.float().square().sum() + lse.sum()).backward()
        grads = [leaf.grad for leaf in leaves]
        if paged:  # the slots in use, packed; zero elsewhere
            in_use = torch.zeros(k_pages.shape[:2], dtype=torch.bool)
            for b, n in enumerate(lengths_k):
                pos = torch.arange(n)
                in_use[table[b, pos // page_size].long(), pos % page_size] = True
            assert not any(g[~in_use].any() for g in grads[1:])
            grads[1:] = [gathered(g, table, cu_k) for g in grads[1:]]
        runs.append((o, lse, *grads))
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("page_size", [5, 16], ids=["pages5", "pages16"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, 2), softcap=2.0,
                                                        alibi_slopes=torch.rand(4))],
                         ids=["causal", "window-softcap-alibi"])
@pytest.mark.parametrize("backend, dtype", BACKEND_DTYPES)
def test_without_gradient_the_pages_are_read_in_place(backend, dtype, kw, page_size,
                                                      monkeypatch):
    """No gradient: the kernels read the keys through block_table (no packed copy), from pages
    whose heads are a strided view of a larger cache; output and lse equal the packed call's,
    bit for bit."""
    from longflash import interface
    lengths_q, lengths_k = [3, 1, 0, 6, 20], [7, 0, 9, 21, 40]
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        lengths_q, lengths_k, 4, 2, 16, page_size, dtype)
    # the pages as heads 1 and 3 of a cache of 4 KV heads: strided heads, offset start
    k_wide, v_wide = (torch.zeros(*x.shape[:2], 4, x.shape[3], dtype=dtype)
                      for x in (k_pages, v_pages))
    k_wide[:, :, 1::2], v_wide[:, :, 1::2] = k_pages, v_pages
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    want = longflash.attention_varlen(q, k, v, *args, return_lse=True, backend=backend, **kw)
    monkeypatch.setattr(interface, "_gather_pages", None)  # a packed copy would fail
    got = longflash.attention_varlen(q, k_wide[:, :, 1::2], v_wide[:, :, 1::2], *args,
                                     return_lse=True, backend=backend, block_table=table, **kw)
    for name, a, b in zip(("o", "lse"), want, got):
        assert torch.equal(a, b), name


@pytest.mark.skipif(not INTERPRET, reason="the split-KV route is the Triton backend's")
def test_paged_decoding_reads_the_pages_in_place(route_small, monkeypatch):  # noqa: F811
    """Equal short queries without a gradient: the split-KV kernel over the caller's pages
    and block_table (no copy), giving what the packed keys give."""
    from longflash import kvcache
    tables, route = [], kvcache._forward
    monkeypatch.setattr(kvcache, "_forward",
                        lambda *a, **kw: tables.append(a[4]) or route(*a, **kw))
    lengths_k = [30, 21, 45]
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        [1, 1, 1], lengths_k, 8, 2, 32, 8, torch.float32)
    packed = longflash.attention_varlen(q, k, v, cu_q, cu_k, 1, 45, causal=True,
                                        return_lse=True)
    paged = longflash.attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 1, 45, causal=True,
                                       return_lse=True, block_table=table)
    assert len(route_small) == 2 and route_small[1].tolist() == lengths_k
    assert tables[1] is table
    for a, b in zip(packed, paged):
        assert torch.equal(a, b)


def float8_pages(k_pages, v_pages, table, cu_k, cache_dtype, dtype, seed=4):
    """The pages in float8, (batch, nheads_kv) and (nheads_kv,) scales, and the keys and
    values they stand for, packed, in dtype: entries times scales in float32, rounded."""
    gen = torch.Generator().manual_seed(seed)
    batch, nheads_kv = table.shape[0], k_pages.shape[2]
    scales = torch.rand(batch, nheads_kv, generator=gen) + 0.5, torch.rand(nheads_kv,
                                                                           generator=gen) + 0.5
    pages = [x.float().to(cache_dtype) for x in (k_pages, v_pages)]
    seq = torch.repeat_interleave(torch.arange(batch), cu_k.diff().long())
    packed = [(gathered(x, table, cu_k).float() * s.expand(batch, nheads_kv)[seq][..., None])
              .to(dtype) for x, s in zip(pages, scales)]
    return pages, scales, packed


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float8_pages_give_what_their_dequantized_keys_give(backend, dtype, cache_dtype):
    """Float8 pages with k_descale, v_descale and a gradient (a quantized cache under a
    differentiated call): output, lse and q's gradient equal the packed call over the keys and
    values they stand for, bit for bit (the backward kernels take a dequantized packed copy),
    with the packed-keys case's empty sequences, windows and GQA."""
    lengths_q, lengths_k = [3, 1, 0, 6, 2], [7, 0, 9, 21, 2]
    q, _, _, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        lengths_q, lengths_k, 4, 2, 16, 4, dtype)
    pages, scales, packed = float8_pages(k_pages, v_pages, table, cu_k, cache_dtype, dtype)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    runs = []
    for keys, kw in ((packed, {}), (pages, dict(block_table=table, k_descale=scales[0],
                                                   v_descale=scales[1]))):
        leaf = q.detach().clone().requires_grad_()
        o, lse = longflash.attention_varlen(leaf, *keys, *args, return_lse=True,
                                            backend=backend, causal=True, window_size=(9, -1),
                                            **kw)
        (o.float().square().sum() + lse.sum()).backward()
        runs.append((o, lse, leaf.grad))
    for name, a, b in zip(("o", "lse", "dq"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("scales", ["both", "keys", "none"])
@pytest.mark.parametrize("kw", [dict(causal=True, window_size=(9, -1)),
                                dict(softcap=2.0, alibi_slopes=torch.rand(4) + 0.1)],
                         ids=["causal-window", "softcap-alibi"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float8_pages_are_read_in_place(backend, dtype, cache_dtype, kw, scales):
    """Float8 pages without a gradient (chunked prefill over a quantized cache), with empty
    sequences, GQA and pages of 5 slots: check_float8_pages_in_place."""
    check_float8_pages_in_place(backend, dtype, cache_dtype, kw, scales, [3, 1, 0, 6, 20],
                                [7, 0, 9, 21, 40], 4, 2, 16, 5)


def check_float8_pages_in_place(backend, dtype, cache_dtype, kw, scales, lengths_q, lengths_k,
                                nheads, nheads_kv, headdim, page_size, device="cpu"):
    """The kernels read the 8-bit tiles through block_table (no packed copy) and apply
    k_descale, v_descale (scales "both", "keys": the keys' alone, or "none": 1) to the scores
    and the output; output and lse within the tolerance rule of the float64 reference over the
    keys and values the pages stand for, sequence by sequence. kw: attention_varlen's keywords
    (alibi_slopes (nheads,))."""
    from unittest import mock
    from conftest import check_close
    from longflash import interface
    q, _, _, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        lengths_q, lengths_k, nheads, nheads_kv, headdim, page_size, dtype)
    pages, descale, _ = float8_pages(k_pages, v_pages, table, cu_k, cache_dtype, dtype)
    descale = {"both": descale, "keys": (descale[0], None), "none": (None, None)}[scales]
    q, cu_q, cu_k, table, *pages = (x.to(device) for x in (q, cu_q, cu_k, table, *pages))
    descale = [None if x is None else x.to(device) for x in descale]
    kw = {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in kw.items()}
    with mock.patch.object(interface, "_gather_pages", None):  # a packed copy would fail
        o, lse = longflash.attention_varlen(q, *pages, cu_q, cu_k, max(lengths_q),
                                            max(lengths_k), return_lse=True, backend=backend,
                                            block_table=table, k_descale=descale[0],
                                            v_descale=descale[1], **kw)
    ones = torch.ones(len(lengths_k), nheads_kv, dtype=torch.float64, device=device)
    for b, n_k in enumerate(lengths_k):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        # (1, n_k, Hkv, D) the keys and values sequence b's pages stand for, in float64
        kv = [seq_keys(x, table.cpu(), b, n_k).to(device).double()
              * (ones if s is None else s.double().expand_as(ones))[b, :, None]
              for x, s in zip(pages, descale)]
        slopes = kw.get("alibi_slopes")
        ref_kw = dict(kw, alibi_slopes=None if slopes is None else slopes[None])
        ref = longflash.attention_ref(q[None, rows].double(), *kv, **ref_kw)
        low = longflash.attention_ref(q[None, rows], *(x.to(dtype) for x in kv), upcast=False,
                                      **ref_kw)
        check_close(f"o[{b}]", o[None, rows], low[0], ref[0])
        check_close(f"lse[{b}]", lse[None, :, rows], low[1], ref[1])


@pytest.mark.skipif(not INTERPRET, reason="the split-KV route is the Triton backend's")
def test_float8_paged_decoding_reads_the_pages_in_place(route_small):  # noqa: F811
    """Equal short queries over float8 pages, no gradient: the split-KV kernel reads them
    (and their scales) in place, within the tolerance rule of the float64 reference over the
    keys they stand for."""
    from conftest import check_close
    lengths_k = [30, 21, 45]
    q, _, _, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        [2, 2, 2], lengths_k, 8, 2, 32, 8, torch.float16)
    pages, scales, _ = float8_pages(k_pages, v_pages, table, cu_k, torch.float8_e4m3fn,
                                    torch.float64)
    o, lse = longflash.attention_varlen(q, *pages, cu_q, cu_k, 2, 45, causal=True,
                                        return_lse=True, block_table=table, k_descale=scales[0],
                                        v_descale=scales[1])
    assert len(route_small) == 1 and route_small[0].tolist() == lengths_k
    _, _, packed = float8_pages(k_pages, v_pages, table, cu_k, torch.float8_e4m3fn,
                                torch.float64)
    for b in range(3):
        rows, keys = slice(2 * b, 2 * b + 2), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = longflash.attention_ref(q[None, rows].double(), packed[0][None, keys],
                                      packed[1][None, keys], causal=True)
        low = longflash.attention_ref(q[None, rows], packed[0][None, keys].half(),
                                      packed[1][None, keys].half(), causal=True, upcast=False)
        check_close(f"o[{b}]", o[None, rows], low[0], ref[0])
        check_close(f"lse[{b}]", lse[None, :, rows], low[1], ref[1])


def test_flash_attn_varlen_func_block_table():
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        [2, 5], [9, 13], 4, 4, 16, 4, torch.float32)
    out, lse, probs = fa.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 13, 0.0,
                                                None, True, return_attn_probs=True,
                                                block_table=table)
    want = longflash.attention_varlen(q, k, v, cu_q, cu_k, 5, 13, causal=True, return_lse=True)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1]) and probs is None


def test_compiled_call_runs_eagerly():
    """torch.compile (without fullgraph) breaks the graph at the paged call and runs it
    eagerly: the same output."""
    q, _, _, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        [2, 5], [9, 13], 4, 2, 16, 4, torch.float32)
    torch._dynamo.reset()

    def step(q, k, v):
        return longflash.attention_varlen(q, k, v, cu_q, cu_k, 5, 13, causal=True,
                                          backend="torch", block_table=table) * 2
    want = step(q, k_pages, v_pages)
    assert torch.equal(torch.compile(step)(q, k_pages, v_pages), want)


def _bad(**changes):
    """Paged inputs with some arguments replaced (a function of the good ones)."""
    def make():
        q, _, _, cu_q, cu_k, k_pages, v_pages, table = make_paged(
            [2, 3], [9, 6], 4, 2, 16, 4, torch.float32)
        args = dict(q=q, k=k_pages, v=v_pages, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                    max_seqlen_q=3, max_seqlen_k=9, block_table=table)
        args.update({name: change(args) for name, change in changes.items()})
        return args
    return make


ERRORS = [
    ("table-dtype", TypeError, "block_table must be an int32",
     _bad(block_table=lambda a: a["block_table"].long())),
    ("table-batch", TypeError, r"block_table must be an int32 tensor of shape \(batch=2",
     _bad(block_table=lambda a: a["block_table"][:1])),
    ("table-range", ValueError, r"block_table entries in use must lie in \[0, 9\)",
     _bad(block_table=lambda a: a["block_table"].clone().fill_(9))),
    ("beyond-capacity", ValueError, "more than block_table holds",
     _bad(block_table=lambda a: a["block_table"][:, :2])),
    ("packed-keys", ValueError, "paged cache of 4 dimensions",
     _bad(k=lambda a: a["k"][0], v=lambda a: a["v"][0])),
    ("shapes", ValueError, "k and v must have the same shape",
     _bad(v=lambda a: a["v"][:, :2])),
    ("cu-start", ValueError, "cu_seqlens_k must start at 0",
     _bad(cu_seqlens_k=lambda a: a["cu_seqlens_k"] + 1)),
    ("max-seqlen", ValueError, "max_seqlen_k = 8 is smaller",
     _bad(max_seqlen_k=lambda a: 8)),
    ("heads", ValueError, "nheads",
     _bad(q=lambda a: a["q"][:, :3])),
    ("fp8-packed", NotImplementedError, "pass block_table",
     _bad(k=lambda a: a["k"][0].to(torch.float8_e4m3fn), v=lambda a: a["v"][0].to(
         torch.float8_e4m3fn), block_table=lambda a: None,
          cu_seqlens_k=lambda a: torch.tensor([0, 2, 4], dtype=torch.int32),
          max_seqlen_k=lambda a: 2)),
    ("fp8-mixed", TypeError, "one dtype",
     _bad(k=lambda a: a["k"].to(torch.float8_e4m3fn), v=lambda a: a["v"].to(torch.float8_e5m2))),
    ("descale-not-fp8", ValueError, "k_descale dequantizes a float8 cache",
     _bad(k_descale=lambda a: 0.5)),
    ("descale-shape", TypeError, "v_descale must be a float",
     _bad(k=lambda a: a["k"].to(torch.float8_e4m3fn), v=lambda a: a["v"].to(torch.float8_e4m3fn),
          v_descale=lambda a: torch.ones(3))),
]


@pytest.mark.parametrize("name, error, match, make", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, error, match, make):
    with pytest.raises(error, match=match):
        longflash.attention_varlen(**make())
