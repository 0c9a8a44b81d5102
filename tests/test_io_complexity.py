"""RQ2's IO model: the simulator's counts equal the closed form exactly, its fast memory never
exceeds M, its outputs are exact; the closed form has the shape of Theorem 2 (and, with a block
mask, of Dao et al. 2022's Proposition 4)."""

import csv
import json

import pytest
import torch

import longflash
from experiments import io_complexity
from experiments import io_model as io
from experiments.io_model import BlockSparse, Shape, Tiles, block_sizes, same_tiles
from experiments.io_sim import TwoLevelMemory, simulate

CASES = [  # (shape, LongFlash tiles or a fast-memory size for the "fit" rule)
    pytest.param(Shape(64, 64, 16), 512, id="N64-D16-M512"),
    pytest.param(Shape(64, 64, 16, True), 512, id="N64-D16-M512-causal"),
    pytest.param(Shape(97, 160, 24, True, 4, 2), same_tiles(32, 16),
                 id="Nq97-Nk160-H4/2-D24-32x16-causal"),
    pytest.param(Shape(160, 97, 24, True, 4, 2), Tiles((16, 32), (32, 16), (16, 8)),
                 id="Nq160-Nk97-H4/2-D24-tiles-per-kernel-causal"),
    pytest.param(Shape(113, 113, 40, False, 2, 1, 2), same_tiles(16, 16),
                 id="B2-N113-H2/1-D40-16x16"),
    pytest.param(Shape(50, 20, 8, True), same_tiles(8, 16), id="Nq50-Nk20-D8-rows-see-no-key"),
    pytest.param(Shape(1, 17, 16, True, 2, 2), same_tiles(16, 16), id="Nq1-Nk17-D16-causal"),
]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The simulator's tiles are tiny: extra threads only wait on each other, badly so on a
    busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def inputs(shape, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(n, h):
        return torch.randn(shape.batch, n, h, shape.headdim, generator=g, dtype=torch.float64)
    return (randn(shape.seqlen_q, shape.nheads), randn(shape.seqlen_k, shape.nheads_kv),
            randn(shape.seqlen_k, shape.nheads_kv), randn(shape.seqlen_q, shape.nheads))


def resolve(shape, setting):
    """(tiles, M): a fast-memory size gets the "fit" tiles; tiles get the smallest M they fit."""
    if isinstance(setting, int):
        return block_sizes(setting, shape.headdim), setting
    return setting, max(io.fast_mem_peak("longflash", shape, m, setting, None)
                        for m in ("fwd", "bwd"))


@pytest.mark.parametrize("provider", ["longflash", "standard"])
@pytest.mark.parametrize("shape, setting", CASES)
def test_simulator_equals_closed_form(provider, shape, setting):
    tiles, sram = resolve(shape, setting)
    q, k, v, do = inputs(shape)
    fwd, bwd, out = simulate(provider, shape, tiles, q, k, v, do, capacity=sram)
    for mode, machine in (("fwd", fwd), ("bwd", bwd)):
        expected = io.counts(provider, shape, mode, tiles, sram)
        assert +machine.moved == +expected, f"{mode}: simulated {dict(machine.moved)}"
        assert machine.peak == io.fast_mem_peak(provider, shape, mode, tiles, sram) <= sram

    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = longflash.attention_ref(q, k, v, causal=shape.causal)
    o.backward(do)
    for name, ref in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(out[name], ref, rtol=1e-12, atol=1e-12, msg=name)
    if provider == "longflash":
        torch.testing.assert_close(out["lse"], lse, rtol=1e-12, atol=1e-12)  # -inf included


def random_blocks(shape, dims, size_q, size_k, seed, empty_row=None):
    """A BlockSparse over `shape` with a random mask of (dims[0], dims[1], .., ..) (1 for a
    broadcast dimension): half the blocks kept; block row `empty_row` hidden whole."""
    rows, cols = -(-shape.seqlen_q // size_q), -(-shape.seqlen_k // size_k)
    mask = torch.rand(*dims, rows, cols, generator=torch.Generator().manual_seed(seed)) < 0.5
    if empty_row is not None:
        mask[..., empty_row, :] = False
    return BlockSparse(mask, size_q, size_k)


SPARSE_CASES = [  # (shape, tiles, mask dims (batch, heads), blocks (q, k), empty block row)
    pytest.param(Shape(300, 450, 16, False, 2, 1), Tiles((32, 64), (64, 32), (32, 32)),
                 (1, 2), (128, 128), None, id="Nq300-Nk450-H2/1-D16-per-head-128"),
    pytest.param(Shape(200, 130, 24, False, 4, 2, 2), Tiles((16, 16), (8, 32), (32, 64)),
                 (2, 1), (32, 64), 2, id="B2-Nq200-Nk130-H4/2-D24-per-batch-32x64-empty-row"),
    pytest.param(Shape(97, 160, 8, False, 2, 2), same_tiles(16, 32), (1, 1), (32, 32), 0,
                 id="Nq97-Nk160-D8-shared-32"),
]


@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
@pytest.mark.parametrize("provider", ["longflash", "standard"])
@pytest.mark.parametrize("shape, tiles, dims, blocks, empty", SPARSE_CASES)
def test_block_sparse_simulator_equals_closed_form(provider, shape, tiles, dims, blocks, empty,
                                                    causal):
    """LongFlash's loops over the kept tiles (found in the kernels' block lists) move what the
    closed form counts, list entries included; standard attention moves what it moves without
    a mask; both outputs equal attention_ref's with the block mask, in float64."""
    shape = shape._replace(causal=causal)
    sparse = random_blocks(shape, dims, *blocks, seed=len(shape), empty_row=empty)
    sram = max(io.fast_mem_peak("longflash", shape, m, tiles, None) for m in ("fwd", "bwd"))
    q, k, v, do = inputs(shape)
    fwd, bwd, out = simulate(provider, shape, tiles, q, k, v, do, capacity=sram, sparse=sparse)
    for mode, machine in (("fwd", fwd), ("bwd", bwd)):
        expected = io.counts(provider, shape, mode, tiles, sram, sparse)
        assert +machine.moved == +expected, f"{mode}: simulated {dict(machine.moved)}"
        assert machine.peak <= sram
        if provider == "longflash":
            dense = io.counts(provider, shape, mode, tiles, sram)
            assert expected["read", "k"] < dense["read", "k"]  # hidden tiles move nothing
            assert expected["read", "lists" if mode == "fwd" else "lists_t"] > 0
        else:
            assert expected == io.counts(provider, shape, mode, tiles, sram)

    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o, lse = longflash.attention_ref(q, k, v, causal=causal, block_mask=sparse.mask,
                                     block_size=blocks)
    o.backward(do)
    for name, ref in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        torch.testing.assert_close(out[name], ref, rtol=1e-12, atol=1e-12, msg=name)
    if provider == "longflash":
        torch.testing.assert_close(out["lse"], lse, rtol=1e-12, atol=1e-12)  # -inf included


def test_block_sparse_uniform_closed_form():
    """N = 1024, d = 64, 128 x 64 tiles, 128-blocks, k of the 64 blocks kept: K and V are read
    k / 64 of the dense times (sum_i kappa_i = s T_r Nk); the lists cost 2 entries a query
    block and one a visited tile; every block kept moves the dense elements plus the lists."""
    shape, tiles = Shape(1024, 1024, 64), same_tiles(128, 64)
    dense = io.longflash_counts(shape, "fwd", tiles)
    for kept in (0, 1, 16, 37, 64):
        bits = torch.zeros(64, dtype=torch.bool)
        bits[torch.randperm(64, generator=torch.Generator().manual_seed(kept))[:kept]] = True
        moved = io.longflash_counts(shape, "fwd", tiles, BlockSparse(bits.view(1, 1, 8, 8),
                                                                     128, 128))
        assert moved["read", "k"] == moved["read", "v"] == kept * 128 * 64  # 128 keys a block
        assert moved["read", "k"] * 64 == dense["read", "k"] * kept
        assert moved["read", "lists"] == 8 * 2 + 2 * kept  # 128-key blocks of 64-key tiles
        rest = {key: n for key, n in moved.items() if key not in (("read", "k"), ("read", "v"),
                                                                  ("read", "lists"))}
        assert rest == {key: n for key, n in dense.items() if key[1] not in ("k", "v")}


def test_block_sparse_bytes_are_linear_in_the_density():
    """Proposition 4's shape: bytes = (what does not stream) + s (what streams), forward and
    backward, so the streamed part's log-log slope in s is 1."""
    shape, sparse_tiles = Shape(4096, 4096, 64), io.sparse_tiles(block_sizes(2**16, 64), 128, 128)
    assert sparse_tiles.fwd == (128, 64) and sparse_tiles.dkdv == (64, 128)
    for mode in ("fwd", "bwd"):
        none = io.hbm_bytes(io.longflash_counts(shape, mode, sparse_tiles,
                                                BlockSparse(torch.zeros(1, 1, 32, 32, dtype=bool),
                                                            128, 128)))
        ss, streamed = [1 / 16, 1 / 8, 1 / 4, 1 / 2, 1], []
        order = torch.randperm(1024, generator=torch.Generator().manual_seed(0))
        for s in ss:
            bits = torch.zeros(32 * 32, dtype=torch.bool)
            bits[order[:int(s * 1024)]] = True
            moved = io.longflash_counts(shape, mode, sparse_tiles,
                                        BlockSparse(bits.view(1, 1, 32, 32), 128, 128))
            streamed.append(io.hbm_bytes(moved) - none)
        assert 0.999 < io.log_slope(ss, streamed) < 1.001, streamed


def test_fast_memory_capacity_is_enforced():
    shape, tiles = Shape(40, 40, 8, True), same_tiles(16, 8)
    sram = max(io.fast_mem_peak("longflash", shape, m, tiles, None) for m in ("fwd", "bwd"))
    with pytest.raises(AssertionError, match="fast memory overflow"):
        simulate("longflash", shape, tiles, *inputs(shape), capacity=sram - 1)
    mem = TwoLevelMemory(10, {})  # standard attention picks its tiles from M: test the machine
    mem.alloc("a", 2, 5)
    with pytest.raises(AssertionError, match="fast memory overflow"):
        mem.alloc("b", 1)


def test_hand_counted_forward():
    """N = 1024, d = 64, 128 x 64 tiles: Q once, K and V once per each of the 8 query blocks."""
    moved = io.longflash_counts(Shape(1024, 1024, 64), "fwd", same_tiles(128, 64))
    assert io.totals(moved) == (1024 * 64 + 2 * 8 * 1024 * 64, 1024 * 64 + 1024)
    assert io.hbm_bytes(moved) == 2 * (1024 * 64 * (1 + 16 + 1)) + 4 * 1024
    causal = io.longflash_counts(Shape(1024, 1024, 64, True), "fwd", same_tiles(128, 64))
    # query block i (of 8) visits (i + 1) * 128 keys: K and V each read 64 * 128 * 36 elements
    assert causal["read", "k"] == causal["read", "v"] == 64 * 128 * 36


@pytest.mark.parametrize("N, BLOCK_M, BLOCK_N", [(256, 64, 16), (1024, 128, 64), (512, 32, 32)])
def test_aligned_causal_closed_form(N, BLOCK_M, BLOCK_N):
    shape = Shape(N, N, 64, True)
    assert io.aligned_causal_streamed(N, BLOCK_M, BLOCK_N) == (
        io.keys_streamed(shape, BLOCK_M, BLOCK_N), io.queries_streamed(shape, BLOCK_M, BLOCK_N))


def test_block_sizes():
    d = 64
    assert block_sizes(4 * d + 3, d).fwd is None and block_sizes(4 * d + 4, d).fwd == (1, 1)
    assert block_sizes(6 * d + 4, d).dkdv == (1, 1)
    for sram in (500, 4096, 65536, 10**6):
        tiles = block_sizes(sram, d)
        for kernel in ("fwd", "dkdv", "dq"):
            bm, bn = getattr(tiles, kernel)
            b = bn if kernel == "dkdv" else bm  # the stationary block: one more row must not fit
            grown = (min(b + 1, d), b + 1) if kernel == "dkdv" else (b + 1, min(b + 1, d))
            assert io.footprint(kernel, d, bm, bn) <= sram < io.footprint(kernel, d, *grown)
    assert block_sizes(16384, d, "flash") == same_tiles(64, 64)  # B_c = ceil(M / 4d) = 64


def test_exponents_of_the_closed_form():
    """Theorem 2's shape: about 2 in N and d, -1 in M (in d^2 <= M <= N d), for "fit" tiles."""
    def hbm(N=16384, d=64, sram=2**16, mode="fwd"):
        return io.hbm_bytes(io.longflash_counts(Shape(N, N, d), mode, block_sizes(sram, d)))
    Ns, ds, Ms = [2**k for k in range(12, 17)], [16, 32, 64, 128], [2**k for k in range(12, 21)]
    for mode in ("fwd", "bwd"):
        assert 1.9 < io.log_slope(Ns, [hbm(N=N, mode=mode) for N in Ns]) < 2.05
        assert 1.8 < io.log_slope(ds, [hbm(d=d, mode=mode) for d in ds]) < 2.2
        assert -1.1 < io.log_slope(Ms, [hbm(sram=M, mode=mode) for M in Ms]) < -0.9
    # standard attention: Theta(N^2), nearly flat in M once M >= d^2
    std = [io.hbm_bytes(io.standard_counts(Shape(4096, 4096, 64), "fwd", M)) for M in Ms]
    assert -0.2 < io.log_slope(Ms, std) < 0


def test_crossover_is_near_d_squared():
    for d in (32, 128):
        m_star = io_complexity.crossover(Shape(16384, 16384, d), "fwd", 2)
        assert 0.5 * d**2 < m_star < 2 * d**2


def test_ncu_plan_and_target(tmp_path):
    path = tmp_path / "plan.csv"
    io_complexity.main(["--ncu-plan", str(path)])
    rows = list(csv.DictReader(open(path)))
    assert {r["provider"] for r in rows} == {"longflash", "sdpa_flash", "standard"}
    for r in rows:
        assert " ncu --clock-control none " in r["command"] and float(r["model_hbm_bytes"]) > 0
    for provider in ("longflash", "standard"):  # on CPU: the command ncu would wrap, tiny
        spec = dict(provider=provider, mode="bwd", batch=1, seqlen=64, nheads=2, headdim=16,
                    causal=True, dtype="float32")
        io_complexity.main(["--ncu-target", json.dumps(spec)])


def test_block_sparse_rows(tmp_path):
    """The experiment's block-sparse rows: a dense row at the same tiles, nested masks whose
    bytes fall with the density, simulated rows of both providers; one key per row."""
    from dataclasses import replace

    from experiments.results import write_results
    cfg = replace(io_complexity.Config(), seqlen=1024, densities=(1.0, 0.25, 0.0625),
                  sparse_sim_shapes=((130, 200, 8, 2, 1, 32, 64),))
    rows = io_complexity.sparse_rows(cfg, print)
    assert {r["experiment"] for r in rows} == {"io_complexity_sparse"}
    hbm = {(r["block_density"], r["mode"], r["causal"]): r["value"] for r in rows
           if r["metric"] == "hbm_bytes" and not r["simulated"] and r["block_mask"] != "none"}
    dense = {(r["mode"], r["causal"]): r["value"] for r in rows
             if r["metric"] == "hbm_bytes" and r["block_mask"] == "none"}
    for (mode, causal), full in dense.items():
        assert hbm[0.0625, mode, causal] < hbm[0.25, mode, causal] < hbm[1.0, mode, causal]
        assert full < hbm[1.0, mode, causal] < 1.001 * full  # the lists: a little more
    sim = [r for r in rows if r["simulated"] and r["metric"] == "sim_max_abs_err"]
    assert len(sim) == 2 * 2 * 2 and all(r["value"] < 1e-9 for r in sim)  # provider, causal, mode
    write_results(rows, str(tmp_path / "x.csv"), command="test",
                  key_columns=("memory_model", "block_mask"))
    masks = io_complexity.nested_masks(16, (0.5, 0.25))
    assert masks[0.25].sum() == 64 and (masks[0.25] <= masks[0.5]).all()
