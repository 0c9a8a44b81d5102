"""Code generation of the Triton kernels for Hopper (sm_90a) and Ampere (sm_80), offline.

    python -m experiments.codegen                   # full report: results/codegen/sm90a.csv, sm80.csv
    python -m experiments.codegen --quick --check   # CI: a small subset, non-zero exit on a limit
    python -m experiments.codegen --kernel fwd --headdim 128 --arch sm90a --dtype bfloat16 \
        --flags plain --config 128/64/8/3/tma/pipe  # a trial of the tuning sweep: printed
    python -m experiments.codegen --kernel fwd --headdim 128 --arch sm90a --dtype bfloat16 \
        --flags plain --launch      # as a launch compiles them (compile_launch): printed

Compiles (never runs) every Triton kernel of `longflash.flash_triton` (forward, preprocess,
dK/dV, dQ) at every config the launcher can choose on that architecture
(`flash_triton.CONFIGS`), and the decoding kernels of `longflash.decode_triton` ("decode":
split-KV, "decode_merge", "decode_append": the append and rotary embedding) at the config the
launcher chooses for a decoding step of a Llama-like shape (one query, 4 query heads per KV
head; the merge for the split count chosen at batch 1, 8 KV heads, 128K keys on a 132-SM
H100), for head dims 64/128/256, bf16 and fp16, and each compile-time variant flag of the
kernel (softcap, alibi, dropout, varlen; paged for the forward (packed sequences whose keys
are read from a paged cache through a block table); paged and leftpad (cache_leftpad) for the
decoding kernel, paged and rotary (half-split, queries in order) for the append; "plain" is none of them; "full_tiles" is the
warp-specialized candidates compiled without masks, as they run when no block needs one,
flash_triton._full_tiles), then reads the ptxas report (`ptxas -v`, the ptxas shipped in the
triton package) and the PTX.

Causal attention is a runtime argument of the kernels (window_right = 0), so one binary
serves causal and non-causal attention: each compile is written as two rows (causal True and
False) with the same numbers; "full_tiles" compiles serve non-causal attention only (one row,
causal False).

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
    compile_s          wall seconds of triton.compile (Python -> PTX -> cubin) on this machine
    loop_instructions  sm_90a: SASS instructions (nvdisasm) of one trip of the innermost loop
                       that holds a warpgroup MMA (HGMMA), the kernel's hot loop
    loop_ex2           its exp2s (MUFU.EX2)
    ex2_beside_wgmma   of those, the ones issued between the loop's first HGMMA and the first
                       wait for it: softmax work that runs while the tensor cores do an
                       asynchronous MMA (the forward's PIPE trial puts them there)

--check exits non-zero when a kernel breaks the limits of issue 14 (`check` below) at a config
the launcher can choose on sm_90a, when the decoding kernel spills, when a kernel needs more
shared memory than an H100 block can have, or when a warp-specialized candidate ("/ws") did not
compile to a warp-specialized kernel (Triton's pass can leave a loop as it is, silently). Must
run without TRITON_INTERPRET=1.
"""

import argparse
import atexit
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

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

ARCHS = {"sm90a": 90, "sm80": 80}
PTXAS_NAMES = {"sm90a": "sm_90a", "sm80": "sm_80"}
KERNELS = ["fwd", "preprocess", "dkdv", "dq", "decode", "decode_merge", "decode_append"]
FLASH_FLAGS = ["plain", "softcap", "alibi", "dropout", "varlen", "full_tiles"]
FLAGS = FLASH_FLAGS + ["paged", "leftpad", "rotary"]
KERNEL_FLAGS = {"fwd": FLASH_FLAGS + ["paged"],
                "decode": ["plain", "softcap", "alibi", "paged", "leftpad"],
                "decode_merge": ["plain"], "decode_append": ["plain", "paged", "rotary"]}
