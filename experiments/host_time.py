"""Host time per call: what one attention call costs the CPU, beside SDPA's backends.

    python -m experiments.host_time            # results/host_time/<device>.csv
    python -m experiments.host_time --quick    # fewer calls (CI)

A call whose host work (Python, checks, autograd, the launcher) outlasts its GPU work leaves
the GPU waiting: RQ1's short shapes and every decoding step then time the host, and so does
a model's training step at small batch. In the H100's tuning sweep (results/tuning/h100.csv,
kernel "call", metric host_ms) a training forward took 0.39-0.91 ms of host time per call and
a backward 0.82-1.26 ms, as long as the forward's kernels at 1K-2K tokens (0.34-0.46 ms); its
profiles (the sweep's log) put about half of it in torch.library.custom_op's layers (PERFLOG
"The ops without custom_op's layers").

Each row is the wall time per call of CALLS calls issued back to back (the GPU runs behind:
far fewer launches than CUDA's queue holds), synchronized after the clock stops; the median
of REPEATS such runs, p20 / p80 over them. Shape SHAPE (bf16, non-causal): the GPU work of
a call is a few microseconds, so the host's time is what is left.

Rows: experiment "host_time", metric "host_us" (us per call), key columns beside
experiments.results.KEY_COLUMNS:
  kernels   "launched": the whole call on a CUDA GPU; providers longflash (Triton backend),
            sdpa_flash and sdpa_cudnn (scaled_dot_product_attention with the backend forced
            once, outside the calls; their native layout (batch, nheads, seqlen, headdim)).
            "stubbed": longflash only, on any machine: the calls above its kernels (the
            checks, the autograd.Function, the ops' dispatch, the options) with the
            implementation replaced by one that only allocates the outputs: the host time
            this package's own Python adds before Triton's launcher, on a CPU too.
            "stand-in": longflash's kernel launchers alone, on a CPU with Triton installed
            (not under TRITON_INTERPRET=1): flash_triton.forward (mode fwd) and backward
            (mode bwd) and a decoding step's decode_triton.forward (mode fwd, seqlen_q 1,
            DECODE: 32 query heads over 8 cache heads of 4,096 tokens), with Triton's driver a
            stand-in Hopper with 132 SMs (launches_elided): each kernel compiles for sm_90a
            on its first call (seconds), and then every call runs the whole launch path
            (flash_triton's lookup of the autotuner's choice, the JIT's argument binding and
            cache lookup) but the C launcher, a no-op. The autotuner, which would time candidates on a GPU, finds them
            equal and keeps the first. CPU tensors: no TMA candidate (no tensor descriptors
            made). Grad False.
  grad      the inputs require gradients (a training forward: autograd records it).
  "lists made", "lists kept": longflash only, on any machine: a block-sparse call's block
            lists (flash_triton._sparse_args, which makes them with _cached_block_lists) for a
            random block_mask per head of LISTS (16K tokens: 128 x 128 blocks of 128, 16
            heads), made afresh on every call (the kept ones dropped first) or found kept for
            the same mask; mode "fwd" the forward's lists, "bwd" the backward's two (the dQ
            kernel's and the transposed ones of dK/dV). On a GPU their launches, on a CPU
            their arithmetic.
mode "fwd" (grad False and True), "fwd_bwd" (grad True: the forward, then
torch.autograd.grad of o with a fixed dO into q, k and v), or "bwd" (stand-in and lists).
A stubbed call plus the stand-in launchers it calls approximates a GPU call's host time
less the C launcher's (a few microseconds per launch).
"""

import argparse
import contextlib
import os
import time
from dataclasses import dataclass
from itertools import product
from unittest import mock

import numpy as np
import torch

import longflash
from longflash import interface
from longflash._common import empty_outputs
from experiments.results import Log, default_out, start_run, write_results
from experiments.speedup import SDPA_BACKENDS, Unsupported, _sdpa_kernel

KEY_COLUMNS = ("kernels", "grad")  # beside experiments.results.KEY_COLUMNS
CALLS, REPEATS = 50, 7
QUICK_CALLS, QUICK_REPEATS = 10, 3


