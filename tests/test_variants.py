"""Attention variants (sliding window, ALiBi, softcap, dropout, packed varlen) against the
float64 reference, forward and gradients, on the blockwise path and the Triton kernels.

Dropout is compared exactly: every implementation draws the same counter-based mask for
the same seed (`_common.dropout_uniform`), so the reference materializes it and the
tolerance rule applies as for any other variant.
"""

import random

import pytest
import torch

import longflash
from longflash import _common, attention_ref, attention_varlen_ref, blockwise
from conftest import INTERPRET, check_close
from test_correctness import KERNEL_FUNCTIONS, force_configs, make_inputs, run

BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])
# The blockwise path with several tile shapes (so short sequences span many blocks), and
# the Triton kernels with their own (interpreter) tiles, with pointer loads, with the TMA
# candidates' tensor descriptors ("tma"), and with the warp-specialized candidates' code paths
# ("ws": everything by descriptor, one loop, every block masked, dK/dV's GQA loop folded into it;
# the interpreter runs them unspecialized), with dK/dV in two passes ("split"), and with dQ
# added by atomics in dK/dV, no dQ kernel ("atomic": pointer atomics; "atomic-tma": a tensor
# descriptor's reductions; "split-atomic": in dK's pass), and the forward's key loop
# software-pipelined by one block ("pipe").
TRIALS = ("split", "atomic", "atomic-tma", "split-atomic", "pipe")  # use_trial
TRITON_TILES = ["tma", "ws", *TRIALS]
BACKEND_TILES = [("torch", (16, 32)), ("torch", (32, 16)), ("torch", None)] + \
    ([("triton", None)] + [("triton", tiles) for tiles in TRITON_TILES] if INTERPRET else [])
VARLEN_BACKENDS = BACKENDS + ([f"triton-{tiles}" for tiles in TRITON_TILES] if INTERPRET else [])


def use_tma(monkeypatch, ws=False, varlen=False):
    """Launch the Triton kernels with tensor descriptors (the interpreter's tile, USE_TMA), and
    with ws their warp-specialized code paths (WARP_SPECIALIZE) where the launcher would choose
    them: not dQ's for packed sequences (flash_triton.backward)."""
    from longflash.flash_triton import _INTERPRET_CONFIG, TMA, WS, _config
    force_configs(monkeypatch, {
        kernel: _config((*_INTERPRET_CONFIG, TMA, *([WS] if ws and not (varlen and kernel == "dq")
                                                   else [])))
        for kernel in KERNEL_FUNCTIONS})


def use_trial(monkeypatch, tiles):
    """A tuning sweep trial (TRIALS), forced on its kernel. dK/dV's: "split" (flash_triton.SPLIT):
    per key block one program accumulates dV, another dK, with tensor descriptors; "atomic"
    (ATOMIC): dK/dV adds each block pair's dQ into an fp32 accumulator and no dQ kernel runs
    ("atomic": by pointer atomics, "atomic-tma": by a tensor descriptor's reductions,
    "split-atomic": both). The forward's: "pipe" (PIPE): the key loop software-pipelined by one
    block (the next block's q.k before this block's softmax), tiles by tensor descriptors."""
    from longflash.flash_triton import _INTERPRET_CONFIG, ATOMIC, PIPE, SPLIT, TMA, _config
    kernel, flags = {"split": ("dkdv", (TMA, SPLIT)), "atomic": ("dkdv", (ATOMIC,)),
                     "atomic-tma": ("dkdv", (TMA, ATOMIC)),
                     "split-atomic": ("dkdv", (TMA, SPLIT, ATOMIC)),
                     "pipe": ("fwd", (TMA, PIPE))}[tiles]
    force_configs(monkeypatch, {kernel: _config((*_INTERPRET_CONFIG, *flags))})
    if ATOMIC in flags:  # no dQ kernel may run: a launch of this one fails
        from longflash import flash_triton
        monkeypatch.setattr(flash_triton, "_attn_bwd_dq", None)

# (id, shape (B, Nq, Nk, H, Hkv, D), keyword arguments)
CASES = [
    ("window8-4", (1, 45, 61, 2, 1, 16), dict(window_size=(8, 4))),
    ("window-left-causal", (1, 61, 45, 2, 2, 16), dict(causal=True, window_size=(10, -1))),
    ("window-right-only", (1, 37, 37, 2, 1, 16), dict(window_size=(-1, 3))),
    ("window0-0", (1, 23, 29, 2, 2, 16), dict(window_size=(0, 0))),
    ("alibi-heads", (2, 29, 33, 4, 2, 16), dict(alibi=(4,))),
    ("alibi-batch-causal", (2, 33, 29, 2, 2, 16), dict(causal=True, alibi=(2, 2))),
    ("softcap", (1, 31, 37, 2, 1, 32), dict(softcap=0.5)),
    ("dropout", (1, 33, 41, 2, 1, 16), dict(dropout_p=0.3, seed=1234)),  # "all": 2 sequences
    ("all", (2, 47, 53, 2, 1, 24), dict(causal=True, window_size=(12, -1), alibi=(2, 2),
                                       softcap=1.0, dropout_p=0.2, seed=7)),
]


