"""attention_with_kvcache: decoding over a KV cache (split-KV, paged caches, in-place append).

Each case builds a cache, appends new keys/values, and compares the output and lse of every
sequence with the float64 reference over that sequence's keys (tolerance rule of
ARCHITECTURE.md: `check_close`), and checks that exactly the appended slots of the cache
changed. The Triton cases run under the interpreter (tiny, fp16 / fp32).
"""

import functools
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import longflash
from longflash import _common, attention_ref, kvcache
from conftest import INTERPRET, check_close

# (id, batch, seqlen_q, nheads, nheads_kv, headdim, page_size (None: contiguous),
#  capacity (contiguous: slots per sequence; paged: max_pages), lengths, seqlen_new, kwargs)
CASES = [
    ("decode-H8/1-D40-len0-full", 3, 1, 8, 1, 40, None, 37, [0, 20, 36], 1, {}),
    ("spec4-H6/2-D59-causal", 3, 4, 6, 2, 59, None, 45, [41, 0, 13], 4, dict(causal=True)),
    ("paged8-H4/4-D80-causal", 2, 2, 4, 4, 80, 8, 6, [7, 40], 3, dict(causal=True)),
    ("paged5-H8/2-D32-window-softcap", 2, 3, 8, 2, 32, 5, 9, [30, 12], 2,
     dict(causal=True, window_size=(6, -1), softcap=0.8)),
    ("noappend-H4/1-D16-alibi", 2, 1, 4, 1, 16, None, 50, [50, 9], 0, dict(alibi=(4,))),
    ("paged16-H2/1-D24-alibi-batch-window", 2, 2, 2, 1, 24, 16, 4, [33, 61], 1,
     dict(alibi=(2, 2), window_size=(10, 2))),
    ("leftpad-H6/2-D48-causal", 3, 2, 6, 2, 48, None, 40, [33, 20, 5], 2,
     dict(causal=True, leftpad=[19, 0, 5])),
    ("paged4-leftpad-H4/1-D32-window-alibi", 2, 3, 4, 1, 32, 4, 10, [30, 13], 3,
     dict(causal=True, window_size=(20, -1), alibi=(4,), leftpad=[11, 6])),
]


def case_id(case):
    return case[0]


def make_case(case, dtype, seed=0):
    """q, k_cache, v_cache, k, v, cache_seqlens, block_table, kwargs, and the contiguous view
    of each sequence's keys: seq_keys(cache, b, n) -> (1, n, Hkv, D)."""
    _, batch, seqlen_q, nheads, nheads_kv, headdim, page_size, capacity, lengths, new, kw = case
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    q = rand(batch, seqlen_q, nheads, headdim)
    if page_size is None:
        k_cache, v_cache = rand(batch, capacity, nheads_kv, headdim), \
            rand(batch, capacity, nheads_kv, headdim)
        block_table = None
    else:
        num_pages = batch * capacity + 3
        k_cache, v_cache = rand(num_pages, page_size, nheads_kv, headdim), \
            rand(num_pages, page_size, nheads_kv, headdim)
        block_table = torch.randperm(num_pages, generator=gen)[:batch * capacity].view(
            batch, capacity).to(torch.int32)
    k = rand(batch, new, nheads_kv, headdim) if new else None
    v = rand(batch, new, nheads_kv, headdim) if new else None
    kw = dict(kw)
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(kw.pop("alibi"), generator=gen) * 0.5
    if "leftpad" in kw:  # sequence b's keys start at cache row leftpad[b]
        kw["cache_leftpad"] = torch.tensor(kw.pop("leftpad"), dtype=torch.int32)
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32)
    return q, k_cache, v_cache, k, v, cache_seqlens, block_table, kw