# The decoding step the decode kernels are compiled for: 32 query heads on 8 KV heads, batch 1,
# 128K keys, 132 SMs (H100 SXM).
DECODE_GROUP, DECODE_PROGRAMS, DECODE_KEYS, H100_SMS = 4, 8, 131072, 132
HEADDIMS = [64, 128, 256]
DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
# Triton's tutorial fused backward (06-fused-attention, 4 warps, 5 stages, BLOCK_N1 128),
# compiled for sm_90a with Triton 3.6: its spill bytes, the bound the dK/dV and dQ kernels must
# beat (issue 14, ANCHORS.md).
TUTORIAL_BWD_SPILLS = {64: 980, 128: 11732}
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
    launch: bool = False  # compile_launch instead of compile_one (--launch)
    out_dir: str = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "results", "codegen")


QUICK = dict(archs=("sm90a",), headdims=(64, 128), dtypes=("bfloat16",),
             flags=("plain", "full_tiles"))


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


# Strides that are not multiples of 16 elements in a launch: the ALiBi slopes' and the block
# table's (max_pages); in a decoding step also the per-query log-sum-exps' (seqlen_q = 1) and
# the rotary table's (rotary_dim / 2, any). The flash kernels' log-sum-exp head stride is the
# sequence length: a multiple of 16 in RQ1.
UNALIGNED_STRIDES = ("stride_ab", "stride_ah", "stride_tb")
DECODE_UNALIGNED_STRIDES = UNALIGNED_STRIDES + ("stride_lh", "stride_qsh", "stride_cos")


def _divisibility(fn, pointers, unaligned=UNALIGNED_STRIDES):
    """What Triton's launcher specializes for contiguous inputs at head dims 64/128/256:
    pointers 16-byte aligned, (batch, seqlen, head) strides multiples of 16 elements. Without
    it the compiler cannot vectorize loads, so it would not pipeline them with cp.async."""
    aligned = [i for i, name in enumerate(fn.arg_names)
               if name in pointers or (name.startswith("stride_") and name not in unaligned)]
    return {(i,): [["tt.divisibility", 16]] for i in aligned}


def kernel_flags(kernel):
    return KERNEL_FLAGS.get(kernel, FLASH_FLAGS)


def configs_for(kernel, major, headdim):
    """The triton.Configs the launcher may choose for `kernel` on this major capability."""
    if kernel == "decode":
        return [decode_triton.launch_config(1, DECODE_GROUP, headdim)]
    if kernel == "decode_append":
        return [decode_triton.append_config(headdim)]
    if kernel == "decode_merge":
        block_n = decode_triton.launch_config(1, DECODE_GROUP, headdim).kwargs["BLOCK_N"]
        return [decode_triton.merge_config(decode_triton.num_splits_heuristic(
            DECODE_PROGRAMS, DECODE_KEYS, block_n, H100_SMS))]
    return flash_triton.configs_for(kernel, major, headdim)