@dataclass(frozen=True)
class Shape:
    batch: int = 1
    seqlen: int = 128
    nheads: int = 16
    headdim: int = 128


SHAPE = Shape()
DECODE = Shape(batch=1, seqlen=4096, nheads=32, headdim=128)  # seqlen: the cache's tokens
DECODE_NHEADS_KV, STAND_IN_SMS = 8, 132
LISTS = Shape(batch=1, seqlen=16384, nheads=16, headdim=128)  # the block-sparse lists' shape
CALLS_MEASURED = (("fwd", False), ("fwd", True), ("fwd_bwd", True))  # (mode, grad)
log = Log()


class _Outputs:
    """An implementation that allocates its outputs and computes nothing (kernels "stubbed")."""

    @staticmethod
    def forward(q, k, v, opts):
        return empty_outputs(q, opts.varlen, v.shape[-1])

    @staticmethod
    def backward(do, q, k, v, o, lse, dlse, opts):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def make_call(provider, kernels, device):
    """(attn, layout): attn(q, k, v) -> o, its inputs in layout "bnhd" or "bhnd", and a
    context that the calls run in. Raises Unsupported."""
    if provider == "longflash":
        backend = "triton" if kernels == "launched" else "torch"
        context = (contextlib.nullcontext() if kernels == "launched" else
                   mock.patch.object(interface, "_implementation", lambda backend: _Outputs))
        return (lambda q, k, v: longflash.attention(q, k, v, backend=backend)), "bnhd", context
    if device != "cuda":
        raise Unsupported(f"{provider} is timed on a CUDA GPU only")
    attn = torch.nn.functional.scaled_dot_product_attention
    return attn, "bhnd", _sdpa_kernel(provider)()


