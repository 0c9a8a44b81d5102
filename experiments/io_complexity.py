"""RQ2: does LongFlash's HBM traffic follow Theta(N^2 d^2 / M), and by how much does it beat
standard attention's Theta(N d + N^2)?

    PYTHONPATH=kernels:. python3 -m experiments.io_complexity          # CPU, about a minute
    PYTHONPATH=kernels:. python3 -m experiments.io_complexity --full   # more simulator checks
    ... --ncu-plan results/io_complexity/ncu_plan.csv   # configurations for a GPU run (below)
    ... --ncu-target '{"provider": "longflash", ...}'   # run one of them once, for ncu to profile

Everything here is counted, not measured: elements moved between slow memory (HBM) and a fast
memory of M elements in the two-level memory model, by the closed form of `io_model.py`. On
small sizes `io_sim.py` also executes the algorithms with an explicit fast memory of M
elements; the script stops if its counts differ from the closed form by a single element, if
its fast memory would exceed M, or if its output disagrees with `attention_ref` in float64.
Hardware traffic (Nsight Compute DRAM bytes) is not measured yet: no GPU was available. The
`--ncu-plan` option writes the configurations and ncu command lines for that later run, each
with the model's prediction beside it; `--ncu-target` is the command they wrap.

Sweeps (a dataclass of defaults, below): N from 256 to 64K at d = 64, M = 2^16; d from 16 to
256 at N = 16K, M = 2^16; M from d to N d at N = 16K, d = 64 for two tile rules (io_model.
block_sizes: "fit", the largest tiles that fit in M, stationary block Theta(M / d); "flash",
Dao et al.'s B_c = ceil(M / 4d), B_r = min(B_c, d), which may not fit); the crossover M at
which LongFlash moves no more bytes than standard attention, for each d; and the simulator
on small shapes (odd lengths, seqlen_q != seqlen_k, GQA, causal or not).

Block-sparse attention (experiment io_complexity_sparse, rows of their own beside the dense
ones): at N = 16K, d = 64, M = 2^16, a random mask of 128 x 128 blocks shared by the heads (a
nested series: each density's kept blocks include the next smaller's), densities 1 to 1/64,
causal or not; LongFlash's tiles are the "fit" ones cut to divide the blocks
(io_model.sparse_tiles), beside a dense row at the same tiles (block_mask "none") and the
simulator on small odd shapes with masks per head. Dao et al. 2022's Proposition 4:
Theta(N d + s N^2 d^2 / M) for a fraction s of the blocks kept.

Rows (results/io_complexity/cpu.csv, schema of experiments/results.py), provider longflash or
standard, mode fwd or bwd (bwd: the backward pass alone; the forward's outputs are in HBM),
dtype float16 (2 bytes per element; lse and delta are float32), status ok, or unsupported
where not even a 1 x 1 tile fits in M. Metrics:
    hbm_elements_read        elements read from HBM into fast memory             (elements)
    hbm_elements_written     elements written from fast memory to HBM            (elements)
    hbm_bytes                bytes moved both ways, at the dtype's size           (bytes)
    fast_mem_peak            most elements resident in fast memory at once        (elements)
    sim_max_abs_err          max |simulator - attention_ref float64| over o and lse (fwd) or
                             dq, dk, dv (bwd); only on rows with simulated = True (abs)
    crossover_sram_elements  smallest M ("fit" tiles) at which LongFlash moves no more bytes
                             than standard attention (elements)
`memory_model` names the modelled machine ("two-level memory, M=..., tiles ..."): a count
depends on M and the tiles, so it is a key column of these rows; `device` is the computer
that evaluated the counts. Extra columns:
sram_elements (M), block_rule ("fit", "flash" or "fixed" for LongFlash; "output-stationary"
for standard attention, whose products pick their own tiles from M), BLOCK_M and BLOCK_N
(forward tiles; backward: the dK/dV kernel's), dq_BLOCK_M, dq_BLOCK_N (the dQ kernel's),
simulated, measured_on_gpu (False); block-sparse rows also block_mask (which mask: a key
column, "none" for the dense row at the same tiles), block_size, block_density (the fraction of
the mask's blocks kept, over its heads).
"""

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import shlex
from dataclasses import asdict, dataclass, replace
from itertools import product

import torch
import torch.nn.functional as F

