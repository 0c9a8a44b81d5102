"""longflash.jax: the blockwise JAX path (custom VJP) against a materializing reference.

Values (o, lse) and gradients (dq, dk, dv of sum(o * w) + sum(lse * w_lse), random w) by
the project's rule (`check_close`): the float32 result's max error against the float64
reference is at most twice that of the float32 reference plus a rounding floor. Small
tiles (32 x 16) so that these odd lengths span several blocks and end in partial ones.
Runs on CPU. The GPU path (jax_triton.triton_call of the Triton kernels) cannot run
here; `test_triton_path_arguments` checks its launch arguments by running the same
kernels through Triton's interpreter in place of jax_triton.
"""

import functools
import inspect
import sys
import types

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="JAX not installed: pip install .[jax]")
import jax.numpy as jnp  # noqa: E402

import longflash.jax as lj  # noqa: E402
from conftest import INTERPRET, check_close  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def x64():
    """float64 for the reference, only while these tests run."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal)
CASES = [
    (2, 17, 17, 4, 2, 40, True),
    (1, 113, 203, 6, 2, 64, False),
    (1, 203, 113, 4, 4, 40, True),  # seqlen_q > seqlen_k: the first 90 rows see no key
    (1, 1, 17, 2, 1, 64, True),
]


def case_id(case):
    b, nq, nk, h, hkv, d, causal = case
    return f"B{b}-Nq{nq}-Nk{nk}-H{h}/{hkv}-D{d}" + ("-causal" if causal else "")


def make_inputs(case, seed=0):
    b, nq, nk, h, hkv, d, _ = case
    rng = np.random.default_rng(seed)
    shapes = [(b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d), (b, nq, h, d), (b, h, nq)]
    return [jnp.asarray(rng.standard_normal(s), jnp.float64) for s in shapes]


def values_and_grads(fn, q, k, v, do, dlse):
    """(o, lse, dq, dk, dv) of fn, forward and backward compiled together (one compile)."""
    def run(q, k, v, do, dlse):
        (o, lse), vjp = jax.vjp(fn, q, k, v)
        dlse = jnp.where(jnp.isinf(lse), 0.0, dlse).astype(lse.dtype)  # rows that see no key
        return (o, lse, *vjp((do.astype(o.dtype), dlse)))
    return jax.jit(run)(q, k, v, do, dlse)


def to_torch(x):
    return torch.from_numpy(np.array(x))


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_matches_reference(case):
    out = check_blockwise(case_id(case), *make_inputs(case), causal=case[-1])
    assert out[0].dtype == jnp.float32 and out[1].shape == (case[0], case[3], case[1])


def check_blockwise(label, q, k, v, do, dlse, causal, **kw):
    """The blockwise path in float32 against the reference in float64, by the tolerance rule
    (o, lse, dq, dk, dv); returns the blockwise path's. kw: more keywords of both."""
    ref = lambda q, k, v: lj.attention_ref(q, k, v, causal=causal, **kw)  # noqa: E731
    blockwise = lambda q, k, v: lj.attention(q, k, v, causal=causal, return_lse=True,  # noqa: E731
                                             block_m=32, block_n=16, backend="jax", **kw)
    lowp = [x.astype(jnp.float32) for x in (q, k, v)]
    ref64 = values_and_grads(ref, q, k, v, do, dlse)
    ref32 = values_and_grads(ref, *lowp, do, dlse)
    out = values_and_grads(blockwise, *lowp, do, dlse)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref32, ref64):
        assert a.shape == r.shape, name
        check_close(f"{label} {name}", to_torch(a), to_torch(b), to_torch(r))
    return out


@pytest.mark.parametrize("case, window", [(CASES[1], (8, 4)), (CASES[1], (50, -1)),
                                          (CASES[2], (30, -1)), (CASES[0], (0, 0)),
                                          (CASES[3], (5, -1))],
                         ids=lambda x: case_id(x) if len(x) == 7 else f"window{x}")
def test_window(case, window):
    """Sliding windows (left, right), with causal (right 0) and without, on query blocks whose
    windows skip key blocks: o, lse and the gradients against the float64 reference."""
    check_blockwise(f"{case_id(case)} window{window}", *make_inputs(case), causal=case[-1],
                    window_size=window)


