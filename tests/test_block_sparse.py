"""Block-sparse attention (block_mask, block_size) against the float64 reference, forward and
gradients, on the blockwise path and the Triton kernels (interpreter), alone and with the
other variants; packed and paged sequences; that hidden blocks are skipped, not masked; the
kernels' block lists; bad masks."""

import pytest
import torch

import longflash
from longflash import _common, attention_ref, attention_varlen_ref
from conftest import INTERPRET, check_close, needs_triton, run_uninterpreted
from test_correctness import KERNEL_FUNCTIONS, force_configs, make_inputs
from test_variants import check_variant, use_tiles

UNIT = _common.BLOCK_SPARSE_UNIT
# The interpreter's own tile (flash_triton._INTERPRET_CONFIG, 32 x 16) puts 4 x 8 tiles in a
# block of 128, and its time goes per tile: here the Triton kernels run tiles of 64 x 64 (2 x 2
# in a block, still edges inside and across blocks; a fifth of the time) unless a case asks for
# the interpreter's own ("small").
BIG_TILES = (64, 64, 4, 1)


def _force_tiles(monkeypatch, tiles):
    from longflash.flash_triton import _config
    force_configs(monkeypatch, {kernel: _config(tiles) for kernel in KERNEL_FUNCTIONS})


@pytest.fixture(autouse=True)
def interpreter_tiles(monkeypatch):
    if INTERPRET:
        _force_tiles(monkeypatch, BIG_TILES)