def kwargs_for(kw, device="cpu"):
    kw = dict(kw)
    if "alibi" in kw:
        shape = kw.pop("alibi")
        kw["alibi_slopes"] = torch.rand(shape, generator=torch.Generator().manual_seed(3),
                                        dtype=torch.float32).to(device) * 0.5
    return kw


def ref_kwargs(kw):
    return {k: v for k, v in kw.items() if k not in ("generator", "deterministic")}


def tiles_id(backend, tiles):
    return f"{backend}-{tiles}" if tiles in TRITON_TILES else \
        f"{backend}-{tiles[0]}x{tiles[1]}" if tiles else backend


def use_tiles(monkeypatch, tiles):
    """A BACKEND_TILES entry's tiles: the blockwise path's (BLOCK_M, BLOCK_N), or the Triton
    kernels' TRITON_TILES code paths (None: the defaults)."""
    if tiles in TRIALS:
        use_trial(monkeypatch, tiles)
    elif tiles in ("tma", "ws"):
        use_tma(monkeypatch, ws=tiles == "ws")
    elif tiles:
        monkeypatch.setattr(blockwise, "BLOCK_M", tiles[0])
        monkeypatch.setattr(blockwise, "BLOCK_N", tiles[1])


# fp32 and fp16 on every path but the sweep's trials (TRIALS), which run fp32 only: they
# change a loop's structure, not its precision, and the interpreter is CI's slowest part. For
# the same reason the trials skip the cases whose score terms "all" has too (softcap, ALiBi per
# head): the windows' block ranges, per-batch ALiBi and dropout each keep a case of their own.
TRIAL_CASES = {"window8-4", "window-left-causal", "window-right-only", "window0-0",
               "alibi-batch-causal", "dropout", "all"}
RUNS = [(backend, tiles, dtype, case) for backend, tiles in BACKEND_TILES
        for dtype in (torch.float32, torch.float16) for case in CASES
        if not (tiles in TRIALS and (dtype == torch.float16 or case[0] not in TRIAL_CASES))]


@pytest.mark.parametrize("backend, tiles, dtype, shape, kw", [(*r[:3], *r[3][1:]) for r in RUNS],
                         ids=[f"{c[0]}-{tiles_id(b, t)}-{'fp32' if d == torch.float32 else 'fp16'}"
                              for b, t, d, c in RUNS])
def test_variant_against_reference(backend, tiles, dtype, shape, kw, monkeypatch):
    use_tiles(monkeypatch, tiles)
    check_variant(shape, dtype, kw, backend)


def test_bfloat16_variants_torch_path():
    """bf16 is not available in the Triton interpreter; the PyTorch path covers it on CPU."""
    check_variant(CASES[-1][1], torch.bfloat16, CASES[-1][2], "torch")


def check_variant(shape, dtype, kw, backend, device="cpu"):
    """Output, lse and gradients of one variant against the float64 reference (tolerance rule)."""
    kw = kwargs_for(kw, device)
    q, k, v, do = make_inputs(shape, dtype, device=device)
    got = run(lambda *x: longflash.attention(*x, return_lse=True, backend=backend, **kw),
              q, k, v, do)
    lowp = run(lambda *x: attention_ref(*x, upcast=False, **ref_kwargs(kw)), q, k, v, do)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = run(lambda *x: attention_ref(*x, **ref_kwargs(kw)), *x64, do.double())
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), got, lowp, ref):
        check_close(name, a, b, r)


# ----------------------------------------------------------------------------- block ranges

