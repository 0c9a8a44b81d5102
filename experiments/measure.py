"""The one timing function and the one memory function that every experiment uses.

    t, p20, p80 = time_ms(lambda: attention(q, k, v), q.device)    # milliseconds
    (t1, ...), (t2, ...) = time_ms_interleaved([f1, f2], device)  # peers, CPU round robin
    mem = peak_memory_mb(lambda: attention(q, k, v), q.device)      # MiB above the start
    (t, p20, p80), mem = time_ms_lean(fn, device, reps=3)  # calls of seconds: 1 + 3 calls
    t, p20, p80 = time_ms_graph(fn)      # CUDA: replays of fn captured in a CUDA graph
    try: ... except Exception as e: status = "oom" if is_oom(e) else "error"
    errs = relative_errors(q, k, v, do, causal)   # o, dq, dk, dv against float64 (a GPU check)

Build the inputs outside fn: only the call itself is timed (and, on CPU, only what fn
allocates counts as its memory).
"""

import json
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np
import torch

# Relative error (Frobenius norm) of a bf16 kernel that a working tile stays far below (about
# 4e-3 on the H100); a broken one (an unwritten or misread tile) is off by order 1.
RELATIVE_ERROR_LIMIT = 3e-2

MB = 2**20  # peak_mem_mb is in MiB, like torch.cuda.max_memory_allocated() / 2**20


def time_ms(fn, device, warmup=25, rep=100, quantiles=(0.5, 0.2, 0.8)):
    """Time fn() in milliseconds: one value per quantile, by default (median, p20, p80).

    CUDA: `triton.testing.do_bench` (CUDA events, L2 flushed between runs) with warmup / rep
    in ms; keyword arguments only, since the positional order changed across Triton 3.x.
    Other devices: wall clock (time.perf_counter) per call, after warm-up calls for at least
    `warmup` ms (at least one), over at least `rep` ms and at least 5 calls.
    """
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench
        out = do_bench(fn, warmup=warmup, rep=rep, quantiles=list(quantiles))
        return tuple(float(x) for x in (out if isinstance(out, (list, tuple)) else [out]))
    return time_ms_interleaved([fn], device, warmup, rep, quantiles)[0]


def time_ms_interleaved(fns, device, warmup=25, rep=100, quantiles=(0.5, 0.2, 0.8)):
    """time_ms of several functions measured together, one quantile tuple per function.

    CUDA: time_ms of each in turn (do_bench isolates each run). Other devices: every function
    warmed up first, then called in turn, round robin, over at least rep ms per function and
    at least 5 calls each, so that a drift of the machine's speed (clock, other load, the
    first calls of a process) falls on all of them alike, not on whichever ran first.
    """
    if torch.device(device).type == "cuda":
        return [time_ms(fn, device, warmup, rep, quantiles) for fn in fns]
    for fn in fns:
        start = time.perf_counter()
        fn()
        while (time.perf_counter() - start) * 1e3 < warmup:
            fn()
    times = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < 5 or (time.perf_counter() - start) * 1e3 < rep * len(fns):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            t.append((time.perf_counter() - t0) * 1e3)
    return [tuple(float(x) for x in np.quantile(t, quantiles)) for t in times]


