"""LongFlash Triton kernels: exact attention, forward and backward, never forming the N x N matrix.

Algorithm (Dao et al. 2022, "FlashAttention", Algorithm 1; Dao 2023, FlashAttention-2):
each program owns one block of BLOCK_M query rows of one (batch, head) and walks
over the key/value blocks of BLOCK_N columns in on-chip memory, keeping the
running row max m_i, running sum l_i and unnormalized output acc in fp32
(online softmax). Scores are scaled by softmax_scale * log2(e) once, so every
exponential is an exp2 (in the forward without softcap or ALiBi the row max is taken before
the scaling, which then joins exp2's subtraction in one FFMA per score). Causal attention
(bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q) and sliding
windows visit only the key blocks
that some row can see, and mask only the blocks that straddle a window edge or
the sequence end. Softcap, ALiBi and dropout (Philox, regenerated in backward)
are compile-time flags, as is an attn_mask (BIAS_KIND: PyTorch's boolean or float mask,
read tile by tile through its strides by pointer loads in every kernel, so a broadcast mask
is never materialized; with BIAS_GRAD the dQ kernel stores its gradient, dS; no
warp-specialized candidate takes one); packed variable-length batches read each sequence's
offsets from cu_seqlens, so no padding is computed, and the forward can read their
keys and values in place from a paged cache through a block table (PAGED), float8 pages
too (each tile converted to q's dtype as it is loaded, the scales applied as decoding does:
HAS_DESCALE).
The forward saves the log-sum-exp per row; the backward recomputes the
probabilities from it: a preprocessing step delta = rowsum(dO * O), one kernel
for dK/dV (a program per key block, looping over query blocks and, for GQA,
over the query heads that share the key head) and one for dQ (a program per
query block). Neither uses atomics, so gradients are deterministic. A trial of the
tuning sweep (ATOMIC) computes dQ in the dK/dV kernel instead, as FlashAttention-2 does,
adding each block pair's share into an fp32 accumulator by atomics (not deterministic; only
with deterministic=False); another (PIPE) software-pipelines the forward's key loop by one
block, so that the next block's q.k runs on the tensor cores during this block's softmax.

`blockwise.py` is the same algorithm in PyTorch ops, with the same names and
block ranges (`_common.key_range`, `_common.query_range`); read it first.

Layout: (batch, seqlen, nheads, headdim), any strides with a contiguous last
dim. Head dims 1..256, padded inside the kernel to a power of two >= 16. The values
may have a head dim of their own (HEAD_DIM_V / BLOCK_DV: v, o, dO, dV and the
accumulators over them; MLA's 192 / 128); the config table takes the larger.
Address arithmetic: program ids and block starts are cast to int64 before
multiplying by strides, so tensors over 2^31 elements are addressed safely.

Where it was tested and where it breaks:
- Tested on CPU under TRITON_INTERPRET=1 (Triton 3.9; and 3.6 with the GPU machines'
  Python, torch and NumPy: `make gpu-image-check`) in fp16 and fp32, at every tile of
  CONFIGS as well as a small one (the warp-specialized code paths too, which the interpreter
  runs unspecialized); the GPU tests (marker `gpu`) target H100/H200 with
  Triton >= 3.0: the first H100 window (Triton 3.6) ran part of them and timed the table's
  candidates (results/gpu_campaign/, PERFLOG); the sweep's trials are untimed.
- Code generation is checked offline (`python -m experiments.codegen`, `make codegen-check`
  in CI against Triton 3.6.0, the H100/H200 machines' version, and the newest Triton):
  compiled for sm_90a at every config in CONFIGS, the forward and dQ kernels spill nothing at
  head dims 64 and 128, every tl.dot of every loop is a wgmma, and the loop's loads are
  pipelined (cp.async, or TMA copies). See results/codegen/sm90a.csv for dK/dV and head dim
  256, which spill a little.
- Two ways to read a loop's tiles (K/V; Q/dO in dK/dV), chosen per config (USE_TMA): pointers
  and masks (every GPU, the interpreter; bounds checked only on the blocks that straddle a
  sequence end or a window edge, the head-dim mask only when the head dim is not a power of
  two), or on Hopper TMA copies through a tensor descriptor made on the device for each
  (sequence, head) slice, which zero-fills past the sequence end and the head dim by itself.
  TMA needs 16-byte aligned rows and Triton's allocator (`_tma_ok`); other inputs get the
  pointer candidates. On Hopper each kernel also has warp-specialized candidates (WS in
  CONFIGS: Triton's automatic warp specialization, a TMA-copy warpgroup feeding two compute
  warpgroups; one loop over every visible block, all masked unless no block needs a mask
  (FULL_TILES: no causal mask or window, lengths multiples of the tiles), which in dK/dV also
  runs over the query heads of a GQA group; `_ws_ok`; opt-in, LONGFLASH_WS=1 (all kernels) or
  a list of kernels (LONGFLASH_WS=fwd): on an H100 with Triton 3.6 they returned NaN
  (results/gpu_campaign/h100-stage1*, PERFLOG); since the workarounds of two bugs of Triton's
  pass (`_held_start`, `_load_head_tile`) the forward's were exact there in two windows,
  dK/dV's exact at head dim 64 and NaN at 128 with grouped query heads; not dK/dV at head dim
  256, whose tiles spilled 4 KB, nor dQ at 256, which returned NaN on the H100 (cause not
  found), nor dQ for packed sequences, whose lse rows a TMA copy cannot read).
- The configs (CONFIGS) were chosen from ptxas evidence, then the backward's TMA tiles at
  head dims 128 and 256 from the H100's tuning sweep: see the comment there.
- Unlike CUDA FlashAttention: the dropout random numbers differ (ours are the
  counter-based stream of `_common.dropout_uniform`, the same on every backend);
  split-KV decoding lives in decode_triton.py, and paged keys are read by pointer loads only
  (no TMA or warp-specialized candidate; the backward takes packed keys); fp32 inputs use IEEE
  fp32 dot products (no TF32), which matches PyTorch's default for matmul.
"""

import contextlib
import contextvars
import functools
import inspect
import math
import os
import types
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

from ._common import (BLOCK_SPARSE_UNIT, LOG2E, block_lists, empty_like, empty_outputs,
                      fix_triton_interpreter)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if _INTERPRET:
    fix_triton_interpreter()


# -- configs: (BLOCK_M, BLOCK_N, num_warps, num_stages[, TMA[, WS]]), at most 4 per kernel,
# architecture (major compute capability) and head-dim bucket (BLOCK_D 16..64 -> 64). Chosen
# offline, untimed, from `python -m experiments.codegen` (results/codegen/sm90a.csv, sm80.csv):
# on sm_90 the candidates that compile with the fewest spills with Triton 3.6.0 and the newest
# Triton (the forward and dQ at head dims 64/128 spill nothing), with every tl.dot on wgmma (a
# warpgroup of 4 warps needs >= 64 rows in the dot's M dimension: BLOCK_M in the forward and dQ,
# BLOCK_N in dK/dV) and the loop's loads pipelined (num_stages), in the usual FlashAttention-2
# shapes (Triton tutorial 06). dK/dV holds two (BLOCK_N, head dim) fp32 accumulators: on sm_90
# its tiles have 8 warps over BLOCK_N = 128 (64 at d256) and short query blocks (BLOCK_M 16/32),
# which spill 0-276 B where (64, 128, 8, 2) spilled 0.9-2 KB at d128; at d64 the larger
# (64, 128) tile (0.2 KB) stays beside a spill-free one for the autotuner to judge.
# Timed on the H100 (tuning sweep, 2026-11-26, results/tuning/h100.csv, PERFLOG "Backward
# tiles from the H100's sweep"): the backward's TMA candidates at d128 and d256 are the sweep's
# winners, each timed as the whole backward call with that kernel's tile forced: dK/dV d256
# (64, 64, 8, 2) 1.54x / 1.62x the autotuner's (16, 64, 8, 3) (1K non-causal / 4K causal),
# d128 (64, 128, 8, 2) 1.16x (4K); dQ d256 (128, 32, 8, 1) 1.13x / 1.11x, d128 (128, 64, 8, 3)
# 1.06x the autotuner's (128, 64, 8, 2). The TMA tiles they replaced lost to them.
# TMA (sm_90 only): the loop's tiles (K/V; Q/dO in dK/dV) come by TMA copies through a tensor
# descriptor instead of cp.async with computed addresses: no address registers, so fewer
# registers (d128 forward 153-178 instead of 219-221) and fewer spills (dK/dV d128 (16, 128) 0 B
# with both Tritons, d256 64-176 B instead of 196-308 B), and the forward affords 128 x 128 tiles
# without spilling. Each kernel and head dim has one or two TMA candidates beside the pointer
# ones, which remain for inputs a TMA copy cannot read (_tma_ok). sm_80 dK/dV at d256:
# (32, 64, 4, 2) compiled to 32 registers and 22 KB of spills with both Tritons; (32, 64, 8, 2)
# and (16, 32, 4, 2) spill 0.2-0.5 KB. The first use of the RQ1 sweep (bf16, head dims
# 64/128/256) compiles 36 kernels. Not tuned on a GPU yet: autotuning picks
# among these on first use and keeps its choice on disk (triton.autotune(cache_results=True)).
# Warp specialization (sm_90, WS after TMA): Triton (3.6.0, 3.9.0) splits a kernel's loop into a
# TMA-copy warpgroup and two compute warpgroups of 64 rows each (query rows in the forward and
# dQ, key rows in dK/dV; 12 warps from num_warps=4, registers moved to the compute warpgroups by
# setmaxnreg), FlashAttention-3's producer/consumer layout. Triton's Hopper pass takes only a
# kernel with one loop in which everything held across the loop (q; k, v in dK/dV; q, dO, lse,
# delta in dQ) comes by TMA copies (with 8 warps, with the three-loop kernels or a pointer load
# there, it silently does nothing or fails to compile), so a WS candidate masks every block
# (a second compile masks none where no block needs a mask: FULL_TILES, _full_tiles), and
# dK/dV folds its GQA loop into its query loop. Spill-free in bf16 at these tiles with Triton
# 3.6.0 (forward d64/128/256, dK/dV d64/128, dQ d64/128); dK/dV at d256 has none (every tile
# tried spilled 4 KB), dQ at d256 none since its (128, 32, 4, 2) returned NaN on the H100
# (results/gpu_campaign/h100-stage5*). One per kernel and head dim.
TMA = "tma"  # a candidate's 5th element: tiles by TMA copies
WS = "ws"    # its 6th: the kernel's loop warp-specialized (needs TMA)
# dK/dV only, not with WS: two programs per key block, one accumulating dV (q.k^T, p^T dO), one
# dK (q.k^T, dO.v^T, dS^T q), each holding one (BLOCK_N, head dim) accumulator instead of two,
# at 5 dots per query block instead of 4; for head dim 256, where the fused tiles wider than 16
# queries spill (PERFLOG). A trial of the tuning sweep (experiments/tuning.py), in no table yet.
SPLIT = "split"
# dK/dV only, not with WS: dQ computed there too (dQ += dS k for each block pair, added by atomics
# into an fp32 accumulator: a TMA reduction with TMA, else atomic adds), no dQ kernel:
# FlashAttention-2's backward, 5 dots per (query block, key block) instead of the 4 + 3 of the
# dK/dV and dQ kernels, each recomputing p. Not deterministic: the additions' order varies, so
# dQ's rounding may differ between runs; the launcher runs these candidates only where
# deterministic=False (_atomic_dq), and autotunes them among themselves. A trial of the tuning
# sweep, in no table yet (PERFLOG).
ATOMIC = "atomic"
# Forward only, not with WS: the key loop software-pipelined by one block (_attn_fwd_inner):
# q.k of the next block in flight on the tensor cores while this block's softmax runs. A trial
# of the tuning sweep, in no table yet (PERFLOG).
PIPE = "pipe"
CONFIGS = {
    ("fwd", 9, 64): [(128, 64, 8, 3), (128, 64, 8, 3, TMA), (128, 128, 8, 2, TMA),
                     (128, 128, 4, 2, TMA, WS)],
    ("fwd", 9, 128): [(128, 64, 8, 3), (128, 64, 8, 3, TMA), (128, 128, 8, 2, TMA),
                      (128, 128, 4, 2, TMA, WS)],
    ("fwd", 9, 256): [(128, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2, TMA),
                      (128, 64, 4, 2, TMA, WS)],
    ("fwd", 8, 64): [(128, 64, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
    ("fwd", 8, 128): [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)],
    ("fwd", 8, 256): [(64, 64, 4, 2), (64, 32, 4, 2)],
    ("dkdv", 9, 64): [(64, 128, 8, 3), (32, 128, 8, 3), (32, 128, 8, 3, TMA),
                      (64, 128, 4, 2, TMA, WS)],
    ("dkdv", 9, 128): [(32, 128, 8, 2), (16, 128, 8, 2), (64, 128, 8, 2, TMA),
                       (32, 128, 4, 3, TMA, WS)],
    ("dkdv", 9, 256): [(16, 64, 8, 3), (64, 64, 8, 2, TMA)],
    ("dkdv", 8, 64): [(64, 64, 4, 3), (32, 128, 4, 3)],
    ("dkdv", 8, 128): [(64, 64, 4, 2), (32, 64, 4, 3)],
    ("dkdv", 8, 256): [(32, 64, 8, 2), (16, 32, 4, 2)],
    ("dq", 9, 64): [(128, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 3, TMA),
                    (128, 128, 4, 2, TMA, WS)],
    ("dq", 9, 128): [(128, 64, 8, 2), (64, 32, 4, 3), (128, 64, 8, 3, TMA),
                     (128, 128, 4, 2, TMA, WS)],
    ("dq", 9, 256): [(64, 32, 8, 2), (128, 32, 8, 1, TMA)],
    ("dq", 8, 64): [(64, 64, 4, 3), (128, 32, 4, 3)],
    ("dq", 8, 128): [(64, 64, 4, 2), (64, 32, 4, 3)],
    ("dq", 8, 256): [(64, 32, 4, 2), (32, 32, 4, 2)],
}
PREPROCESS_BLOCK_M = 128
_INTERPRET_CONFIG = (32, 16, 4, 1)  # one small asymmetric tile: block edges on tiny shapes


def _config(c):
    """The triton.Config of a CONFIGS entry."""
    block_m, block_n, warps, stages, *flags = c
    kwargs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "USE_TMA": TMA in flags,
              "WARP_SPECIALIZE": WS in flags, **({"SPLIT": True} if SPLIT in flags else {}),
              **({"ATOMIC_DQ": True} if ATOMIC in flags else {}),
              **({"PIPELINE": True} if PIPE in flags else {})}
    if WS in flags and (SPLIT in flags or ATOMIC in flags or PIPE in flags):
        raise ValueError(f"a candidate is warp-specialized or split/atomic/pipe, not both: {c}")
    return triton.Config(kwargs, num_warps=warps, num_stages=stages)


