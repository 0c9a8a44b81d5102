"""longflash.jax.attention_varlen: packed variable-length sequences against the reference run
sequence by sequence (o, lse, dq, dk, dv by the tolerance rule), against longflash's PyTorch
attention_varlen (dropout's numbers, per-sequence ALiBi), and the block ranges it walks.
Tiles of 32 x 16, so that sequences start and end inside tiles and span several."""

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="JAX not installed: pip install .[jax]")
import jax.numpy as jnp  # noqa: E402

import longflash.jax as lj  # noqa: E402
from conftest import check_close  # noqa: E402
from test_jax import to_torch, x64  # noqa: E402,F401  (x64: float64 while these tests run)

TILES = dict(block_m=32, block_n=16)


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_inputs(lengths_q, lengths_k, nheads, nheads_kv, headdim, seed=0):
    """q, k, v, do (float64), dlse and the offsets."""
    rng = np.random.default_rng(seed)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    shapes = [(total_q, nheads, headdim), (total_k, nheads_kv, headdim),
              (total_k, nheads_kv, headdim), (total_q, nheads, headdim), (nheads, total_q)]
    arrays = [jnp.asarray(rng.standard_normal(s), jnp.float64) for s in shapes]
    return (*arrays, jnp.asarray(offsets(lengths_q)), jnp.asarray(offsets(lengths_k)))