import longflash
from experiments import io_model as io
from experiments.io_model import BlockSparse, Shape, Tiles, block_sizes, runnable
from experiments.io_sim import simulate
from experiments.results import default_out, this_command, write_results

PROVIDERS, MODES = ("longflash", "standard"), ("fwd", "bwd")
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum"


@dataclass
class Config:
    seqlens: tuple = tuple(2**k for k in range(8, 17))  # N sweep: 256 .. 64K
    headdims: tuple = (16, 32, 64, 128, 256)            # d sweep and crossover
    seqlen: int = 16384          # N of the d and M sweeps and of the crossover
    headdim: int = 64            # d of the N and M sweeps
    sram: int = 2**16            # M of the N and d sweeps, elements (128 KiB of float16)
    dtype: str = "float16"       # sets hbm_bytes' bytes per element
    sim_sweeps: tuple = ((128, 16),)  # simulator: (N, d), M from d to N d ("fit" tiles)
    # simulator on odd shapes: (seqlen_q, seqlen_k, headdim, nheads, nheads_kv, BLOCK_M, BLOCK_N)
    sim_shapes: tuple = ((97, 160, 24, 4, 2, 32, 16), (160, 97, 24, 4, 2, 16, 32),
                         (113, 113, 40, 2, 1, 16, 16))
    # block sparsity at N = seqlen, d = headdim, M = sram: fractions of the blocks kept
    densities: tuple = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625)
    block_size: int = 128        # the mask's blocks (longflash's unit, RQ1 part sparse's)
    # ... and the simulator with a mask per head, half its blocks kept: (seqlen_q, seqlen_k,
    # headdim, nheads, nheads_kv, BLOCK_M, BLOCK_N)
    sparse_sim_shapes: tuple = ((300, 450, 16, 2, 1, 32, 64), (257, 200, 24, 4, 2, 64, 32))
    out: str = ""  # default results/io_complexity/<device>.csv (experiments.results.default_out)


FULL = dict(sim_sweeps=Config.sim_sweeps + ((256, 32),),
            sim_shapes=Config.sim_shapes + ((203, 97, 59, 8, 2, 64, 32), (1, 17, 16, 2, 2, 16, 16),
                                            (256, 512, 64, 4, 4, 64, 64)),
            sparse_sim_shapes=Config.sparse_sim_shapes + ((640, 513, 32, 2, 2, 128, 64),))


# -- rows ----------------------------------------------------------------------------------------

def describe(provider, sram, tiles, mode):
    if provider == "standard":  # its products pick their own tiles from M (io_model.gemm_tiles)
        return f"two-level memory, M={sram}"
    if tiles is None or not runnable(tiles, mode):
        return f"two-level memory, M={sram}, no tile fits"
    if mode == "fwd":
        return f"two-level memory, M={sram}, tiles {tiles.fwd[0]}x{tiles.fwd[1]}"
    return (f"two-level memory, M={sram}, dK/dV tiles {tiles.dkdv[0]}x{tiles.dkdv[1]}, "
            f"dQ tiles {tiles.dq[0]}x{tiles.dq[1]}")


def base_row(cfg, provider, shape, mode, device, experiment="io_complexity", **extra):
    return dict(experiment=experiment, provider=provider, mode=mode, dtype=cfg.dtype,
                batch=shape.batch, seqlen_q=shape.seqlen_q, seqlen_k=shape.seqlen_k,
                nheads=shape.nheads, nheads_kv=shape.nheads_kv, headdim=shape.headdim,
                causal=shape.causal, p20=math.nan, p80=math.nan, memory_model=device,
                measured_on_gpu=False, **extra)