def seq_keys(cache, block_table, b, n):
    """The first n keys of sequence b as a contiguous (1, n, Hkv, D) tensor."""
    if block_table is None:
        return cache[b:b + 1, :n]
    page_size = cache.shape[1]
    pos = torch.arange(n)
    rows = bits(cache)[block_table[b, pos // page_size].long(), pos % page_size][None]
    return rows if rows.dtype == cache.dtype else rows.view(cache.dtype)


def expected_cache(cache, new, block_table, lengths):
    """The cache after the append, computed slot by slot."""
    out = cache.clone()
    if new is None:
        return out
    for b, n in enumerate(lengths):
        for t in range(new.shape[1]):
            pos = n + t
            if block_table is None:
                out[b, pos] = new[b, t]
            else:
                page_size = cache.shape[1]
                out[int(block_table[b, pos // page_size]), pos % page_size] = new[b, t]
    return out


def make_mask(kind, q, keys, seed=1):
    """An attn_mask of q's (batch, nheads, seqlen_q) over `keys` key positions: "bool-keys"
    (batch, 1, seqlen_q, keys), a boolean shared by the heads (tree attention's shape);
    "float-heads" (batch, nheads, seqlen_q, keys), a float per head with -inf entries;
    "bool-rows" (nheads, seqlen_q, 1), one boolean per row for every key (some rows see no
    key)."""
    batch, seqlen_q, nheads, _ = q.shape
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool-keys":
        return torch.rand(batch, 1, seqlen_q, keys, generator=gen) < 0.7
    if kind == "float-heads":
        mask = torch.randn(batch, nheads, seqlen_q, keys, generator=gen, dtype=torch.float64)
        mask[torch.rand(mask.shape, generator=gen) < 0.2] = float("-inf")
        return mask.to(q.dtype)
    assert kind == "bool-rows"
    return torch.rand(nheads, seqlen_q, 1, generator=gen) < 0.7


MASK_KINDS = ["bool-keys", "float-heads", "bool-rows"]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
DESCALES = ["none", "floats", "tensors"]
BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])


def make_descales(kind, q, nheads_kv, seed=2):
    """k_descale and v_descale of a kind: "none"; "floats" (0.7, 1.3); "tensors": k_descale
    (batch, nheads_kv), v_descale (nheads_kv,) (broadcast over the batch). Returns the
    keyword arguments and both as (batch, nheads_kv) float32 (ones for none)."""
    batch = q.shape[0]
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        kw = {}
    elif kind == "floats":
        kw = dict(k_descale=0.7, v_descale=1.3)
    else:
        assert kind == "tensors"
        kw = dict(k_descale=torch.rand(batch, nheads_kv, generator=gen) + 0.5,
                  v_descale=torch.rand(nheads_kv, generator=gen) + 0.5)
    full = [torch.as_tensor(kw.get(name, 1.0), dtype=torch.float32).expand(batch, nheads_kv)
            for name in ("k_descale", "v_descale")]
    return kw, full


def with_block_mask(mask, kw, q, b, first, end):
    """attention_ref's attn_mask for sequence b (keys first..end-1 of its cache rows): mask
    (None, boolean or float) where kw's block_mask shows the key, else hidden."""
    block_q, block_k = _common.check_block_size(kw.get("block_size", _common.BLOCK_SPARSE_UNIT))
    blocks = kw["block_mask"].expand(q.shape[0], q.shape[2], *kw["block_mask"].shape[2:])
    seen = _common.block_mask_elements(blocks[b:b + 1], block_q, block_k, q.shape[1],
                                       end)[..., first:]
    if mask is None:
        return seen
    if mask.dtype == torch.bool:
        return mask & seen
    return mask.masked_fill(~seen, float("-inf"))


def bits(x):
    """A tensor to compare with torch.equal or to index (float8 as its bytes: torch 2.4 has
    neither for float8 on CPU)."""
    return x.view(torch.uint8) if x.dtype in FP8 else x


def check_case(case, dtype, backend, num_splits, device="cpu", int_seqlens=False,
               fn=longflash.attention_with_kvcache, mask_kind=None, fp8=None):
    """One case on `device` (the reference on the CPU); int_seqlens: cache_seqlens as an int
    (the case's lengths must all be equal); fn: attention_with_kvcache or a compiled one;
    mask_kind: an attn_mask (make_mask) over the positions of the longest sequence's keys
    and two more, or None; fp8: (float8 dtype, descale kind) for a quantized cache (its
    entries times the scales against the float64 reference; the append quantized as
    kvcache.quantize does it, bit for bit), or None."""
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kw = make_case(case, dtype)
    lengths = cache_seqlens.tolist()
    new = 0 if k is None else k.shape[1]
    if mask_kind is not None:
        kw["attn_mask"] = make_mask(mask_kind, q, max(lengths) + new + 2)
    k_new, v_new = k, v  # as the cache stores them
    if fp8 is not None:
        cache_dtype, descale_kind = fp8
        k_cache, v_cache = k_cache.float().to(cache_dtype), v_cache.float().to(cache_dtype)
        descale_kw, (k_scale, v_scale) = make_descales(descale_kind, q, k_cache.shape[2])
        kw.update(descale_kw)
        if k is not None:
            k_new, v_new = (kvcache.quantize(x, scale, cache_dtype)
                            for x, scale in ((k, k_scale), (v, v_scale)))
    k_after = expected_cache(k_cache, k_new, block_table, lengths)
    v_after = expected_cache(v_cache, v_new, block_table, lengths)
    on = (lambda x: x if x is None else x.to(device))  # noqa: E731
    seqlens = lengths[0] if int_seqlens else on(cache_seqlens)
    assert not int_seqlens or set(lengths) == {seqlens}
    kw_on = {key: on(val) if isinstance(val, torch.Tensor) else val for key, val in kw.items()}
    caches = [on(k_cache), on(v_cache)]
    o, lse = fn(q.to(device), *caches, on(k), on(v), seqlens, on(block_table), return_lse=True,
                backend=backend, num_splits=num_splits, **kw_on)
    (k_cache, v_cache), o, lse = [c.cpu() for c in caches], o.cpu(), lse.cpu()
    # -- only the appended slots changed, to the appended values --
    assert torch.equal(bits(k_cache), bits(k_after)) and torch.equal(bits(v_cache), bits(v_after))
    assert o.shape == q.shape and o.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    pads = kw.get("cache_leftpad", torch.zeros(len(lengths), dtype=torch.int32)).tolist()
    for b, n in enumerate(lengths):
        keys = seq_keys(k_cache, block_table, b, n + new)[:, pads[b]:]
        values = seq_keys(v_cache, block_table, b, n + new)[:, pads[b]:]
        if fp8 is not None:  # what the attention sees: entries times scales, in float64
            keys, values = (x.double() * scale[b].double()[:, None]
                            for x, scale in ((keys, k_scale), (values, v_scale)))
        slopes = kw.get("alibi_slopes")
        ref_kw = {key: val for key, val in kw.items()
                  if key not in ("alibi_slopes", "cache_leftpad", "attn_mask", "k_descale",
                                 "v_descale", "block_mask", "block_size")}
        if slopes is not None:
            ref_kw["alibi_slopes"] = slopes.expand(q.shape[0], q.shape[2])[b:b + 1]
        if mask_kind is not None:  # sequence b's rows, at its keys' positions
            mask = kw["attn_mask"].expand(*q.shape[:1], q.shape[2], q.shape[1], -1)[b:b + 1]
            ref_kw["attn_mask"] = mask if mask.shape[-1] == 1 else mask[..., pads[b]:n + new]
        if "block_mask" in kw:  # as the elementwise mask it stands for, beside any attn_mask
            ref_kw["attn_mask"] = with_block_mask(ref_kw.get("attn_mask"), kw, q, b, pads[b],
                                                  n + new)
        ref = attention_ref(q[b:b + 1].double(), keys.double(), values.double(), **ref_kw)
        low = attention_ref(q[b:b + 1], keys.to(dtype), values.to(dtype), upcast=False,
                            **ref_kw)
        check_close(f"o[{b}]", o[b:b + 1], low[0], ref[0])
        check_close(f"lse[{b}]", lse[b:b + 1], low[1], ref[1])


@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["splits-auto", "splits1", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_torch_path(dtype, case, num_splits, monkeypatch):
    monkeypatch.setattr(kvcache, "BLOCK_N", 8)  # several key blocks per split on tiny caches
    monkeypatch.setattr(kvcache, "MAX_BLOCK_N", 8)
    check_case(case, dtype, "torch", num_splits)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("num_splits", [0, 1, 3], ids=["splits-auto", "splits1", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_interpreter(dtype, case, num_splits):
    check_case(case, dtype, "triton", num_splits)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attn_mask_torch_path(dtype, case, mask_kind, num_splits, monkeypatch):
    monkeypatch.setattr(kvcache, "BLOCK_N", 8)
    monkeypatch.setattr(kvcache, "MAX_BLOCK_N", 8)
    check_case(case, dtype, "torch", num_splits, mask_kind=mask_kind)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_attn_mask_triton_interpreter(dtype, case, mask_kind, num_splits):
    check_case(case, dtype, "triton", num_splits, mask_kind=mask_kind)


@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_cache_torch_path(dtype, case, cache_dtype, num_splits, monkeypatch):
    monkeypatch.setattr(kvcache, "BLOCK_N", 8)
    monkeypatch.setattr(kvcache, "MAX_BLOCK_N", 8)
    descales = DESCALES[CASES.index(case) % len(DESCALES)]  # each kind on several cases
    check_case(case, dtype, "torch", num_splits, fp8=(cache_dtype, descales))


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_cache_triton_interpreter(dtype, case, cache_dtype, num_splits):
    descales = DESCALES[CASES.index(case) % len(DESCALES)]
    check_case(case, dtype, "triton", num_splits, fp8=(cache_dtype, descales))


def check_fp8_append_rounds_as_torch(backend, cache_dtype, device="cpu", nan=True):
    """The append's quantization, bit for bit kvcache.quantize's (torch's round to nearest
    even after the saturation): every finite value of the format, the midpoints between
    neighbours (ties) and just beside them, subnormals, values beyond the largest (saturated),
    +-inf, -0 and, if nan, NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    grid = grid[grid.isfinite()].unique()
    ties = (grid[:-1] + grid[1:]) / 2
    gen = torch.Generator().manual_seed(3)
    values = torch.cat([grid, ties, ties * (1 + 2**-20), ties * (1 - 2**-20),
                        torch.randn(500, generator=gen) * 1e-3,
                        torch.tensor([1e6, -1e6, float("inf"), -float("inf"), -0.0, -1e-30]
                                     + [float("nan")] * nan)])
    values = torch.cat([values, values.new_zeros(-len(values) % 16)]).to(device)
    k = values.view(1, -1, 1, 16) * 0.5  # k_descale 0.5 gives them back
    k_cache = torch.zeros(1, k.shape[1], 1, 16, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    longflash.attention_with_kvcache(torch.randn(1, 1, 1, 16, device=device), k_cache, v_cache,
                                     k, k, 0, backend=backend, k_descale=0.5)
    want = values.view(k.shape).clamp(-torch.finfo(cache_dtype).max,
                                       torch.finfo(cache_dtype).max).to(cache_dtype)
    assert torch.equal(bits(k_cache), bits(want))
    assert torch.equal(bits(v_cache), bits(kvcache.quantize(k, None, cache_dtype)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_fp8_append_rounds_as_torch(backend, cache_dtype):
    # Triton 3.9's interpreter converts NaN to float8 as 384 (a bug of its own: compiled,
    # cvt.rn.satfinite keeps NaN); test_gpu's fp8 test includes NaN.
    check_fp8_append_rounds_as_torch(backend, cache_dtype, nan=backend == "torch")


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("paged", [None, 4], ids=["contiguous", "paged4"])
def test_fp8_append_with_rotary_and_cache_batch_idx_agree(cache_dtype, paged):
    """Rotary embeddings into a float8 cache: the Triton append kernel rotates, rounds to k's
    dtype and quantizes, bit for bit as the PyTorch path's ops; with cache_batch_idx (rows of
    a contiguous cache), the scales follow the sequence. Outputs agree within fp16 rounding."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 2, 4, 16, generator=gen).half()
    k, v = (torch.randn(2, 2, 2, 16, generator=gen).half() for _ in range(2))
    cos, sin = torch.cos(torch.rand(40, 6)), torch.sin(torch.rand(40, 6))
    if paged:
        cache = torch.randn(9, paged, 2, 16, generator=gen)
        kw = dict(block_table=torch.tensor([[3, 0, 7, 1], [2, 8, 5, 4]], dtype=torch.int32))
    else:
        cache = torch.randn(3, 16, 2, 16, generator=gen)
        kw = dict(cache_batch_idx=torch.tensor([2, 0]))
    descales = dict(k_descale=torch.tensor([[0.5, 2.0], [1.5, 0.25]]),
                    v_descale=torch.tensor([0.75, 1.25]))
    runs = []
    for backend in ("torch", "triton"):
        k_cache, v_cache = cache.to(cache_dtype), (cache * 0.5).to(cache_dtype)
        o = longflash.attention_with_kvcache(q, k_cache, v_cache, k, v,
                                             torch.tensor([5, 9]), causal=True,
                                             rotary_cos=cos, rotary_sin=sin, backend=backend,
                                             **descales, **kw)
        runs.append((o, bits(k_cache), bits(v_cache)))
    (o_torch, *caches_torch), (o_triton, *caches_triton) = runs
    assert all(torch.equal(a, b) for a, b in zip(caches_torch, caches_triton))
    assert not torch.equal(caches_torch[0], bits(cache.to(cache_dtype)))  # it appended
    torch.testing.assert_close(o_triton, o_torch, atol=2e-3, rtol=2e-3)


def test_gqa_ratios_and_float64():
    """GQA ratios 1 to 8 on the float64 PyTorch path: exact to rounding."""
    for nheads_kv in (8, 4, 2, 1):
        case = ("gqa", 2, 3, 8, nheads_kv, 20, None, 30, [5, 17], 2, dict(causal=True))
        check_case(case, torch.float64, "torch", 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attn_mask_scalar(backend):
    """A 0-d attn_mask broadcasts to every score: False hides every key (o = 0, lse = -inf), a
    float c shifts every score, leaving o as without a mask and lse + c."""
    q, k_cache, v_cache, _, _, lengths, _, _ = make_case(CASES[1], torch.float32)
    run = functools.partial(longflash.attention_with_kvcache, q, k_cache, v_cache,
                            cache_seqlens=lengths, causal=True, return_lse=True,
                            backend=backend)
    o, lse = run(attn_mask=torch.tensor(False))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o, lse = run()
    o_c, lse_c = run(attn_mask=torch.tensor(0.5))
    torch.testing.assert_close(o_c, o)
    torch.testing.assert_close(lse_c, lse + 0.5)


# A speculative step's draft tree: node t's parent (-1: the last token in the cache)
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 5]


def tree_mask(parents, prefix, keys):
    """(len(parents), keys) boolean: node t sees the `prefix` cached keys, its ancestors and
    itself, each node's key at position prefix + its index (the draft appended in order)."""
    mask = torch.zeros(len(parents), keys, dtype=torch.bool)
    mask[:, :prefix] = True
    for t in range(len(parents)):
        node = t
        while node >= 0:
            mask[t, prefix + node] = True
            node = parents[node]
    return mask


def test_tree_attention_mask_is_each_nodes_ancestors():
    """longflash.tree_attention_mask against the node-by-node walk (tree_mask): one tree for
    every sequence and a tree per sequence, prefixes of other lengths (0 among them), an int
    prefix, a longer key dimension, a chain, a flat tree, no node; errors name parents,
    cache_seqlens or length."""
    gen = torch.Generator().manual_seed(8)
    trees = torch.stack([torch.tensor(TREE_PARENTS)] + [
        torch.tensor([-1] + [int(torch.randint(-1, t, (), generator=gen)) for t in range(1, 7)])
        for _ in range(2)])  # (3, 7)
    prefixes = [5, 0, 12]
    for parents, lengths, length in ((TREE_PARENTS, prefixes, None),
                                     (trees, torch.tensor(prefixes), 30),
                                     (list(range(-1, 6)), 4, None), ([-1] * 5, [3, 1], None),
                                     ([], [2, 3], None)):
        mask = longflash.tree_attention_mask(parents, lengths, length)
        per_seq = parents if torch.is_tensor(parents) else torch.tensor([parents],
                                                                         dtype=torch.long)
        n_lengths = torch.as_tensor(lengths).reshape(-1)
        batch = max(len(per_seq), len(n_lengths))
        keys = length or int(n_lengths.max()) + per_seq.shape[1]
        assert mask.shape == (batch, 1, per_seq.shape[1], keys) and mask.dtype == torch.bool
        for b in range(batch):
            tree = per_seq[b % len(per_seq)].tolist()
            want = tree_mask(tree, int(n_lengths[b % len(n_lengths)]), keys)
            assert torch.equal(mask[b, 0], want), (parents, lengths, b)
    for bad, match in ((dict(parents=[-1, 1]), "parents"), (dict(parents=[-2, 0]), "parents"),
                       (dict(parents=[-1.0, 0.0]), "parents"),
                       (dict(parents=torch.tensor([[-1, 0]] * 3), cache_seqlens=[1, 2]),
                        "batch"),
                       (dict(cache_seqlens=-1), "cache_seqlens"),
                       (dict(length=3), "length")):
        kw = dict(dict(parents=[-1, 0], cache_seqlens=2), **bad)
        with pytest.raises((ValueError, TypeError), match=match):
            longflash.tree_attention_mask(**kw)


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float64), ("torch", torch.bfloat16)]
                         + [("triton", torch.float32), ("triton", torch.float16)] * INTERPRET,
                         ids=lambda x: str(x).removeprefix("torch."))
def test_tree_attention_is_decoding_each_branch(backend, dtype):
    """Tree attention in speculative decoding: the draft's 7 nodes appended and attended in one
    call, with a boolean attn_mask of each node's ancestors (batch, 1, 7, L), give what
    decoding the node's branch token by token gives: attention over the prefix and the
    branch, within the tolerance rule of the float64 reference (GQA, two sequences of other
    prefix lengths, so the tree sits at other cache rows in each)."""
    gen = torch.Generator().manual_seed(7)
    prefixes, nodes, keys = [21, 9], len(TREE_PARENTS), 21 + len(TREE_PARENTS)
    q = torch.randn(2, nodes, 8, 32, generator=gen, dtype=torch.float64)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, generator=gen, dtype=torch.float64)
                        for _ in range(2))
    k_new, v_new = (torch.randn(2, nodes, 2, 32, generator=gen, dtype=torch.float64)
                    for _ in range(2))
    mask = longflash.tree_attention_mask(TREE_PARENTS, torch.tensor(prefixes))
    assert mask.shape == (2, 1, nodes, keys)
    low = [x.to(dtype) for x in (q, k_cache, v_cache, k_new, v_new)]
    o, lse = longflash.attention_with_kvcache(
        *low, cache_seqlens=torch.tensor(prefixes, dtype=torch.int32), return_lse=True,
        backend=backend, attn_mask=mask)
    for b, prefix in enumerate(prefixes):
        for t in range(nodes):
            branch = mask[b, 0, t, prefix:].nonzero().flatten().tolist()  # in cache order
            sel = torch.tensor(branch)
            keys_t, values_t = (torch.cat([c[b:b + 1, :prefix], new[b:b + 1, sel]], 1)
                                for c, new in ((k_cache, k_new), (v_cache, v_new)))
            q_t = q[b:b + 1, t:t + 1]
            ref = attention_ref(q_t, keys_t, values_t)
            lowp = attention_ref(*(x.to(dtype) for x in (q_t, keys_t, values_t)), upcast=False)
            check_close(f"o[{b}, node {t}]", o[b:b + 1, t:t + 1], lowp[0], ref[0])
            check_close(f"lse[{b}, node {t}]", lse[b:b + 1, :, t:t + 1], lowp[1], ref[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_int_cache_seqlens_and_no_key(backend):
    """An int cache_seqlens; length 0 with nothing appended: o = 0, lse = -inf."""
    q = torch.randn(2, 1, 4, 16)
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    o, lse = longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=0,
                                              return_lse=True, backend=backend)
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    o = longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=10, backend=backend)
    ref, _ = attention_ref(q, k_cache, v_cache)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "e4m3"])