@pytest.mark.parametrize("case, kw", [(CASES[1], dict(softcap=0.7)),
                                      (CASES[0], dict(softcap=2.0, window_size=(6, -1))),
                                      (CASES[2], dict(softcap=1.5))],
                         ids=["softcap", "softcap-window-causal", "softcap-causal-empty-rows"])
def test_softcap(case, kw):
    """softcap * tanh(s / softcap) (scores scaled up so that tanh saturates): o, lse and the
    gradients through it against the float64 reference."""
    q, k, v, do, dlse = make_inputs(case)
    check_blockwise(f"{case_id(case)} {kw}", q * 3, k, v, do, dlse, causal=case[-1], **kw)


@pytest.mark.parametrize("case, per_batch, kw", [
    (CASES[1], False, {}), (CASES[0], True, dict(window_size=(6, -1))),
    (CASES[2], False, dict(softcap=1.5))], ids=["alibi", "alibi-batch-window-causal",
                                                 "alibi-softcap-causal"])
def test_alibi(case, per_batch, kw):
    """ALiBi slopes, (nheads,) or (batch, nheads), alone and with a window or softcap: o, lse
    and the gradients against the float64 reference."""
    b, h = case[0], case[3]
    slopes = jnp.asarray(np.random.default_rng(8).random((b, h) if per_batch else (h,)))
    check_blockwise(f"{case_id(case)} alibi", *make_inputs(case), causal=case[-1],
                    alibi_slopes=slopes, **kw)


def test_softcap_and_attn_mask_order():
    """A float attn_mask is added after softcap, as in longflash.attention: a mask of c on
    every score leaves o unchanged and adds c to lse, with a softcap of 0.5 (under which
    scores alone never exceed 0.5)."""
    q, k, v, _, _ = make_inputs(CASES[1])
    o, lse = lj.attention(q, k, v, return_lse=True, softcap=0.5, block_m=32, block_n=16)
    o_c, lse_c = lj.attention(q, k, v, return_lse=True, softcap=0.5, block_m=32, block_n=16,
                              attn_mask=jnp.full((1, 1), 3.0))
    np.testing.assert_allclose(o_c, o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse_c, lse + 3.0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CASES[1:3], ids=[case_id(c) for c in CASES[1:3]])
def test_learnable_sink(case):
    """Attention sinks: o, lse and the gradients of q, k, v and the sink against the reference
    that appends the sink as a column of scores."""
    causal = case[-1]
    q, k, v, do, dlse = make_inputs(case)
    sink = jnp.asarray(np.linspace(-1.0, 4.0, case[3]))

    def values_and_grads_sink(fn, q, k, v, sink):  # forward and backward in one compile
        def run(q, k, v, sink):
            (o, lse), vjp = jax.vjp(fn, q, k, v, sink)
            return (o, lse, *vjp((do.astype(o.dtype), dlse.astype(lse.dtype))))
        return jax.jit(run)(q, k, v, sink)
    ref = lambda q, k, v, s: lj.attention_ref(q, k, v, causal=causal,  # noqa: E731
                                              learnable_sink=s)
    blockwise = lambda q, k, v, s: lj.attention(q, k, v, causal=causal, return_lse=True,  # noqa: E731
                                                block_m=32, block_n=16, backend="jax",
                                                learnable_sink=s)
    lowp = [x.astype(jnp.float32) for x in (q, k, v, sink)]
    ref64 = values_and_grads_sink(ref, q, k, v, sink)
    ref32 = values_and_grads_sink(ref, *lowp)
    out = values_and_grads_sink(blockwise, *lowp)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv", "dsink"), out, ref32, ref64):
        check_close(f"{case_id(case)} {name}", to_torch(a), to_torch(b), to_torch(r))
    with pytest.raises(ValueError, match="learnable_sink"):
        lj.attention(q, k, v, learnable_sink=sink[:1])


# (case, mask shape with B/H/Q/K for the case's dims, kind)
MASKS = [
    (CASES[0], "B11K", "bool"),    # key padding, broadcast over heads and rows
    (CASES[1], "HQK", "float"),    # a bias per head (T5-like), shared by the batch
    (CASES[2], "BHQK", "float"),   # full, with -inf entries; the first 90 rows see no key
    (CASES[1], "Q1", "bool"),      # one boolean per row for every key: some rows see none
    (CASES[3], "1HQK", "bool"),
]


