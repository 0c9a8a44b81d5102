"""RQ3, sequence parallelism: exact ring attention (longflash.parallel) across ranks.

    python -m experiments.scaling                        # CPU: gloo ranks on this machine
    python -m experiments.scaling --long-budget-s 1800   # ... with 30 minutes for part "long"
    python -m experiments.scaling --full                 # GPU machine (see FULL)
    python -m experiments.scaling --quick --out /tmp/s.csv   # tiny sizes, seconds (tests)
    python -m experiments.scaling --parts exactness,weak     # a subset; rows merge by key

Ranks are processes on this machine, forked and joined in a gloo group, one CPU thread
each: they emulate devices (CPU tensors, also with --full). On a machine with a GPU they are
forked from a clean forkserver process, not from this one (spawn_ranks; the environment
variable LONGFLASH_RANKS_START_METHOD=fork|forkserver|spawn overrides). With more ranks than
cores they time-share the cores (column `cores`), so timings beyond that are not parallel
speed. Writes results/scaling/<device>.csv (device "cpu" or the GPU, e.g. "h100"), the log
<device>.log and the config <device>.json.

Rows follow experiments/results.py, experiment "scaling", with extra columns: part, layout
("zigzag", "contiguous", or "none": one device, no ring), ranks, tokens_per_rank (seqlen =
ranks * tokens_per_rank), cores, basis ("measured" or "projected"), link, link_bandwidth_gbs,
link_latency_us, window_left (part window); part, layout, ranks, link and window_left are
key columns (KEY_COLUMNS). Provider
"longflash" is the ring (ranks = 1: a ring of one, the same computation as
longflash.attention), "standard" the materializing reference.

Parts and metrics:
  exactness   ring vs the float64 reference, tokens per rank fixed, ranks 1..8, both layouts,
              float32 and bfloat16: max_err_o, max_err_lse (mode fwd), max_err_dq, max_err_dk,
              max_err_dv (mode bwd), unit "abs" = max |x - x_ref64|. Beside them, on one
              device at the same seqlen: longflash.attention (layout none) and "standard"
              computed in the input dtype (the yardstick of the tests' tolerance rule).
  memory      peak_mem_mb of one forward+backward, tokens per rank fixed: the largest
              per-rank peak (MiB above the start of the call: growth of the resident set's
              high-water mark in each rank). Layout none: longflash.attention holding the
              whole sequence on one device, measured the same way in a process of its own.
  weak        measured weak scaling, tokens per rank fixed: time_ms of forward+backward (the
              slowest rank's median of 5 calls), tflops per rank, and flop_efficiency =
              (FLOPs(seqlen) / ranks / time) / (FLOPs(tokens_per_rank) / time of 1 rank).
              FLOPs as in experiments.results.flops (causal halved, backward 2.5x).
  blocks      the compute a rank does in one ring step, on this device (GPU with --full;
              on CPU with one thread, like a rank), timed with experiments.measure.time_ms:
              time_ms of the ops attention_forward (mode fwd) and attention_backward (mode
              bwd) on the blocks of T = block_tokens_per_rank: causal (T, T) (the local step),
              (T, T/2) and (T/2, T) (zigzag's other steps), (T, T) non-causal (contiguous).
  projection  alpha-beta model of a ring of 1..64 ranks from the block times (basis
              "projected", never measured): projected_time_ms and projected_efficiency (as
              flop_efficiency) for each link of LINKS, whose assumed bandwidth per direction
              and latency are the columns link_bandwidth_gbs, link_latency_us. Lockstep: a
              step lasts as long as its slowest rank's block or its transfer, whichever is
              longer (they overlap); forward steps carry k, v (input dtype), backward steps
              also the previous step's dk, dv (float32), and the last dk, dv transfer is
              exposed. Merges and the metadata check are not modelled.
  window      a causal sliding window of window_left tokens against the whole ring (window_left
              -1), tokens per rank fixed, ranks window_ranks, both layouts: sent_mb (MiB that
              a rank hands torch.distributed to send in one forward+backward: key/value
              shards and the travelling dK/dV, counted at longflash.parallel._exchange; the
              largest rank's) and time_ms (forward+backward, the slowest rank's median of 5).
              Column window_left (a key column; empty in the other parts' rows).
  variants    the ring's options over the global sequence against the float64 reference,
              causal, tokens per rank fixed, ranks variant_ranks, both layouts, float32 and
              bfloat16: column variant (a key column; empty in the other parts' rows) of
              VARIANTS (a sliding window, ALiBi, packed documents, packed documents under a
              window, dropout, softcap): max_err_o, max_err_lse (mode fwd), max_err_dq,
              max_err_dk, max_err_dv (mode bwd), unit "abs", and beside each error_bound_<x>,
              the tests' tolerance rule (longflash.reference.error_bound: 2x the error of
              "standard" attention in the input dtype plus a rounding floor); exact means
              every max_err_<x> <= error_bound_<x>.
  decode      decoding over a KV cache sharded across the ranks (longflash.parallel.
              attention_with_sharded_kvcache): the cache's seqlen_k tokens in P contiguous
              parts of tokens_per_rank (layout "contiguous"), one step of one new token
              (seqlen_q 1) that appends its key and value on rank 0, decode_shape, ranks
              decode_ranks (1: a group of one, the same call without collectives). At each of decode_seqlens, cfg.dtype: time_ms (a step, the slowest rank's
              median of 1 + 5), cache_mb (the largest rank's part of the cache, keys and values,
              MiB) and sent_kb (KiB a rank hands torch.distributed in a step: the merge's two
              all_reduces and the argument check's all_gather, counted at torch.distributed).
              At decode_exact_seqlen, for each of exact_dtypes: max_err_o, max_err_lse against
              float64 attention over the whole cache and the new token, and beside each
              error_bound_<x>, the tests' tolerance rule (as in part variants).
  long        one long causal sequence through the ring of `long_ranks` emulated ranks,
              forward, lengths doubling while the time budget lasts (each run is predicted
              at 4x the previous): time_ms (one call, between barriers), peak_mem_mb (per
              rank, largest), max_err_o_sampled (max |o - ref64| over `long_check_rows`
              query rows spread over the sequence, the reference attending to all their keys)
              and error_bound_o_sampled (the tests' tolerance rule on those rows,
              longflash.reference.error_bound: 2x PyTorch's own error in the input dtype plus
              a rounding floor; exact means max_err_o_sampled <= error_bound_o_sampled).
              With CUDA (--full) also longflash.attention forward+backward at gpu_long_seqlen
              on one GPU (layout none; bfloat16; time_ms, tflops, peak_mem_mb), run and
              written before every other part, then one forward call checked the same way
              (mode fwd: max_err_o_sampled, error_bound_o_sampled). From gpu_long_lean_seqlen tokens on (1M: a
              few seconds a call) it is timed leanly, experiments.measure.time_ms_lean: one
              warm-up call (autotuning), then gpu_long_reps timed calls, fewer once they took
              gpu_long_max_s together (CUDA events; median, p20, p80 of those few),
              peak_mem_mb the largest over the timed calls. An OOM or any other failure
              gives the three rows with status oom / error.
"""

