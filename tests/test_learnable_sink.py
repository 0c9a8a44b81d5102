"""Attention sinks (`learnable_sink`, gpt-oss): one more logit per head in every row's softmax,
attending to no value. Every entry point against the float64 reference, which appends the
sink as a column of the N x N scores (`attention_ref(learnable_sink=...)`): output, lse and
the gradients of q, k, v and the sink itself, by the tolerance rule.
"""

import pytest
import torch

import longflash
from longflash import attention_ref, attention_varlen_ref
from conftest import INTERPRET, check_close, check_with_grads
from test_correctness import make_inputs
from test_variants import kwargs_for, packed, ref_kwargs, tiles_id, use_tiles

# The sink is applied to the kernels' outputs, whose backward takes its lse gradient: the
# kernels' own code paths (TMA, warp-specialized tiles) are test_variants' to cover.
BACKEND_TILES = [("torch", (16, 32)), ("torch", None)] + ([("triton", None)] if INTERPRET else [])
BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])

# (id, shape (B, Nq, Nk, H, Hkv, D), keyword arguments)
CASES = [
    ("full", (2, 29, 37, 4, 2, 16), dict()),
    # seqlen_q > seqlen_k: the first rows see no key (o = 0, lse = the sink)
    ("causal-empty-rows", (1, 45, 31, 4, 1, 24), dict(causal=True)),
    ("all", (2, 47, 53, 4, 2, 24), dict(causal=True, window_size=(12, -1), alibi=(2, 4),
                                       softcap=1.0, dropout_p=0.2, seed=7)),
]