def reference(q, k, v, cu_q, cu_k, alibi_slopes=None, **kw):
    """attention_ref on each sequence, outputs packed again: (o, lse (H, total_q))."""
    cu_q, cu_k = np.asarray(cu_q), np.asarray(cu_k)  # concrete: the slices' bounds
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        rows, cols = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        slopes = None if alibi_slopes is None else alibi_slopes.reshape(-1, q.shape[1])[
            b if alibi_slopes.ndim == 2 else 0]
        if cols.stop == cols.start:  # no keys: o = 0, lse = -inf (attention_ref needs a key)
            outs.append(jnp.zeros((rows.stop - rows.start, *q.shape[1:2], v.shape[2]), q.dtype))
            lses.append(jnp.full((q.shape[1], rows.stop - rows.start), -jnp.inf, q.dtype))
            continue
        o, lse = lj.attention_ref(q[None, rows], k[None, cols], v[None, cols],
                                  alibi_slopes=slopes, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return jnp.concatenate(outs), jnp.concatenate(lses, axis=1)


def values_and_grads(fn, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) of fn, forward and backward compiled together (one compile)."""
    def run(q, k, v):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        dl = jnp.where(jnp.isinf(lse), 0.0, dlse).astype(lse.dtype)  # rows that see no key
        return (o, lse, *vjp((do.astype(o.dtype), dl)))
    return jax.jit(run)(q, k, v)


# (q lengths, k lengths, nheads, nheads_kv, headdim, keywords): sequences across tile edges,
# of one token, empty (no queries; no keys: o = 0, lse = -inf), seqlen_q > seqlen_k
CASES = [
    ([40, 1, 50, 22], None, 4, 2, 40, dict(causal=True)),
    ([17, 0, 63, 33], [17, 9, 80, 20], 6, 2, 64, dict()),
    ([30, 7, 45], [0, 20, 45], 2, 1, 59, dict(causal=True)),
    ([64, 5, 70], None, 4, 1, 40, dict(causal=True, window_size=(9, -1), softcap=0.8)),
    ([33, 50, 3], [70, 41, 8], 4, 2, 32, dict(window_size=(8, 4), alibi_slopes="per sequence")),
]


def case_id(case):
    lq, lk, h, hkv, d, kw = case
    return f"q{lq}-k{lk or lq}-H{h}/{hkv}-D{d}-" + ("-".join(kw) or "full")


def keywords(kw, nheads, batch):
    rng = np.random.default_rng(5)
    slopes = {"per sequence": (batch, nheads), "per head": (nheads,)}.get(kw.get("alibi_slopes"))
    return dict(kw, alibi_slopes=None if slopes is None else jnp.asarray(rng.random(slopes)))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference(case):
    """float32 against the float64 reference by the tolerance rule: o, lse and the gradients
    of q, k, v; sequences without keys give o = 0 and lse = -inf."""
    lengths_q, lengths_k, nheads, nheads_kv, headdim, kw = case
    lengths_k = lengths_k or lengths_q
    q, k, v, do, dlse, cu_q, cu_k = make_inputs(lengths_q, lengths_k, nheads, nheads_kv,
                                                headdim)
    kw = keywords(kw, nheads, len(lengths_q))
    ref = lambda q, k, v: reference(q, k, v, cu_q, cu_k, **kw)  # noqa: E731
    packed = lambda q, k, v: lj.attention_varlen(  # noqa: E731
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True, **TILES, **kw)
    lowp = [x.astype(jnp.float32) for x in (q, k, v)]
    ref64 = values_and_grads(ref, q, k, v, do, dlse)
    ref32 = values_and_grads(ref, *lowp, do, dlse)
    out = values_and_grads(packed, *lowp, do, dlse)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref32, ref64):
        assert a.shape == r.shape and a.dtype == jnp.float32, name
        check_close(f"{case_id(case)} {name}", to_torch(a), to_torch(b), to_torch(r))


def test_same_as_longflash_attention_varlen():
    """Dropout with an int seed, per-sequence ALiBi and a window: the output and gradients of
    longflash.attention_varlen (PyTorch path) in float64, so both bindings drop the same
    elements of the same packed batch."""
    import longflash
    lengths_q, lengths_k = [17, 40, 1, 29], [30, 40, 9, 29]
    q, k, v, do, _, cu_q, cu_k = make_inputs(lengths_q, lengths_k, 4, 2, 32)
    slopes = np.random.default_rng(3).random((4, 4)).astype(np.float32)  # (PyTorch: float32)
    kw = dict(causal=True, window_size=(20, -1), dropout_p=0.3)
    seed = (5 << 32) + 9

    def loss(q, k, v):
        return (lj.attention_varlen(q, k, v, cu_q, cu_k, 40, 40, alibi_slopes=jnp.asarray(slopes),
                                    dropout_rng=seed, **TILES, **kw) * do).sum()
    got = [lj.attention_varlen(q, k, v, cu_q, cu_k, 40, 40, alibi_slopes=jnp.asarray(slopes),
                               dropout_rng=seed, **kw), *jax.grad(loss, (0, 1, 2))(q, k, v)]
    tq, tk, tv = (to_torch(x).requires_grad_() for x in (q, k, v))
    o = longflash.attention_varlen(tq, tk, tv, to_torch(cu_q), to_torch(cu_k), 40, 40,
                                   alibi_slopes=torch.from_numpy(slopes), seed=seed,
                                   backend="torch", **kw)
    expected = [o, *torch.autograd.grad((o * to_torch(do)).sum(), (tq, tk, tv))]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_learnable_sink():
    lengths = [20, 45]
    q, k, v, _, _, cu_q, cu_k = make_inputs(lengths, lengths, 4, 2, 32)
    sink = jnp.asarray(np.random.default_rng(3).standard_normal(4))
    o, lse = lj.attention_varlen(q, k, v, cu_q, cu_k, 45, 45, causal=True, return_lse=True,
                                 learnable_sink=sink, **TILES)
    ref_o, ref_lse = reference(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink)
    np.testing.assert_allclose(np.asarray(o), np.asarray(ref_o), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-12, atol=1e-12)


def tiles_walked(lengths_q, lengths_k, block_m, block_n, **kw):
    """(forward tiles, backward tiles) that _packed's block ranges make the loops compute."""
    cfg = lj._Config(False, 1.0, block_m, block_n, "jax", varlen=True,
                     window_left=kw.get("window_left", -1), window_right=0)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    ctx = lj._context(jnp.zeros((1, total_q, 1, 1)), jnp.zeros((1, total_k, 1, 1)), cfg)
    padded_q, padded_k = -(-total_q // block_m) * block_m, -(-total_k // block_n) * block_n
    packed = lj._packed(offsets(lengths_q), offsets(lengths_k), ctx, padded_q, padded_k)
    return tuple(int(((r[:, 1] - r[:, 0]) // block).sum())
                 for r, block in ((packed.ranges_q, block_n), (packed.ranges_k, block_m)))


def test_only_the_sequences_blocks_are_computed():
    """Causal, 8 sequences of 64 tokens in 32 x 32 tiles: the loops compute the 3 tiles of
    each sequence's lower triangle (24), not the 136 of the whole packed row's; with a window
    of 31 keys, 2 of them per sequence after the first block (the diagonal and the one
    before); sequences that straddle a tile add the tiles they share."""
    assert tiles_walked([64] * 8, [64] * 8, 32, 32) == (24, 24)
    assert tiles_walked([128] * 4, [128] * 4, 32, 32, window_left=31) == (28, 28)
    # 3 sequences of 48, query tiles [0, 32) ... [128, 160): keys [0, 32), [0, 64) (rows of
    # sequences 0 and 1), [32, 96), [96, 128), [96, 160)
    assert tiles_walked([48] * 3, [48] * 3, 32, 32)[0] == 1 + 2 + 2 + 1 + 2


def test_traced_offsets_compile_once():
    """Offsets as traced arguments: two splits of the same totals give their eager values
    from one compiled function."""
    q, k, v, _, _, _, _ = make_inputs([64], [64], 2, 2, 16)
    run = jax.jit(lambda cu: lj.attention_varlen(q, k, v, cu, cu, 64, 64, causal=True, **TILES))
    for lengths in ([20, 44], [50, 7, 7], [64, 0, 0]):
        cu = jnp.asarray(offsets(lengths + [0] * (3 - len(lengths))))
        eager = lj.attention_varlen(q, k, v, cu, cu, 64, 64, causal=True, **TILES)
        np.testing.assert_allclose(np.asarray(run(cu)), np.asarray(eager), rtol=1e-12)
    assert run._cache_size() == 1


def _as_pages(x, lengths, page_size, seed):
    """Packed keys (total_k, Hkv, D) as a paged cache: each sequence's keys on pages of
    page_size slots in shuffled order, NaN in the slots past its length and on two spare pages
    (never read): (pages, block_table)."""
    x = np.asarray(x)
    max_pages = max(-(-n // page_size) for n in lengths)
    order = np.random.default_rng(seed).permutation(len(lengths) * max_pages + 2)
    pages = np.full((len(order), page_size) + x.shape[1:], np.nan, x.dtype)
    table = order[:len(lengths) * max_pages].reshape(len(lengths), max_pages)
    start = 0
    for b, n in enumerate(lengths):
        for t in range(n):
            pages[table[b, t // page_size], t % page_size] = x[start + t]
        start += n
    return jnp.asarray(pages), jnp.asarray(table, jnp.int32)


def test_paged_keys_as_packed_and_as_longflash():
    """Paged keys (block_table): the output and gradients (q, and the pages') of the packed
    keys they hold, and those of longflash.attention_varlen with the same pages (PyTorch
    path, float64); under jit with traced offsets (keys gathered to batch * max_seqlen_k
    rows) the eager values."""
    import longflash
    lengths_q, lengths_k = [5, 9, 1], [21, 9, 37]  # the last page partly NaN
    q, k, v, do, _, cu_q, cu_k = make_inputs(lengths_q, lengths_k, 4, 2, 32)
    (k_pages, table), (v_pages, _) = (_as_pages(x, lengths_k, 8, seed) for x, seed in
                                      ((k, 1), (v, 1)))
    kw = dict(causal=True, window_size=(12, -1))

    def paged(q, kp, vp):
        return lj.attention_varlen(q, kp, vp, cu_q, cu_k, 9, 37, block_table=table, **TILES, **kw)
    o, vjp = jax.vjp(paged, q, k_pages, v_pages)
    dq, dk_pages, dv_pages = vjp(do)
    o_packed, vjp_packed = jax.vjp(lambda q, k, v: lj.attention_varlen(
        q, k, v, cu_q, cu_k, 9, 37, **TILES, **kw), q, k, v)
    dq_packed, dk, dv = vjp_packed(do)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_packed), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(np.asarray(dq), np.asarray(dq_packed), rtol=1e-12, atol=1e-13)
    for name, got, packed in (("dk", dk_pages, dk), ("dv", dv_pages, dv)):  # back to the pages
        want = np.nan_to_num(np.asarray(_as_pages(packed, lengths_k, 8, 1)[0]))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-13, err_msg=name)
    tq, tk, tv = (to_torch(x).requires_grad_() for x in (q, k_pages, v_pages))
    ot = longflash.attention_varlen(tq, tk, tv, to_torch(cu_q), to_torch(cu_k), 9, 37,
                                    block_table=to_torch(table), backend="torch", **kw)
    expected = [ot, *torch.autograd.grad((ot * to_torch(do)).sum(), (tq, tk, tv))]
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, dq, dk_pages, dv_pages), expected):
        np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)
    traced = jax.jit(lambda q, kp, vp, cu_q, cu_k: lj.attention_varlen(
        q, kp, vp, cu_q, cu_k, 9, 37, block_table=table, **TILES, **kw))
    np.testing.assert_allclose(np.asarray(traced(q, k_pages, v_pages, cu_q, cu_k)),
                               np.asarray(o), rtol=1e-12, atol=1e-13)


def _bad_inputs():
    """(keywords replacing the valid call's, error, message)."""
    x, cu = np.zeros, np.array([0, 3, 5], np.int32)
    return [
        (dict(q=x((1, 5, 4, 32), np.float32)), ValueError, "q must have 3 dimensions"),
        (dict(cu_seqlens_q=cu.astype(np.float32)), TypeError, "cu_seqlens_q must be a 1-D int"),
        (dict(cu_seqlens_k=[0, 3, 7]), TypeError, "cu_seqlens_k must be a 1-D integer array"),
        (dict(cu_seqlens_q=np.array([1, 3, 5])), ValueError, r"start at 0 and end at .*\(5\)"),
        (dict(cu_seqlens_k=np.array([0, 3, 6])), ValueError, r"end at the number of tokens \(7"),
        (dict(cu_seqlens_q=np.array([0, 6, 5])), ValueError, "cu_seqlens_q must be non-decr"),
        (dict(cu_seqlens_q=np.array([0, 5]), max_seqlen_q=5), ValueError, "the same number of sequences"),
        (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q = 2 is smaller .* \(3\)"),
        (dict(max_seqlen_k=None), TypeError, "max_seqlen_k must be an int"),
        (dict(backend="triton"), NotImplementedError, "blockwise JAX path only"),
        (dict(v=x((7, 2, 32), np.float64)), TypeError, "same dtype"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(alibi_slopes=x(3, np.float32)), ValueError, r"alibi_slopes must have shape \(4,\)"),
        (dict(dropout_p=1.0), ValueError, "dropout_p must be in"),
        (dict(learnable_sink=x(3, np.float32)), ValueError, "learnable_sink must have"),
        (dict(k=x((3, 4, 2, 32), np.float32), v=x((3, 4, 2, 32), np.float32),
              block_table=np.zeros((2, 2), np.int64)), TypeError, "block_table must be an int32"),
        (dict(k=x((3, 4, 2, 32), np.float32), v=x((3, 4, 2, 32), np.float32),
              block_table=np.array([[0, 1], [5, 2]], np.int32)), ValueError,
         r"block_table\[1\] has a page outside \[0, 3\)"),
        (dict(k=x((3, 2, 2, 32), np.float32), v=x((3, 2, 2, 32), np.float32),
              block_table=np.array([[0], [1]], np.int32)), ValueError,
         r"max_seqlen_k = 4 is more keys than block_table holds \(1 pages of 2\)"),
        (dict(block_table=np.array([[0], [1]], np.int32)), ValueError,
         "k must have 4 dimensions .* with block_table"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_inputs(),
                         ids=[m for _, _, m in _bad_inputs()])
def test_bad_input(kwargs, error, match):
    """A clear error naming the argument, raised before anything runs."""
    f32, cu_q, cu_k = np.float32, np.array([0, 3, 5], np.int32), np.array([0, 4, 7], np.int32)
    call = dict(q=np.zeros((5, 4, 32), f32), k=np.zeros((7, 2, 32), f32),
                v=np.zeros((7, 2, 32), f32), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                max_seqlen_q=3, max_seqlen_k=4)
    call.update(kwargs)
    with pytest.raises(error, match=match):
        lj.attention_varlen(**call)