def make_mask(case, dims, kind, seed=4):
    b, nq, nk, h, _, _, _ = case
    shape = tuple({"B": b, "H": h, "Q": nq, "K": nk, "1": 1}[c] for c in dims)
    rng = np.random.default_rng(seed)
    if kind == "bool":
        return jnp.asarray(rng.random(shape) < 0.7)
    mask = rng.standard_normal(shape)
    mask[rng.random(shape) < 0.2] = -np.inf
    return jnp.asarray(mask)


@pytest.mark.parametrize("case, dims, kind", MASKS,
                         ids=[f"{case_id(c)}-{d}-{k}" for c, d, k in MASKS])
def test_attn_mask(case, dims, kind):
    """attn_mask (boolean, or float added to the scores) broadcast in several ways: o, lse and
    the gradients of q, k, v and of a float mask (dL/ds summed where it broadcasts) in float32
    against the float64 reference, by the tolerance rule."""
    causal = case[-1]
    q, k, v, do, dlse = make_inputs(case)
    mask = make_mask(case, dims, kind)

    @functools.partial(jax.jit, static_argnums=0)  # forward and backward in one compile
    def run(fn, q, k, v, mask):
        """o, lse and the cotangents of q, k, v, and of a float mask."""
        if kind == "bool":
            (o, lse), vjp = jax.vjp(lambda q, k, v: fn(q, k, v, mask), q, k, v)
        else:
            (o, lse), vjp = jax.vjp(fn, q, k, v, mask)
        dl = jnp.where(jnp.isinf(lse), 0.0, dlse).astype(lse.dtype)  # rows that see no key
        return (o, lse, *vjp((do.astype(o.dtype), dl)))
    ref = lambda q, k, v, m: lj.attention_ref(q, k, v, causal=causal,  # noqa: E731
                                              attn_mask=m)
    blockwise = lambda q, k, v, m: lj.attention(q, k, v, causal=causal,  # noqa: E731
                                                return_lse=True, block_m=32, block_n=16,
                                                attn_mask=m)
    lowp = [x.astype(jnp.float32) for x in (q, k, v)] + [
        mask if kind == "bool" else mask.astype(jnp.float32)]
    ref64 = run(ref, q, k, v, mask)
    ref32 = run(ref, *lowp)
    out = run(blockwise, *lowp)
    names = ("o", "lse", "dq", "dk", "dv") + (("dmask",) if kind == "float" else ())
    for name, a, b, r in zip(names, out, ref32, ref64):
        assert a.shape == r.shape, name
        check_close(f"{case_id(case)} {dims} {name}", to_torch(a), to_torch(b), to_torch(r))


def test_attn_mask_under_jit_and_vmap():
    """attn_mask as a traced argument: jax.jit and jax.vmap (over a batch of masks) give the
    eager values."""
    case = CASES[1]
    q, k, v, _, _ = (x.astype(jnp.float32) for x in make_inputs(case))
    masks = jnp.stack([make_mask(case, "HQK", "bool", seed=s) for s in (5, 6)])
    eager = [lj.attention(q, k, v, attn_mask=m, block_m=32, block_n=16) for m in masks]
    jitted = jax.jit(lambda m: lj.attention(q, k, v, attn_mask=m, block_m=32, block_n=16))
    mapped = jax.vmap(lambda m: lj.attention(q, k, v, attn_mask=m, block_m=32, block_n=16))
    for i, m in enumerate(masks):
        np.testing.assert_allclose(jitted(m), eager[i], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(mapped(masks), jnp.stack(eager), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("headdim_v", [24, 56])
def test_value_headdim_differs(headdim_v):
    """v narrower (v zero-padded) and wider (q and k zero-padded) than q's 40: the default
    scale stays 1 / sqrt(40)."""
    case = (1, 33, 47, 4, 2, 40, True)
    q, k, _, _, dlse = make_inputs(case, seed=2)
    rng = np.random.default_rng(3)
    v, do = (jnp.asarray(rng.standard_normal(s + (headdim_v,)), jnp.float64)
             for s in ((1, 47, 2), (1, 33, 4)))
    out = check_blockwise(f"Dv{headdim_v}", q, k, v, do, dlse, causal=True)
    assert out[0].shape == (1, 33, 4, headdim_v)


def test_float64_is_exact():
    """In float64 the blockwise path agrees with the reference to rounding (1e-12)."""
    case = (1, 33, 47, 4, 2, 40, True)
    q, k, v, do, dlse = make_inputs(case, seed=1)
    ref = values_and_grads(lambda q, k, v: lj.attention_ref(q, k, v, causal=True),
                           q, k, v, do, dlse)
    out = values_and_grads(lambda q, k, v: lj.attention(q, k, v, causal=True, return_lse=True,
                                                        block_m=32, block_n=16), q, k, v, do, dlse)
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref):
        assert a.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-12, atol=1e-12,
                                   err_msg=name)