def test_paged_sequence_without_keys_reads_no_page(backend, cache_dtype):
    """A paged cache where one sequence has no key and its pages hold NaN (slots past a
    length may hold anything): that sequence gives o = 0, lse = -inf, the other its attention
    (the PyTorch path once multiplied the NaN rows by p = 0)."""
    q = torch.randn(2, 2, 4, 16)
    pages = torch.randn(6, 4, 2, 16), torch.randn(6, 4, 2, 16)
    for x in pages:
        x[3:] = float("nan")  # sequence 1's pages
    k_cache, v_cache = (x.to(cache_dtype) for x in pages)
    block_table = torch.arange(6, dtype=torch.int32).view(2, 3)
    o, lse = longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(
        [7, 0]), block_table=block_table, return_lse=True, backend=backend)
    assert torch.equal(o[1], torch.zeros_like(o[1])) and torch.isneginf(lse[1]).all()
    k, v = (x.float()[:3].reshape(1, 12, 2, 16)[:, :7] for x in (k_cache, v_cache))
    ref, ref_lse = attention_ref(q[:1], k, v)
    torch.testing.assert_close(o[:1], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:1], ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_int_cache_seqlens_is_the_tensor_of_equal_lengths(backend, paged):
    """An int cache_seqlens (checked on the host, no synchronization) gives exactly what the
    tensor of that length for every sequence gives: the same append, o and lse."""
    case = ("int", 2, 2, 4, 2, 24, 4 if paged else None, 12 if paged else 45, [29, 29], 3,
            dict(causal=True))
    results = []
    for as_int in (False, True):
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, kw = make_case(case, torch.float32)
        seqlens = 29 if as_int else cache_seqlens
        o, lse = longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, seqlens,
                                                  block_table, return_lse=True, backend=backend,
                                                  **kw)
        results.append((o, lse, k_cache, v_cache))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    check_case(case, torch.float32, backend, 0)