import argparse
import contextlib
import ctypes
import datetime
import math
import os
import tempfile
import time
import unittest.mock
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import longflash
from longflash.reference import error_bound
from longflash import parallel
from longflash.parallel import ring_attention, shard_sequence, unshard_sequence
from experiments.measure import MB, rss_growth_kb, is_oom, peak_memory_mb, time_ms, \
    time_ms_lean
from experiments.results import (Log, cpu_name, flops, load_average, start_run, tflops,
                                 usable_cores, write_results)

CPU_BACKEND = "torch"  # the blockwise PyTorch path, even where TRITON_INTERPRET=1 is set

# Assumptions of the projection, per direction of one link: (GB/s, latency in us).
# NVLink 4 (H100 SXM): 900 GB/s both directions together. InfiniBand NDR: 400 Gb/s per
# GPU. Peak figures, so the projection is optimistic about communication.
LINKS = {"ideal": (math.inf, 0.0), "nvlink": (450.0, 10.0), "infiniband": (50.0, 20.0)}


@dataclass
class Config:
    shape: tuple = (1, 4, 2, 64)          # (batch, nheads, nheads_kv, headdim) of the ring parts
    dtype: str = "float32"                # inputs of memory, weak, blocks, long
    causal: bool = True
    layouts: tuple = ("zigzag", "contiguous")
    exact_ranks: tuple = (1, 2, 4, 8)
    exact_tokens_per_rank: int = 256
    exact_dtypes: tuple = ("float32", "bfloat16")
    tokens_per_rank: int = 2048           # memory, weak
    memory_ranks: tuple = (1, 2, 4, 8)
    weak_ranks: tuple = (1, 2, 4)         # > cores: the ranks time-share
    window_ranks: tuple = (2, 4, 8)       # part window: a causal window of window_left tokens
    window_tokens_per_rank: int = 1024    # ... (a quarter of a zigzag chunk) against the
    window_left: int = 128                # ... whole ring
    variant_ranks: tuple = (2, 4, 8)      # part variants
    variant_tokens_per_rank: int = 256
    variant_dtypes: tuple = ("float32", "bfloat16")
    decode_ranks: tuple = (1, 2, 4, 8)    # part decode: one query over a sharded cache
    decode_shape: tuple = (1, 8, 2, 64)   # (batch, nheads, nheads_kv, headdim): GQA 4
    decode_seqlens: tuple = (2**14, 2**16, 2**18, 2**20)  # cache lengths timed (16K .. 1M)
    decode_exact_seqlen: int = 2**16      # checked against float64 there (exact_dtypes)
    block_device: str = "cpu"             # blocks and projection: where the blocks are timed,
    block_shape: tuple = (1, 4, 2, 64)    # ... their shape (default: as the gloo ranks',
    block_dtype: str = "float32"          # so that projection and measurement compare)
    block_tokens_per_rank: int = 2048
    projection_ranks: tuple = (1, 2, 4, 8, 16, 32, 64)
    long_ranks: int = 4
    long_shape: tuple = (1, 1, 1, 16)     # one head, headdim 16: length over width
    long_seqlens: tuple = tuple(2**i for i in range(16, 21))  # 64K .. 1M
    long_budget_s: float = 240.0          # part long stops before a run predicted past this
    long_check_rows: int = 16
    gpu_long_seqlen: int = 0              # > 0: one GPU, forward+backward (--full)
    gpu_long_shape: tuple = (1, 4, 4, 128)
    gpu_long_device: str = "cuda"         # runs only where this is available ("cpu": tests)
    gpu_long_lean_seqlen: int = 2**18     # from this length on, measure.time_ms_lean: one
    gpu_long_reps: int = 3                # ... warm-up call, then this many timed calls,
    gpu_long_max_s: float = 60.0          # ... fewer once they took this long together


FULL = dict(  # a GPU machine with 16 cores: gloo ranks on its CPU, blocks on its GPU with
    # the attention of Llama-3-8B (32 heads, 8 KV heads, headdim 128), bf16, 8K tokens per rank
    exact_ranks=(1, 2, 4, 8, 16), memory_ranks=(1, 2, 4, 8, 16), weak_ranks=(1, 2, 4, 8, 16),
    window_ranks=(2, 4, 8, 16), window_tokens_per_rank=2048, window_left=256,
    block_device="cuda", block_shape=(1, 32, 8, 128), block_dtype="bfloat16",
    block_tokens_per_rank=8192, long_ranks=16, long_budget_s=480.0, gpu_long_seqlen=2**20)
QUICK = dict(
    shape=(1, 2, 1, 16), exact_ranks=(1, 2), exact_tokens_per_rank=16, exact_dtypes=("float32",),
    tokens_per_rank=64, memory_ranks=(1, 2), weak_ranks=(1, 2, 4), block_shape=(1, 2, 1, 16),
    block_tokens_per_rank=64, projection_ranks=(1, 2, 64), window_ranks=(2, 4),
    window_tokens_per_rank=32, window_left=4, variant_ranks=(2,), variant_tokens_per_rank=16,
    variant_dtypes=("float32",), decode_ranks=(1, 2), decode_shape=(1, 2, 1, 16),
    decode_seqlens=(64, 256), decode_exact_seqlen=64, long_ranks=2, long_seqlens=(256, 512),
    long_budget_s=30.0, long_check_rows=4)
PARTS = ("exactness", "memory", "weak", "blocks", "projection", "window", "variants", "decode",
         "long")
