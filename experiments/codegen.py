"""Code generation of the Triton kernels for Hopper (sm_90a) and Ampere (sm_80), offline.

    python -m experiments.codegen                   # full report: results/codegen/sm90a.csv, sm80.csv
    python -m experiments.codegen --quick --check   # CI: a small subset, non-zero exit on a limit
    python -m experiments.codegen --kernel fwd --headdim 128 --arch sm90a --dtype bfloat16 \
        --flags plain --config 128/64/8/3/tma/pipe  # a trial of the tuning sweep: printed

Compiles (never runs) every Triton kernel of `longflash.flash_triton` (forward, preprocess,
dK/dV, dQ) at every config the launcher can choose on that architecture
(`flash_triton.CONFIGS`), and the decoding kernels of `longflash.decode_triton` ("decode":
split-KV, "decode_merge", "decode_append": the append and rotary embedding) at the config the
launcher chooses for a decoding step of a Llama-like shape (one query, 4 query heads per KV
head; the split-KV kernel also at 16 queries a sequence, its 64-row tile: speculative decoding,
a shared prefix's call; the merge for the split count chosen at batch 1, 8 KV heads, 128K
keys on a 132-SM H100), for head dims 64/128/256, bf16 and fp16, and each variant flag of
the kernel, then reads the ptxas report (`ptxas -v`, the ptxas shipped in the triton package) and the PTX.

The flash kernels compile as a launch compiles them (compile_launch): their launcher is called
on CPU tensors with Triton's driver a stand-in of the target GPU, so Triton specializes every
argument as at that call. The flags of a flash kernel are launches (launch_inputs): "plain" is
RQ1's call (batch 1, 16 heads, 4000 tokens, non-causal, no variant); "gqa" the same with 4 KV
heads (grouped query heads); "softcap", "alibi", "dropout" that variant; "mask" an attn_mask
(a boolean key-padding mask, broadcast: no warp-specialized candidate); "sparse" a block_mask
(block-sparse attention, 128 x 128 blocks, one mask per head; no warp-specialized candidate
either); "varlen" packed
sequences; "paged" (forward) packed sequences whose keys are read from a paged cache through a
block table, "fp8" (forward) the same over float8 pages with their scales; "full_tiles" 4096 tokens, where no block needs a mask: the warp-specialized
candidates compile without masks there (flash_triton._full_tiles; at 4000 tokens they mask
every block). The decoding kernels' signatures are built by hand (compile_one): "plain", and
paged, leftpad (cache_leftpad), mask (a boolean attn_mask over the keys, contiguous along
them) and sparse (a block_mask, each tile's row of bits, its key blocks contiguous, the loop
over its program's list of blocks) for the
split-KV kernel, paged and rotary (half-split, queries in order) for the append,
and fp8 for both (a float8 cache with (batch, nheads_kv) scales, FP8_CACHE). With triton==3.6.0
compile the architectures' fp8 rows in separate processes (`--arch`): after an sm_90a compile,
its fp8 conversions for sm_80 come out as sm_90 instructions that ptxas rejects.

Causal attention is a runtime argument of the kernels (window_right = 0); a causal launch
compiles the same code (checked: registers, spills and hot loop alike), so each compile is
written as two rows (causal True and False) with the same numbers; "full_tiles" compiles serve
non-causal attention only (one row, causal False).

Rows (results schema of experiments/results.py, provider "longflash", mode "fwd" for the
forward and decoding kernels and "bwd" for the three backward kernels, extra key columns
`arch`, `kernel`, `config` ("BLOCK_M/BLOCK_N/warps/stages"), `flags`), one per metric:
    registers          registers per thread (ptxas)
    spill_bytes        bytes of spill stores (ptxas); spill_load_bytes: bytes of spill loads
    shared_mem_bytes   shared memory of the compiled kernel (Triton's metadata)
    wgmma_count        Hopper warpgroup MMA instructions in the PTX (wgmma.mma_async)
    mma_count          Ampere-style MMA instructions in the PTX (mma.sync)
    tma_count          TMA copies in the PTX (cp.async.bulk.tensor)
    cp_async_count     asynchronous global->shared copies in the PTX (cp.async.ca / .cg)
    warps              warps per program as compiled (Triton's metadata): the config's, or more
                       where Triton warp-specialized the kernel (a TMA-copy warpgroup beside
                       the compute warpgroups: 12 from the WS candidates' 4)
    setmaxnreg_count   register reallocations between warpgroups in the PTX (setmaxnreg): the
                       sign of a warp-specialized kernel
    ws_offset_twice    places in the TTGIR where a compute partition's row index adds the
                       partition's row offset twice (a Triton bug: ws_offset_twice below)
    ws_freed_before_read  warpgroup MMAs in the TTGIR that read a copied tile (through a
                       reshape) after its buffer was released to the copy warpgroup (a Triton
                       bug: ws_freed_before_read below)
    compile_s          wall seconds of triton.compile (Python -> PTX -> cubin) of this kernel on
                       this machine (never a cache hit)
    loop_instructions  sm_90a: SASS instructions (nvdisasm) of one trip of the innermost loop
                       that holds a warpgroup MMA (HGMMA), the kernel's hot loop
    loop_ex2           its exp2s (MUFU.EX2)
    ex2_beside_wgmma   of those, the ones issued between the loop's first HGMMA and the first
                       wait for it: softmax work that runs while the tensor cores do an
                       asynchronous MMA (the forward's PIPE trial puts them there)

--check exits non-zero when a kernel breaks the limits of issue 14 (`check` below) at a config
the launcher can choose on sm_90a, when the decoding kernel spills, when a kernel needs more
shared memory than an H100 block can have, or when a warp-specialized candidate ("/ws") did not
compile to a warp-specialized kernel (Triton's pass can leave a loop as it is, silently) or
indexes a partition's rows twice offset (ws_offset_twice) or reads a tile after releasing its
buffer (ws_freed_before_read). Must run without TRITON_INTERPRET=1.
"""

