"""Compile (not run) every LongFlash Triton kernel for NVIDIA GPU targets, on any machine.

    python tests/compile_for_gpu.py 90:bfloat16:plain:80 80:float16:all:256

"all" turns on every compile-time feature (softcap, ALiBi, dropout, packed sequences, and for
the forward's pointer loads paged keys). On
capability 9 and above the kernels are compiled with pointer loads and with TMA copies
(USE_TMA), as the autotuner may launch either there (with TMA copies also dK/dV in two passes,
SPLIT, and adding dQ by atomics, ATOMIC_DQ, alone and in dK's pass, and the forward
software-pipelined, PIPELINE: the tuning sweep's trials, which are all TMA tiles), and on
capability 9 in 16-bit types also
warp-specialized (WARP_SPECIALIZE: forward, dK/dV, dQ), with and without the masks that
FULL_TILES drops.

Triton's interpreter (the CPU tests) executes kernels as NumPy and never runs the
compiler, so type and layout errors that only the real compiler sees would first
show up on a GPU. This script lowers each kernel to machine code for the given
compute capability with the ptxas that ships with Triton. Must run without
TRITON_INTERPRET=1. Used by tests/test_compile.py.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from longflash import flash_triton

TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def compile_kernel(kernel, pointers, constexprs, target, **options):
    fn = flash_triton.jit_function(kernel)
    constexprs = {**flash_triton.constexpr_defaults(fn), **constexprs}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32")
                 for name in fn.arg_names}
    signature.update({name: "fp32" for name in ("qk_scale", "softmax_scale", "softcap", "dropout_p")
                      if name in signature})
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=target, options=options or None)


def compile_all(capability, dtype, features, headdim):
    target = GPUTarget("cuda", capability, 32)
    p = "*" + TYPES[dtype]
    block_d = max(16, triton.next_power_of_2(headdim))
    on = features == "all"
    meta = dict(HAS_SOFTCAP=on, HAS_ALIBI=on, HAS_DROPOUT=on, IS_VARLEN=on, HEAD_DIM=headdim,
                BLOCK_D=block_d, HEAD_DIM_V=headdim, BLOCK_DV=block_d, BLOCK_M=64, BLOCK_N=32,
                INPUT_PRECISION="ieee" if dtype == "float32" else "tf32")
    stats = {"LSE": "*fp32", "Delta": "*fp32", "ALIBI": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
    fwd = dict(Q=p, K=p, V=p, O=p, TABLE="*i32", **stats)
    compile_kernel(flash_triton._attn_bwd_preprocess, dict(O=p, DO=p, **stats),
                   dict(IS_VARLEN=on, HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_M=128), target)
    grads = dict(Q=p, K=p, V=p, DO=p, DQ=p, DK=p, DV=p, DQ_ACC="*fp32", **stats)
    for tma in (False, True) if capability >= 90 else (False,):
        meta["USE_TMA"] = tma
        meta["WARP_SPECIALIZE"] = meta["FULL_TILES"] = False
        compile_kernel(flash_triton._attn_fwd, fwd, dict(meta, PAGED=on and not tma), target)
        compile_kernel(flash_triton._attn_bwd_dkdv, grads, meta, target)
        compile_kernel(flash_triton._attn_bwd_dq, grads, meta, target)
        if tma:  # the tuning sweep's trials (tuning.TRIALS), every one a TMA tile
            compile_kernel(flash_triton._attn_fwd, fwd, dict(meta, PAGED=False, PIPELINE=True),
                           target)
            for trial in (dict(SPLIT=True), dict(ATOMIC_DQ=True), dict(SPLIT=True, ATOMIC_DQ=True)):
                compile_kernel(flash_triton._attn_bwd_dkdv, grads, dict(meta, **trial), target)
    if capability == 90 and dtype != "float32":  # the warp-specialized candidates, masked
        # and not (FULL_TILES, never with packed sequences)
        for full_tiles in (False,) if on else (False, True):
            ws = dict(meta, USE_TMA=True, WARP_SPECIALIZE=True, FULL_TILES=full_tiles)
            compile_kernel(flash_triton._attn_fwd, fwd, dict(ws, BLOCK_M=128, PAGED=False), target,
                           num_warps=4)
            compile_kernel(flash_triton._attn_bwd_dkdv, grads,
                           dict(ws, BLOCK_M=32, BLOCK_N=128), target, num_warps=4)
            compile_kernel(flash_triton._attn_bwd_dq, grads, dict(ws, BLOCK_M=128), target,
                           num_warps=4)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        capability, dtype, features, headdim = spec.split(":")
        compile_all(int(capability), dtype, features, int(headdim))
        print(f"compiled for sm_{capability}: {spec}", flush=True)
