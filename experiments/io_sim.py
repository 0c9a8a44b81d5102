"""A two-level memory machine that runs LongFlash's tiled algorithm and standard attention.

`TwoLevelMemory` holds the slow memory (HBM: named float64 tensors, unbounded) and a fast
memory of `capacity` elements (named tiles). Arithmetic is done only on tiles; every element
goes through `load` (HBM -> fast, counted as a read) or `store` (fast -> HBM, counted as a
write); `alloc` and `load` assert that the resident tiles never exceed `capacity`. The loops
below are those of `flash_triton.py` (same block ranges from `_common`, same tile names) and of
the standard attention modelled in `io_model.py`; they compute the real output, which the tests
compare with `longflash.attention_ref` in float64, and their counts must equal `io_model`'s
closed form exactly.

With a block mask (io_model.BlockSparse) LongFlash's loops go over the kept tiles only, found
as the kernels find them, from the lists of `_common.block_lists` in HBM: a list entry is
read into a register (`TwoLevelMemory.index`: counted as moved, not as fast memory).

What occupies fast memory: every tile and every row vector that lives across statements, at its
nominal size (BLOCK rows, even at a sequence end, as in the kernel's registers and shared
memory). Temporaries inside one expression (the masked row max, alpha) stand for registers and
are not counted. Rows past a sequence end are masked loads: padding that moves nothing.
"""

import math
from collections import Counter
from itertools import product

import torch

from experiments.io_model import standard_tiles
from longflash import _common
from longflash._common import key_range, query_range

NEG_INF = float("-inf")


class TwoLevelMemory:
    def __init__(self, capacity, hbm):
        self.capacity, self.hbm = capacity, hbm
        self.tiles = {}
        self.used = self.peak = 0
        self.moved = Counter()  # ("read" | "write", tensor) -> elements

    def alloc(self, name, *shape, fill=0.0):
        assert name not in self.tiles, f"tile {name} is already in fast memory"
        self.used += math.prod(shape)
        assert self.used <= self.capacity, f"fast memory overflow: {self.used} > {self.capacity}"
        self.peak = max(self.peak, self.used)
        self.tiles[name] = torch.full(shape, fill, dtype=torch.float64)
        return self.tiles[name]

    def load(self, name, b, h, start, rows, col=0, cols=None, fill=0.0, tile=None):
        """Rows [start, start + rows) (columns [col, col + cols) if cols is given) of HBM
        tensor `name`[b, h] into the fast-memory tile `tile` (default `name`); rows and
        columns past the ends are `fill`."""
        src = self.hbm[name][b, h]
        part, shape = src[start:start + rows], [rows, *src.shape[1:]]  # lse, delta: 1-D
        if cols is not None:
            part, shape[1] = part[:, col:col + cols], cols
        t = self.alloc(tile or name, *shape, fill=fill)
        t[tuple(slice(0, n) for n in part.shape)] = part
        self.moved["read", name] += part.numel()
        return t

    def store(self, tile, name, b, h, start, col=None):
        """The part of `tile` that lies inside HBM tensor `name`[b, h], from row `start` (and
        column `col` of a matrix); rows and columns past the ends are masked."""
        dst = self.hbm[name][b, h][start:start + tile.shape[0]]
        if col is not None:
            dst = dst[:, col:col + tile.shape[1]]
        dst.copy_(tile[tuple(slice(0, n) for n in dst.shape)])
        self.moved["write", name] += dst.numel()

    def index(self, name, b, h, row, col):
        """Entry [row, col] of the int32 HBM tensor `name`[b, h] (a block list), into a
        register: one element read."""
        self.moved["read", name] += 1
        return int(self.hbm[name][b, h][row, col])

    def free(self, *names):
        for name in names:
            self.used -= self.tiles.pop(name).numel()


def window(shape):
    """(window_left, window_right) of `_common`'s block ranges: causal is window_right = 0."""
    return (-1, 0) if shape.causal else (-1, -1)


def visible(shape, start_m, start_n, BLOCK_M, BLOCK_N):
    """(BLOCK_M, BLOCK_N) bool: query i may see key j; False past the sequence ends. (A block
    mask needs no term: a tile lies inside one block, and a hidden one is never visited.)"""
    i = torch.arange(start_m, start_m + BLOCK_M)[:, None]
    j = torch.arange(start_n, start_n + BLOCK_N)[None, :]
    Nq, Nk = shape.seqlen_q, shape.seqlen_k
    return (i < Nq) & (j < Nk) & _common.visible(i, j, Nq, Nk, *window(shape))


