"""Block-sparse decoding (attention_with_kvcache's block_mask, block_size) against the float64
reference over the elementwise mask it stands for: contiguous and paged caches, GQA packing
with per-head masks, splits, with the other options and an attn_mask; that a key block no row
sees is not read, that each KV head reads its group's blocks only, split evenly (the programs'
lists); bad masks."""

import pytest
import torch

import longflash
from longflash import _common, attention_ref, kvcache
from conftest import INTERPRET
from test_kvcache import BACKENDS, _compile_recorded, _ops, check_case

UNIT = _common.BLOCK_SPARSE_UNIT


def _blocks(batch, nheads, seqlen_q, positions, dims, block_size=UNIT, seed=5):
    """A random block_mask over `positions` cache rows ("BH", "1H", "B1": which of batch and
    heads it has): about 60% of blocks seen; block 1 seen by no row (a tile every program
    skips); with heads, head 1 sees no block at all (o = 0, lse = -inf)."""
    bq, bk = _common.check_block_size(block_size)
    size = (batch if dims[0] == "B" else 1, nheads if dims[1] == "H" else 1, -(-seqlen_q // bq),
            -(-positions // bk))
    mask = torch.rand(size, generator=torch.Generator().manual_seed(seed)) < 0.6
    mask[..., 0] = True
    mask[..., 1] = False
    if dims[1] == "H":
        mask[:, 1] = False
    return mask


# test_kvcache's cases: (id, batch, seqlen_q, nheads, nheads_kv, headdim, page_size (None:
# contiguous), capacity (contiguous: slots per sequence; paged: max_pages), lengths,
# seqlen_new, kwargs), with caches of several 128-key blocks
CASES = [
    ("decode-H8/2-D32-heads-causal", 3, 1, 8, 2, 32, None, 700, [650, 300, 0], 1,
     dict(causal=True, block_mask=_blocks(3, 8, 1, 700, "BH"))),
    ("spec3-paged48-H4/1-D16-shared-window-leftpad", 2, 3, 4, 1, 16, 48, 12, [520, 200], 2,
     dict(causal=True, window_size=(300, -1), leftpad=[100, 0],
          block_mask=_blocks(2, 4, 3, 12 * 48, "1H", (128, 256)), block_size=(128, 256))),
    ("noappend-H2/2-D24-batch-alibi-softcap", 2, 2, 2, 2, 24, None, 400, [400, 130], 0,
     dict(alibi=(2,), softcap=0.9, block_mask=_blocks(2, 2, 2, 400, "B1"))),
    # 5 queries x 16 heads of one KV head: 80 packed rows, two Triton programs (64 rows each)
    ("spec5-H16/1-D16-heads-two-programs", 1, 5, 16, 1, 16, None, 1000, [860], 5,
     dict(causal=True, block_mask=_blocks(1, 16, 5, 1000, "BH", seed=9))),
    # blocks of 64 keys (below the kernel's key tile of 128 at head dims up to 64) and of 64
    # queries: two query blocks in one program's rows
    ("spec2-paged32-H8/1-D16-heads-blocks64", 2, 2, 8, 1, 16, 32, 10, [300, 90], 1,
     dict(causal=True, block_mask=_blocks(2, 8, 2, 10 * 32, "BH", 64, seed=3), block_size=64)),
]


def case_id(case):
    return case[0]


@pytest.mark.parametrize("block_n", [8, None], ids=["keys8", "keys-default"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path(dtype, case, num_splits, block_n, monkeypatch):
    if block_n:  # several key steps per block_mask block; by default, one per block
        monkeypatch.setattr(kvcache, "BLOCK_N", block_n)
        monkeypatch.setattr(kvcache, "MAX_BLOCK_N", block_n)
    check_case(case, dtype, "torch", num_splits)


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("num_splits", [1, 3], ids=["splits1", "splits3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_interpreter(dtype, case, num_splits):
    check_case(case, dtype, "triton", num_splits)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool-keys", "float-heads"])
def test_with_attn_mask(backend, mask_kind):
    """block_mask and an attn_mask together: a key must pass both."""
    check_case(CASES[0], torch.float32, backend, 3, mask_kind=mask_kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads", [1, 4], ids=["shared", "per-head"])
@pytest.mark.parametrize("num_splits", [1, 2], ids=["splits1", "splits2"])
def test_hidden_blocks_are_not_read(backend, num_splits, heads, device="cpu"):
    """The keys and values of block 1, which no row sees, are NaN: a tile loaded and then
    masked would give NaN (0 * NaN in p v), one not read nothing. Against the reference over
    the keys the mask keeps. The PyTorch path reads a mask shared by the heads through views
    of runs of visible tiles (one split), else gathers each KV head's (per head: KV head 1's
    group hides block 2 too), beside positions outside its split (two splits): neither may
    let a hidden key count."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=gen).to(device)
    k_cache, v_cache = (torch.randn(2, 512, 2, 16, generator=gen).to(device) for _ in range(2))
    block_mask = torch.ones(1, heads, 1, 4, dtype=torch.bool, device=device)
    block_mask[..., 1] = False
    block_mask[:, 2:, :, 2] = False
    k_nan, v_nan = k_cache.clone(), v_cache.clone()
    k_nan[:, UNIT:2 * UNIT], v_nan[:, UNIT:2 * UNIT] = float("nan"), float("nan")
    o = longflash.attention_with_kvcache(q, k_nan, v_nan, backend=backend, block_mask=block_mask,
                                         num_splits=num_splits)
    elements = _common.block_mask_elements(block_mask, UNIT, UNIT, 1, 512)
    o_ref = attention_ref(q.cpu(), k_cache.cpu(), v_cache.cpu(), attn_mask=elements.cpu())[0]
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.cpu(), o_ref, atol=2e-3 if device == "cuda" else 1e-5,
                               rtol=1e-5)  # (on a GPU, float32 dot products in TF32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_mask_for_the_whole_cache_through_a_decoding_loop(backend):
    """One block_mask over the cache's capacity, kept through the steps of a decoding loop
    (the appends grow the sequences past block boundaries), equals attn_mask's elementwise
    mask at every step."""
    gen = torch.Generator().manual_seed(8)
    batch, nheads, nheads_kv, headdim, capacity = 2, 4, 2, 16, 300
    k_cache, v_cache = (torch.randn(batch, capacity, nheads_kv, headdim, generator=gen)
                        for _ in range(2))
    block_mask = _blocks(batch, nheads, 1, capacity, "BH")
    elements = _common.block_mask_elements(block_mask, UNIT, UNIT, 1, capacity)
    k_dense, v_dense = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([120, 250])
    for _ in range(12):
        q, k, v = (torch.randn(batch, 1, h, headdim, generator=gen)
                   for h in (nheads, nheads_kv, nheads_kv))
        o, lse = longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths,
                                                  causal=True, block_mask=block_mask,
                                                  return_lse=True, backend=backend)
        o_el, lse_el = longflash.attention_with_kvcache(q, k_dense, v_dense, k, v, lengths,
                                                        causal=True, attn_mask=elements,
                                                        return_lse=True, backend=backend)
        torch.testing.assert_close(o, o_el, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, lse_el, atol=1e-5, rtol=1e-5)
        lengths += 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph(backend):
    """A block-sparse decoding step under torch.compile(fullgraph=True): the mask is an input
    of the decoding op, at int and tensor lengths, within the tolerance rule."""
    step, graphs = _compile_recorded(longflash.attention_with_kvcache, "aot_eager")
    for lengths in ([400, 400], [330, 90]):
        case = ("compiled-blocks", 2, 1, 8, 2, 32, None, 420, lengths, 1,
                dict(causal=True, block_mask=_blocks(2, 8, 1, 420, "BH")))
        check_case(case, torch.float32, backend, 0, int_seqlens=lengths[0] == lengths[1],
                   fn=step)
    assert graphs and all("longflash.kvcache_forward" in _ops(g) for g in graphs)


@pytest.mark.parametrize("heads", [1, 12], ids=["shared", "per-head"])
@pytest.mark.parametrize("seqlen_q, block_m, block_size_q", [(1, 16, 128), (5, 16, 128),
                                                            (300, 64, 128), (300, 32, 256)])
def test_group_block_lists(heads, seqlen_q, block_m, block_size_q):
    """A program's lists hold the blocks some of its rows see (of its group's heads and its
    rows' query blocks), against the union taken row by row; with block_m < group the union
    of the whole group's heads."""
    nheads_kv, group = 3, 4
    n_qblocks = -(-seqlen_q // block_size_q)
    mask = torch.rand(2, heads, n_qblocks, 7, generator=torch.Generator().manual_seed(2)) < 0.3
    lists = _common.group_block_lists(mask, group, seqlen_q, block_m, block_size_q)
    rows = seqlen_q * group
    programs = -(-rows // block_m)
    assert lists.shape == (2, nheads_kv if heads > 1 else 1, programs, 15)
    for hk in range(lists.shape[1]):
        for p in range(programs):
            want = torch.zeros(2, 7, dtype=torch.bool)
            for r in range(p * block_m, min(rows, (p + 1) * block_m)):
                for h in (range(hk * group, hk * group + group) if heads > 1 else [0]):
                    want |= mask[:, h, r // group // block_size_q]
            assert torch.equal(lists[:, hk, p], _common.block_lists(want))


def test_torch_path_reads_each_heads_visible_tiles(monkeypatch):
    """The PyTorch path reads, for each KV head, the tiles of the blocks its group sees and no
    other, the splits an equal share of them (as the kernel's programs): KV head 0's group
    sees blocks 4-7 (two each for two splits, not none and four), head 1's blocks 1 and 6."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 1, 4, 16, generator=gen)
    k_cache, v_cache = (torch.randn(1, 1024, 2, 16, generator=gen) for _ in range(2))
    mask = torch.zeros(1, 4, 1, 8, dtype=torch.bool)
    mask[0, 0, 0, 4:], mask[0, 1, 0, 5:], mask[0, 3, 0, [1, 6]] = True, True, True
    read = []
    gather = kvcache._gather

    def recording(cache, block_table, b, pos):
        read.append(pos)
        return gather(cache, block_table, b, pos)

    monkeypatch.setattr(kvcache, "_gather", recording)
    o = longflash.attention_with_kvcache(q, k_cache, v_cache, backend="torch", block_mask=mask,
                                         num_splits=2)
    blocks = {(hk, s): set() for hk in range(2) for s in range(2)}
    for pos in read[::2]:  # keys, then values at the same positions
        assert pos.shape[:3] == (1, 2, 2)
        for hk in range(2):
            for s in range(2):
                blocks[hk, s] |= set((pos[0, hk, s] // UNIT).tolist()) - {0}
    assert blocks == {(0, 0): {4, 5}, (0, 1): {6, 7}, (1, 0): {1}, (1, 1): {6}}
    o_ref = attention_ref(q, k_cache, v_cache, attn_mask=_common.block_mask_elements(
        mask, UNIT, UNIT, 1, 1024))[0]
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="the Triton launcher's kept lists, interpreted")
def test_triton_lists_made_once_per_mask(monkeypatch):
    """The decoding launcher makes a mask's program lists once: a second step with the same
    unchanged mask reuses them; a write into the mask makes them again."""
    from longflash import decode_triton
    made = []
    group_lists = decode_triton.group_block_lists
    monkeypatch.setattr(decode_triton, "group_block_lists",
                        lambda *a: made.append(1) or group_lists(*a))
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 1, 4, 16, generator=gen)
    k_cache, v_cache = (torch.randn(1, 300, 2, 16, generator=gen) for _ in range(2))
    mask = torch.ones(1, 4, 1, 3, dtype=torch.bool)
    outs = [longflash.attention_with_kvcache(q, k_cache, v_cache, backend="triton",
                                             block_mask=mask) for _ in range(2)]
    assert len(made) == 1 and torch.equal(outs[0], outs[1])
    mask[0, 0, 0, 1] = False
    longflash.attention_with_kvcache(q, k_cache, v_cache, backend="triton", block_mask=mask)
    assert len(made) == 2


def _call(**kw):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 16, generator=gen)
    k_cache, v_cache = (torch.randn(2, 300, 2, 16, generator=gen) for _ in range(2))
    return longflash.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=260,
                                            backend="torch", **kw)


@pytest.mark.parametrize("kw, error, match", [
    (dict(block_mask=torch.ones(2, 4, 1, 3)), TypeError, "block_mask must be a bool tensor"),
    (dict(block_mask=torch.ones(2, 4, 1, 2, dtype=torch.bool)), ValueError,
     r"block_mask must have shape .*at least 3\), got \(2, 4, 1, 2\)"),
    (dict(block_mask=torch.ones(2, 3, 1, 3, dtype=torch.bool)), ValueError,
     r"block_mask must have shape \(batch or 1, nheads or 1"),
    (dict(block_mask=torch.ones(2, 4, 2, 3, dtype=torch.bool)), ValueError,
     r"ceil\(seqlen_q / 128\)"),
    (dict(block_mask=torch.ones(2, 4, 1, 3, dtype=torch.bool), block_size=100), ValueError,
     "block_size must be a positive multiple of 64"),
], ids=["dtype", "too-few-key-blocks", "heads", "query-blocks", "block-size"])
def test_bad_block_mask(kw, error, match):
    with pytest.raises(error, match=match):
        _call(**kw)


@pytest.mark.parametrize("headdim, block_size_k, block_n", [
    (64, None, 128), (64, 64, 64), (64, 192, 64), (128, 64, 64), (128, 256, 64),
    (64, 384, 128)])
def test_split_kernels_key_tile_divides_the_blocks(headdim, block_size_k, block_n,
                                                   monkeypatch):
    """The split-KV kernel's key tile on a GPU (128 keys at head dims up to 64, else 64)
    divides a block_mask's key blocks: each tile inside one block."""
    from longflash import decode_triton
    monkeypatch.setattr(decode_triton, "_INTERPRET", False)
    cfg = decode_triton.launch_config(1, 4, headdim, block_size_k=block_size_k)
    assert cfg.kwargs["BLOCK_N"] == block_n


def test_more_key_blocks_than_the_keys_need():
    """A mask over more blocks than the sequences reach (the capacity's, or more) is taken."""
    mask = torch.ones(1, 1, 1, 5, dtype=torch.bool)
    torch.testing.assert_close(_call(block_mask=mask), _call(), atol=1e-6, rtol=1e-5)