# ----------------------------------------------------------------------------- torch.compile

def _compile_recorded(fn, compile_backend):
    """torch.compile(fn, fullgraph=True) on a fresh cache, and the list of the graphs it
    compiles (one per compile; `compile_backend` compiles each)."""
    from torch._dynamo.backends.registry import lookup_backend
    torch._dynamo.reset()
    graphs, inner = [], lookup_backend(compile_backend)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)
    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def _ops(graph):
    """The names of the ops a graph calls, without overload (longflash.kvcache_forward)."""
    return {str(node.target).removesuffix(".default") for node in graph.graph.nodes
            if node.op == "call_function"}


def check_compiled_decoding(backend, compile_backend, dtype, paged, device="cpu"):
    """attention_with_kvcache under torch.compile(fullgraph=True): one decoding step (GQA,
    causal, one token appended in place) at three consecutive int lengths, then at ragged
    tensor lengths, without and with cache_leftpad, each within the tolerance rule with the
    cache appended as in eager. The second int length makes the length a SymInt, which serves
    the third without recompiling: one graph per decoding step would recompile at every
    token."""
    step, graphs = _compile_recorded(longflash.attention_with_kvcache, compile_backend)

    def case(lengths, **kw):  # contiguous: 90 slots; paged: 12 pages of 8
        return ("compiled", 2, 1, 8, 2, 32, paged, 12 if paged else 90, lengths, 1,
                dict(causal=True, **kw))
    for n in (60, 61, 62):
        check_case(case([n, n]), dtype, backend, 0, device, int_seqlens=True, fn=step)
    assert len(graphs) == 2, f"{len(graphs)} compiles for three int lengths"
    check_case(case([75, 9]), dtype, backend, 0, device, fn=step)
    check_case(case([75, 9], leftpad=[37, 3]), dtype, backend, 0, device, fn=step)
    assert len(graphs) == 4
    assert all("longflash.kvcache_forward" in _ops(g) for g in graphs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [None, 8], ids=["contiguous", "paged8"])
