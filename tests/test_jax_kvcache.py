"""longflash.jax.attention_with_kvcache: decoding over a KV cache in JAX, against the
materializing reference run on each sequence's keys.

o and lse by the project's rule (`check_close`: the float32 result's max error against the
float64 reference at most twice that of the float32 reference plus a rounding floor); the
appended caches exactly. Tiles of 16 keys, so the odd capacities end in a partial block
(read as a block overlapping the one before).
"""

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="JAX not installed: pip install .[jax]")
import jax.numpy as jnp  # noqa: E402

import longflash.jax as lj  # noqa: E402
from conftest import check_close  # noqa: E402
from test_jax import to_torch, x64  # noqa: E402,F401  (x64: float64 while these tests run)


# (batch, seqlen_q, nheads, nheads_kv, headdim, headdim_v, capacity, lengths before the append,
#  seqlen_new, keywords)
CASES = [
    (3, 1, 4, 2, 40, 40, 97, [0, 17, 80], 1, dict(causal=True)),  # one token a step
    (2, 5, 6, 2, 64, 64, 203, [113, 40], 5, dict(causal=True)),  # a speculative step
    (2, 3, 8, 1, 64, 32, 130, [100, 7], 0, dict()),  # MQA, v's head dim smaller, no append
    (2, 4, 4, 4, 40, 40, 157, [150, 33], 2, dict(causal=True, window_size=(20, -1))),
    (1, 2, 4, 2, 59, 59, 113, [60], 2, dict(softcap=30.0)),
    (2, 3, 4, 2, 32, 32, 80, [30, 2], 3, dict(window_size=(4, 1))),  # a window both ways
]


def case_id(case):
    b, nq, h, hkv, d, dv, cap, lengths, new, kw = case
    flags = "-".join(f"{k}{v}" for k, v in kw.items())
    return f"B{b}-Nq{nq}-H{h}/{hkv}-D{d}/{dv}-C{cap}-L{lengths}-new{new}-{flags}"


def make_inputs(case, seed=0):
    """q, k_cache, v_cache, k, v (float64; k, v None without new tokens) and the lengths."""
    b, nq, h, hkv, d, dv, cap, lengths, new, _ = case
    rng = np.random.default_rng(seed)
    shapes = [(b, nq, h, d), (b, cap, hkv, d), (b, cap, hkv, dv), (b, new, hkv, d),
              (b, new, hkv, dv)]
    arrays = [jnp.asarray(rng.standard_normal(s), jnp.float64) for s in shapes]
    if not new:
        arrays[3:] = None, None
    return (*arrays, jnp.asarray(lengths, jnp.int32))


def appended(cache, new, lengths):
    """The expected cache after the append, built in numpy."""
    out = np.array(cache)
    for b, n in enumerate(np.asarray(lengths)):
        if new is not None:
            out[b, n:n + new.shape[1]] = np.asarray(new[b])
    return out


def reference(q, k_cache, v_cache, lengths, new, **kw):
    """(o, lse) of attention_ref over each sequence's keys after the append."""
    outs = [lj.attention_ref(q[b:b + 1], k_cache[b:b + 1, :n + new], v_cache[b:b + 1, :n + new],
                             **kw) for b, n in enumerate(np.asarray(lengths))]
    return jnp.concatenate([o for o, _ in outs]), jnp.concatenate([lse for _, lse in outs])


