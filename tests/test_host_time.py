"""experiments/host_time.py, and what it guards: the ops without custom_op's Python layers."""

from unittest import mock

import pytest
import torch

import longflash
from experiments import host_time
from experiments.results import read_results


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rows")
def test_quick_run_writes_the_stubbed_rows(tmp_path):
    out = tmp_path / "host_time" / "cpu.csv"
    host_time.main(["--quick", "--out", str(out)])
    df = read_results([str(out)])
    assert sorted(zip(df["mode"], df["grad"])) == sorted(host_time.CALLS_MEASURED)
    assert set(df["provider"]) == {"longflash"} and set(df["kernels"]) == {"stubbed"}
    assert (df["status"] == "ok").all() and (df["metric"] == "host_us").all()
    assert (df["value"] > 0).all() and (df["p20"] <= df["value"]).all()
    assert (df["value"] <= df["p80"]).all()


def test_stubbed_call_computes_nothing_and_real_call_computes():
    """The stub replaces the implementation within its context only."""
    attn, layout, context = host_time.make_call("longflash", "stubbed", "cpu")
    q = torch.randn(1, 8, 2, 16)
    with context, mock.patch("longflash.blockwise.forward", side_effect=AssertionError):
        assert attn(q, q, q).shape == q.shape
    ref = longflash.attention(q, q, q, backend="torch")
    torch.testing.assert_close(attn(q, q, q), ref)
    assert layout == "bnhd"


def test_sdpa_rows_need_a_gpu():
    with pytest.raises(host_time.Unsupported):
        host_time.make_call("sdpa_flash", "launched", "cpu")


def test_training_call_skips_custom_ops_autograd_layer():
    """torch.library.custom_op's register_autograd fills the defaults of every argument on
    each call, quadratic in their number (about 100 us of the forward's host time at 18
    arguments): longflash.attention's autograd is an autograd.Function around the ops."""
    q, k, v = (torch.randn(1, 9, 2, 16, requires_grad=True) for _ in range(3))
    with mock.patch("torch._library.utils.fill_defaults", side_effect=AssertionError):
        o = longflash.attention(q, k, v, causal=True, backend="torch")
        torch.autograd.grad(o.sum(), (q, k, v))
