"""Linear memory on CPU: going from N = 8K to 16K, the blockwise path's peak grows by a small
fraction of what the N x N matrix grows by, while the materializing reference's grows by more.

Both are measured by experiments.measure.peak_memory_mb in a fresh interpreter, so
nothing else that the test session allocated is counted.
"""

import json

import pytest

from conftest import run_uninterpreted


SCRIPT = """
import json, sys, torch, longflash
from experiments.measure import peak_memory_mb
n, impl = int(sys.argv[1]), sys.argv[2]
def fwd_bwd(q, k, v):
    if impl == "reference":
        o = longflash.attention_ref(q, k, v)[0]
    else:
        o = longflash.attention(q, k, v, causal=True, backend="torch")
    o.backward(torch.ones_like(o))
small = [torch.randn(1, 300, 1, 64, requires_grad=True) for _ in range(3)]
fwd_bwd(*small)  # warm up: library code and allocator pages touched once are not N's memory
q, k, v = (torch.randn(1, n, 1, 64, requires_grad=True) for _ in range(3))
print(json.dumps(peak_memory_mb(lambda: fwd_bwd(q, k, v), "cpu")))
"""


def peak_mb(seqlen, impl):
    out = run_uninterpreted("-c", SCRIPT, str(seqlen), impl)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_blockwise_memory_is_linear():
    """Compared by growth: what doubling N adds to the peak. A constant part (code pages,
    allocator and BLAS scratch, which differ from one CPU and library build to another) cancels,
    so the check is the same on every machine; a quadratic allocation adds 3 N^2 / 4 elements."""
    matrix_mb = lambda n: n * n * 4 / 2**20  # noqa: E731 - one fp32 N x N matrix
    ref = {n: peak_mb(n, "reference") for n in (1024, 2048)}
    print(f"reference: {ref[1024]:.0f} MiB extra at N=1024, {ref[2048]:.0f} at N=2048; one "
          f"N x N matrix grows by {matrix_mb(2048) - matrix_mb(1024):.0f}")
    assert ref[2048] - ref[1024] >= matrix_mb(2048) - matrix_mb(1024)  # it sees quadratic growth
    blockwise = {n: peak_mb(n, "blockwise") for n in (8192, 16384)}
    grown, matrix_grown = blockwise[16384] - blockwise[8192], matrix_mb(16384) - matrix_mb(8192)
    print(f"blockwise: {blockwise[8192]:.0f} MiB extra at N=8192, {blockwise[16384]:.0f} at "
          f"N=16384 (+{grown:.0f}); one N x N matrix grows by {matrix_grown:.0f}")
    assert grown < 0.1 * matrix_grown