def _blocks(shape, dims, block_size=UNIT, density=0.6, seed=11):
    """A random block_mask for inputs of shape (B, Nq, Nk, H, Hkv, D): dims "BH", "1H", "B1"
    or "11" say which of batch and heads it has; block_size an int or (queries, keys)."""
    bq, bk = (block_size, block_size) if isinstance(block_size, int) else block_size
    size = (shape[0] if dims[0] == "B" else 1, shape[3] if dims[1] == "H" else 1,
            -(-shape[1] // bq), -(-shape[2] // bk))
    return torch.rand(size, generator=torch.Generator().manual_seed(seed)) < density


# (id, shape (B, Nq, Nk, H, Hkv, D), mask dims, block_size, keyword arguments)
CASES = [
    ("per-head", (2, 300, 420, 4, 2, 16), "BH", UNIT, {}),
    ("shared-causal", (1, 400, 400, 2, 1, 16), "11", UNIT, dict(causal=True)),
    ("heads-window", (1, 330, 390, 2, 2, 16), "1H", UNIT, dict(window_size=(150, 40))),
    ("wide-blocks-all", (2, 290, 310, 2, 1, 24), "B1", (256, 128),
     dict(causal=True, alibi=(2, 2), softcap=1.0, dropout_p=0.2, seed=7)),
    # blocks smaller than the kernels' largest tiles, and keys' not a power of two: 64 x 192
    ("blocks-64x192-heads-causal", (1, 200, 450, 2, 1, 16), "1H", (64, 192), dict(causal=True)),
]
SMALL = ("shared-causal", "heads-window")  # the Triton kernels' cases with the interpreter's tile
RUNS = [("torch", (64, 32)), ("torch", None)] + ([("triton", None)] if INTERPRET else [])
PARAMS = [pytest.param(b, "small" if b == "triton" and c[0] in SMALL else t, d, *c[1:],
                       id=f"{c[0]}-{b}{'-%dx%d' % t if t else ''}-{n}")
          for c in CASES for d, n in ((torch.float32, "fp32"), (torch.float16, "fp16"))
          for b, t in RUNS if not (b == "triton" and n == "fp32" and c[0] != "per-head")]


def _kwargs(shape, dims, block_size, kw):
    mask = _blocks(shape, dims, block_size)
    if mask.shape[2] > 1:
        mask[..., 1, :] = False  # the second query block sees no key: o = 0, lse = -inf
    return dict(kw, block_mask=mask, block_size=block_size)


@pytest.mark.parametrize("backend, tiles, dtype, shape, dims, block_size, kw", PARAMS)
def test_block_mask_against_reference(backend, tiles, dtype, shape, dims, block_size, kw,
                                      monkeypatch):
    if tiles == "small":
        from longflash.flash_triton import _INTERPRET_CONFIG
        _force_tiles(monkeypatch, _INTERPRET_CONFIG)
    else:
        use_tiles(monkeypatch, tiles)
    check_variant(shape, dtype, _kwargs(shape, dims, block_size, kw), backend)


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels' TMA code paths, interpreted")
def test_block_mask_tma_tiles(monkeypatch):
    use_tiles(monkeypatch, "tma")
    shape, dims, block_size, kw = CASES[1][1:]
    check_variant(shape, torch.float32, _kwargs(shape, dims, block_size, kw), "triton")


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
def test_block_mask_with_attn_mask(backend):
    """Both masks: a key must pass each."""
    shape = (2, 260, 300, 2, 1, 16)
    mask = torch.rand(2, 1, 1, 300, generator=torch.Generator().manual_seed(2)) > 0.3
    kw = dict(_kwargs(shape, "BH", UNIT, {}), attn_mask=mask)
    check_variant(shape, torch.float32, kw, backend)


def _nan_in_hidden_keys(k, v, block_mask, bk):
    """k, v with NaN in every key block that block_mask hides from every query block of every
    batch row and head: a kernel that loaded or multiplied such a block would return NaN."""
    hidden = ~block_mask.any(dim=(0, 1, 2))  # (key blocks,)
    rows = hidden.repeat_interleave(bk)[:k.shape[1]]
    k, v = (x.detach().clone() for x in (k, v))
    k[:, rows], v[:, rows] = float("nan"), float("nan")
    return k.requires_grad_(), v.requires_grad_(), rows


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
def test_hidden_blocks_are_skipped(backend, device="cpu"):
    """Keys and values of the hidden blocks are NaN: a tile computed and then masked would
    give NaN (0 * NaN in p v, dP = dO v^T), a skipped one nothing. Forward and backward,
    against the reference over the visible keys. Blocks of 256 (the blockwise path's own
    tiles, 256 x 256)."""
    shape = (1, 260, 700, 2, 1, 16)
    q, k, v, do = make_inputs(shape, torch.float32, device=device)
    block_mask = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device)
    block_mask[..., 1] = False
    k_nan, v_nan, rows = _nan_in_hidden_keys(k, v, block_mask, 256)
    o = longflash.attention(q, k_nan, v_nan, backend=backend, block_mask=block_mask,
                            block_size=256)
    dq, dk, dv = torch.autograd.grad(o, (q, k_nan, v_nan), do)
    keep = ~rows
    o_ref = attention_ref(q, k[:, keep], v[:, keep])[0]
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    assert torch.isfinite(o).all() and torch.isfinite(dq).all()
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, dq_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dk[:, keep], dk_ref[:, keep], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dv[:, keep], dv_ref[:, keep], atol=1e-5, rtol=1e-5)
    assert (dk[:, rows] == 0).all() and (dv[:, rows] == 0).all()