def test_inside_jit_and_vmap():
    """Called from a user's jit and vmap (tracers in), default tiles: the same results as
    called eagerly, one batch entry at a time."""
    q, k, v, _, _ = make_inputs((2, 17, 17, 4, 2, 40, True))
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    eager = lj.attention(q, k, v, causal=True)
    jitted = jax.jit(lambda q, k, v: lj.attention(q, k, v, causal=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
    mapped = jax.vmap(lambda q, k, v: lj.attention(q[None], k[None], v[None], causal=True)[0])
    np.testing.assert_allclose(np.asarray(mapped(q, k, v)), np.asarray(eager), rtol=1e-6,
                               atol=1e-6)


def test_empty_keys():
    q = jnp.ones((1, 3, 2, 8), jnp.float32)
    k = v = jnp.ones((1, 0, 2, 8), jnp.float32)
    (o, lse), vjp = jax.vjp(lambda q, k, v: lj.attention(q, k, v, return_lse=True), q, k, v)
    assert not np.asarray(o).any() and np.isneginf(np.asarray(lse)).all()
    dq, _, _ = vjp((jnp.ones_like(o), jnp.zeros_like(lse)))
    assert not np.asarray(dq).any()


def temp_bytes(fn, *shapes):
    """Scratch memory XLA plans for fn (compiled, not run)."""
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_linear_memory():
    """Forward + backward at N = 4096: no N x N buffer (64 MiB in float32) in the blockwise
    path; the materializing reference needs at least one."""
    n, d = 4096, 64
    shape = (1, n, 1, d)
    matrix = n * n * 4

    def loss(attn):
        return jax.grad(lambda q, k, v: attn(q, k, v).sum(), argnums=(0, 1, 2))

    blockwise = temp_bytes(loss(lambda q, k, v: lj.attention(q, k, v, causal=True,
                                                             backend="jax")), shape, shape, shape)
    reference = temp_bytes(loss(lambda q, k, v: lj.attention_ref(q, k, v, causal=True)[0]),
                           shape, shape, shape)
    print(f"scratch at N={n}: blockwise {blockwise / 2**20:.1f} MiB, "
          f"reference {reference / 2**20:.1f} MiB, one N x N matrix {matrix / 2**20:.0f} MiB")
    assert reference >= matrix
    assert blockwise < matrix / 8


def packed_ids(lengths):
    """(1, sum(lengths)) segment ids of sequences of these lengths, one after the other."""
    return jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)


# (case, q ids, kv ids (None: the q ids), window): packed sequences across block edges (tiles
# of 32 x 16), one of a single token; with causal, a window, and bidirectional
SEGMENTS = [
    ((1, 113, 113, 4, 2, 40, True), [40, 1, 50, 22], None, (-1, -1)),
    ((1, 113, 113, 4, 2, 40, True), [17, 33, 63], None, (9, -1)),
    ((1, 97, 97, 6, 6, 64, False), [30, 30, 37], None, (-1, -1)),
    # keys of other segments than the queries: a query whose id no key has sees nothing
    ((1, 40, 70, 2, 1, 32, False), [10, 30], [25, 20, 25], (-1, -1)),
]


@pytest.mark.parametrize("case, q_lengths, kv_lengths, window", SEGMENTS,
                         ids=[f"{case_id(c)}-{q}-{k}-w{w}" for c, q, k, w in SEGMENTS])
def test_segment_ids(case, q_lengths, kv_lengths, window):
    """segment_ids (packed sequences) against the reference with the same mask made dense:
    o, lse and the gradients of q, k, v, by the tolerance rule; queries whose id no key has
    give o = 0 and lse = -inf."""
    causal = case[-1]
    q_ids = packed_ids(q_lengths)
    kv_ids = q_ids if kv_lengths is None else packed_ids(kv_lengths) + 1  # ids 1, 2, 3
    ids = q_ids if kv_lengths is None else (q_ids, kv_ids)
    mask = (q_ids[:, :, None] == kv_ids[:, None, :])[:, None]  # (B, 1, Nq, Nk)
    q, k, v, do, dlse = make_inputs(case)

    def run(fn, q, k, v):
        return values_and_grads(lambda q, k, v: fn(q, k, v), q, k, v, do, dlse)
    ref = lambda q, k, v: lj.attention_ref(q, k, v, causal=causal, attn_mask=mask,  # noqa: E731
                                           window_size=window)
    blockwise = lambda q, k, v: lj.attention(q, k, v, causal=causal, return_lse=True,  # noqa: E731
                                             block_m=32, block_n=16, segment_ids=ids,
                                             window_size=window)
    lowp = [x.astype(jnp.float32) for x in (q, k, v)]
    ref64, ref32, out = run(ref, q, k, v), run(ref, *lowp), run(blockwise, *lowp)
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), out, ref32, ref64):
        check_close(f"{case_id(case)} segments {name}", to_torch(a), to_torch(b), to_torch(r))
    if kv_lengths is not None:  # queries of segment 0: no key has it
        assert bool(jnp.isneginf(out[1][:, :, :q_lengths[0]]).all())
        assert float(jnp.abs(out[0][:, :q_lengths[0]]).max()) == 0.0


