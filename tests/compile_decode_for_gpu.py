"""Compile (not run) the decoding kernels (append, split-KV, merge) for NVIDIA GPU targets, on
any machine.

    python tests/compile_decode_for_gpu.py 90:bfloat16:paged:128 80:float16:all:64

"paged" reads the cache through block_table and appends with interleaved rotary; "all" adds
half-split rotary, cache_leftpad, softcap, ALiBi, a float attn_mask, a block_mask and the
split output (partials + merge kernel); both read per-sequence lengths, any other takes one
length for every sequence (UNIFORM_SEQLEN, an int cache_seqlens) and appends without rotary.
"mla": MLA's absorbed decoding (qv), the head dim given that of the latent values and qv, q
and k's 64, 16 query heads on the KV head. Tile sizes are the launcher's
(decode_triton.launch_config, a decoding step with 4 query heads per KV head). Registers and
spills at the alignment the launcher specializes on are in experiments/codegen.py's report.
Must run without TRITON_INTERPRET=1. Used by tests/test_compile.py.
"""

import sys

import triton
from triton.backends.compiler import GPUTarget

from compile_for_gpu import TYPES, compile_kernel
from longflash import decode_triton


def compile_all(capability, dtype, features, headdim):
    target = GPUTarget("cuda", capability, 32)
    p = "*" + TYPES[dtype]
    mla = features == "mla"
    headdim, headdim_v = (64, headdim) if mla else (headdim, headdim)
    cfg = decode_triton.launch_config(1, 16 if mla else 4, headdim, headdim_v, qv=mla)
    on = features == "all"
    pointers = dict(Q=p, K_CACHE=p, V_CACHE=p, BLOCK_TABLE="*i32", SEQLENS_K="*i32",
                    LEFTPAD_K="*i32", ALIBI="*fp32", O=p, LSE="*fp32", O_PARTIAL="*fp32",
                    LSE_PARTIAL="*fp32", BIAS="*fp32", SPARSE="*u8", LISTS="*i32",
                    **(dict(QV=p) if mla else {}))
    meta = dict(UNIFORM_SEQLEN=features not in ("paged", "all"),
                PAGED=features in ("paged", "all"), SPLIT=on, HAS_LEFTPAD=on, HAS_SOFTCAP=on, HAS_ALIBI=on,
                HEAD_DIM=headdim, HEAD_DIM_V=headdim_v, BIAS_KIND=1 if on else 0,
                HAS_QV=mla, BLOCK_SPARSE=on,
                INPUT_PRECISION="ieee" if dtype == "float32" else "tf32", **cfg.kwargs)
    compile_kernel(decode_triton._fwd_splitkv, pointers, meta, target)
    rotary = features in ("paged", "all")
    compile_kernel(decode_triton._append_rotary,
                   dict(Q=p, Q_ROT=p, K_NEW=p, V_NEW=p, K_CACHE=p, V_CACHE=p,
                        BLOCK_TABLE="*i32", SEQLENS="*i64", COS="*fp32", SIN="*fp32"),
                   dict(UNIFORM_SEQLEN=meta["UNIFORM_SEQLEN"], PAGED=meta["PAGED"],
                        ROTARY=rotary, INTERLEAVED=features == "paged", Q_IN_ORDER=on,
                        HEAD_DIM=headdim, BLOCK_D=cfg.kwargs["BLOCK_D"], HEAD_DIM_V=headdim_v,
                        BLOCK_DV=cfg.kwargs["BLOCK_DV"]), target, num_warps=1)
    merge = dict(HEAD_DIM=headdim_v,
                 **decode_triton.merge_config(decode_triton.MAX_SPLITS, headdim_v).kwargs)
    compile_kernel(decode_triton._merge_splits,
                   dict(O_PARTIAL="*fp32", LSE_PARTIAL="*fp32", O=p, LSE="*fp32"), merge, target)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        capability, dtype, features, headdim = spec.split(":")
        compile_all(int(capability), dtype, features, int(headdim))
        print(f"compiled for sm_{capability}: {spec}", flush=True)
