"""merge_attention and attention_with_shared_prefix (cascade decoding over a prefix shared by
the batch): against the float64 reference over the keys each query sees (tolerance rule of
ARCHITECTURE.md: `check_close`); the Triton cases run under the interpreter (fp16 / fp32)."""

import pytest
import torch

import longflash
from longflash import attention_ref
from conftest import INTERPRET, check_close


def rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("split", [0, 1, 13, 29, 30])
def test_merge_attention_is_attention_over_both_parts(split):
    """Attention over keys [0, split) and [split, 30), merged, equals attention over all 30
    keys (float64: to rounding); a part with no key (split 0 or 30) changes nothing; causal
    rows that see no key of a part (its lse -inf) merge exactly, and rows that see none at
    all give 0 / -inf."""
    gen = torch.Generator().manual_seed(split)
    q, k, v = rand(gen, 2, 40, 4, 16), rand(gen, 2, 30, 2, 16), rand(gen, 2, 30, 2, 16)
    mask = torch.rand(2, 1, 40, 30, generator=gen) < 0.8
    mask[:, :, :3] = False  # rows that see no key at all
    whole = attention_ref(q, k, v, attn_mask=mask)
    parts = [attention_ref(q, k[:, s], v[:, s], attn_mask=mask[..., s])
             for s in (slice(0, split), slice(split, 30))]
    o, lse = longflash.merge_attention(*parts[0], *parts[1])
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(o, whole[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole[1], rtol=1e-12, atol=1e-12)
    assert torch.isneginf(lse[:, :, :3]).all() and (o[:, :3] == 0).all()


def test_merge_attention_gradients():
    """Differentiable: gradcheck in float64, through both outputs and both lse."""
    gen = torch.Generator().manual_seed(1)
    args = [rand(gen, 2, 5, 3, 4), rand(gen, 2, 3, 5), rand(gen, 2, 5, 3, 4), rand(gen, 2, 3, 5)]
    args = [x.requires_grad_() for x in args]
    assert torch.autograd.gradcheck(lambda *a: longflash.merge_attention(*a), args)


def test_merge_attention_bad_input():
    o, lse = torch.zeros(2, 5, 3, 4), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="lse_b \\(batch, nheads, seqlen_q\\)"):
        longflash.merge_attention(o, lse, o, lse.transpose(1, 2))
    with pytest.raises(ValueError, match="o_a and o_b must have the same shape"):
        longflash.merge_attention(o, lse, o[:, :, :, :2], lse)


# (id, batch, seqlen_q, nheads, nheads_kv, headdim, prefix_len, own lengths before the
#  append (seqlen_new = seqlen_q), page_size (None: contiguous), kwargs)
CASES = [
    ("decode-H8/2", 3, 1, 8, 2, 32, 37, [0, 20, 9], None, {}),
    ("spec3-H4/4-causal", 2, 3, 4, 4, 24, 19, [11, 4], None, dict(causal=True)),
    ("paged4-H6/2-softcap", 2, 2, 6, 2, 16, 50, [13, 7], 4, dict(causal=True, softcap=0.9)),
    ("full-H4/1-sink", 2, 2, 4, 1, 16, 8, [5, 30], None, dict(causal=False, sink=True)),
    # 68 packed query rows over the prefix: two of the split-KV kernel's 64-row tiles
    ("batch17-H8/2", 17, 1, 8, 2, 16, 40, [3 * b % 11 for b in range(17)], None, {}),
]


