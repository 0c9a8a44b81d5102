"""The Triton kernels on GPUs with less shared memory a block than the H100's: every launch
fits the GPU (flash_triton._fit_shared_memory for the autotuned kernels, decode_triton.
_launch_fitted for the split-KV kernel). Compiled for a stand-in sm_120 (an RTX 50-series
GPU: 99 KB a block, the sm_90 table's tiles; sm_86 and sm_89 have the same 99 KB) whose
driver reports that limit and whose kernels raise Triton's OutOfResources at their first
launch past it, as a GPU's do; nothing runs."""

import pytest
import torch

from conftest import needs_triton, run_uninterpreted

SMALL_GPU = """
import torch
from unittest import mock
from triton.compiler.compiler import CompiledKernel
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.errors import OutOfResources
from experiments.codegen import StandInGPU
from longflash import flash_triton as ft, decode_triton as dt, interface
from longflash._common import Options

LIMIT = 101376  # 99 KB


class SmallGPU(StandInGPU):
    class utils:
        @staticmethod
        def get_device_properties(device):
            return {"max_shared_mem": LIMIT}


launched = []


def first_launch(self):  # Triton's check at a kernel's first launch; the launch does nothing
    if self.metadata.shared > LIMIT:
        raise OutOfResources(self.metadata.shared, LIMIT, "shared memory")
    self.module = self.function = 0
    self._run = lambda *args, **kwargs: launched.append((self.name, self.metadata.shared))


if FIT_OFF:
    ft._fit_shared_memory = lambda kernel, configs, named_args, kwargs: configs
driver.set_active(SmallGPU(120))
with mock.patch.object(CompiledKernel, "_init_handles", first_launch), \\
        mock.patch.object(Autotuner, "_bench", lambda self, *args, **kwargs: [1.0] * 3):
    q = torch.randn(1, 256, 2, 256, dtype=torch.bfloat16)
    opts = interface._options(q, False, 0.0625, -1, -1, None, 0.0, 0.0, None, None, None, 0, 0)
    o, lse = ft.forward(q, q, q, opts)
    ft.backward(q, q, q, q, o, lse, None, opts)
    qd = torch.randn(1, 1, 8, 256, dtype=torch.bfloat16)
    cache = [torch.randn(1, 1024, 2, 256, dtype=torch.bfloat16) for _ in range(2)]
    for _ in range(2):
        dt.forward(qd, *cache, 1024, None, Options(0.0625, -1, -1, None, 0.0), 0, 1024)
print(sorted({name for name, _ in launched}))
print(max(shared for _, shared in launched) <= LIMIT, len(dt._FITTED))
print(" ".join(f"{c.kwargs['BLOCK_M']}/{c.kwargs['BLOCK_N']}/{c.num_stages}"
               for c in (ft._attn_fwd.best_config, *dt._FITTED.values())))
"""


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in GPU")
def test_head_dim_256_fits_a_99_kb_gpu():
    """Head dim 256, bf16: the sm_90 table's forward tiles need 106-147 KB on sm_120, so
    without the fit the autotuner times them all as equal and launches one that cannot run;
    with it the forward, dK/dV and dQ run fitted candidates, and the decoding step (141 KB
    with 3 stages) one stage fewer, found at its first launch and kept for the next."""
    out = run_uninterpreted("-c", "FIT_OFF = False\n" + SMALL_GPU).stdout.splitlines()
    assert out[0] == str(["_attn_bwd_dkdv", "_attn_bwd_dq", "_attn_bwd_preprocess", "_attn_fwd",
                          "_fwd_splitkv", "_merge_splits"]), out
    assert out[1] == "True 1", out
    fwd, decode = out[2].split()
    assert fwd not in ("128/64/2", "128/32/2") and decode == "16/64/2", out  # 16/64/3 -> 2


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in GPU")
def test_without_the_fit_the_forward_cannot_launch():
    """The same forward with the autotuner's candidates unfitted fails at its launch (the
    check above is not vacuous; run_uninterpreted asserts success, with stderr's tail)."""
    with pytest.raises(AssertionError, match="OutOfResources"):
        run_uninterpreted("-c", "FIT_OFF = True\n" + SMALL_GPU)


@needs_triton
def test_smaller_config_steps():
    """A stage fewer first, then the longer tile edge halved (BLOCK_N on a tie), to 16; with
    rows_fixed only BLOCK_N (the decoding kernel's grid is along BLOCK_M)."""
    import triton
    from longflash.flash_triton import smaller_config

    def steps(config, **kw):
        out = []
        while config is not None:
            out.append((config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_stages))
            config = smaller_config(config, **kw)
        return out
    start = triton.Config(dict(BLOCK_M=64, BLOCK_N=32, BLOCK_D=256), num_warps=8, num_stages=3)
    assert steps(start) == [(64, 32, 3), (64, 32, 2), (64, 32, 1), (32, 32, 1), (32, 16, 1),
                            (16, 16, 1)]
    assert steps(start, rows_fixed=True) == [(64, 32, 3), (64, 32, 2), (64, 32, 1), (64, 16, 1)]
    assert smaller_config(start).kwargs["BLOCK_D"] == 256 and smaller_config(start).num_warps == 8