def paged(cache, page_size, seed=1):
    """A contiguous cache (B, capacity, Hkv, D) as pages in shuffled order, with two spare
    pages: (pages, block_table)."""
    b, cap = cache.shape[:2]
    max_pages = -(-cap // page_size)
    cache = np.pad(np.asarray(cache), [(0, 0), (0, max_pages * page_size - cap), (0, 0), (0, 0)])
    order = np.random.default_rng(seed).permutation(b * max_pages + 2)
    pages = np.zeros((b * max_pages + 2, page_size) + cache.shape[2:], cache.dtype)
    table = order[:b * max_pages].reshape(b, max_pages)
    pages[table] = cache.reshape(b, max_pages, page_size, *cache.shape[2:])
    return jnp.asarray(pages), jnp.asarray(table, jnp.int32)


def unpaged(pages, table, capacity):
    return np.asarray(pages)[np.asarray(table)].reshape(table.shape[0], -1,
                                                        *pages.shape[2:])[:, :capacity]


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_matches_reference(case, page_size):
    """float32 o and lse against the float64 reference by the tolerance rule; the caches
    after the append exactly as expected; the rows past each sequence's end filled with NaN
    (they must not be read into the output)."""
    q, k_cache, v_cache, k, v, lengths = make_inputs(case)
    kw, new, cap = case[-1], case[-2], case[6]
    k_full, v_full = (jnp.asarray(appended(c, x, lengths)) for c, x in ((k_cache, k), (v_cache, v)))
    ref64 = reference(q, k_full, v_full, lengths, new, **kw)
    lowp = [None if x is None else x.astype(jnp.float32) for x in (q, k_full, v_full, k, v)]
    ref32 = reference(*lowp[:3], lengths, new, **kw)
    past_end = np.arange(cap)[None, :] >= np.asarray(lengths)[:, None]  # (B, capacity)
    caches = [jnp.where(past_end[:, :, None, None], jnp.nan, c.astype(jnp.float32))
              for c in (k_cache, v_cache)]
    table = None
    if page_size:
        (k_pages, table), (v_pages, _) = (paged(c, page_size) for c in caches)
        caches = [k_pages, v_pages]
    (o, lse), k_out, v_out = lj.attention_with_kvcache(
        lowp[0], *caches, *lowp[3:], cache_seqlens=lengths, block_table=table, return_lse=True,
        block_n=16, **kw)
    label = case_id(case) + ("" if page_size is None else f"-paged{page_size}")
    for name, a, b, r in zip(("o", "lse"), (o, lse), ref32, ref64):
        assert a.shape == r.shape, name
        check_close(f"{label} {name}", to_torch(a), to_torch(b), to_torch(r))
    for name, out, cache, x in (("k", k_out, caches[0], lowp[3]), ("v", v_out, caches[1], lowp[4])):
        got = np.asarray(out) if table is None else unpaged(out, table, cap)
        before = np.asarray(cache) if table is None else unpaged(cache, table, cap)
        np.testing.assert_array_equal(got, appended(before, x, lengths), err_msg=f"{name}_cache")


def tree_mask(lengths_after, seqlen_q, width, seed=4):
    """(batch, 1, seqlen_q, width) boolean: speculative decoding's draft tree, the last seqlen_q
    keys of each sequence; query i sees the cache before them and its ancestors and itself
    among them (parent of draft t: a random earlier draft, or none)."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((len(lengths_after), 1, seqlen_q, width), bool)
    for b, n in enumerate(lengths_after):
        parents = [-1] + [int(rng.integers(-1, t)) for t in range(1, seqlen_q)]
        mask[b, 0, :, :n - seqlen_q] = True
        for i in range(seqlen_q):
            t = i
            while t >= 0:
                mask[b, 0, i, n - seqlen_q + t] = True
                t = parents[t]
    return mask


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_alibi_and_attn_mask(page_size):
    """ALiBi (per sequence and head) with a speculative tree as a boolean attn_mask, then with
    a float mask broadcast over the batch and queries, against the reference on each
    sequence's keys (the mask's columns cut to its length) by the tolerance rule."""
    case = (2, 4, 4, 2, 40, 40, 101, [70, 21], 4, dict())
    q, k_cache, v_cache, k, v, lengths = make_inputs(case)
    after = [n + 4 for n in np.asarray(lengths)]
    rng = np.random.default_rng(5)
    slopes = jnp.asarray(rng.uniform(0.05, 0.5, (2, 4)))
    masks = [jnp.asarray(tree_mask(after, 4, 101)),
             jnp.asarray(rng.standard_normal((1, 4, 1, 90)))]  # L = 90 >= the lengths
    k_full, v_full = (jnp.asarray(appended(c, x, lengths)) for c, x in ((k_cache, k), (v_cache, v)))
    for mask in masks:
        def ref(q, k_all, v_all):
            outs = [lj.attention_ref(q[b:b + 1], k_all[b:b + 1, :n], v_all[b:b + 1, :n],
                                     alibi_slopes=slopes[b:b + 1],
                                     attn_mask=mask[min(b, mask.shape[0] - 1)][None, ..., :n])
                    for b, n in enumerate(after)]
            return [jnp.concatenate(x) for x in zip(*outs)]
        lowp = [x.astype(jnp.float32) for x in (q, k_cache, v_cache, k, v, k_full, v_full)]
        caches, table = lowp[1:3], None
        if page_size:
            (k_pages, table), (v_pages, _) = (paged(c, page_size) for c in caches)
            caches = [k_pages, v_pages]
        (o, lse), _, _ = lj.attention_with_kvcache(
            lowp[0], *caches, *lowp[3:5], cache_seqlens=lengths, block_table=table,
            alibi_slopes=slopes.astype(jnp.float32), attn_mask=mask, return_lse=True, block_n=16)
        label = f"alibi-mask{mask.shape}-{page_size}"
        for name, a, b, r in zip(("o", "lse"), (o, lse), ref(*lowp[0:1], *lowp[5:]),
                                 ref(q, k_full, v_full)):
            check_close(f"{label} {name}", to_torch(a), to_torch(b), to_torch(r))


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rotary_as_longflash_attention_with_kvcache(interleaved, causal):
    """Rotary embeddings (rotary_dim 24 of head dim 40) give the output and caches of
    longflash.attention_with_kvcache (the PyTorch path, float64) with the same arguments:
    the new keys rotated at cache_seqlens + t, the queries at cache_seqlens (+ i if causal)."""
    import longflash
    case = (2, 3, 4, 2, 40, 40, 60, [30, 9], 3, dict())
    q, k_cache, v_cache, k, v, lengths = make_inputs(case)
    rng = np.random.default_rng(6)
    cos, sin = (jnp.asarray(rng.uniform(-1, 1, (40, 12))) for _ in range(2))
    kw = dict(causal=causal, rotary_interleaved=interleaved)
    o, k_out, v_out = lj.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths,
                                                rotary_cos=cos, rotary_sin=sin, block_n=16, **kw)
    t = [to_torch(x) for x in (q, k_cache, v_cache, k, v, lengths, cos, sin)]
    o_t = longflash.attention_with_kvcache(*t[:5], cache_seqlens=t[5].long(), rotary_cos=t[6],
                                           rotary_sin=t[7], backend="torch", **kw)
    np.testing.assert_allclose(np.asarray(o), o_t.numpy(), rtol=1e-10, atol=1e-12)
    for got, expected in ((k_out, t[1]), (v_out, t[2])):  # the PyTorch call appended in place
        np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_mla_qv_as_longflash_attention_with_kvcache(page_size):
    """MLA absorbed (qv: 40-dim latents in v_cache, head dim 16 for q and k), float64: o and
    lse those of longflash.attention_with_kvcache (the PyTorch path) and of the reference over
    [q, qv] against [keys, latents] (default scale 1/sqrt(16 + 40)), the caches appended."""
    import longflash
    case = (2, 2, 4, 1, 16, 40, 60, [33, 4], 2, dict(causal=True, window_size=(25, -1)))
    q, k_cache, v_cache, k, v, lengths = make_inputs(case)
    qv = jnp.asarray(np.random.default_rng(7).standard_normal((2, 2, 4, 40)))
    caches, table = [k_cache, v_cache], None
    if page_size:
        (k_pages, table), (v_pages, _) = (paged(c, page_size) for c in caches)
        caches = [k_pages, v_pages]
    (o, lse), k_out, v_out = lj.attention_with_kvcache(
        q, *caches, k, v, lengths, table, return_lse=True, qv=qv, block_n=16, **case[-1])
    t = [to_torch(x) for x in (q, *caches, k, v, qv)]
    o_t, lse_t = longflash.attention_with_kvcache(
        *t[:5], cache_seqlens=to_torch(lengths).long(),
        block_table=None if table is None else to_torch(table), return_lse=True, qv=t[5],
        backend="torch", **case[-1])
    np.testing.assert_allclose(np.asarray(o), o_t.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), lse_t.numpy(), rtol=1e-10, atol=1e-12)
    k_full, v_full = (jnp.asarray(appended(c, x, lengths)) for c, x in ((k_cache, k), (v_cache, v)))
    for out, full in ((k_out, k_full), (v_out, v_full)):
        got = np.asarray(out) if table is None else unpaged(out, table, 60)
        np.testing.assert_array_equal(got, np.asarray(full))
    keys = jnp.concatenate([k_full, v_full], -1)  # [rotary part, latent] of every token
    outs = [lj.attention_ref(jnp.concatenate([q[b:b + 1], qv[b:b + 1]], -1),
                             keys[b:b + 1, :n + 2], v_full[b:b + 1, :n + 2],
                             softmax_scale=56 ** -0.5, **case[-1])[0]
            for b, n in enumerate(np.asarray(lengths))]
    np.testing.assert_allclose(np.asarray(o), np.asarray(jnp.concatenate(outs)), rtol=1e-10,
                               atol=1e-12)


def test_a_sequence_without_keys():
    """Length 0 and nothing appended: o = 0 and lse = -inf for it, the others unaffected."""
    case = (2, 2, 4, 2, 32, 32, 40, [0, 25], 0, dict(causal=True))
    q, k_cache, v_cache, _, _, lengths = make_inputs(case)
    (o, lse), _, _ = lj.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               causal=True, return_lse=True, block_n=16)
    assert not np.asarray(o[0]).any() and np.isneginf(np.asarray(lse[0])).all()
    ref = reference(q[1:], k_cache[1:], v_cache[1:], lengths[1:], 0, causal=True)
    np.testing.assert_allclose(np.asarray(o[1:]), np.asarray(ref[0]), rtol=1e-12, atol=1e-12)


def test_a_jitted_decoding_loop_compiles_once():
    """Five steps of a jitted step (caches donated, lengths traced) equal the eager steps, and
    the step compiles once for every length; an int cache_seqlens (the default: the whole
    capacity) gives the same as an array."""
    case = (2, 1, 4, 2, 32, 32, 64, [3, 30], 1, dict(causal=True))
    q, k_cache, v_cache, _, _, lengths = make_inputs(case)
    rng = np.random.default_rng(2)
    new = [[jnp.asarray(rng.standard_normal((2, 1, 2, 32))) for _ in range(2)] for _ in range(5)]

    def step(q, k_cache, v_cache, k, v, lengths):
        return lj.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths, causal=True,
                                         block_n=16)

    jitted = jax.jit(step, donate_argnums=(1, 2))
    eager_caches = (k_cache, v_cache)
    jitted_caches = tuple(jnp.array(c, copy=True) for c in eager_caches)  # donated
    for t, (k, v) in enumerate(new):
        o_eager, *eager_caches = step(q, *eager_caches, k, v, lengths + t)
        o_jit, *jitted_caches = jitted(q, *jitted_caches, k, v, lengths + t)
        np.testing.assert_allclose(np.asarray(o_jit), np.asarray(o_eager), rtol=1e-12,
                                   atol=1e-12)
    assert jitted._cache_size() == 1
    for a, b in zip(jitted_caches, eager_caches):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    full = lj.attention_with_kvcache(q, k_cache, v_cache, block_n=16)[0]
    as_array = lj.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=jnp.full(2, 64),
                                         block_n=16)[0]
    np.testing.assert_array_equal(np.asarray(full), np.asarray(as_array))


def test_learnable_sink():
    case = CASES[1]
    q, k_cache, v_cache, k, v, lengths = make_inputs(case)
    sink = jnp.asarray(np.random.default_rng(3).standard_normal(case[2]))
    (o, lse), k_full, v_full = lj.attention_with_kvcache(
        q, k_cache, v_cache, k, v, lengths, causal=True, return_lse=True, learnable_sink=sink,
        block_n=16)
    ref = reference(q, k_full, v_full, lengths, case[-2], causal=True, learnable_sink=sink)
    for a, r in zip((o, lse), ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-12, atol=1e-12)


FP8 = ["float8_e4m3fn", "float8_e5m2"]


def _torch_bits(x):
    """A torch float8 tensor's bytes as a numpy uint8 array."""
    return x.view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt", FP8, ids=["e4m3", "e5m2"])