def count_rows(cfg, provider, shape, mode, tiles, sram, rule, sim_err=None, sparse=None,
               **columns):
    """One row per metric for one configuration; `unsupported` rows where no tile fits.
    sparse: an io_model.BlockSparse; columns: more columns (experiment, block_mask, ...)."""
    lf = provider == "longflash"
    ok = not lf or runnable(tiles, mode)
    tile = (tiles.fwd if mode == "fwd" else tiles.dkdv) if lf and ok else (None, None)
    dq = tiles.dq if lf and ok and mode == "bwd" else (None, None)
    extra = dict(sram_elements=sram, block_rule=rule if lf else "output-stationary",
                 BLOCK_M=tile[0], BLOCK_N=tile[1], dq_BLOCK_M=dq[0], dq_BLOCK_N=dq[1],
                 simulated=sim_err is not None, **columns)
    base = base_row(cfg, provider, shape, mode, describe(provider, sram, tiles, mode), **extra)
    metrics = ["hbm_elements_read", "hbm_elements_written", "hbm_bytes", "fast_mem_peak"]
    if not ok:
        return [dict(base, metric=m, value=math.nan, unit="", status="unsupported")
                for m in metrics]
    moved = io.counts(provider, shape, mode, tiles, sram, sparse)
    reads, writes = io.totals(moved)
    values = [(reads, "elements"), (writes, "elements"),
              (io.hbm_bytes(moved, ELEMENT_SIZE[cfg.dtype]), "bytes"),
              (io.fast_mem_peak(provider, shape, mode, tiles, sram), "elements")]
    if sim_err is not None:
        metrics.append("sim_max_abs_err")
        values.append((sim_err, "abs"))
    return [dict(base, metric=m, value=v, unit=u, status="ok")
            for m, (v, u) in zip(metrics, values)]


# -- the simulator check -------------------------------------------------------------------------

def max_err(a, b):
    """max |a - b|; equal infinities (the lse of a row that sees no key) count as 0, NaN
    (an element never written) propagates."""
    diff = torch.where(a == b, 0.0, (a - b).abs())
    return diff.max().item() if diff.numel() else 0.0


