"""RQ3 on GPU-shaped rows (tests/gpu_shaped/scaling.py: made up, not measured): the scaling
notebook for device class h100 writes the macros of the paper's "On a GPU" paragraph, with
"not measured" and why where a partial campaign lacks a part, and the paper builds on them."""

import os
import re
import shutil

import pandas as pd
import pytest

from tests import gpu_shaped
from tests.gpu_shaped import scaling as fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "HOneZeroZero"


_macros = gpu_shaped.macros


def _run_notebook(tmp_path, **write_kw):
    """A scratch copy of results/ (the CPU run) and paper/generated/, GPU-shaped rows, the
    notebook for class h100; the h100 macros ({} if the notebook declined) and its output."""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    res = tmp_path / "results"
    gpu_shaped.copy_cpu_results("scaling", res)
    fixture.write(res, **write_kw)
    gen, _, out = gpu_shaped.run_notebooks(tmp_path, ["scaling"], timeout=600,
                                           classes=[gpu_shaped.TAG])
    h100 = gen / "scaling_h100.tex"
    return (_macros(h100) if h100.exists() else {}), out


def _gpu(macros):
    """The h100 macros without their prefix."""
    assert all(k.startswith(PREFIX) for k in macros)
    return {k[len(PREFIX):]: v for k, v in macros.items()}


def test_fixture_follows_the_script(tmp_path):
    """Rows keyed and shaped as experiments.scaling writes them on the GPU machine."""
    from experiments import scaling
    df = pd.read_csv(fixture.write(tmp_path))
    cfg = fixture.config()
    assert set(df["part"]) == {"long", "blocks", "projection", "exactness"}
    one_gpu = df[(df["part"] == "long") & (df["layout"] == "none")]
    assert sorted(one_gpu["metric"]) == ["error_bound_o_sampled", "max_err_o_sampled",
                                         "peak_mem_mb", "tflops", "time_ms"]
    assert set(one_gpu["seqlen_q"]) == {cfg.gpu_long_seqlen} == {2**20}
    assert set(one_gpu["device"]) == {gpu_shaped.GPU}
    assert set(df[df["part"] == "exactness"]["ranks"]) == set(cfg.exact_ranks)
    assert set(df[df["part"] == "exactness"]["device"]) == {fixture.HOST_CPU}
    assert set(df[df["part"] == "projection"]["link"]) == set(scaling.LINKS)
    assert len(df[df["part"] == "blocks"]) == 2 * 2 * len(scaling.BLOCKS)  # fwd/bwd, time/tflops


@pytest.mark.slow
def test_notebook_and_paper_on_gpu_shaped_rows(tmp_path):
    macros, _ = _run_notebook(tmp_path)
    gpu = _gpu(macros)
    df = pd.read_csv(tmp_path / "results" / "scaling" / "h100.csv")
    time_ms = df[(df["part"] == "long") & (df["layout"] == "none")
                 & (df["metric"] == "time_ms")]["value"].item()
    assert gpu["RingOneGpuTime"] == f"{time_ms / 1e3:.1f}\\,s"  # computed here, from the rows
    assert gpu["RingOneGpuTokens"] == "1{,}048{,}576"
    # The file's device is the GPU, although the host CPU wrote more rows (the gloo ranks).
    devices = df["device"].value_counts()
    assert devices.index[0] != gpu_shaped.GPU
    assert macros["HOneZeroZeroScalingResultsDevice"] == gpu_shaped.GPU
    # Met: ok at 1M tokens and the sampled error within the tolerance rule's bound.
    check = {m: df[(df["part"] == "long") & (df["layout"] == "none") & (df["metric"] == m)]
             ["value"].item() for m in ("max_err_o_sampled", "error_bound_o_sampled")}
    assert check["max_err_o_sampled"] <= check["error_bound_o_sampled"]
    assert gpu["RingOneGpuGoal"] == "met"
    assert gpu["RingOneGpuMaxErr"].startswith("$") and gpu["RingOneGpuErrBound"].startswith("$")
    proj = df[(df["part"] == "projection") & (df["metric"] == "projected_efficiency")
              & (df["layout"] == "zigzag") & (df["link"] == "nvlink") & (df["ranks"] == 8)]
    assert gpu["RingGpuProjZigzagNvlink"] == f"{100 * proj['value'].item():.0f}\\%"
    assert gpu["RingGpuExactMaxRanks"] == "16"
    # The CPU class is untouched by the GPU file.
    assert (tmp_path / "generated" / "scaling.tex").read_text() == open(
        os.path.join(ROOT, "paper", "generated", "scaling.tex")).read()
    for name in ("scaling_weak_h100", "scaling_exactness_h100"):
        assert (tmp_path / "figures" / f"{name}.pdf").exists(), name
    devices = (tmp_path / "generated" / "devices.tex").read_text()
    assert "\\newcommand{\\GpuScaling}{HOneZeroZero}" in devices
    # notebooks/run_notebooks.py must not define the other RQs' \Gpu<Rq> as "not measured":
    # the paper tests them with \ifdefined, and a placeholder would open their GPU paragraphs.
    placeholders = re.findall(r"\\newcommand\{\\(Gpu\w+)\}",
                              (tmp_path / "generated" / "not_measured.tex").read_text())
    assert not placeholders, f"not_measured.tex defines {placeholders}"
    built = gpu_shaped.build_paper(tmp_path / "build", tmp_path / "generated",
                                   [tmp_path / "figures"])
    if built:
        assert "scaling_weak_h100" in open(os.path.join(built[0], "main.log")).read()


@pytest.mark.slow
@pytest.mark.parametrize("write_kw, goal", [
    (dict(pieces=("one_gpu",), one_gpu="oom"), "not met"),        # killed after its first rows
    (dict(pieces=("exactness",)), "not measured"),                 # only scaling_exact ran
    (dict(pieces=("one_gpu", "blocks", "projection"), one_gpu="error"), "not measured"),
    (dict(pieces=("one_gpu",), exact=False), "not met"),        # beyond the tolerance rule
], ids=["one-gpu-oom-only", "exactness-only", "one-gpu-error", "one-gpu-inexact"])
def test_partial_campaign(tmp_path, write_kw, goal):
    gpu = _gpu(_run_notebook(tmp_path, **write_kw)[0])
    assert gpu["RingOneGpuGoal"] == goal
    if "one_gpu" in write_kw["pieces"] and write_kw.get("one_gpu", "ok") != "ok":
        assert gpu["RingOneGpuTime"].startswith("not measured (")
        assert gpu["RingOneGpuPeak"].startswith("not measured (")
    if "projection" not in write_kw["pieces"]:
        assert gpu["RingGpuProjNotMeasured"].startswith("not projected (")
    if "exactness" not in write_kw["pieces"]:
        assert gpu["RingGpuExactNotMeasured"].startswith("not measured (")


@pytest.mark.slow
def test_nothing_drawable_is_skipped(tmp_path):
    """Only failed gloo parts: the notebook declines for h100 (NotApplicable), no crash."""
    macros, out = _run_notebook(tmp_path, pieces=("ring_long", "exactness"),
                                failed=("ring_long", "exactness"))
    assert macros == {}
    assert "skipped for h100" in out and "no part with ok rows" in out