def visited_tiles(mem, sparse, b, h, start, lo, hi, TILE, transposed=False):
    """The first rows of the tiles of [lo, hi) (lo a multiple of TILE) that the loop of the
    block starting at `start` visits, in order: every one without a block mask (sparse None);
    with one, those whose block is kept, found as flash_triton's _sparse_span and
    _sparse_tile find them in the HBM lists of batch entry b, head h ("lists" of query
    blocks, or "lists_t" of key blocks if transposed): the span from the block's row of
    running counts, then each tile's block index."""
    if sparse is None:
        return range(lo, hi, TILE)
    lists = "lists_t" if transposed else "lists"
    stay, block = ((sparse.block_size_k, sparse.block_size_q) if transposed
                   else (sparse.block_size_q, sparse.block_size_k))
    row, per, cols = start // stay, block // TILE, (mem.hbm[lists].shape[-1] - 1) // 2

    def before(t):  # kept tiles before tile t: _tiles_before
        blk, rem = divmod(t, per)
        blocks = mem.index(lists, b, h, row, blk)
        inside = mem.index(lists, b, h, row, blk + 1) - blocks if rem else 0  # blk kept?
        return blocks * per + inside * rem

    first, last = before(lo // TILE), before(-(-hi // TILE))
    return [(mem.index(lists, b, h, row, cols + 1 + i // per) * per + i % per) * TILE
            for i in range(first, last)]


def heads(shape):
    """(b, h, hk): every query head with its key/value head (GQA)."""
    group = shape.nheads // shape.nheads_kv
    return [(b, h, h // group) for b, h in product(range(shape.batch), range(shape.nheads))]


def kv_heads(shape):
    """(b, hk, query heads of the group)."""
    group = shape.nheads // shape.nheads_kv
    return [(b, hk, range(hk * group, (hk + 1) * group))
            for b, hk in product(range(shape.batch), range(shape.nheads_kv))]


# -- LongFlash ---------------------------------------------------------------------------------

def longflash_fwd(mem, shape, tiles, scale, sparse=None):
    BLOCK_M, BLOCK_N = tiles.fwd
    d = shape.headdim
    for (b, h, hk), start_m in product(heads(shape), range(0, shape.seqlen_q, BLOCK_M)):
        q = mem.load("q", b, h, start_m, BLOCK_M)
        acc = mem.alloc("acc", BLOCK_M, d)
        m_i, l_i = mem.alloc("m_i", BLOCK_M, fill=NEG_INF), mem.alloc("l_i", BLOCK_M)
        m_ij = mem.alloc("m_ij", BLOCK_M)
        lo, _, _, hi = key_range(start_m, BLOCK_M, BLOCK_N, shape.seqlen_q, shape.seqlen_k,
                                 *window(shape))
        for start_n in visited_tiles(mem, sparse, b, h, start_m, lo, hi, BLOCK_N):
            k, v = mem.load("k", b, hk, start_n, BLOCK_N), mem.load("v", b, hk, start_n, BLOCK_N)
            # -- compute qk; the mask also covers padding past the sequence ends --
            s = mem.alloc("s", BLOCK_M, BLOCK_N)
            s.copy_((q @ k.T * scale).masked_fill(
                ~visible(shape, start_m, start_n, BLOCK_M, BLOCK_N), NEG_INF))
            # -- online softmax: new row max, rescale what was accumulated --
            m_ij.copy_(torch.maximum(m_i, s.amax(1)))
            m_safe = torch.where(m_ij == NEG_INF, 0.0, m_ij)  # rows that saw no key yet
            s.sub_(m_safe[:, None]).exp_()                     # s now holds p
            alpha = torch.exp(m_i - m_safe)
            l_i.mul_(alpha).add_(s.sum(1))
            acc.mul_(alpha[:, None]).add_(s @ v)
            m_i.copy_(m_ij)
            mem.free("k", "v", "s")
        # -- epilogue: a row that saw no key gives o = 0, lse = -inf --
        l_safe = torch.where(l_i == 0, 1.0, l_i)
        mem.store(acc.div_(l_safe[:, None]), "o", b, h, start_m)
        mem.store(torch.where(l_i == 0, NEG_INF, m_i + l_safe.log()), "lse", b, h, start_m)
        mem.free("q", "acc", "m_i", "l_i", "m_ij")


def _probs(mem, shape, q, k, lse, start_m, start_n, scale):
    """Tile p = exp(q k^T scale - lse), recomputed from the saved lse."""
    p = mem.alloc("p", q.shape[0], k.shape[0])
    lse = torch.where(lse == NEG_INF, float("inf"), lse)  # a row that saw no key: p = 0
    mask = visible(shape, start_m, start_n, q.shape[0], k.shape[0])
    return p.copy_(torch.exp((q @ k.T * scale - lse[:, None]).masked_fill(~mask, NEG_INF)))


def longflash_bwd(mem, shape, tiles, scale, sparse=None):
    d, Nq, Nk = shape.headdim, shape.seqlen_q, shape.seqlen_k
    # -- preprocess: delta = rowsum(dO * O) (the dQ kernel's query blocks) --
    BLOCK_M = tiles.dq[0]
    for (b, h, _), start_m in product(heads(shape), range(0, Nq, BLOCK_M)):
        o, do = mem.load("o", b, h, start_m, BLOCK_M), mem.load("do", b, h, start_m, BLOCK_M)
        delta = mem.alloc("delta", BLOCK_M)
        mem.store(delta.copy_((o * do).sum(1)), "delta", b, h, start_m)
        mem.free("o", "do", "delta")

    # -- dK, dV: K_j, V_j stay; the query blocks that see them stream, head by head of the group --
    BLOCK_M, BLOCK_N = tiles.dkdv
    for (b, hk, group), start_n in product(kv_heads(shape), range(0, Nk, BLOCK_N)):
        k, v = mem.load("k", b, hk, start_n, BLOCK_N), mem.load("v", b, hk, start_n, BLOCK_N)
        dk, dv = mem.alloc("dk", BLOCK_N, d), mem.alloc("dv", BLOCK_N, d)
        lo, _, _, hi = query_range(start_n, BLOCK_M, BLOCK_N, Nq, Nk, *window(shape))
        for h, start_m in ((h, m) for h in group for m in visited_tiles(
                mem, sparse, b, h, start_n, lo, hi, BLOCK_M, transposed=True)):
            q, do = mem.load("q", b, h, start_m, BLOCK_M), mem.load("do", b, h, start_m, BLOCK_M)
            lse, delta = (mem.load(t, b, h, start_m, BLOCK_M) for t in ("lse", "delta"))
            p = _probs(mem, shape, q, k, lse, start_m, start_n, scale)
            dv += p.T @ do
            ds = mem.alloc("ds", BLOCK_M, BLOCK_N)
            ds.copy_(do @ v.T).sub_(delta[:, None]).mul_(p)  # dS = p * (dP - delta)
            dk += ds.T @ q
            mem.free("q", "do", "lse", "delta", "p", "ds")
        mem.store(dk.mul_(scale), "dk", b, hk, start_n)
        mem.store(dv, "dv", b, hk, start_n)
        mem.free("k", "v", "dk", "dv")

    # -- dQ: Q_i, dO_i, lse_i, delta_i stay; the key blocks they see stream --
    BLOCK_M, BLOCK_N = tiles.dq
    for (b, h, hk), start_m in product(heads(shape), range(0, Nq, BLOCK_M)):
        q, do = mem.load("q", b, h, start_m, BLOCK_M), mem.load("do", b, h, start_m, BLOCK_M)
        lse, delta = (mem.load(t, b, h, start_m, BLOCK_M) for t in ("lse", "delta"))
        dq = mem.alloc("dq", BLOCK_M, d)
        lo, _, _, hi = key_range(start_m, BLOCK_M, BLOCK_N, Nq, Nk, *window(shape))
        for start_n in visited_tiles(mem, sparse, b, h, start_m, lo, hi, BLOCK_N):
            k, v = mem.load("k", b, hk, start_n, BLOCK_N), mem.load("v", b, hk, start_n, BLOCK_N)
            p = _probs(mem, shape, q, k, lse, start_m, start_n, scale)
            ds = mem.alloc("ds", BLOCK_M, BLOCK_N)
            dq += ds.copy_(do @ v.T).sub_(delta[:, None]).mul_(p) @ k
            mem.free("k", "v", "p", "ds")
        mem.store(dq.mul_(scale), "dq", b, h, start_m)
        mem.free("q", "do", "lse", "delta", "dq")


# -- standard attention (Algorithm 0) ----------------------------------------------------------

def _block(mem, tile, operand, b, h, row, rows, col, cols):
    """Block [row, row + rows) x [col, col + cols) of a product's operand (HBM tensor,
    stored transposed?) into the fast-memory tile `tile`."""
    name, transposed = operand
    if transposed:
        return mem.load(name, b, h, col, cols, row, rows, tile=tile).T
    return mem.load(name, b, h, row, rows, col, cols, tile=tile)


def _product(mem, out, m, n, parts, tile, a, b, finish=None):
    """out = sum over parts of A B, output-stationary: a (bm, bn) tile of the (m, n) result
    stays in fast memory while (bm, bk) blocks of A and (bk, bn) blocks of B stream.
    out: (HBM tensor, batch, head); a, b: (HBM tensor, stored transposed?); parts: (batch,
    head of A, head of B, inner length); finish(c, start_m, start_n) scales or masks the tile."""
    bm, bn, bk = tile
    for start_m, start_n in product(range(0, m, bm), range(0, n, bn)):
        c = mem.alloc("c", bm, bn)
        for (batch, h_a, h_b, k), kk in ((p, kk) for p in parts for kk in range(0, p[3], bk)):
            c += (_block(mem, "a", a, batch, h_a, start_m, bm, kk, bk)
                  @ _block(mem, "b", b, batch, h_b, kk, bk, start_n, bn))
            mem.free("a", "b")
        if finish is not None:
            finish(c, start_m, start_n)
        mem.store(c, *out, start_m, start_n)
        mem.free("c")


def standard_fwd(mem, shape, sram, scale, sparse=None):
    d, Nq, Nk = shape.headdim, shape.seqlen_q, shape.seqlen_k
    tiles = standard_tiles(shape, sram)
    side = tiles["P"]

    if sparse is not None:
        blocks = sparse.mask.expand(shape.batch, shape.nheads, *sparse.mask.shape[2:])
    for b, h, hk in heads(shape):
        def mask(c, start_m, start_n, b=b, h=h):
            seen = visible(shape, start_m, start_n, *c.shape)
            if sparse is not None:  # the block mask, elementwise, inside the sequences
                rows, cols = min(c.shape[0], Nq - start_m), min(c.shape[1], Nk - start_n)
                seen[:rows, :cols] &= _common.block_mask_elements(
                    blocks[b, h], sparse.block_size_q, sparse.block_size_k, rows, cols,
                    start_m, start_n)
            c.mul_(scale).masked_fill_(~seen, NEG_INF)

        # -- S = Q K^T, masked as it is written --
        _product(mem, ("s", b, h), Nq, Nk, [(b, h, hk, d)], tiles["S"], ("q", False),
                 ("k", True), mask)
        # -- P = softmax(S) by (side, side) tiles: one pass for the row max and sum (online),
        #    one to write P --
        for start_m in range(0, Nq, side):
            m_i, l_i = mem.alloc("m_i", side, fill=NEG_INF), mem.alloc("l_i", side)
            m_ij = mem.alloc("m_ij", side)
            for second_pass, start_n in product((False, True), range(0, Nk, side)):
                if second_pass and start_n == 0:  # a row that saw no key: p = 0
                    m_i.copy_(torch.where(m_i == NEG_INF, 0.0, m_i))
                    l_i.copy_(torch.where(l_i == 0, float("inf"), l_i))
                s = mem.load("s", b, h, start_m, side, start_n, side, fill=NEG_INF)
                if second_pass:
                    mem.store(s.sub_(m_i[:, None]).exp_().div_(l_i[:, None]), "p", b, h,
                              start_m, start_n)
                else:
                    m_ij.copy_(torch.maximum(m_i, s.amax(1)))
                    m_safe = torch.where(m_ij == NEG_INF, 0.0, m_ij)
                    l_i.mul_(torch.exp(m_i - m_safe)).add_(torch.exp(s - m_safe[:, None]).sum(1))
                    m_i.copy_(m_ij)
                mem.free("s")
            mem.free("m_i", "l_i", "m_ij")
        # -- O = P V --
        _product(mem, ("o", b, h), Nq, d, [(b, h, hk, Nk)], tiles["O"], ("p", False),
                 ("v", False))


def standard_bwd(mem, shape, sram, scale, sparse=None):  # P is 0 where the mask hides
    d, Nq, Nk = shape.headdim, shape.seqlen_q, shape.seqlen_k
    tiles = standard_tiles(shape, sram)
    side = tiles["dS"]

    def scaled(c, *_):
        c.mul_(scale)

    # -- dV = P^T dO: the group's query heads are part of the inner dimension --
    for b, hk, group in kv_heads(shape):
        _product(mem, ("dv", b, hk), Nk, d, [(b, h, h, Nq) for h in group], tiles["dV"],
                 ("p", True), ("do", False))
    for b, h, hk in heads(shape):
        # -- dP = dO V^T --
        _product(mem, ("dp", b, h), Nq, Nk, [(b, h, hk, d)], tiles["dP"], ("do", False),
                 ("v", True))
        # -- dS = P * (dP - rowsum(P * dP)): one pass for the row sums, one to write dS --
        for start_m in range(0, Nq, side):
            rowsum = mem.alloc("rowsum", side)
            for second_pass, start_n in product((False, True), range(0, Nk, side)):
                p = mem.load("p", b, h, start_m, side, start_n, side)
                dp = mem.load("dp", b, h, start_m, side, start_n, side)
                if second_pass:
                    mem.store(dp.sub_(rowsum[:, None]).mul_(p), "ds", b, h, start_m, start_n)
                else:
                    rowsum += (p * dp).sum(1)
                mem.free("p", "dp")
            mem.free("rowsum")
        # -- dQ = dS K --
        _product(mem, ("dq", b, h), Nq, d, [(b, h, hk, Nk)], tiles["dQ"], ("ds", False),
                 ("k", False), scaled)
    # -- dK = dS^T Q --
    for b, hk, group in kv_heads(shape):
        _product(mem, ("dk", b, hk), Nk, d, [(b, h, h, Nq) for h in group], tiles["dK"],
                 ("ds", True), ("q", False), scaled)


# -- running both --------------------------------------------------------------------------------

def simulate(provider, shape, tiles, q, k, v, do, capacity, softmax_scale=None, sparse=None):
    """Run `provider`'s forward then backward on a TwoLevelMemory of `capacity` elements;
    sparse: an io_model.BlockSparse (LongFlash's loops skip its hidden tiles; standard
    attention masks them elementwise as S is written).

    q: (batch, seqlen_q, nheads, headdim), k, v: (batch, seqlen_k, nheads_kv, headdim), do like q.
    Returns (fwd machine, bwd machine, outputs): the machines hold .moved and .peak; outputs
    is a dict o, dq, dk, dv (and lse for LongFlash) in the API's layout, float64.
    """
    scale = shape.headdim ** -0.5 if softmax_scale is None else softmax_scale
    bhsd = lambda x: x.detach().double().transpose(1, 2).contiguous()  # noqa: E731  (B, H, N, D)
    hbm = {"q": bhsd(q), "k": bhsd(k), "v": bhsd(v), "do": bhsd(do)}
    B, H, Hkv, Nq, Nk = shape.batch, shape.nheads, shape.nheads_kv, shape.seqlen_q, shape.seqlen_k
    nan = lambda *s: torch.full(s, float("nan"), dtype=torch.float64)  # noqa: E731  unwritten = NaN
    hbm.update(o=nan(B, H, Nq, shape.headdim), dq=nan(B, H, Nq, shape.headdim),
               dk=nan(B, Hkv, Nk, shape.headdim), dv=nan(B, Hkv, Nk, shape.headdim))
    if provider == "longflash":
        hbm.update(lse=nan(B, H, Nq), delta=nan(B, H, Nq))
        fwd, bwd = longflash_fwd, longflash_bwd
        if sparse is not None:
            mask = sparse.mask.expand(B, H, *sparse.mask.shape[2:])
            hbm.update(lists=_common.block_lists(mask),
                       lists_t=_common.block_lists(mask.transpose(-1, -2)))
    else:
        hbm.update({t: nan(B, H, Nq, Nk) for t in ("s", "p", "dp", "ds")})
        fwd, bwd = standard_fwd, standard_bwd
    machines = TwoLevelMemory(capacity, hbm), TwoLevelMemory(capacity, hbm)
    setting = tiles if provider == "longflash" else capacity  # standard picks its own tiles
    fwd(machines[0], shape, setting, scale, sparse)
    bwd(machines[1], shape, setting, scale, sparse)
    assert not any(m.tiles for m in machines), "a tile was left in fast memory"
    outputs = {t: hbm[t].transpose(1, 2) for t in ("o", "dq", "dk", "dv")}
    if provider == "longflash":
        outputs["lse"] = hbm["lse"]
    return *machines, outputs