# beside experiments.results.KEY_COLUMNS
KEY_COLUMNS = ("part", "layout", "ranks", "link", "window_left", "variant")
# Part variants: name -> f(global seqlen, tokens per rank, nheads) -> ring_attention's options
# (all causal). Windows of half a zigzag chunk; documents of lengths 1 to 2 ranks' tokens,
# drawn once, so that some lie within a chunk and others cross several.
VARIANTS = {
    "window": lambda n, t, h: dict(window_size=(t // 4, -1)),
    "alibi": lambda n, t, h: dict(alibi_slopes=2.0 ** (-8.0 * torch.arange(1, h + 1) / h)),
    "packed": lambda n, t, h: dict(cu_seqlens=_documents(n, t)),
    "packed_window": lambda n, t, h: dict(cu_seqlens=_documents(n, t), window_size=(t // 4, -1)),
    "dropout": lambda n, t, h: dict(dropout_p=0.1, seed=2**40 + 1),
    "softcap": lambda n, t, h: dict(softcap=5.0),
}


# ----------------------------------------------------------------------------- ranks

def _rank_main(rank, world_size, tmp, timeout_s, fn, args, log_path=None):
    torch.set_num_threads(1)  # before anything else: see spawn_ranks
    log.path = log_path  # a rank started by the forkserver has a fresh module: no log path
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"),
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            torch.save(result, os.path.join(tmp, "result.pt"))
    finally:
        dist.destroy_process_group()


def _fork_is_safe():
    """Whether ranks may be forked from this process: only where no GPU is visible.

    PyTorch's autograd engine starts a worker thread per GPU on the first backward of a
    process that sees one (whatever device the tensors are on), and from then on a forked
    child cannot run a backward ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing"); a child forked after this process used CUDA cannot use
    CUDA either. On the H100 machine this process runs backward passes before the ranks (the
    warm-up of spawn_ranks, part long's one-GPU run), so every rank of part exactness
    failed. Without a GPU the engine starts no thread and fork is safe (and fast)."""
    return not torch.cuda.is_available()


# What a rank loads on its first call, imported once in the forkserver (spawn_ranks).
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "longflash", "experiments.scaling"]


def spawn_ranks(world_size, fn, *args, timeout_s=1800, start_method=None):
    """Run fn(rank, world_size, *args) in world_size processes joined in a gloo group (their
    default group), one CPU thread each, on CPU tensors; return what rank 0's fn returned.

    start_method: "fork", "forkserver" or "spawn" (seconds per rank); by default
    $LONGFLASH_RANKS_START_METHOD, else "fork" where that is safe (_fork_is_safe: no GPU),
    else "forkserver".
    Forked ranks inherit this process's imports, so starting one costs milliseconds, not
    seconds. One thread per rank also keeps them out of OpenMP regions, whose thread pool
    does not survive fork (as in experiments.measure). "forkserver": the ranks are forked
    from a server process started afresh once (it imports FORKSERVER_PRELOAD, never runs
    autograd or CUDA), so nothing this process did reaches them; fn and args are pickled.
    A failing rank raises here (torch.multiprocessing.ProcessRaisedException, its traceback
    in the message) and stops the others.
    """
    start_method = (start_method or os.environ.get("LONGFLASH_RANKS_START_METHOD")
                    or ("fork" if _fork_is_safe() else "forkserver"))
    if start_method == "fork":
        # Load once, here, what the custom ops load on their first call (torch._dynamo).
        x = torch.zeros(1, 1, 1, 1, requires_grad=True)
        longflash.attention(x, x, x, backend="torch").sum().backward()
    elif start_method == "forkserver":  # effective until the server starts (the first call)
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(
            FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
        torch.multiprocessing.start_processes(
            _rank_main, (world_size, tmp, timeout_s, fn, args, log.path), nprocs=world_size,
            start_method=start_method)
        return torch.load(os.path.join(tmp, "result.pt"), weights_only=False)


def _max_over_ranks(*values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _release_free_memory():
    """glibc keeps freed blocks resident in its heap, and a repeated call reuses them without
    raising the resident set's high-water mark. malloc_trim(0) gives their pages back, so
    that the memory of the next call shows (as fresh pages) when it is measured."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _rank_peak_mb(fn):
    """Peak extra memory of fn() in this rank (CPU). measure.peak_memory_mb would fork, and a
    forked rank loses gloo's threads, so the growth of the high-water mark is read in-process."""
    _release_free_memory()
    return rss_growth_kb(fn) * 1024 / MB


# ----------------------------------------------------------------------------- rows

def _row(cfg_shape, dtype, part, layout, ranks, tokens_per_rank, mode, metric, value, unit,
         seqlen_q=None, seqlen_k=None, causal=True, provider="longflash", p20=math.nan,
         p80=math.nan, status="ok", basis="measured", link=None, window_left=None,
         variant=None, **extra):
    """One row of the results schema plus this experiment's columns (module docstring)."""
    batch, nheads, nheads_kv, headdim = cfg_shape
    seqlen_q = ranks * tokens_per_rank if seqlen_q is None else seqlen_q
    return dict(experiment="scaling", provider=provider, mode=mode,
                dtype=dtype, batch=batch, seqlen_q=seqlen_q,
                seqlen_k=seqlen_q if seqlen_k is None else seqlen_k, nheads=nheads,
                nheads_kv=nheads_kv, headdim=headdim, causal=causal, metric=metric, value=value,
                unit=unit, p20=p20, p80=p80, status=status, part=part, layout=layout,
                ranks=ranks, tokens_per_rank=tokens_per_rank, cores=usable_cores(),
                basis=basis, link=link, window_left=window_left, variant=variant, **extra)


def _inputs(shape, seqlen, dtype, seed, device="cpu", seqlen_k=None):
    """q: (batch, seqlen, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim); do."""
    batch, nheads, nheads_kv, headdim = shape
    gen = torch.Generator().manual_seed(seed)
    seqlen_k = seqlen if seqlen_k is None else seqlen_k
    sizes = [(batch, seqlen, nheads, headdim)] + [(batch, seqlen_k, nheads_kv, headdim)] * 2
    return [torch.randn(s, generator=gen).to(device=device, dtype=getattr(torch, dtype))
            for s in sizes + sizes[:1]]


# ----------------------------------------------------------------------------- parts in ranks

def _outputs(fn, q, k, v, do):
    """o, lse and the gradients of sum(o * do), fn(q, k, v) -> (o, lse)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o, lse = fn(q, k, v)
    return [o, lse, *torch.autograd.grad(o, (q, k, v), do.to(o.dtype))]


def _ring_outputs(q, k, v, do, layout, **options):
    """_outputs of ring_attention with options on this rank's shards of the full q, k, v, do,
    unsharded: the whole sequence's o, lse and gradients, on every rank."""
    shard = lambda x: shard_sequence(x, layout=layout)  # noqa: E731
    out = _outputs(lambda *x: ring_attention(*x, layout=layout, return_lse=True,
                                             backend=CPU_BACKEND, **options),
                   *map(shard, (q, k, v, do)))
    out[1] = out[1].transpose(1, 2)  # lse (B, H, N) -> (B, N, H): seqlen on dim 1
    out = [unshard_sequence(x, layout=layout) for x in out]
    out[1] = out[1].transpose(1, 2)
    return out


def _exactness(rank, world_size, cfg):
    rows, names = [], ("o", "lse", "dq", "dk", "dv")
    seqlen = world_size * cfg.exact_tokens_per_rank
    for dtype in cfg.exact_dtypes:
        q, k, v, do = _inputs(cfg.shape, seqlen, dtype, seed=0)
        if rank == 0:
            x64 = [x.double() for x in (q, k, v, do)]
            ref = _outputs(lambda *x: longflash.attention_ref(*x, causal=cfg.causal), *x64)
        results = {}
        for layout in cfg.layouts:
            results[("longflash", layout, world_size)] = _ring_outputs(q, k, v, do, layout,
                                                                       causal=cfg.causal)
        if rank != 0:
            continue
        results[("longflash", "none", 1)] = _outputs(
            lambda *x: longflash.attention(*x, causal=cfg.causal, return_lse=True,
                                           backend=CPU_BACKEND), q, k, v, do)
        results[("standard", "none", 1)] = _outputs(
            lambda *x: longflash.attention_ref(*x, causal=cfg.causal, upcast=False), q, k, v, do)
        for (provider, layout, ranks), out in results.items():
            for name, x, r in zip(names, out, ref):
                err = (x.double() - r).abs().max().item()
                rows.append(_row(cfg.shape, dtype, "exactness", layout, ranks, seqlen // ranks,
                                 "fwd" if name in ("o", "lse") else "bwd", f"max_err_{name}",
                                 err, "abs", causal=cfg.causal, provider=provider))
    return rows


def _memory_and_weak(rank, world_size, cfg, parts):
    rows, T = [], cfg.tokens_per_rank
    # This rank's shards, drawn directly: the whole sequence never exists anywhere.
    q, k, v, do = _inputs(cfg.shape, T, cfg.dtype, seed=1000 + rank)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    row = lambda *a, **kw: _row(cfg.shape, cfg.dtype, *a, causal=cfg.causal, **kw)  # noqa

    def fwd_bwd(layout):
        o = ring_attention(q, k, v, causal=cfg.causal, layout=layout, backend=CPU_BACKEND)
        torch.autograd.grad(o, (q, k, v), do)
    if "weak" in parts and world_size in cfg.weak_ranks:
        fl = flops(cfg.shape[0], world_size * T, world_size * T, cfg.shape[1], cfg.shape[3],
                   cfg.causal, "fwd_bwd") / world_size
        for layout in cfg.layouts:
            dist.barrier()
            # warmup=0, rep=0: exactly 1 + 5 calls, the same count on every rank (an adaptive
            # count would leave ranks waiting for each other forever).
            med, p20, p80 = _max_over_ranks(*time_ms(lambda: fwd_bwd(layout), "cpu",
                                                     warmup=0, rep=0))
            rows.append(row("weak", layout, world_size, T, "fwd_bwd", "time_ms", med, "ms",
                            p20=p20, p80=p80))
            rows.append(row("weak", layout, world_size, T, "fwd_bwd", "tflops", tflops(fl, med),
                            "TFLOP/s"))
    if "memory" in parts and world_size in cfg.memory_ranks:
        for layout in cfg.layouts:
            fwd_bwd(layout)  # warm-up: what is loaded once is not the call's memory
            (peak,) = _max_over_ranks(_rank_peak_mb(lambda: fwd_bwd(layout)))
            rows.append(row("memory", layout, world_size, T, "fwd_bwd", "peak_mem_mb", peak, "MiB"))
    return rows


def _window(rank, world_size, cfg):
    """Part window: a causal window of cfg.window_left tokens through the ring against the
    whole ring, both layouts: what each rank sends (counted where the ring posts its
    transfers) and the time of a forward+backward pass."""
    rows, T = [], cfg.window_tokens_per_rank
    q, k, v, do = _inputs(cfg.shape, T, cfg.dtype, seed=2000 + rank)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    sent, exchange = [0], parallel._exchange

    def counted(ring, *tensors, shift=1):
        if shift % ring.world_size:  # a shift of 0 sends nothing
            sent[0] += sum(x.numel() * x.element_size() for x in tensors)
        return exchange(ring, *tensors, shift=shift)
    for layout in cfg.layouts:
        for window_left in (-1, cfg.window_left):
            def fwd_bwd():
                o = ring_attention(q, k, v, causal=True, layout=layout, backend=CPU_BACKEND,
                                   window_size=(window_left, -1))
                torch.autograd.grad(o, (q, k, v), do)
            sent[0] = 0
            with unittest.mock.patch.object(parallel, "_exchange", counted):
                fwd_bwd()  # also the warm-up
            (sent_mb,) = _max_over_ranks(sent[0] / MB)
            dist.barrier()
            med, p20, p80 = _max_over_ranks(*time_ms(fwd_bwd, "cpu", warmup=0, rep=0))  # 1 + 5
            row = lambda *a, **kw: _row(cfg.shape, cfg.dtype, "window", layout,  # noqa: E731
                                        world_size, T, "fwd_bwd", *a, window_left=window_left,
                                        **kw)
            rows += [row("sent_mb", sent_mb, "MiB"), row("time_ms", med, "ms", p20=p20, p80=p80)]
    return rows


def _documents(seqlen, tokens_per_rank):
    """cu_seqlens (int32) of documents of 1 to 2 * tokens_per_rank tokens over seqlen."""
    gen, offsets = torch.Generator().manual_seed(seqlen), [0]
    while offsets[-1] < seqlen:
        n = int(torch.randint(1, 2 * tokens_per_rank + 1, (), generator=gen))
        offsets.append(min(offsets[-1] + n, seqlen))
    return torch.tensor(offsets, dtype=torch.int32)


def _reference(q, k, v, options, upcast):
    """longflash.attention_ref with ring_attention's options (packed: each document alone,
    batch 1), causal; (o, lse)."""
    kw = dict(options)
    cu = kw.pop("cu_seqlens", None)
    kw["seed"] = kw.get("seed", 0)
    if cu is None:
        return longflash.attention_ref(q, k, v, causal=True, upcast=upcast, **kw)
    o, lse = longflash.attention_varlen_ref(q[0], k[0], v[0], cu, cu, causal=True,
                                            upcast=upcast, **kw)
    return o[None], lse[None]


def _variants(rank, world_size, cfg):
    """Part variants: each of VARIANTS through the ring, both layouts, against float64, with
    the tolerance rule's bound from standard attention in the input dtype."""
    rows, names, T = [], ("o", "lse", "dq", "dk", "dv"), cfg.variant_tokens_per_rank
    seqlen = world_size * T
    for dtype in cfg.variant_dtypes:
        q, k, v, do = _inputs(cfg.shape, seqlen, dtype, seed=3000 + world_size)
        for variant, options_of in VARIANTS.items():
            options = options_of(seqlen, T, cfg.shape[1])
            if rank == 0:
                ref = _outputs(lambda *x: _reference(*x, options, True),
                               *[x.double() for x in (q, k, v, do)])
                lowp = _outputs(lambda *x: _reference(*x, options, False), q, k, v, do)
            for layout in cfg.layouts:
                out = _ring_outputs(q, k, v, do, layout, causal=True, **options)
                if rank != 0:
                    continue
                for name, x, low, r in zip(names, out, lowp, ref):
                    err, err_lowp = ((y.double() - r).abs().max().item() for y in (x, low))
                    bound = error_bound(err_lowp, r.abs().max().item(), q.dtype)
                    mode = "fwd" if name in ("o", "lse") else "bwd"
                    for metric, value in ((f"max_err_{name}", err),
                                          (f"error_bound_{name}", bound)):
                        rows.append(_row(cfg.shape, dtype, "variants", layout, world_size, T,
                                         mode, metric, value, "abs", variant=variant))
    return rows


def _decode(rank, world_size, cfg):
    """Part decode: one decoding step over a cache in contiguous parts, one a rank; checked
    against float64 at decode_exact_seqlen, timed at each of decode_seqlens."""
    rows, shape = [], cfg.decode_shape
    batch, nheads, nheads_kv, headdim = shape

    def part_and_step(n, dtype, seed, whole):
        """This rank's part of a cache of n tokens (room for the step's token), the step's q,
        k, v (the same on every rank), the whole cache if `whole` (drawn from one seed on
        every rank, else this rank's part drawn alone: the whole never exists)."""
        gen = torch.Generator().manual_seed(seed)
        draw = lambda *size: torch.randn(*size, generator=gen).to(getattr(torch, dtype))  # noqa
        q, k_new, v_new = draw(batch, 1, nheads, headdim), *(draw(batch, 1, nheads_kv, headdim)
                                                             for _ in range(2))
        t = n // world_size
        if whole:
            k, v = (draw(batch, n, nheads_kv, headdim) for _ in range(2))
            parts = [x[:, rank * t:(rank + 1) * t] for x in (k, v)]
        else:
            gen.manual_seed(seed + 1 + rank)
            parts, k, v = [draw(batch, t, nheads_kv, headdim) for _ in range(2)], None, None
        caches = [torch.cat([x, torch.zeros_like(x[:, :1])], 1) for x in parts]  # (B, t + 1, ..)
        return q, k_new, v_new, caches, t, k, v

    def step(q, k_new, v_new, caches, t):
        return parallel.attention_with_sharded_kvcache(
            q, *caches, k_new, v_new, t, causal=True, return_lse=True, backend=CPU_BACKEND)

    n = cfg.decode_exact_seqlen
    for dtype in cfg.exact_dtypes:
        q, k_new, v_new, caches, t, k, v = part_and_step(n, dtype, seed=4000, whole=True)
        o, lse = step(q, k_new, v_new, caches, t)
        if rank != 0:
            continue
        keys, values = (torch.cat([x, new], 1) for x, new in ((k, k_new), (v, v_new)))
        ref = longflash.attention_ref(*(x.double() for x in (q, keys, values)))
        lowp = longflash.attention_ref(q, keys, values, upcast=False)
        for name, x, low, r in zip(("o", "lse"), (o, lse), lowp, ref):
            err, err_lowp = ((y.double() - r).abs().max().item() for y in (x, low))
            bound = error_bound(err_lowp, r.abs().max().item(), q.dtype)
            rows += [_row(shape, dtype, "decode", "contiguous", world_size, t, "fwd", metric,
                          value, "abs", seqlen_q=1, seqlen_k=n)
                     for metric, value in ((f"max_err_{name}", err), (f"error_bound_{name}",
                                                                      bound))]
    sent, collectives = [0], {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def counted(name):
        def call(tensor, *args, **kwargs):
            tensors = tensor if isinstance(tensor, list) else [tensor]  # all_gather: the output
            sent[0] += sum(x.numel() * x.element_size() for x in tensors[:1])
            return collectives[name](tensor, *args, **kwargs)
        return call
    for n in cfg.decode_seqlens:
        inputs = part_and_step(n, cfg.dtype, seed=5000 + n, whole=False)[:5]
        sent[0] = 0
        with unittest.mock.patch.multiple(dist, **{name: counted(name) for name in collectives}):
            step(*inputs)  # also the warm-up
        if world_size == 1:
            sent[0] = 0  # a group of one: the calls send nothing
        cache_mb = sum(x.numel() * x.element_size() for x in inputs[3]) / MB
        (sent_kb, cache_mb) = _max_over_ranks(sent[0] / 1024, cache_mb)
        dist.barrier()
        med, p20, p80 = _max_over_ranks(*time_ms(lambda: step(*inputs), "cpu", warmup=0, rep=0))
        del inputs
        row = lambda *a, **kw: _row(shape, cfg.dtype, "decode", "contiguous",  # noqa: E731
                                    world_size, n // world_size, "fwd", *a, seqlen_q=1,
                                    seqlen_k=n, **kw)
        rows += [row("time_ms", med, "ms", p20=p20, p80=p80), row("cache_mb", cache_mb, "MiB"),
                 row("sent_kb", sent_kb, "KiB")]
    return rows if rank == 0 else []


def _long(rank, world_size, cfg):
    rows, start = [], time.perf_counter()
    shape, predicted = cfg.long_shape, 0.0
    # Warm-up on a few tokens: what is loaded once is not the first length's time or memory.
    ring_attention(*_inputs(shape, 8 * world_size, cfg.dtype, seed=0)[:3], causal=True,
                   backend=CPU_BACKEND)
    for seqlen in cfg.long_seqlens:
        (spent,) = _max_over_ranks(time.perf_counter() - start)  # the same on every rank
        if predicted > cfg.long_budget_s - spent:
            if rank == 0:
                log(f"long: not run from seqlen {seqlen}: predicted {predicted:.0f} s, "
                    f"{cfg.long_budget_s - spent:.0f} s of the budget left")
            break
        q, k, v, _ = _inputs(shape, seqlen, cfg.dtype, seed=seqlen)
        local = [shard_sequence(x, layout="zigzag") for x in (q, k, v)]
        box = {}

        def forward():
            dist.barrier()
            t0 = time.perf_counter()
            box["o"] = ring_attention(*local, causal=True, layout="zigzag", backend=CPU_BACKEND)
            dist.barrier()
            box["s"] = time.perf_counter() - t0
        peak, seconds = _max_over_ranks(_rank_peak_mb(forward), box["s"])
        o = unshard_sequence(box.pop("o"), layout="zigzag")
        predicted = 4 * seconds  # causal work grows as seqlen^2
        if rank != 0:
            continue
        err, bound = _sampled_error(q, k, v, o, cfg.long_check_rows)
        log(f"long: seqlen {seqlen} on {world_size} ranks: {seconds:.1f} s, peak {peak:.0f} MiB"
            f" per rank, max err {err:.2e} on {cfg.long_check_rows} rows (bound {bound:.2e})")
        row = lambda *a, **kw: _row(shape, cfg.dtype, "long", "zigzag", world_size,  # noqa
                                    seqlen // world_size, "fwd", *a, **kw)
        rows += [row("time_ms", seconds * 1e3, "ms"), row("peak_mem_mb", peak, "MiB"),
                 row("max_err_o_sampled", err, "abs"), row("error_bound_o_sampled", bound, "abs")]
    return rows


def _sampled_error(q, k, v, o, n_rows):
    """(max |o - ref64|, the tolerance rule's bound on it) over n_rows causal query rows spread
    over the sequence, the last among them (it attends to every key). Row i sees keys 0..i, so
    its reference is attention_ref on k[:, :i + 1], a 1 x (i + 1) score matrix, computed where
    the inputs are; the bound is longflash.reference.error_bound, from PyTorch's own error in
    q's dtype on the same rows."""
    err = err_lowp = ref_absmax = 0.0
    for i in torch.linspace(0, q.shape[1] - 1, n_rows).long().tolist():
        row = (q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1])
        ref = longflash.attention_ref(*(x.double() for x in row), causal=True)[0][:, 0]
        lowp = longflash.attention_ref(*row, causal=True, upcast=False)[0][:, 0]
        err = max(err, (o[:, i].double() - ref).abs().max().item())
        err_lowp = max(err_lowp, (lowp.double() - ref).abs().max().item())
        ref_absmax = max(ref_absmax, ref.abs().max().item())
        del ref, lowp
    return err, error_bound(err_lowp, ref_absmax, q.dtype)


def _ranks_worker(rank, world_size, cfg, parts):
    """Every part that runs on world_size ranks; rows from rank 0."""
    rows = []
    if "exactness" in parts and world_size in cfg.exact_ranks:
        rows += _exactness(rank, world_size, cfg)
    if {"memory", "weak"} & set(parts):
        rows += _memory_and_weak(rank, world_size, cfg, parts)
    if "window" in parts and world_size in cfg.window_ranks:
        rows += _window(rank, world_size, cfg)
    if "variants" in parts and world_size in cfg.variant_ranks:
        rows += _variants(rank, world_size, cfg)
    if "decode" in parts and world_size in cfg.decode_ranks:
        rows += _decode(rank, world_size, cfg)
    return rows


# ----------------------------------------------------------------------------- one device

def _single_device_memory(rank, world_size, cfg):
    """In a ring of one (measured as the ranks are): longflash.attention holding the whole
    sequence of each ring size of part memory on one device."""
    rows = []
    for ranks in cfg.memory_ranks:
        q, k, v, do = _inputs(cfg.shape, ranks * cfg.tokens_per_rank, cfg.dtype, seed=1)
        q, k, v = (x.requires_grad_() for x in (q, k, v))

        def fwd_bwd():
            o = longflash.attention(q, k, v, causal=cfg.causal, backend=CPU_BACKEND)
            torch.autograd.grad(o, (q, k, v), do)
        fwd_bwd()  # warm-up, as in the ranks
        rows.append(_row(cfg.shape, cfg.dtype, "memory", "none", ranks, cfg.tokens_per_rank,
                         "fwd_bwd", "peak_mem_mb", _rank_peak_mb(fwd_bwd), "MiB",
                         causal=cfg.causal))
    return rows


BLOCKS = {  # name -> (seqlen_q, seqlen_k, causal) in units of T = tokens per rank
    "local": (1, 1, True), "kv_half": (1, 0.5, False), "q_half": (0.5, 1, False),
    "full": (1, 1, False)}


def _blocks(cfg, device):
    """{name: (fwd_ms, bwd_ms)} of the BLOCKS on device, and their rows."""
    T, shape, dtype = cfg.block_tokens_per_rank, cfg.block_shape, cfg.block_dtype
    times, rows = {}, []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a CPU rank has one thread
    try:
        for name, (fq, fk, causal) in BLOCKS.items():
            nq, nk = int(fq * T), int(fk * T)
            q, k, v, do = _inputs(shape, nq, dtype, seed=2, device=device, seqlen_k=nk)
            scale = 1 / math.sqrt(shape[3])
            backend = "triton" if device == "cuda" else CPU_BACKEND
            args = (causal, scale, backend)
            o, lse = torch.ops.longflash.attention_forward(q, k, v, *args)
            fwd = lambda: torch.ops.longflash.attention_forward(q, k, v, *args)  # noqa: E731
            bwd = lambda: torch.ops.longflash.attention_backward(  # noqa: E731
                do, q, k, v, o, lse, None, *args)
            for mode, fn in (("fwd", fwd), ("bwd", bwd)):
                med, p20, p80 = time_ms(fn, device)
                times.setdefault(name, {})[mode] = med
                fl = flops(shape[0], nq, nk, shape[1], shape[3], causal, mode)
                row = lambda *a, **kw: _row(shape, dtype, "blocks", "none", 1, T, mode,  # noqa
                                            *a, seqlen_q=nq, seqlen_k=nk, causal=causal, **kw)
                rows += [row("time_ms", med, "ms", p20=p20, p80=p80),
                         row("tflops", tflops(fl, med), "TFLOP/s")]
    finally:
        torch.set_num_threads(threads)
    return times, rows


def _step_block(layout, causal, rank, src):
    """The BLOCKS entry that rank computes against the shard of src (None: skipped), as
    longflash.parallel plans it."""
    if not causal:
        return "full"
    if src == rank:
        return "local"
    if layout == "contiguous":
        return "full" if src < rank else None
    return "kv_half" if src < rank else "q_half"


def project(times, world_size, layout, causal, kv_bytes, dkv_bytes, link):
    """Forward+backward time (ms) of a ring of world_size ranks under the alpha-beta model of
    the docstring (part projection). times: {block: {"fwd": ms, "bwd": ms}}; kv_bytes: k and
    v of one shard in the input dtype; dkv_bytes: dk and dv of one shard in float32."""
    bandwidth_gbs, latency_us = LINKS[link]

    def transfer(nbytes):
        return latency_us * 1e-3 + nbytes / (bandwidth_gbs * 1e9) * 1e3 if nbytes else 0.0

    def compute(step, mode):  # lockstep: the slowest rank of the step
        blocks = (_step_block(layout, causal, r, (r - step) % world_size)
                  for r in range(world_size))
        return max(times[b][mode] if b else 0.0 for b in blocks)

    last = world_size - 1
    # Step s overlaps its compute with the transfers then in flight: k, v for step s + 1 and,
    # in the backward, dk, dv of step s - 1.
    total = sum(max(compute(s, "fwd"), transfer(kv_bytes if s < last else 0))
                for s in range(world_size))
    total += sum(max(compute(s, "bwd"),
                     transfer((kv_bytes if s < last else 0) + (dkv_bytes if s else 0)))
                 for s in range(world_size))
    return total + transfer(dkv_bytes if last else 0)  # the last dk, dv back to their owner


def _projection(cfg, times, device):
    batch, nheads, nheads_kv, headdim = cfg.block_shape
    T, rows = cfg.block_tokens_per_rank, []
    elements = 2 * batch * T * nheads_kv * headdim  # k and v of one shard
    kv_bytes = elements * torch.empty((), dtype=getattr(torch, cfg.block_dtype)).element_size()
    fl = lambda n: flops(batch, n, n, nheads, headdim, cfg.causal, "fwd_bwd")  # noqa: E731
    one_rank = fl(T) / (times["local"]["fwd"] + times["local"]["bwd"])  # FLOP per ms, no ring
    for layout in cfg.layouts:
        for ranks in cfg.projection_ranks:
            for link, (bandwidth, latency) in LINKS.items():
                ms = project(times, ranks, layout, cfg.causal, kv_bytes, elements * 4, link)
                for metric, value, unit in (
                        ("projected_time_ms", ms, "ms"),
                        ("projected_efficiency", fl(ranks * T) / ranks / ms / one_rank, "ratio")):
                    rows.append(_row(cfg.block_shape, cfg.block_dtype, "projection", layout,
                                     ranks, T, "fwd_bwd", metric, value, unit, causal=cfg.causal,
                                     basis="projected", link=link, link_bandwidth_gbs=bandwidth,
                                     link_latency_us=latency))
    return _on_device(rows, device)


def _weak_efficiency(tflops_rows):
    """flop_efficiency: TFLOP/s per rank over TFLOP/s of one rank (same layout)."""
    one_rank = {r["layout"]: r["value"] for r in tflops_rows if r["ranks"] == 1}
    return [dict(r, metric="flop_efficiency", value=r["value"] / one_rank[r["layout"]],
                 unit="ratio") for r in tflops_rows if r["layout"] in one_rank]


def _gpu_long(cfg, device="cuda"):
    """One GPU: longflash.attention forward+backward over gpu_long_seqlen tokens; its rows, or
    rows with status "oom" / "error" (value NaN) if it fails. At gpu_long_lean_seqlen tokens
    and more, one call takes seconds (1M tokens: ~4e15 FLOP), so it is measured leanly
    (measure.time_ms_lean: one warm-up call, then gpu_long_reps timed calls, the peak from
    those) instead of by time_ms (do_bench: 8 calls at this size) plus peak_memory_mb (one
    more). `device` other than "cuda": the same on CPU (tests)."""
    seqlen, shape = cfg.gpu_long_seqlen, cfg.gpu_long_shape
    dtype = "bfloat16" if device == "cuda" else "float32"
    row = lambda *a, **kw: _row(shape, dtype, "long", "none", 1, seqlen, "fwd_bwd",  # noqa
                                *a, **kw)
    q = k = v = do = None
    try:
        q, k, v, do = _inputs(shape, seqlen, dtype, seed=3, device=device)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        backend = "auto" if device == "cuda" else CPU_BACKEND
        fn = lambda: torch.autograd.grad(  # noqa: E731
            longflash.attention(q, k, v, causal=True, backend=backend), (q, k, v), do)
        if seqlen >= cfg.gpu_long_lean_seqlen:
            (med, p20, p80), peak = time_ms_lean(fn, device, reps=cfg.gpu_long_reps,
                                                 max_s=cfg.gpu_long_max_s)
            how = f"1 warm-up + at most {cfg.gpu_long_reps} timed calls"
        else:
            med, p20, p80 = time_ms(fn, device)
            peak = peak_memory_mb(fn, device)
            how = "time_ms + peak_memory_mb"
        fl = flops(shape[0], seqlen, seqlen, shape[1], shape[3], True, "fwd_bwd")
        log(f"long, one GPU, seqlen {seqlen}: {med:.0f} ms (p20 {p20:.0f}, p80 {p80:.0f}), "
            f"{tflops(fl, med):.0f} TFLOP/s, peak {peak:.0f} MiB ({how})")
        rows = [row("time_ms", med, "ms", p20=p20, p80=p80),
                row("tflops", tflops(fl, med), "TFLOP/s")]
        if math.isfinite(peak):
            rows.append(row("peak_mem_mb", peak, "MiB"))
        else:  # time_ms_lean off CUDA (tests): not measured
            rows.append(row("peak_mem_mb", math.nan, "MiB", status="unsupported"))
        rows += _gpu_long_exactness(cfg, q, k, v, backend, row)
        return rows
    except Exception as e:  # noqa: BLE001 - the rows record what happened
        status = "oom" if is_oom(e) else "error"
        log(f"long, one GPU, seqlen {seqlen}: {status}: {type(e).__name__}: {str(e)[-500:]}")
        return [row(m, math.nan, u, status=status)
                for m, u in (("time_ms", "ms"), ("tflops", "TFLOP/s"), ("peak_mem_mb", "MiB"))]
    finally:
        del q, k, v, do  # an OOM's memory goes back before the next part
        if device == "cuda":
            with contextlib.suppress(Exception):  # a broken context fails the next part, not this
                torch.cuda.empty_cache()



def _gpu_long_exactness(cfg, q, k, v, backend, row):
    """Is the one-GPU run exact? One more forward call (its output), then _sampled_error on
    long_check_rows rows: rows max_err_o_sampled and error_bound_o_sampled (mode fwd), or
    rows with status oom / error if the check fails (the timing rows stand)."""
    fwd = lambda *a, **kw: dict(row(*a, **kw), mode="fwd")  # noqa: E731
    try:
        with torch.no_grad():
            o = longflash.attention(q.detach(), k.detach(), v.detach(), causal=True,
                                    backend=backend)
            err, bound = _sampled_error(q.detach(), k.detach(), v.detach(), o,
                                        cfg.long_check_rows)
        log(f"long, one GPU: max err {err:.2e} on {cfg.long_check_rows} sampled rows "
            f"(bound {bound:.2e}: {'within' if err <= bound else 'BEYOND'})")
        return [fwd("max_err_o_sampled", err, "abs"), fwd("error_bound_o_sampled", bound, "abs")]
    except Exception as e:  # noqa: BLE001 - the rows record what happened
        status = "oom" if is_oom(e) else "error"
        log(f"long, one GPU, exactness check: {status}: {type(e).__name__}: {str(e)[-500:]}")
        return [fwd(m, math.nan, "abs", status=status)
                for m in ("max_err_o_sampled", "error_bound_o_sampled")]

# ----------------------------------------------------------------------------- main

log = Log()  # the raw log beside the results; set log.path in main


def _on_device(rows, device):
    """Rows measured on this machine's CPU name it as their device, even on a GPU machine."""
    if device != "cuda":
        for row in rows:
            row["device"] = cpu_name()
    return rows


def _failed(cfg, parts, world_size, error):
    """Rows with status oom / error for parts that failed on world_size ranks, one per part
    and layout, keyed as the part's own first metric is (exactness: max_err_o of mode fwd
    for each dtype), so that a later run that succeeds replaces them; column note holds the
    error (the failing rank's exception: the last line of its traceback)."""
    status = "oom" if is_oom(error) else "error"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    note = (lines[-1] if lines else type(error).__name__)[:300]
    rows = []
    for part in parts:
        dtypes, tokens, mode, metric = dict(  # the part's own rows, as written in the ranks
            exactness=(cfg.exact_dtypes, cfg.exact_tokens_per_rank, "fwd", "max_err_o"),
            memory=((cfg.dtype,), cfg.tokens_per_rank, "fwd_bwd", "peak_mem_mb"),
            weak=((cfg.dtype,), cfg.tokens_per_rank, "fwd_bwd", "time_ms"),
            window=((cfg.dtype,), cfg.window_tokens_per_rank, "fwd_bwd", "time_ms"),
            variants=(cfg.variant_dtypes, cfg.variant_tokens_per_rank, "fwd", "max_err_o"),
            decode=(cfg.exact_dtypes, cfg.decode_exact_seqlen // world_size, "fwd",
                    "max_err_o"),
            long=((cfg.dtype,), cfg.tokens_per_rank, "fwd_bwd", "time_ms"))[part]
        decode = dict(seqlen_q=1, seqlen_k=cfg.decode_exact_seqlen) if part == "decode" else {}
        rows += [_row(cfg.decode_shape if decode else cfg.shape, dtype, part, layout, world_size,
                      tokens, mode, metric, math.nan, "", causal=cfg.causal, status=status,
                      note=note, window_left=cfg.window_left if part == "window" else None,
                      variant=variant, **decode)
                 for dtype in dtypes
                 for layout in (("contiguous",) if part == "decode" else cfg.layouts)
                 for variant in (VARIANTS if part == "variants" else (None,))]
    return rows


def _write(rows, path):
    for r in rows:
        log(f"  {r['part']:<10} {r['provider']:<9} {r['layout']:<10} ranks {r['ranks']:>2}  "
            f"seqlen {r['seqlen_q']:>7} {r['dtype']:<8} {r['mode']:<7} {r['metric']:<20} "
            f"{r['value']:.4g} {r['unit']} {r['link'] or ''} {r['variant'] or ''} "
            f"[{r['status']}]")
    if rows:
        write_results(rows, path, key_columns=KEY_COLUMNS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Parts and metrics: see the module docstring.")
    parser.add_argument("--full", action="store_true", help="GPU machine sizes (FULL)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (QUICK)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--long-budget-s", type=float, help="seconds for part long "
                        f"(default {Config.long_budget_s:.0f}, {FULL['long_budget_s']:.0f} with "
                        "--full)")
    parser.add_argument("--long-seqlens", help="comma-separated sequence lengths for part long "
                        "(default: 64K doubling to 1M while the budget lasts)")
    parser.add_argument("--out", help="results CSV (default results/scaling/<device>.csv); "
                        "the log and config are written beside it")
    args = parser.parse_args()
    cfg = Config(**(FULL if args.full else QUICK if args.quick else {}))
    if args.long_budget_s is not None:
        cfg = replace(cfg, long_budget_s=args.long_budget_s)
    if args.long_seqlens:
        cfg = replace(cfg, long_seqlens=tuple(int(n) for n in args.long_seqlens.split(",")))
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if cfg.block_device == "cuda" and not torch.cuda.is_available():
        parser.error("--full times the blocks on a GPU, and there is none here")
    out, _ = start_run("scaling", args.out, log, dict(asdict(cfg), parts=parts),
                       f"scaling on {cpu_name()} ({usable_cores()} cores), torch "
                       f"{torch.__version__}, parts {parts}\n{cfg}")

    # The one-GPU run over gpu_long_seqlen tokens first, its rows written before anything else
    # runs: it is the headline of part long, and a step killed at its timeout later keeps it.
    if "long" in parts and cfg.gpu_long_seqlen and (cfg.gpu_long_device != "cuda"
                                                    or torch.cuda.is_available()):
        t0 = time.perf_counter()
        _write(_on_device(_gpu_long(cfg, cfg.gpu_long_device), cfg.gpu_long_device), out)
        log(f"long, one GPU: {time.perf_counter() - t0:.0f} s")

    world_sizes = sorted(set(cfg.exact_ranks if "exactness" in parts else ())
                         | set(cfg.memory_ranks if "memory" in parts else ())
                         | set(cfg.weak_ranks if "weak" in parts else ())
                         | set(cfg.window_ranks if "window" in parts else ())
                         | set(cfg.variant_ranks if "variants" in parts else ())
                         | set(cfg.decode_ranks if "decode" in parts else ()))
    tflops_rows = []  # weak scaling: flop_efficiency is relative to one rank
    for world_size in world_sizes:
        t0 = time.perf_counter()
        try:
            rows = spawn_ranks(world_size, _ranks_worker, cfg, parts)
        except Exception as e:  # noqa: BLE001 - recorded as status rows
            log(f"{world_size} ranks failed: {e}")
            rows = _failed(cfg, [p for p in parts if p in ("exactness", "memory", "weak",
                                                           "window", "variants", "decode")],
                           world_size, e)
        log(f"{world_size} ranks: {time.perf_counter() - t0:.0f} s (load average "
            f"{load_average()[0]:.1f} on {usable_cores()} cores)")
        _write(_on_device(rows, "cpu"), out)
        tflops_rows += [r for r in rows if r["part"] == "weak" and r["metric"] == "tflops"]
    _write(_weak_efficiency(tflops_rows), out)
    if "memory" in parts:
        _write(_on_device(spawn_ranks(1, _single_device_memory, cfg), "cpu"), out)
    if {"blocks", "projection"} & set(parts):
        times, rows = _blocks(cfg, cfg.block_device)
        _write(_on_device(rows, cfg.block_device) if "blocks" in parts else [], out)
        if "projection" in parts:
            _write(_projection(cfg, times, cfg.block_device), out)
    if "long" in parts:
        t0 = time.perf_counter()
        try:
            rows = spawn_ranks(cfg.long_ranks, _long, cfg)
        except Exception as e:  # noqa: BLE001
            log(f"long on {cfg.long_ranks} ranks failed: {e}")
            rows = _failed(replace(cfg, layouts=("zigzag",)), ["long"], cfg.long_ranks, e)
        log(f"long: {time.perf_counter() - t0:.0f} s")
        _write(_on_device(rows, "cpu"), out)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