def _packed(lengths_q, lengths_k, nheads, nheads_kv, headdim, dtype):
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lengths_q), nheads, headdim, generator=gen, dtype=dtype)
    k, v = (torch.randn(sum(lengths_k), nheads_kv, headdim, generator=gen, dtype=dtype)
            for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (lengths_q, lengths_k)]
    return q, k, v, cu


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_packed_sequences(backend, causal):
    """Each sequence's blocks count from its own first query and key."""
    lengths_q, lengths_k = [200, 300, 70], [260, 300, 140]
    q, k, v, (cu_q, cu_k) = _packed(lengths_q, lengths_k, 2, 1, 16, torch.float32)
    block_mask = torch.rand(3, 2, 3, 3, generator=torch.Generator().manual_seed(6)) < 0.6
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8))

    def run(fn, *x):
        x = [t.detach().clone().requires_grad_() for t in x]
        o, lse = fn(*x, cu_q, cu_k, causal=causal, block_mask=block_mask)
        return (o, lse, *torch.autograd.grad(o, x, do.to(o.dtype)))

    got = run(lambda *a, **kw: longflash.attention_varlen(*a[:5], 300, 300, return_lse=True,
                                                          backend=backend, **kw), q, k, v)
    lowp = run(lambda *a, **kw: attention_varlen_ref(*a, upcast=False, **kw), q, k, v)
    ref = run(attention_varlen_ref, q.double(), k.double(), v.double())
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), got, lowp, ref):
        check_close(name, a, b, r)


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
def test_block_mask_paged_keys(backend):
    """Paged keys read in place (no gradient): blocks count key positions, not pages."""
    lengths_q, lengths_k, page = [130, 20], [300, 400], 64
    q, k, v, (cu_q, cu_k) = _packed(lengths_q, lengths_k, 2, 2, 16, torch.float32)
    pages = [-(-n // page) for n in lengths_k]
    table = torch.zeros(2, max(pages), dtype=torch.int32)
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(1))
    kp, vp = (torch.zeros(sum(pages), page, 2, 16) for _ in range(2))
    for b, n in enumerate(lengths_k):
        ids = order[sum(pages[:b]):sum(pages[:b + 1])]
        table[b, :len(ids)] = ids
        for j, pid in enumerate(ids.tolist()):
            rows = slice(cu_k[b] + j * page, min(cu_k[b] + (j + 1) * page, cu_k[b + 1]))
            kp[pid, :rows.stop - rows.start], vp[pid, :rows.stop - rows.start] = k[rows], v[rows]
    block_mask = torch.tensor([[True, False, True, True], [False, True, False, True]])
    block_mask = block_mask[:, None, None, :].expand(2, 1, 2, 4).clone()
    block_mask[1, 0, 0] = False  # sequence 1's queries are one block: its row 0
    o = longflash.attention_varlen(q, kp, vp, cu_q, cu_k, 130, 400, causal=True,
                                   backend=backend, block_table=table, block_mask=block_mask)
    ref = attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k, causal=True,
                               block_mask=block_mask)[0]
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqlen_k", [1, 1100])
def test_block_mask_decoding_shape_runs_the_main_kernel(seqlen_k):
    """Short queries over many keys (the split-KV route without a block_mask) with one: the
    main kernels run and the mask holds."""
    backend = "triton" if INTERPRET else "torch"
    shape = (2, 3, seqlen_k, 4, 1, 16)
    check_variant(shape, torch.float32, _kwargs(shape, "BH", UNIT, {}), backend)