def kernel_spec(kernel, dtype, flags, headdim, arch):
    """(jit function, signature pointers, constexprs) of one kernel, as the launcher calls it."""
    p = "*" + DTYPES[dtype]
    if kernel == "decode_append":  # with an int cache_seqlens unless paged (as decode)
        tensors = dict(Q=p, Q_ROT=p, K_NEW=p, V_NEW=p, K_CACHE=p, V_CACHE=p,
                       BLOCK_TABLE="*i32", SEQLENS="*i32", COS="*fp32", SIN="*fp32")
        return decode_triton._append_rotary, tensors, dict(
            UNIFORM_SEQLEN=flags != "paged", PAGED=flags == "paged", ROTARY=flags == "rotary",
            INTERLEAVED=False, Q_IN_ORDER=True, HEAD_DIM=headdim, HEAD_DIM_V=headdim)
    if kernel in ("decode", "decode_merge"):
        block_d = max(16, triton.next_power_of_2(headdim))
        tensors = dict(Q=p, K_CACHE=p, V_CACHE=p, O=p, BLOCK_TABLE="*i32", SEQLENS_K="*i32",
                       LEFTPAD_K="*i32", ALIBI="*fp32", LSE="*fp32", O_PARTIAL="*fp32", LSE_PARTIAL="*fp32")
        if kernel == "decode_merge":
            return decode_triton._merge_splits, tensors, dict(HEAD_DIM=headdim, BLOCK_D=block_d)
        # split: the long-cache case the goal is about (SPLIT=False only drops the merge)
        # UNIFORM_SEQLEN: one length for every sequence (an int cache_seqlens, as RQ1 times
        # it); paged and left-padded caches come with per-sequence lengths
        return decode_triton._fwd_splitkv, tensors, dict(
            UNIFORM_SEQLEN=flags not in ("paged", "leftpad"), PAGED=flags == "paged",
            SPLIT=True, HAS_LEFTPAD=flags == "leftpad", HAS_SOFTCAP=flags == "softcap",
            HAS_ALIBI=flags == "alibi", HEAD_DIM=headdim, HEAD_DIM_V=headdim,
            INPUT_PRECISION="tf32")
    stats = {"LSE": "*fp32", "Delta": "*fp32", "ALIBI": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
    tensors = dict(Q=p, K=p, V=p, O=p, DO=p, DQ=p, DK=p, DV=p, TABLE="*i32", DQ_ACC="*fp32",
                   **stats)
    meta = flash_triton.constexprs(headdim, dtype_is_fp32=False,
                                   varlen=flags in ("varlen", "paged"),
                                   softcap=flags == "softcap", alibi=flags == "alibi",
                                   dropout=flags == "dropout")
    fn = {"fwd": flash_triton._attn_fwd, "preprocess": flash_triton._attn_bwd_preprocess,
          "dkdv": flash_triton._attn_bwd_dkdv, "dq": flash_triton._attn_bwd_dq}[kernel]
    fn = flash_triton.jit_function(fn)
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}
    return fn, tensors, dict(meta, FULL_TILES=flags == "full_tiles", PAGED=flags == "paged")


def compile_one(kernel, dtype, flags, headdim, arch, cfg):
    """Compile one kernel at one config; returns a dict of metrics."""
    fn, tensors, meta = kernel_spec(kernel, dtype, flags, headdim, arch)
    meta = {**flash_triton.constexpr_defaults(fn), **meta, **cfg.kwargs}
    meta = {k: v for k, v in meta.items() if k in fn.arg_names}
    src = ASTSource(fn=fn, signature=_signature(fn, tensors, meta),
                    constexprs={(fn.arg_names.index(k),): v for k, v in meta.items()},
                    attrs=_divisibility(fn, tensors, DECODE_UNALIGNED_STRIDES
                                        if kernel.startswith("decode") else UNALIGNED_STRIDES))
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


# The launch compile_launch makes: (batch, tokens, heads), as RQ1 at 4K tokens (lengths and
# head count multiples of 16, no GQA), non-causal, no variant.
LAUNCH_SHAPE = (1, 4096, 16)
LAUNCHED = {"fwd": "_attn_fwd", "preprocess": "_attn_bwd_preprocess", "dkdv": "_attn_bwd_dkdv",
            "dq": "_attn_bwd_dq"}


