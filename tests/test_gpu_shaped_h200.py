"""The GPU window's last step when the lent machine is an H200, not an H100 (the device tool
lends either; a results file and its device class are named after the GPU's model): every
RQ's GPU-shaped rows written under the H200's name (tests/gpu_shaped, made-up values), every
per-device notebook, the README table and the paper. Nothing may assume "h100": the macros
of class h200 are prefixed HTwoZeroZero, the paper's GPU paragraphs name the H200. Then the
next window as it will be (an H200 runs stage 8 beside the committed H100 results): the paper
and the README report each GPU, the H100 first.
"""

import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from tests import gpu_shaped
from tests.gpu_shaped import scaling as gpu_scaling
from tests.gpu_shaped import speedup as gpu_speedup

ROOT = gpu_shaped.ROOT
GPU, TAG, PREFIX = "NVIDIA H200", "h200", "HTwoZeroZero"


def _readme_gpu_rows(tmp_path, gen):
    """The README's RQ1 GPU rows, its table filled from the macros in gen (a copy of README.md;
    the repository's is never written)."""
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    table = subprocess.run([sys.executable, "notebooks/readme_table.py", "--readme", str(readme)],
                           cwd=ROOT, env=dict(os.environ, LONGFLASH_GENERATED=str(gen)),
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    return [line for line in readme.read_text().splitlines()
            if line.startswith("| RQ1 speed on a GPU |")]


def test_figures_readme_and_paper_on_an_h200(tmp_path, monkeypatch):
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    monkeypatch.setattr(gpu_shaped, "GPU", GPU)
    monkeypatch.setattr(gpu_shaped, "TAG", TAG)
    res = tmp_path / "results"
    gpu_shaped.write_all(res)
    assert sorted(p.name for p in res.glob("*/*.csv")) == [f"{TAG}.csv"] * len(gpu_shaped.RQS)
    gen, fig, out = gpu_shaped.run_notebooks(tmp_path, gpu_shaped.RQS, copy_figures=True,
                                             timeout=1200)
    for rq in gpu_shaped.RQS:
        assert f"{rq}.ipynb for device class {TAG}" in out, rq
        assert (gen / f"{rq}_{TAG}.tex").exists(), rq
    assert not list(gen.glob("*_h100.tex")) and not list(fig.glob("*_h100.*"))
    assert gpu_shaped.macros(gen / f"speedup_{TAG}.tex")[f"Speedup{PREFIX}Device"] == GPU
    devices = (gen / "devices.tex").read_text()
    assert f"\\newcommand{{\\GpuSpeedup}}{{{PREFIX}}}" in devices and "HOneZeroZero" not in devices
    # README: the GPU row names the H200 and its results file.
    gpu_row = _readme_gpu_rows(tmp_path, gen)
    assert len(gpu_row) == 1 and GPU in gpu_row[0] and f"`results/speedup/{TAG}.csv`" in gpu_row[0]
    # The paper builds, with the H200's GPU paragraphs and no "no GPU was available".
    built = gpu_shaped.build_paper(tmp_path / "build", gen, [fig])
    if built and built[1]:
        text, has = built[1], gpu_shaped.has
        assert has(text, f"On {GPU}, LongFlash") and not has(text, "No GPU was available")


def test_an_h200_window_beside_the_committed_h100_results(tmp_path, monkeypatch):
    """The committed results (the H100's four windows, the CPU's) and an H200's stage 8
    (GPU-shaped: RQ1's decode, batch, long, prefill, shared_prefix and mla parts against SDPA's
    FlashAttention-2 and cuDNN backends, RQ3's exactness): RQ1 reports each GPU in a paragraph,
    goals table and figure of its own, the headline sentences stay the first GPU's (the H100's),
    the README has a GPU row for each."""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    committed = gpu_shaped.committed_gpu_classes()
    if "h100" not in committed or TAG in committed:
        pytest.skip(f"written for committed H100 results and no {TAG}'s (committed: {committed})")
    res = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "results"), res)
    monkeypatch.setattr(gpu_shaped, "GPU", GPU)
    monkeypatch.setattr(gpu_shaped, "TAG", TAG)
    rows = pd.read_csv(gpu_speedup.write(res, stages=(8,), gates_pass=True))
    gpu_scaling.write(res, pieces=("exactness",))
    assert set(rows["part"]) == {"ceiling", "decode", "batch", "long", "prefill", "shared_prefix",
                                 "mla"}
    gen, fig, out = gpu_shaped.run_notebooks(tmp_path, ["speedup", "scaling"], copy_figures=True,
                                             timeout=1200, classes=["h100", TAG])
    devices = gpu_shaped.macros(gen / "devices.tex")
    assert devices["GpuSpeedup"] == "HOneZeroZero"
    assert devices["GpuSpeedupAll"] == f"HOneZeroZero,{PREFIX}"
    m = gpu_shaped.macros(gen / f"speedup_{TAG}.tex")
    # stage 8 times LongFlash against FlashAttention-2 and cuDNN only: the others not measured
    assert f"Speedup{PREFIX}OverStandardTypical" not in m
    assert f"Speedup{PREFIX}OverSdpaFlashTypical" in m and m[f"Speedup{PREFIX}GoalsCount"] == "7"
    # the cascade against LongFlash's step over duplicated caches, recomputed from the rows
    sp = rows[(rows["part"] == "shared_prefix") & (rows["metric"] == "time_ms")
              & (rows["provider"] == "longflash")]
    t = sp.pivot_table(index=["batch", "prefix_len"], columns="route", values="value")
    own = t["duplicated"] / t["cascade"]
    assert m[f"Speedup{PREFIX}SharedOverDuplicatedMin"] == f"{own.min():.2f}"
    assert m[f"Speedup{PREFIX}SharedConfigs"] == str(len(own)) == "4"
    # MLA's absorbed call against the fastest SDPA route, recomputed from the rows
    mla = rows[(rows["part"] == "mla") & (rows["metric"] == "time_ms") & (rows["status"] == "ok")]
    t = mla.assign(call=mla["provider"] + " " + mla["route"]).pivot_table(
        index=["batch", "seqlen_k"], columns="call", values="value")
    best = t.drop(columns="longflash absorbed").min(axis=1) / t["longflash absorbed"]
    assert m[f"Speedup{PREFIX}MlaOverBestPeerMin"] == f"{best.min():.2f}"
    assert m[f"Speedup{PREFIX}MlaConfigs"] == str(len(best)) == "4"
    # the gate passed: RQ1's rows after it ran with the forward's WS on, which the paper says
    timed = rows[(rows["provider"] == "longflash") & rows["part"].isin(["batch", "long"])
                 & (rows["metric"] == "time_ms") & (rows["status"] == "ok")]
    assert timed["command"].str.startswith("LONGFLASH_WS=fwd ").all()
    assert m[f"Speedup{PREFIX}LongflashSwitches"] == (
        "the forward's warp-specialized candidate on (\\texttt{LONGFLASH\\_WS=fwd}) in "
        f"{len(timed)} of {len(timed)}")
    assert "SpeedupHOneZeroZeroLongflashSwitches" not in gpu_shaped.macros(
        gen / "speedup_h100.tex")  # the H100's rows ran with the defaults
    # README: a GPU row for each GPU, the H100's first
    gpu_rows = _readme_gpu_rows(tmp_path, gen)
    assert len(gpu_rows) == 2
    assert "`results/speedup/h100.csv`" in gpu_rows[0] and GPU in gpu_rows[1]
    built = gpu_shaped.build_paper(tmp_path / "build", gen, [fig])
    if built and built[1]:
        text, has, count = built[1], gpu_shaped.has, gpu_shaped.count
        h100 = gpu_shaped.macros(gen / "speedup_h100.tex")["SpeedupHOneZeroZeroDevice"]
        first = gpu_shaped.find(text, f"On {h100}. In bfloat16")
        second = gpu_shaped.find(text, f"On {GPU}. In bfloat16")
        assert 0 <= first < second
        h100_part, gpu_part = text[first:second], text[second:]
        assert has(gpu_part, "With a prefix shared by the batch")
        assert has(gpu_part, "Multi-head latent attention decoded in its absorbed form (16")
        assert has(h100_part, "absorbed form (qv) was not measured on this GPU")
        assert has(gpu_part, "ran with kernel switches other than the package")
        assert not has(h100_part, "ran with kernel switches")
        assert count(text, "The goals set for LongFlash on a GPU, on") == 2
        assert has(text, f"{h100} and {GPU}")  # the setup and threats name both
        for gpu in (h100, GPU):  # the abstract, the contributions and the conclusion: each GPU
            assert count(text, f"On {gpu}, LongFlash") == 1, gpu
            assert count(text, f"On {gpu}, its Triton kernels met") == 2, gpu
