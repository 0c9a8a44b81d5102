"""Tuning sweep: each kernel's candidate tiles timed at the shapes where LongFlash fell short,
and each such call split into host and GPU time.

    python -m experiments.tuning --full --budget-s 400   # GPU: results/tuning/<gpu>.csv
    python -m experiments.tuning --quick                 # CPU, Triton interpreter, tiny (CI)

Issue 16's tuning step, written before the window so that its minutes go to measuring. On the
first H100 window (RQ1, results/speedup/h100.csv) LongFlash was slowest against SDPA's
FlashAttention-2 in the d256 backward (0.45x), in short causal forwards (d128 at 2K: 0.714 ms,
no faster than non-causal's 0.682 ms) and in the d64 forward at 1K (0.681 ms, as long as at
2K). Two questions per such shape, one answer each:

1. Is the time the GPU's or the host's? Kernel "call", config "auto" (the autotuner's
   choice), the call as RQ1 times it:
     time_ms        do_bench (experiments.measure.time_ms), as RQ1
     time_ms_graph  the same call as CUDA-graph replays (measure.time_ms_graph): GPU work only
     host_ms        wall time per call of 50 calls issued without a synchronization: the host's
                    Python, checks and launches (the GPU runs behind)
     kernel_ms      per kernel (kernel "fwd", "preprocess", "dkdv", "dq"; config "auto"): its
                    GPU time per call from torch.profiler
   time_ms well above time_ms_graph means RQ1 timed the host there, not the kernels; the
   log then has the host's cProfile of the call (where host_ms goes). Config "auto-again"
   (CALL_AGAIN): time_ms of the same call after the target's lead candidates, to tell a
   forced tile's time from what the sweep changed meanwhile. One target is a decoding
   step (RQ1's part decode: per call 0.13-0.29 ms, as graph replays 0.01-0.07 ms on the H100).
2. Does another tile do better? Kernel "fwd", "dkdv" or "dq", config "BLOCK_M/BLOCK_N/warps/
   stages[/tma[/ws]]" (codegen.config_name): each candidate of flash_triton.CONFIGS for this
   GPU and head dim, then TRIALS (tiles the launcher cannot choose yet), forced for that kernel
   alone (the others autotuned), first checked on a small shape against float64
     max_rel_err    ||x - ref|| / ||ref|| over o (fwd) or dq, dk, dv (dkdv, dq)
                    (measure.relative_errors); not below RELATIVE_ERROR_LIMIT, as in the
                    campaign's preflight, the candidate is wrong: status "error", no time
   then timed at the target:
     time_ms        the forward call (fwd), or the backward (dkdv, dq: autograd.grad on one
                    forward's graph, RQ1's mode bwd), median with p20/p80
   Warp-specialized candidates (NaN on the H100, PERFLOG) only with --ws, last, checked on
   lengths with no mask where the target needs none (check_seqlens_for).

Rows: results schema (experiments/results.py), experiment "tuning", provider "longflash", mode
"fwd" or "bwd", key columns `kernel` and `config`. Every target's calls run first, in order
(TARGETS), then every target's lead candidates (the autotuner's choice and the first
LEAD_TRIALS trials of each kernel), then every target's other candidates; rows are written
after each call and each kernel's candidates. After --budget-s nothing more is started (the
first target's calls excepted) and the log names what was not run; --resume skips what the file
already holds with status ok, so a rerun measures the rest (a GPU window of 15 minutes is two
runs: experiments/GPU.md).
"""

import argparse
import os
import time
from dataclasses import asdict, dataclass

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --quick: the kernels on the CPU

import longflash  # noqa: E402
from longflash import flash_triton as ft  # noqa: E402
from longflash.flash_triton import ATOMIC, PIPE, SPLIT, TMA, WS  # noqa: E402
from experiments import decode  # noqa: E402
from experiments.codegen import config_name  # noqa: E402
from experiments.measure import RELATIVE_ERROR_LIMIT, relative_errors  # noqa: E402
from experiments.measure import time_ms, time_ms_graph  # noqa: E402
from experiments.host_time import host_profile, host_us  # noqa: E402
from experiments.results import (Log, check_resume_after, default_out,  # noqa: E402
                                 measured_before, same_switches, start_run, write_results)