def compile_launch(kernel, dtype, headdim, arch, cfg):
    """One config compiled as a launch compiles it, where compile_one builds the signature by
    hand: flash_triton's launcher called on CPU tensors of LAUNCH_SHAPE inside
    flash_triton.compiling(), with Triton's driver a StandInGPU of the target, so that each
    argument is specialized as at that launch (the lengths and head count known multiples of 16,
    group_size = 1 folded; a warp-specialized config then compiles without masks, FULL_TILES,
    as it runs there). The pass's other kernels forced to their first candidate (nothing is
    timed). compile_s: the whole pass's compiles (a kernel compiled before in this run loads
    from Triton's cache)."""
    from triton.runtime.driver import driver
    from longflash.interface import _options
    driver.set_active(StandInGPU(ARCHS[arch]))
    batch, tokens, heads = LAUNCH_SHAPE
    q, k, v, do = (torch.randn(batch, tokens, heads, headdim, dtype=getattr(torch, dtype))
                   for _ in range(4))
    o, lse = torch.empty_like(q), torch.empty(batch, heads, tokens)
    opts = _options(q, False, headdim ** -0.5, -1, -1, None, 0.0, 0.0, None, None, None, 0, 0)
    forced = {name: configs_for(name, ARCHS[arch] // 10, headdim)[0]
              for name in ("fwd", "dkdv", "dq")}
    if kernel != "preprocess":
        forced[kernel] = cfg
    cache = flash_triton.jit_function(getattr(flash_triton, LAUNCHED[kernel])).device_caches[0][0]
    cache.clear()  # so that this config compiles here, whatever this process compiled before
    t0 = time.perf_counter()
    with flash_triton.compiling(1), flash_triton.forced_configs(forced):
        if kernel == "fwd":
            flash_triton.forward(q, k, v, opts)
        else:
            flash_triton.backward(do, q, k, v, o, lse, None, opts)
    (compiled,) = cache.values()
    return _metrics(compiled, arch, time.perf_counter() - t0)


def _metrics(compiled, arch, compile_s):
    """The report's metrics of one compiled kernel."""
    ptx = compiled.asm["ptx"]
    return dict(compile_s=compile_s, **loop_profile(compiled.asm["cubin"]),
                shared_mem_bytes=compiled.metadata.shared,
                warps=compiled.metadata.num_warps,
                setmaxnreg_count=len(re.findall(r"\bsetmaxnreg\.", ptx)),
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


UNITS = dict(registers="count", spill_bytes="B", spill_load_bytes="B", shared_mem_bytes="B",
             wgmma_count="count", mma_count="count", tma_count="count", cp_async_count="count",
             warps="count", setmaxnreg_count="count", compile_s="s",
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
                candidates = ([flash_triton._config(c) for c in conf.configs] or
                              configs_for(kernel, ARCHS[arch] // 10, headdim))
                for dtype in conf.dtypes:
                    for flags in [f for f in conf.flags if f in kernel_flags(kernel)]:
                        # full_tiles: what the warp-specialized candidates compile to;
                        # paged: only the pointer candidates run it (no TMA tile across pages)
                        for cfg in [c for c in candidates
                                    if (flags != "full_tiles" or c.kwargs.get("WARP_SPECIALIZE"))
                                    and (flags != "paged" or not c.kwargs.get("USE_TMA"))]:
                            mode = "bwd" if kernel in ("preprocess", "dkdv", "dq") else "fwd"
                            key = dict(arch=arch, kernel=kernel, config=config_name(cfg),
                                       flags=flags, experiment="codegen", provider="longflash",
                                       mode=mode, dtype=dtype,
                                       batch="", seqlen_q="", seqlen_k="", nheads="",
                                       nheads_kv="", headdim=headdim, p20="", p80="")
                            try:
                                metrics, status = (
                                    compile_launch(kernel, dtype, headdim, arch, cfg)
                                    if conf.launch else
                                    compile_one(kernel, dtype, flags, headdim, arch, cfg)), "ok"
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
        if flags not in ("plain", "full_tiles") or headdim == 256:
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
    parser.add_argument("--launch", action="store_true",
                        help="compile as a launch does (compile_launch: the launcher on an RQ1 "
                             "shape, plain, kernels fwd/preprocess/dkdv/dq); prints, writes "
                             "nothing")
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
    if args.launch:
        if set(conf.flags) != {"plain"} or not set(conf.kernels) <= set(LAUNCHED):
            parser.error(f"--launch compiles --flags plain of the kernels {sorted(LAUNCHED)}")
        conf, args.no_write = dataclasses.replace(conf, launch=True), True
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