def test_block_lists():
    """The kernels' lists: per row, how many True columns come before each column, then the
    True columns in order."""
    from longflash._common import block_lists
    bits = torch.rand(3, 2, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.5
    lists = block_lists(bits)
    assert lists.shape == (3, 2, 5, 15) and lists.dtype == torch.int32
    for row, out in zip(bits.reshape(-1, 7), lists.reshape(-1, 15)):
        true = row.nonzero().flatten()
        assert out[:8].tolist() == [int(row[:j].sum()) for j in range(8)]
        assert out[8:8 + len(true)].tolist() == true.tolist()


@pytest.mark.parametrize("kernel", ["fwd", "dkdv", "dq"])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("blocks", [(128, 128), (64, 64), (64, 192), (256, 384)])
def test_autotuner_candidates_divide_the_blocks(kernel, headdim, blocks):
    """The autotuner's candidates on an H100 (sm_90: every table's largest tiles are 128)
    with a block_mask: the table's, each tile shrunk to divide the blocks; blocks of
    multiples of 128 keep the table's whole. Without a mask the block sizes change nothing."""
    from longflash import flash_triton
    configs = [flash_triton._config(c) for c in flash_triton.all_configs(kernel)]
    prune = flash_triton._prune(kernel)
    call = dict(HEAD_DIM=headdim, HEAD_DIM_V=headdim, atomic_dq=0, tma_ok=1, ws_ok=0,
                sparse_bq=blocks[0], sparse_bk=blocks[1])
    table = prune(configs, dict(Q=torch.empty(0)), **call, BLOCK_SPARSE=False)
    kept = prune(configs, dict(Q=torch.empty(0)), **call, BLOCK_SPARSE=True)
    assert table and kept
    tiles = lambda cs: [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in cs]  # noqa: E731
    assert all(blocks[0] % m == 0 and blocks[1] % n == 0 for m, n in tiles(kept))
    if blocks[0] % 128 == 0 and blocks[1] % 128 == 0:
        assert kept == table
    import math
    assert sorted(set(tiles(kept))) == sorted({(math.gcd(m, blocks[0]), math.gcd(n, blocks[1]))
                                               for m, n in tiles(table)})
    assert len(kept) <= len(table)
    one = prune(configs[:1], dict(Q=torch.empty(0)), **call, BLOCK_SPARSE=True)  # forced
    assert len(one) == 1 and all(blocks[0] % m == 0 and blocks[1] % n == 0 for m, n in tiles(one))


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in GPU")
def test_blocks_of_64_get_tiles_of_64_on_a_stand_in_hopper():
    """Compiled for sm_90a (experiments.host_time.launches_elided): a forward over blocks of
    128 keeps the table's 128-row tile, one over blocks of 64 (same shape, dtype, head dim)
    gets its own autotuning (the block sizes are in the key) and a 64 x 64 tile."""
    code = """
import torch
from experiments.host_time import launches_elided
from longflash import flash_triton as ft, interface

q = torch.randn(1, 256, 1, 16, dtype=torch.float16)
with launches_elided():
    for block in (128, 64):
        mask = torch.ones(1, 1, 256 // block, 256 // block, dtype=torch.bool)
        opts = interface._options(q, False, 0.25, -1, -1, None, 0.0, 0.0, None, None, None,
                                  0, 0, block_mask=mask, block_size_q=block,
                                  block_size_k=block)
        ft.forward(q, q, q, opts)
        c = ft._attn_fwd.best_config.kwargs
        print(block, c["BLOCK_M"], c["BLOCK_N"], len(ft._attn_fwd.cache))
"""
    lines = run_uninterpreted("-c", code).stdout.split("\n")[:2]
    assert lines == ["128 128 64 1", "64 64 64 2"], lines


def test_block_lists_made_once_per_mask(monkeypatch):
    """The launchers' lists are kept per mask tensor: the same unchanged tensor gets the same
    lists back; an in-place write (through a view too) makes them again; an inference tensor
    (no version counter) never keeps them; an entry goes with its mask."""
    import gc

    from longflash.flash_triton import _LISTS, _cached_block_lists
    mask = torch.rand(1, 2, 3, 4, generator=torch.Generator().manual_seed(1)) < 0.5
    lists = _cached_block_lists(mask, False)
    assert _cached_block_lists(mask, False) is lists
    transposed = _cached_block_lists(mask, True)
    assert torch.equal(transposed, _common.block_lists(mask.transpose(-1, -2)))
    mask[0, 0, 0, 0] = ~mask[0, 0, 0, 0]
    again = _cached_block_lists(mask, False)
    assert again is not lists and torch.equal(again, _common.block_lists(mask))
    mask[0].fill_(True)  # a view shares the version counter
    assert torch.equal(_cached_block_lists(mask, False), _common.block_lists(mask))
    assert not torch.equal(_cached_block_lists(mask, True), transposed)
    keys = [k for k in _LISTS if k[0] == id(mask)]
    del mask
    gc.collect()
    assert not [k for k in keys if k in _LISTS]
    with torch.inference_mode():
        frozen = torch.ones(1, 1, 2, 2, dtype=torch.bool)
        assert _cached_block_lists(frozen, False) is not _cached_block_lists(frozen, False)
    # while a CUDA graph is captured (test_gpu's test_block_sparse_cuda_graph_gpu on a GPU)
    from longflash import flash_triton
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    kept = _cached_block_lists(mask, False)
    monkeypatch.setattr(flash_triton, "_capturing", lambda x: True)
    assert _cached_block_lists(mask, False) is not kept


@pytest.mark.skipif(not INTERPRET, reason="the Triton launchers' kept lists, interpreted")
def test_block_mask_changed_in_place_between_calls():
    """One mask tensor through the kernels, then changed in place and passed again: the second
    call (forward and backward) follows the new mask, not the lists kept from the first."""
    shape = (1, 260, 300, 2, 1, 16)
    q, k, v, do = make_inputs(shape, torch.float32)
    mask = _blocks(shape, "1H", UNIT, density=0.5)
    for _ in range(2):
        q_, k_, v_ = (x.detach().clone().requires_grad_() for x in (q, k, v))
        o = longflash.attention(q_, k_, v_, backend="triton", block_mask=mask)
        grads = torch.autograd.grad(o, (q_, k_, v_), do)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = attention_ref(q64, k64, v64, block_mask=mask)[0]
        for got, want in zip((o, *grads), (ref, *torch.autograd.grad(ref, (q64, k64, v64),
                                                                     do.double()))):
            torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        mask.logical_not_()  # the kept blocks become the hidden ones


def test_block_mask_compiles_fullgraph():
    """torch.compile(fullgraph=True): block_mask and block_size travel through both ops."""
    shape = (1, 260, 260, 2, 1, 16)
    q, k, v, do = make_inputs(shape, torch.float32)
    mask = _blocks(shape, "1H", UNIT)

    def f(q, k, v):
        return longflash.attention(q, k, v, causal=True, backend="torch", block_mask=mask)

    o = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do)
    o_ref = f(q, k, v)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    torch.testing.assert_close(o, o_ref)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("bad, error, match", [
    (dict(block_mask=torch.ones(1, 1, 3, 3)), TypeError, "block_mask must be a bool tensor"),
    (dict(block_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool)), ValueError,
     r"block_mask must have shape .* \(2 or 1, 4 or 1, 3, 3\)"),
    (dict(block_mask=torch.ones(3, 1, 3, 3, dtype=torch.bool)), ValueError, "block_mask"),
    (dict(block_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), block_size=96), ValueError,
     "block_size must be a positive multiple of 64"),
    (dict(block_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool), block_size=(128, 100)),
     ValueError, "block_size"),
    (dict(block_size=True), ValueError, "block_size"),
    (dict(block_mask=torch.ones(1, 1, 2, 3, dtype=torch.bool), block_size=(256, 128)), None,
     None),
])
def test_bad_block_mask(bad, error, match):
    q, k, v = (torch.randn(2, 300, 4, 16) for _ in range(3))
    if error is None:
        longflash.attention(q, k, v, backend="torch", **bad)
        return
    with pytest.raises(error, match=match):
        longflash.attention(q, k, v, backend="torch", **bad)


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(0, 130), (130, 0), (5, 0)])
def test_block_mask_empty_sizes(backend, seqlen_q, seqlen_k):
    """No queries, or no keys (a mask with no key blocks): empty outputs, or o = 0 and lse
    -inf, and zero gradients, as without a mask."""
    q, k, v, do = make_inputs((1, seqlen_q, seqlen_k, 2, 1, 16), torch.float32)
    mask = torch.ones(1, 1, -(-seqlen_q // UNIT), -(-seqlen_k // UNIT), dtype=torch.bool)
    o, lse = longflash.attention(q, k, v, backend=backend, block_mask=mask, return_lse=True)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert o.shape == q.shape and (o == 0).all() and (lse == float("-inf")).all()
    assert not dq.any() and not dk.any() and not dv.any()
