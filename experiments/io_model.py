"""Closed-form HBM traffic of LongFlash and of standard attention, counted element by element.

Model (Hong & Kung 1981; Dao et al. 2022, Sec. 3.2): a slow memory (HBM) of unbounded size and
a fast memory (SRAM) of M elements; arithmetic happens only on data in fast memory; the cost is
the number of elements moved between the two. The functions below give that number exactly,
per tensor, for the loop order of LongFlash's kernels (`flash_triton.py`) and for standard
attention (Algorithm 0, as modelled below), as functions of the shape and the tile sizes.
`io_sim.py` executes both algorithms on an explicit fast memory and must reproduce these counts
exactly (tests/test_io_complexity.py); paper/sections/io_analysis.tex derives them.

Notation, per batch element and query head (K/V-side terms per key/value head):
    Nq = seqlen_q, Nk = seqlen_k, d = headdim, T_r = ceil(Nq / BLOCK_M), T_c = ceil(Nk / BLOCK_N)
    kappa_i = key rows in the key blocks that query block i visits    (keys_streamed = sum_i)
    rho_j   = query rows in the query blocks that visit key block j   (queries_streamed = sum_j)
    Without causal masking sum_i kappa_i = T_r Nk and sum_j rho_j = T_c Nq; causal blocks that no
    row can see are skipped (`_common.key_range` / `query_range`). Rows past a sequence end are
    masked loads and move nothing.

LongFlash, forward (a program per query block keeps Q_i, acc, m_i, l_i; K_j, V_j stream):
    read  Q: Nq d        K, V: d sum kappa          write O: Nq d    lse: Nq
LongFlash, backward (forward outputs already in HBM; dlse not modelled):
    preprocess   read O, dO: Nq d each                                 write delta: Nq
    dK/dV        per key block and key/value head: read K_j, V_j once, write dK_j, dV_j once;
                 per query head of the group: read Q, dO: d sum rho, lse, delta: sum rho
    dQ           read Q, dO: Nq d, lse, delta: Nq; K, V: d sum kappa   write dQ: Nq d
    GQA: the forward and the dQ kernel run a program per *query* head, so each reads the shared
    K, V itself; the dK/dV kernel loads K_j, V_j once for the whole group.

Standard attention ("Algorithm 0" of Dao et al. 2022, App. B), the model counted here: three
matrix products forward and four backward, each a textbook output-stationary blocked product
C (m x n) = A (m x k) B (k x n) whose output tile (bm x bn) is as large as fast memory allows
(`gemm_tiles`): it reads A ceil(n / bn) times and B ceil(m / bm) times and writes C once. S, P,
dP and dS (Nq x Nk each) go through HBM. A row reduction (P from S, dS from P and dP) reads
its rows twice, once for the row statistics and once to write the result, because a row of
Nk elements need not fit in fast memory. The causal mask is applied as S is written; no block
is skipped, so the counts do not depend on causal. For GQA, dV and dK sum over the group's
query heads inside the product (the group is part of its inner dimension).
    forward   S = Q K^T    (m, n, k) = (Nq, Nk, d)     write S
              P = softmax  read S twice                 write P
              O = P V      (Nq, d, Nk)                  write O
    backward  dV = P^T dO  (Nk, d, group Nq)            write dV
              dP = dO V^T  (Nq, Nk, d)                  write dP
              dS = P * (dP - rowsum(P * dP))  read P, dP twice   write dS
              dQ = dS K    (Nq, d, Nk)                  write dQ
              dK = dS^T Q  (Nk, d, group Nq)            write dK
Block-sparse attention (`BlockSparse`: attention's block_mask, blocks of block_size_q x
block_size_k, each a multiple of the kernels' tiles, so that a tile lies inside one block):
LongFlash's loops visit only the tiles of their range whose block is kept, so kappa_i and rho_j
count the rows of those tiles alone, per head (a mask may differ by batch entry and head), and
the loops read the kernels' block lists (`_common.block_lists`, int32): for each loop its span
in the list (two running counts, one more at an end inside a block, as flash_triton.
_tiles_before) and each visited tile's block index. The kernels split a loop over up to three
ranges (masked edges, unmasked middle), each reading its own span: at most 12 entries a loop,
modelled as the one range's. Standard attention applies the mask elementwise as S is written
and moves the same elements as without it (as with causal). The block mask itself (one bool
per block) and the launcher's making of the lists are not counted. Without the mask's
structure (uniform fraction s of the blocks kept, Nq, Nk multiples of the blocks), sum_i
kappa_i = s T_r Nk: the forward moves Theta(N d + s N^2 d / BLOCK_M) elements, Dao et al.
2022's Proposition 4, Theta(N d + s N^2 d^2 / M), for tiles that grow as M / d (here capped by
the block size).
Its tiles depend only on M and the shape; LongFlash's are an argument:
`Tiles(fwd, dkdv, dq)`, one (BLOCK_M, BLOCK_N) per kernel, because the Triton autotuner picks
each kernel's tile on its own.
"""