def make_sink(nheads, dtype, device="cpu"):
    """Sinks on the scale of the scores, one far above them (that head attends mostly to it)."""
    sink = torch.randn(nheads, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    sink[0] = 6.0
    return sink.to(device=device, dtype=dtype).requires_grad_()


def check(fn, ref_fn, q, k, v, sink, do, dlse):
    """o, lse and the gradients of q, k, v and the sink against the float64 reference."""
    check_with_grads(fn, ref_fn, (q, k, v, sink), ("q", "k", "v", "sink"), do, dlse)


@pytest.mark.parametrize("backend, tiles", BACKEND_TILES,
                         ids=[tiles_id(*bt) for bt in BACKEND_TILES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("shape, kw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_attention_with_sink(backend, tiles, dtype, shape, kw, monkeypatch):
    use_tiles(monkeypatch, tiles)
    check_attention(shape, dtype, kw, backend)


def test_bfloat16_torch_path():
    check_attention(CASES[-1][1], torch.bfloat16, CASES[-1][2], "torch")


def check_attention(shape, dtype, kw, backend, device="cpu"):
    kw = kwargs_for(kw, device)
    q, k, v, do = make_inputs(shape, dtype, device=device)
    sink = make_sink(shape[3], torch.float32, device)
    dlse = torch.randn(shape[0], shape[3], shape[1],
                       generator=torch.Generator().manual_seed(6)).to(device)
    check(lambda q, k, v, s: longflash.attention(q, k, v, return_lse=True, backend=backend,
                                                 learnable_sink=s, **kw),
          lambda q, k, v, s, **r: attention_ref(q, k, v, learnable_sink=s, **ref_kwargs(kw), **r),
          q, k, v, sink, do, dlse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [dict(causal=True),
                                dict(causal=True, window_size=(6, -1), alibi=(3, 4), softcap=1.0,
                                     dropout_p=0.2, seed=11)], ids=["causal", "all"])
def test_varlen_with_sink(backend, kw):
    """Packed sequences, one of them empty; the same sinks in every sequence."""
    kw = kwargs_for(kw)
    (q, k, v), cu_q, cu_k, max_q, max_k = packed([17, 0, 40], [23, 5, 31])
    sink = make_sink(q.shape[1], torch.float32)
    do = torch.randn_like(q)
    dlse = torch.randn(q.shape[1], q.shape[0])
    check(lambda q, k, v, s: longflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                                        return_lse=True, backend=backend,
                                                        learnable_sink=s, **kw),
          lambda q, k, v, s, **r: attention_varlen_ref(q, k, v, cu_q, cu_k, learnable_sink=s,
                                                       **ref_kwargs(kw), **r),
          q, k, v, sink, do, dlse)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("route", ["kvcache", "split-kv"])
def test_decoding_with_sink(backend, route, monkeypatch):
    """attention_with_kvcache with an append, and attention()'s split-KV route for short
    queries over long keys (taken here from 64 keys), against the reference over the keys in
    use; the sink's gradient flows there too (inference in q, k, v)."""
    import longflash.interface as interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 64)
    gen = torch.Generator().manual_seed(2)
    batch, nheads, nheads_kv, headdim, length, new = 2, 8, 2, 32, 70, 2
    q = torch.randn(batch, new, nheads, headdim, generator=gen).half()
    k_cache = torch.randn(batch, 80, nheads_kv, headdim, generator=gen).half()
    v_cache = torch.randn(batch, 80, nheads_kv, headdim, generator=gen).half()
    k_new, v_new = torch.randn(2, batch, new, nheads_kv, headdim, generator=gen).half()
    sink = make_sink(nheads, torch.float32)
    if route == "kvcache":
        o, lse = longflash.attention_with_kvcache(
            q, k_cache, v_cache, k_new, v_new, cache_seqlens=length, causal=True,
            return_lse=True, backend=backend, learnable_sink=sink)
    else:
        k_cache[:, length:length + new], v_cache[:, length:length + new] = k_new, v_new
        o, lse = longflash.attention(q, k_cache[:, :length + new], v_cache[:, :length + new],
                                     causal=True, return_lse=True, backend=backend,
                                     learnable_sink=sink)
    keys, values = k_cache[:, :length + new], v_cache[:, :length + new]
    (dsink,) = torch.autograd.grad((o.float().sum() + lse.sum()), (sink,))
    low = attention_ref(q, keys, values, causal=True, learnable_sink=sink, upcast=False)
    s64 = sink.detach().double().requires_grad_()
    ref = attention_ref(q.double(), keys.double(), values.double(), causal=True,
                        learnable_sink=s64)
    (dsink_ref,) = torch.autograd.grad(ref[0].sum() + ref[1].sum(), (s64,))
    (dsink_low,) = torch.autograd.grad(low[0].float().sum() + low[1].sum(), (sink,))
    for name, a, b, r in zip(("o", "lse", "dsink"), (o, lse, dsink), (*low, dsink_low),
                             (*ref, dsink_ref)):
        check_close(name, a, b, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_infinity_sink_is_no_sink(backend):
    """A sink of -inf changes nothing, bit for bit: rows without keys keep o = 0, lse = -inf."""
    q, k, v, _ = make_inputs((1, 45, 31, 4, 1, 24), torch.float16)
    sink = torch.full((4,), float("-inf"))
    plain = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    sunk = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend,
                               learnable_sink=sink)
    for a, b in zip(plain, sunk):
        assert torch.equal(a, b)


def test_sink_gradcheck_float64():
    """Finite differences in q, k, v and the sink on the blockwise path (float64)."""
    q, k, v, _ = make_inputs((1, 9, 7, 2, 1, 4), torch.float64)
    sink = torch.tensor([0.3, -1.2], dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, sink):
        return longflash.attention(q, k, v, causal=True, return_lse=True, backend="torch",
                                   learnable_sink=sink)
    assert torch.autograd.gradcheck(fn, (q, k, v, sink))


def test_sink_under_torch_compile():
    """fullgraph=True: the sink is plain PyTorch ops around the attention op."""
    q, k, v, _ = make_inputs((1, 21, 21, 2, 1, 16), torch.float32)
    sink = torch.tensor([0.5, 2.0])
    fn = lambda q, k, v, s: longflash.attention(q, k, v, causal=True, learnable_sink=s,  # noqa: E731
                                                backend="torch")
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, sink), fn(q, k, v, sink), atol=1e-6, rtol=1e-6)


q0, k0, v0, _ = make_inputs((2, 9, 11, 4, 2, 16), torch.float32)
BAD = [
    ("shape", torch.zeros(2), ValueError),
    ("batched", torch.zeros(2, 4), ValueError),
    ("integer", torch.zeros(4, dtype=torch.int64), TypeError),
    ("list", [0.0] * 4, TypeError),
    ("device", torch.zeros(4, device="meta"), ValueError),
]


@pytest.mark.parametrize("sink, exc", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_sink(sink, exc):
    with pytest.raises(exc, match="learnable_sink"):
        longflash.attention(q0, k0, v0, learnable_sink=sink)
    k_cache = torch.zeros(2, 16, 2, 16)
    with pytest.raises(exc, match="learnable_sink"):
        longflash.attention_with_kvcache(q0, k_cache, k_cache.clone(), k0[:, :1], v0[:, :1],
                                         cache_seqlens=3, learnable_sink=sink)
    assert k_cache.abs().sum() == 0  # refused before the append wrote anything