def _table_key(kernel, major, headdim):
    """Hopper and newer use the sm_90 table, Ampere/Ada the sm_80 one (major: 8, 9, 10...)."""
    block_d = max(64, triton.next_power_of_2(headdim))
    return kernel, 9 if major >= 9 else 8, block_d


def configs_for(kernel, major, headdim):
    """The triton.Configs the launcher may choose for `kernel` ("fwd", "preprocess", "dkdv",
    "dq") on a GPU of this major compute capability (9 for H100) and head dim (the larger of
    the keys' and the values')."""
    if kernel == "preprocess":
        return [triton.Config({"BLOCK_M": PREPROCESS_BLOCK_M}, num_warps=4, num_stages=1)]
    return [_config(c) for c in CONFIGS[_table_key(kernel, major, headdim)]]


@functools.lru_cache(maxsize=None)  # once per combination: a launch's host time counts
def constexprs(headdim, dtype_is_fp32=False, varlen=False, softcap=False, alibi=False,
               dropout=False, headdim_v=None, bias_kind=0, block_sparse=False):
    """The compile-time arguments the launcher passes (without the tile sizes), read-only.
    headdim_v: the values' head dim (MLA: another than the queries' and keys'), default
    headdim. bias_kind: attn_mask's kind (_bias_args). block_sparse: a block_mask
    (_sparse_args)."""
    headdim_v = headdim_v or headdim
    return types.MappingProxyType(dict(
        HAS_SOFTCAP=softcap, HAS_ALIBI=alibi, HAS_DROPOUT=dropout, IS_VARLEN=varlen,
        BIAS_KIND=bias_kind, BLOCK_SPARSE=block_sparse,
        HEAD_DIM=headdim, BLOCK_D=max(16, triton.next_power_of_2(headdim)), HEAD_DIM_V=headdim_v,
        BLOCK_DV=max(16, triton.next_power_of_2(headdim_v)),
        INPUT_PRECISION="ieee" if dtype_is_fp32 else "tf32"))


def all_configs(kernel):
    """Every (BLOCK_M, BLOCK_N, warps, stages[, TMA[, WS]]) of `kernel` in CONFIGS, any
    architecture and head dim: the autotuner's candidates before pruning."""
    return sorted({c for (name, _, _), cs in CONFIGS.items() if name == kernel for c in cs})


def _prune(kernel):
    def prune(configs, named_args, **kwargs):
        """Keep this GPU's and head dim's candidates (CONFIGS); the TMA ones only where the
        launcher found the inputs fit (tma_ok), the warp-specialized ones only where it found
        that they may run (ws_ok); in dK/dV those that compute dQ (ATOMIC) only, or none of
        them, as the launcher chose (atomic_dq). A single config (forced_configs) as it is, as
        the autotuner runs it. Then compile the kept ones at once (_compile_candidates): the
        autotuner prunes only on a miss, just before it compiles and times each."""
        arg = lambda name: kwargs.get(name, named_args.get(name, 0))  # noqa: E731
        if len(configs) == 1:
            return _fit_blocks(configs, arg)
        q = named_args["Q"]
        capability = torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 9
        wanted = CONFIGS[_table_key(kernel, capability, max(arg("HEAD_DIM"), arg("HEAD_DIM_V")))]
        configs = [c for c in configs
                   if bool(c.kwargs.get("ATOMIC_DQ")) == bool(arg("atomic_dq"))]
        pointers = [c for c in configs if not c.kwargs["USE_TMA"]]
        usable = [c for c in configs if (not c.kwargs["USE_TMA"] or arg("tma_ok"))
                  and (not c.kwargs.get("WARP_SPECIALIZE") or arg("ws_ok"))]
        kept = _fit_blocks([c for c in usable if _entry(c) in wanted] or pointers[:1], arg)
        _compile_candidates(kernel, kept, named_args, kwargs)
        return _fit_shared_memory(kernel, kept, named_args, kwargs)
    return prune


def _fit_blocks(configs, arg):
    """With a block_mask, the candidates with each tile shrunk to divide its blocks (a tile
    inside one block: BLOCK_M to its greatest common divisor with sparse_bq queries, BLOCK_N
    with sparse_bk keys; warps and stages as they were), without repeats: blocks of
    multiples of 128 keep the table's tiles, blocks of 64 take 64-row tiles where the table's
    have 128 (spill-free on sm_90a in the forward, PERFLOG "Blocks of 64"). Without one, as
    they are."""
    if not arg("BLOCK_SPARSE"):
        return configs
    bq, bk = arg("sparse_bq"), arg("sparse_bk")
    shrunk = {}
    for c in configs:
        m, n = math.gcd(c.kwargs["BLOCK_M"], bq), math.gcd(c.kwargs["BLOCK_N"], bk)
        if (m, n) != (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]):
            c = triton.Config(dict(c.kwargs, BLOCK_M=m, BLOCK_N=n), num_warps=c.num_warps,
                              num_stages=c.num_stages)
        shrunk.setdefault(_entry(c), c)
    return list(shrunk.values())


def max_shared_memory():
    """The current GPU's shared memory per block in bytes, as Triton checks a kernel's at its
    first launch (OutOfResources past it), or None where Triton's driver does not say."""
    try:
        from triton.runtime.driver import driver
        return int(driver.active.utils.get_device_properties(
            driver.active.get_current_device())["max_shared_mem"])
    except Exception:  # noqa: BLE001 (a stand-in driver, the interpreter)
        return None


def smaller_config(config, rows_fixed=False):
    """A config one step smaller in shared memory: a pipeline stage fewer, else the longer
    tile edge halved (BLOCK_N on a tie, or always with rows_fixed: the grid's BLOCK_M kept;
    not below 16, so a tile still divides what the larger one divided); None past that."""
    kw, warps = config.kwargs, config.num_warps
    if config.num_stages > 1:
        return triton.Config(dict(kw), num_warps=warps, num_stages=config.num_stages - 1)
    m, n = kw["BLOCK_M"], kw["BLOCK_N"]
    if (n if rows_fixed else max(m, n)) <= 16:
        return None
    m, n = (m, n // 2) if rows_fixed or n >= m else (m // 2, n)
    return triton.Config(dict(kw, BLOCK_M=m, BLOCK_N=n), num_warps=warps, num_stages=1)


def _fit_shared_memory(kernel, configs, named_args, kwargs):
    """The candidates that fit the GPU's shared memory per block (each compiled, its
    metadata.shared against max_shared_memory()), one over it replaced by its smaller_config
    steps until one fits (a warp-specialized one dropped): on GPUs of 99 KB a block (sm_86,
    sm_89, sm_120) some of the tables' tiles do not fit (sm_120's d256 forward: 106-147 KB
    with the sm_90 table; PERFLOG "Tiles that fit the GPU's shared memory"), and where none
    does the autotuner would time every one as failed and launch one that cannot run. As
    they are where every one fits, the limit is unknown, or within compiling()."""
    limit = None if _compile_only.get() or _INTERPRET else max_shared_memory()
    if limit is None:
        return configs
    fn = _tuned(kernel).fn
    call = {k: v for k, v in {**named_args, **kwargs}.items() if k not in ("grid", "warmup")}
    fit = {}
    for config in configs:
        while config is not None:
            try:
                compiled = fn.warmup(grid=(1,), **call, **config.all_kwargs())
                compiled = compiled.result() if hasattr(compiled, "result") else compiled
                shared = compiled.metadata.shared
            except Exception:  # noqa: BLE001 (a candidate that does not compile: left out)
                break
            if shared <= limit:
                fit.setdefault(_entry(config), config)
                break
            config = None if config.kwargs.get("WARP_SPECIALIZE") else smaller_config(config)
    return list(fit.values()) or configs


def _entry(config):
    """The CONFIGS entry of a triton.Config."""
    k = config.kwargs
    return (k["BLOCK_M"], k["BLOCK_N"], config.num_warps, config.num_stages,
            *([TMA] if k.get("USE_TMA") else []), *([WS] if k.get("WARP_SPECIALIZE") else []),
            *([SPLIT] if k.get("SPLIT") else []), *([ATOMIC] if k.get("ATOMIC_DQ") else []),
            *([PIPE] if k.get("PIPELINE") else []))


# Autotuning keys on the longer length rounded up to a power of two, at most this: past 64K
# tokens a grid of thousands of programs fills any GPU, the per-program loops only get longer,
# and tuning a 1M-token call would run each candidate several times at seconds a run.
SEQLEN_BUCKET_MAX = 65536


def seqlen_bucket(seqlen_q, seqlen_k):
    """The sequence-length part of the autotuning key: the next power of two (as
    triton.next_power_of_2, in a tenth of its time), at most SEQLEN_BUCKET_MAX."""
    return min(1 << (max(seqlen_q, seqlen_k, 1) - 1).bit_length(), SEQLEN_BUCKET_MAX)


def _autotune(kernel):
    if _INTERPRET:  # one config: nothing to prune or benchmark
        return triton.autotune(configs=[_config(_INTERPRET_CONFIG)], key=[])
    # Keyed on the head dim, the window (causal is window_right = 0) and seqlen_bucket, so
    # varying lengths do not re-tune every time.
    # cache_results (Triton >= 3.2): the choice is kept on disk, in Triton's cache directory.
    cache = ({"cache_results": True}
             if "cache_results" in inspect.signature(triton.autotune).parameters else {})
    # dK/dV's ATOMIC candidates add into DQ_ACC: zeroed before each one is timed.
    extra = {"fwd": ["PAGED"], "dkdv": ["atomic_dq"], "dq": ["BIAS_GRAD"]}.get(kernel, [])
    reset = {"reset_to_zero": ["DQ_ACC"]} if kernel == "dkdv" else {}
    return triton.autotune(configs=[_config(c) for c in all_configs(kernel)],
                           key=["HEAD_DIM", "HEAD_DIM_V", "seqlen_bucket", "window_left",
                                "window_right",
                                "HAS_SOFTCAP", "HAS_ALIBI", "HAS_DROPOUT", "IS_VARLEN",
                                "BIAS_KIND", "BLOCK_SPARSE", "sparse_bq", "sparse_bk", "tma_ok",
                                "ws_ok"] + extra,
                           prune_configs_by={"early_config_prune": _prune(kernel)}, **cache,
                           **reset)


def _full_tiles(args):
    """FULL_TILES: no block of this call needs a mask (no causal mask or window, one sequence
    per batch row, both lengths multiples of the tiles), so a warp-specialized loop, which
    otherwise masks every block, masks none, as the non-causal Triton tutorial does. False for
    the other candidates: they mask only the blocks at an edge already, and one compile of
    theirs serves every call."""
    return bool(args["WARP_SPECIALIZE"] and args["window_left"] < 0 and args["window_right"] < 0
                and not args["IS_VARLEN"] and args["seqlen_q"] % args["BLOCK_M"] == 0
                and args["seqlen_k"] % args["BLOCK_N"] == 0)


def jit_function(kernel):
    """The @triton.jit function under a kernel's autotuner and heuristics, to compile or launch
    it directly with every constexpr given (experiments/codegen.py, the JAX binding)."""
    while isinstance(kernel, (triton.runtime.Autotuner, triton.runtime.Heuristics)):
        kernel = kernel.fn
    return kernel


def constexpr_defaults(kernel):
    """{name: default} of a kernel's constexpr parameters that have one (dK/dV's SPLIT). A
    launch binds them; a compile from the AST or a call by name must name them, or such a
    parameter becomes a runtime argument (`if SPLIT:` compiled both ways) or goes missing."""
    params = inspect.signature(jit_function(kernel).fn).parameters  # the interpreter's too
    return {name: p.default for name, p in params.items()
            if p.annotation is tl.constexpr and p.default is not inspect.Parameter.empty}


# ----------------------------------------------------------------------------- helpers

@triton.jit
def _visible(rows, cols, n_rows, n_cols, before, after, ROW_BOUNDS: tl.constexpr):
    """True where tile row r may see column c, as _common.visible in tile orientation: rows
    (R, 1) are queries in the forward and dQ (n_rows = seqlen_q, before/after = window_left/
    right), keys in dK/dV (n_rows = seqlen_k, the window mirrored: before = window_right), and
    r + n_cols - n_rows - before <= c <= r + n_cols - n_rows + after inside both lengths.
    ROW_BOUNDS: each row's interval of columns first (a few registers per thread, since a
    thread holds few rows of an MMA tile), then two compares per score: fewer instructions, but
    a few more live registers, which spill in the 255-register dK/dV tiles (sm_90a codegen)."""
    if ROW_BOUNDS:
        diag = rows + (n_cols - n_rows)
        first = tl.where(before < 0, 0, diag - before)
        last = tl.where(after < 0, n_cols - 1, tl.minimum(diag + after, n_cols - 1))
        last = tl.where(rows < n_rows, last, -1)  # a row past the end sees nothing
        mask = (cols >= first) & (cols <= last)
    else:  # each score tested against its column's diagonal (the same set)
        diag = cols + (n_rows - n_cols)
        mask = (cols < n_cols) & (rows < n_rows)
        mask = mask & ((before < 0) | (rows <= diag + before))
        mask = mask & ((after < 0) | (rows >= diag - after))
    return mask


@triton.jit
def _key_range(start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Keys of query block start_m, as _common.key_range: [lo, mid_lo) and [mid_hi, hi)
    masked, [mid_lo, mid_hi) unmasked. A block past the end of its sequence (packed
    batches) visits nothing."""
    first = start_m + (seqlen_k - seqlen_q)
    last = first + BLOCK_M - 1
    hi = tl.where(window_right >= 0, tl.minimum(tl.maximum(last + window_right + 1, 0), seqlen_k),
                  seqlen_k)
    lo = tl.where(window_left >= 0,
                  tl.minimum(tl.maximum(first - window_left, 0), seqlen_k) // BLOCK_N * BLOCK_N, 0)
    ceil_hi = (hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    mid_lo = tl.where(window_left >= 0, tl.minimum(
        (tl.maximum(last - window_left, lo) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, ceil_hi), lo)
    every_row_hi = tl.where(window_right >= 0,
                            tl.minimum(tl.maximum(first + window_right + 1, 0), seqlen_k), seqlen_k)
    mid_hi = tl.maximum(every_row_hi // BLOCK_N * BLOCK_N, mid_lo)
    valid = start_m < seqlen_q
    return (tl.where(valid, lo, 0), tl.where(valid, mid_lo, 0), tl.where(valid, mid_hi, 0),
            tl.where(valid, hi, 0))


@triton.jit
def _query_range(start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Queries of key block start_n, as _common.query_range: _key_range with queries and
    keys swapped and the window mirrored."""
    return _key_range(start_n, seqlen_k, seqlen_q, window_right, window_left, BLOCK_N, BLOCK_M)


@triton.jit
def _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k) of batch entry off_b: packed sequences read
    their offsets from cu_seqlens, padded batches start at 0."""
    if IS_VARLEN:
        q_start = tl.load(CU_Q + off_b)
        k_start = tl.load(CU_K + off_b)
        seqlen_q = tl.load(CU_Q + off_b + 1) - q_start
        seqlen_k = tl.load(CU_K + off_b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    return tl.cast(q_start, tl.int64), tl.cast(k_start, tl.int64), seqlen_q, seqlen_k


@triton.jit
def _query_block_start(BLOCK_M: tl.constexpr):
    """The first query row of this program's block (forward, dQ). Program ids run over the
    query blocks in reverse: causally the last blocks see the most keys, so they start first and
    the short ones fill the tail of the grid (longest first; the same set of blocks)."""
    return (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^{2x} + 1): saturates to +-1 without overflow trouble (exp2(inf) -> 2/inf = 0).
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _scores(qk, rows, cols, n_rows, n_cols, before, after, qk_scale, softcap, softmax_scale,
            slope, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
            ROW_BOUNDS: tl.constexpr = True):
    """Scores in log2 units from q.k, in FlashAttention-2's order (scale, softcap, ALiBi, mask),
    as blockwise._scores; also t = tanh(s / softcap) for the softcap gradient. The tile's rows
    and columns as in _visible: (queries, keys) in the forward and dQ, (keys, queries) in
    dK/dV."""
    if HAS_SOFTCAP:
        t = _tanh(qk * (softmax_scale / softcap))
        s = t * (softcap * 1.4426950408889634)
    else:
        t = qk  # unused
        s = qk * qk_scale
    if HAS_ALIBI:
        distance = tl.abs(rows + (n_cols - n_rows) - cols).to(tl.float32)  # |i + Nk - Nq - j|
        s = s - (slope * 1.4426950408889634) * distance
    if MASKED:
        s = tl.where(_visible(rows, cols, n_rows, n_cols, before, after, ROW_BOUNDS), s,
                     float("-inf"))
    return s, t


@triton.jit
def _bias(BIAS, rows, cols, n_rows, n_cols, stride_r, stride_c, BIAS_KIND: tl.constexpr):
    """attn_mask's tile in log2 units, added to the scores after _scores (as blockwise._scores
    adds it before the window mask); rows and columns as in _visible. BIAS_KIND 1: a float
    mask, added; 2: a boolean mask (read as uint8), -inf where it is False. Positions past
    either length read nothing (0 added)."""
    ptrs = BIAS + rows.to(tl.int64) * stride_r + cols.to(tl.int64) * stride_c
    inside = (rows < n_rows) & (cols < n_cols)
    if BIAS_KIND == 2:
        keep = tl.load(ptrs, mask=inside, other=1)
        b = tl.where(keep != 0, 0.0, float("-inf"))
    else:
        b = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * 1.4426950408889634
    return b


@triton.jit
def _tiles_before(row, t, tiles_per_block):
    """How many of a loop's visible tiles come before its tile t: row[0..cols] is the
    exclusive running count of the row's visible blocks (_common.block_lists), each block
    tiles_per_block tiles."""
    blk = t // tiles_per_block
    rem = t - blk * tiles_per_block
    before = tl.load(row + blk)
    after = tl.load(row + blk + 1, mask=rem > 0, other=0)
    return before * tiles_per_block + tl.where(rem > 0, (after - before) * rem, 0)


@triton.jit
def _sparse_span(row, start, end, TILE: tl.constexpr, block_size):
    """[first, last): the positions, in the row's list of visible tiles, of those within
    [start, end) (start a multiple of TILE): a loop over them visits exactly the tiles that
    `range(start, end, TILE)` visits and block_mask keeps, in the same order."""
    tiles_per_block = block_size // TILE
    return (_tiles_before(row, start // TILE, tiles_per_block),
            _tiles_before(row, tl.cdiv(end, TILE), tiles_per_block))


@triton.jit
def _sparse_tile(row, cols, i, TILE: tl.constexpr, block_size):
    """The first index (query or key) of the row's i-th visible tile: row[cols + 1 ..] lists
    the visible blocks in order (_common.block_lists)."""
    tiles_per_block = block_size // TILE
    blk = tl.load(row + cols + 1 + i // tiles_per_block)
    return (blk * tiles_per_block + i % tiles_per_block) * TILE


@triton.jit
def _loop_span(lo, hi, row, TILE: tl.constexpr, block_size, BLOCK_SPARSE: tl.constexpr):
    """A loop over the tiles of [lo, hi) runs `for i in range(first, last, step)` with
    (first, last) from here, step `1 if BLOCK_SPARSE else TILE`, and each tile's start from
    _loop_tile: [lo, hi) itself, or with BLOCK_SPARSE the positions of its visible tiles in
    the row's list (_sparse_span)."""
    first, last = lo, hi
    if BLOCK_SPARSE:
        first, last = _sparse_span(row, lo, hi, TILE, block_size)
    return first, last