def test_compile_fullgraph(backend, paged):
    check_compiled_decoding(backend, "aot_eager", torch.float32, paged)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_with_attn_mask(backend):
    """A decoding step with an attn_mask under torch.compile(fullgraph=True): the mask is an
    input of the decoding op, at int and tensor lengths, within the tolerance rule."""
    step, graphs = _compile_recorded(longflash.attention_with_kvcache, "aot_eager")
    for lengths, kind in (([40, 40], "bool-keys"), ([52, 7], "float-heads")):
        case = ("compiled-mask", 2, 3, 8, 2, 32, None, 60, lengths, 1, dict(causal=True))
        check_case(case, torch.float32, backend, 0, int_seqlens=kind == "bool-keys", fn=step,
                   mask_kind=kind)
    assert graphs and all("longflash.kvcache_forward" in _ops(g) for g in graphs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_with_fp8_cache(backend):
    """A decoding step over a float8 cache under torch.compile(fullgraph=True): the append
    quantized by traced ops, the scales inputs of the decoding op, within the tolerance
    rule, the cache bit for bit."""
    step, graphs = _compile_recorded(longflash.attention_with_kvcache, "aot_eager")
    for lengths, descales in (([40, 40], "tensors"), ([52, 7], "floats")):
        case = ("compiled-fp8", 2, 3, 8, 2, 32, None, 60, lengths, 1, dict(causal=True))
        check_case(case, torch.float32, backend, 0, int_seqlens=descales == "tensors", fn=step,
                   fp8=(torch.float8_e4m3fn, descales))
    # (tensor scales, then floats: Dynamo also records an empty graph, which calls nothing)
    assert graphs and all("longflash.kvcache_forward" in _ops(g) for g in graphs if _ops(g))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    """torch.library's consistency checks of the decoding op (fake vs real, schema), with
    lengths as a tensor and as one int, with and without cache_leftpad, and with an
    attn_mask, with MLA's qv, and with a block_mask."""
    case = ("op", 2, 2, 4, 2, 16, None, 30, [20, 20], 0, {})
    q, k_cache, v_cache, _, _, cache_seqlens, _, _ = make_case(case, torch.float32)
    rest = (True, 0.25, -1, -1, 0.0, None, 0, backend)
    leftpad = torch.tensor([3, 17], dtype=torch.int32)
    qv = torch.randn_like(q)
    unit = _common.BLOCK_SPARSE_UNIT
    blocks = torch.tensor([True, False]).view(1, 1, 1, 2).expand(2, 4, 1, 2)
    for lengths in ((cache_seqlens.long(), 0, 20), (None, 20, 20)):
        for pads, mask, mla, sparse in (
                (None, None, None, None), (leftpad, None, None, None),
                (None, make_mask("bool-keys", q, 20), None, None), (None, None, qv, None),
                (None, None, None, blocks)):
            torch.library.opcheck(torch.ops.longflash.kvcache_forward.default,
                                  lengths + (q, k_cache, v_cache, None, pads) + rest
                                  + (mask, None, None, mla, sparse, unit, unit))
    fp8 = [c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache)]
    scales = (torch.rand(2, 2) + 0.5, torch.rand(1, 1).expand(2, 2))  # (batch, nheads_kv)
    # test_schema multiplies the inputs, which torch does not do in float8 on the CPU
    torch.library.opcheck(torch.ops.longflash.kvcache_forward.default,
                          (None, 20, 20, q, *fp8, None, None) + rest
                          + (None, *scales, None, None, unit, unit),
                          test_utils=("test_faketensor", "test_autograd_registration",
                                      "test_aot_dispatch_dynamic"))


def check_compiled_route(compile_backend, dtype, device="cpu"):
    """attention() without a gradient under torch.compile(fullgraph=True), short queries over
    keys of three consecutive lengths (a SymInt from the second, no third compile): the
    split-KV path (its op in every graph, the main kernel's in none), within the tolerance
    rule. Needs SPLIT_KV_MIN_SEQLEN_K <= 41."""
    fn, graphs = _compile_recorded(longflash.attention, compile_backend)
    gen = torch.Generator().manual_seed(4)
    for seqlen_k in (41, 42, 43):
        q = torch.randn(2, 3, 6, 24, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(2, seqlen_k, 2, 24, generator=gen, dtype=torch.float64)
                for _ in range(2))
        low = [x.to(dtype) for x in (q, k, v)]
        with torch.no_grad():
            o, lse = fn(*(x.to(device) for x in low), causal=True, return_lse=True)
        check_route_output(o, lse, q, k, v, low, causal=True)
    assert len(graphs) == 2, f"{len(graphs)} compiles for three key lengths"
    for g in graphs:
        assert "longflash.kvcache_forward" in _ops(g)
        assert "longflash.attention_forward" not in _ops(g)


class _Launch:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, grid, args, kwargs))


def _refuse_device_reads(monkeypatch):
    """Every way of reading a tensor's values back to Python raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("a device-to-host read (synchronization)")
    for name in ("tolist", "item", "__int__", "__index__", "__float__", "__bool__", "cpu",
                 "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.skipif(not INTERPRET, reason="the Triton launcher on CPU tensors")
@pytest.mark.parametrize("append", [False, True], ids=["no-append", "append"])
def test_int_cache_seqlens_reads_nothing_back(append, monkeypatch):
    """With an int cache_seqlens, validation, the append and the launcher (split heuristic
    included) read no tensor value back to the host (no .tolist(), .item(), int(tensor)): a
    GPU timing of a decoding step measures the kernels, not a device round trip. The kernels
    are stubbed (the interpreter itself reads tensors); a tensor cache_seqlens, whose values
    are checked, does read them, once."""
    from longflash import decode_triton
    gen = torch.Generator().manual_seed(4)
    batch, nheads, nheads_kv, headdim, length, new = 2, 4, 1, 16, 190, 2 if append else 0
    q = torch.randn(batch, 1, nheads, headdim, generator=gen)
    k_cache, v_cache = (torch.randn(batch, 200, nheads_kv, headdim, generator=gen)
                        for _ in range(2))
    k, v = ((torch.randn(batch, new, nheads_kv, headdim, generator=gen) for _ in range(2))
            if append else (None, None))
    calls, names = [], decode_triton._fwd_splitkv.arg_names
    monkeypatch.setattr(decode_triton, "_fwd_splitkv", _Launch("split", calls))
    monkeypatch.setattr(decode_triton, "_merge_splits", _Launch("merge", calls))
    with monkeypatch.context() as m:
        _refuse_device_reads(m)
        longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=length,
                                         causal=True, backend="triton")
    (split, grid, args, kwargs), merge = calls[0], calls[1:]
    # the length the kernel takes as an argument (no tensor filled on the device), and the
    # split count the heuristic gives at that length
    assert kwargs["UNIFORM_SEQLEN"] and args[names.index("seqlen_k_all")] == length + new
    cfg = decode_triton.launch_config(1, nheads // nheads_kv, headdim)
    assert grid[0] == decode_triton.num_splits_heuristic(
        batch * nheads_kv, length + new, cfg.kwargs["BLOCK_N"], decode_triton._num_sms(q.device))
    assert grid[0] > 1 and [c[0] for c in merge] == ["merge"]
    if append:
        assert torch.equal(k_cache[:, length:length + new], k)
    # a tensor's values are read for their checks: the refusal catches it
    with monkeypatch.context() as m:
        _refuse_device_reads(m)
        with pytest.raises(AssertionError, match="device-to-host"):
            longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.full(
                (batch,), length, dtype=torch.int32), backend="triton")


class _CountOps(TorchDispatchMode):
    """Counts the aten ops run inside it (each one a kernel launch on a GPU, but views)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


ALLOCATIONS = {"aten.empty.memory_format", "aten.new_empty.default", "aten.empty_like.default"}


@pytest.mark.skipif(not INTERPRET, reason="the Triton launcher on CPU tensors")
@pytest.mark.parametrize("new, rotary", [(0, False), (2, False), (2, True)],
                         ids=["no-append", "append", "append-rotary"])
@pytest.mark.parametrize("as_int", [True, False], ids=["int", "tensor"])
def test_triton_decoding_step_is_its_kernels(new, rotary, as_int, monkeypatch):
    """On the Triton backend a decoding step launches the append kernel (which also rotates)
    when k is given, the split kernel and the merge, and no PyTorch op but allocations, and,
    with a tensor cache_seqlens and an append, the add of the new lengths: a host that issued a
    dozen small kernels for the append and rotary would cost more than the attention over a
    short cache. The kernels are stubbed (the interpreter runs PyTorch ops of its own)."""
    from longflash import decode_triton
    batch, seqlen_q, nheads, nheads_kv, headdim, length = 2, 1, 4, 1, 16, 190
    case = ("launches", batch, seqlen_q, nheads, nheads_kv, headdim, None, 200,
            [length] * batch, new, dict(causal=True))
    q, k_cache, v_cache, k, v, cache_seqlens, _, kw = make_case(case, torch.float32)
    if rotary:
        kw.update(_rotary(256, 4))
    monkeypatch.setattr(longflash._common, "POISON_OUTPUTS", False)  # as outside the tests
    calls = []
    for name in ("_append_rotary", "_fwd_splitkv", "_merge_splits"):
        monkeypatch.setattr(decode_triton, name, _Launch(name, calls))
    with _CountOps() as counted:
        longflash.attention_with_kvcache(q, k_cache, v_cache, k, v,
                                         length if as_int else cache_seqlens,
                                         backend="triton", **kw)
    launched = [c[0] for c in calls]
    assert launched == ["_append_rotary"] * bool(new) + ["_fwd_splitkv", "_merge_splits"]
    if new:
        assert calls[0][1] == (new * nheads_kv + (seqlen_q * nheads if rotary else 0), batch)
    extra = Counter({"aten.add.Tensor": 1}) if new and not as_int else Counter()
    assert Counter({op: n for op, n in counted.ops.items() if op not in ALLOCATIONS}) == extra


