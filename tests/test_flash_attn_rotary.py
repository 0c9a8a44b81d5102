"""longflash.flash_attn.layers.rotary: flash_attn.layers.rotary's API (flash_attn 2.7's
signatures, written out below) against an independent float64 rotation (complex
multiplication, one token at a time), with the tolerance rule: batched and packed inputs,
offsets as ints and per sequence, partial and interleaved rotary dims, in place and not,
gradients, the packed-qkv forms and RotaryEmbedding's tables (XPos included)."""

import inspect
import math

import pytest
import torch

from conftest import check_close
from longflash.flash_attn.layers import rotary

ROTARY_SIGNATURES = {  # flash_attn 2.7, flash_attn/layers/rotary.py: (name, default)
    "apply_rotary_emb": [("x", None), ("cos", None), ("sin", None), ("interleaved", False),
                         ("inplace", False), ("seqlen_offsets", 0), ("cu_seqlens", None),
                         ("max_seqlen", None)],
    "apply_rotary_emb_qkv_": [("qkv", None), ("cos", None), ("sin", None), ("cos_k", None),
                              ("sin_k", None), ("interleaved", False), ("seqlen_offsets", 0),
                              ("num_heads_q", None)],
    "apply_rotary_emb_kv_": [("kv", None), ("cos", None), ("sin", None), ("interleaved", False),
                             ("seqlen_offsets", 0)],
}
OPS_SIGNATURE = [("x", None), ("cos", None), ("sin", None), ("seqlen_offsets", 0),  # ops.triton
                 ("cu_seqlens", None), ("max_seqlen", None), ("interleaved", False),
                 ("inplace", False), ("conjugate", False)]
ROTARY_EMBEDDING_SIGNATURES = {
    "__init__": [("dim", None), ("base", 10000.0), ("interleaved", False), ("scale_base", None),
                 ("device", None)],
    "forward": [("qkv", None), ("kv", None), ("seqlen_offset", 0), ("max_seqlen", None),
                ("num_heads_q", None)],
}