@triton.jit
def _loop_tile(i, row, cols, TILE: tl.constexpr, block_size, BLOCK_SPARSE: tl.constexpr):
    """The start of the loop's tile i (_loop_span)."""
    start = i
    if BLOCK_SPARSE:
        start = _sparse_tile(row, cols, i, TILE, block_size)
    return start


@triton.jit
def _dropout_scale(seed_lo, seed_hi, drop_row0, drop_col0, bh, i, j, dropout_p):
    """keep / (1 - dropout_p) per (i, j), keep drawn as _common.dropout_uniform (Philox-4x32-10
    with counter (drop_col0 + j, drop_row0 + i, bh, 0) and key (seed_lo, seed_hi)): the
    offsets place a call's rows and keys in a larger attention (Options.dropout_row0)."""
    c0 = (j + drop_col0 + i * 0).to(tl.uint32)
    c1 = (i + drop_row0 + j * 0).to(tl.uint32)
    c2 = c0 * 0 + tl.cast(bh, tl.uint32)
    c3 = c0 * 0
    k0 = tl.cast(seed_lo, tl.uint32)
    k1 = tl.cast(seed_hi, tl.uint32)
    for _ in tl.static_range(10):
        old_c0, old_c2 = c0, c2
        c0 = tl.math.umulhi(old_c2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.math.umulhi(old_c0, 0xD2511F53) ^ c3 ^ k1
        c1 = old_c2 * 0xCD9E8D57
        c3 = old_c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    uniform = (c0 >> 8).to(tl.float32) * (1.0 / 16777216.0)
    return tl.where(uniform >= dropout_p, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def _block_ptrs(base, start, stride, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    return base + tl.cast(start, tl.int64) * stride + rows[:, None] * stride + cols[None, :]


@triton.jit
def _block_mask(start, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr):
    """Bounds of a tile, only where they can be crossed: rows unless the caller knows the block
    lies inside the sequence (interior blocks), columns unless HEAD_DIM is a power of two.
    A mask tensor costs registers in every loop iteration, so none is built when none is
    needed (None: an unmasked load or store)."""
    rows = start + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    if ROWS_IN_BOUNDS:
        if HEAD_DIM == BLOCK_D:
            mask = None
        else:
            mask = (rows[:, None] >= 0) & (cols[None, :] < HEAD_DIM)
    else:
        if HEAD_DIM == BLOCK_D:
            mask = (rows[:, None] < n_rows) & (cols[None, :] >= 0)
        else:
            mask = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _load_masked(ptrs, start, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr):
    """The (BLOCK_ROWS, BLOCK_D) tile at ptrs, whose rows are start, start + 1, ... of a
    sequence of n_rows; zeros past the ends."""
    mask = _block_mask(start, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D, ROWS_IN_BOUNDS)
    if ROWS_IN_BOUNDS and HEAD_DIM == BLOCK_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _load_block(base, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr = False):
    """Rows [start, start + BLOCK_ROWS) of a (seqlen, headdim) slice; zeros past the ends."""
    ptrs = _block_ptrs(base, start, stride, BLOCK_ROWS, BLOCK_D)
    return _load_masked(ptrs, start, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D, ROWS_IN_BOUNDS)


@triton.jit
def page_rows(TABLE, rows, mask, page_size, stride_page, stride_row):
    """Offsets (int64) of key rows `rows` of one sequence in a paged cache: row n is slot
    n % page_size of page TABLE[n // page_size] (TABLE: the sequence's row of the block
    table), pages stride_page apart, slots stride_row apart. Masked rows read page 0."""
    page = tl.load(TABLE + rows // page_size, mask=mask, other=0).to(tl.int64)
    return page * stride_page + (rows % page_size).to(tl.int64) * stride_row


@triton.jit
def _store_block(base, x, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    ptrs = _block_ptrs(base, start, stride, BLOCK_ROWS, BLOCK_D)
    tl.store(ptrs, x.to(base.dtype.element_ty),
             mask=_block_mask(start, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D, False))


@triton.jit
def _add_block(tiles, x, start, stride, n_rows, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
               ROWS_IN_BOUNDS: tl.constexpr, USE_TMA: tl.constexpr):
    """Adds x to rows [start, start + BLOCK_ROWS) of what _tiles returned for an fp32
    accumulator of BLOCK_D columns, atomically, as other programs add to the same rows: a TMA
    reduction (Hopper), else relaxed atomic adds (only the order of the additions is free, so
    the sum's rounding may differ between runs)."""
    if USE_TMA:
        tiles.atomic_add([start, 0], x)
    else:
        ptrs = _block_ptrs(tiles, start, stride, BLOCK_ROWS, BLOCK_D)
        tl.atomic_add(ptrs, x, mask=_block_mask(start, n_rows, BLOCK_D, BLOCK_ROWS, BLOCK_D,
                                                ROWS_IN_BOUNDS), sem="relaxed")


@triton.jit
def _tiles(base, n_rows, stride, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
           BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """What a loop reads its tiles from: with USE_TMA a tensor descriptor of the (n_rows,
    HEAD_DIM) slice at base, whose (BLOCK_ROWS, BLOCK_D) tiles are TMA copies (Hopper) with
    zeros past both ends; else base itself (pointer loads, _load_block)."""
    if USE_TMA:
        base = tl.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D])
    return base


@triton.jit
def _load_tile(tiles, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + BLOCK_ROWS) of what _tiles returned; zeros past the ends."""
    if USE_TMA:
        x = tiles.load([start, 0])
    else:
        x = _load_block(tiles, start, stride, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D,
                        ROWS_IN_BOUNDS)
    return x


@triton.jit
def _load_kv(tiles, TABLE, start, stride, stride_page, page_size, n_rows, HEAD_DIM: tl.constexpr,
             BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr,
             USE_TMA: tl.constexpr, PAGED: tl.constexpr):
    """_load_tile of a loop's keys or values; PAGED: tiles is the paged cache at this head, and
    the rows come through the block table (page_rows) by pointer loads."""
    if PAGED:
        rows = start + tl.arange(0, BLOCK_ROWS)
        offsets = page_rows(TABLE, rows, rows < n_rows, page_size, stride_page, stride)
        x = _load_masked(tiles + offsets[:, None] + tl.arange(0, BLOCK_D)[None, :], start,
                         n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D, ROWS_IN_BOUNDS)
    else:
        x = _load_tile(tiles, start, stride, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D,
                       ROWS_IN_BOUNDS, USE_TMA)
    return x


@triton.jit
def _held_start(start, n_rows):
    """The first row of a held tile's TMA copy: start, as a value of its own. Triton's Hopper
    warp specialization (3.6.0, 3.9.0) splits the program's rows between two compute
    partitions and shifts the copy's coordinate for the second by its 64 rows; where the
    program's row index (start + arange, for masks, stores and statistics) was built from the
    same SSA value, the pass shifted that too, on top of the second partition's arange(64,
    128): rows 64 too far (causal masks off by 64, the last 64 rows of a sequence never
    stored, statistics stored 64 rows off), which fits the NaN the first H100 window found in
    these kernels (not yet rerun on a GPU). A copy past the end reads zeros either way.
    experiments/codegen.py's ws_offset_twice finds the pattern in the compiled IR."""
    return tl.minimum(start, n_rows)


@triton.jit
def _load_held(base, start, stride, n_rows, HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, BY_TMA: tl.constexpr):
    """The tile a program holds across its loop (q in the forward, q and dO in dQ, k and v in
    dK/dV): with BY_TMA one TMA copy through a fresh descriptor, as a warp-specialized loop
    needs (Triton's Hopper pass rejects a pointer load there), else pointer loads."""
    tiles = _tiles(base, n_rows, stride, HEAD_DIM, BLOCK_ROWS, BLOCK_D, BY_TMA)
    if BY_TMA:
        start = _held_start(start, n_rows)
    return _load_tile(tiles, start, stride, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D, False, BY_TMA)


@triton.jit
def _load_rows(base, start, n_rows, BLOCK_ROWS: tl.constexpr, other,
               ROWS_IN_BOUNDS: tl.constexpr = False):
    """Per-row statistics (lse, delta) of rows [start, start + BLOCK_ROWS)."""
    offs = start + tl.arange(0, BLOCK_ROWS)
    if ROWS_IN_BOUNDS:
        x = tl.load(base + offs)
    else:
        x = tl.load(base + offs, mask=offs < n_rows, other=other)
    return x


@triton.jit
def _load_rows_tma(base, start, n_rows, BLOCK_ROWS: tl.constexpr):
    """_load_rows by a TMA copy, zeros past n_rows (base 16-byte aligned): what a warp-
    specialized kernel holds across its loop must come so (Triton's Hopper pass rejects a
    pointer load there)."""
    rows = tl.make_tensor_descriptor(base, shape=[n_rows], strides=[1], block_shape=[BLOCK_ROWS])
    return rows.load([_held_start(start, n_rows)])


# ----------------------------------------------------------------------------- forward

@triton.jit
def _attn_fwd_qk(q, K, stride_kn, TABLE, stride_kp, page_size, start_n, seqlen_k,
                 MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                 PAGED: tl.constexpr):
    """q.k of key block start_n: the first half of a forward step."""
    k = _load_kv(K, TABLE, start_n, stride_kn, stride_kp, page_size, seqlen_k, HEAD_DIM, BLOCK_N,
                 BLOCK_D, not MASKED, USE_TMA, PAGED)
    return tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION)  # float8: exact


@triton.jit
def _attn_fwd_update(acc, l_i, m_i, qk, V, stride_vn, TABLE, stride_vp, page_size, offs_m,
                     start_n, bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
                     window_left, window_right, qk_scale, softcap, softmax_scale, slope, dropout_p,
                     bias, stride_bm, stride_bn, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                     HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                     BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, PAGED: tl.constexpr,
                     BIAS_KIND: tl.constexpr, DTYPE: tl.constexpr):
    """The second half of a forward step, from key block start_n's q.k: scores, online
    softmax, acc += p v. bias: this (batch, head)'s attn_mask (BIAS_KIND, _bias). DTYPE: q's,
    that of the product p v (float8 pages' values are converted to it, exactly)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    # Scores in log2 units are s * scale. Without softcap or ALiBi, s is q.k masked but not
    # scaled: its row max times qk_scale (> 0) is the scaled scores' max, and each score's
    # scaling joins exp2's subtraction in one FFMA (a multiply per score fewer than scaling
    # first, which the max needs on its own)
    unscaled: tl.constexpr = not (HAS_SOFTCAP or HAS_ALIBI or BIAS_KIND != 0)
    s, _ = _scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                   window_right, 1.0 if unscaled else qk_scale, softcap, softmax_scale, slope,
                   MASKED, HAS_SOFTCAP, HAS_ALIBI)
    if BIAS_KIND != 0:
        s = s + _bias(bias, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, stride_bm,
                      stride_bn, BIAS_KIND)
    scale = qk_scale if unscaled else 1.0
    # -- online softmax: new row max, rescale what was accumulated --
    m_ij = tl.maximum(m_i, tl.max(s, 1) * scale)
    m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # rows that saw no key yet
    p = tl.math.exp2(s * scale - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = p * _dropout_scale(seed_lo, seed_hi, drop_row0, drop_col0, bh, offs_m[:, None],
                               offs_n[None, :], dropout_p)
    # -- update output accumulator --
    v = _load_kv(V, TABLE, start_n, stride_vn, stride_vp, page_size, seqlen_k, HEAD_DIM_V,
                 BLOCK_N, BLOCK_DV, not MASKED, USE_TMA, PAGED).to(DTYPE)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(DTYPE), v, acc, input_precision=INPUT_PRECISION)
    return acc, l_i, m_ij


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_vn, TABLE, stride_kp, stride_vp,
                    page_size, start_m, lo, hi, bh, seed_lo, seed_hi, drop_row0, drop_col0,
                    seqlen_q, seqlen_k, window_left, window_right, qk_scale, softcap,
                    softmax_scale, slope, dropout_p, bias, stride_bm, stride_bn, sparse,
                    sparse_cols, sparse_block, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    HAS_ALIBI: tl.constexpr,
                    HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                    WARP_SPECIALIZE: tl.constexpr, PAGED: tl.constexpr, PIPELINE: tl.constexpr,
                    BIAS_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr):
    """Key blocks [lo, hi) of query block start_m, a step (_attn_fwd_qk, then
    _attn_fwd_update) each. WARP_SPECIALIZE (Hopper, a kernel with this one loop): Triton
    gives the loop's TMA copies a warpgroup of their own and splits the query rows between two
    compute warpgroups (FlashAttention-3's producer/consumer layout). PIPELINE: the loop is
    software-pipelined by one block, q.k of block j + 1 issued before block j's softmax, so
    that on Hopper the asynchronous wgmma of the one runs beside the other's exp2s
    (FlashAttention-3's intra-warpgroup overlap), at the cost of a second score tile in
    registers. BLOCK_SPARSE (neither of those): the loop runs over the visible key tiles of
    [lo, hi) only, from this query block's row of block_mask's lists (sparse:
    _common.block_lists; sparse_block: the mask's key block size), each tile's keys by its
    index in the list: the hidden blocks cost neither loads nor matmuls, and the loop stays
    one that Triton can software-pipeline (a branch around each step would not be)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qk_args = (q, K, stride_kn, TABLE, stride_kp, page_size)  # no constexpr in a tuple
    up_args = (V, stride_vn, TABLE, stride_vp, page_size, offs_m)
    rest = (bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
            window_right, qk_scale, softcap, softmax_scale, slope, dropout_p, bias, stride_bm,
            stride_bn)
    if WARP_SPECIALIZE:  # older Tritons' tl.range has no warp_specialize (_ws_ok)
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            qk = _attn_fwd_qk(*qk_args, start_n, seqlen_k, MASKED, HEAD_DIM, BLOCK_D, BLOCK_N,
                              INPUT_PRECISION, USE_TMA, PAGED)
            acc, l_i, m_i = _attn_fwd_update(
                acc, l_i, m_i, qk, *up_args, start_n, *rest, MASKED, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION, USE_TMA, PAGED,
                BIAS_KIND, q.dtype)
    elif PIPELINE:
        if lo < hi:
            qk = _attn_fwd_qk(*qk_args, lo, seqlen_k, MASKED, HEAD_DIM, BLOCK_D, BLOCK_N,
                              INPUT_PRECISION, USE_TMA, PAGED)
            for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
                qk_next = _attn_fwd_qk(*qk_args, start_n, seqlen_k, MASKED, HEAD_DIM, BLOCK_D,
                                       BLOCK_N, INPUT_PRECISION, USE_TMA, PAGED)
                acc, l_i, m_i = _attn_fwd_update(
                    acc, l_i, m_i, qk, *up_args, start_n - BLOCK_N, *rest, MASKED, HAS_SOFTCAP,
                    HAS_ALIBI, HAS_DROPOUT, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION,
                    USE_TMA, PAGED, BIAS_KIND, q.dtype)
                qk = qk_next
            last = lo + (hi - lo - 1) // BLOCK_N * BLOCK_N
            acc, l_i, m_i = _attn_fwd_update(
                acc, l_i, m_i, qk, *up_args, last, *rest, MASKED, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION, USE_TMA, PAGED,
                BIAS_KIND, q.dtype)
    else:
        first, last = _loop_span(lo, hi, sparse, BLOCK_N, sparse_block, BLOCK_SPARSE)
        for i in range(first, last, 1 if BLOCK_SPARSE else BLOCK_N):
            start_n = _loop_tile(i, sparse, sparse_cols, BLOCK_N, sparse_block, BLOCK_SPARSE)
            qk = _attn_fwd_qk(*qk_args, start_n, seqlen_k, MASKED, HEAD_DIM, BLOCK_D, BLOCK_N,
                              INPUT_PRECISION, USE_TMA, PAGED)
            acc, l_i, m_i = _attn_fwd_update(
                acc, l_i, m_i, qk, *up_args, start_n, *rest, MASKED, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION, USE_TMA, PAGED,
                BIAS_KIND, q.dtype)
    return acc, l_i, m_i


# The dropout seed's halves and offsets: a new seed per call (per training step), or another
# block's offsets (a ring's), must not compile anew. Triton specializes integer arguments on
# their value (1) and divisibility (by 16), so a seed left to it would compile each kernel
# again for each of four such classes as they appear.
_SEED = ["seed_lo", "seed_hi", "drop_row0", "drop_col0"]


@_autotune("fwd")
@triton.heuristics({"FULL_TILES": _full_tiles})
@triton.jit(do_not_specialize=_SEED)
def _attn_fwd(Q, K, V, O, LSE, ALIBI, CU_Q, CU_K, TABLE,
              stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh, stride_ob, stride_on, stride_oh,
              stride_lb, stride_lh, stride_ab, stride_ah, stride_tb, page_size,
              nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket, tma_ok, ws_ok, window_left,
              window_right, qk_scale, softmax_scale, softcap, dropout_p, seed_lo, seed_hi,
              drop_row0, drop_col0, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, PAGED: tl.constexpr,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_DV: tl.constexpr, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
              FULL_TILES: tl.constexpr, PIPELINE: tl.constexpr = False,
              BIAS_KIND: tl.constexpr = 0, BIAS=None, stride_bb=0, stride_bh=0, stride_bm=0,
              stride_bn=0, HAS_DESCALE: tl.constexpr = False, K_DESCALE=None, V_DESCALE=None,
              stride_kdb=0, stride_kdh=0, stride_vdb=0, stride_vdh=0,
              BLOCK_SPARSE: tl.constexpr = False, SPARSE=None, stride_sb=0, stride_sh=0,
              stride_sr=0, sparse_cols=0, sparse_bq=128, sparse_bk=128):
    """PAGED pages may be float8 (a quantized KV cache): their tiles are converted to q's
    dtype as they are loaded (exact); HAS_DESCALE: their scales K_DESCALE, V_DESCALE (batch,
    nheads_kv), the key's folded into the softmax scale, the value's into the output, as in
    decode_triton's split-KV kernel. BLOCK_SPARSE: SPARSE (batch, nheads, query blocks of
    sparse_bq, 2 sparse_cols + 1) int32, block_mask's lists of visible key blocks (of
    sparse_bk keys) per query block (_sparse_args); not warp-specialized nor pipelined."""
    tl.static_assert(not (BLOCK_SPARSE and (WARP_SPECIALIZE or PIPELINE)),
                     "block_mask runs on the plain key loop only")
    start_m = _query_block_start(BLOCK_M)
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    off_hk = off_h // group_size
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k,
                                                     IS_VARLEN)
    Q += off_b * stride_qb + off_h * stride_qh + q_start * stride_qn
    if PAGED:  # K, V: (num_pages, page_size, nheads_kv, headdim), rows through TABLE
        K += off_hk * stride_kh
        V += off_hk * stride_vh
        TABLE += off_b * stride_tb
    else:
        K += off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
        V += off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    O += off_b * stride_ob + off_h * stride_oh + q_start * stride_on
    LSE += off_b * stride_lb + off_h * stride_lh + q_start
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah)
    bias = LSE  # attn_mask of this (batch, head) (BIAS_KIND); never read without one
    if BIAS_KIND != 0:
        bias = BIAS + off_b * stride_bb + off_h * stride_bh
    sparse = CU_K  # block_mask's lists of this query block; never read without one
    if BLOCK_SPARSE:
        sparse = SPARSE + off_b * stride_sb + off_h * stride_sh + (start_m // sparse_bq) * stride_sr
    if HAS_DESCALE:
        k_scale = tl.load(K_DESCALE + off_b * stride_kdb + off_hk * stride_kdh)
        qk_scale *= k_scale
        softmax_scale *= k_scale

    q = _load_held(Q, start_m, stride_qn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, WARP_SPECIALIZE)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # -- keys: [lo, mid_lo) masked, [mid_lo, mid_hi) unmasked, [mid_hi, hi) masked; warp-
    # specialized, all of [lo, hi) in one loop (Triton's Hopper pass takes one loop), masked
    # unless FULL_TILES --
    lo, mid_lo, mid_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                        BLOCK_M, BLOCK_N)
    first_hi = mid_lo
    if WARP_SPECIALIZE:
        first_hi = hi
    K = _tiles(K, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    V = _tiles(V, seqlen_k, stride_vn, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    args = (K, V, stride_kn, stride_vn, TABLE, stride_kb, stride_vb, page_size, start_m)
    rest = (off_bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
            window_right, qk_scale, softcap, softmax_scale, slope, dropout_p, bias, stride_bm,
            stride_bn, sparse, sparse_cols, sparse_bk)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, *args, lo, first_hi, *rest, not FULL_TILES,
                                    HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                    HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION,
                                    USE_TMA, WARP_SPECIALIZE, PAGED, PIPELINE, BIAS_KIND,
                                    BLOCK_SPARSE)
    if not WARP_SPECIALIZE:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, *args, mid_lo, mid_hi, *rest, False,
                                        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION,
                                        USE_TMA, False, PAGED, PIPELINE, BIAS_KIND, BLOCK_SPARSE)
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, *args, mid_hi, hi, *rest, True,
                                        HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                        HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION,
                                        USE_TMA, False, PAGED, PIPELINE, BIAS_KIND, BLOCK_SPARSE)

    # -- epilogue: normalize; a row that saw no key gives o = 0, lse = -inf --
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    acc = acc / l_safe[:, None]
    if HAS_DESCALE:
        acc = acc * tl.load(V_DESCALE + off_b * stride_vdb + off_hk * stride_vdh)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) / 1.4426950408889634)
    _store_block(O, acc, start_m, stride_on, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(LSE + offs_m, lse, mask=offs_m < seqlen_q)


# ----------------------------------------------------------------------------- backward

@triton.jit
def _attn_bwd_preprocess(O, DO, Delta, CU_Q, stride_ob, stride_on, stride_oh,
                         stride_dob, stride_don, stride_doh, stride_lb, stride_lh, nheads,
                         seqlen_q, IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    q_start, _, seqlen_q, _ = _sequence(CU_Q, CU_Q, off_b, seqlen_q, seqlen_q, IS_VARLEN)
    o = _load_block(O + off_b * stride_ob + off_h * stride_oh + q_start * stride_on, start_m,
                    stride_on, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
    do = _load_block(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_don, start_m,
                     stride_don, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(Delta + off_b * stride_lb + off_h * stride_lh + q_start + offs_m, delta,
             mask=offs_m < seqlen_q)


@triton.jit
def _load_head_tile(tiles, start, g, stride, n_rows, HEAD_DIM: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, ROWS_IN_BOUNDS: tl.constexpr,
                    USE_TMA: tl.constexpr, GROUPED: tl.constexpr):
    """_load_tile of query head g of a GQA group: with GROUPED from a (rows, group, HEAD_DIM)
    tensor descriptor of the group's heads (_attn_bwd_dkdv_ws), else from tiles of that head."""
    if GROUPED:
        # + 0.0: the tile through registers (exact but for a zero's sign). Triton's Hopper
        # pass (3.6.0) releases a copied tile's buffer after its last reader but does not
        # follow a reshape of the buffer (memdesc_reshape) to the dots that read through it:
        # it released q's and dO's right after the reshape, and the copy warpgroup could
        # refill them under the running wgmmas (dK/dV wrong on an H100; codegen's
        # ws_freed_before_read counts such reads: 8 per kernel before, 0 since).
        x = tiles.load([start, g, 0]).reshape(BLOCK_ROWS, BLOCK_D) + 0.0
    else:
        x = _load_tile(tiles, start, stride, n_rows, HEAD_DIM, BLOCK_ROWS, BLOCK_D,
                       ROWS_IN_BOUNDS, USE_TMA)
    return x


@triton.jit
def _attn_bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, stride_qn, stride_don, offs_n, start_m,
                        g, bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
                        window_left, window_right, qk_scale, softcap, softmax_scale, slope,
                        dropout_p, MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                        HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        USE_TMA: tl.constexpr,
                        GROUPED: tl.constexpr, PASS: tl.constexpr = 0, DQ_ACC=None,
                        stride_dqn=0, ATOMIC_DQ: tl.constexpr = False, bias=None, stride_bm=0,
                        stride_bn=0, BIAS_KIND: tl.constexpr = 0):
    """One query block (of query head g) of dK/dV: p^T recomputed from the saved lse,
    dV += p^T dO, dK += dS^T q (PASS 0: both; 1: dV alone; 2: dK alone, SPLIT); with ATOMIC_DQ
    also dQ += dS k, added into DQ_ACC (fp32, BLOCK_D columns: _tiles) by atomics. bias: head
    g's attn_mask (BIAS_KIND, _bias)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _load_head_tile(Q, start_m, g, stride_qn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, not MASKED,
                        USE_TMA, GROUPED)
    # lse = -inf marks a row that saw no key; +inf makes its probabilities exactly 0.
    lse = _load_rows(LSE, start_m, seqlen_q, BLOCK_M, float("inf"), not MASKED)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    # -- recompute p^T from the saved lse --
    # Row bounds only in the warp-specialized loop (GROUPED), whose compute warpgroups have
    # registers to spare; the 8-warp tiles sit at 255 registers (_visible).
    qkT = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
    sT, tT = _scores(qkT, offs_n[:, None], offs_m[None, :], seqlen_k, seqlen_q, window_right,
                     window_left, qk_scale, softcap, softmax_scale, slope, MASKED,
                     HAS_SOFTCAP, HAS_ALIBI, GROUPED)
    if BIAS_KIND != 0:
        sT = sT + _bias(bias, offs_n[:, None], offs_m[None, :], seqlen_k, seqlen_q, stride_bn,
                        stride_bm, BIAS_KIND)
    pT = tl.math.exp2(sT - lse[None, :] * 1.4426950408889634)
    # -- dV += p_dropped^T dO --
    do = _load_head_tile(DO, start_m, g, stride_don, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV,
                         not MASKED, USE_TMA, GROUPED)
    if PASS != 1:
        dpT = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
    if HAS_DROPOUT:
        scaleT = _dropout_scale(seed_lo, seed_hi, drop_row0, drop_col0, bh, offs_m[None, :],
                                offs_n[:, None], dropout_p)
        if PASS != 2:
            dv = tl.dot((pT * scaleT).to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        if PASS != 1:
            dpT = dpT * scaleT
    elif PASS != 2:
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
    if PASS != 1:
        # -- dS = p * (dP - delta), through softcap; dK += dS^T q --
        delta = _load_rows(Delta, start_m, seqlen_q, BLOCK_M, 0.0, not MASKED)
        dsT = pT * (dpT - delta[None, :])
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=INPUT_PRECISION)
        if ATOMIC_DQ:
            # -- dQ += dS k: this key block's share, added to what the others add --
            dq = tl.dot(tl.trans(dsT), k, input_precision=INPUT_PRECISION)  # (BLOCK_M, BLOCK_D)
            _add_block(DQ_ACC, dq, start_m, stride_dqn, seqlen_q, BLOCK_M, BLOCK_D, not MASKED,
                       USE_TMA)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, stride_qn, stride_don, start_n, lo, hi,
                         bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
                         window_left, window_right, qk_scale, softcap, softmax_scale, slope,
                         dropout_p, bias, stride_bm, stride_bn, sparse, sparse_cols,
                         sparse_block, MASKED: tl.constexpr,
                         HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                         PASS: tl.constexpr, DQ_ACC, stride_dqn, ATOMIC_DQ: tl.constexpr,
                         BIAS_KIND: tl.constexpr, BLOCK_SPARSE: tl.constexpr):
    """Query blocks [lo, hi) of one query head for key block start_n; BLOCK_SPARSE: only
    those block_mask keeps, from this key block's row of its transposed lists (as in
    _attn_fwd_inner)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    first, last = _loop_span(lo, hi, sparse, BLOCK_M, sparse_block, BLOCK_SPARSE)
    for i in range(first, last, 1 if BLOCK_SPARSE else BLOCK_M):
        start_m = _loop_tile(i, sparse, sparse_cols, BLOCK_M, sparse_block, BLOCK_SPARSE)
        dk, dv = _attn_bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE, Delta, stride_qn, stride_don,
                                     offs_n, start_m, 0, bh, seed_lo, seed_hi, drop_row0,
                                     drop_col0, seqlen_q, seqlen_k, window_left, window_right,
                                     qk_scale, softcap, softmax_scale, slope, dropout_p, MASKED,
                                     HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                     HEAD_DIM_V, BLOCK_DV, BLOCK_M, INPUT_PRECISION, USE_TMA,
                                     False, PASS, DQ_ACC, stride_dqn, ATOMIC_DQ, bias, stride_bm,
                                     stride_bn, BIAS_KIND)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_heads(dk, dv, k, v, Q, DO, LSE, Delta, ALIBI, DQ_ACC, stride_qb, stride_qn,
                         stride_qh, stride_dob, stride_don, stride_doh, stride_lb, stride_lh,
                         stride_ab, stride_ah, stride_dqb, stride_dqn, stride_dqh, off_b, off_hk,
                         q_start, start_n, lo, mid_lo, mid_hi, hi,
                         nheads, group_size, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q,
                         seqlen_k, window_left, window_right, qk_scale, softcap, softmax_scale,
                         dropout_p, bias, stride_bh, stride_bm, stride_bn, sparse, stride_sh,
                         sparse_cols, sparse_bq,
                         HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                         PASS: tl.constexpr, ATOMIC_DQ: tl.constexpr, BIAS_KIND: tl.constexpr,
                         BLOCK_SPARSE: tl.constexpr):
    """Every query head of key head off_hk's group, in turn, over the query blocks [lo, mid_lo)
    masked, [mid_lo, mid_hi) unmasked, [mid_hi, hi) masked. GQA without atomics: dK, dV are
    deterministic (dQ, with ATOMIC_DQ, is not). bias: batch off_b's attn_mask (BIAS_KIND);
    sparse: its block_mask (BLOCK_SPARSE)."""
    for g in range(group_size):
        off_h = off_hk * group_size + g
        Q_h = _tiles(Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qn, seqlen_q,
                     stride_qn, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
        DO_h = _tiles(DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_don,
                      seqlen_q, stride_don, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
        LSE_h = LSE + off_b * stride_lb + off_h * stride_lh + q_start
        Delta_h = Delta + off_b * stride_lb + off_h * stride_lh + q_start
        DQ_h = DQ_ACC
        if ATOMIC_DQ:
            DQ_h = _tiles(DQ_ACC + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqn,
                          seqlen_q, stride_dqn, BLOCK_D, BLOCK_M, BLOCK_D, USE_TMA)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah)
        bias_h = bias
        if BIAS_KIND != 0:
            bias_h = bias + off_h * stride_bh
        sparse_h = sparse
        if BLOCK_SPARSE:
            sparse_h = sparse + off_h * stride_sh
        args = (Q_h, DO_h, LSE_h, Delta_h, stride_qn, stride_don, start_n)
        rest = (off_b * nheads + off_h, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
                window_left, window_right, qk_scale, softcap, softmax_scale, slope, dropout_p,
                bias_h, stride_bm, stride_bn, sparse_h, sparse_cols, sparse_bq)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, *args, lo, mid_lo, *rest, True, HAS_SOFTCAP,
                                      HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                                      BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA, PASS,
                                      DQ_h, stride_dqn, ATOMIC_DQ, BIAS_KIND, BLOCK_SPARSE)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, *args, mid_lo, mid_hi, *rest, False,
                                      HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                      HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION,
                                      USE_TMA, PASS, DQ_h, stride_dqn, ATOMIC_DQ, BIAS_KIND,
                                      BLOCK_SPARSE)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, *args, mid_hi, hi, *rest, True, HAS_SOFTCAP,
                                      HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                                      BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA, PASS,
                                      DQ_h, stride_dqn, ATOMIC_DQ, BIAS_KIND, BLOCK_SPARSE)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_ws(dk, dv, k, v, Q, DO, LSE, Delta, ALIBI, stride_qn, stride_qh, stride_don,
                      stride_doh, stride_lh, stride_ah, start_n, lo, hi, group_size, bh, seed_lo,
                      seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left, window_right,
                      qk_scale, softcap, softmax_scale, dropout_p, MASKED: tl.constexpr,
                      HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """Query blocks [lo, hi) of every query head g of the group (Q, DO, LSE, Delta, ALIBI and bh
    at the group's first head) for key block start_n, warp-specialized (Hopper): one loop over
    (g, query block), every block masked if MASKED (not FULL_TILES), q and dO by TMA copies
    through (seqlen_q, group_size, HEAD_DIM) descriptors. Triton's Hopper pass takes only a
    kernel with one loop, so the GQA loop of _attn_bwd_dkdv is folded into it; it gives the
    copies a warpgroup and splits the key rows between two compute warpgroups (FlashAttention-
    3's backward layout)."""
    Q = tl.make_tensor_descriptor(Q, shape=[seqlen_q, group_size, HEAD_DIM],
                                  strides=[stride_qn, stride_qh, 1],
                                  block_shape=[BLOCK_M, 1, BLOCK_D])
    DO = tl.make_tensor_descriptor(DO, shape=[seqlen_q, group_size, HEAD_DIM_V],
                                   strides=[stride_don, stride_doh, 1],
                                   block_shape=[BLOCK_M, 1, BLOCK_DV])
    offs_n = start_n + tl.arange(0, BLOCK_N)
    blocks = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
    for i in tl.range(0, group_size * blocks, warp_specialize=True):
        g = i // blocks
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(ALIBI + g * stride_ah)
        dk, dv = _attn_bwd_dkdv_step(dk, dv, k, v, Q, DO, LSE + g * stride_lh,
                                     Delta + g * stride_lh, stride_qn, stride_don, offs_n,
                                     lo + (i - g * blocks) * BLOCK_M, g, bh + g, seed_lo, seed_hi,
                                     drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
                                     window_right, qk_scale, softcap, softmax_scale, slope,
                                     dropout_p, MASKED, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT,
                                     HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_M,
                                     INPUT_PRECISION, True, True)
    return dk, dv


@_autotune("dkdv")
@triton.heuristics({"FULL_TILES": _full_tiles})
@triton.jit(do_not_specialize=_SEED)
def _attn_bwd_dkdv(Q, K, V, DO, LSE, Delta, DK, DV, DQ_ACC, ALIBI, CU_Q, CU_K,
                   stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                   stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                   stride_dkb, stride_dkn, stride_dkh, stride_dvb, stride_dvn, stride_dvh,
                   stride_dqb, stride_dqn, stride_dqh,
                   stride_lb, stride_lh, stride_ab, stride_ah,
                   nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket, tma_ok, ws_ok,
                   atomic_dq, window_left, window_right, qk_scale, softmax_scale, softcap,
                   dropout_p, seed_lo, seed_hi, drop_row0, drop_col0,
                   HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                   FULL_TILES: tl.constexpr, SPLIT: tl.constexpr = False,
                   ATOMIC_DQ: tl.constexpr = False, BIAS_KIND: tl.constexpr = 0, BIAS=None,
                   stride_bb=0, stride_bh=0, stride_bm=0, stride_bn=0,
                   BLOCK_SPARSE: tl.constexpr = False, SPARSE=None, stride_sb=0, stride_sh=0,
                   stride_sr=0, sparse_cols=0, sparse_bq=128, sparse_bk=128):
    """BLOCK_SPARSE: SPARSE (batch, nheads, key blocks, 2 sparse_cols + 1) int32, block_mask's
    lists of visible query blocks per key block (transposed, _sparse_args)."""
    tl.static_assert(not (BLOCK_SPARSE and WARP_SPECIALIZE),
                     "block_mask runs on the query loops that are not warp-specialized")
    start_n = tl.program_id(0) * BLOCK_N
    off_bhk = tl.program_id(1).to(tl.int64)
    nheads_kv = nheads // group_size
    off_b, off_hk = off_bhk // nheads_kv, off_bhk % nheads_kv
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k,
                                                     IS_VARLEN)
    K += off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    V += off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    bias = LSE  # attn_mask of this batch entry (BIAS_KIND); never read without one
    if BIAS_KIND != 0:
        bias = BIAS + off_b * stride_bb
    sparse = CU_K  # block_mask's lists of this key block (BLOCK_SPARSE); never read without
    if BLOCK_SPARSE:
        sparse = SPARSE + off_b * stride_sb + (start_n // sparse_bk) * stride_sr

    # -- queries: [lo, mid_lo) masked, [mid_lo, mid_hi) unmasked, [mid_hi, hi) masked; warp-
    # specialized, all of [lo, hi), of every query head of the group, in one loop, masked
    # unless FULL_TILES --
    lo, mid_lo, mid_hi, hi = _query_range(start_n, seqlen_q, seqlen_k, window_left, window_right,
                                          BLOCK_M, BLOCK_N)
    k = _load_held(K, start_n, stride_kn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, WARP_SPECIALIZE)
    v = _load_held(V, start_n, stride_vn, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV,
                   WARP_SPECIALIZE)
    heads = (Q, DO, LSE, Delta, ALIBI, DQ_ACC, stride_qb, stride_qn, stride_qh, stride_dob,
             stride_don, stride_doh, stride_lb, stride_lh, stride_ab, stride_ah, stride_dqb,
             stride_dqn, stride_dqh, off_b, off_hk, q_start, start_n, lo, mid_lo, mid_hi, hi,
             nheads, group_size, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
             window_left, window_right, qk_scale, softcap, softmax_scale, dropout_p, bias,
             stride_bh, stride_bm, stride_bn, sparse, stride_sh, sparse_cols, sparse_bq)
    if SPLIT:  # program_id(2): 0 accumulates dV alone, 1 dK alone
        if tl.program_id(2) == 0:
            dk, dv = _attn_bwd_dkdv_heads(dk, dv, k, v, *heads, HAS_SOFTCAP, HAS_ALIBI,
                                          HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                                          BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA, 1,
                                          ATOMIC_DQ, BIAS_KIND, BLOCK_SPARSE)
            _store_block(DV + off_b * stride_dvb + off_hk * stride_dvh + k_start * stride_dvn, dv,
                         start_n, stride_dvn, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
        else:
            dk, dv = _attn_bwd_dkdv_heads(dk, dv, k, v, *heads, HAS_SOFTCAP, HAS_ALIBI,
                                          HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                                          BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA, 2,
                                          ATOMIC_DQ, BIAS_KIND, BLOCK_SPARSE)
            _store_block(DK + off_b * stride_dkb + off_hk * stride_dkh + k_start * stride_dkn,
                         dk * softmax_scale, start_n, stride_dkn, seqlen_k, HEAD_DIM, BLOCK_N,
                         BLOCK_D)
    else:
        if WARP_SPECIALIZE:
            off_h = off_hk * group_size  # the group's first query head
            dk, dv = _attn_bwd_dkdv_ws(
                dk, dv, k, v, Q + off_b * stride_qb + off_h * stride_qh + q_start * stride_qn,
                DO + off_b * stride_dob + off_h * stride_doh + q_start * stride_don,
                LSE + off_b * stride_lb + off_h * stride_lh + q_start,
                Delta + off_b * stride_lb + off_h * stride_lh + q_start,
                ALIBI + off_b * stride_ab + off_h * stride_ah, stride_qn, stride_qh, stride_don,
                stride_doh, stride_lh, stride_ah, start_n, lo, hi, group_size,
                off_b * nheads + off_h, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k,
                window_left, window_right, qk_scale, softcap, softmax_scale, dropout_p,
                not FULL_TILES, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION)
        else:
            dk, dv = _attn_bwd_dkdv_heads(dk, dv, k, v, *heads, HAS_SOFTCAP, HAS_ALIBI,
                                          HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                                          BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA, 0,
                                          ATOMIC_DQ, BIAS_KIND, BLOCK_SPARSE)
        _store_block(DK + off_b * stride_dkb + off_hk * stride_dkh + k_start * stride_dkn,
                     dk * softmax_scale, start_n, stride_dkn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D)
        _store_block(DV + off_b * stride_dvb + off_hk * stride_dvh + k_start * stride_dvn, dv,
                     start_n, stride_dvn, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV)


@triton.jit
def _attn_bwd_dq_step(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, start_n, bh,
                      seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
                      window_right, qk_scale, softcap, softmax_scale, slope, dropout_p,
                      MASKED: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                      HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, bias=None,
                      stride_bm=0, stride_bn=0, dbias=None, stride_dbm=0,
                      BIAS_KIND: tl.constexpr = 0, BIAS_GRAD: tl.constexpr = False):
    """One key block of dQ: p recomputed from the saved lse, dQ += dS k. bias: this (batch,
    head)'s attn_mask (BIAS_KIND, _bias); BIAS_GRAD: dS before softcap and the scale (the
    mask's gradient) stored into dbias, this (batch, head)'s rows of the scores' gradient."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = _load_tile(K, start_n, stride_kn, seqlen_k, HEAD_DIM, BLOCK_N, BLOCK_D, not MASKED,
                   USE_TMA)
    v = _load_tile(V, start_n, stride_vn, seqlen_k, HEAD_DIM_V, BLOCK_N, BLOCK_DV, not MASKED,
                   USE_TMA)
    # -- recompute p from the saved lse --
    qk = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
    s, t = _scores(qk, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, window_left,
                   window_right, qk_scale, softcap, softmax_scale, slope, MASKED, HAS_SOFTCAP,
                   HAS_ALIBI)
    if BIAS_KIND != 0:
        s = s + _bias(bias, offs_m[:, None], offs_n[None, :], seqlen_q, seqlen_k, stride_bm,
                      stride_bn, BIAS_KIND)
    p = tl.math.exp2(s - lse[:, None])
    # -- dS = p * (dP - delta), through dropout and softcap; dQ += dS k --
    dp = tl.dot(do, tl.trans(v), input_precision=INPUT_PRECISION)
    if HAS_DROPOUT:
        dp = dp * _dropout_scale(seed_lo, seed_hi, drop_row0, drop_col0, bh, offs_m[:, None],
                                 offs_n[None, :], dropout_p)
    ds = p * (dp - delta[:, None])
    if BIAS_GRAD:
        rows, cols = offs_m[:, None], offs_n[None, :]
        tl.store(dbias + rows.to(tl.int64) * stride_dbm + cols, ds,
                 mask=(rows < seqlen_q) & (cols < seqlen_k))
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_vn, start_m, lo, hi, bh,
                       seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
                       window_right, qk_scale, softcap, softmax_scale, slope, dropout_p, bias,
                       stride_bm, stride_bn, dbias, stride_dbm, sparse, sparse_cols,
                       sparse_block, MASKED: tl.constexpr,
                       HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                       HAS_DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
                       WARP_SPECIALIZE: tl.constexpr, BIAS_KIND: tl.constexpr,
                       BIAS_GRAD: tl.constexpr, BLOCK_SPARSE: tl.constexpr):
    """Key blocks [lo, hi) of query block start_m; WARP_SPECIALIZE and BLOCK_SPARSE as in
    _attn_fwd_inner."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    if WARP_SPECIALIZE:  # older Tritons' tl.range has no warp_specialize (_ws_ok)
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            dq = _attn_bwd_dq_step(
                dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, start_n, bh, seed_lo,
                seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left, window_right,
                qk_scale, softcap, softmax_scale, slope, dropout_p, MASKED, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION,
                USE_TMA, bias, stride_bm, stride_bn, dbias, stride_dbm, BIAS_KIND, BIAS_GRAD)
    else:
        first, last = _loop_span(lo, hi, sparse, BLOCK_N, sparse_block, BLOCK_SPARSE)
        for i in range(first, last, 1 if BLOCK_SPARSE else BLOCK_N):
            start_n = _loop_tile(i, sparse, sparse_cols, BLOCK_N, sparse_block, BLOCK_SPARSE)
            dq = _attn_bwd_dq_step(
                dq, q, do, lse, delta, K, V, stride_kn, stride_vn, offs_m, start_n, bh, seed_lo,
                seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left, window_right,
                qk_scale, softcap, softmax_scale, slope, dropout_p, MASKED, HAS_SOFTCAP, HAS_ALIBI,
                HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BLOCK_N, INPUT_PRECISION,
                USE_TMA, bias, stride_bm, stride_bn, dbias, stride_dbm, BIAS_KIND, BIAS_GRAD)
    return dq


@_autotune("dq")
@triton.heuristics({"FULL_TILES": _full_tiles})
@triton.jit(do_not_specialize=_SEED)
def _attn_bwd_dq(Q, K, V, DO, LSE, Delta, DQ, ALIBI, CU_Q, CU_K,
                 stride_qb, stride_qn, stride_qh, stride_kb, stride_kn, stride_kh,
                 stride_vb, stride_vn, stride_vh, stride_dob, stride_don, stride_doh,
                 stride_dqb, stride_dqn, stride_dqh, stride_lb, stride_lh, stride_ab, stride_ah,
                 nheads, group_size, seqlen_q, seqlen_k, seqlen_bucket, tma_ok, ws_ok,
                 window_left, window_right, qk_scale, softmax_scale, softcap, dropout_p, seed_lo,
                 seed_hi, drop_row0, drop_col0,
                 HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 IS_VARLEN: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                 INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                 FULL_TILES: tl.constexpr, BIAS_KIND: tl.constexpr = 0, BIAS=None, stride_bb=0,
                 stride_bh=0, stride_bm=0, stride_bn=0, BIAS_GRAD: tl.constexpr = False,
                 DBIAS=None, stride_dbh=0, stride_dbm=0, BLOCK_SPARSE: tl.constexpr = False,
                 SPARSE=None, stride_sb=0, stride_sh=0, stride_sr=0, sparse_cols=0, sparse_bq=128,
                 sparse_bk=128):
    """BLOCK_SPARSE: SPARSE as the forward's (_attn_fwd)."""
    tl.static_assert(not (BLOCK_SPARSE and WARP_SPECIALIZE),
                     "block_mask runs on the key loops that are not warp-specialized")
    start_m = _query_block_start(BLOCK_M)
    off_bh = tl.program_id(1).to(tl.int64)
    off_b, off_h = off_bh // nheads, off_bh % nheads
    off_hk = off_h // group_size
    q_start, k_start, seqlen_q, seqlen_k = _sequence(CU_Q, CU_K, off_b, seqlen_q, seqlen_k,
                                                     IS_VARLEN)
    K += off_b * stride_kb + off_hk * stride_kh + k_start * stride_kn
    V += off_b * stride_vb + off_hk * stride_vh + k_start * stride_vn
    Q += off_b * stride_qb + off_h * stride_qh + q_start * stride_qn
    DO += off_b * stride_dob + off_h * stride_doh + q_start * stride_don
    q = _load_held(Q, start_m, stride_qn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D, WARP_SPECIALIZE)
    do = _load_held(DO, start_m, stride_don, seqlen_q, HEAD_DIM_V, BLOCK_M, BLOCK_DV,
                    WARP_SPECIALIZE)
    stats = off_b * stride_lb + off_h * stride_lh + q_start
    if WARP_SPECIALIZE:
        lse = _load_rows_tma(LSE + stats, start_m, seqlen_q, BLOCK_M)
        delta = _load_rows_tma(Delta + stats, start_m, seqlen_q, BLOCK_M)
    else:
        lse = _load_rows(LSE + stats, start_m, seqlen_q, BLOCK_M, float("inf"))
        delta = _load_rows(Delta + stats, start_m, seqlen_q, BLOCK_M, 0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_ab + off_h * stride_ah)
    bias = LSE  # attn_mask of this (batch, head) (BIAS_KIND); never read without one
    if BIAS_KIND != 0:
        bias = BIAS + off_b * stride_bb + off_h * stride_bh
    dbias = LSE  # its gradient's rows (BIAS_GRAD: (batch, nheads, ...) contiguous)
    if BIAS_GRAD:
        dbias = DBIAS + off_bh * stride_dbh
    sparse = CU_K  # block_mask's lists of this query block (BLOCK_SPARSE); never read without
    if BLOCK_SPARSE:
        sparse = SPARSE + off_b * stride_sb + off_h * stride_sh + (start_m // sparse_bq) * stride_sr
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- keys: the same ranges as the forward (warp-specialized: all of [lo, hi) in one loop,
    # masked unless FULL_TILES) --
    lo, mid_lo, mid_hi, hi = _key_range(start_m, seqlen_q, seqlen_k, window_left, window_right,
                                        BLOCK_M, BLOCK_N)
    first_hi = mid_lo
    if WARP_SPECIALIZE:
        first_hi = hi
    K = _tiles(K, seqlen_k, stride_kn, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    V = _tiles(V, seqlen_k, stride_vn, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    args = (K, V, stride_kn, stride_vn, start_m)
    rest = (off_bh, seed_lo, seed_hi, drop_row0, drop_col0, seqlen_q, seqlen_k, window_left,
            window_right, qk_scale, softcap, softmax_scale, slope, dropout_p, bias, stride_bm,
            stride_bn, dbias, stride_dbm, sparse, sparse_cols, sparse_bk)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, *args, lo, first_hi, *rest, not FULL_TILES,
                            HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D, HEAD_DIM_V,
                            BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA,
                            WARP_SPECIALIZE, BIAS_KIND, BIAS_GRAD, BLOCK_SPARSE)
    if not WARP_SPECIALIZE:
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, *args, mid_lo, mid_hi, *rest, False,
                                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA,
                                False, BIAS_KIND, BIAS_GRAD, BLOCK_SPARSE)
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, *args, mid_hi, hi, *rest, True,
                                HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HEAD_DIM, BLOCK_D,
                                HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, INPUT_PRECISION, USE_TMA,
                                False, BIAS_KIND, BIAS_GRAD, BLOCK_SPARSE)
    _store_block(DQ + off_b * stride_dqb + off_h * stride_dqh + q_start * stride_dqn,
                 dq * softmax_scale, start_m, stride_dqn, seqlen_q, HEAD_DIM, BLOCK_M, BLOCK_D)


# ----------------------------------------------------------------------------- range probe

@triton.jit
def _range_probe(OUT, seqlen_q, seqlen_k, window_left, window_right, KEYS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes (lo, mid_lo, mid_hi, hi) of block program_id(0), as the kernels compute them."""
    start = tl.program_id(0) * (BLOCK_M if KEYS else BLOCK_N)
    if KEYS:
        lo, mid_lo, mid_hi, hi = _key_range(start, seqlen_q, seqlen_k, window_left, window_right,
                                            BLOCK_M, BLOCK_N)
    else:
        lo, mid_lo, mid_hi, hi = _query_range(start, seqlen_q, seqlen_k, window_left,
                                              window_right, BLOCK_M, BLOCK_N)
    offs = tl.arange(0, 4)
    values = tl.where(offs == 0, lo, tl.where(offs == 1, mid_lo, tl.where(offs == 2, mid_hi, hi)))
    tl.store(OUT + tl.program_id(0) * 4 + offs, values)


def block_ranges(seqlen_q, seqlen_k, window_left=-1, window_right=-1, block_m=128, block_n=64,
                 keys=True, device="cuda"):
    """The (lo, mid_lo, mid_hi, hi) ranges the kernels loop over, one row per query block
    (keys=True: the forward and dQ kernels) or per key block (keys=False: dK/dV), computed
    by the kernels' own range functions. For measuring blocks visited and for tests."""
    n_blocks = triton.cdiv(seqlen_q, block_m) if keys else triton.cdiv(seqlen_k, block_n)
    out = torch.empty((n_blocks, 4), dtype=torch.int32, device=device)
    _range_probe[(n_blocks,)](out, seqlen_q, seqlen_k, window_left, window_right, KEYS=keys,
                              BLOCK_M=block_m, BLOCK_N=block_n)
    return out


# ----------------------------------------------------------------------------- launchers

def _last_dim_contiguous(*xs):
    return [x if x.stride(-1) == 1 else x.contiguous() for x in xs]


def _strides(x):
    """(batch, seqlen, head) strides; packed (total, nheads, headdim) tensors have batch 0."""
    return (0, *x.stride()[:2]) if x.dim() == 3 else tuple(x.stride()[:3])


def _tma_allocator(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_ok(*tiled):
    """1 if the TMA candidates may run on these tensors (those whose tiles a TMA kernel
    copies), else 0. A TMA copy needs Hopper or newer, a 16-byte aligned start and row strides
    that are multiples of 16 bytes (the head dim is any: the copy zero-fills past it); a tensor
    descriptor made on the device needs scratch memory from Triton's allocator, torch's unless
    the caller set one (triton.set_allocator). 16-bit inputs only (fp32 is not compiled with
    TMA in the codegen report). LONGFLASH_TMA=0 in the environment turns TMA off; so does
    ROCm (its GPUs report capabilities of their own: an MI300's is 9.4; no TMA there)."""
    x = tiled[0]
    if (_INTERPRET or os.environ.get("LONGFLASH_TMA", "1") == "0" or not x.is_cuda
            or torch.version.hip or torch.cuda.get_device_capability(x.device)[0] < 9
            or x.dtype not in (torch.float16, torch.bfloat16)
            or not hasattr(tl, "make_tensor_descriptor")):
        return 0
    if not all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(-3) > 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in tiled):
        return 0
    try:
        from triton.runtime import _allocation
        if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            triton.set_allocator(_tma_allocator)
    except (ImportError, AttributeError):  # a Triton whose allocator we cannot see: no TMA
        return 0
    return 1


WS_KERNELS = ("fwd", "dkdv", "dq")
# LONGFLASH_WS when unset (experiments.results.KERNEL_SWITCHES keeps the same default, so that
# the rows of a run name the switches it set otherwise)
WS_DEFAULT = "0"


def ws_kernels():
    """The kernels whose warp-specialized candidates LONGFLASH_WS turns on: "0" (the default)
    none, "1" all three, or a comma-separated list of "fwd", "dkdv", "dq" (LONGFLASH_WS=fwd:
    the forward's alone). A ValueError naming the variable for anything else."""
    return _parse_ws(os.environ.get("LONGFLASH_WS", WS_DEFAULT))


@functools.lru_cache(maxsize=16)  # read on every call: a launch's host time counts
def _parse_ws(value):
    value = value.strip()
    if value in ("", "0"):
        return frozenset()
    if value == "1":
        return frozenset(WS_KERNELS)
    names = [name.strip() for name in value.split(",")]
    if any(name not in WS_KERNELS for name in names):
        raise ValueError(f"LONGFLASH_WS must be 0, 1 or a comma-separated list of "
                         f"{', '.join(WS_KERNELS)} (the kernels whose warp-specialized "
                         f"candidates may run), got {value!r}")
    return frozenset(names)


def _ws_ok(kernel, *tiled):
    """1 if `kernel`'s ("fwd", "dkdv", "dq") warp-specialized candidates may run: turned on by
    LONGFLASH_WS (ws_kernels), TMA for every tile they copy (_tma_ok; q, k and v in the
    forward, q, k, v and dO in the backward), a Hopper GPU (the sm_90 pass; Blackwell's is
    another, not compiled here) and a Triton whose tl.range takes warp_specialize. Off by
    default: on an H100 with Triton 3.6.0 they returned NaN where the TMA and pointer
    candidates were exact (the GPU campaign's preflight and test_every_config_gpu, PERFLOG);
    since two workarounds the forward's were exact in two windows' preflights, dK/dV's at
    head dim 128 still NaN with grouped query heads."""
    if (kernel not in ws_kernels() or not _tma_ok(*tiled)
            or torch.cuda.get_device_capability(tiled[0].device)[0] != 9):
        return 0
    return int("warp_specialize" in inspect.signature(tl.range).parameters)


def _atomic_dq(q, headdim, deterministic, tma_ok=1):
    """Whether dK/dV computes dQ too (ATOMIC candidates; no dQ kernel): only where the caller
    allows a non-deterministic backward (deterministic=False, torch's deterministic mode off)
    and this GPU's and head dim's dK/dV table has such candidates that may run on these inputs
    (TMA ones only if tma_ok), so the autotuner, which keeps the kind chosen here, has one; a
    single config (forced, forced_configs, or the interpreter's) as it is."""
    configs = _attn_bwd_dkdv.configs
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if len(configs) == 1:
        atomic = bool(configs[0].kwargs.get("ATOMIC_DQ"))
        if atomic and deterministic:
            raise ValueError("deterministic=True (or torch.use_deterministic_algorithms, or a "
                             "gradient for attn_mask, which the dQ kernel computes) with a "
                             "forced dK/dV config that adds dQ by atomics (flash_triton.ATOMIC): "
                             "force another config or pass deterministic=False")
        return atomic
    major = torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 9
    return not deterministic and any(ATOMIC in c and (TMA not in c or tma_ok)
                                     for c in CONFIGS[_table_key("dkdv", major, headdim)])


_LISTS = {}  # (id(block_mask), tag) -> (weakref to it, its version, its lists)


def _capturing(x):
    """Whether x's device is capturing a CUDA graph."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _cached_lists(block_mask, tag, make):
    """make(), lists of block_mask's, made once per mask and tag (which lists: a hashable): the
    same tensor, unchanged since (its version counter, which in-place writes through any view
    advance), gets back the lists made for it, so a model that hands one mask to every layer
    makes them once, not once per layer and pass (each a few kernel launches). An entry goes
    when its mask does. Made afresh, and not kept, for inference tensors (no version counter)
    and while a CUDA graph is captured (each replay must remake them from what the mask then
    holds)."""
    if block_mask.is_inference() or _capturing(block_mask):
        return make()
    key = (id(block_mask), tag)
    entry = _LISTS.get(key)
    if entry is not None and entry[0]() is block_mask and entry[1] == block_mask._version:
        return entry[2]
    lists = make()
    _LISTS[key] = (weakref.ref(block_mask, lambda _, key=key: _LISTS.pop(key, None)),
                   block_mask._version, lists)
    return lists


def _cached_block_lists(block_mask, transposed):
    """block_lists of block_mask (transposed: of its last two dimensions swapped), made once
    per mask (_cached_lists)."""
    return _cached_lists(block_mask, transposed, lambda: block_lists(
        block_mask.transpose(-1, -2) if transposed else block_mask))


def _sparse_args(opts, batch, nheads, transposed=False):
    """block_mask as a kernel reads it: {} without one, else SPARSE, its lists of visible key
    blocks per query block (block_lists; transposed: of visible query blocks per key block,
    for dK/dV), a (batch, nheads, rows, 2 cols + 1) view (broadcast dimensions at stride 0:
    made once for the mask's own batch and heads), its strides and cols.
    (N / block)^2 x 8 bytes beside the mask's own (N / block)^2 bools. The block sizes go
    with every call (_launch_args: the autotuner's key, _fit_blocks)."""
    if opts.block_mask is None:
        return {}
    lists = _cached_block_lists(opts.block_mask, transposed)
    lists = lists.expand(batch, nheads, *lists.shape[2:])
    cols = opts.block_mask.shape[-2 if transposed else -1]
    return dict(SPARSE=lists, sparse_cols=cols,
                **dict(zip(("stride_sb", "stride_sh", "stride_sr"), lists.stride()[:3])))


def _bias_args(mask, batch, nheads, seqlen_q, seqlen_k):
    """attn_mask as the kernels read it: {} without one, else BIAS, a (batch, nheads, seqlen_q,
    seqlen_k) view (broadcast dimensions at stride 0: nothing copied), its strides, and
    BIAS_KIND: 1 a float mask, added to the scores; 2 a boolean one, read as uint8."""
    if mask is None:
        return {}
    bias = mask.expand(batch, nheads, seqlen_q, seqlen_k)
    if bias.dtype == torch.bool:
        bias = bias.view(torch.uint8)
    return dict(BIAS=bias, **dict(zip(("stride_bb", "stride_bh", "stride_bm", "stride_bn"),
                                      bias.stride())))


@functools.lru_cache(maxsize=None)
def _unit_scale(device):  # kept: a decoding step allocates nothing for a missing scale
    return torch.ones((), dtype=torch.float32, device=device).expand(1, 1)


def _descale_args(k_descale, v_descale, device):
    """A float8 cache's (batch, nheads_kv) scales as the kernels read them (1 if None)."""
    k_descale, v_descale = (_unit_scale(device) if x is None else x
                            for x in (k_descale, v_descale))
    return dict(K_DESCALE=k_descale, V_DESCALE=v_descale,
                stride_kdb=k_descale.stride(0), stride_kdh=k_descale.stride(1),
                stride_vdb=v_descale.stride(0), stride_vdh=v_descale.stride(1))


def check_fp8(cache):
    """A float8 cache the kernels can convert on this device (Triton has no float8_e4m3fn
    conversion before compute capability 8.9)."""
    if cache.dtype == torch.float8_e4m3fn and cache.is_cuda and \
            torch.cuda.get_device_capability(cache.device) < (8, 9):
        raise NotImplementedError(
            f"a float8_e4m3fn cache needs a GPU of compute capability 8.9 or more for Triton "
            f"({torch.cuda.get_device_name(cache.device)}); use float8_e5m2 or "
            f"backend='torch'")


def _launch_args(q, k, v, lse, opts, tiled, ws_tiled, ws_kernel):
    """Shapes, strides and scalars shared by the three main kernels: TMA candidates where
    `tiled` (what a loop copies) fit, warp-specialized ones of `ws_kernel` where `ws_tiled`
    (every tile) do and LONGFLASH_WS allows them (_ws_ok), none with an attn_mask (their loops
    read only TMA copies) or a block_mask (their loops skip no block) nor on packed sequences
    (the forward's raised an illegal instruction on an H100 with Triton 3.6.0 over
    attention_varlen's, the fourth window's gate)."""
    if opts.varlen:
        batch, seqlen_q, seqlen_k = opts.cu_seqlens_q.numel() - 1, opts.max_seqlen_q, \
            opts.max_seqlen_k
        lse_strides = (0, lse.stride(0))  # lse: (nheads, total_q)
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lse_strides = lse.stride()[:2]  # lse: (batch, nheads, seqlen_q)
    nheads, headdim, nheads_kv = q.shape[-2], q.shape[-1], k.shape[-2]
    alibi, mask, sparse = opts.alibi_slopes, opts.attn_mask, opts.block_mask is not None
    dummy = lse  # a valid pointer for the disabled features; never read
    pointers = dict(ALIBI=dummy if alibi is None else alibi,
                    CU_Q=dummy if not opts.varlen else opts.cu_seqlens_q,
                    CU_K=dummy if not opts.varlen else opts.cu_seqlens_k)
    scalars = dict(
        stride_lb=lse_strides[0], stride_lh=lse_strides[1],
        stride_ab=0 if alibi is None else alibi.stride(0),
        stride_ah=0 if alibi is None else alibi.stride(1),
        nheads=nheads, group_size=nheads // nheads_kv, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        seqlen_bucket=seqlen_bucket(seqlen_q, seqlen_k), tma_ok=_tma_ok(*tiled),
        ws_ok=int(mask is None and not sparse and not opts.varlen
                  and _ws_ok(ws_kernel, *ws_tiled)),
        window_left=opts.window_left, window_right=opts.window_right,
        sparse_bq=opts.block_size_q, sparse_bk=opts.block_size_k,
        qk_scale=opts.softmax_scale * LOG2E, softmax_scale=opts.softmax_scale,
        softcap=opts.softcap, dropout_p=opts.dropout_p,
        seed_lo=opts.seed & 0xFFFFFFFF, seed_hi=(opts.seed >> 32) & 0xFFFFFFFF,
        drop_row0=opts.dropout_row0, drop_col0=opts.dropout_col0,
        **constexprs(headdim, q.dtype == torch.float32, opts.varlen, opts.softcap > 0,
                     alibi is not None, opts.dropout_p > 0, v.shape[-1],
                     0 if mask is None else 2 if mask.dtype == torch.bool else 1, sparse),
        **_bias_args(mask, batch, nheads, seqlen_q, seqlen_k), **_sparse_args(opts, batch, nheads),
    )
    return batch, nheads, nheads_kv, seqlen_q, seqlen_k, pointers, scalars


def on_tensor_device(fn):
    """fn run with its first argument's CUDA device current: Triton launches on the current
    device and its current stream, so a call on tensors of cuda:1 while cuda:0 is current (a
    model spread over GPUs in one process, as accelerate's device_map places it) would launch
    on cuda:0 with cuda:1's pointers. FlashAttention's CUDA extension takes a device guard
    likewise."""
    @functools.wraps(fn)
    def on_device(x, *args, **kwargs):
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)
    return on_device


@on_tensor_device
def forward(q, k, v, opts):
    """o like q (v's head dim); lse (batch, nheads, seqlen_q), or (nheads, total_q) for packed
    sequences."""
    q, k, v = _last_dim_contiguous(q, k, v)
    o, lse = empty_outputs(q, opts.varlen, v.shape[-1])
    batch, nheads, _, seqlen_q, _, pointers, scalars = _launch_args(
        q, k, v, lse, opts, (k, v), (q, k, v), "fwd")
    if batch * nheads * seqlen_q == 0:
        return o, lse.fill_(float("-inf"))
    table = opts.block_table  # paged k, v (num_pages, page_size, ...): strides (page, slot, head)
    if table is not None:  # pointer loads only: a TMA tile may span pages; float8 pages too
        check_fp8(k)
        scalars.update(tma_ok=0, ws_ok=0)
        if opts.k_descale is not None or opts.v_descale is not None:
            scalars.update(HAS_DESCALE=True, **_descale_args(opts.k_descale, opts.v_descale,
                                                             q.device))
    grid = lambda META: (triton.cdiv(seqlen_q, META["BLOCK_M"]), batch * nheads)  # noqa: E731
    _launch(_attn_fwd, grid, q, k, v, o, lse, pointers["ALIBI"], pointers["CU_Q"],
            pointers["CU_K"], pointers["CU_K"] if table is None else table,
            *_strides(q), *_strides(k), *_strides(v), *_strides(o),
            stride_tb=0 if table is None else table.stride(0),
            page_size=1 if table is None else k.shape[1], PAGED=table is not None, **scalars)
    return o, lse


@on_tensor_device
def backward(do, q, k, v, o, lse, dlse, opts):
    """Gradients (dq, dk, dv) of sum(o * do) + sum(lse * dlse); dlse may be None."""
    do, q, k, v, o = _last_dim_contiguous(do, q, k, v, o)
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    if opts.varlen:
        lse = lse.contiguous()
        delta = torch.empty_like(lse)
    else:  # rows of 16 bytes multiples: the warp-specialized dQ reads them by TMA copies
        seqlen_q = lse.shape[-1]
        stats = lse.new_empty(2, *lse.shape[:-1], triton.cdiv(seqlen_q, 4) * 4)[..., :seqlen_q]
        lse, delta = stats[0].copy_(lse), stats[1]
    batch, nheads, nheads_kv, seqlen_q, seqlen_k, pointers, scalars = _launch_args(
        q, k, v, lse, opts, (q, k, v, do), (q, k, v, do), "dkdv")
    if dq.numel() == 0 or dk.numel() == 0 or batch == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # -- preprocess: delta = rowsum(do * o) over the values' head dim; a gradient of lse
    # enters as -dlse --
    block_m = 32 if _INTERPRET else PREPROCESS_BLOCK_M
    _launch(_attn_bwd_preprocess, (triton.cdiv(seqlen_q, block_m), batch * nheads),
            o, do, delta, pointers["CU_Q"], *_strides(o), *_strides(do), scalars["stride_lb"],
            scalars["stride_lh"], nheads, seqlen_q, IS_VARLEN=opts.varlen,
            HEAD_DIM=scalars["HEAD_DIM_V"], BLOCK_D=scalars["BLOCK_DV"], BLOCK_M=block_m)
    if dlse is not None:
        delta -= dlse
    tensors = (q, k, v, do, lse, delta)
    extra = (pointers["ALIBI"], pointers["CU_Q"], pointers["CU_K"])
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do))
    # (the attn_mask's gradient comes from the dQ kernel: no atomic dQ with it)
    atomic = _atomic_dq(q, max(q.shape[-1], v.shape[-1]),
                        opts.deterministic or opts.attn_mask_grad is not None, scalars["tma_ok"])
    if atomic:  # fp32, BLOCK_D columns: rows of 16-byte multiples for a TMA reduction, no mask
        dq_acc = q.new_zeros((*q.shape[:-1], scalars["BLOCK_D"]), dtype=torch.float32)
        dq_strides = _strides(dq_acc)
    else:  # never read (zeroed by the autotuner before timing an ATOMIC candidate)
        dq_acc, dq_strides = delta.new_empty(0), (0, 0, 0)
    grid_kv = lambda META: (triton.cdiv(seqlen_k, META["BLOCK_N"]), batch * nheads_kv,  # noqa: E731
                            2 if META.get("SPLIT") else 1)
    _launch(_attn_bwd_dkdv, grid_kv, *tensors, dk, dv, dq_acc, *extra, *strides, *_strides(dk),
            *_strides(dv), *dq_strides, atomic_dq=int(atomic),
            **{**scalars, **_sparse_args(opts, batch, nheads, transposed=True)})
    if atomic:
        return dq.copy_(dq_acc[..., :q.shape[-1]].mul_(opts.softmax_scale)), dk, dv
    # Packed sequences start anywhere in lse's rows: no TMA copy of them, so no warp-specialized
    # dQ; nor with an attn_mask (_launch_args).
    scalars["ws_ok"] = int(not opts.varlen and opts.attn_mask is None
                           and opts.block_mask is None and _ws_ok("dq", q, k, v, do))
    grid_q = lambda META: (triton.cdiv(seqlen_q, META["BLOCK_M"]), batch * nheads)  # noqa: E731
    dbias = opts.attn_mask_grad  # (batch, nheads, seqlen_q, seqlen_k) float32 zeros, or None
    dbias_args = {} if dbias is None else dict(DBIAS=dbias, stride_dbh=dbias.stride(1),
                                               stride_dbm=dbias.stride(2))
    _launch(_attn_bwd_dq, grid_q, *tensors, dq, *extra, *strides, *_strides(dq), **scalars,
            BIAS_GRAD=dbias is not None, **dbias_args)
    return dq, dk, dv


def _tuned(kernel):
    """The autotuned kernel of a name: "fwd" | "dkdv" | "dq"."""
    return {"fwd": _attn_fwd, "dkdv": _attn_bwd_dkdv, "dq": _attn_bwd_dq}[kernel]


@contextlib.contextmanager
def forced_configs(configs):
    """Within the block, each kernel named in `configs` ({"fwd" | "dkdv" | "dq": triton.Config})
    launches with that config alone (the autotuner runs a single config as it is, with neither
    benchmarking nor its cache); the others autotune as usual. For checking and timing one
    candidate: the GPU campaign's preflight and tuning sweep."""
    saved = {name: _tuned(name).configs for name in configs}
    try:
        for name, config in configs.items():
            _tuned(name).configs = [config]
        yield
    finally:
        for name, old in saved.items():
            _tuned(name).configs = old


# ----------------------------------------------------------------------------- compilation

# Triton's autotuner compiles each candidate just before timing it, one at a time: on a new
# specialization (head dims, dtype, flags, alignments) three kernels of three or four
# candidates each, most of a first call's seconds. Its compiler releases the GIL in its passes
# and runs ptxas as a process, so the candidates compile in threads at once
# (triton.AsyncCompileMode, Triton >= 3.4); the timing then finds them compiled.
_compile_only = contextvars.ContextVar("longflash_compile_only", default=False)


def compile_workers():
    """Threads that compile candidates at once: LONGFLASH_COMPILE_WORKERS if set (1 compiles
    them one at a time, as Triton does), else this process's CPUs, at most 8."""
    env = os.environ.get("LONGFLASH_COMPILE_WORKERS")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"LONGFLASH_COMPILE_WORKERS must be a positive integer, got {env!r}")
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 8))