import math
from collections import Counter, namedtuple

import torch

Shape = namedtuple("Shape", "seqlen_q seqlen_k headdim causal nheads nheads_kv batch",
                   defaults=(False, 1, 1, 1))
Tiles = namedtuple("Tiles", "fwd dkdv dq")  # each (BLOCK_M, BLOCK_N)
# mask: bool (batch or 1, nheads or 1, ceil(Nq / block_size_q), ceil(Nk / block_size_k)), as
# longflash.attention's block_mask (whose blocks are multiples of 128; the model takes any)
BlockSparse = namedtuple("BlockSparse", "mask block_size_q block_size_k")

STATS = ("lse", "delta")  # float32 row statistics: 4 bytes whatever the input dtype
LISTS = ("lists", "lists_t")  # block_mask's int32 lists, per query block / per key block
PHASES = {  # the loops that run one after the other, each with its own fast-memory footprint
    ("longflash", "fwd"): ("fwd",),
    ("longflash", "bwd"): ("preprocess", "dkdv", "dq"),
    ("standard", "fwd"): ("S", "P", "O"),  # named by the matrix they write
    ("standard", "bwd"): ("dV", "dP", "dS", "dQ", "dK"),
}


def same_tiles(BLOCK_M, BLOCK_N):
    return Tiles(*[(BLOCK_M, BLOCK_N)] * 3)


