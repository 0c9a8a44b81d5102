"""experiments/host_time.py, and what it guards: the ops without custom_op's Python layers."""

from unittest import mock

import pytest
import torch

import longflash
from experiments import host_time
from experiments.results import read_results
from conftest import needs_triton, run_uninterpreted


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rows")
def test_quick_run_writes_the_stubbed_rows(tmp_path):
    """The stubbed calls' rows and the block lists' (made on every call, or kept: far less)."""
    out = tmp_path / "host_time" / "cpu.csv"
    host_time.main(["--quick", "--out", str(out)])
    df = read_results([str(out)])
    stubbed, lists = df[df["kernels"] == "stubbed"], df[df["kernels"] != "stubbed"]
    assert sorted(zip(stubbed["mode"], stubbed["grad"])) == sorted(host_time.CALLS_MEASURED)
    assert sorted(zip(lists["kernels"], lists["mode"])) == [
        ("lists kept", "bwd"), ("lists kept", "fwd"), ("lists made", "bwd"), ("lists made", "fwd")]
    us = dict(zip(zip(lists["kernels"], lists["mode"]), lists["value"]))
    assert all(us["lists kept", m] < us["lists made", m] for m in ("fwd", "bwd"))
    assert set(df["provider"]) == {"longflash"}
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


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rows")
def test_stand_in_rows_time_the_launchers(tmp_path):
    """Forward, backward and a decoding step's launchers, compiled for sm_90a, launched into a
    no-op: every row measured."""
    out = tmp_path / "cpu.csv"
    run_uninterpreted("-m", "experiments.host_time", "--quick", "--out", str(out))
    df = read_results([str(out)])
    si = df[df["kernels"] == "stand-in"]
    assert sorted(zip(si["mode"], si["seqlen_q"])) == [("bwd", 128), ("fwd", 1), ("fwd", 128)]
    assert (si["status"] == "ok").all() and (si["value"] > 0).all()


@needs_triton
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a stand-in GPU")
def test_autotuners_choice_is_recalled_without_the_autotuner():
    """After the autotuner's first call caches a choice, the launcher finds it under Triton's
    own key and launches it without Autotuner.run (whose key building is quadratic in the
    arguments); another key (here the dtype) still goes through the autotuner."""
    code = """
import torch
from unittest import mock
from triton.runtime.autotuner import Autotuner
from experiments.host_time import launches_elided
from longflash import flash_triton as ft, interface

runs = []
real = Autotuner.run
def counted(self, *args, **kwargs):
    runs.append(self)
    return real(self, *args, **kwargs)

with launches_elided(), mock.patch.object(Autotuner, "run", counted):
    for dtype in (torch.float16, torch.float16, torch.bfloat16, torch.bfloat16):
        q = torch.randn(1, 64, 2, 64, dtype=dtype)
        opts = interface._options(q, False, 0.125, -1, -1, None, 0.0, 0.0, None, None, None,
                                  0, 0)
        ft.forward(q, q, q, opts)
        print(len(runs), ft._attn_fwd.best_config in ft._attn_fwd.cache.values())
assert len(ft._attn_fwd.configs) > 1
"""
    lines = run_uninterpreted("-c", code).stdout.split()
    assert lines == ["1", "True", "1", "True", "2", "True", "2", "True"], lines


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rows")
def test_profile_logs_where_each_longflash_calls_host_time_goes(tmp_path):
    """--profile TOP: each LongFlash call's cProfile (its TOP functions by own time) in the
    log after its row (on a GPU, the launched calls' too: where their host time goes)."""
    out = tmp_path / "host_time" / "cpu.csv"
    host_time.main(["--quick", "--no-stand-in", "--profile", "5", "--out", str(out)])
    log = out.with_suffix(".log").read_text()
    for mode, grad in host_time.CALLS_MEASURED:
        head = f"host profile, longflash stubbed {mode} grad={grad}, "
        assert head in log
        table = log.split(head, 1)[1].split("host profile", 1)[0]
        assert "Ordered by: internal time" in table and "ncalls" in table