KEY_COLUMNS = ("kernel", "config")  # beside experiments.results.KEY_COLUMNS
KERNELS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}  # their jit names
HOST_CALLS = 50
CALL_AGAIN = "auto-again"  # the call timed again after its lead candidates (kernel "call")
PROFILED = {"_attn_fwd": "fwd", "_attn_bwd_preprocess": "preprocess", "_attn_bwd_dkdv": "dkdv",
            "_attn_bwd_dq": "dq", "_fwd_splitkv": "decode", "_merge_splits": "decode_merge"}

# sm_90 tiles beside CONFIGS', chosen from ptxas reports (sm_90a, bf16, Triton 3.6.0; spill
# bytes, PERFLOG "Tuning sweep"): the TMA versions of tiles that won or came close on the
# H100, which spill less than their pointer versions, larger tiles that compile with few
# spills, and a forward tile small enough for two programs per SM (64 x 64, 4 warps: for short
# causal calls, where one program's prologue and epilogue would overlap another's loop).
# dK/dV in two passes (SPLIT: one program per key block accumulating dV, one dK; 5 dots per
# query block instead of 4) at tiles that spill as one pass: Triton 3.6.0, spill bytes split /
# fused, d256 (32, 64, 8, 3) 0 / 64, (64, 64, 8, 2) 92 / 208; d128 (64, 128, 8, 2) 44 / 216,
# (64, 64, 8, 3) 4 / 44 (PERFLOG). dK/dV adding dQ by atomics (ATOMIC: no dQ kernel, 5 dots
# per block pair instead of 4 + 3; first, the largest predicted gain) at the tiles whose every
# dot is a wgmma (64 queries) with the fewest spills, with 128 keys (FlashAttention-2's tile:
# half the atomic traffic per FLOP of 64 keys) or 64, at d256 in dK's pass of SPLIT: Triton
# 3.6.0, spill bytes, d128 split (64, 128, 8, 2) 100, split (64, 64, 8, 3) 0, (64, 64, 8, 3)
# 52; d256 split (16, 64, 8, 2) 36, (32, 64, 8, 2) 104 (PERFLOG). The forward software-
# pipelined by one key block (PIPE: the next block's q.k wgmma in flight during this block's
# softmax; first) at the H100's chosen tile, d256 at 32 keys: Triton 3.6.0, no spills, 175 /
# 200 / 235 registers at d64 / d128 / d256, 21-29 of a loop's 34 exp2s between the q.k
# wgmma's issue and its wait (PERFLOG); second, the same at 64 x 64 with 4 warps, small
# enough for two programs per SM (d128: 203-214 registers x 128 threads, 99 KB of shared
# memory), whose barriers then hold one warpgroup each, not both; third at d64, 128 keys
# pipelined (250 registers, no spills, 44 of 66 exp2s beside the wgmma, 504 instructions a trip
# of 128 keys against 322 a trip of 64). (BLOCK_M, BLOCK_N, warps, stages[, TMA][, SPLIT][,
# ATOMIC][, PIPE]) as in CONFIGS.
# Moved to CONFIGS after the H100's sweep (2026-11-26, PERFLOG "Backward tiles from the H100's
# sweep"): dK/dV (64, 128, 8, 2) TMA at d128 and (64, 64, 8, 2) TMA at d256, dQ (128, 64, 8,
# 3) TMA at d128 and (128, 32, 8, 1) TMA at d256; the table's TMA tiles they replaced, which
# lost, are gone, dQ d128's (128, 64, 8, 2) TMA (the autotuner's choice there) kept here.
# Last at d256's dK/dV: the new tile with dQ by atomics (no dQ kernel), as the old tile's ATOMIC
# won 1.06-1.15x in the sweep; it spills 648 B against the tile's 184 (ptxas, Triton 3.6.0).
TRIALS = {
    ("fwd", 64): [(128, 64, 8, 3, TMA, PIPE), (64, 64, 4, 2, TMA, PIPE),
                  (128, 128, 8, 3, TMA, PIPE), (128, 64, 8, 2, TMA), (128, 128, 8, 3, TMA),
                  (64, 64, 4, 2, TMA)],
    ("fwd", 128): [(128, 64, 8, 3, TMA, PIPE), (64, 64, 4, 2, TMA, PIPE), (128, 64, 8, 2, TMA),
                   (128, 128, 8, 3, TMA), (64, 64, 4, 2, TMA)],
    ("fwd", 256): [(128, 32, 8, 2, TMA, PIPE), (128, 32, 8, 2, TMA), (64, 64, 4, 2, TMA)],
    ("dkdv", 64): [(64, 64, 8, 3, TMA, ATOMIC), (64, 128, 8, 2, TMA)],
    ("dkdv", 128): [(64, 128, 8, 2, TMA, SPLIT, ATOMIC), (64, 64, 8, 3, TMA, SPLIT, ATOMIC),
                    (64, 64, 8, 3, TMA, ATOMIC), (32, 128, 8, 2, TMA), (64, 64, 8, 3, TMA),
                    (32, 64, 4, 3, TMA), (64, 128, 8, 2, TMA, SPLIT), (64, 64, 8, 3, TMA, SPLIT)],
    ("dkdv", 256): [(16, 64, 8, 2, TMA, SPLIT, ATOMIC), (32, 64, 8, 2, TMA, SPLIT, ATOMIC),
                    (32, 64, 8, 2, TMA), (32, 64, 8, 3, TMA),
                    (32, 64, 8, 3, TMA, SPLIT), (64, 64, 8, 2, TMA, SPLIT),
                    (64, 64, 8, 2, TMA, ATOMIC)],
    ("dq", 128): [(128, 64, 8, 2, TMA), (128, 128, 8, 2, TMA)],
    ("dq", 256): [(64, 64, 8, 2, TMA)],
}


