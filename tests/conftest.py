"""Test set-up: Triton runs under its interpreter when there is no GPU, outputs are
NaN-poisoned, and `check_close` implements the tolerance rule of ARCHITECTURE.md. Without
Triton (macOS, Windows: no wheels), or with one older than the kernels need
(_common.MIN_TRITON), the tests of the Triton kernels are skipped (HAS_TRITON, `needs_triton`)
and the rest run on the PyTorch path."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    # Must be set before longflash (and so Triton's JIT) is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import longflash._common  # noqa: E402
from longflash import interface  # noqa: E402
from longflash.reference import error_bound  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
# The Triton kernels can run (interpreted without a GPU): a triton package, new enough.
HAS_TRITON = interface._TRITON_PROBLEM is None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and HAS_TRITON
# a module that tests the Triton kernels themselves: `pytestmark = needs_triton`
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason=f"the Triton kernels need "
                                  f"{interface._TRITON_PROBLEM}")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_uninterpreted(*argv, timeout=600, **env):
    """`python *argv` in a fresh interpreter without TRITON_INTERPRET (Triton then compiles
    for a GPU target: the machine's, or a stand-in's), from the repository root with
    kernels/ and the root importable, `env` added to the environment. It must succeed (its
    stderr's tail is the failure message); returns the CompletedProcess."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]),
                **env)
    full.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, *argv], env=full, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def torch_sdpa(query, key, value, enable_gqa=False, **kwargs):
    """PyTorch's scaled_dot_product_attention, the SDPA drop-in's yardstick, as torch >= 2.5
    computes it on torch 2.4 too: enable_gqa (which 2.4 lacks) as key and value heads repeated
    for each query head of their group, and 0 for a row a boolean mask leaves no key."""
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = (x.repeat_interleave(group, dim=-3) for x in (key, value))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.dtype == torch.bool:  # a row that sees no key: 0, as from
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)  # torch 2.5 on (2.4: NaN)
    return out


# Under pytest-xdist (make test) each worker takes its share of the cores for torch's threads;
# each taking all of them oversubscribes the machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (_CPUS or 1) // _WORKERS))


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(longflash._common, "POISON_OUTPUTS", True)


def check_close(name, out, out_lowp, ref):
    """max|out - ref| <= 2 * max|out_lowp - ref| + floor, where ref is the float64 reference
    and out_lowp the same computation done by PyTorch in the input's precision.

    -inf entries (lse of rows that see no key) must match exactly; the rest is compared.
    """
    dtype = out_lowp.dtype if out_lowp.dtype != torch.float64 else torch.float32
    ref = ref.double()
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(out) & (out < 0), inf & (ref < 0)), f"{name}: -inf pattern"
    assert not torch.isnan(out).any(), f"{name}: NaN in output (unwritten or invalid)"
    out, out_lowp, ref = (x.double()[~inf] for x in (out, out_lowp, ref))
    if ref.numel() == 0:
        return
    err = (out - ref).abs().max().item()
    err_lowp = (out_lowp - ref).abs().max().item()
    bound = error_bound(err_lowp, ref.abs().max().item(), dtype)
    print(f"{name}: max err {err:.3e}, PyTorch low-precision err {err_lowp:.3e}, bound {bound:.1e}")
    assert err <= bound, f"{name}: {err:.3e} > {bound:.1e} (2 * {err_lowp:.3e} + floor)"


def errors_raised(calls):
    """{name: (exception type name, message), or None if it raised nothing} of each call, for
    ranks that send what they raised back to the parent (picklable, unlike some exceptions)."""
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - recorded, asserted on in the parent
            errors[name] = (type(e).__name__, str(e))
    return errors


def _outputs_and_grads(fn, inputs, do, dlse):
    """fn(*inputs) -> (o, lse); returns o, lse and the gradients of sum(o * do) +
    sum(lse * dlse) (rows with a finite lse) with respect to every input."""
    o, lse = fn(*inputs)
    loss = (o * do).sum() + (lse.nan_to_num(neginf=0.0) * dlse.to(lse.dtype)).sum()
    return (o, lse) + torch.autograd.grad(loss, inputs)


def check_with_grads(fn, ref_fn, inputs, names, do, dlse):
    """fn's o, lse and input gradients against ref_fn's in float64 by the tolerance rule, with
    ref_fn(..., upcast=False) as the low-precision computation; names: the inputs' ("q", ...).
    Returns fn's (o, lse, gradients...)."""
    got = _outputs_and_grads(fn, inputs, do, dlse)
    lowp = _outputs_and_grads(lambda *x: ref_fn(*x, upcast=False), inputs, do, dlse)
    x64 = [x.detach().double().requires_grad_() for x in inputs]
    ref = _outputs_and_grads(ref_fn, x64, do.double(), dlse.double())
    for name, a, b, r in zip(("o", "lse", *(f"d{n}" for n in names)), got, lowp, ref):
        assert a.shape == r.shape, name
        check_close(name, a, b, r)
    return got