def test_fp8_quantize_is_torchs_bit_for_bit(fmt):
    """jax_kvcache.quantize gives the bytes of kvcache.quantize (the PyTorch path's append, which
    the Triton kernel matches): normal values, ties between two float8 values, subnormals,
    zeros of both signs, values past the largest (saturated), each with a per-(sequence, head)
    scale."""
    from longflash import kvcache
    from longflash.jax_kvcache import quantize
    dtype = getattr(torch, fmt)
    rng = np.random.default_rng(7)
    values = [rng.standard_normal((2, 64, 2, 16)).astype(np.float32) * 40]
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()  # every float8 value
    grid = grid[torch.isfinite(grid)].sort().values
    ties = ((grid[1:] + grid[:-1]) / 2).numpy()  # halfway between neighbours: nearest even
    edge = np.concatenate([ties, grid.numpy(), [0.0, -0.0, 1e-9, -1e-9, 1e6, -1e6]])
    values.append(np.resize(edge, (2, edge.size // 4 + 1, 2, 1)).astype(np.float32))
    for x in values:
        scale = rng.uniform(0.5, 2.0, (2, 2)).astype(np.float32) if x is values[0] else \
            np.ones((2, 2), np.float32)
        want = _torch_bits(kvcache.quantize(torch.from_numpy(x), torch.from_numpy(scale), dtype))
        got = np.asarray(quantize(jnp.asarray(x), jnp.asarray(scale), getattr(jnp, fmt)))
        np.testing.assert_array_equal(got.view(np.uint8), want)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("fmt", FP8, ids=["e4m3", "e5m2"])
def test_fp8_cache_matches_reference(fmt, page_size):
    """A float8 cache with per-(sequence, head) key scales and one value scale: o and lse
    (float32 queries) against the float64 reference over the cache's entries times their
    scales (the tolerance rule; the float32 computation over the same values the yardstick),
    the new keys and values appended as kvcache.quantize stores them, the rows past each
    sequence's end NaN (never read), and o and lse equal to longflash.attention_with_kvcache's
    (the PyTorch path) on the same cache."""
    import longflash
    from longflash import kvcache
    from longflash.jax_kvcache import quantize
    case = (2, 3, 6, 2, 40, 40, 97, [60, 13], 3, dict(causal=True))
    *arrays, lengths = make_inputs(case)
    q, k_cache, v_cache, k, v = (x.astype(jnp.float32) for x in arrays)
    fp8 = getattr(jnp, fmt)
    k_descale = jnp.asarray(np.random.default_rng(8).uniform(0.01, 0.05, (2, 2)), jnp.float32)
    v_descale = 1 / 32
    v_scale = jnp.full((2, 2), v_descale, jnp.float32)
    past_end = np.arange(97)[None, :] >= np.asarray(lengths)[:, None]
    caches = [jnp.where(past_end[:, :, None, None], jnp.nan, quantize(c, s, fp8))
              for c, s in ((k_cache, k_descale), (v_cache, v_scale))]
    table = None
    if page_size:
        (k_pages, table), (v_pages, _) = (paged(c, page_size) for c in caches)
        caches = [k_pages, v_pages]
    (o, lse), k_out, v_out = lj.attention_with_kvcache(
        q, *caches, k, v, cache_seqlens=lengths, block_table=table, return_lse=True,
        k_descale=k_descale, v_descale=v_descale, block_n=16, **case[-1])
    got = [np.asarray(x) if table is None else unpaged(x, table, 97) for x in (k_out, v_out)]
    for name, out, cache, new, scale in (("k", got[0], k_cache, k, k_descale),
                                         ("v", got[1], v_cache, v, v_scale)):
        want = quantize(jnp.asarray(appended(cache, new, lengths)), scale, fp8)  # the rows in use
        used = ~(np.arange(97)[None, :] >= np.asarray(lengths)[:, None] + 3)
        np.testing.assert_array_equal(out.view(np.uint8)[used], np.asarray(want).view(
            np.uint8)[used], err_msg=f"{name}_cache")
        torch_rows = kvcache.quantize(to_torch(new), to_torch(scale), getattr(torch, fmt))
        for b, n in enumerate(np.asarray(lengths)):  # the appended rows: the PyTorch path's bytes
            np.testing.assert_array_equal(out[b, n:n + 3].view(np.uint8), _torch_bits(
                torch_rows[b]), err_msg=f"{name}_cache appended")
    deq = [jnp.asarray(np.where(past_end[:, :, None, None] & ~used[:, :, None, None], 0.0,
                                x.astype(np.float64))) * s.astype(jnp.float64)[:, None, :, None]
           for x, s in ((got[0], k_descale), (got[1], v_scale))]
    ref64 = reference(q.astype(jnp.float64), *deq, lengths, 3, **case[-1])
    ref32 = reference(q, *(x.astype(jnp.float32) for x in deq), lengths, 3, **case[-1])
    label = f"{fmt}-{page_size}"
    for name, a, b, r in zip(("o", "lse"), (o, lse), ref32, ref64):
        check_close(f"{label} {name}", to_torch(a), to_torch(b), to_torch(r))
    t_caches = [torch.from_numpy(np.array(c).view(np.uint8)).view(getattr(torch, fmt))
                for c in caches]
    o_t, lse_t = longflash.attention_with_kvcache(
        to_torch(q), *t_caches, to_torch(k), to_torch(v), cache_seqlens=to_torch(lengths).long(),
        block_table=None if table is None else to_torch(table), return_lse=True,
        k_descale=to_torch(k_descale), v_descale=v_descale, backend="torch", **case[-1])
    np.testing.assert_allclose(np.asarray(o), o_t.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), lse_t.numpy(), rtol=1e-5, atol=1e-6)


def _bad_inputs():
    """(keywords replacing the valid call's, error, message)."""
    x = np.zeros
    return [
        (dict(q=x((2, 4, 32), np.float32)), ValueError, "q must have 4 dimensions"),
        (dict(q=[1.0]), TypeError, "q must be a jax.Array"),
        (dict(q=x((2, 1, 4, 32), np.int32)), TypeError, "q has dtype int32"),
        (dict(k_cache=x((2, 40, 2, 32), np.float64)), TypeError, "k_cache has dtype float64"),
        (dict(v_cache=x((2, 41, 2, 32), np.float32)), ValueError, "same shape but for the head"),
        (dict(k_cache=x((2, 40, 2, 16), np.float32)), ValueError, "k_cache headdim 16"),
        (dict(k_cache=x((2, 40, 3, 32), np.float32), v_cache=x((2, 40, 3, 32), np.float32)),
         ValueError, "multiple of the nheads_kv"),
        (dict(k_cache=x((3, 40, 2, 32), np.float32), v_cache=x((3, 40, 2, 32), np.float32)),
         ValueError, "a paged cache needs block_table"),
        (dict(v=None), ValueError, "k and v must be given together"),
        (dict(k=x((2, 1, 2, 16), np.float32)), ValueError, "k and v must have shapes"),
        (dict(cache_seqlens=40), ValueError, r"cache_seqlens \+ seqlen_new must lie in \[0, 40\]"),
        (dict(cache_seqlens=np.array([3, -1])), ValueError, "cache_seqlens in \\[-1, 3\\]"),
        (dict(cache_seqlens=np.array([3.0, 1.0])), TypeError, "cache_seqlens must be an int"),
        (dict(cache_seqlens=np.array([3])), TypeError, "cache_seqlens must be an int"),
        (dict(block_table=np.zeros((2, 4), np.int64)), TypeError, "block_table must be an int32"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(window_size=(3,)), TypeError, "window_size"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale"),
        (dict(learnable_sink=np.zeros(3, np.float32)), ValueError, "learnable_sink must have"),
        (dict(block_n=0), ValueError, "block_n must be a positive int"),
        (dict(alibi_slopes=x(3, np.float32)), ValueError, "alibi_slopes must have shape"),
        (dict(attn_mask=x((2, 1, 1, 3), bool)), ValueError, r"L >= seqlen_k.*\(2, 4, 1, 4\)"),
        (dict(attn_mask=x((1, 40), np.int32)), TypeError, "attn_mask must be a bool"),
        (dict(rotary_cos=x((50, 8), np.float32)), ValueError, "given together"),
        (dict(rotary_cos=x((50, 8), np.float32), rotary_sin=x((50, 8), np.float32), k=None,
              v=None), ValueError, "they need k and v"),
        (dict(rotary_cos=x((50, 8), np.int32), rotary_sin=x((50, 8), np.int32)), TypeError,
         "rotary_cos must be a floating-point array"),
        (dict(rotary_cos=x((50, 20), np.float32), rotary_sin=x((50, 20), np.float32)),
         ValueError, r"rotary_dim \(2 \* rotary_cos.shape\[1\] = 40\)"),
        (dict(rotary_cos=x((3, 8), np.float32), rotary_sin=x((3, 8), np.float32)), ValueError,
         "position 3 is needed"),
        (dict(k_descale=0.5), ValueError, "k_descale dequantizes a float8 cache"),
        (dict(qv=[1.0]), TypeError, "qv must be a jax.Array"),
        (dict(qv=x((2, 1, 4, 16), np.float32)), ValueError,
         r"qv must have shape .* \(2, 1, 4, 32\)"),
        (dict(qv=x((2, 1, 4, 32), np.float64)), TypeError, "qv has dtype float64"),
        (dict(k_cache=x((2, 40, 2, 32), jnp.float8_e4m3fn)), TypeError,
         "a float8 cache's keys and values must have one dtype"),
        (dict(k_cache=x((2, 40, 2, 32), jnp.float8_e5m2), v_cache=x((2, 40, 2, 32),
              jnp.float8_e5m2), v_descale=-1.0), ValueError, "v_descale must be positive"),
        (dict(k_cache=x((2, 40, 2, 32), jnp.float8_e5m2), v_cache=x((2, 40, 2, 32),
              jnp.float8_e5m2), k_descale=x((3, 2), np.float32)), TypeError,
         r"k_descale must be a float, or a float32 array broadcastable to \(batch, nheads_kv\)"),
    ]


@pytest.mark.parametrize("kwargs, error, match", _bad_inputs(),
                         ids=[m for _, _, m in _bad_inputs()])
def test_bad_input(kwargs, error, match):
    """A clear error naming the argument, raised before anything runs."""
    f32 = np.float32
    call = dict(q=np.zeros((2, 1, 4, 32), f32), k_cache=np.zeros((2, 40, 2, 32), f32),
                v_cache=np.zeros((2, 40, 2, 32), f32), k=np.zeros((2, 1, 2, 32), f32),
                v=np.zeros((2, 1, 2, 32), f32), cache_seqlens=3)
    call.update(kwargs)
    with pytest.raises(error, match=match):
        lj.attention_with_kvcache(**call)


def test_the_gpu_campaigns_jax_probe(tmp_path):
    """Stage 3's JAX probe (experiments.gpu_campaign.probe_jax) checks a decoding step too; here
    on the CPU both of its rows pass."""
    import json

    from experiments import gpu_campaign
    gpu_campaign.probe_jax(tmp_path / "jax.json")
    rows = {r["metric"]: r for r in json.loads((tmp_path / "jax.json").read_text())["rows"]}
    for metric in ("max_abs_diff_default_backend", "max_abs_diff_kvcache"):
        assert rows[metric]["status"] == "ok" and rows[metric]["value"] < 1e-3, rows[metric]
