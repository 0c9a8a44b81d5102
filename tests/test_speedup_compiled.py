"""RQ1's modes on a compiled provider. On the H100 (torch 2.11) every bwd row of flex was an
error: its backward, compiled by AOTAutograd during fwd_bwd, donated its saved buffers, and a
backward that does refuses the retain_graph=True with which mode bwd times every provider.
FlexAttention's backward does not run on CPUs, but any torch.compile'd attention has the same
AOTAutograd backward: here a compiled SDPA stands in for flex, through the sweep itself."""

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from experiments import speedup


def _compiled_attention():
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                             backend="aot_eager")  # AOTAutograd without Inductor: fast
    return compiled, "bhnd"


def test_compiled_provider_is_measured_in_every_mode(tmp_path, monkeypatch):
    """fwd, fwd_bwd, then bwd (the sweep's order) on a compiled provider: every row ok."""
    import torch._functorch.config as functorch_config
    if not hasattr(functorch_config, "donated_buffer"):
        pytest.skip(f"torch {torch.__version__} does not donate buffers")
    torch._dynamo.reset()
    monkeypatch.setattr(speedup, "make_attention",
                        lambda provider, device, causal, seqlen: _compiled_attention())
    monkeypatch.setattr(speedup.log, "path", None)
    cfg = speedup.Config(**dict(speedup.QUICK, providers=("flex",), seqlens=(128,),
                                causals=(False,), long_seqlens=(), parts=("batch",),
                                threads=0, ceiling_rep_ms=0))
    out = tmp_path / "cpu.csv"
    speedup.run(cfg, "cpu", str(out))
    df = pd.read_csv(out)
    rows = df[df["provider"] == "flex"]
    assert set(rows["mode"]) == {"fwd", "fwd_bwd", "bwd"}
    assert (rows["status"] == "ok").all(), rows[rows["status"] != "ok"].to_dict("records")
    assert functorch_config.donated_buffer  # the patch ended with the measurement


def test_compiled_bwd_gradients_are_right():
    """A backward compiled under the measurement's configuration, timed with retain_graph,
    gives the gradients of eager attention on every call."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_()
    expected = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)
    attn, _ = _compiled_attention()
    with speedup._compile_config("flex"):
        speedup._mode_fn(attn, q, k, v, do, "fwd_bwd")()
        bwd = speedup._mode_fn(attn, q, k, v, do, "bwd")
        for _ in range(3):
            for got, want in zip(bwd(), expected):
                torch.testing.assert_close(got, want)