@contextlib.contextmanager
def launches_elided():
    """Within the block, Triton's driver is a stand-in Hopper (experiments.codegen.StandInGPU)
    and a compiled kernel's launch does nothing: the kernels compile for sm_90a from CPU
    tensors, the autotuner finds its candidates equal (the first kept and cached, as a GPU's
    timing would cache its choice), decode_triton sees 132 SMs (the H100's split choice)."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.driver import driver

    from experiments.codegen import StandInGPU
    from longflash import decode_triton

    def no_launch(self):
        self.module = self.function = 0
        self._run = lambda *args, **kwargs: None

    previous = driver._active
    driver.set_active(StandInGPU(90))
    try:
        with mock.patch.object(CompiledKernel, "_init_handles", no_launch), \
                mock.patch.object(Autotuner, "_bench", lambda self, *a, **kw: [1.0, 1.0, 1.0]), \
                mock.patch.object(decode_triton, "_num_sms", lambda device: STAND_IN_SMS):
            yield
    finally:
        driver._active = previous


def stand_in_rows(dtype, calls, repeats):
    """kernels "stand-in": flash_triton.forward and backward at SHAPE, decode_triton.forward
    at DECODE, each compiled on its first call (launches_elided)."""
    from longflash import decode_triton, flash_triton
    from longflash._common import Options

    gen = torch.Generator().manual_seed(0)
    b, n, h, d = SHAPE.batch, SHAPE.seqlen, SHAPE.nheads, SHAPE.headdim
    q, k, v, do = (torch.randn(b, n, h, d, generator=gen, dtype=dtype) for _ in range(4))
    opts = interface._options(q, False, d ** -0.5, -1, -1, None, 0.0, 0.0, None, None, None, 0,
                              0)
    o, lse = empty_outputs(q, False, d)
    qd = torch.randn(DECODE.batch, 1, DECODE.nheads, DECODE.headdim, generator=gen, dtype=dtype)
    cache = [torch.randn(DECODE.batch, DECODE.seqlen, DECODE_NHEADS_KV, DECODE.headdim,
                         generator=gen, dtype=dtype) for _ in range(2)]
    decode_opts = Options(DECODE.headdim ** -0.5, -1, -1, None, 0.0)
    measured = (
        ("fwd", SHAPE, 0, lambda: flash_triton.forward(q, k, v, opts)),
        ("bwd", SHAPE, 0, lambda: flash_triton.backward(do, q, k, v, o, lse, None, opts)),
        ("fwd", DECODE, DECODE_NHEADS_KV, lambda: decode_triton.forward(
            qd, *cache, DECODE.seqlen, None, decode_opts, 0, DECODE.seqlen)))
    rows = []
    with launches_elided():
        for mode, shape, nheads_kv, call in measured:
            decoding = shape is DECODE
            row = dict(experiment="host_time", provider="longflash", mode=mode,
                       dtype=str(dtype).split(".")[-1], batch=shape.batch,
                       seqlen_q=1 if decoding else shape.seqlen, seqlen_k=shape.seqlen,
                       nheads=shape.nheads, nheads_kv=nheads_kv or shape.nheads,
                       headdim=shape.headdim, causal=False, metric="host_us", unit="us",
                       kernels="stand-in", grad=False)
            rows.append(_measure(row, call, "cpu", calls, repeats))
    return rows


def lists_rows(device, calls, repeats):
    """kernels "lists made" and "lists kept": the block lists of a block-sparse call at
    LISTS, made on every call or kept from the first."""
    from longflash import flash_triton
    from longflash._common import BLOCK_SPARSE_UNIT, Options

    blocks = -(-LISTS.seqlen // BLOCK_SPARSE_UNIT)
    gen = torch.Generator(device=device).manual_seed(0)
    mask = torch.rand(1, LISTS.nheads, blocks, blocks, generator=gen, device=device) < 0.25
    opts = Options(LISTS.headdim ** -0.5, -1, -1, None, 0.0)._replace(block_mask=mask)

    def lists(mode):
        args = [flash_triton._sparse_args(opts, LISTS.batch, LISTS.nheads)]
        if mode == "bwd":
            args.append(flash_triton._sparse_args(opts, LISTS.batch, LISTS.nheads, True))
        return args

    def made(mode):
        def call():
            for key in [k for k in flash_triton._LISTS if k[0] == id(mask)]:
                del flash_triton._LISTS[key]
            return lists(mode)
        return call

    rows = []
    for kernels, mode in product(("lists made", "lists kept"), ("fwd", "bwd")):
        row = dict(experiment="host_time", provider="longflash", mode=mode, dtype="bool",
                   batch=LISTS.batch, seqlen_q=LISTS.seqlen, seqlen_k=LISTS.seqlen,
                   nheads=LISTS.nheads, nheads_kv=LISTS.nheads, headdim=LISTS.headdim,
                   causal=False, metric="host_us", unit="us", kernels=kernels, grad=False)
        call = made(mode) if kernels == "lists made" else (lambda mode=mode: lists(mode))
        rows.append(_measure(row, call, device, calls, repeats))
    return rows


def _measure(row, call, device, calls, repeats):
    """row with host_us's median, p20 and p80 of call, or status "error"."""
    name = f"{row['provider']} {row['kernels']} {row['mode']} grad={row['grad']}"
    try:
        med, p20, p80 = host_us(call, device, calls, repeats)
    except Exception as exc:  # noqa: BLE001 - a row, not a crash
        log(f"{name}: error {type(exc).__name__}: {str(exc)[:300]}")
        return dict(row, value=float("nan"), status="error")
    log(f"{name:40s} seqlen_q {row['seqlen_q']:5d} {med:8.1f} us (p20 {p20:.1f}, p80 "
        f"{p80:.1f})")
    return dict(row, value=med, p20=p20, p80=p80, status="ok")


def host_us(call, device, calls, repeats, warm=10):
    """(median, p20, p80) of the wall us per call of `calls` calls issued back to back, over
    `repeats` runs, after `warm` calls (autotuning, compiles, the allocator); the GPU is
    synchronized after each run's clock stops. One place for the tuning sweep's host_ms too."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warm):
        call()
    sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return tuple(float(x) for x in np.quantile(runs, (0.5, 0.2, 0.8)))


def host_profile(fn, calls, top=12):
    """The host's time per call by function (cProfile over `calls` calls, the top `top` by own
    time): where host_us (or the tuning sweep's host_ms) goes. For the log."""
    import cProfile
    import io
    import pstats
    fn()
    with cProfile.Profile() as prof:
        for _ in range(calls):
            fn()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())