def run_case(case, dtype, backend, device="cpu"):
    _, batch, seqlen_q, nheads, nheads_kv, headdim, prefix_len, lengths, page_size, kw = case
    kw = dict(kw)
    gen = torch.Generator().manual_seed(7)
    q = rand(gen, batch, seqlen_q, nheads, headdim, dtype=dtype)
    prefix_k, prefix_v = (rand(gen, 1, prefix_len, nheads_kv, headdim, dtype=dtype)
                          for _ in range(2))
    k_new, v_new = (rand(gen, batch, seqlen_q, nheads_kv, headdim, dtype=dtype)
                    for _ in range(2))
    capacity = max(lengths) + seqlen_q
    own_k, own_v = (rand(gen, batch, capacity, nheads_kv, headdim, dtype=dtype)
                    for _ in range(2))
    sink = torch.linspace(-1.0, 2.0, nheads) if kw.pop("sink", False) else None
    causal, softcap = kw.get("causal", True), kw.get("softcap", 0.0)
    # each sequence's keys as the reference sees them: the prefix, then its own after the append
    seqs = []
    for b, n in enumerate(lengths):
        own = [torch.cat([x[b:b + 1, :n], new[b:b + 1]], 1) for x, new in
               ((own_k, k_new), (own_v, v_new))]
        seqs.append([torch.cat([p, o], 1) for p, o in zip((prefix_k, prefix_v), own)])
    if page_size is None:
        k_cache, v_cache, block_table = own_k.clone(), own_v.clone(), None
    else:  # the same rows, in pages of page_size
        pages = -(-capacity // page_size)
        k_cache, v_cache = (x.new_zeros(batch * pages + 1, page_size, nheads_kv, headdim)
                            for x in (own_k, own_v))
        block_table = (torch.arange(batch * pages, dtype=torch.int32).view(batch, pages) + 1)
        for cache, own in ((k_cache, own_k), (v_cache, own_v)):
            flat = cache[1:].view(batch, pages * page_size, nheads_kv, headdim)
            flat[:, :capacity] = own
    lens = torch.tensor(lengths, dtype=torch.int32)
    args = [x if x is None else x.to(device) for x in (q, prefix_k, prefix_v, k_cache, v_cache,
                                                          k_new, v_new, lens, block_table, sink)]
    o, lse = longflash.attention_with_shared_prefix(
        *args[:9], causal=causal, softcap=softcap, return_lse=True, backend=backend,
        learnable_sink=args[9])
    return q, seqs, o.cpu(), lse.cpu(), dict(causal=causal, softcap=softcap, learnable_sink=sink)


def check_shared_prefix(case, dtype, backend, device="cpu"):
    """o and lse of every sequence against the float64 reference over the prefix followed by
    its own keys (tolerance rule; the low-precision reference in dtype on the CPU)."""
    q, seqs, o, lse, kw = run_case(case, dtype, backend, device)
    for b, (keys, values) in enumerate(seqs):
        q_b = q[b:b + 1]
        ref = attention_ref(*(x.double() for x in (q_b, keys, values)), **kw)
        lowp = attention_ref(q_b, keys, values, upcast=False, **kw)
        check_close(f"{case[0]} seq {b} o", o[b:b + 1], lowp[0], ref[0])
        check_close(f"{case[0]} seq {b} lse", lse[b:b + 1], lowp[1], ref[1])


BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_shared_prefix_is_attention_over_prefix_and_own_keys(case, backend):
    """o and lse of every sequence against the float64 reference over the prefix followed by
    its own keys (causal aligned to its end), the new keys appended in place."""
    check_shared_prefix(case, torch.float16 if backend == "triton" else torch.float32, backend)


def test_shared_prefix_bad_input():
    q = torch.randn(2, 1, 4, 16)
    cache = torch.randn(2, 10, 2, 16)
    with pytest.raises(ValueError, match="prefix_k must be a \\(1, prefix_len"):
        longflash.attention_with_shared_prefix(q, torch.randn(2, 5, 2, 16),
                                               torch.randn(1, 5, 2, 16), cache, cache)
    with pytest.raises(ValueError, match="learnable_sink must have shape"):
        longflash.attention_with_shared_prefix(q, cache[:1], cache[:1], cache, cache,
                                               learnable_sink=torch.zeros(3))