@dataclass
class Target:
    """One RQ1 shape and the kernels whose tiles are swept there (bf16 on a GPU). decode: one
    decoding step over a cache of seqlen tokens, as RQ1's part decode times it
    (attention_with_kvcache, one query, nheads_kv cache heads), call rows only."""
    headdim: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    kernels: tuple
    nheads_kv: int = 0  # 0: nheads
    decode: bool = False


# Slowest against FlashAttention-2 on the H100 first (ratios of results/speedup/h100.csv).
TARGETS = [
    Target(256, False, 1024, 16, 8, ("dkdv", "dq", "fwd")),  # bwd 0.45x
    Target(128, True, 2048, 8, 16, ("fwd",)),                 # fwd 0.67x
    Target(64, False, 1024, 16, 32, ("fwd",)),                # fwd 0.70x
    Target(128, False, 4096, 1, 32, (), nheads_kv=8, decode=True),  # 0.23 ms a step, 0.02 graphed
    Target(128, False, 4096, 4, 16, ("dkdv", "dq", "fwd")),   # the goals' shape: bwd 0.89x
    Target(256, True, 4096, 4, 8, ("dkdv", "dq")),
    Target(64, True, 2048, 8, 32, ("fwd",)),
]
QUICK_TARGETS = [Target(32, True, 48, 1, 2, ("fwd", "dkdv")),
                 Target(32, False, 64, 1, 4, (), nheads_kv=2, decode=True)]
CHECK_SEQLENS = (528, 1040)  # multiples of 16 as every target's, so a candidate compiles once
FULL_TILE_MULTIPLE = 128      # every tile's BLOCK_M and BLOCK_N divide it
QUICK_CHECK_SEQLENS = (40, 56)
# The first trials of each kernel timed at every target before any other candidate: the
# largest predicted gains, dK/dV's atomic dQ (which makes dQ's tiles moot where it wins) and
# the pipelined forward (one and two programs per SM); about 17 compiles over the targets.
LEAD_TRIALS = {"dkdv": 2, "fwd": 2, "dq": 0}

log = Log()


def candidates(kernel, major, headdim, ws=False):
    """The triton.Configs to sweep: CONFIGS' for this GPU and head dim, then TRIALS', then (ws)
    the table's warp-specialized ones."""
    block_d = ft._table_key(kernel, major, headdim)[2]
    table = ft.CONFIGS[ft._table_key(kernel, major, headdim)]
    entries = [*(c for c in table if WS not in c),
               *(TRIALS.get((kernel, block_d), []) if major == 9 else []),
               *(c for c in table if ws and WS in c)]
    return [ft._config(c) for c in dict.fromkeys(entries)]