def time_ms_graph(fn, warmup=3, reps=50, quantiles=(0.5, 0.2, 0.8), flush_mb=256):
    """CUDA only: fn captured once in a CUDA graph, then `reps` replays, each timed with CUDA
    events after an L2 flush (a flush_mb memset, outside the events, as do_bench does).

    What it leaves out is the host's work per call: Python, argument checks and kernel launches
    are replaced by one graph launch, as in a serving loop that replays a captured decoding
    step. For calls whose GPU work lasts microseconds (a decoding step over a short cache),
    time_ms can measure the host instead. fn must be capturable: no host synchronization and
    nothing read back (capture raises otherwise). `warmup` calls run first on a side stream
    (compilation, autotuning, lazy allocations), as torch.cuda.graphs asks.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(flush_mb * MB, dtype=torch.int8, device="cuda")
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(reps)]
    graph.replay()  # the first replay uploads the graph
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = [start.elapsed_time(end) for start, end in events]
    del graph, flush
    return tuple(float(x) for x in np.quantile(times, quantiles))


def time_ms_lean(fn, device, reps=3, quantiles=(0.5, 0.2, 0.8), max_s=None):
    """For calls that take seconds each (1M-token attention): ((quantiles), peak MiB) from
    1 + reps calls, where time_ms (do_bench: 1 + 5 estimating + warm-up + timed calls) and a
    separate peak_memory_mb would make 9 or more.

    One untimed warm-up call (it compiles and autotunes), then `reps` timed calls, each
    synchronized on its own: the quantiles are over those reps values (np.quantile, linear
    interpolation: with 2 or 3 values p20 / p80 lie between them). No L2 flush: meant for
    working sets far beyond L2. max_s: no further timed call once the timed calls took this
    many seconds together (at least one is made), for a time budget.
    CUDA: CUDA events around each call; the peak is max_memory_allocated() - memory_allocated()
    around each timed call (the caching allocator's tensors, as in peak_memory_mb), the largest
    over the timed calls, so the autotuner's buffers in the warm-up do not count.
    Other devices: time.perf_counter per call; the peak is NaN (not measured: use
    peak_memory_mb, which runs fn once more in a forked child).
    """
    reps = max(1, int(reps))
    fn()  # warm-up
    times, peak = [], math.nan
    if torch.device(device).type == "cuda":
        peak = 0.0
        for _ in range(reps):
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
            peak = max(peak, (torch.cuda.max_memory_allocated(device) - before) / MB)
            if max_s is not None and sum(times) >= max_s * 1e3:
                break
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if max_s is not None and sum(times) >= max_s * 1e3:
                break
    return tuple(float(x) for x in np.quantile(times, quantiles)), peak


def _proc_status_kb(field):
    """A 'VmRSS' / 'VmHWM' line of /proc/self/status, in kB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_growth_kb(fn):
    """How far fn raises this process's resident set above where it started (kB). Meant for
    a process of its own (peak_memory_mb's forked child, a spawned rank): it resets the
    process's high-water mark and runs single-threaded."""
    # libgomp's thread pool does not survive fork(): an OpenMP region in the child can hang
    # forever if the parent used one. Single-threaded ops never enter one.
    torch.set_num_threads(1)
    try:
        # Linux >= 4.0: "5" resets this process's high-water mark (VmHWM) to its current RSS.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the baseline is the inherited high-water mark (see peak_memory_mb)
    before = max(_proc_status_kb("VmHWM"), _proc_status_kb("VmRSS"))
    fn()
    return _proc_status_kb("VmHWM") - before


def _limit_address_space(limit_mb):
    import resource
    cap = _proc_status_kb("VmSize") * 1024 + int(limit_mb * MB)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def peak_memory_mb(fn, device, limit_mb=None):
    """Peak extra memory (MiB) while fn() runs, above what was in use when it was called.

    limit_mb (CPU only): a memory budget enforced on fn. The child's address space is capped
    (RLIMIT_AS) at its size before fn plus limit_mb, so an allocation beyond the budget fails
    inside fn with PyTorch's "can't allocate memory" (is_oom() is True) instead of waking the
    kernel's OOM killer. Address space counts reserved as well as touched pages, so the cap
    is conservative: fn is refused at most limit_mb of new mappings.

    CUDA: max_memory_allocated() - memory_allocated() around fn, from the caching allocator
    (tensors only; the allocator's reserve and the CUDA context are not counted).

    CPU (Linux): fn runs in a forked child (so the parent's own high-water mark is untouched),
    which reports the growth of its resident set: VmHWM after fn minus RSS before, with the
    high-water mark first reset through /proc/self/clear_refs. Notes:
    - getrusage's ru_maxrss is not used: it carries the high-water mark of the parent across
      fork and exec, so a child of a big process (pytest, a notebook) would under-report.
    - if the reset is not permitted (kernel < 4.0, some sandboxes) the child's high-water mark
      starts at what it inherited, and the result is the growth above that: exact only when
      fn's peak exceeds it. Then measure in a fresh subprocess.
    - the child runs single-threaded (see rss_growth_kb), so per-thread buffers are missing,
      and code pages first touched by fn count as its memory (a few MiB at most).
    - if the child raises, RuntimeError with its traceback (is_oom() sees "can't allocate
      memory" in it); if it is killed (SIGKILL: the kernel's OOM killer), RuntimeError saying
      "out of memory". Under limit_mb, oneDNN (PyTorch's CPU linear, GELU, ... kernels)
      reports a failed allocation only as "could not create a primitive": that is read as
      the budget exceeded (it happens, now and then, on the probe just above the largest
      that fits), and the message says so.
    Other operating systems: NaN.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / MB
    if not sys.platform.startswith("linux"):
        return float("nan")

    sys.stdout.flush()
    sys.stderr.flush()  # or buffered text would be written twice, once by each process
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns that fork() of a multi-threaded process may deadlock: the
        # OpenMP case is handled in the child, and the child runs nothing else.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: never returns into the caller's code
        try:
            os.close(read_fd)
            try:
                if limit_mb is not None:
                    _limit_address_space(limit_mb)
                msg = ["ok", rss_growth_kb(fn)]
            except BaseException as e:
                msg = ["error", traceback.format_exc()]
                if limit_mb is not None and "could not create a primitive" in str(e):
                    msg[1] = (f"can't allocate memory within the budget of {limit_mb} MiB: "
                              f"oneDNN says only that it could not create a primitive, which "
                              f"under the address-space cap is its failed allocation\n" + msg[1])
            with os.fdopen(write_fd, "w") as f:
                f.write(json.dumps(msg))
        finally:
            os._exit(0)

    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        data = f.read()  # until the child closes its end, so a large message cannot block it
    _, wait_status = os.waitpid(pid, 0)
    if not data:
        if os.WIFSIGNALED(wait_status) and os.WTERMSIG(wait_status) == 9:
            raise RuntimeError("peak_memory_mb: the child was killed by SIGKILL, which on Linux "
                               "means out of memory (the kernel's OOM killer)")
        raise RuntimeError(f"peak_memory_mb: the child died without a result ({wait_status=})")
    kind, payload = json.loads(data)
    if kind == "error":
        raise RuntimeError(f"peak_memory_mb: fn raised in the measuring child:\n{payload}")
    return payload * 1024 / MB


def is_oom(exc):
    """True if exc means out of memory (record status "oom"), False for any other failure.

    torch.OutOfMemoryError / torch.cuda.OutOfMemoryError, any MemoryError (Python raises it
    with an empty message), and RuntimeErrors saying "out of memory" (CUDA) or "can't
    allocate memory" (PyTorch's CPU allocator).
    """
    oom_types = tuple(t for t in (getattr(torch, "OutOfMemoryError", None),
                                  getattr(torch.cuda, "OutOfMemoryError", None)) if t)
    if isinstance(exc, oom_types + (MemoryError,)):
        return True
    message = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in message
                                              or "can't allocate memory" in message)


def relative_errors(q, k, v, do, causal, grads=True):
    """||x - ref|| / ||ref|| of longflash.attention's o, dq, dk, dv (o alone unless grads) on
    the Triton backend, the reference (longflash.attention_ref) in float64 on the inputs'
    device: the GPU campaign's check of a forced kernel candidate (compare with
    RELATIVE_ERROR_LIMIT; NaN is an error)."""
    import longflash
    x = [t.detach().clone().requires_grad_(grads) for t in (q, k, v)]
    x64 = [t.detach().double().requires_grad_(grads) for t in (q, k, v)]
    o = longflash.attention(*x, causal=causal, backend="triton")
    o64, _ = longflash.attention_ref(*x64, causal=causal)
    grads, grads64 = ((torch.autograd.grad(o, x, do), torch.autograd.grad(o64, x64, do.double()))
                      if grads else ((), ()))
    return [float((a.detach().double() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))
            for a, b in zip((o, *grads), (o64, *grads64))]