@pytest.mark.skipif(not INTERPRET, reason="the Triton launcher on CPU tensors")
def test_triton_cache_with_strided_headdim_is_refused_before_the_append():
    """The Triton kernels read a cache row as contiguous headdim elements: a cache whose last
    dimension is strided raises, naming the caches, before the new keys are written."""
    case = ("strided", 2, 1, 4, 2, 16, None, 20, [5, 9], 1, {})
    q, k_cache, v_cache, k, v, cache_seqlens, _, _ = make_case(case, torch.float32)
    strided = torch.zeros(2, 20, 2, 32)[..., ::2]  # (2, 20, 2, 16), headdim stride 2
    before = strided.clone()
    with pytest.raises(ValueError, match="k_cache and v_cache must have a contiguous last"):
        longflash.attention_with_kvcache(q, strided, v_cache, k, v, cache_seqlens,
                                         backend="triton")
    assert torch.equal(strided, before)


@pytest.mark.skipif(not INTERPRET, reason="compares the two CPU paths")
def test_backends_agree():
    case = CASES[3]
    outs = []
    for backend in ("torch", "triton"):
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, kw = make_case(case, torch.float32)
        outs.append(longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                     block_table, return_lse=True,
                                                     backend=backend, **kw))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- rotary

def rotate_ref(x, positions, cos, sin, interleaved):
    """x (B, N, H, D) in float64, token (b, n) turned by the angles of positions[b][n]: each
    pair of the first rotary_dim dims as a complex number times cos + i sin."""
    out, half = x.double().clone(), cos.shape[1]
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            turn = torch.complex(cos[positions[b][n]].double(), sin[positions[b][n]].double())
            xr = out[b, n, :, :2 * half]  # (H, rotary_dim)
            if interleaved:
                z = torch.complex(xr[:, 0::2], xr[:, 1::2]) * turn
                out[b, n, :, :2 * half] = torch.stack([z.real, z.imag], -1).flatten(-2)
            else:
                z = torch.complex(xr[:, :half], xr[:, half:]) * turn
                out[b, n, :, :2 * half] = torch.cat([z.real, z.imag], -1)
    return out


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float64)] + (
    [("triton", torch.float32)] if INTERPRET else []), ids=lambda x: str(x).split(".")[-1])
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("rotary_dim", [16, 24], ids=["partial", "full"])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(5, -1)), {}],
                         ids=["causal", "window", "full-attention"])
@pytest.mark.parametrize("paged, as_int", [(None, True), (None, False), (4, False)],
                         ids=["int", "tensor", "paged4"])
def test_rotary(backend, dtype, interleaved, rotary_dim, kw, paged, as_int):
    """rotary_cos/rotary_sin give what rotating q and the new keys by hand gives (float64:
    to rounding), cache included: keys at cache_seqlens + t; queries at cache_seqlens + i
    when causal or windowed, else all at cache_seqlens."""
    check_rotary(backend, dtype, interleaved, rotary_dim, kw, paged, as_int)


# the inputs' rounding of a rotated value, in the stored dtype
ROTARY_TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 2e-3,
              torch.bfloat16: 2e-2}


def check_rotary(backend, dtype, interleaved, rotary_dim, kw, paged, as_int, device="cpu"):
    lengths = [9, 9] if as_int else [9, 2]
    case = ("rotary", 2, 3, 4, 2, 24, paged, 6 if paged else 20, lengths, 3, kw)
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, kw = make_case(case, dtype)
    angles = torch.rand(16, rotary_dim // 2, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    seqlens = lengths[0] if as_int else cache_seqlens.to(device)
    table = None if block_table is None else block_table.to(device)
    caches = [k_cache.to(device, copy=True), v_cache.to(device, copy=True)]
    ref_caches = [k_cache.to(device, copy=True), v_cache.to(device, copy=True)]
    o, lse = longflash.attention_with_kvcache(
        q.to(device), *caches, k.to(device), v.to(device), seqlens, table, return_lse=True,
        backend=backend, rotary_cos=cos.to(device), rotary_sin=sin.to(device),
        rotary_interleaved=interleaved, **kw)
    in_order = kw != {}
    q_pos = [[n + (i if in_order else 0) for i in range(3)] for n in lengths]
    k_pos = [[n + t for t in range(3)] for n in lengths]
    q_r, k_r = (rotate_ref(x, pos, cos, sin, interleaved).to(dtype)
                for x, pos in ((q, q_pos), (k, k_pos)))
    o_ref, lse_ref = longflash.attention_with_kvcache(
        q_r.to(device), *ref_caches, k_r.to(device), v.to(device),
        seqlens, table, return_lse=True, backend=backend, **kw)
    tol = ROTARY_TOL[dtype]
    for got, want in zip((o, lse, *caches), (o_ref, lse_ref, *ref_caches)):
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rotary", [False, True], ids=["plain", "rotary"])
def test_append_from_fused_projection_views(backend, rotary):
    """q, k and v as views into one fused projection (batch, seqlen, nheads + 2 * nheads_kv,
    headdim), as a model's qkv layer leaves them, and a transposed cos table: the same output
    and cache as contiguous copies give, exactly (float32)."""
    gen = torch.Generator().manual_seed(7)
    batch, seqlen, nheads, nheads_kv, headdim = 2, 3, 4, 2, 24
    qkv = torch.randn(batch, seqlen, nheads + 2 * nheads_kv, headdim, generator=gen)
    q, k, v = qkv.split([nheads, nheads_kv, nheads_kv], dim=2)
    k_cache, v_cache = (torch.randn(batch, 20, nheads_kv, headdim, generator=gen)
                        for _ in range(2))
    kw = dict(causal=True, return_lse=True, backend=backend)
    if rotary:
        angles = torch.rand(8, 12, generator=gen, dtype=torch.float64) * 6.3
        kw.update(rotary_cos=angles.cos().float().t().contiguous().t(),
                  rotary_sin=angles.sin().float(), rotary_interleaved=False)
    lengths = torch.tensor([5, 2])
    runs = []
    for views in (True, False):
        caches = [k_cache.clone(), v_cache.clone()]
        args = (q, k, v) if views else (q.contiguous(), k.contiguous(), v.contiguous())
        if not views and rotary:
            kw["rotary_cos"] = kw["rotary_cos"].contiguous()
        o, lse = longflash.attention_with_kvcache(args[0], *caches, *args[1:], lengths, **kw)
        runs.append((o, lse, *caches))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- cache_batch_idx

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("as_int", [True, False], ids=["int", "tensor"])
def test_cache_batch_idx(backend, as_int):
    """Sequences on chosen rows of a larger cache give what the same rows, taken out as a
    cache of their own, give; the append lands in those rows only."""
    case = ("rows", 5, 2, 4, 2, 16, None, 30, [12] * 5 if as_int else [12, 0, 7, 29, 3], 1,
            dict(causal=True))
    _, k_cache, v_cache, _, _, cache_seqlens, _, kw = make_case(case, torch.float32)
    rows = torch.tensor([4, 0, 2])
    q, _, _, k, v, _, _, _ = make_case(("q", 3) + case[2:], torch.float32, seed=1)
    seqlens = 12 if as_int else cache_seqlens[rows]
    caches = [k_cache.clone(), v_cache.clone()]
    o, lse = longflash.attention_with_kvcache(q, *caches, k, v, seqlens, return_lse=True,
                                              backend=backend, cache_batch_idx=rows, **kw)
    taken = [k_cache[rows], v_cache[rows]]
    o_ref, lse_ref = longflash.attention_with_kvcache(q, *taken, k, v, seqlens,
                                                      return_lse=True, backend=backend, **kw)
    torch.testing.assert_close(o, o_ref, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse, lse_ref, atol=2e-6, rtol=2e-6)
    for cache, before, after in zip(caches, (k_cache, v_cache), taken):
        assert torch.equal(cache[rows], after)
        others = [r for r in range(5) if r not in rows.tolist()]
        assert torch.equal(cache[others], before[others])


# ----------------------------------------------------------------------------- errors

def _error_inputs():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k_cache, v_cache = torch.randn(2, 8, 2, 16, generator=gen), torch.randn(2, 8, 2, 16,
                                                                             generator=gen)
    k, v = torch.randn(2, 2, 2, 16, generator=gen), torch.randn(2, 2, 2, 16, generator=gen)
    pages_k, pages_v = torch.randn(5, 4, 2, 16, generator=gen), torch.randn(5, 4, 2, 16,
                                                                             generator=gen)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return q, k_cache, v_cache, k, v, pages_k, pages_v, table


def _per_sequence(arg, value):
    """Inputs with a bad keyword argument (cache_seqlens 1, two keys appended)."""
    return lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, {arg: value})