@contextlib.contextmanager
def compiling(workers=None):
    """Within the block, a launch of the forward, preprocessing, dK/dV or dQ kernel compiles
    (for this GPU and these arguments: the autotuner's candidates after pruning, or a forced
    config) and runs nothing, leaving its outputs unwritten; the compiles run on `workers`
    threads (default compile_workers()), and the block's end waits for them. A later call of
    the same specialization finds them compiled. A compile that fails is left to the launch
    that needs it (which raises, or the autotuner skips the candidate). Under the interpreter
    launches do nothing. The tuning sweep compiles a target's candidates this way before
    checking and timing them one at a time (forced_configs)."""
    token = _compile_only.set(True)
    try:
        if _INTERPRET or not hasattr(triton, "AsyncCompileMode"):
            yield  # (an older Triton: each launch compiles where it is, one at a time)
        else:
            with ThreadPoolExecutor(workers or compile_workers()) as pool, \
                    triton.AsyncCompileMode(pool, ignore_errors=True):
                yield
    finally:
        _compile_only.reset(token)


def _launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs), or within compiling() its compile only. An autotuned
    kernel whose choice for this call is cached (_chosen) launches that config directly."""
    if _compile_only.get():
        if not _INTERPRET:
            kernel.warmup(*args, grid=grid, **kwargs)
        return None
    config = _chosen(kernel, args, kwargs)
    if config is None:
        return kernel[grid](*args, **kwargs)
    kernel.best_config = config  # as the autotuner sets it (the tuning sweep reads it)
    return kernel.fn[grid](*args, **kwargs, **config.all_kwargs())


def _chosen(kernel, args, kwargs):
    """The autotuner's cached config for this call, looked up under the key Triton's
    Autotuner.run builds (the key arguments' values, then each tensor argument's dtype as a
    string, in argument order; the launchers pass every tensor by position), or None: not an
    autotuner, one config (forced_configs, the interpreter), a config with a pre_hook, a miss
    (the autotuner then tunes, and caches), or a Triton that keys otherwise, or a tensor
    passed by keyword (the key then matches none: each call goes through the autotuner, as
    before). The autotuner builds its key anew on every call from a dict of all ~50
    arguments filtered against a list of their names, quadratic in them (PERFLOG "The
    autotuner's choice recalled")."""
    configs, cache = getattr(kernel, "configs", ()), getattr(kernel, "cache", None)
    if len(configs) < 2 or not cache or any(name not in kwargs for name in kernel.keys):
        return None
    key = (*(kwargs[name] for name in kernel.keys),
           *(str(x.dtype) for x in args if isinstance(x, torch.Tensor)))
    config = cache.get(key)
    return None if config is None or config.pre_hook is not None else config


def _compile_candidates(kernel, configs, named_args, kwargs):
    """The autotuner's pruned candidates of one launch (named_args, kwargs: its arguments),
    compiled at once (compiling()) before the autotuner times them. Not within compiling()
    (the launch's own warmup compiles them there), nor with a single thread; if it fails, the
    autotuner compiles them one at a time as it would have, after a warning."""
    if len(configs) < 2 or _compile_only.get() or _INTERPRET or compile_workers() < 2:
        return
    tuner = _tuned(kernel)
    call = {k: v for k, v in {**named_args, **kwargs}.items() if k not in ("grid", "warmup")}
    try:
        with compiling(min(len(configs), compile_workers())):
            for config in configs:
                tuner.fn.warmup(grid=(1,), **call, **config.all_kwargs())
    except Exception as error:  # noqa: BLE001 (only time is at stake)
        warnings.warn(f"longflash: compiling the {kernel} kernel's autotuning candidates at once "
                      f"failed ({error!r}); the autotuner compiles them one at a time")