def verify(provider, shape, tiles, sram, seed=0, sparse=None):
    """Run the simulator with fast memory `sram` (and block mask `sparse`); assert it matches
    the closed form exactly. Returns {mode: max abs error against attention_ref in float64}."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda n, h: torch.randn(shape.batch, n, h, shape.headdim, generator=g,  # noqa: E731
                                     dtype=torch.float64)
    q, do = randn(shape.seqlen_q, shape.nheads), randn(shape.seqlen_q, shape.nheads)
    k, v = randn(shape.seqlen_k, shape.nheads_kv), randn(shape.seqlen_k, shape.nheads_kv)
    fwd, bwd, out = simulate(provider, shape, tiles, q, k, v, do, sram, sparse=sparse)
    for mode, machine in (("fwd", fwd), ("bwd", bwd)):
        expected = io.counts(provider, shape, mode, tiles, sram, sparse)
        assert +machine.moved == +expected, (provider, shape, tiles, mode, machine.moved, expected)
        assert machine.peak == io.fast_mem_peak(provider, shape, mode, tiles, sram)

    q, k, v = (x.requires_grad_() for x in (q, k, v))
    blocks = {} if sparse is None else dict(block_mask=sparse.mask, block_size=(
        sparse.block_size_q, sparse.block_size_k))
    o, lse = longflash.attention_ref(q, k, v, causal=shape.causal, **blocks)
    o.backward(do)
    errs = {"fwd": max_err(out["o"], o), "bwd": max(max_err(out[t], x.grad)
                                                  for t, x in (("dq", q), ("dk", k), ("dv", v)))}
    if provider == "longflash":
        errs["fwd"] = max(errs["fwd"], max_err(out["lse"], lse))
    assert all(e < 1e-9 for e in errs.values()), (provider, shape, errs)
    return errs


def simulated_rows(cfg, log):
    rows, n = [], 0
    configs = []
    for (N, d), causal in product(cfg.sim_sweeps, (False, True)):
        for sram in (2**k for k in range(int(math.log2(d)), int(math.log2(N * d)) + 1)):
            configs.append((Shape(N, N, d, causal), block_sizes(sram, d), sram, "fit"))
    for Nq, Nk, d, h, hkv, bm, bn in cfg.sim_shapes:
        for causal in (False, True):
            shape = Shape(Nq, Nk, d, causal, h, hkv)
            tiles = io.same_tiles(bm, bn)
            sram = max(io.fast_mem_peak("longflash", shape, m, tiles, None) for m in ("fwd", "bwd"))
            configs.append((shape, tiles, sram, "fixed"))
    for shape, tiles, sram, rule in configs:
        for provider in PROVIDERS:
            errs = {}
            if runnable(tiles, "fwd") and runnable(tiles, "bwd"):
                errs = verify(provider, shape, tiles, sram)
                n += 1
            for mode in MODES:
                rows += count_rows(cfg, provider, shape, mode, tiles, sram, rule, errs.get(mode))
    log(f"simulator: {n} runs (configuration x provider, forward and backward): counts equal to "
        f"the closed form, fast memory within M, outputs within 1e-9 of attention_ref")
    return rows


def nested_masks(blocks, densities, seed=0):
    """{density: (1, 1, blocks, blocks) bool}: round(density blocks^2) random blocks kept,
    each density's set inside the next larger's (one random order)."""
    order = torch.randperm(blocks * blocks, generator=torch.Generator().manual_seed(seed))
    masks = {}
    for s in densities:
        bits = torch.zeros(blocks * blocks, dtype=torch.bool)
        bits[order[:round(s * blocks * blocks)]] = True
        masks[s] = bits.view(1, 1, blocks, blocks)
    return masks


def sparse_columns(sparse, name):
    return dict(experiment="io_complexity_sparse", block_mask=name,
                block_size=sparse.block_size_q if sparse else None,
                block_density=1.0 if sparse is None else sparse.mask.float().mean().item())


def sparse_rows(cfg, log):
    """The density sweep (LongFlash; "none": the dense kernels at the same tiles), and the
    simulator with masks per head (both providers)."""
    rows, bs = [], cfg.block_size
    shape = Shape(cfg.seqlen, cfg.seqlen, cfg.headdim)
    tiles = io.sparse_tiles(block_sizes(cfg.sram, cfg.headdim), bs, bs)
    blocks = -(-cfg.seqlen // bs)
    masks = {f"random {round(s * blocks**2)}/{blocks**2} of {bs}x{bs} blocks, shared by the "
             f"heads, seed 0": BlockSparse(m, bs, bs)
             for s, m in nested_masks(blocks, cfg.densities).items()}
    for causal, mode in product((False, True), MODES):
        for name, sparse in [("none", None), *masks.items()]:
            rows += count_rows(cfg, "longflash", shape._replace(causal=causal), mode, tiles,
                               cfg.sram, "fit", sparse=sparse, **sparse_columns(sparse, name))
    n = 0
    for (Nq, Nk, d, h, hkv, bm, bn), causal in product(cfg.sparse_sim_shapes, (False, True)):
        shape, tiles = Shape(Nq, Nk, d, causal, h, hkv), io.same_tiles(bm, bn)
        g = torch.Generator().manual_seed(Nq)
        sparse = BlockSparse(torch.rand(1, h, -(-Nq // bs), -(-Nk // bs), generator=g) < 0.5,
                             bs, bs)
        name = f"random half of {bs}x{bs} blocks per head, seed {Nq}"
        sram = max(io.fast_mem_peak("longflash", shape, m, tiles, None) for m in MODES)
        for provider in PROVIDERS:
            errs = verify(provider, shape, tiles, sram, sparse=sparse)
            n += 1
            for mode in MODES:
                rows += count_rows(cfg, provider, shape, mode, tiles, sram, "fixed",
                                   errs[mode], sparse, **sparse_columns(sparse, name))
    log(f"simulator, block-sparse: {n} runs: counts equal to the closed form, outputs within "
        f"1e-9 of attention_ref with the block mask")
    return rows


# -- the sweeps ----------------------------------------------------------------------------------

def sweep_rows(cfg):
    rows = []
    points = [(Shape(N, N, cfg.headdim), cfg.sram, "fit") for N in cfg.seqlens]
    points += [(Shape(cfg.seqlen, cfg.seqlen, d), cfg.sram, "fit") for d in cfg.headdims]
    points += [(Shape(cfg.seqlen, cfg.seqlen, cfg.headdim), 2**k, rule)
               for rule in ("fit", "flash")
               for k in range(int(math.log2(cfg.headdim)),
                              int(math.log2(cfg.seqlen * cfg.headdim)) + 1)]
    for shape, sram, rule in points:
        tiles = block_sizes(sram, shape.headdim, rule)
        for causal, provider, mode in product((False, True), PROVIDERS, MODES):
            rows += count_rows(cfg, provider, shape._replace(causal=causal), mode, tiles, sram,
                               rule)
    return rows


def crossover(shape, mode, element_size):
    """Smallest M ("fit" tiles) at which LongFlash moves no more bytes than standard attention."""
    def wins(sram):
        tiles = block_sizes(sram, shape.headdim)
        if not runnable(tiles, mode):
            return False
        lf, std = (io.hbm_bytes(io.counts(p, shape, mode, tiles, sram), element_size)
                   for p in ("longflash", "standard"))
        return lf <= std
    lo = hi = 4 * shape.headdim  # below the smallest tile
    while not wins(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # bisect between a losing and a winning M
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi


def crossover_rows(cfg, log):
    rows = []
    for d, causal, mode in product(cfg.headdims, (False, True), MODES):
        shape = Shape(cfg.seqlen, cfg.seqlen, d, causal)
        m_star = crossover(shape, mode, ELEMENT_SIZE[cfg.dtype])
        log(f"crossover N={cfg.seqlen} d={d:3d} causal={causal!s:5} {mode}: M* = {m_star:7d} "
            f"= {m_star / d**2:.2f} d^2")
        rows.append(dict(base_row(cfg, "longflash", shape, mode,
                                  "two-level memory, M variable, fit tiles",
                                  sram_elements=None, block_rule="fit", simulated=False),
                         metric="crossover_sram_elements", value=m_star, unit="elements",
                         status="ok"))
    return rows


def summarize(cfg, rows, log):
    """The fitted log-log exponents, printed (the notebook fits them again from the CSV)."""
    def series(key, xs, provider, mode, **fixed):
        pts = [(r[key], r["value"]) for r in rows if r["metric"] == "hbm_bytes"
               and r["experiment"] == "io_complexity" and r["status"] == "ok" and r["provider"] == provider and r["mode"] == mode
               and r[key] in xs and all(r[k] == v for k, v in fixed.items())]
        return io.log_slope(*zip(*sorted(pts)))
    for provider, mode in product(PROVIDERS, MODES):
        rule = "fit" if provider == "longflash" else "output-stationary"
        ref = dict(causal=False, block_rule=rule)
        n = series("seqlen_q", cfg.seqlens, provider, mode, headdim=cfg.headdim,
                   sram_elements=cfg.sram, **ref)
        d = series("headdim", cfg.headdims, provider, mode, seqlen_q=cfg.seqlen,
                   sram_elements=cfg.sram, **ref)
        m = series("sram_elements", range(cfg.headdim**2, cfg.seqlen * cfg.headdim + 1),
                   provider, mode, seqlen_q=cfg.seqlen, headdim=cfg.headdim, **ref)
        log(f"exponents {provider:9} {mode}: N {n:.3f}  d {d:.3f}  M (d^2..Nd) {m:.3f}")
    for causal, mode in product((False, True), MODES):  # block sparsity: bytes against density
        pts = {r["block_mask"]: (r["block_density"], r["value"]) for r in rows
               if r["experiment"] == "io_complexity_sparse" and not r["simulated"]
               and r["metric"] == "hbm_bytes" and r["mode"] == mode and r["causal"] == causal}
        dense = pts.pop("none")[1]
        log(f"block-sparse longflash {mode} causal={causal!s:5}: bytes / dense at the same "
            f"tiles: " + ", ".join(f"{s:g} -> {b / dense:.3f}" for s, b in sorted(pts.values())))


# -- Nsight Compute plan (for a GPU session) -----------------------------------------------------

def ncu_plan(seqlens=tuple(2**k for k in range(10, 19)), headdims=(64, 128),
             providers=("longflash", "sdpa_flash", "standard"), batch=1, nheads=16,
             dtype="bfloat16", tiles=Tiles((128, 64), (64, 128), (128, 64)), sram=2**16):
    """One entry per configuration to profile with Nsight Compute, with the ncu command line and
    the model's HBM bytes: LongFlash and SDPA's FlashAttention-2 (the same loop order) for
    `tiles`, a guess (read the autotuned BLOCK_M from ncu's grid size, cdiv(seqlen_q, BLOCK_M)
    x batch*nheads, and recount with io_model), standard attention for M = `sram`."""
    plan = []
    for provider, mode, N, d, causal in product(providers, MODES, seqlens, headdims, (False, True)):
        spec = dict(provider=provider, mode=mode, batch=batch, seqlen=N, nheads=nheads,
                    headdim=d, causal=causal, dtype=dtype)
        shape = Shape(N, N, d, causal, nheads, nheads, batch)
        model = "longflash" if provider == "sdpa_flash" else provider  # same loop order (FA2)
        predicted = io.hbm_bytes(io.counts(model, shape, mode, tiles, sram), ELEMENT_SIZE[dtype])
        command = (f"PYTHONPATH=kernels:. ncu --clock-control none --nvtx --nvtx-include "
                   f"io_target/ --metrics {NCU_METRICS} --print-units base --csv python3 -m "
                   f"experiments.io_complexity "
                   f"--ncu-target {shlex.quote(json.dumps(spec))}")
        plan.append(dict(spec, model_hbm_bytes=predicted, model_tiles=str(tuple(tiles)),
                         command=command))
    return plan


def run_target(spec):
    """Run one configuration once, inside the NVTX range "io_target" that ncu profiles,
    after an unprofiled warm-up (which also autotunes)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = (spec["batch"], spec["seqlen"], spec["nheads"], spec["headdim"])
    bwd = spec["mode"] == "bwd"
    q, k, v, do = (torch.randn(shape, device=device, dtype=getattr(torch, spec["dtype"]))
                   for _ in range(4))
    q, k, v = (x.requires_grad_(bwd) for x in (q, k, v))

    def forward():
        if spec["provider"] == "longflash":
            return longflash.attention(q, k, v, causal=spec["causal"])
        if spec["provider"] == "standard":
            return longflash.attention_ref(q, k, v, causal=spec["causal"], upcast=False)[0]
        from torch.nn.attention import SDPBackend, sdpa_kernel
        # seqlen_q == seqlen_k, so SDPA's top-left causal alignment agrees with ours
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                                  is_causal=spec["causal"]).transpose(1, 2)

    @contextlib.contextmanager
    def nvtx_range(active):
        active = active and device == "cuda"
        if active:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("io_target")
        yield
        if active:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()

    for profile in (False, True):  # a warm-up (which also autotunes), then the profiled run
        if bwd:
            o = forward()
            with nvtx_range(profile):
                torch.autograd.grad(o, (q, k, v), do)
        else:
            with nvtx_range(profile):
                forward()


