"""The Triton kernels compile for Hopper (sm_90) and Ampere (sm_80), checked on any machine."""

import os

import pytest
import torch

from conftest import ROOT, needs_triton, run_uninterpreted

SCRIPTS = {  # script: specs (capability:dtype:features:headdim)
    "compile_for_gpu.py": ["90:bfloat16:plain:80", "90:float16:all:256", "80:bfloat16:all:128"],
    # the split-KV decoding and merge kernels (mla: absorbed, qv and 512-dim latents)
    "compile_decode_for_gpu.py": ["90:bfloat16:paged:128", "90:float16:all:80",
                                  "80:bfloat16:all:128", "90:bfloat16:plain:128",
                                  "90:bfloat16:mla:512"],
}


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
@pytest.mark.parametrize("script,spec", [(s, spec) for s, specs in SCRIPTS.items() for spec in specs])
def test_kernels_compile_for_gpu_targets(script, spec):
    """One spec a test (a few minutes each on a 2-core machine), so pytest-xdist spreads them."""
    out = run_uninterpreted(os.path.join(ROOT, "tests", script), spec,
                            TRITON_DEFAULT_FP_FUSION="1")
    assert out.stdout.count("compiled for") == 1
