"""RQ1, speedup and memory: LongFlash against the attention users already have.

    python -m experiments.speedup                 # CPU default (below): about 15 min, 1 core
    python -m experiments.speedup --full          # the GPU sweep (FULL), H100 / H200
    python -m experiments.speedup --quick --out /tmp/s.csv   # tiny shapes, seconds (tests)
    python -m experiments.speedup --full --headdims 256 --resume   # a slice; rows merge by key
    python -m experiments.speedup --parts decode  # part decode alone (experiments/decode.py)

Every provider available on the machine is measured in the same process and run, on the
same inputs (random normal, never zeros), each in its own layout, built outside the
measured call:
  longflash       longflash.attention: the Triton kernels on a GPU (backend "triton"), the
                  blockwise PyTorch path on a CPU (backend "torch").
  standard        the materializing reference, longflash.attention_ref in the input dtype
                  (upcast=False): scores, mask, probabilities and log-sum-exp are N x N.
  sdpa_math, sdpa_flash (FlashAttention-2), sdpa_efficient, sdpa_cudnn
                  torch.nn.functional.scaled_dot_product_attention with one backend forced
                  by torch.nn.attention.sdpa_kernel.                        (GPU)
  flex            torch.compile(flex_attention), with a causal BlockMask when causal (built
                  by a compiled create_block_mask above 16K tokens). (GPU)
  sdpa_cpu        scaled_dot_product_attention on CPU tensors, PyTorch's own choice of
                  kernel (its fused CPU flash kernel for these inputs).      (CPU)
A provider that this torch, this device or this shape does not offer is a row with status
"unsupported" (for example: no sdpa_kernel, "No viable backend", a Triton kernel out of
shared memory); out of memory is "oom"; anything else "error" (its message is in the log).
The same holds for a failure while a provider is built (make_attention: for example flex's
block mask out of memory): each of its modes is then a row with that status, not run.

Sweep (as in the FlashAttention papers). Part "batch": tokens per batch fixed (batch =
tokens_per_batch // seqlen), hidden size fixed (nheads = hidden // headdim). Part "long":
batch 1 (nheads = long_hidden // headdim), longer sequences, for the providers that fit.
Each (seqlen, headdim, causal) is one group; modes run in the order fwd, fwd_bwd, bwd.
  CPU (default): float32, one torch thread; batch part 4096 tokens, hidden 128, seqlen
      512..4096, headdim 64 and 128, causal and not, all three modes; long part: seqlen 8K,
      16K, 32K, one head of headdim 64, causal, modes fwd and fwd_bwd. Peak memory under a
      budget of --cpu-mem-budget-mb (default 8000 MiB), so that standard attention at long
      sequences becomes an "oom" row, measured, instead of a crash. One thread because the
      machine this was sized for has two cores shared with other work: with two threads,
      an OpenMP thread waiting for a descheduled partner made times vary tenfold; and the
      memory child runs single-threaded anyway (experiments.measure).
  GPU (--full): bfloat16; batch part 16K tokens, hidden 2048, seqlen 512..16K, headdim 64,
      128, 256, causal and not, all modes; long part: seqlen 32K, 64K, 128K, hidden 2048 at
      headdim 128 (16 heads), causal, all modes. Groups run headdim 128 first (batch, then
      long), then 64, then 256; results are written after every group, so a run stopped by
      its budget (--budget-s; none by default: the GPU campaign passes each window's) keeps
      what it measured, and --resume skips what the file already holds (but rows with status
      error, which it measures again). Its pieces in the GPU campaign's windows took about 12
      minutes of an H100 in all (results/gpu_campaign/h100-stage*.csv, steps speedup*).

Part "prefill" (experiments/prefill.py): a chunk of new queries attending to a paged KV cache
(chunked prefill), LongFlash's forward reading the pages in place in the run's dtype and in
float8, and over float8 pages gathered into a dequantized copy first. It runs after part
decode.

Part "shared_prefix" (experiments/shared_prefix.py): a decoding step of a batch that shares a
prefix, LongFlash's cascade call (the prefix read once for the batch) against the same step
over caches that each hold a copy of the prefix (LongFlash and SDPA). It runs after part
prefill.

Part "mla" (experiments/mla_decode.py): a decoding step of DeepSeek-V3's multi-head latent
attention in its absorbed form, LongFlash's call with qv (the latents read once for both
products) against the attention of [q, qv] over concatenated caches (LongFlash and SDPA). It
runs after part shared_prefix.

Part "sparse" (experiments/block_sparse.py): block-sparse attention (block_mask, blocks of 128
x 128) at several fractions of blocks kept, LongFlash's kernels (which skip the hidden blocks)
against FlexAttention's with the same blocks (GPU) and SDPA and standard attention with the
blocks made an elementwise mask. It runs after part mla.

Part "sparse_decode" (experiments/sparse_decode.py): a decoding step over part decode's shape
that reads only the key blocks each KV head selects (block_mask), at several fractions of
blocks kept, against the same call with the blocks as an elementwise attn_mask, SDPA with
that mask and (GPU) FlexAttention with the blocks. It runs last.

Part "decode" (experiments/decode.py has its providers and rows): one generation step over a
KV cache of 1K..32K tokens (GPU: ..128K), batch 1 and 8, 32 query heads over 8 KV heads, head
dim 128: time and the cache bytes read per second, LongFlash's split-KV kernel with and
without splitting against SDPA's backends and FlexAttention. It runs after parts batch and
long, before parts prefill and shared_prefix and the closing ceilings.

Modes: fwd = the forward pass of training (inputs require grad, so the graph is built);
bwd = the backward pass alone, torch.autograd.grad of an output computed beforehand
(retain_graph), as FlashAttention's benchmarks time it; fwd_bwd = both. Compiled flex is
compiled and measured with AOTAutograd's donated buffers off in every mode (a backward that
donates them refuses retain_graph; see _compile_config). A mode whose
prerequisite failed (fwd_bwd after fwd, bwd after fwd_bwd) takes its status without running.

Rows (results/speedup/<device>.csv, device "cpu" or the GPU's, e.g. "h100"; experiment
"speedup"; extra columns: part ("batch", "long", "ceiling"), load_avg_1m (the machine's
1-minute load average when the group started), cores (CPU cores this process may use),
threads and mem_budget_mb (CPU: torch threads, the memory budget in MiB; empty on GPU),
size (ceilings only)):
  time_ms (ms)        median with p20/p80 (experiments.measure.time_ms: do_bench on CUDA,
                      which flushes L2 between calls; wall clock on CPU).
  tflops (TFLOP/s)    experiments.results.flops(...) / time, FlashAttention's convention
                      (forward 4*B*H*N^2*D, causal halved, backward 2.5x); p20/p80 from the
                      p80/p20 times.
  peak_mem_mb (MiB)   peak memory above what was allocated when the measured call started
                      (the inputs; for bwd also the forward's output and saved tensors):
                      experiments.measure.peak_memory_mb, on CPU in a forked child capped at
                      the memory budget (an over-budget call fails there: "oom"), then timed.
  ceilings, provider "ceiling", mode "fwd", measured at the start and at the end of the
  run; a row keeps the better of the two medians (on a shared machine one of them can be
  disturbed; both are in the log), and with --resume the better of those and the file's row
  (one ceiling serves the rows of all the runs a resumed file holds), unless the resumed run
  measured no row of a part reported against the ceilings (batch, long, decode): then the
  file's ceilings stay as they are (those of the runs that measured its rows):
    matmul_tflops     a square matmul in the run's dtype (seqlen_q = seqlen_k = headdim = n).
    copy_gbps         a device-to-device copy of one tensor, bytes read + written per second
                      (seqlen_q = seqlen_k = elements).
  The notebook reports each provider as a fraction of them: tflops / matmul_tflops, and
  (minimal bytes / time) / copy_gbps, where the minimal bytes are the tensors a kernel must
  read and write once (fwd q, k, v, o; bwd q, k, v, o, do, dq, dk, dv; fwd_bwd both; lse
  not counted).
The log (<out>.log) has every row, every failure's message, the load average at the start,
after each group and at the end; <out>.json the resolved configuration.
"""