# -- main ----------------------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="more and larger simulator checks")
    parser.add_argument("--out", default="", help="results CSV (default results/io_complexity/<device>.csv)")
    parser.add_argument("--ncu-plan", metavar="CSV",
                        help="write the Nsight Compute plan for a GPU run to CSV and exit")
    parser.add_argument("--ncu-target", metavar="JSON",
                        help="run one configuration of the plan once (what ncu wraps) and exit")
    args = parser.parse_args(argv)
    if args.ncu_target:
        run_target(json.loads(args.ncu_target))
        return
    if args.ncu_plan:
        plan = ncu_plan()
        os.makedirs(os.path.dirname(os.path.abspath(args.ncu_plan)), exist_ok=True)
        with open(args.ncu_plan, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(plan[0]))
            writer.writeheader()
            writer.writerows(plan)
        print(f"{len(plan)} configurations -> {args.ncu_plan}")
        return

    cfg = replace(Config(), out=args.out or default_out("io_complexity"), **(FULL if args.full else {}))
    torch.set_num_threads(1)  # the simulator's tiles are tiny: threads only add overhead
    lines = [f"config: {json.dumps(asdict(cfg))}"]

    def log(line):
        print(line, flush=True)
        lines.append(line)

    rows = (sweep_rows(cfg) + crossover_rows(cfg, log) + simulated_rows(cfg, log)
            + sparse_rows(cfg, log))
    # A configuration can fall in two sweeps: keep one row per key (the simulated one if any).
    by_key = {}
    for r in sorted(rows, key=lambda r: r.get("simulated", False)):
        by_key[r["experiment"], r["provider"], r["mode"], r["batch"], r["seqlen_q"],
               r["seqlen_k"], r["nheads"], r["nheads_kv"], r["headdim"], r["causal"],
               r["metric"], r["memory_model"], r.get("block_mask")] = r
    rows = list(by_key.values())
    summarize(cfg, rows, log)
    write_results(rows, cfg.out, key_columns=("memory_model", "block_mask"))
    log(f"{len(rows)} rows -> {cfg.out}")
    # Appended, as the other experiments' logs (experiments.results.start_run): a rerun, or
    # the GPU campaign's ncu rows beside these, never erase an earlier run's log.
    with open(os.path.splitext(cfg.out)[0] + ".log", "a") as f:
        f.write(f"== {datetime.datetime.now().isoformat(timespec='seconds')} "
                f"{this_command()}\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