def test_segment_ids_under_jit_and_vmap():
    """segment_ids as traced arguments: jax.jit and jax.vmap (over layouts) give the eager
    values."""
    q, k, v, _, _ = (x.astype(jnp.float32) for x in make_inputs((1, 64, 64, 2, 2, 32, True)))
    layouts = jnp.concatenate([packed_ids([20, 44]), packed_ids([50, 7, 7])])
    run = lambda ids: lj.attention(q, k, v, causal=True, block_m=32, block_n=16,  # noqa: E731
                                   segment_ids=ids[None])
    eager = [run(ids) for ids in layouts]
    for i, ids in enumerate(layouts):
        np.testing.assert_allclose(jax.jit(run)(ids), eager[i], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.vmap(run)(layouts), jnp.stack(eager), rtol=1e-6, atol=1e-6)


def ones(*shape, dtype=np.float32):
    return np.ones(shape, dtype)


DROPOUT = [(2, 45, 70, 4, 2, 32, True), (1, 113, 97, 2, 2, 40, False)]


@pytest.mark.parametrize("case", DROPOUT, ids=[case_id(c) for c in DROPOUT])
def test_dropout(case):
    """Dropout (p = 0.3) against the reference with the same elements dropped, by the
    tolerance rule (o, lse and every gradient): the backward pass regenerates each tile's
    mask."""
    check_blockwise(case_id(case) + "-dropout", *make_inputs(case), causal=case[-1],
                    dropout_p=0.3, dropout_rng=(7 << 32) + 11)