def cdiv(a, b):
    return -(-a // b)


# -- which blocks the kernels visit ----------------------------------------------------------------
# Derived here in closed form (the paper's equations for kappa_i and rho_j) on purpose, not
# taken from `_common.key_range` / `query_range`: the simulator loops over those ranges, so
# "closed form == simulator" checks the paper's formulas against what the kernels do.

def key_spans(shape, BLOCK_M, BLOCK_N):
    """[(lo, hi)] per query block: the keys [lo, hi) its loop visits (forward and dQ kernel)."""
    seqlen_q, seqlen_k = shape.seqlen_q, shape.seqlen_k
    if not shape.causal:
        return [(0, seqlen_k)] * cdiv(seqlen_q, BLOCK_M)
    spans = []
    for start_m in range(0, seqlen_q, BLOCK_M):
        # keys seen by the block's last row (bottom-right causal), rounded up to whole key blocks
        seen = min(max(min(start_m + BLOCK_M, seqlen_q) + seqlen_k - seqlen_q, 0), seqlen_k)
        spans.append((0, min(cdiv(seen, BLOCK_N) * BLOCK_N, seqlen_k)))
    return spans


def query_spans(shape, BLOCK_M, BLOCK_N):
    """[(lo, hi)] per key block: the queries [lo, hi) its loop visits (dK/dV kernel)."""
    seqlen_q, seqlen_k = shape.seqlen_q, shape.seqlen_k
    if not shape.causal:
        return [(0, seqlen_q)] * cdiv(seqlen_k, BLOCK_N)
    spans = []
    for start_n in range(0, seqlen_k, BLOCK_N):
        first = max(start_n - (seqlen_k - seqlen_q), 0)  # the first query that sees key start_n
        spans.append((first // BLOCK_M * BLOCK_M, seqlen_q))  # from the start of its block on
    return spans


def keys_streamed(shape, BLOCK_M, BLOCK_N):
    """sum_i kappa_i: key rows streamed past all query blocks (forward and dQ kernel)."""
    return sum(hi - lo for lo, hi in key_spans(shape, BLOCK_M, BLOCK_N))


def queries_streamed(shape, BLOCK_M, BLOCK_N):
    """sum_j rho_j: query rows streamed past all key blocks (dK/dV kernel)."""
    return sum(hi - lo for lo, hi in query_spans(shape, BLOCK_M, BLOCK_N))


def sparse_streamed(bits, spans, TILE, block, length):
    """A block-sparse loop's traffic, summed over batch entries, heads and loops: (rows
    streamed, list entries read).

    bits: bool (batch, nheads, loops, blocks), each loop's row of the block mask (a query
    block's, or a key block's of the transposed mask); spans: [(lo, hi)] per loop, lo a
    multiple of TILE; TILE divides block; length: the streamed sequence's. A loop visits the
    tiles of [lo, hi) whose block is kept (rows past `length` move nothing), reads two running
    counts and one more for each end of the span inside a block, then one index per tile."""
    per = block // TILE
    start = torch.arange(0, length, TILE)                    # every streamed tile's first row
    lo, hi = (torch.tensor(x)[:, None] for x in zip(*spans))  # (loops, 1)
    kept = bits[..., start // block] & (start >= lo) & (start < hi)  # (B, H, loops, tiles)
    rows = (length - start).clamp(max=TILE)
    ends = (lo // TILE % per != 0).int() + (-(-hi // TILE) % per != 0).int()  # inside a block
    spans_read = bits.shape[0] * bits.shape[1] * int((2 + ends).sum())
    return int((kept * rows).sum()), spans_read + int(kept.sum())


def _loop_bits(sparse, shape, transposed, TILE):
    """Each loop's row of the mask, (batch, nheads, loops, blocks): a query block's (a key
    block's if transposed) of TILE rows."""
    mask = sparse.mask.expand(shape.batch, shape.nheads, *sparse.mask.shape[2:])
    if transposed:
        mask, block, length = mask.transpose(-1, -2), sparse.block_size_k, shape.seqlen_k
    else:
        block, length = sparse.block_size_q, shape.seqlen_q
    return mask[:, :, torch.arange(0, length, TILE) // block]


def sparse_tiles(tiles, block_size_q, block_size_k):
    """The largest tiles within `tiles` that divide the blocks, so a tile lies inside one."""
    def divisor(n, most):
        return max(t for t in range(1, min(n, most) + 1) if n % t == 0)
    return Tiles(*[(divisor(block_size_q, bm), divisor(block_size_k, bn)) for bm, bn in tiles])


def aligned_causal_streamed(N, BLOCK_M, BLOCK_N):
    """(sum kappa, sum rho) in closed form for causal Nq = Nk = N when BLOCK_N | BLOCK_M | N:
    query block i visits (i + 1) BLOCK_M keys; key block j is visited from query block
    floor(j BLOCK_N / BLOCK_M) on. The paper's displayed formulas."""
    assert N % BLOCK_M == 0 and BLOCK_M % BLOCK_N == 0
    return N * (N + BLOCK_M) // (2 * BLOCK_M), N * (N + BLOCK_M) // (2 * BLOCK_N)


# -- elements moved ------------------------------------------------------------------------------

def streamed(shape, tiles, kernel, sparse=None):
    """(rows streamed summed over all heads, list entries read) of a kernel's loops: keys
    past query blocks (kernel "fwd" or "dq"), queries past key blocks ("dkdv")."""
    BLOCK_M, BLOCK_N = getattr(tiles, kernel)
    transposed = kernel == "dkdv"
    spans = (query_spans if transposed else key_spans)(shape, BLOCK_M, BLOCK_N)
    if sparse is None:
        return shape.batch * shape.nheads * sum(hi - lo for lo, hi in spans), 0
    if transposed:  # key blocks of BLOCK_N stay, query tiles of BLOCK_M stream
        return sparse_streamed(_loop_bits(sparse, shape, True, BLOCK_N), spans, BLOCK_M,
                               sparse.block_size_q, shape.seqlen_q)
    return sparse_streamed(_loop_bits(sparse, shape, False, BLOCK_M), spans, BLOCK_N,
                           sparse.block_size_k, shape.seqlen_k)


def longflash_counts(shape, mode, tiles, sparse=None):
    """Counter {("read" | "write", tensor): elements} of LongFlash's kernels; sparse: a
    BlockSparse, or None (dense)."""
    s, d, c = shape, shape.headdim, Counter()
    heads, kv_heads = s.batch * s.nheads, s.batch * s.nheads_kv
    Nq, Nk = s.seqlen_q, s.seqlen_k
    if mode == "fwd":
        kappa, lists = streamed(s, tiles, "fwd", sparse)
        c["read", "q"] = heads * Nq * d
        c["read", "k"] = c["read", "v"] = kappa * d
        c["read", "lists"] = lists
        c["write", "o"] = heads * Nq * d
        c["write", "lse"] = heads * Nq
        return +c
    (rho, lists_t), (kappa, lists) = streamed(s, tiles, "dkdv", sparse), streamed(s, tiles, "dq",
                                                                                  sparse)
    # -- preprocess: delta = rowsum(dO * O) --
    c["read", "o"] = c["read", "do"] = heads * Nq * d
    c["write", "delta"] = heads * Nq
    # -- dK, dV: K_j, V_j stay; Q, dO, lse, delta of the visited query blocks stream --
    c["read", "k"] = c["read", "v"] = kv_heads * Nk * d
    c["write", "dk"] = c["write", "dv"] = kv_heads * Nk * d
    for t, width in (("q", d), ("do", d), ("lse", 1), ("delta", 1)):
        c["read", t] += rho * width
    c["read", "lists_t"] = lists_t
    # -- dQ: Q_i, dO_i, lse_i, delta_i stay; K, V of the visited key blocks stream --
    for t, width in (("q", d), ("do", d), ("lse", 1), ("delta", 1)):
        c["read", t] += heads * Nq * width
    c["read", "k"] += kappa * d
    c["read", "v"] += kappa * d
    c["read", "lists"] = lists
    c["write", "dq"] = heads * Nq * d
    return +c


def gemm_tiles(sram, m, n, k):
    """(bm, bn, bk) of an output-stationary product C (m x n) = A (m x k) B (k x n) in a fast
    memory of `sram` elements: the largest output tile that fits beside an inner chunk of 1
    (square unless C is narrower), then the longest inner chunk bk that fits beside it (any
    chunk moves the same elements; a longer one only means fewer steps)."""
    b = math.isqrt(sram + 1) - 1  # the largest b with b^2 + 2 b <= sram
    if n < b:
        bm, bn = min(m, (sram - n) // (n + 1)), n
    elif m < b:
        bm, bn = m, min(n, (sram - m) // (m + 1))
    else:
        bm = bn = b
    return bm, bn, min(k, (sram - bm * bn) // (bm + bn))


def row_tile(sram, matrices):
    """Side b of the square tiles of a row reduction over `matrices` Nq x Nk matrices, with
    three row vectors of b: the largest b with matrices b^2 + 3 b <= sram."""
    return (math.isqrt(9 + 4 * matrices * sram) - 3) // (2 * matrices)


def standard_tiles(shape, sram):
    """{phase: (bm, bn, bk)} for products, {phase: b} for row reductions."""
    Nq, Nk, d = shape.seqlen_q, shape.seqlen_k, shape.headdim
    group_q = shape.nheads // shape.nheads_kv * Nq
    return {"S": gemm_tiles(sram, Nq, Nk, d), "P": row_tile(sram, 1),
            "O": gemm_tiles(sram, Nq, d, Nk), "dV": gemm_tiles(sram, Nk, d, group_q),
            "dP": gemm_tiles(sram, Nq, Nk, d), "dS": row_tile(sram, 2),
            "dQ": gemm_tiles(sram, Nq, d, Nk), "dK": gemm_tiles(sram, Nk, d, group_q)}


def standard_counts(shape, mode, sram):
    """Counter {("read" | "write", tensor): elements} of standard attention (module docstring)."""
    s, d, c = shape, shape.headdim, Counter()
    heads, kv_heads = s.batch * s.nheads, s.batch * s.nheads_kv
    Nq, Nk, group_q = s.seqlen_q, s.seqlen_k, s.nheads // s.nheads_kv * s.seqlen_q
    tiles = standard_tiles(shape, sram)

    def product(phase, a, b, out, m, n, k, outputs):
        bm, bn, _ = tiles[phase]
        c["read", a] += outputs * m * k * cdiv(n, bn)
        c["read", b] += outputs * k * n * cdiv(m, bm)
        c["write", out] += outputs * m * n

    matrix = heads * Nq * Nk  # one Nq x Nk matrix per query head
    if mode == "fwd":
        product("S", "q", "k", "s", Nq, Nk, d, heads)
        c["read", "s"] += 2 * matrix
        c["write", "p"] += matrix
        product("O", "p", "v", "o", Nq, d, Nk, heads)
        return c
    product("dV", "p", "do", "dv", Nk, d, group_q, kv_heads)
    product("dP", "do", "v", "dp", Nq, Nk, d, heads)
    c["read", "p"] += 2 * matrix
    c["read", "dp"] += 2 * matrix
    c["write", "ds"] += matrix
    product("dQ", "ds", "k", "dq", Nq, d, Nk, heads)
    product("dK", "ds", "q", "dk", Nk, d, group_q, kv_heads)
    return c


def counts(provider, shape, mode, tiles, sram, sparse=None):
    """LongFlash runs with `tiles`; standard attention picks its own for `sram` and moves the
    same elements with a block mask as without one."""
    if provider == "longflash":
        return longflash_counts(shape, mode, tiles, sparse)
    return standard_counts(shape, mode, sram)


def hbm_bytes(moved, element_size=2):
    """Bytes moved both ways: element_size per element of the input dtype, 4 for lse, delta
    and the block lists' int32 entries."""
    return sum(n * (4 if name in STATS + LISTS else element_size)
               for (_, name), n in moved.items())


def totals(moved):
    return (sum(n for (way, _), n in moved.items() if way == "read"),
            sum(n for (way, _), n in moved.items() if way == "write"))


# -- fast memory ---------------------------------------------------------------------------------

def footprint(phase, headdim, BLOCK_M, BLOCK_N):
    """Elements resident at once in a LongFlash kernel: nominal tiles, even at a sequence end."""
    d, bm, bn = headdim, BLOCK_M, BLOCK_N
    return {  # the resident tiles, in the order of the comments
        "fwd": bm * (2 * d + 3) + 2 * bn * d + bm * bn,       # q acc m_i l_i m_ij | k v | s
        "preprocess": bm * (2 * d + 1),                         # o do delta
        "dkdv": 4 * bn * d + bm * (2 * d + 2) + 2 * bm * bn,    # k v dk dv | q do lse delta | p ds
        "dq": bm * (3 * d + 2) + 2 * bn * d + 2 * bm * bn,      # q do dq lse delta | k v | p ds
    }[phase]


def standard_footprint(phase, tile):
    if phase == "P":
        return tile * tile + 3 * tile      # s m_i l_i m_ij
    if phase == "dS":
        return 2 * tile * tile + tile      # p dp rowsum
    bm, bn, bk = tile
    return bm * bn + bk * (bm + bn)        # c | a b


def fast_mem_peak(provider, shape, mode, tiles, sram):
    if provider == "standard":
        std = standard_tiles(shape, sram)
        return max(standard_footprint(p, std[p]) for p in PHASES[provider, mode])
    return max(footprint(p, shape.headdim, *getattr(tiles, "dq" if p == "preprocess" else p))
               for p in PHASES[provider, mode])


def block_sizes(sram, headdim, rule="fit"):
    """Tiles for a fast memory of `sram` elements; a kernel gets None if not even 1 x 1 fits.

    rule "fit": the stationary block (query rows for the forward and dQ kernels, key rows for
        the dK/dV kernel) gets as many rows as fit in `sram`; the streamed block gets
        min(that, headdim) rows, as in Dao et al.'s B_r = min(B_c, d). Never exceeds `sram`.
    rule "flash": Dao et al. 2022's literal choice B_c = ceil(M / 4d), B_r = min(B_c, d) with
        B_r = BLOCK_M, B_c = BLOCK_N in every kernel. It was made for FlashAttention-1, whose
        loop keeps K_j, V_j stationary; it may exceed `sram` (see fast_mem_peak).
    """
    if rule == "flash":
        B_c = cdiv(sram, 4 * headdim)
        return same_tiles(min(B_c, headdim), B_c)

    def largest(phase, key_stationary):
        def tile(b):
            return (min(b, headdim), b) if key_stationary else (b, min(b, headdim))
        lo, hi = 0, sram // headdim + 1  # footprint > b * headdim, so b < sram / headdim
        while hi - lo > 1:  # footprint grows with b: bisect for the largest b that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if footprint(phase, headdim, *tile(mid)) <= sram else (lo, mid)
        return tile(lo) if lo else None

    return Tiles(largest("fwd", False), largest("dkdv", True), largest("dq", False))


def runnable(tiles, mode):
    return tiles.fwd is not None if mode == "fwd" else None not in (tiles.dkdv, tiles.dq)


def log_slope(xs, ys):
    """Least-squares slope of log y against log x: the fitted exponent."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return (sum((a - mx) * (b - my) for a, b in zip(lx, ly))
            / sum((a - mx) ** 2 for a in lx))
