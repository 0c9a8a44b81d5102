"""Linear memory on CPU: the blockwise path at N = 16K needs a small fraction of the
memory of the N x N matrix, while the materializing reference grows quadratically.

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
    matrix_mb = lambda n: n * n * 4 / 2**20  # noqa: E731 - one fp32 N x N matrix
    ref_mb = peak_mb(2048, "reference")
    print(f"reference, N=2048: {ref_mb:.0f} MiB extra; one N x N matrix is {matrix_mb(2048):.0f}")
    assert ref_mb >= matrix_mb(2048)  # the measurement sees a quadratic allocation
    blockwise_mb = peak_mb(16384, "blockwise")
    print(f"blockwise, N=16384: {blockwise_mb:.0f} MiB extra; one N x N matrix is "
          f"{matrix_mb(16384):.0f}")
    assert blockwise_mb < 0.1 * matrix_mb(16384)