def rows_of(provider, kernels, device, dtype, calls, repeats, shape=SHAPE, profile=0):
    """The rows of one provider: each (mode, grad) of CALLS_MEASURED; with profile, each call's
    cProfile (its top `profile` functions by own time) to the log after its row."""
    base = dict(experiment="host_time", provider=provider, dtype=str(dtype).split(".")[-1],
                batch=shape.batch, seqlen_q=shape.seqlen, seqlen_k=shape.seqlen,
                nheads=shape.nheads, nheads_kv=shape.nheads, headdim=shape.headdim,
                causal=False, metric="host_us", unit="us", kernels=kernels)
    try:
        attn, layout, context = make_call(provider, kernels, device)
    except Unsupported as exc:
        log(f"{provider} {kernels}: unsupported ({exc})")
        return [dict(base, mode=m, grad=g, value=float("nan"), status="unsupported")
                for m, g in CALLS_MEASURED]
    gen = torch.Generator(device=device).manual_seed(0)
    dims = (shape.batch, shape.seqlen, shape.nheads, shape.headdim)
    if layout == "bhnd":
        dims = (dims[0], dims[2], dims[1], dims[3])
    rows = []
    with context:
        for mode, grad in CALLS_MEASURED:
            q, k, v, do = (torch.randn(dims, generator=gen, device=device, dtype=dtype)
                           for _ in range(4))
            for x in (q, k, v):
                x.requires_grad_(grad)
            if mode == "fwd":
                call = lambda: attn(q, k, v)  # noqa: E731
            else:
                call = lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do)  # noqa: E731
            rows.append(_measure(dict(base, mode=mode, grad=grad), call, device, calls,
                                 repeats))
            if profile:
                log(f"host profile, {provider} {kernels} {mode} grad={grad}, {calls} calls:\n"
                    + host_profile(call, calls, top=profile))
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_CALLS} calls x {QUICK_REPEATS} runs (CI)")
    parser.add_argument("--no-stand-in", dest="stand_in", action="store_false",
                        help="without a GPU, no stand-in rows (they compile kernels for "
                        "sm_90a first: about a minute)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="also log each LongFlash call's cProfile (stubbed, and launched on a "
                        "GPU: its TOP functions by own time): where its host time goes")
    parser.add_argument("--out", default=None,
                        help="CSV (default results/host_time/<device>.csv)")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    calls, repeats = (QUICK_CALLS, QUICK_REPEATS) if args.quick else (CALLS, REPEATS)
    dtype = torch.bfloat16
    out, command = start_run("host_time", args.out or default_out("host_time"), log,
                             dict(shape=SHAPE.__dict__, calls=calls, repeats=repeats,
                                  device=device, dtype=str(dtype)),
                             f"{calls} calls x {repeats} runs on {device}")
    providers = [("longflash", "stubbed")]
    if device == "cuda":
        providers += [("longflash", "launched")] + [(p, "launched") for p in SDPA_BACKENDS
                                                    if p in ("sdpa_flash", "sdpa_cudnn")]
    rows = []
    for provider, kernels in providers:
        profile = args.profile if provider == "longflash" else 0
        rows += rows_of(provider, kernels, device, dtype, calls, repeats, profile=profile)
    rows += lists_rows(device, calls, repeats)
    if device == "cpu" and args.stand_in:
        if os.environ.get("TRITON_INTERPRET") == "1":
            log("stand-in: not under TRITON_INTERPRET=1 (the kernels would be interpreted)")
        else:
            rows += stand_in_rows(dtype, calls, repeats)
    write_results(rows, out, command, key_columns=KEY_COLUMNS)
    log(f"{len(rows)} rows -> {out}")


if __name__ == "__main__":
    main()