def test_block_ranges_against_brute_force():
    """Skipped blocks are invisible to every row; unmasked blocks are visible to every row."""
    rng = random.Random(0)
    for _ in range(400):
        nq, nk = rng.randint(1, 70), rng.randint(1, 70)
        bm, bn = rng.choice([4, 8, 16]), rng.choice([4, 8, 16])
        left, right = rng.choice([-1, 0, 3, 17]), rng.choice([-1, 0, 5, 30])
        vis = _common.visible(torch.arange(nq)[:, None], torch.arange(nk)[None, :], nq, nk,
                              left, right)
        for start_m in range(0, nq, bm):
            rows = vis[start_m:start_m + bm]
            lo, mid_lo, mid_hi, hi = _common.key_range(start_m, bm, bn, nq, nk, left, right)
            assert lo <= mid_lo <= mid_hi and lo % bn == mid_lo % bn == mid_hi % bn == 0
            assert not rows[:, :lo].any() and not rows[:, hi:].any()
            assert rows[:, mid_lo:mid_hi].all()
        for start_n in range(0, nk, bn):
            cols = vis[:, start_n:start_n + bn]
            lo, mid_lo, mid_hi, hi = _common.query_range(start_n, bm, bn, nq, nk, left, right)
            assert lo <= mid_lo <= mid_hi and lo % bm == mid_lo % bm == mid_hi % bm == 0
            assert not cols[:lo].any() and not cols[hi:].any()
            assert cols[mid_lo:mid_hi].all()


@pytest.mark.skipif(not INTERPRET, reason="compares the kernels' ranges on CPU")
def test_kernel_ranges_equal_python_ranges():
    """The Triton kernels loop over exactly the blocks that _common's ranges describe."""
    from longflash import flash_triton
    rng = random.Random(1)
    for _ in range(30):
        nq, nk = rng.randint(1, 90), rng.randint(1, 90)
        bm, bn = rng.choice([16, 32]), rng.choice([16, 32])
        left, right = rng.choice([-1, 0, 3, 17]), rng.choice([-1, 0, 5, 30])
        for keys, rng_fn, step in ((True, _common.key_range, bm), (False, _common.query_range, bn)):
            got = flash_triton.block_ranges(nq, nk, left, right, bm, bn, keys, "cpu").tolist()
            n = nq if keys else nk
            want = [list(rng_fn(s, bm, bn, nq, nk, left, right)) for s in range(0, n, step)]
            assert got == want, (nq, nk, bm, bn, left, right, keys)