def test_dropout_drops_what_longflash_attention_drops():
    """An int seed: the output and gradients of longflash.attention (PyTorch path, float64)
    with the same seed, so both bindings train the same model the same way."""
    case = DROPOUT[0]
    q, k, v, do, _ = make_inputs(case)
    seed = (3 << 32) + 5

    def loss(q, k, v):
        return (lj.attention(q, k, v, causal=True, dropout_p=0.25, dropout_rng=seed,
                             block_m=32, block_n=16) * do).sum()
    got = [lj.attention(q, k, v, causal=True, dropout_p=0.25, dropout_rng=seed),
           *jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]
    tq, tk, tv = (to_torch(x).requires_grad_() for x in (q, k, v))
    import longflash
    o = longflash.attention(tq, tk, tv, causal=True, dropout_p=0.25, seed=seed, backend="torch")
    expected = [o, *torch.autograd.grad((o * to_torch(do)).sum(), (tq, tk, tv))]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, expected):
        np.testing.assert_allclose(np.asarray(a), b.detach().numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_dropout_with_a_traced_key():
    """A jax.random key under jit: the same key gives the eager result, another key another
    mask; about dropout_p of the probabilities drop (o of v = ones counts the kept mass)."""
    q, k, v, _, _ = make_inputs((1, 64, 64, 2, 2, 16, False))
    ones_v = jnp.ones_like(v)
    run = jax.jit(lambda key, v: lj.attention(q, k, v, dropout_p=0.5, dropout_rng=key,
                                              block_m=32, block_n=16))
    key, other = jax.random.split(jax.random.key(0))
    eager = lj.attention(q, k, v, dropout_p=0.5, dropout_rng=key, block_m=32, block_n=16)
    np.testing.assert_allclose(np.asarray(run(key, v)), np.asarray(eager), rtol=1e-12)
    assert not np.allclose(np.asarray(run(other, v)), np.asarray(eager))
    kept = np.asarray(run(key, ones_v))[..., 0]  # sum of the kept probabilities / (1 - p)
    assert 0.9 < kept.mean() < 1.1 and kept.std() > 0.05


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(q=ones(2, 3, 4)), ValueError, "q must have 4 dimensions"),
    (dict(k=[[1.0]]), TypeError, "k must be a jax.Array"),
    (dict(v=ones(1, 5, 2, 8, dtype=np.int32)), TypeError, "v has dtype int32"),
    (dict(q=ones(1, 4, 2, 8, dtype=np.float16)), TypeError, "same dtype"),
    (dict(v=ones(1, 6, 2, 8)), ValueError, "k and v must agree in"),
    (dict(q=ones(2, 4, 2, 8)), ValueError, "same batch size"),
    (dict(q=ones(1, 4, 2, 16)), ValueError, "same headdim"),
    (dict(q=ones(1, 4, 3, 8)), ValueError, "multiple of nheads_kv"),
    (dict(q=ones(1, 4, 2, 300), k=ones(1, 5, 2, 300), v=ones(1, 5, 2, 300)), ValueError,
     "headdim must be between"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive"),
    (dict(softmax_scale="1"), TypeError, "softmax_scale must be"),
    (dict(block_m=0), ValueError, "block_m must be a positive int"),
    (dict(block_n=16.0), ValueError, "block_n must be a positive int"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend="triton"), ValueError, "backend='triton' needs GPU arrays"),
    (dict(window_size=3), TypeError, "window_size must be a pair"),
    (dict(softcap=-1.0), ValueError, "softcap must be a finite float"),
    (dict(alibi_slopes=ones(3)), ValueError, "alibi_slopes must have shape"),
    (dict(alibi_slopes=ones(2, dtype=np.int32)), TypeError, "alibi_slopes must be a float"),
    (dict(alibi_slopes=ones(2), backend="triton"), NotImplementedError, "alibi_slopes"),
    (dict(softcap="1"), TypeError, "softcap must be"),
    (dict(window_size=(-2, 0)), ValueError, "window_size entries"),
    (dict(attn_mask=ones(4, 6)), ValueError, "attn_mask must be broadcastable"),
    (dict(attn_mask=ones(1, 3, 4, 5)), ValueError, "attn_mask must be broadcastable"),
    (dict(attn_mask=ones(4, 5, dtype=np.int32)), TypeError, "attn_mask must be a bool"),
    (dict(attn_mask=[[True]]), TypeError, "attn_mask must be a bool"),
    (dict(attn_mask=ones(4, 5), backend="triton"), NotImplementedError, "attn_mask"),
    (dict(segment_ids=ones(1, 4, dtype=np.int32)), ValueError, "kv_segment_ids must have shape"),
    (dict(segment_ids=(ones(1, 4, dtype=np.int32), ones(1, 4, dtype=np.int32))), ValueError,
     r"kv_segment_ids must have shape \(batch, seqlen\) = \(1, 5\)"),
    (dict(segment_ids=ones(1, 4)), TypeError, "segment_ids must be an integer array"),
    (dict(segment_ids=(ones(1, 4, dtype=np.int32),)), TypeError, "segment_ids must be"),
    (dict(segment_ids=(ones(1, 4, dtype=np.int32), ones(1, 5, dtype=np.int32)),
          backend="triton"), NotImplementedError, "segment_ids"),
    (dict(dropout_p=1.0, dropout_rng=0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1", dropout_rng=0), TypeError, "dropout_p must be a float"),
    (dict(dropout_p=0.1), TypeError, "dropout_p > 0 needs dropout_rng"),
    (dict(dropout_p=0.1, dropout_rng=ones(2)), TypeError, "dropout_p > 0 needs dropout_rng"),
    (dict(dropout_p=0.1, dropout_rng=-1), ValueError, "dropout_rng as an int seed"),
    (dict(dropout_p=0.1, dropout_rng=0, backend="triton"), NotImplementedError, "dropout"),
])
def test_bad_input(kwargs, error, match):
    args = {**dict(q=ones(1, 4, 2, 8), k=ones(1, 5, 2, 8), v=ones(1, 5, 2, 8)), **kwargs}
    with pytest.raises(error, match=match):
        lj.attention(**args)


