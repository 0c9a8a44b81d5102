"""Compile (not run) the split-KV decoding kernels for NVIDIA GPU targets, on any machine.

    python tests/compile_decode_for_gpu.py 90:bfloat16:paged:128 80:float16:all:64

"paged" reads the cache through block_table; "all" adds softcap, ALiBi and the split
output (partials + merge kernel). Prints each kernel's registers and spills
(ptxas -v). Must run without TRITON_INTERPRET=1. Used by tests/test_compile.py.
"""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from compile_for_gpu import TYPES, compile_kernel
from longflash import decode_triton


def compile_all(capability, dtype, features, headdim):
    target = GPUTarget("cuda", capability, 32)
    p = "*" + TYPES[dtype]
    block_m, block_n, block_d = 16, 64 if headdim > 64 else 128, max(16, triton.next_power_of_2(
        headdim))
    on = features == "all"
    pointers = dict(Q=p, K_CACHE=p, V_CACHE=p, BLOCK_TABLE="*i32", SEQLENS_K="*i32",
                    ALIBI="*fp32", O=p, LSE="*fp32", O_PARTIAL="*fp32", LSE_PARTIAL="*fp32")
    meta = dict(PAGED=features in ("paged", "all"), SPLIT=on, HAS_SOFTCAP=on, HAS_ALIBI=on,
                HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                INPUT_PRECISION="ieee" if dtype == "float32" else "tf32")
    kernels = [compile_kernel(decode_triton._fwd_splitkv, pointers, meta, target)]
    kernels.append(compile_kernel(decode_triton._merge_splits,
                                  dict(O_PARTIAL="*fp32", LSE_PARTIAL="*fp32", O=p, LSE="*fp32"),
                                  dict(HEAD_DIM=headdim, BLOCK_D=block_d, BLOCK_S=32), target))
    return kernels


def ptxas_usage(compiled, capability):
    """Registers and spill bytes reported by `ptxas -v`, with the ptxas Triton itself uses."""
    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(capability).path
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, "-v", f"-arch={arch}", path, "-o", os.devnull],
                             capture_output=True, text=True)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else None,
            f"{spills.group(1)}/{spills.group(2)}" if spills else None)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        capability, dtype, features, headdim = spec.split(":")
        for name, compiled in zip(("splitkv", "merge"),
                                  compile_all(int(capability), dtype, features, int(headdim))):
            regs, spills = ptxas_usage(compiled, int(capability))
            print(f"  {name}: {regs} registers, spill stores/loads {spills} bytes, shared "
                  f"{compiled.metadata.shared} B", flush=True)
        print(f"compiled for sm_{capability}: {spec}", flush=True)