import argparse
import contextlib
import ctypes
import importlib
import math
import os
import re
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    # Autotuning results cached on disk (Triton >= 3.3; read when the kernels are defined),
    # so that a resumed run (--resume) does not tune the same shapes again.
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import longflash  # noqa: E402
from experiments.measure import is_oom, peak_memory_mb, time_ms  # noqa: E402
from experiments.results import (Log, check_resume_after, cpu_name, flops,  # noqa: E402
                                 load_average, measured_before, same_switches, start_run,
                                 tflops, usable_cores, write_results)

GPU_PROVIDERS = ("longflash", "standard", "sdpa_math", "sdpa_flash", "sdpa_efficient",
                 "sdpa_cudnn", "flex")
CPU_PROVIDERS = ("longflash", "sdpa_cpu", "standard")
SDPA_BACKENDS = {"sdpa_math": "MATH", "sdpa_flash": "FLASH_ATTENTION",
                 "sdpa_efficient": "EFFICIENT_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}
MODE_ORDER = ("fwd", "fwd_bwd", "bwd")              # each mode's prerequisite comes first
CEILING_PARTS = ("batch", "long", "decode")       # the parts the notebook reports against them
# Messages of a peer that cannot run a configuration (not a bug of this script).
UNSUPPORTED = ("no viable backend", "no available kernel", "outofresources", "out of resource",
               "no valid triton configs", "does not support")


@dataclass
class Config:
    dtype: str = "float32"
    providers: tuple = CPU_PROVIDERS
    tokens_per_batch: int = 4096          # part batch: batch = tokens_per_batch // seqlen
    hidden: int = 128                     # part batch: nheads = hidden // headdim
    seqlens: tuple = (512, 1024, 2048, 4096)
    headdims: tuple = (64, 128)           # also the order in which groups run
    causals: tuple = (False, True)
    modes: tuple = ("fwd", "bwd", "fwd_bwd")
    long_seqlens: tuple = (8192, 16384, 32768)   # part long: batch 1
    long_hidden: int = 64                 # part long: nheads = long_hidden // headdim
    long_headdims: tuple = (64,)
    long_causals: tuple = (True,)
    long_modes: tuple = ("fwd", "fwd_bwd")
    warmup_ms: float = 25                 # time_ms: warm-up, then at least rep_ms and 5 calls
    rep_ms: float = 200
    long_warmup_ms: float = 0             # part long on CPU: 1 + 5 calls (seconds each)
    long_rep_ms: float = 0
    cpu_mem_budget_mb: float = 8000       # CPU: peak memory is measured under this cap
    threads: int = 1                      # CPU: torch threads (0: torch's default)
    ceiling_matmul_n: int = 2048          # matmul_tflops: n x n @ n x n
    ceiling_copy_mb: int = 256            # copy_gbps: one tensor of this size
    ceiling_rep_ms: float = 1000          # time_ms's rep for each ceiling
    budget_s: float = 0                   # > 0: start no group after this many seconds
    parts: tuple = ("batch", "long", "decode", "prefill", "shared_prefix", "mla", "sparse",
                    "sparse_decode")
    decode_seqlens: tuple = (1024, 2048, 4096, 8192, 16384, 32768)   # part decode: cache tokens
    decode_batches: tuple = (1, 8)
    decode_nheads: int = 32               # part decode: a Llama-like GQA shape
    decode_nheads_kv: int = 8
    decode_headdim: int = 128
    prefill_seqlens: tuple = (1024, 4096)   # part prefill: keys per sequence (cache + chunk)
    prefill_chunks: tuple = (64, 256)       # part prefill: the chunk's queries per sequence
    prefill_batch: int = 2
    prefill_nheads: int = 8
    prefill_nheads_kv: int = 2
    prefill_headdim: int = 64
    prefill_page_size: int = 16
    shared_batches: tuple = (4,)            # part shared_prefix: sequences sharing the prefix
    shared_prefixes: tuple = (4096, 16384)  # part shared_prefix: the shared prefix's tokens
    shared_suffix_len: int = 256            # part shared_prefix: each sequence's own tokens
    mla_seqlens: tuple = (1024, 8192)       # part mla: cache tokens
    mla_batches: tuple = (4,)
    mla_nheads: int = 16                    # part mla: DeepSeek-V3 under 8-way tensor parallelism
    mla_rope_dim: int = 64                  # q and k: the rotary part
    mla_latent_dim: int = 512               # v_cache and qv: the compressed latent
    sparse_seqlens: tuple = (4096,)         # part sparse: tokens (batch 1, non-causal)
    sparse_densities: tuple = (1.0, 0.5, 0.25, 0.125)  # fractions of blocks kept (1: dense)
    sparse_nheads: int = 4
    sparse_headdim: int = 64
    sparse_decode_seqlens: tuple = (16384,)  # part sparse_decode: cache tokens (decode_* heads)
    sparse_decode_batches: tuple = (1,)
    sparse_decode_densities: tuple = (1.0, 0.5, 0.25, 0.125, 0.0625)  # blocks kept (1: dense)


FULL = dict(  # the GPU sweep of the issue; see the module docstring
    dtype="bfloat16", providers=GPU_PROVIDERS, tokens_per_batch=16384, hidden=2048,
    seqlens=(512, 1024, 2048, 4096, 8192, 16384), headdims=(128, 64, 256),
    long_seqlens=(32768, 65536, 131072), long_hidden=2048, long_headdims=(128,),
    long_causals=(True,), long_modes=("fwd", "bwd", "fwd_bwd"), warmup_ms=10, rep_ms=50,
    long_warmup_ms=10, long_rep_ms=50, ceiling_matmul_n=8192, ceiling_copy_mb=1024,
    ceiling_rep_ms=200,
    decode_seqlens=(1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072),
    prefill_seqlens=(4096, 16384, 65536), prefill_chunks=(128, 512, 2048), prefill_batch=4,
    prefill_nheads=32, prefill_nheads_kv=8, prefill_headdim=128,
    shared_batches=(8, 32), shared_prefixes=(4096, 32768), shared_suffix_len=512,
    mla_seqlens=(4096, 32768), mla_batches=(1, 16), sparse_seqlens=(16384, 65536),
    sparse_densities=(1.0, 0.5, 0.25, 0.125, 0.0625), sparse_nheads=16, sparse_headdim=128,
    sparse_decode_seqlens=(32768, 131072), sparse_decode_batches=(1, 8))
QUICK = dict(  # tiny shapes: proves the pipeline end to end (tests), timings meaningless
    tokens_per_batch=512, hidden=32, seqlens=(128, 256), headdims=(16,),
    long_seqlens=(512, 2048), long_hidden=32, long_headdims=(16,), warmup_ms=0, rep_ms=0,
    ceiling_matmul_n=256, ceiling_copy_mb=16, ceiling_rep_ms=50, decode_seqlens=(256, 1024),
    decode_batches=(1, 2), decode_nheads=4, decode_nheads_kv=2, decode_headdim=16,
    prefill_seqlens=(256,), prefill_chunks=(32,), prefill_nheads=4, prefill_nheads_kv=2,
    prefill_headdim=16, shared_batches=(2,), shared_prefixes=(256,), shared_suffix_len=32,
    mla_seqlens=(256,), mla_batches=(2,), mla_nheads=4, mla_rope_dim=16, mla_latent_dim=48,
    sparse_seqlens=(384,), sparse_densities=(1.0, 0.5), sparse_nheads=2, sparse_headdim=16,
    sparse_decode_seqlens=(640,), sparse_decode_densities=(1.0, 0.5))


class Unsupported(Exception):
    """This provider does not exist on this device or in this torch."""


# ----------------------------------------------------------------------------- providers

def _sdpa_kernel(provider):
    """torch.nn.attention.sdpa_kernel(backend) for a forced SDPA backend (torch >= 2.3)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        raise Unsupported(f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel") from e
    backend = getattr(SDPBackend, SDPA_BACKENDS[provider], None)
    if backend is None:
        raise Unsupported(f"torch {torch.__version__} has no SDPBackend.{SDPA_BACKENDS[provider]}")
    return lambda: sdpa_kernel(backend)


def sdpa(provider, **kwargs):
    """attn(q, k, v): scaled_dot_product_attention(q, k, v, **kwargs) on the backend that
    `provider` forces (sdpa_cpu: PyTorch's own choice). Raises Unsupported."""
    forced = _sdpa_kernel(provider) if provider in SDPA_BACKENDS else contextlib.nullcontext

    def attn(q, k, v):
        with forced():
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return attn


_FLEX = {}


def compiled_flex(device, dynamic=False):
    """torch.compile(flex_attention) (torch >= 2.5), one per process and `dynamic`."""
    if device != "cuda":
        raise Unsupported("flex: compiled FlexAttention is measured on GPUs only (its backward "
                          "does not run on CPU)")
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        raise Unsupported(f"torch {torch.__version__} has no FlexAttention") from e
    if dynamic not in _FLEX:
        # Every (shape, mask) compiles anew; the default limit of 8 would silently fall back
        # to eager flex_attention, which is not what is meant to be measured.
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 512))
        _FLEX[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _FLEX[dynamic]


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# Eager create_block_mask materializes the Q x KV boolean mask and several copies of it (10.6
# GiB of peak memory at 32K tokens on a CPU, torch 2.13): fine up to the batch part's 16K
# tokens, out of memory at 128K. Above this many mask elements it is compiled instead
# (torch.compile(create_block_mask), which recent torch recommends over its deprecated
# _compile=True and which _compile=True calls), fusing the mask into the block reductions:
# nothing Q x KV is stored (32K tokens on a CPU: no growth above the process's 0.5 GiB), at a
# few seconds of compilation per sequence length.
EAGER_BLOCK_MASK_MAX = 2**28


def causal_block_mask(seqlen, device):
    """FlexAttention's causal BlockMask over seqlen x seqlen (eager below
    EAGER_BLOCK_MASK_MAX elements, compiled above; eager again if compiling fails for a reason
    other than memory)."""
    from torch.nn.attention.flex_attention import create_block_mask
    if seqlen * seqlen > EAGER_BLOCK_MASK_MAX:
        if "block_mask" not in _FLEX:
            _FLEX["block_mask"] = torch.compile(create_block_mask)
        try:
            return _FLEX["block_mask"](_causal_mask_mod, None, None, seqlen, seqlen,
                                       device=device)
        except Exception as e:  # noqa: BLE001 - the eager way may still fit
            if is_oom(e):
                raise
            log(f"flex: compiled create_block_mask failed at N={seqlen} ({_summary(e)}); "
                "building the mask eagerly")
    return create_block_mask(_causal_mask_mod, None, None, seqlen, seqlen, device=device)


def _flex(seqlen, causal, device):
    """Compiled flex_attention and the BlockMask of this group (None: full)."""
    flex = compiled_flex(device)
    mask = None
    if causal:  # seqlen_q == seqlen_k here, so top-left and bottom-right alignment agree
        mask = causal_block_mask(seqlen, device)
    return lambda q, k, v: flex(q, k, v, block_mask=mask)


def make_attention(provider, device, causal, seqlen):
    """(attn, layout): attn(q, k, v) -> o, with q, k, v in layout "bnhd" (batch, seqlen, nheads,
    headdim) or "bhnd" (batch, nheads, seqlen, headdim). Raises Unsupported."""
    on_gpu = device == "cuda"
    if provider == "longflash":
        backend = "triton" if on_gpu else "torch"
        return (lambda q, k, v: longflash.attention(q, k, v, causal=causal, backend=backend),
                "bnhd")
    if provider == "standard":
        return (lambda q, k, v: longflash.attention_ref(q, k, v, causal=causal,
                                                        upcast=False)[0], "bnhd")
    if provider == "sdpa_cpu" and on_gpu:
        raise Unsupported("sdpa_cpu is PyTorch's SDPA on CPU tensors")
    if provider == "sdpa_cpu" or provider in SDPA_BACKENDS:
        return sdpa(provider, is_causal=causal), "bhnd"
    if provider == "flex":
        return _flex(seqlen, causal, device), "bhnd"
    raise ValueError(f"unknown provider {provider!r}")


# ----------------------------------------------------------------------------- measuring

def _release_free_memory():
    """glibc keeps freed small blocks resident; a forked child would reuse them without its
    resident set growing. malloc_trim(0) returns them, so each measurement starts clean."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status(exc, provider):
    """ok / oom / unsupported / error of a failed call (see the module docstring)."""
    if is_oom(exc):
        return "oom"
    message = str(exc).lower()
    if isinstance(exc, Unsupported) or (
            provider != "longflash" and any(s in message for s in UNSUPPORTED)):
        return "unsupported"
    return "error"


def _summary(exc):
    """One line for the log: the last line of the message (a forked child's traceback ends
    with the child's exception)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if not re.match(r"^[\w.]+(Error|Exception)\b", last):
        last = f"{type(exc).__name__}: {last}"
    return last[:300]


def _build(provider, device, causal, seqlen):
    """((attn, layout), None), or ((None, None), (status, message)) when building the
    provider (make_attention) failed: every mode of it then becomes a row with that status,
    not run. Any exception counts, not only Unsupported (FlexAttention's block mask can run
    out of memory while it is built), with the status rules of a failed call (_status)."""
    failure = None
    try:
        return make_attention(provider, device, causal, seqlen), None
    except Exception as e:  # noqa: BLE001 - rows with their status, not a crash
        failure = (_status(e, provider), str(e) if isinstance(e, Unsupported) else
                   f"building {provider} failed: {_summary(e)}")
    # Here the exception and its frames are gone: only now can the cache be emptied.
    if device == "cuda":
        torch.cuda.empty_cache()
    return (None, None), failure


# Providers whose backward AOTAutograd compiles (torch.compile). See _compile_config.
COMPILED_PROVIDERS = ("flex",)


def _compile_config(provider):
    """The configuration under which a compiled provider is measured (a context manager).

    Mode bwd times torch.autograd.grad(o, ..., retain_graph=True) on one forward's graph for
    every provider (FlashAttention's benchmarks do the same), so that the forward is not in
    the timed call. AOTAutograd compiles a backward that by default donates the buffers of
    the tensors saved for it (reuses their memory for its outputs), and such a backward
    refuses retain_graph=True ("compiled with non-empty donated buffers"): once fwd_bwd had
    compiled flex's backward, every flex bwd row on the H100 (torch 2.11) was an error. So
    compiled providers are compiled, and measured in every mode, with
    torch._functorch.config.donated_buffer off (the patch is entered once per measurement,
    not in the timed call). Donation is a memory saving: the backward would reuse the saved
    intermediates that are neither inputs nor outputs (for flex essentially its log-sum-exp,
    B x H x N float32), so a fwd_bwd peak of flex may be higher by about that much."""
    try:
        import torch._functorch.config as functorch_config
    except ImportError:
        return contextlib.nullcontext()
    if provider not in COMPILED_PROVIDERS or not hasattr(functorch_config, "donated_buffer"):
        return contextlib.nullcontext()
    return functorch_config.patch(donated_buffer=False)


def _mode_fn(attn, q, k, v, do, mode):
    """The measured call of a mode. bwd: the forward runs here, once, outside the call."""
    if mode == "fwd":
        return lambda: attn(q, k, v)
    if mode == "fwd_bwd":
        return lambda: torch.autograd.grad(attn(q, k, v), (q, k, v), do)
    o = attn(q, k, v)
    return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)


def measure(attn, inputs, mode, device, cfg, long_part, provider, fwd_bwd_fits=False):
    """(status, peak_mb, (median, p20, p80) ms, message) of one provider and mode.

    On CPU every call runs first in a child under the memory budget and only then, once it
    is known to fit, in this process (timing). The forward of bwd runs in this process
    before any measurement, so unless fwd_bwd is known to fit, that is checked first."""
    q, k, v, do = inputs
    warmup, rep = ((cfg.long_warmup_ms, cfg.long_rep_ms) if long_part
                   else (cfg.warmup_ms, cfg.rep_ms))
    peak, times, failure = math.nan, (math.nan,) * 3, None
    try:
        with _compile_config(provider):  # where a compiled provider compiles: see there
            if device == "cpu" and mode == "bwd" and not fwd_bwd_fits:
                peak_memory_mb(_mode_fn(attn, q, k, v, do, "fwd_bwd"), device,
                               limit_mb=cfg.cpu_mem_budget_mb)
            fn = _mode_fn(attn, q, k, v, do, mode)
            if device == "cuda":
                fn()  # warm-up before the memory measurement: compilation, autotuning
                peak = peak_memory_mb(fn, device)
            else:
                _release_free_memory()
                peak = peak_memory_mb(fn, device, limit_mb=cfg.cpu_mem_budget_mb)
            times = time_ms(fn, device, warmup=warmup, rep=rep)
    except Exception as e:  # noqa: BLE001 - a row with its status, not a crash
        failure = (_status(e, provider), _summary(e))
    # Here the exception and its frames (which hold a failed call's tensors) are gone, and
    # fn (the forward of bwd) is dropped on return: only then can the cache be emptied.
    fn = None
    if failure and device == "cuda":
        torch.cuda.empty_cache()
    if failure:
        return failure[0], peak, (math.nan,) * 3, failure[1]
    return "ok", peak, times, ""


def ceilings(cfg, device):
    """Rows of the machine's ceilings in this run: matmul_tflops and copy_gbps."""
    dtype = getattr(torch, cfg.dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    n = cfg.ceiling_matmul_n
    a, b = (torch.randn(n, n, device=device, dtype=dtype, generator=gen) for _ in range(2))
    mm = time_ms(lambda: a @ b, device, warmup=cfg.warmup_ms, rep=cfg.ceiling_rep_ms)
    elements = cfg.ceiling_copy_mb * 2**20 // torch.empty((), dtype=dtype).element_size()
    x = torch.randn(elements, device=device, dtype=dtype, generator=gen)
    y = torch.empty_like(x)
    cp = time_ms(lambda: y.copy_(x), device, warmup=cfg.warmup_ms, rep=cfg.ceiling_rep_ms)
    moved = 2 * x.numel() * x.element_size()  # read + write
    base = dict(experiment="speedup", provider="ceiling", mode="fwd", dtype=cfg.dtype, batch=1,
                nheads=1, nheads_kv=1, causal=False, status="ok", part="ceiling")
    flop = 2.0 * n**3
    return [
        dict(base, seqlen_q=n, seqlen_k=n, headdim=n, metric="matmul_tflops",
             value=tflops(flop, mm[0]), unit="TFLOP/s", p20=tflops(flop, mm[2]),
             p80=tflops(flop, mm[1]), size=f"{n}x{n}x{n}"),
        dict(base, seqlen_q=elements, seqlen_k=elements, headdim=1, metric="copy_gbps",
             value=gbps(moved, cp[0]), unit="GB/s", p20=gbps(moved, cp[2]),
             p80=gbps(moved, cp[1]), size=f"{cfg.ceiling_copy_mb} MiB"),
    ]


def gbps(nbytes, ms):
    """GB/s (1e9 bytes per second) of nbytes moved in ms milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- sweep

def groups(cfg):
    """(part, seqlen, headdim, causal) in run order: per headdim, part batch then part long."""
    out = []
    for headdim in cfg.headdims:
        out += [("batch", n, headdim, c) for n in cfg.seqlens for c in cfg.causals]
        if headdim in cfg.long_headdims:
            out += [("long", n, headdim, c) for n in cfg.long_seqlens for c in cfg.long_causals]
    out += [("long", n, d, c) for d in cfg.long_headdims if d not in cfg.headdims
            for n in cfg.long_seqlens for c in cfg.long_causals]
    return out


def _inputs(batch, seqlen, nheads, headdim, dtype, device, seed):
    """q, k, v, do in both layouts: {"bnhd": [...], "bhnd": [...]}, leaves that require grad
    (do does not). Random normal: never time on zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bnhd = [torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype,
                        generator=gen) for _ in range(4)]
    bhnd = [x.transpose(1, 2).contiguous() for x in bnhd]  # (B, H, N, D)
    return {layout: [x.requires_grad_(i < 3) for i, x in enumerate(xs)]
            for layout, xs in (("bnhd", bnhd), ("bhnd", bhnd))}


def _warm_up(device):
    """Load what each provider loads on its first call (code, thread pools), on a few tokens,
    so that it is not counted as the first measurement's memory or time."""
    x = torch.randn(1, 64, 1, 16, device=device, requires_grad=True)
    longflash.attention(x, x, x, backend="torch").sum().backward()
    longflash.attention_ref(x, x, x, upcast=False)[0].sum().backward()
    y = x.detach().transpose(1, 2).contiguous().requires_grad_()
    F.scaled_dot_product_attention(y, y, y, is_causal=True).sum().backward()


log = Log()  # the raw log beside the results; set log.path in main


def _existing_keys(path, after=None):
    """(done, failed): keys of the time_ms rows already in path (for --resume), those with
    status error apart. A failure of the harness or a kernel is measured again (once fixed),
    an oom or an unsupported configuration is not. after (an ISO time): rows measured before
    it count as never measured (a kernel changed since), and so do rows measured under other
    kernel switches (LONGFLASH_WS=fwd: other candidates; results.same_switches)."""
    if not os.path.exists(path):
        return set(), set()
    import pandas as pd
    df = pd.read_csv(path)
    df = df[(df["metric"] == "time_ms") & same_switches(df) & df["part"].isin(("batch", "long"))]
    if after:
        df = df[~measured_before(df, after)]
    cols = ["provider", "mode", "dtype", "batch", "seqlen_q", "nheads", "headdim", "causal"]
    keys = lambda d: {tuple(str(x) for x in row)  # noqa: E731
                      for row in d[cols].itertuples(index=False)}
    return keys(df[df["status"] != "error"]), keys(df[df["status"] == "error"])


def _group_shape(cfg, part, seqlen, headdim):
    """(batch, nheads, modes) of a group: cfg.tokens_per_batch tokens per batch and
    cfg.hidden = nheads x headdim (part batch), or batch 1 and cfg.long_hidden (part long)."""
    long_part = part == "long"
    batch = 1 if long_part else max(1, cfg.tokens_per_batch // seqlen)
    nheads = max(1, (cfg.long_hidden if long_part else cfg.hidden) // headdim)
    modes = [m for m in MODE_ORDER if m in (cfg.long_modes if long_part else cfg.modes)]
    return batch, nheads, modes


def _key(cfg, provider, mode, batch, seqlen, nheads, headdim, causal):
    """A time_ms row's key, as _existing_keys reads it back."""
    return tuple(str(x) for x in (provider, mode, cfg.dtype, batch, seqlen, nheads, headdim,
                                  causal))


def _never_measured_first(cfg, plan, measured):
    """The plan with the groups that hold a configuration never measured (no row at all)
    first, in their order, then the others (their error rows measured again): a budget
    that runs out then leaves retries unmade, not new results (the first H100 window's 72
    flex bwd errors would otherwise come before d64's causal 16K, the last group)."""
    def unmeasured(group):
        part, seqlen, headdim, causal = group
        batch, nheads, modes = _group_shape(cfg, part, seqlen, headdim)
        return any(_key(cfg, p, m, batch, seqlen, nheads, headdim, causal) not in measured
                   for p in cfg.providers for m in modes)
    return sorted(plan, key=lambda g: not unmeasured(g))  # stable


def run(cfg, device, out, resume=False, resume_after=None):
    dtype = getattr(torch, cfg.dtype)
    start = time.perf_counter()
    if device == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    threads = torch.get_num_threads()
    log(f"load average at start: {load_average()} on {usable_cores()} cores, "
        f"torch threads {threads}")
    _warm_up("cpu")
    # The conditions of the run, in every row: the notebook reads nothing but the CSV.
    machine = dict(cores=usable_cores(),
                   threads=threads if device == "cpu" else math.nan,
                   mem_budget_mb=cfg.cpu_mem_budget_mb if device == "cpu" else math.nan)
    ceiling_rows = measure_ceilings(cfg, device, machine, "start")
    # A run that measures no row reported against the ceilings (resumed, or of parts such as
    # prefill or mla only) leaves the file's alone: they belong to the runs that measured its
    # rows.
    ceilings_pending = (resume or not set(cfg.parts) & set(CEILING_PARTS)) and \
        _file_has_ceilings(out)
    if resume:
        ceiling_rows = _best_ceilings(ceiling_rows, out)
    if not ceilings_pending:
        write_results(ceiling_rows, out)

    def write_measured(rows, part, **kwargs):
        nonlocal ceilings_pending
        if ceilings_pending and part in CEILING_PARTS:
            write_results(ceiling_rows, out)
            ceilings_pending = False
        write_results(rows, out, **kwargs)

    done, failed = _existing_keys(out, resume_after) if resume else (set(), set())

    plan = [g for g in groups(cfg) if g[0] in cfg.parts]
    if resume:
        plan = _never_measured_first(cfg, plan, done | failed)
    total = sum(len(cfg.providers) * len(cfg.long_modes if p == "long" else cfg.modes)
                for p, *_ in plan)
    count = 0
    for g, (part, seqlen, headdim, causal) in enumerate(plan):
        elapsed = time.perf_counter() - start
        if cfg.budget_s and elapsed > cfg.budget_s:
            log(f"budget of {cfg.budget_s:.0f} s spent after {elapsed:.0f} s: not run: "
                + ", ".join(f"{p} N={n} D={d} {'causal' if c else 'full'}"
                            for p, n, d, c in plan[g:]))
            break
        long_part = part == "long"
        batch, nheads, modes = _group_shape(cfg, part, seqlen, headdim)
        load = load_average()[0]
        base = dict(experiment="speedup", dtype=cfg.dtype, batch=batch, seqlen_q=seqlen,
                    seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads, headdim=headdim,
                    causal=causal, part=part, load_avg_1m=load, **machine)
        inputs = _inputs(batch, seqlen, nheads, headdim, dtype, device, seed=seqlen + headdim)
        rows = []
        for provider in cfg.providers:
            keys = {mode: _key(cfg, provider, mode, batch, seqlen, nheads, headdim, causal)
                    for mode in modes}
            if all(key in done for key in keys.values()):  # --resume: nothing to build
                count += len(modes)
                continue
            fwd_bwd_fits = False
            # inherited: the status a failed mode passes on to the modes that need it
            (attn, layout), inherited = _build(provider, device, causal, seqlen)
            for mode in modes:
                count += 1
                if keys[mode] in done:
                    continue
                if inherited:
                    status, peak, times, message = inherited[0], math.nan, (math.nan,) * 3, \
                        f"not run: {inherited[1]}"
                else:
                    status, peak, times, message = measure(attn, inputs[layout], mode, device,
                                                           cfg, long_part, provider, fwd_bwd_fits)
                    fwd_bwd_fits |= mode == "fwd_bwd" and status == "ok"
                    if status != "ok":
                        inherited = (status, f"{mode} was {status}")
                new = _rows(base, provider, mode, status, peak, times)
                rows += new
                log(f"[{count:4d}/{total}] {time.perf_counter() - start:6.0f} s  {part:5} "
                    f"B={batch:<3d} N={seqlen:<6d} H={nheads:<3d} D={headdim:<3d} "
                    f"{'causal' if causal else 'full  '} {provider:<14} {mode:<7} "
                    f"{times[0]:10.3f} ms {new[2]['value']:8.3f} TFLOP/s {peak:9.1f} MiB  "
                    f"[{status}]" + (f"  {message}" if message else ""))
            attn = None
        del inputs
        if device == "cuda":
            torch.cuda.empty_cache()
        if rows:
            write_measured(rows, part)
        log(f"group {g + 1}/{len(plan)} done at {time.perf_counter() - start:.0f} s, "
            f"load average {load_average()[0]:.2f}")
    # the parts with a module of their own, in this order (each imports this module's
    # providers and failure rules: imported here, on use)
    for part, name in STEP_PARTS.items():
        if part in cfg.parts:
            module = importlib.import_module(f"experiments.{name}")
            rows = module.run(cfg, device, log, machine, start,
                              module.existing_keys(out, resume_after) if resume else set())
            if rows:
                write_measured(rows, part, key_columns=module.KEY_COLUMNS)
    end = measure_ceilings(cfg, device, machine, "end")
    if ceilings_pending:
        log(f"ceilings of {out} kept: this run measured no rows of "
            f"{', '.join(CEILING_PARTS)}, which are reported against them")
    else:
        write_results([max(a, b, key=lambda r: r["value"]) for a, b in zip(ceiling_rows, end)],
                      out)
    log(f"load average at end: {load_average()}; {time.perf_counter() - start:.0f} s in all")


# part -> its module in experiments/ (run, existing_keys, KEY_COLUMNS), in the order run()
# runs them after parts batch and long
STEP_PARTS = {"decode": "decode", "prefill": "prefill", "shared_prefix": "shared_prefix",
              "mla": "mla_decode", "sparse": "block_sparse", "sparse_decode": "sparse_decode"}


def _file_has_ceilings(path):
    if not os.path.exists(path):
        return False
    import pandas as pd
    df = pd.read_csv(path, usecols=["provider", "status"])
    return bool(((df["provider"] == "ceiling") & (df["status"] == "ok")).any())


def _best_ceilings(rows, path):
    """rows, each replaced by path's ceiling row of the same metric, dtype and size where that
    one is higher. A resumed file holds the rows of several runs and one ceiling serves them
    all: the best any of its runs measured (on the H100 the matmul ceiling's median varied from
    691 to 776 TFLOP/s between the runs of one campaign; a low one flatters every fraction)."""
    if not os.path.exists(path):
        return rows
    import pandas as pd
    df = pd.read_csv(path)
    df = df[(df["provider"] == "ceiling") & (df["status"] == "ok")]
    best = []
    for r in rows:
        same = df[(df["metric"] == r["metric"]) & (df["dtype"] == r["dtype"])
                  & (df["seqlen_q"] == r["seqlen_q"])]
        if len(same) and same["value"].max() > r["value"]:
            earlier = same.loc[same["value"].idxmax()]
            log(f"ceiling kept from an earlier run in {path}: {r['metric']} "
                f"{earlier['value']:.4g} (this run {r['value']:.4g})")
            r = dict(r, **{k: earlier[k] for k in r if k in earlier.index})
        best.append(r)
    return best


def measure_ceilings(cfg, device, machine, when):
    rows = ceilings(cfg, device)
    for r in rows:
        r.update(machine, load_avg_1m=load_average()[0])
        log(f"ceiling at the {when}: {r['metric']} {r['value']:.4g} {r['unit']} "
            f"(p20 {r['p20']:.4g}, p80 {r['p80']:.4g}; {r['size']}, {cfg.dtype})")
    return rows


def _rows(base, provider, mode, status, peak, times):
    """The three metric rows of one provider and mode (NaN values unless status is ok)."""
    med, p20, p80 = times
    ok = status == "ok"
    fl = flops(base["batch"], base["seqlen_q"], base["seqlen_k"], base["nheads"],
               base["headdim"], base["causal"], mode)
    nan = math.nan
    t = (lambda x: tflops(fl, x)) if ok else (lambda x: nan)
    row = dict(base, provider=provider, mode=mode, status=status)
    # Memory measured before a failure in timing keeps its value; none where it cannot be
    # measured (peak_memory_mb gives NaN on CPUs of other operating systems).
    peak_status = "ok" if math.isfinite(peak) else status if status != "ok" else "unsupported"
    return [
        dict(row, metric="peak_mem_mb", value=peak, unit="MiB", p20=nan, p80=nan,
             status=peak_status),
        dict(row, metric="time_ms", value=med, unit="ms", p20=p20, p80=p80),
        dict(row, metric="tflops", value=t(med), unit="TFLOP/s", p20=t(p80), p80=t(p20)),
    ]


def summary(out, device):
    """Short tables, last: median fwd_bwd time and peak memory per provider and seqlen (causal,
    the first head dim), and part decode's time per step per provider and cache length."""
    import pandas as pd
    rows = pd.read_csv(out)
    rows = rows[rows["experiment"] == "speedup"]
    df = rows[(rows["mode"] == "fwd_bwd") & (rows["causal"])]
    if not df.empty:
        d = df["headdim"].iloc[0]
        df = df[df["headdim"] == d]
        for metric in ("time_ms", "peak_mem_mb"):
            table = df[df["metric"] == metric].pivot_table(
                index="provider", columns="seqlen_q", values="value", aggfunc="first")
            log(f"\n{metric}, causal, forward+backward, headdim {d} ({device}):\n"
                f"{table.round(1).to_string()}")
    if "num_splits" in rows:
        dec = rows[(rows["part"] == "decode") & (rows["metric"] == "time_ms")]
        kv = dec["kv_dtype"] if "kv_dtype" in dec else pd.Series(math.nan, index=dec.index)
        dec = dec.assign(provider=dec["provider"] + dec["num_splits"].map(
            lambda n: "" if pd.isna(n) else " (no split)" if n == 1 else " (split-KV)")
            + kv.map(lambda c: "" if pd.isna(c) else f", {c}"))
        table = dec.pivot_table(index=["batch", "provider"], columns="seqlen_k", values="value",
                                aggfunc="first")
        log(f"\ntime_ms per decoding step, by cache length ({device}):\n"
            f"{table.round(2).to_string()}")
    if (rows["part"] == "prefill").any():
        pre = rows[(rows["part"] == "prefill") & (rows["metric"] == "time_ms")]
        pre = pre.assign(cache=pre["kv_dtype"].fillna(pre["dtype"]) + " " + pre["route"])
        table = pre.pivot_table(index="cache", columns=["seqlen_k", "seqlen_q"], values="value",
                                aggfunc="first")
        log(f"\ntime_ms per prefill chunk, by keys and chunk length ({device}):\n"
            f"{table.round(2).to_string()}")
    for part, columns, what in (
            ("shared_prefix", ["batch", "prefix_len"],
             "decoding step over a shared prefix, by batch and prefix length"),
            ("mla", ["batch", "seqlen_k"],
             "MLA decoding step, absorbed and concatenated, by batch and cache length")):
        if (rows["part"] == part).any():  # one row a provider and route
            r = rows[(rows["part"] == part) & (rows["metric"] == "time_ms")]
            table = r.assign(call=r["provider"] + " " + r["route"]).pivot_table(
                index="call", columns=columns, values="value", aggfunc="first")
            log(f"\ntime_ms per {what} ({device}):\n{table.round(2).to_string()}")
    if (rows["part"] == "sparse").any():
        r = rows[(rows["part"] == "sparse") & (rows["metric"] == "time_ms")]
        table = r.assign(call=r["provider"] + " " + r["mode"]).pivot_table(
            index=["seqlen_q", "call"], columns="density", values="value", aggfunc="first")
        log(f"\ntime_ms of block-sparse attention, by fraction of blocks kept ({device}):\n"
            f"{table.round(2).to_string()}")
    if (rows["part"] == "sparse_decode").any():
        r = rows[(rows["part"] == "sparse_decode") & (rows["metric"] == "time_ms")]
        table = r.assign(call=r["provider"] + " " + r["route"]).pivot_table(
            index=["batch", "seqlen_k", "mask_heads", "call"], columns="density",
            values="value", aggfunc="first")
        log(f"\ntime_ms per block-sparse decoding step, by fraction of blocks kept "
            f"({device}):\n{table.round(2).to_string()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Providers, sweep and metrics: see the module "
                                     "docstring.")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the GPU sweep (FULL)")
    size.add_argument("--quick", action="store_true", help="tiny shapes, seconds (QUICK)")
    parser.add_argument("--out", help="results CSV (default results/speedup/<device>.csv); the "
                        "log and the configuration are written beside it")
    parser.add_argument("--cpu-mem-budget-mb", type=float,
                        help=f"CPU memory budget per measured call (default "
                        f"{Config.cpu_mem_budget_mb:.0f}): above it a call is an 'oom' row")
    parser.add_argument("--threads", type=int, help="CPU: torch threads (default "
                        f"{Config.threads}; 0: torch's default)")
    parser.add_argument("--providers", help="comma-separated subset or superset of the "
                        "device's providers")
    parser.add_argument("--headdims", help="comma-separated head dims (both parts)")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths of part batch")
    parser.add_argument("--long-seqlens", help="comma-separated sequence lengths of part long "
                        "('' for none)")
    parser.add_argument("--parts", help="comma-separated parts to run (default: "
                        f"{','.join(Config.parts)})")
    parser.add_argument("--decode-seqlens", help="comma-separated cache lengths of part decode")
    parser.add_argument("--budget-s", type=float, help="start no group after this many "
                        "seconds (default: none)")
    parser.add_argument("--resume", action="store_true", help="skip measurements whose "
                        "time_ms row is already in the output file")
    parser.add_argument("--resume-after", metavar="TIME", help="with --resume: rows measured "
                        "before this ISO time (UTC) count as unmeasured, so a kernel changed "
                        "since is measured again (its new rows replace the old ones)")
    args = parser.parse_args()
    check_resume_after(parser, args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.full and device != "cuda":
        parser.error("--full is the GPU sweep, and there is no CUDA device here")
    cfg = Config(**(FULL if args.full else QUICK if args.quick else {}))
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    if args.cpu_mem_budget_mb is not None:
        cfg = replace(cfg, cpu_mem_budget_mb=args.cpu_mem_budget_mb)
    if args.threads is not None:
        cfg = replace(cfg, threads=args.threads)
    if args.providers:
        cfg = replace(cfg, providers=tuple(args.providers.split(",")))
    if args.headdims:
        cfg = replace(cfg, headdims=ints(args.headdims),
                      long_headdims=tuple(d for d in cfg.long_headdims
                                          if d in ints(args.headdims)))
    if args.seqlens is not None:
        cfg = replace(cfg, seqlens=ints(args.seqlens))
    if args.long_seqlens is not None:
        cfg = replace(cfg, long_seqlens=ints(args.long_seqlens))
    if args.budget_s is not None:
        cfg = replace(cfg, budget_s=args.budget_s)
    if args.parts:
        cfg = replace(cfg, parts=tuple(args.parts.split(",")))
        if set(cfg.parts) - set(Config.parts):
            parser.error(f"--parts: unknown {sorted(set(cfg.parts) - set(Config.parts))}; "
                         f"choose from {','.join(Config.parts)}")
    if args.decode_seqlens is not None:
        cfg = replace(cfg, decode_seqlens=ints(args.decode_seqlens))
    unknown = [p for p in cfg.providers if p not in GPU_PROVIDERS + CPU_PROVIDERS]
    if unknown:
        parser.error(f"--providers: unknown {unknown}; choose from "
                     f"{sorted(set(GPU_PROVIDERS + CPU_PROVIDERS))}")
    warnings.filterwarnings("ignore", message=r".*(kernel not used|not compiled with).*")

    name = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    out, _ = start_run("speedup", args.out, log, dict(asdict(cfg), device=device),
                       f"speedup on {name}, torch {torch.__version__}\n{cfg}")
    run(cfg, device, out, resume=args.resume, resume_after=args.resume_after)
    summary(out, device)
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