ERRORS = [
    ("beyond-capacity", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([3, 7]))),
    ("negative-length", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([-1, 2]))),
    ("int-beyond-capacity", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 7)),
    ("int-negative", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, -1)),
    ("default-new-beyond-capacity", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc[:, :1], vc[:, :1], k, v, None)),
    ("float-seqlens", TypeError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([1.0, 2.0]))),
    ("python-float-seqlens", TypeError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 2.0)),
    ("seqlens-shape", TypeError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([1, 2, 3]))),
    ("dtype-mismatch", TypeError, "k_cache",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc.half(), vc, k, v, 1)),
    ("new-dtype-mismatch", TypeError, "k has dtype",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k.double(), v, 1)),
    ("heads-mismatch", ValueError, "nheads",
     lambda q, kc, vc, k, v, pk, pv, t: (q[:, :, :3], kc, vc, None, None, 1)),
    ("new-heads-mismatch", ValueError, "k and v",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k[:, :, :1], v[:, :, :1], 1)),
    ("only-k", ValueError, "together",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, None, 1)),
    ("cache-shapes", ValueError, "k_cache and v_cache",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc[:, :7], k, v, 1)),
    ("headdim", ValueError, "headdim",
     lambda q, kc, vc, k, v, pk, pv, t: (q[..., :8], kc, vc, None, None, 1)),
    ("paged-beyond-capacity", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, torch.tensor([1, 7]), t)),
    ("block-table-range", ValueError, "block_table",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, torch.tensor([1, 3]),
                                         torch.tensor([[0, 1], [2, 5]], dtype=torch.int32))),
    ("block-table-negative", ValueError, "block_table",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, torch.tensor([1, 3]),
                                         torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32))),
    ("paged-int-beyond-capacity", ValueError, "cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, 7, t)),
    ("block-table-range-int", ValueError, "block_table",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, 3,
                                         torch.tensor([[0, 1], [2, 5]], dtype=torch.int32))),
    ("block-table-dtype", TypeError, "block_table",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, 1, t.long())),
    ("window", TypeError, "window_size",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(window_size=3))),
    ("softcap", ValueError, "softcap",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(softcap=-1.0))),
    ("scale", ValueError, "softmax_scale",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(softmax_scale=0.0))),
    ("backend", ValueError, "backend",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(backend="cuda"))),
    ("num-splits", ValueError, "num_splits",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(num_splits=-1))),
    ("batch-idx-range", ValueError, "cache_batch_idx entries",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None,
                                         dict(cache_batch_idx=torch.tensor([0, 2])))),
    ("batch-idx-paged", ValueError, "block_table",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, 1, t,
                                         dict(cache_batch_idx=torch.tensor([0, 1])))),
    ("leftpad-beyond-length", ValueError, r"cache_leftpad\[1\] = 3 must lie in \[0, cache_seqlens",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([1, 2]), None,
                                         dict(cache_leftpad=torch.tensor([0, 3])))),
    ("leftpad-negative-int-seqlens", ValueError, r"cache_leftpad\[0\] = -1",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 2, None,
                                         dict(cache_leftpad=torch.tensor([-1, 0])))),
    ("leftpad-paged-beyond-length", ValueError, r"cache_leftpad\[0\] = 5",
     lambda q, kc, vc, k, v, pk, pv, t: (q, pk, pv, k, v, 4, t,
                                         dict(cache_leftpad=torch.tensor([5, 0])))),
    ("rotary-only-cos", ValueError, "together",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None,
                                         dict(rotary_cos=torch.ones(8, 4)))),
    ("rotary-without-k", ValueError, "need k and v",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, None, None, 1, None, _rotary(8, 4))),
    ("rotary-dim", ValueError, "rotary_dim",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, _rotary(8, 9))),
    ("rotary-shape", ValueError, "same shape",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None,
                                         dict(rotary_cos=torch.ones(8, 4),
                                              rotary_sin=torch.ones(7, 4)))),
    ("rotary-dtype", TypeError, "rotary_cos",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None,
                                         dict(rotary_cos=torch.ones(8, 4, dtype=torch.long),
                                              rotary_sin=torch.ones(8, 4)))),
    ("rotary-positions", ValueError, "position 6 is needed",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([1, 5]), None,
                                         _rotary(6, 4))),
    ("rotary-positions-int", ValueError, "position 6 is needed",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 5, None, _rotary(6, 4))),
    ("rotary-interleaved", TypeError, "rotary_interleaved",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None,
                                         dict(_rotary(8, 4), rotary_interleaved=1))),
]