def check_seqlens_for(cfg, t, check_seqlens):
    """The check's (seqlen_q, seqlen_k): check_seqlens, but for a warp-specialized candidate at a
    target that needs no mask (non-causal, lengths multiples of every tile) lengths that need
    none either, so the check runs the unmasked compile the target times (FULL_TILES,
    flash_triton._full_tiles) and not the masked one."""
    full = not t.causal and t.seqlen % FULL_TILE_MULTIPLE == 0
    if cfg.kwargs["WARP_SPECIALIZE"] and full:
        return tuple(-(-n // FULL_TILE_MULTIPLE) * FULL_TILE_MULTIPLE for n in check_seqlens)
    return check_seqlens


def inputs(batch, seqlen_q, seqlen_k, nheads, headdim, dtype, device, seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    q, do = (torch.randn(batch, seqlen_q, nheads, headdim, device=device, dtype=dtype,
                         generator=gen) for _ in range(2))
    k, v = (torch.randn(batch, seqlen_k, nheads, headdim, device=device, dtype=dtype,
                        generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)], do


def pass_fn(qkv, do, causal, mode):
    """The timed call: the forward, or (bwd) the backward on one forward's graph."""
    attn = lambda: longflash.attention(*qkv, causal=causal, backend="triton")  # noqa: E731
    if mode == "fwd":
        return attn
    o = attn()
    return lambda: torch.autograd.grad(o, qkv, do, retain_graph=True)


def host_ms(fn, device, calls=HOST_CALLS):
    """Wall ms per call of `calls` calls issued back to back, after one, synchronized only
    after the clock stops (CUDA: the host's work per call while the GPU runs behind)."""
    return host_us(fn, device, calls, repeats=1, warm=1)[0] / 1e3


def kernel_ms(fn, reps=10):
    """{kernel: GPU ms per call} of LongFlash's kernels in fn (PROFILED), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        for name, short in PROFILED.items():
            if evt.key.startswith(name) and total:
                out[short] = out.get(short, 0.0) + total / reps / 1e3  # us -> ms
    if not out:  # a renamed kernel or a profiler without device times: say so, no silent gap
        raise RuntimeError("no LongFlash kernel among the profiler's events: "
                           + ", ".join(e.key for e in prof.key_averages())[:300])
    return out


def _row(base, kernel, config, metric, value, unit="ms", status="ok", p20=float("nan"),
         p80=float("nan")):
    return dict(base, kernel=kernel, config=config, metric=metric, value=value, unit=unit,
                p20=p20, p80=p80, status=status)


def _measured(base, kernel, config, metric, measure):
    """Rows of one measurement; an exception is a row with status error (and a log line)."""
    try:
        value = measure()
    except Exception as exc:  # noqa: BLE001 - a row, not a crash
        log(f"  {kernel} {config} {metric}: error {type(exc).__name__}: {str(exc)[:300]}")
        return [_row(base, kernel, config, metric, float("nan"), status="error")]
    if isinstance(value, dict):
        return [_row(base, name, config, metric, v) for name, v in value.items()]
    if isinstance(value, tuple):
        return [_row(base, kernel, config, metric, value[0], p20=value[1], p80=value[2])]
    return [_row(base, kernel, config, metric, value)]


def call_rows(base, make_fn, device):
    """Kernel "call" rows of one call (make_fn() builds it, inputs ready): do_bench, host
    and (CUDA) graph-replay and per-kernel times; the host's cProfile to the log."""
    calls = HOST_CALLS if device == "cuda" else 3  # the interpreter: seconds a call
    rows = _measured(base, "call", "auto", "time_ms", lambda: time_ms(make_fn(), device))
    rows += _measured(base, "call", "auto", "host_ms", lambda: host_ms(make_fn(), device, calls))
    if device == "cuda":
        rows += _measured(base, "call", "auto", "time_ms_graph", lambda: time_ms_graph(make_fn()))
        rows += _measured(base, "call", "auto", "kernel_ms", lambda: kernel_ms(make_fn()))
    log(f"  call {base['mode']}: " + ", ".join(
        f"{r['kernel']} {r['metric']} {r['value']:.4g}" for r in rows))
    try:
        # as many calls as host_ms: far fewer launches than CUDA's queue holds, so no call
        # waits for the GPU
        log(f"  host profile, {base['mode']} call:\n" + host_profile(make_fn(), calls, top=12))
    except Exception as exc:  # noqa: BLE001 - a note in the log, not a result
        log(f"  host profile: {type(exc).__name__}: {exc}")
    return rows


def decode_rows(t, device, dtype):
    """A decoding step, RQ1's part decode's own call and inputs (experiments.decode): call
    rows only."""
    nheads_kv = t.nheads_kv or t.nheads
    step, layout = decode.make_decode("longflash", device)
    q, k, v = decode._inputs(t.batch, t.seqlen, t.nheads, nheads_kv, t.headdim, dtype, device,
                             seed=0)[layout]
    base = dict(experiment="tuning", provider="longflash", mode="fwd",
                dtype=str(dtype).replace("torch.", ""), batch=t.batch, seqlen_q=1,
                seqlen_k=t.seqlen, nheads=t.nheads, nheads_kv=nheads_kv, headdim=t.headdim,
                causal=False)
    return call_rows(base, lambda: lambda: step(q, k, v), device)


def _key(row):
    """A measurement's identity for --resume (the shape, mode, kernel and config)."""
    return tuple(str(row[c]) for c in ("batch", "seqlen_q", "seqlen_k", "nheads", "headdim",
                                       "causal", "mode", "kernel", "config"))


def measured_keys(path, after=None):
    """Keys of the time_ms rows with status ok already in path (--resume): what a later run
    need not measure again. An error (a wrong tile, a crash) is measured again, and so is a
    row measured before `after` (an ISO time: the kernels' tables changed since) or under other
    kernel switches (results.same_switches)."""
    if not os.path.exists(path):
        return set()
    import pandas as pd
    df = pd.read_csv(path)
    ok = df[(df["metric"] == "time_ms") & (df["status"] == "ok") & same_switches(df)]
    if after:
        ok = ok[~measured_before(ok, after)]
    return {_key(row) for row in ok.to_dict("records")}


def sweep_target(t, device, dtype, check_seqlens, ws=False, done=None, deadline=None,
                 part="calls", always=False):
    """The rows of one target's calls (part "calls") or of its kernels' candidates (part
    "lead": the autotuner's choice and the first LEAD_TRIALS trials; "candidates": all),
    yielded a batch at a time (each call, each kernel's candidates) so that the caller writes
    them as they come. done: keys already measured or tried (skipped; the candidates tried here
    are added); deadline: a time.monotonic() after which nothing more is started (the log names
    what was not run), except the calls if `always` (the first target's: a run that starts
    measures something)."""
    done = set() if done is None else done

    def late(what):
        if deadline is not None and time.monotonic() > deadline and not always:
            log(f"  budget spent: not run: {what}")
            return True
        return False

    if t.decode:
        base = dict(batch=t.batch, seqlen_q=1, seqlen_k=t.seqlen, nheads=t.nheads,
                    headdim=t.headdim, causal=False, mode="fwd", kernel="call", config="auto")
        if part == "calls" and _key(base) not in done and not late("the decoding call"):
            yield decode_rows(t, device, dtype)
        return
    mode_of = {"fwd": "fwd", "dkdv": "bwd", "dq": "bwd"}
    major = torch.cuda.get_device_capability()[0] if device == "cuda" else 9
    qkv, do = inputs(t.batch, t.seqlen, t.seqlen, t.nheads, t.headdim, dtype, device)
    base = dict(experiment="tuning", provider="longflash", dtype=str(dtype).replace("torch.", ""),
                batch=t.batch, seqlen_q=t.seqlen, seqlen_k=t.seqlen, nheads=t.nheads,
                nheads_kv=t.nheads, headdim=t.headdim, causal=t.causal)
    modes = dict.fromkeys(mode_of[k] for k in t.kernels)
    if part == "calls":
        for mode in modes:  # the call as RQ1 times it
            b = dict(base, mode=mode)
            if _key(dict(b, kernel="call", config="auto")) not in done and not late(
                    f"call {mode}"):
                yield call_rows(b, lambda: pass_fn(qkv, do, t.causal, mode), device)
        return
    # what the autotuner chose at this shape: one call of each mode, none forced, sets its
    # best_config (found in its cache if the calls part ran)
    for mode in modes:
        pass_fn(qkv, do, t.causal, mode)()
    chosen = {k: config_name(getattr(ft, KERNELS[k]).best_config) for k in t.kernels
              if getattr(getattr(ft, KERNELS[k]), "best_config", None) is not None}
    for kernel in t.kernels:
        b, rows = dict(base, mode=mode_of[kernel]), []
        names = {config_name(c): c for c in candidates(kernel, major, t.headdim, ws)}
        if part == "lead":
            block_d = ft._table_key(kernel, major, t.headdim)[2]
            trials = TRIALS.get((kernel, block_d), [])[:LEAD_TRIALS[kernel]]
            lead = [chosen.get(kernel)] + [config_name(ft._config(c)) for c in trials]
            # (the autotuner's choice: compiled already, so a check and a timing; trials only
            # where candidates() has them, on sm_90)
            names = {n: names[n] for n in lead if n in names}
        todo = [n for n in names if _key(dict(b, kernel=kernel, config=n)) not in done]
        done.update(_key(dict(b, kernel=kernel, config=n)) for n in todo)
        if len(todo) > 1 and not (deadline is not None and time.monotonic() > deadline):
            compile_candidates(kernel, [names[n] for n in todo], qkv, do, t.causal, b["mode"])
        for i, name in enumerate(todo):
            if late(f"{kernel} {', '.join(todo[i:])}"):
                break
            rows += candidate_rows(t, b, kernel, names[name], qkv, do, device, dtype,
                                   check_seqlens)
        if rows:
            log(f"  {kernel}: " + summary(rows, kernel, chosen.get(kernel, "?")))
            yield rows
    if part == "lead":
        # The call timed again, none forced, after the candidates' checks and timings: the
        # H100's sweep timed the autotuner's own forward tile, forced, 0.1-0.27 ms above the
        # call at 1K-2K (equal at 4K). Slow here too: something the sweep leaves behind (clocks
        # after the float64 checks, memory); fast: the forcing itself.
        for mode in modes:
            b = dict(base, mode=mode, kernel="call", config=CALL_AGAIN)
            if _key(b) not in done and not late(f"call {mode} again"):
                done.add(_key(b))
                rows = _measured(b, "call", CALL_AGAIN, "time_ms", lambda: time_ms(
                    pass_fn(qkv, do, t.causal, mode), device))
                log(f"  call {mode} again: time_ms {rows[0]['value']:.4g}")
                yield rows


def compile_candidates(kernel, configs, qkv, do, causal, mode):
    """Compile a target's candidates of `kernel` at once, on threads (flash_triton.compiling()),
    before each is checked and timed alone: forced one at a time, each would compile where it
    first runs, one after the other (about 70 compiles in the whole sweep). Each is forced as it
    will run, at the target's shape (the check's lengths are multiples of 16 like the target's:
    the same compile). If this fails, each compiles where it runs, as before."""
    start = time.perf_counter()
    try:
        with ft.compiling():
            for cfg in configs:
                with ft.forced_configs({kernel: cfg}):
                    pass_fn(qkv, do, causal, mode)()
    except Exception as error:  # noqa: BLE001 (only time is at stake)
        log(f"  {kernel}: compiling the candidates at once failed: {error!r}")
        return
    how = "the interpreter: nothing to compile" if ft._INTERPRET else \
        f"{ft.compile_workers()} threads"
    log(f"  {kernel}: {len(configs)} candidates compiled in {time.perf_counter() - start:.1f} s"
        f" ({how})")


def candidate_rows(t, b, kernel, cfg, qkv, do, device, dtype, check_seqlens):
    """A candidate forced alone for `kernel`: its check against float64 on a small shape
    (max_rel_err; not below RELATIVE_ERROR_LIMIT, an error row and no time), then its time at
    the target."""
    name = config_name(cfg)
    # the check: one sequence, the target's heads, lengths multiples of 16 as the target's
    # (Triton specializes integer arguments on that): one compile serves both
    check = inputs(1, *check_seqlens_for(cfg, t, check_seqlens), t.nheads, t.headdim, dtype,
                   device, seed=1)
    with ft.forced_configs({kernel: cfg}):
        # o for a forward candidate (no backward run), dq, dk, dv for a backward one
        rows = _measured(b, kernel, name, "max_rel_err", lambda: max(
            relative_errors(*check[0], check[1], t.causal, grads=kernel != "fwd")
            [0 if kernel == "fwd" else 1:]))
        err = rows[0]["value"]
        if rows[0]["status"] == "ok" and not err < RELATIVE_ERROR_LIMIT:  # NaN too
            rows[0]["status"] = "error"
        if rows[0]["status"] == "ok":
            rows += _measured(b, kernel, name, "time_ms", lambda: time_ms(
                pass_fn(qkv, do, t.causal, b["mode"]), device))
        else:
            rows.append(_row(b, kernel, name, "time_ms", float("nan"), status="error"))
    log(f"  {kernel:4s} {name:16s} max_rel_err {err:.2g} time_ms {rows[-1]['value']:.4g}"
        f" ({rows[-1]['status']})")
    return rows


def summary(rows, kernel, chosen):
    """One line: the fastest exact candidate of `kernel` against the autotuner's choice."""
    timed = {r["config"]: r["value"] for r in rows if r["kernel"] == kernel
             and r["metric"] == "time_ms" and r["status"] == "ok"}
    if not timed:
        return "no candidate was exact"
    best = min(timed, key=timed.get)
    if chosen not in timed:
        return f"fastest {best} {timed[best]:.4g} ms; the autotuner's {chosen} not timed here"
    return (f"fastest {best} {timed[best]:.4g} ms, the autotuner's {chosen} "
            f"{timed[chosen]:.4g} ms ({timed[chosen] / timed[best]:.2f}x)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the GPU targets (TARGETS)")
    size.add_argument("--quick", action="store_true", help="one tiny target (the pipeline)")
    parser.add_argument("--targets", help="comma-separated indices into the targets to run")
    parser.add_argument("--ws", action="store_true", help="also the warp-specialized candidates")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no call and no candidate after this many seconds (the "
                        "first target's calls excepted)")
    parser.add_argument("--resume", action="store_true", help="skip what the results file "
                        "already holds with status ok (a rerun measures only the rest)")
    parser.add_argument("--resume-after", metavar="ISO_TIME", default=None,
                        help="with --resume: rows measured before this time are measured "
                        "again (the config tables changed since)")
    parser.add_argument("--out", default=None, help="CSV (default results/tuning/<device>.csv)")
    args = parser.parse_args(argv)
    check_resume_after(parser, args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.quick:
        parser.error("the sweep times Triton kernels on a GPU; on a CPU use --quick (the "
                     "pipeline, under the Triton interpreter)")
    targets, check_seqlens = ((QUICK_TARGETS, QUICK_CHECK_SEQLENS) if args.quick
                              else (TARGETS, CHECK_SEQLENS))
    if args.targets:
        targets = [targets[int(i)] for i in args.targets.split(",")]
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # no bf16 tl.dot interpreted
    out, _ = start_run("tuning", args.out or default_out("tuning"), log,
                       dict(targets=[asdict(t) for t in targets], ws=args.ws,
                            budget_s=args.budget_s, resume=args.resume,
                            trials={str(k): v for k, v in TRIALS.items()}, device=device),
                       f"{len(targets)} targets on {device}")
    done = measured_keys(out, args.resume_after) if args.resume else set()  # grows as tried
    if done:
        log(f"--resume: {len(done)} measurements already in {out} are not repeated")
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    # Every target's calls first (host or GPU: a few seconds each), then every target's lead
    # candidates (the autotuner's choice, timed as the others, and the first trials: the
    # largest predicted gains), then every target's other candidates (a compile, a check and a
    # timing each): a short run answers the first question everywhere and times the likeliest
    # winners at every shape before it spends the rest on tiles, slowest target first.
    for part in ("calls", "lead", "candidates"):
        for i, t in enumerate(targets):
            always = part == "calls" and i == 0
            if deadline is not None and time.monotonic() > deadline and not always:
                log(f"budget of {args.budget_s:.0f} s spent: {part} of targets {i}.. not run")
                break
            log(f"target {i}, {part}: {asdict(t)}")
            for rows in sweep_target(t, device, dtype, check_seqlens, args.ws, done, deadline,
                                     part, always):
                write_results(rows, out, key_columns=KEY_COLUMNS)
    log(f"rows in {out}")


if __name__ == "__main__":
    main()