def _interpreted_triton_call(*args, kernel, out_type, grid, num_warps=None, num_stages=None,
                             **kwargs):
    """Stand-in for jax_triton.triton_call (its keyword form): checks that every kernel
    parameter is named except the outputs, which fill the rest in order, then runs the
    kernel under TRITON_INTERPRET=1 on CPU copies of the arrays."""
    import triton.language as tl
    assert not args, "launch arguments are passed by name"
    params = inspect.signature(kernel.fn).parameters.values()
    constexpr = {p.name for p in params if p.annotation in (tl.constexpr, "tl.constexpr")}
    names = [p.name for p in params]
    assert set(kwargs) <= set(names), f"not parameters of {kernel}: {set(kwargs) - set(names)}"
    assert constexpr <= set(kwargs), f"constexprs not given: {constexpr - set(kwargs)}"
    missing = [n for n in names if n not in kwargs and n not in constexpr]
    outs = out_type if isinstance(out_type, tuple) else (out_type,)
    assert len(missing) == len(outs), f"outputs {missing} for {len(outs)} out_type entries"
    outputs = {n: torch.full(o.shape, float("nan"), dtype=getattr(torch, np.dtype(o.dtype).name))
               for n, o in zip(missing, outs)}
    inputs = {n: torch.from_numpy(np.array(x)) if isinstance(x, jax.Array) else x
              for n, x in kwargs.items()}
    kernel[grid](**inputs, **outputs)
    results = tuple(jnp.asarray(outputs[n].numpy()) for n in missing)
    return results if isinstance(out_type, tuple) else results[0]


@pytest.mark.skipif(not INTERPRET, reason="runs the kernels under TRITON_INTERPRET=1 (no GPU)")
@pytest.mark.parametrize("headdim_v", [40, 24])
def test_triton_path_arguments(headdim_v, monkeypatch):
    """The GPU path's launches (names, strides, lse and delta layouts, GQA grid, the values'
    head dim) give the blockwise path's results when the kernels run in Triton's interpreter.
    jax_triton itself and GPU compilation remain untested."""
    monkeypatch.setitem(sys.modules, "jax_triton",
                        types.SimpleNamespace(triton_call=_interpreted_triton_call))
    case = (2, 17, 33, 4, 2, 40, True)
    q, k, v, do, dlse = (x.astype(jnp.float32) for x in make_inputs(case, seed=2))
    v, do = v[..., :headdim_v], do[..., :headdim_v]
    cfg = lj._Config(True, 40 ** -0.5, 32, 16, "triton")
    o, lse = lj._triton_forward(q, k, v, cfg)
    grads = lj._triton_backward(do, dlse, q, k, v, o, lse, cfg)
    cfg = cfg._replace(backend="jax")
    o_ref, lse_ref = lj._forward_dense(q, k, v, cfg)
    grads_ref = lj._backward_dense(do, dlse, q, k, v, o_ref, lse_ref, cfg)
    for name, a, r in zip(("o", "lse", "dq", "dk", "dv"), (o, lse, *grads),
                          (o_ref, lse_ref, *grads_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_jax_triton_requirement_decides(monkeypatch):
    """jax-triton 0.4 imports with triton 3.6 (the GPU machines') but stubs out its NVIDIA
    backend, so its own requirement on triton decides whether the Triton path is usable."""
    pytest.importorskip("packaging")
    from importlib import metadata
    monkeypatch.setattr(metadata, "requires", lambda dist: [
        "absl-py>=1.4.0", "jax>=0.11.0", "triton>=3.7", 'pytest; extra == "tests"'])
    assert lj._unmet_requirement("jax-triton", "triton", "3.6.0") == "triton>=3.7"
    assert lj._unmet_requirement("jax-triton", "triton", "3.7.0") is None

    def not_installed(dist):
        raise metadata.PackageNotFoundError(dist)
    monkeypatch.setattr(metadata, "requires", not_installed)
    assert lj._unmet_requirement("jax-triton", "triton", "3.6.0") is None
    try:
        import jax_triton  # noqa: F401
    except ImportError:  # here: no jax-triton (it needs a CUDA jaxlib), and the reason says so
        assert lj.jax_triton_missing().startswith("jax_triton is not importable")