def _params(fn):
    empty = inspect.Parameter.empty
    return [(p.name, None if p.default is empty else p.default)
            for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", list(ROTARY_SIGNATURES))
def test_signature_is_flash_attn_s(name):
    assert _params(getattr(rotary, name)) == ROTARY_SIGNATURES[name]


def test_rotary_embedding_signature_is_flash_attn_s():
    for name, expected in ROTARY_EMBEDDING_SIGNATURES.items():
        assert _params(getattr(rotary.RotaryEmbedding, name)) == expected, name
    assert rotary.apply_rotary_emb_func is rotary.apply_rotary_emb


def rotate_ref(x, cos, sin, positions, interleaved):
    """x: (tokens, nheads, headdim) rotated token by token at positions (tokens,), in float64:
    each pair (a, b) of the first rotary_dim dims as a + ib times cos + i sin."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = cos.shape[1]
    out = x.clone()
    for t, p in enumerate(positions.tolist()):
        if interleaved:
            a, b = x[t, :, 0:2 * half:2], x[t, :, 1:2 * half:2]
        else:
            a, b = x[t, :, :half], x[t, :, half:2 * half]
        z = torch.complex(a, b) * torch.complex(cos[p], sin[p])
        if interleaved:
            out[t, :, 0:2 * half:2], out[t, :, 1:2 * half:2] = z.real, z.imag
        else:
            out[t, :, :half], out[t, :, half:2 * half] = z.real, z.imag
    return out


def lowp(x, cos, sin, positions, interleaved):
    """The same rotation in x's dtype (PyTorch's low-precision error, for the bound)."""
    half = cos.shape[1]
    c, s = cos[positions].to(x.dtype)[:, None], sin[positions].to(x.dtype)[:, None]
    a, b = (x[..., 0:2 * half:2], x[..., 1:2 * half:2]) if interleaved else \
        (x[..., :half], x[..., half:2 * half])
    out = x.clone()
    ra, rb = a * c - b * s, a * s + b * c
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = ra, rb
    else:
        out[..., :half], out[..., half:2 * half] = ra, rb
    return out


def tables(seqlen_ro, rotary_dim, dtype=torch.float32):
    angles = torch.rand(seqlen_ro, rotary_dim // 2, generator=torch.Generator().manual_seed(1))
    return (angles * 2 * math.pi).cos().to(dtype), (angles * 2 * math.pi).sin().to(dtype)


CASES = [  # (batch, seqlen, nheads, headdim, rotary_dim, offsets, interleaved)
    (2, 17, 3, 64, 64, 0, False),
    (3, 9, 2, 40, 16, 5, True),
    (2, 13, 4, 80, 32, [0, 7], False),
    (1, 1, 2, 59, 58, [30], True),
]


def case_id(c):
    return f"B{c[0]}-N{c[1]}-H{c[2]}-D{c[3]}-R{c[4]}-off{c[5]}" + ("-interleaved" if c[6] else "")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_batched_matches_reference_with_gradients(case, dtype):
    batch, seqlen, nheads, headdim, rotary_dim, offsets, interleaved = case
    x = torch.randn(batch, seqlen, nheads, headdim, dtype=dtype, requires_grad=True)
    cos, sin = tables(seqlen + 31, rotary_dim, dtype)
    off = offsets if isinstance(offsets, int) else torch.tensor(offsets)
    out = rotary.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=off)
    assert out.dtype == dtype and out.shape == x.shape
    per_seq = torch.tensor([offsets] * batch if isinstance(offsets, int) else offsets)
    do = torch.randn_like(out)
    out.backward(do)
    for b in range(batch):
        pos = torch.arange(seqlen) + per_seq[b]
        ref = rotate_ref(x[b].detach(), cos, sin, pos, interleaved)
        check_close(f"{case_id(case)} b{b} out", out[b].detach(),
                    lowp(x[b].detach(), cos, sin, pos, interleaved), ref)
        # the rotation is orthogonal: dx is do rotated back (sin negated)
        grad_ref = rotate_ref(do[b], cos, -sin, pos, interleaved)
        check_close(f"{case_id(case)} b{b} dx", x.grad[b], lowp(do[b], cos, -sin, pos,
                                                                 interleaved), grad_ref)
        torch.testing.assert_close(out[b, ..., rotary_dim:], x[b, ..., rotary_dim:],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("offsets", [3, [0, 4, 1]], ids=["int", "tensor"])
def test_packed_sequences(offsets):
    """cu_seqlens: each sequence's tokens from their own first position (plus its offset);
    the rows past cu_seqlens[-1] returned as they are; the same as each sequence batched."""
    lengths = [5, 0, 8]
    cu = torch.tensor([0, 5, 5, 13], dtype=torch.int32)
    x = torch.randn(15, 2, 32)
    cos, sin = tables(16, 24)
    off = offsets if isinstance(offsets, int) else torch.tensor(offsets)
    out = rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=off, cu_seqlens=cu, max_seqlen=8)
    per_seq = [offsets] * 3 if isinstance(offsets, int) else offsets
    pos = torch.cat([torch.arange(n) + o for n, o in zip(lengths, per_seq)])
    check_close("packed", out[:13], lowp(x[:13], cos, sin, pos, False),
                rotate_ref(x[:13], cos, sin, pos, False))
    assert torch.equal(out[13:], x[13:])
    start = 5
    alone = rotary.apply_rotary_emb(x[None, start:start + 8], cos, sin,
                                    seqlen_offsets=per_seq[2])
    assert torch.equal(out[start:start + 8], alone[0])
    none = torch.zeros(1, dtype=torch.int32)  # no sequence: every row as it is
    assert torch.equal(rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=off[:0] if isinstance(
        off, torch.Tensor) else off, cu_seqlens=none), x)


def test_inplace_writes_x_and_its_gradient_flows():
    w = torch.randn(16, 16, requires_grad=True)
    h = torch.randn(2, 7, 16)
    cos, sin = tables(9, 8)
    x = (h @ w).view(2, 7, 2, 8)  # a non-leaf, as a projection's output
    expected = rotary.apply_rotary_emb(x.detach(), cos, sin, seqlen_offsets=2)
    out = rotary.apply_rotary_emb(x, cos, sin, inplace=True, seqlen_offsets=2)
    assert out is x and torch.equal(x.detach(), expected)
    out.sum().backward()
    w_ref = w.detach().clone().requires_grad_()
    rotary.apply_rotary_emb((h @ w_ref).view(2, 7, 2, 8), cos, sin, seqlen_offsets=2).sum() \
        .backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


@pytest.mark.parametrize("packing", ["3", "gqa"])
def test_qkv_and_kv_forms(packing):
    """apply_rotary_emb_qkv_ rotates q and k (k with cos_k, sin_k when given) of a packed qkv
    in place and leaves v; apply_rotary_emb_kv_ rotates k of a packed kv; both equal
    apply_rotary_emb on each part."""
    batch, seqlen, heads, d = 2, 6, 4, 16
    cos, sin = tables(10, 16)
    cos_k, sin_k = tables(10, 16)[1], tables(10, 16)[0]
    off = torch.tensor([1, 3])
    if packing == "3":
        qkv = torch.randn(batch, seqlen, 3, heads, d)
        q, k, v = qkv[:, :, 0].clone(), qkv[:, :, 1].clone(), qkv[:, :, 2].clone()
        parts = lambda t: (t[:, :, 0], t[:, :, 1], t[:, :, 2])  # noqa: E731
        nq = None
    else:
        nq, nk = 4, 2
        qkv = torch.randn(batch, seqlen, nq + 2 * nk, d)
        q, k, v = (qkv[:, :, a:b].clone() for a, b in ((0, nq), (nq, nq + nk),
                                                       (nq + nk, nq + 2 * nk)))
        parts = lambda t: (t[:, :, :nq], t[:, :, nq:nq + nk], t[:, :, nq + nk:])  # noqa: E731
    out = rotary.apply_rotary_emb_qkv_(qkv, cos, sin, cos_k, sin_k, seqlen_offsets=off,
                                       num_heads_q=nq)
    assert out is qkv
    rq, rk, rv = parts(qkv)
    assert torch.equal(rq, rotary.apply_rotary_emb(q, cos, sin, seqlen_offsets=off))
    assert torch.equal(rk, rotary.apply_rotary_emb(k, cos_k, sin_k, seqlen_offsets=off))
    assert torch.equal(rv, v)
    kv = torch.randn(batch, seqlen, 2, heads, d)
    k, v = kv[:, :, 0].clone(), kv[:, :, 1].clone()
    assert rotary.apply_rotary_emb_kv_(kv, cos, sin, True, off) is kv
    assert torch.equal(kv[:, :, 0], rotary.apply_rotary_emb(k, cos, sin, True,
                                                            seqlen_offsets=off))
    assert torch.equal(kv[:, :, 1], v)


@pytest.mark.parametrize("scale_base", [None, 64], ids=["rope", "xpos"])
def test_rotary_embedding_tables_and_forward(scale_base):
    """RotaryEmbedding's tables: cos / sin of t * base^(-2i / dim) (XPos: q's times, k's
    divided by the scale ^ ((t - n // 2) / scale_base)), grown on demand; forward rotates qkv
    (or q and kv) in place with them; a partial rotary dim leaves the rest."""
    dim, headdim, base = 8, 12, 500.0
    rope = rotary.RotaryEmbedding(dim, base=base, scale_base=scale_base)
    qkv = torch.randn(2, 5, 3, 2, headdim, dtype=torch.float64)
    q, k, v = (qkv[:, :, i].clone() for i in range(3))
    rope(qkv, seqlen_offset=3)
    n = rope._seq_len_cached
    assert n == 8
    t = torch.arange(n, dtype=torch.float64)[:, None]
    i2 = torch.arange(0, dim, 2, dtype=torch.float64)
    angles = t * base ** (-i2 / dim)
    scale = torch.ones(n, dim // 2, dtype=torch.float64) if scale_base is None else \
        ((i2 + 0.4 * dim) / (1.4 * dim)) ** ((t - n // 2) / scale_base)
    for name, expected in (("_cos_cached", angles.cos() * scale), ("_sin_cached",
                                                                    angles.sin() * scale)):
        torch.testing.assert_close(getattr(rope, name), expected, rtol=0, atol=1e-5)
    cos_k = rope._cos_cached if scale_base is None else rope._cos_k_cached
    sin_k = rope._sin_cached if scale_base is None else rope._sin_k_cached
    if scale_base is not None:
        torch.testing.assert_close(cos_k, angles.cos() / scale, rtol=0, atol=1e-5)
    pos = torch.arange(5).repeat(2) + 3
    for part, x, c, s in ((0, q, rope._cos_cached, rope._sin_cached), (1, k, cos_k, sin_k)):
        ref = rotate_ref(x.reshape(10, 2, headdim), c, s, pos, False).view(2, 5, 2, headdim)
        torch.testing.assert_close(qkv[:, :, part], ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(qkv[:, :, 2], v)
    rope(torch.randn(1, 20, 3, 2, headdim, dtype=torch.float64))
    assert rope._seq_len_cached == 20  # grown
    q2, kv2 = torch.randn(2, 4, 2, headdim), torch.randn(2, 4, 2, 2, headdim)
    q_ref, kv_ref = q2.clone(), kv2.clone()
    got_q, got_kv = rope(q2, kv2, seqlen_offset=torch.tensor([0, 6]), max_seqlen=12)
    assert got_q is q2 and got_kv is kv2 and rope._cos_cached.dtype == torch.float32
    off = torch.tensor([0, 6])
    assert torch.equal(q2, rotary.apply_rotary_emb(q_ref, rope._cos_cached, rope._sin_cached,
                                                   seqlen_offsets=off))
    k_tables = (rope._cos_cached, rope._sin_cached) if scale_base is None else \
        (rope._cos_k_cached, rope._sin_k_cached)
    assert torch.equal(kv2[:, :, 0], rotary.apply_rotary_emb(kv_ref[:, :, 0], *k_tables,
                                                             seqlen_offsets=off))


def test_bad_input_raises_naming_the_argument():
    x = torch.randn(2, 6, 2, 16)
    cos, sin = tables(8, 8)
    cases = [
        (lambda: rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=3), ValueError,
         "position 8 is needed"),
        (lambda: rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 3])),
         ValueError, "position 8"),
        (lambda: rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0])),
         ValueError, "seqlen_offsets"),
        (lambda: rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=-1), ValueError,
         "seqlen_offsets must be >= 0"),
        (lambda: rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=1.5), TypeError,
         "seqlen_offsets"),
        (lambda: rotary.apply_rotary_emb(x, cos, sin[:, :3]), ValueError, "same shape"),
        (lambda: rotary.apply_rotary_emb(x, *tables(8, 18)), ValueError, "rotary_dim"),
        (lambda: rotary.apply_rotary_emb(x, cos.long(), sin), TypeError, "cos must be"),
        (lambda: rotary.apply_rotary_emb(x[0], cos, sin), ValueError, "x must be"),
        (lambda: rotary.apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor([0, 9])),
         ValueError, "cu_seqlens must be"),
        (lambda: rotary.apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor(
            [0, 9], dtype=torch.int32)), ValueError, "past x's 6 tokens"),
        (lambda: rotary.apply_rotary_emb(x[0], cos, sin, cu_seqlens=torch.tensor(
            [0, 4, 6], dtype=torch.int32), max_seqlen=3), ValueError, "max_seqlen"),
        (lambda: rotary.apply_rotary_emb(x[0], cos, sin, seqlen_offsets=5, cu_seqlens=torch.
                                         tensor([0, 4], dtype=torch.int32)), ValueError,
         "position 8"),
        (lambda: rotary.apply_rotary_emb_qkv_(torch.randn(2, 6, 8, 16), cos, sin), ValueError,
         "num_heads_q"),
        (lambda: rotary.apply_rotary_emb_qkv_(torch.randn(2, 6, 8, 16), cos, sin,
                                              num_heads_q=3), ValueError, "num_heads_q"),
        (lambda: rotary.apply_rotary_emb_kv_(torch.randn(2, 6, 3, 2, 16), cos, sin),
         ValueError, "kv must be"),
        (lambda: rotary.RotaryEmbedding(7), ValueError, "dim"),
        (lambda: rotary.RotaryEmbedding(8)(torch.randn(2, 6, 3, 2, 16),
                                           seqlen_offset=torch.tensor([0, 1])),
         ValueError, "max_seqlen"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_same_rotation_as_flash_attn_with_kvcache(interleaved):
    """q and the new k rotated by apply_rotary_emb at the cache's lengths, then decoding
    without rotary, give bit for bit flash_attn_with_kvcache with rotary_cos / rotary_sin (as
    FlashAttention's two paths do)."""
    from longflash.flash_attn import flash_attn_with_kvcache
    batch, cap, heads, heads_kv, d = 2, 24, 4, 2, 32
    g = torch.Generator().manual_seed(3)
    q = torch.randn(batch, 2, heads, d, generator=g)
    k, v = torch.randn(2, batch, 2, heads_kv, d, generator=g)
    caches = torch.randn(2, batch, cap, heads_kv, d, generator=g)
    lengths = torch.tensor([5, 17], dtype=torch.int32)
    cos, sin = tables(cap, 16)
    fused = flash_attn_with_kvcache(q, *caches.clone(), k, v, cos, sin, lengths, causal=True,
                                    rotary_interleaved=interleaved)
    rq, rk = (rotary.apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=lengths)
              for x in (q, k))
    apart = flash_attn_with_kvcache(rq, *caches.clone(), rk, v, cache_seqlens=lengths,
                                    causal=True)
    assert torch.equal(fused, apart)


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) captures per-sequence offsets and packed sequences (no
    read back), and gives what the eager call gives."""
    cos, sin = tables(32, 16)
    x, packed = torch.randn(2, 9, 2, 16), torch.randn(12, 2, 16)
    off, cu = torch.tensor([0, 20]), torch.tensor([0, 5, 12], dtype=torch.int32)

    def both(x, packed, off, cu):
        return (rotary.apply_rotary_emb(x, cos, sin, seqlen_offsets=off),
                rotary.apply_rotary_emb(packed, cos, sin, True, seqlen_offsets=off,
                                        cu_seqlens=cu, max_seqlen=7))
    got = torch.compile(both, fullgraph=True, backend="eager")(x, packed, off, cu)
    for a, b in zip(got, both(x, packed, off, cu)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ops_apply_rotary_and_its_conjugate():
    """flash_attn.ops.triton.rotary.apply_rotary: its signature; apply_rotary_emb's result in
    its own argument order; conjugate=True undoes the rotation (the inverse, float64)."""
    from longflash.flash_attn.ops.triton.rotary import apply_rotary
    assert _params(apply_rotary) == OPS_SIGNATURE
    x = torch.randn(2, 7, 3, 16, dtype=torch.float64)
    cos, sin = tables(12, 12, torch.float64)
    off = torch.tensor([0, 5])
    there = apply_rotary(x, cos, sin, off, interleaved=True)
    assert torch.equal(there, rotary.apply_rotary_emb(x, cos, sin, True, seqlen_offsets=off))
    back = apply_rotary(there, cos, sin, off, interleaved=True, conjugate=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-6)  # float32 tables: |cos + i sin| ~ 1
    assert (there - x).abs().max() > 0.1