ERRORS += [  # attn_mask: its last dimension spans the keys of the longest sequence (3 here)
    ("mask-keys", ValueError, r"attn_mask must be broadcastable to \(batch, nheads, seqlen_q, L\)",
     _per_sequence("attn_mask", torch.ones(2, 4, 1, 2, dtype=torch.bool))),
    ("mask-keys-tensor", ValueError, "attn_mask",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, torch.tensor([1, 4]), None,
                                         dict(attn_mask=torch.ones(1, 5)))),
    ("mask-heads", ValueError, "attn_mask",
     _per_sequence("attn_mask", torch.ones(2, 3, 1, 3, dtype=torch.bool))),
    ("mask-dtype", TypeError, "attn_mask",
     _per_sequence("attn_mask", torch.ones(2, 4, 1, 3, dtype=torch.int32))),
    ("mask-dims", ValueError, "attn_mask",
     _per_sequence("attn_mask", torch.ones(1, 2, 4, 1, 3, dtype=torch.bool))),
]
ERRORS += [
    ("fp8-cache-pair", TypeError, "v_cache has dtype",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc.to(torch.float8_e4m3fn),
                                         vc.to(torch.float8_e5m2), k, v, 1)),
    ("fp8-new-keys", TypeError, "k has dtype",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc.to(torch.float8_e4m3fn),
                                         vc.to(torch.float8_e4m3fn), k.half(), v, 1)),
    ("fp8-q", TypeError, "q has dtype",
     lambda q, kc, vc, k, v, pk, pv, t: (q.to(torch.float8_e4m3fn), kc.to(torch.float8_e4m3fn),
                                         vc.to(torch.float8_e4m3fn), None, None, 1)),
    ("descale-without-fp8", ValueError, "k_descale dequantizes a float8 cache",
     lambda q, kc, vc, k, v, pk, pv, t: (q, kc, vc, k, v, 1, None, dict(k_descale=0.5))),
]
ERRORS += [(f"{name}-{what}", error, name,
            lambda q, kc, vc, k, v, pk, pv, t, name=name, bad=bad: (
                q, kc.to(torch.float8_e5m2), vc.to(torch.float8_e5m2), k, v, 1, None,
                {name: bad}))
           for name in ("k_descale", "v_descale")
           for what, error, bad in (("zero", ValueError, 0.0), ("nan", ValueError, float("nan")),
                                    ("float64", TypeError, torch.ones(2, 2, dtype=torch.float64)),
                                    ("shape", TypeError, torch.ones(2, 3)),
                                    ("3d", TypeError, torch.ones(1, 2, 2)),
                                    ("bool", TypeError, True))]
ERRORS += [(f"{arg}-{what}", TypeError, arg, _per_sequence(arg, bad))
           for arg in ("cache_batch_idx", "cache_leftpad")
           for what, bad in (("shape", torch.tensor([0])), ("dtype", torch.tensor([0.0, 1.0])))]


def _rotary(seqlen_ro, half):
    return dict(rotary_cos=torch.ones(seqlen_ro, half), rotary_sin=torch.zeros(seqlen_ro, half))


@pytest.mark.parametrize("name, error, match, make", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_leave_the_cache_unchanged(name, error, match, make):
    inputs = _error_inputs()
    args = make(*inputs)
    kw = args[7] if len(args) > 7 else {}
    block_table = args[6] if len(args) > 6 else None
    caches = [x for x in args[1:3]]
    before = [c.clone() for c in caches]
    with pytest.raises(error, match=match):
        longflash.attention_with_kvcache(*args[:5], cache_seqlens=args[5],
                                         block_table=block_table, **kw)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(caches, before))


# ----------------------------------------------------------------------------- routing

@pytest.fixture
def route_small(monkeypatch):
    """Route short queries over keys of >= 20 tokens to the split-KV path; record the key
    lengths each call passes (an int, or a tensor of per-sequence lengths)."""
    from longflash import interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 20)
    calls = []
    original = kvcache._forward
    monkeypatch.setattr(kvcache, "_forward",
                        lambda *a, **kw: calls.append(a[3]) or original(*a, **kw))
    return calls


def check_route_output(o, lse, q, k, v, low, **kw):
    """o, lse of attention() on q, k, v (float64 on the CPU) cast to `low`, within the
    tolerance rule of the float64 reference."""
    ref = attention_ref(q, k, v, **kw)
    lowp = attention_ref(*(x.cpu() for x in low), upcast=False, **kw)
    check_close("o", o.cpu(), lowp[0], ref[0])
    check_close("lse", lse.cpu(), lowp[1], ref[1])


def check_attention_routes_to_split_kv(calls, q, k, v, dtype, device="cpu", **kw):
    """q, k, v: float64 on the CPU. attention() in dtype on device, without a gradient, takes
    the split-KV path with the key length as one int (calls: route_small's record) and is within
    the tolerance rule of the float64 reference; with a gradient, the main kernel runs."""
    low = [x.to(device, dtype) for x in (q, k, v)]
    kw_on = {key: val.to(device) if isinstance(val, torch.Tensor) else val
             for key, val in kw.items()}
    with torch.no_grad():
        o, lse = longflash.attention(*low, return_lse=True, **kw_on)
    assert calls == [k.shape[1]], "attention did not take the split-KV path with an int length"
    check_route_output(o, lse, q, k, v, low, **kw)
    longflash.attention(low[0].requires_grad_(), *low[1:], **kw_on)
    assert len(calls) == 1


@pytest.mark.skipif(not INTERPRET, reason="routing is on the Triton backend (interpreter here)")
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(9, 0), softcap=0.5),
                                dict(alibi=(6,)), dict(causal=True, mask="padding"),
                                dict(window_size=(9, 0), mask="float-heads")],
                         ids=["causal", "window-softcap", "alibi", "causal-padding-mask",
                              "window-float-mask"])
def test_attention_routes_decoding_to_split_kv(route_small, kw):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 6, 24, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 41, 2, 24, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 41, 2, 24, generator=gen, dtype=torch.float64)
    kw = dict(kw)
    if "alibi" in kw:
        kw["alibi_slopes"] = torch.rand(kw.pop("alibi"), generator=gen) * 0.5
    if kw.get("mask") == "padding":  # (batch, 1, 1, seqlen_k): keys 30 and on of sequence 1
        kw["attn_mask"] = (torch.arange(41) < torch.tensor([41, 30])[:, None])[:, None, None]
    elif "mask" in kw:  # (nheads, seqlen_q, seqlen_k), stored keys-major: strided keys
        kw["attn_mask"] = make_mask(kw["mask"], q, 41)[0].mT.contiguous().mT
    kw.pop("mask", None)
    check_attention_routes_to_split_kv(route_small, q, k, v, torch.float32, **kw)


@pytest.mark.skipif(not INTERPRET, reason="routing is on the Triton backend (interpreter here)")
def test_attention_with_a_learned_mask_keeps_the_main_kernel(route_small):
    """A float attn_mask that requires grad needs the main kernels' backward (its gradient):
    attention does not route it to the split-KV path, which is inference only."""
    q, k, v = (torch.randn(1, n, 2, 16) for n in (2, 41, 41))
    mask = torch.randn(2, 2, 41, requires_grad=True)
    longflash.attention(q, k, v, attn_mask=mask).sum().backward()
    assert route_small == [] and mask.grad is not None


@pytest.mark.skipif(not INTERPRET, reason="routing is on the Triton backend (interpreter here)")
def test_compiled_attention_routes_decoding_to_split_kv(monkeypatch):
    from longflash import interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 20)
    check_compiled_route("aot_eager", torch.float32)


@pytest.mark.skipif(not INTERPRET, reason="routing is on the Triton backend (interpreter here)")
def test_attention_varlen_routes_decoding_to_split_kv(route_small):
    gen = torch.Generator().manual_seed(3)
    lengths_k = [25, 40, 31]
    q = torch.randn(3 * 2, 4, 16, generator=gen)
    k = torch.randn(sum(lengths_k), 2, 16, generator=gen)
    v = torch.randn(sum(lengths_k), 2, 16, generator=gen)
    cu_q = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 65, 96], dtype=torch.int32)
    o, lse = longflash.attention_varlen(q, k, v, cu_q, cu_k, 2, 40, causal=True,
                                        return_lse=True)
    assert route_small
    ref = longflash.attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         causal=True)
    low = longflash.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, upcast=False)
    check_close("o", o, low[0], ref[0])
    check_close("lse", lse, low[1], ref[1])