import argparse
import atexit
import dataclasses
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from unittest import mock

if __name__ == "__main__":  # before triton is imported; importers (tests) keep their set-up
    os.environ.pop("TRITON_INTERPRET", None)  # compile for real
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default of every Triton so far
    # A fresh cache directory, so compile_s times a real compilation, never a cache hit.
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="longflash-codegen-")
    atexit.register(shutil.rmtree, os.environ["TRITON_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longflash import decode_triton, flash_triton  # noqa: E402
from experiments.codegen_bounds import TUTORIAL_BWD_SPILLS  # noqa: E402
from longflash._common import Options, empty_outputs  # noqa: E402

ARCHS = {"sm90a": 90, "sm80": 80}
PTXAS_NAMES = {"sm90a": "sm_90a", "sm80": "sm_80"}
KERNELS = ["fwd", "preprocess", "dkdv", "dq", "decode", "decode_merge", "decode_append"]
FLASH_FLAGS = ["plain", "gqa", "softcap", "alibi", "dropout", "varlen", "full_tiles", "mask",
               "sparse"]
FLAGS = FLASH_FLAGS + ["paged", "leftpad", "rotary", "fp8", "mla"]
KERNEL_FLAGS = {"fwd": FLASH_FLAGS + ["paged", "fp8"], "preprocess": ["plain", "varlen"],
                "decode": ["plain", "softcap", "alibi", "paged", "leftpad", "mask", "sparse",
                           "fp8", "mla"],
                "decode_merge": ["plain", "mla"],
                "decode_append": ["plain", "paged", "rotary", "fp8"]}
# "fp8": a float8 cache with (batch, nheads_kv) scales, in the format each architecture's
# Triton converts: float8_e4m3fn on sm_90 (8.9 and later), float8_e5m2 on sm_80.
FP8_CACHE = {"sm90a": ("*fp8e4nv", torch.float8_e4m3fn), "sm80": ("*fp8e5", torch.float8_e5m2)}
# The decoding step the decode kernels are compiled for: 32 query heads on 8 KV heads, batch 1,
# 128K keys, 132 SMs (H100 SXM).
DECODE_GROUP, DECODE_PROGRAMS, DECODE_KEYS, H100_SMS = 4, 8, 131072, 132
# "mla": DeepSeek-V3's absorbed MLA decoding step (attention_with_kvcache's qv): 128 query
# heads over one latent KV head, 16 a GPU under 8-way tensor parallelism, batch 1; q and k
# the rotary part (head dim 64, the only head dim it compiles at), v and qv the 512-dim latent.
MLA_GROUP, MLA_HEADDIM, MLA_HEADDIM_V = 16, 64, 512
HEADDIMS = [64, 128, 256]
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
H100_MAX_SHARED_BYTES = 227 * 1024  # opt-in shared memory per block on sm_90 (CUDA guide)


@dataclasses.dataclass
class Config:
    """The --quick subset: what CI compiles (a few minutes on a 2-core machine)."""
    archs: tuple = ("sm90a", "sm80")
    kernels: tuple = tuple(KERNELS)
    headdims: tuple = tuple(HEADDIMS)
    dtypes: tuple = tuple(DTYPES)
    flags: tuple = tuple(FLAGS)
    configs: tuple = ()  # CONFIGS entries to compile instead of the table's (--config)
    out_dir: str = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "results", "codegen")


QUICK = dict(archs=("sm90a",), headdims=(64, 128), dtypes=("bfloat16",),
             flags=("plain", "full_tiles", "mla"))


def ptxas_path(capability=90):
    """The ptxas Triton itself uses for this target (shipped in the triton package)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(capability).path
    except (ImportError, TypeError, AttributeError):  # older Triton: the bundled binary
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def _signature(fn, pointers, constexprs):
    sig = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
           for name in fn.arg_names}
    sig.update({name: "fp32" for name in ("qk_scale", "softmax_scale", "softcap", "dropout_p")
                if name in sig})
    return sig


# Strides of a decoding step that are not multiples of 16 elements: the ALiBi slopes', the
# block table's (max_pages), the per-query log-sum-exps' (seqlen_q = 1), the rotary
# table's (rotary_dim / 2, any) and an attn_mask's (not specialized: they grow with the cache).
DECODE_UNALIGNED_STRIDES = ("stride_ab", "stride_ah", "stride_tb", "stride_lh", "stride_qsh",
                            "stride_cos", "stride_bb", "stride_bh", "stride_bm", "stride_kdb",
                            "stride_kdh", "stride_vdb", "stride_vdh")


def _divisibility(fn, pointers):
    """What Triton's launcher specializes for contiguous inputs at head dims 64/128/256:
    pointers 16-byte aligned, (batch, seqlen, head) strides multiples of 16 elements. Without
    it the compiler cannot vectorize loads, so it would not pipeline them with cp.async."""
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name in pointers or (name.startswith("stride_")
                                       and name not in DECODE_UNALIGNED_STRIDES)]
    return {(i,): [["tt.divisibility", 16]] for i in aligned}


def kernel_flags(kernel):
    return KERNEL_FLAGS.get(kernel, FLASH_FLAGS)


def configs_for(kernel, major, headdim, flags="plain"):
    """The triton.Configs the launcher may choose for `kernel` on this major capability (for
    the decoding kernel, with these variant flags)."""
    if flags == "mla" and headdim != MLA_HEADDIM:
        return []
    mla = flags == "mla"
    group, headdim_v = (MLA_GROUP, MLA_HEADDIM_V) if mla else (DECODE_GROUP, headdim)
    if kernel == "decode":  # a decoding step (16 packed rows), and 16 queries a sequence
        # (speculative decoding; a shared prefix's call): 64 packed rows, the largest tile
        configs = [decode_triton.launch_config(n, group, headdim, headdim_v,
                                               masked=flags == "mask", qv=mla)
                   for n in (1, 16 // (group // DECODE_GROUP))]
        return list({config_name(c): c for c in configs}.values())  # "mla": may be one
    if kernel == "decode_append":
        return [decode_triton.append_config(headdim)]
    if kernel == "decode_merge":
        block_n = decode_triton.launch_config(1, group, headdim, headdim_v, qv=mla).kwargs[
            "BLOCK_N"]
        programs = 1 if mla else DECODE_PROGRAMS
        return [decode_triton.merge_config(decode_triton.num_splits_heuristic(
            programs, DECODE_KEYS, block_n, H100_SMS), headdim_v)]
    return flash_triton.configs_for(kernel, major, headdim)


def kernel_spec(kernel, dtype, flags, headdim, arch="sm90a"):
    """(jit function, signature pointers, constexprs) of a decoding kernel, as its launcher
    calls it."""
    p = "*" + DTYPES[dtype]
    cache, fp8 = p, {}
    if flags == "fp8":
        cache = FP8_CACHE[arch][0]
        fp8 = dict(K_DESCALE="*fp32", V_DESCALE="*fp32")
    if kernel == "decode_append":  # with an int cache_seqlens unless paged (as decode)
        tensors = dict(Q=p, Q_ROT=p, K_NEW=p, V_NEW=p, K_CACHE=cache, V_CACHE=cache,
                       BLOCK_TABLE="*i32", SEQLENS="*i32", COS="*fp32", SIN="*fp32", **fp8)
        return decode_triton._append_rotary, tensors, dict(
            UNIFORM_SEQLEN=flags != "paged", PAGED=flags == "paged", ROTARY=flags == "rotary",
            INTERLEAVED=False, Q_IN_ORDER=True, HEAD_DIM=headdim, HEAD_DIM_V=headdim,
            **(decode_triton._fp8_format(FP8_CACHE[arch][1]) if fp8 else {}))
    if kernel in ("decode", "decode_merge"):
        headdim_v = MLA_HEADDIM_V if flags == "mla" else headdim
        tensors = dict(Q=p, K_CACHE=cache, V_CACHE=cache, O=p, BLOCK_TABLE="*i32",
                       SEQLENS_K="*i32", LEFTPAD_K="*i32", ALIBI="*fp32", LSE="*fp32",
                       O_PARTIAL="*fp32", LSE_PARTIAL="*fp32", BIAS="*u8", SPARSE="*u8", LISTS="*i32",
                       **fp8,
                       **(dict(QV=p) if flags == "mla" else {}))
        if kernel == "decode_merge":
            return decode_triton._merge_splits, tensors, dict(HEAD_DIM=headdim_v)
        # split: the long-cache case the goal is about (SPLIT=False only drops the merge)
        # UNIFORM_SEQLEN: one length for every sequence (an int cache_seqlens, as RQ1 times
        # it); paged and left-padded caches come with per-sequence lengths
        return decode_triton._fwd_splitkv, tensors, dict(
            UNIFORM_SEQLEN=flags not in ("paged", "leftpad"), PAGED=flags == "paged",
            SPLIT=True, HAS_LEFTPAD=flags == "leftpad", HAS_SOFTCAP=flags == "softcap",
            HAS_ALIBI=flags == "alibi", HEAD_DIM=headdim, HEAD_DIM_V=headdim_v,
            INPUT_PRECISION="tf32",
            # a boolean mask (read as uint8), its keys contiguous: stride 1, which Triton
            # specializes as a constant
            **(dict(BIAS_KIND=2, stride_bn=1) if flags == "mask" else {}),
            **(dict(BLOCK_SPARSE=True, stride_sn=1) if flags == "sparse" else {}),
            **(dict(HAS_DESCALE=True) if fp8 else {}),
            **(dict(HAS_QV=True) if flags == "mla" else {}))


def compile_one(kernel, dtype, flags, headdim, arch, cfg):
    """Compile one decoding kernel at one config, its signature built by hand (kernel_spec);
    returns a dict of metrics. The flash kernels compile as launched: compile_launch."""
    fn, tensors, meta = kernel_spec(kernel, dtype, flags, headdim, arch)
    meta = {**flash_triton.constexpr_defaults(fn), **meta, **cfg.kwargs}
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}
    src = ASTSource(fn=fn, signature=_signature(fn, tensors, meta),
                    constexprs={(fn.arg_names.index(k),): v for k, v in meta.items()},
                    attrs=_divisibility(fn, tensors))
    t0 = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return _metrics(compiled, arch, time.perf_counter() - t0)


class StandInGPU:
    """Triton's driver for compiling with no GPU: device 0 of the given compute capability.
    Enough for a launch within flash_triton.compiling(), which compiles and runs nothing."""

    def __init__(self, capability):
        self.target = GPUTarget("cuda", capability, 32)

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


# The launches compile_launch makes, as RQ1 calls the kernels (lengths and head counts multiples
# of 16, the inputs contiguous): batch 1, 16 query heads, non-causal, 4000 tokens (not a multiple
# of the tiles, so a warp-specialized loop masks every block, as at most lengths and in causal
# attention) or, for "full_tiles", 4096 (a multiple of every tile: the warp-specialized loops
# compile without masks, as at RQ1's non-causal calls). "gqa": 4 KV heads. "varlen": two
# packed sequences of 1000 and 3000 tokens; "paged" the same with the keys and values in a
# paged cache of 256-token pages read through the block table (forward only). "mask": an
# attn_mask, a (1, 1, 1, 4000) boolean key-padding mask broadcast over heads and rows (stride
# 0), the common case; no warp-specialized candidate runs with a mask. "sparse": a block_mask of
# (1, 16, 32, 32) 128 x 128 blocks, one per head (a per-head sparsity pattern).
LAUNCH_TOKENS, LAUNCH_TOKENS_FULL, LAUNCH_HEADS, LAUNCH_KV_HEADS_GQA = 4000, 4096, 16, 4
LAUNCH_SEQLENS, LAUNCH_PAGE = (1000, 3000), 256
LAUNCHED = {"fwd": "_attn_fwd", "preprocess": "_attn_bwd_preprocess", "dkdv": "_attn_bwd_dkdv",
            "dq": "_attn_bwd_dq"}


def launch_inputs(flags, dtype, headdim, arch="sm90a"):
    """(q, k, v, Options) of the launch a flag stands for (above); the tensors on the CPU,
    unwritten (nothing runs). "fp8": "paged" with float8 pages (FP8_CACHE[arch]) and their
    (batch, nheads_kv) scales."""
    dt = getattr(torch, dtype)
    tokens = LAUNCH_TOKENS_FULL if flags == "full_tiles" else LAUNCH_TOKENS
    kv_heads = LAUNCH_KV_HEADS_GQA if flags == "gqa" else LAUNCH_HEADS
    opts = dict(softmax_scale=headdim ** -0.5)
    if flags in ("varlen", "paged", "fp8"):
        cu = torch.tensor([0, *itertools.accumulate(LAUNCH_SEQLENS)], dtype=torch.int32)
        opts.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(LAUNCH_SEQLENS),
                    max_seqlen_k=max(LAUNCH_SEQLENS))
        q = torch.empty(sum(LAUNCH_SEQLENS), LAUNCH_HEADS, headdim, dtype=dt)
        kv_shape = (sum(LAUNCH_SEQLENS), kv_heads, headdim)
        if flags in ("paged", "fp8"):  # each sequence's keys in pages of its own
            pages = [-(-n // LAUNCH_PAGE) for n in LAUNCH_SEQLENS]
            table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
            for b, n in enumerate(pages):
                table[b, :n] = torch.arange(sum(pages[:b]), sum(pages[:b + 1]))
            opts.update(block_table=table)
            kv_shape = (sum(pages), LAUNCH_PAGE, kv_heads, headdim)
    else:
        q = torch.empty(1, tokens, LAUNCH_HEADS, headdim, dtype=dt)
        kv_shape = (1, tokens, kv_heads, headdim)
    if flags == "softcap":
        opts.update(softcap=30.0)
    if flags == "alibi":  # (nheads,) broadcast over the batch, as interface.py passes it
        opts.update(alibi_slopes=torch.empty(LAUNCH_HEADS).expand(1, LAUNCH_HEADS))
    if flags == "dropout":
        opts.update(dropout_p=0.1, seed=1234)
    if flags == "mask":  # as interface.py passes it: broadcast to (batch, nheads, N, N)
        opts.update(attn_mask=torch.empty(1, 1, 1, tokens, dtype=torch.bool).expand(
            1, LAUNCH_HEADS, tokens, tokens))
    if flags == "sparse":
        blocks = -(-tokens // flash_triton.BLOCK_SPARSE_UNIT)
        opts.update(block_mask=torch.empty(1, LAUNCH_HEADS, blocks, blocks, dtype=torch.bool))
    if flags == "fp8":
        dt = FP8_CACHE[arch][1]
        opts.update(k_descale=torch.empty(len(LAUNCH_SEQLENS), kv_heads),
                    v_descale=torch.empty(len(LAUNCH_SEQLENS), kv_heads))
    k, v = (torch.empty(kv_shape, dtype=dt) for _ in range(2))
    return q, k, v, Options(**opts)


_stand_in_capability = []  # the StandInGPU's that compile_launch made Triton's driver


def _stand_in(capability):
    """Triton's driver a StandInGPU of this capability; on a change, the flash kernels forget
    what they compiled for the previous one (their caches are made for one target)."""
    from triton.runtime.driver import driver
    if _stand_in_capability == [capability]:
        return
    driver.set_active(StandInGPU(capability))
    _stand_in_capability[:] = [capability]
    for name in LAUNCHED.values():
        flash_triton.jit_function(getattr(flash_triton, name)).device_caches.clear()


def compile_launch(kernel, dtype, flags, headdim, arch, cfg):
    """One config of a flash kernel compiled as a launch compiles it: flash_triton's launcher
    called on the inputs of launch_inputs(flags) inside flash_triton.compiling(), with
    Triton's driver a StandInGPU of the target, so that Triton specializes every argument as at
    that launch (lengths and head counts known multiples of 16, group_size = 1 folded without
    "gqa", the ALiBi slopes' head stride 1, FULL_TILES). The pass's other kernels run their
    first candidate that computes no dQ (nothing is timed). compile_s: this kernel's compile
    alone, never a cache hit (a fresh cache directory each call); the others stay compiled in
    memory from one call to the next."""
    q, k, v, opts = launch_inputs(flags, dtype, headdim, arch)
    forced = {name: next(c for c in configs_for(name, ARCHS[arch] // 10, headdim)
                         if not c.kwargs.get("ATOMIC_DQ")) for name in ("fwd", "dkdv", "dq")}
    if kernel != "preprocess":
        forced[kernel] = cfg
    _stand_in(ARCHS[arch])
    fn = flash_triton.jit_function(getattr(flash_triton, LAUNCHED[kernel]))
    cache = fn.device_caches[0][0]  # (made on first use, for the active driver's target)
    saved, compiles, original = dict(cache), [], fn.compile
    cache.clear()  # so that this config compiles here, whatever this process compiled before

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        except Exception as e:
            compiles.append(e)
            raise
        finally:
            compiles.append(time.perf_counter() - t0)

    fn.compile = timed
    with tempfile.TemporaryDirectory(prefix="longflash-codegen-") as cache_dir, \
            mock.patch.dict(os.environ, TRITON_CACHE_DIR=cache_dir):
        try:
            with flash_triton.compiling(1), flash_triton.forced_configs(forced):
                if kernel == "fwd":
                    flash_triton.forward(q, k, v, opts)
                else:
                    o, lse = empty_outputs(q, opts.cu_seqlens_q is not None)
                    flash_triton.backward(torch.empty_like(o), q, k, v, o, lse, None, opts)
            compiled = list(cache.values())
        finally:
            fn.compile = original
            cache.clear()
            cache.update(saved)
    errors = [c for c in compiles if isinstance(c, Exception)]
    if len(compiled) != 1 or errors:
        raise RuntimeError(f"{kernel} did not compile: {errors[0] if errors else compiled}")
    return _metrics(compiled[0], arch, sum(c for c in compiles if not isinstance(c, Exception)))


def _metrics(compiled, arch, compile_s):
    """The report's metrics of one compiled kernel."""
    ptx = compiled.asm["ptx"]
    return dict(compile_s=compile_s, **loop_profile(compiled.asm["cubin"]),
                shared_mem_bytes=compiled.metadata.shared,
                warps=compiled.metadata.num_warps,
                setmaxnreg_count=len(re.findall(r"\bsetmaxnreg\.", ptx)),
                ws_offset_twice=ws_offset_twice(compiled.asm["ttgir"]),
                ws_freed_before_read=ws_freed_before_read(compiled.asm["ttgir"]),
                **ptxas_report(ptx, arch),
                wgmma_count=len(re.findall(r"\bwgmma\.mma_async", ptx)),
                mma_count=len(re.findall(r"\bmma\.sync", ptx)),
                tma_count=len(re.findall(r"\bcp\.async\.bulk\.tensor", ptx)),
                cp_async_count=len(re.findall(r"\bcp\.async\.c[ag]\b", ptx)))


def ptxas_report(ptx, arch):
    """registers, spill_bytes (stores), spill_load_bytes from `ptxas -v` on the PTX."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas_path(ARCHS[arch]), "-v", f"--gpu-name={PTXAS_NAMES[arch]}", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(registers=int(regs.group(1)), spill_bytes=int(spill.group(1)),
                spill_load_bytes=int(spill.group(2)))


def _sass_lines(cubin):
    """(instructions, {label: index of the instruction after it}) of a cubin, by nvdisasm."""
    nvdisasm = os.path.join(os.path.dirname(ptxas_path()), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True,
                              check=True).stdout
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        code = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if code:
            instructions.append(code.group(1))
    return instructions, labels


def loop_profile(cubin):
    """loop_instructions, loop_ex2, ex2_beside_wgmma (the docstring above) of a cubin; {} where
    no loop holds an HGMMA (sm_80) or nvdisasm is missing."""
    try:
        ins, labels = _sass_lines(cubin)
    except (OSError, subprocess.CalledProcessError):
        return {}
    # a loop's back edge: a predicated branch to an earlier label (the unconditional ones that
    # jump back are out-of-line code after the exit, such as a barrier's retry)
    loops = []
    for i, code in enumerate(ins):
        target = re.match(r"@!?U?P\w+\s+BRA\b.*?(\.L_x_\d+)", code)
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append(ins[labels[target.group(1)]:i + 1])
    loops = [body for body in loops if any("HGMMA" in x for x in body)]
    if not loops:
        return {}
    body = min(loops, key=len)
    first = next(i for i, x in enumerate(body) if "HGMMA" in x)
    wait = next((i for i, x in enumerate(body) if i > first and "WARPGROUP.DEPBAR" in x),
                len(body))
    ex2 = lambda part: sum("MUFU.EX2" in x for x in part)  # noqa: E731
    return dict(loop_instructions=len(body), loop_ex2=ex2(body),
                ex2_beside_wgmma=ex2(body[first:wait]))


_DEF = re.compile(r"^\s*(%[\w.]+) = (\S+) (.*)$")


def ws_freed_before_read(ttgir):
    """How often a warp-specialized kernel's TTGIR reads a copied tile in a warpgroup MMA after
    it released the tile's buffer: a ttng.warp_group_dot operand that is a memdesc_reshape of
    a buffer (or a memdesc_trans of one), with a ttng.arrive_barrier (the consumer's "buffer
    free" signal to the copy warpgroup) between the reshape and the dot. Triton's Hopper pass
    (3.6.0) places the release after a buffer's last consumer but does not follow a
    memdesc_reshape to the dots that read through it, so the copy warpgroup may refill the
    buffer under them (dK/dV's three-dimensional q and dO copies; flash_triton._load_head_tile
    goes through registers instead). Line by line, as ws_offset_twice."""
    origin, arrived, found = {}, set(), 0
    for line in ttgir.splitlines():
        if re.match(r"^\s*ttng\.arrive_barrier\b", line):
            arrived |= set(origin.values())
            continue
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        origin.pop(name, None)  # a name printed again in another region
        operands = re.findall(r"%[\w.]+", rest.split(":")[0].split("{")[0])
        if op == "ttg.memdesc_reshape":
            origin[name] = name
            arrived.discard(name)
        elif op == "ttg.memdesc_trans" and operands and operands[0] in origin:
            origin[name] = origin[operands[0]]
        elif op == "ttng.warp_group_dot":
            found += sum(origin.get(o) in arrived for o in operands[:2])
    return found


def ws_offset_twice(ttgir):
    """How often a warp-specialized kernel's TTGIR adds a compute partition's row offset twice
    to its row index: tt.splat(start + K) + tt.make_range(start = K). Triton's Hopper pass
    (3.6.0 and 3.9.0) splits a program's 128 rows into two partitions of 64; for the second it
    shifts the held tile's TMA coordinate by 64 (right) and the row range by 64 (right), and
    where the row index was built from the same SSA value as the coordinate, it splats the
    shifted coordinate (wrong): that partition then masks, stores and indexes rows 64 too far
    (causal masks off by 64, its last 64 rows never stored). flash_triton._held_start keeps the
    two values apart. A line-by-line reading of the printed IR: a name printed again (another
    region) replaces the earlier one."""
    consts, shifted, splats, ranges, found = {}, {}, {}, {}, 0
    for line in ttgir.splitlines():
        m = _DEF.match(line)
        if not m:
            continue
        name, op, rest = m.groups()
        rest = re.sub(r"\s+loc\(.*\)$", "", rest)
        for table in (consts, shifted, splats, ranges):
            table.pop(name, None)  # a name printed again in another region
        operands = re.findall(r"%[\w.]+", rest.split(":")[0].split("{")[0])
        if op == "arith.constant":
            value = re.search(r"(?:^|\s|\})\s*(-?\d+) : i32\b", rest)
            if value:
                consts[name] = int(value.group(1))
        elif op == "arith.addi" and len(operands) == 2 and rest.endswith(": i32"):
            k = [consts[o] for o in operands if o in consts]
            if len(k) == 1 and k[0] > 0:
                shifted[name] = k[0]
        elif op == "tt.splat" and operands and operands[0] in shifted:
            splats[name] = shifted[operands[0]]
        elif op == "tt.make_range":
            start = re.search(r"start = (\d+) : i32", rest)
            if start:
                ranges[name] = int(start.group(1))
        elif op == "arith.addi" and len(operands) == 2:
            a, b = operands
            for s, r in ((a, b), (b, a)):
                if s in splats and ranges.get(r) == splats[s]:
                    found += 1
    return found


UNITS = dict(registers="count", spill_bytes="B", spill_load_bytes="B", shared_mem_bytes="B",
             wgmma_count="count", mma_count="count", tma_count="count", cp_async_count="count",
             warps="count", setmaxnreg_count="count", ws_offset_twice="count",
             ws_freed_before_read="count", compile_s="s",
             loop_instructions="count", loop_ex2="count", ex2_beside_wgmma="count")


def config_name(cfg):
    """BLOCK_M/BLOCK_N/warps/stages ("-" for a tile a kernel lacks), with "/tma" for a TMA
    candidate, "/tma/ws" for a warp-specialized one, "/split" for dK/dV in two passes,
    "/atomic" for dK/dV adding dQ by atomics and "/pipe" for the software-pipelined forward;
    BLOCK_S/warps/stages for the merge kernel."""
    k = cfg.kwargs
    tiles = [k["BLOCK_S"]] if "BLOCK_S" in k else [k.get("BLOCK_M", "-"), k.get("BLOCK_N", "-")]
    return "/".join(map(str, [*tiles, cfg.num_warps, cfg.num_stages,
                              *([flash_triton.TMA] if k.get("USE_TMA") else []),
                              *([flash_triton.WS] if k.get("WARP_SPECIALIZE") else []),
                              *([flash_triton.SPLIT] if k.get("SPLIT") else []),
                              *([flash_triton.ATOMIC] if k.get("ATOMIC_DQ") else []),
                              *([flash_triton.PIPE] if k.get("PIPELINE") else [])]))


def parse_config(name):
    """The CONFIGS entry of a config_name ("128/64/8/3/tma/pipe")."""
    tiles = name.split("/")
    if len(tiles) < 4 or not all(t.isdigit() for t in tiles[:4]):
        raise argparse.ArgumentTypeError(f"{name!r}: BLOCK_M/BLOCK_N/warps/stages[/flags]")
    entry = (*map(int, tiles[:4]), *tiles[4:])
    try:
        flash_triton._config(entry)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{name!r}: {e}")
    unknown = set(tiles[4:]) - {flash_triton.TMA, flash_triton.WS, flash_triton.SPLIT,
                                flash_triton.ATOMIC, flash_triton.PIPE}
    if unknown:
        raise argparse.ArgumentTypeError(f"{name!r}: unknown flags {sorted(unknown)}")
    return entry


def sweep(conf, log=print):
    """Compile everything in conf; returns {arch: rows}."""
    by_arch = {}
    for arch in conf.archs:
        rows = []
        for kernel in conf.kernels:
            for headdim in conf.headdims:
                for dtype in conf.dtypes:
                    for flags in [f for f in conf.flags if f in kernel_flags(kernel)]:
                        candidates = ([flash_triton._config(c) for c in conf.configs] or
                                      configs_for(kernel, ARCHS[arch] // 10, headdim, flags))
                        # full_tiles: what the warp-specialized candidates compile to;
                        # paged (fp8 too): only the pointer candidates run it (no TMA tile
                        # across pages);
                        # mask, sparse: no warp-specialized candidate runs them
                        for cfg in [c for c in candidates
                                    if (flags != "full_tiles" or c.kwargs.get("WARP_SPECIALIZE"))
                                    and (flags not in ("paged", "fp8")
                                         or not c.kwargs.get("USE_TMA"))
                                    and (flags not in ("mask", "sparse")
                                         or not c.kwargs.get("WARP_SPECIALIZE"))]:
                            mode = "bwd" if kernel in ("preprocess", "dkdv", "dq") else "fwd"
                            key = dict(arch=arch, kernel=kernel, config=config_name(cfg),
                                       flags=flags, experiment="codegen", provider="longflash",
                                       mode=mode, dtype=dtype,
                                       batch="", seqlen_q="", seqlen_k="", nheads="",
                                       nheads_kv="", headdim=headdim, p20="", p80="")
                            compile_config = (compile_one if kernel.startswith("decode")
                                              else compile_launch)
                            try:
                                metrics, status = compile_config(
                                    kernel, dtype, flags, headdim, arch, cfg), "ok"
                            except Exception as e:  # a failed compile is a row, not a crash
                                log(f"{arch} {kernel} d={headdim} {dtype} {flags} "
                                    f"{key['config']}: error {str(e).splitlines()[0][:200]}")
                                metrics, status = {m: float("nan") for m in UNITS}, "error"
                            log(f"{arch} {kernel:10s} d={headdim:3d} {dtype:8s} {flags:7s} "
                                f"{key['config']:13s} " + " ".join(
                                    f"{m}={metrics[m]:.3g}" for m in
                                    ("registers", "spill_bytes", "wgmma_count", "mma_count",
                                     "tma_count", "warps", "compile_s", "loop_instructions",
                                     "loop_ex2", "ex2_beside_wgmma") if m in metrics))
                            for causal in (False,) if flags == "full_tiles" else (False, True):
                                for metric, value in metrics.items():
                                    rows.append(dict(key, causal=causal, metric=metric,
                                                     value=value, unit=UNITS[metric],
                                                     status=status))
        by_arch[arch] = rows
    return by_arch


def check(rows):
    """Violations of issue 14's limits at the configs the launcher chooses on sm_90a."""
    problems = []
    cells = {}
    for r in rows:
        if r["arch"] == "sm90a" and r["causal"] is False:
            cells.setdefault((r["kernel"], r["headdim"], r["dtype"], r["flags"], r["config"]),
                             {})[r["metric"]] = (r["value"], r["status"])
    for (kernel, headdim, dtype, flags, config), m in sorted(cells.items()):
        where = f"{kernel} d={headdim} {dtype} {flags} {config}"
        if m["registers"][1] != "ok":
            problems.append(f"{where}: does not compile")
            continue
        spills, wgmma, mma = (m[k][0] for k in ("spill_bytes", "wgmma_count", "mma_count"))
        if m["shared_mem_bytes"][0] > H100_MAX_SHARED_BYTES:  # would not launch at all
            problems.append(f"{where}: {m['shared_mem_bytes'][0]:.0f} B of shared memory, "
                            f"above the H100's {H100_MAX_SHARED_BYTES} B per block")
        if config.endswith("/" + flash_triton.WS) and not (
                m.get("setmaxnreg_count", (0,))[0] > 0
                and m.get("warps", (0,))[0] > int(config.split("/")[2])):
            problems.append(f"{where}: a warp-specialized candidate compiled without warp "
                            f"specialization (warps {m.get('warps', ('?',))[0]}, setmaxnreg "
                            f"{m.get('setmaxnreg_count', ('?',))[0]})")
        if m.get("ws_freed_before_read", (0,))[0] > 0:
            problems.append(f"{where}: a warpgroup MMA reads a copied tile after its buffer was "
                            f"released (ws_freed_before_read "
                            f"{m['ws_freed_before_read'][0]:.0f}: the copy may overwrite it)")
        if m.get("ws_offset_twice", (0,))[0] > 0:
            problems.append(f"{where}: a compute partition's row index adds its offset twice "
                            f"(ws_offset_twice {m['ws_offset_twice'][0]:.0f}: rows 64 too far)")
        if kernel == "decode" and flags == "mla" and spills > 0:  # spill-free when added
            problems.append(f"{where}: MLA's decoding config must be spill-free "
                            f"(spills {spills:.0f} B)")
        if flags not in ("plain", "gqa", "full_tiles") or headdim == 256:
            continue  # variants and d=256: reported, no limit (d=256 must compile)
        if kernel == "fwd" and (spills > 0 or wgmma == 0 or mma > 0):
            problems.append(f"{where}: forward must be spill-free with wgmma "
                            f"(spills {spills:.0f} B, wgmma {wgmma:.0f}, mma.sync {mma:.0f})")
        if kernel in ("dkdv", "dq"):
            if wgmma == 0 or mma > 0:
                problems.append(f"{where}: every backward loop must use wgmma "
                                f"(wgmma {wgmma:.0f}, mma.sync {mma:.0f})")
            if spills >= TUTORIAL_BWD_SPILLS[headdim]:
                problems.append(f"{where}: spills {spills:.0f} B, Triton's tutorial backward "
                                f"{TUTORIAL_BWD_SPILLS[headdim]} B")
        if kernel == "decode" and spills > 0:  # our own bar: it was spill-free when added
            problems.append(f"{where}: the decoding kernel must be spill-free "
                            f"(spills {spills:.0f} B)")
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="sm_90a, head dims 64/128, bf16, no variant flags (CI)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if a chosen sm_90a config breaks issue 14's limits")
    parser.add_argument("--arch", nargs="+", choices=list(ARCHS), help="default: all")
    parser.add_argument("--kernel", nargs="+", choices=KERNELS, help="default: all")
    parser.add_argument("--headdim", nargs="+", type=int, choices=HEADDIMS, help="default: all")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), help="default: all")
    parser.add_argument("--flags", nargs="+", choices=FLAGS, help="default: all")
    parser.add_argument("--config", nargs="+", type=parse_config,
                        help="compile these candidates instead of the config table's, as "
                             "config_name writes them (128/64/8/3/tma/pipe: a trial of the "
                             "tuning sweep); prints, writes nothing")
    parser.add_argument("--out-dir", help="default: results/codegen (the full report only)")
    parser.add_argument("--no-write", action="store_true", help="print, write nothing")
    args = parser.parse_args(argv)
    conf = Config(**QUICK) if args.quick else Config()
    for field, value in (("archs", args.arch), ("kernels", args.kernel),
                         ("headdims", args.headdim),
                         ("dtypes", args.dtype), ("flags", args.flags)):
        if value:
            conf = dataclasses.replace(conf, **{field: tuple(value)})
    if args.out_dir:
        conf = dataclasses.replace(conf, out_dir=args.out_dir)
    if args.config:  # trials: the report holds the table's candidates only
        conf, args.no_write = dataclasses.replace(conf, configs=tuple(args.config)), True
    print(f"triton {triton.__version__}, ptxas {ptxas_path()}", flush=True)
    t0 = time.perf_counter()
    by_arch = {}
    for arch in conf.archs:  # one file per architecture, written as soon as it is done
        by_arch.update(sweep(dataclasses.replace(conf, archs=(arch,)),
                             log=lambda m: print(m, flush=True)))
        # The quick subset never overwrites the committed full report unless asked to.
        if not args.no_write and (not args.quick or args.out_dir):
            from experiments.results import this_command, write_results  # pandas: only to write
            path = os.path.join(conf.out_dir, f"{arch}.csv")
            write_results(by_arch[arch], path, command=this_command(),
                          key_columns=("arch", "kernel", "config", "flags", "triton"))
            print(f"wrote {path}", flush=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.check:
        problems = check([r for rows in by_arch.values() for r in rows])
        for p in problems:
            print("LIMIT:", p)
        if problems:
            return 1
        print(f"codegen check passed (triton {triton.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