def test_window_visits_blocks_linear_in_n():
    """With a fixed window, the number of key blocks visited grows like N, not N^2."""
    def visited(n, window):
        return sum(-(-(hi - lo) // 16) for lo, _, _, hi in
                   (_common.key_range(m, 16, 16, n, n, *window) for m in range(0, n, 16)))
    window = [visited(n, (64, 0)) for n in (2048, 4096, 8192)]
    assert window[2] - window[1] == 2 * (window[1] - window[0])  # linear (plus a constant)
    assert visited(4096, (-1, 0)) > 3.9 * visited(2048, (-1, 0))  # causal: quadratic


# ----------------------------------------------------------------------------- dropout

def test_dropout_mask_statistics():
    u = _common.dropout_uniform(42, torch.arange(4)[:, None, None], torch.arange(256)[:, None],
                                torch.arange(256)[None, :])
    for p in (0.1, 0.5):
        dropped = (u < p).double().mean().item()
        assert abs(dropped - p) < 4 * (p * (1 - p) / u.numel()) ** 0.5, dropped
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_preserves_expectation(backend):
    """With v = 1 every output element is sum_j p_j keep_j / (1 - p): 1 in expectation."""
    q, k, _, _ = make_inputs((1, 64, 96, 2, 2, 16), torch.float32)
    v = torch.ones_like(k)
    o = longflash.attention(q.detach(), k.detach(), v, dropout_p=0.25, seed=5, backend=backend)
    assert abs(o[..., 0].mean().item() - 1.0) < 0.05
    assert o[..., 0].std().item() > 0.05  # and the mask really drops something


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_is_reproducible(backend):
    q, k, v, do = make_inputs((1, 33, 33, 2, 1, 16), torch.float32)
    a = run(lambda *x: longflash.attention(*x, return_lse=True, dropout_p=0.3, seed=9,
                                           backend=backend), q, k, v, do)
    b = run(lambda *x: longflash.attention(*x, return_lse=True, dropout_p=0.3, seed=9,
                                           backend=backend), q, k, v, do)
    c = longflash.attention(q, k, v, dropout_p=0.3, seed=10, backend=backend)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c)
    g = torch.Generator().manual_seed(0)
    d = longflash.attention(q, k, v, dropout_p=0.3, generator=g, backend=backend)
    g.manual_seed(0)
    assert torch.equal(d, longflash.attention(q, k, v, dropout_p=0.3, generator=g,
                                              backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_zero_is_bit_identical(backend):
    q, k, v, _ = make_inputs((1, 21, 21, 2, 2, 16), torch.float32)
    assert torch.equal(longflash.attention(q, k, v, dropout_p=0.0, seed=3, backend=backend),
                       longflash.attention(q, k, v, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_of_a_block_counts_from_its_offsets(backend):
    """The ops' (3,) seed, (seed, first row, first key) (ring attention's calls): a call over
    rows r0.. and keys c0.. of a larger attention drops what that attention drops there. Its
    output, lse and gradients are those of the whole attention's rows r0:r1 with the keys
    outside c0:c1 masked, against float64, forward and backward; counted from 0 they are not."""
    check_block_dropout((2, 37, 45, 4, 2, 16), (9, 30), (7, 40), torch.float16, backend)


def check_block_dropout(shape, rows, cols, dtype, backend, device="cpu"):
    """test_dropout_of_a_block_counts_from_its_offsets on one shape (B, Nq, Nk, H, Hkv, D)."""
    (r0, r1), (c0, c1), seed, p = rows, cols, 2**35 + 3, 0.3
    q, k, v, _ = make_inputs(shape, dtype, device=device)
    do = torch.randn(shape[0], r1 - r0, shape[3], shape[5], dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1)).to(device, q.dtype)
    keys = torch.zeros(shape[2], dtype=torch.bool, device=device)
    keys[c0:c1] = True

    def reference(q, k, v, upcast):
        o, lse = attention_ref(q, k, v, dropout_p=p, seed=seed, upcast=upcast, attn_mask=keys)
        o, lse = o[:, r0:r1], lse[:, :, r0:r1]
        return (o, lse, *torch.autograd.grad((o * do.to(o.dtype)).sum(), (q, k, v)))
    lowp = reference(q, k, v, False)
    ref = reference(*[x.detach().double().requires_grad_() for x in (q, k, v)], True)

    def block(row0, col0):
        blk = [x.detach()[:, a:b].contiguous() for x, (a, b) in
               zip((q, k, v), ((r0, r1), (c0, c1), (c0, c1)))]
        args = (False, shape[5] ** -0.5, backend, -1, -1, None, 0.0, p,
                torch.tensor([seed, row0, col0]))
        o, lse = torch.ops.longflash.attention_forward(*blk, *args)
        dq, dk, dv, _ = torch.ops.longflash.attention_backward(do, *blk, o, lse, None, *args)
        return o, lse, dq, dk, dv
    got = block(r0, c0)
    for name, x, low, r in zip(("o", "lse", "dq", "dk", "dv"), got, lowp, ref):
        if name in ("dk", "dv"):
            low, r = low[:, c0:c1], r[:, c0:c1]
        elif name == "dq":
            low, r = low[:, r0:r1], r[:, r0:r1]
        check_close(name, x, low, r)
    with pytest.raises(AssertionError):  # the counter from the block's own (0, 0)
        check_close("o", block(0, 0)[0], lowp[0], ref[0])


def test_sdpa_dropout():
    q, k, v, _ = make_inputs((1, 21, 21, 2, 2, 16), torch.float32)
    torch.manual_seed(0)
    a = longflash.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                               dropout_p=0.5)
    b = longflash.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    assert not torch.equal(a, b) and torch.isfinite(a).all()


# ----------------------------------------------------------------------------- varlen

def packed(lengths_q, lengths_k, nheads=4, nheads_kv=2, headdim=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q, nheads, headdim, generator=gen, dtype=torch.float64)
    k = torch.randn(total_k, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    v = torch.randn(total_k, nheads_kv, headdim, generator=gen, dtype=torch.float64)
    cu = lambda ls: torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)  # noqa: E731
    return ([x.to(dtype).requires_grad_() for x in (q, k, v)], cu(lengths_q), cu(lengths_k),
            max(lengths_q), max(lengths_k))


VARLEN_KWS = {"full": dict(), "causal": dict(causal=True),
              "all": dict(causal=True, window_size=(6, -1), alibi=(3, 4), softcap=1.0,
                          dropout_p=0.2, seed=11)}
# the sweep's trials (their loops' structure) unmasked and with every mask: "all" is causal too
VARLEN_RUNS = [(backend, name) for backend in VARLEN_BACKENDS for name in VARLEN_KWS
               if not (backend.partition("-")[2] in TRIALS and name == "causal")]


@pytest.mark.parametrize("backend, kw", [(b, VARLEN_KWS[n]) for b, n in VARLEN_RUNS],
                         ids=[f"{n}-{b}" for b, n in VARLEN_RUNS])
def test_varlen_against_reference(backend, kw, monkeypatch):
    """Sequences of different lengths, one empty, seqlen_q != seqlen_k within a sequence (with
    TMA: one descriptor per sequence, so a tile never reads the next sequence's rows)."""
    backend, _, tiles = backend.partition("-")
    if tiles in TRIALS:
        use_trial(monkeypatch, tiles)
    elif tiles:
        use_tma(monkeypatch, ws=tiles == "ws", varlen=True)
    kw = kwargs_for(kw)
    (q, k, v), cu_q, cu_k, max_q, max_k = packed([17, 0, 40], [23, 5, 31])
    do = torch.randn_like(q)
    got = run(lambda *x: longflash.attention_varlen(*x, cu_q, cu_k, max_q, max_k, return_lse=True,
                                                    backend=backend, **kw), q, k, v, do)
    lowp = run(lambda *x: attention_varlen_ref(*x, cu_q, cu_k, **ref_kwargs(kw)), q, k, v, do)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = run(lambda *x: attention_varlen_ref(*x, cu_q, cu_k, **ref_kwargs(kw)), *x64,
              do.double())
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), got, lowp, ref):
        check_close(name, a, b, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_equals_separate_calls(backend):
    (q, k, v), cu_q, cu_k, max_q, max_k = packed([9, 30], [9, 30])
    o = longflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                   backend=backend)
    for b in range(2):
        rows = slice(cu_q[b], cu_q[b + 1])
        ob = longflash.attention(q[None, rows], k[None, rows], v[None, rows], causal=True,
                                 backend=backend)
        torch.testing.assert_close(o[rows], ob[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic_flag(backend):
    q, k, v, do = make_inputs((2, 29, 35, 4, 1, 16), torch.float16)
    kw = dict(causal=True, window_size=(9, -1), softcap=2.0, dropout_p=0.1, seed=1,
              deterministic=True, backend=backend)
    grads = [torch.autograd.grad(longflash.attention(q, k, v, **kw), (q, k, v), do)
             for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ----------------------------------------------------------------------------- bad values

q0, k0, v0, _ = make_inputs((2, 9, 11, 4, 2, 16), torch.float32)
BAD = [
    ("window-below-minus-one", dict(window_size=(-2, 0)), ValueError, "window_size"),
    ("window-not-pair", dict(window_size=5), TypeError, "window_size"),
    ("softcap-negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("dropout-one", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout-negative", dict(dropout_p=-0.1), ValueError, "dropout_p"),
    ("alibi-shape", dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
    ("alibi-dtype", dict(alibi_slopes=torch.ones(4, dtype=torch.float64)), TypeError,
     "alibi_slopes"),
    ("seed-float", dict(dropout_p=0.1, seed=1.5), TypeError, "seed"),
    ("deterministic-int", dict(deterministic=1), TypeError, "deterministic"),
]


@pytest.mark.parametrize("kw, exc, word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_variant_values(kw, exc, word):
    with pytest.raises(exc, match=word):
        longflash.attention(q0, k0, v0, **kw)


def cu(*xs, dtype=torch.int32):
    return torch.tensor(xs, dtype=dtype)


(vq, vk, vv), vcu_q, vcu_k, vmax_q, vmax_k = packed([3, 5], [4, 4])
BAD_VARLEN = [
    ("int64", dict(cu_seqlens_q=cu(0, 3, 8, dtype=torch.int64)), TypeError, "cu_seqlens_q"),
    ("not-zero-start", dict(cu_seqlens_q=cu(1, 3, 8)), ValueError, "start at 0"),
    ("wrong-end", dict(cu_seqlens_k=cu(0, 4, 7)), ValueError, "end at"),
    ("decreasing", dict(cu_seqlens_q=cu(0, 5, 3, 8), cu_seqlens_k=cu(0, 4, 4, 8)), ValueError,
     "non-decreasing"),
    ("count", dict(cu_seqlens_k=cu(0, 8), max_seqlen_k=8), ValueError,
     "same number of sequences"),
    ("max-too-small", dict(max_seqlen_q=4), ValueError, "max_seqlen_q"),
    ("alibi-batch", dict(alibi_slopes=torch.ones(3, 4)), ValueError, "alibi_slopes"),
]


@pytest.mark.parametrize("kw, exc, word", [b[1:] for b in BAD_VARLEN],
                         ids=[b[0] for b in BAD_VARLEN])
def test_bad_varlen_values(kw, exc, word):
    args = dict(cu_seqlens_q=vcu_q, cu_seqlens_k=vcu_k, max_seqlen_q=vmax_q, max_seqlen_k=vmax_k)
    args.update(kw)
    with pytest.raises(exc, match=word):
        longflash.attention_varlen(vq, vk, vv, **args)
