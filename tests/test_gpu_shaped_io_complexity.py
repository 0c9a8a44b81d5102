"""RQ2 before any GPU: the GPU-shaped rows of the campaign's ncu step (tests/gpu_shaped/
io_complexity.py, made-up bytes) through notebooks/io_complexity.ipynb for device class h100,
then the paper on its macros; and the partial runs a GPU window can leave (nothing measured,
ncu missing, no L2 size recorded, L2 bytes missing). Everything is written under tmp_path, never
into results/, figures/ or paper/generated/."""

import math
import os
import re

import pandas as pd
import pytest

from tests import gpu_shaped
from tests.gpu_shaped import io_complexity as fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READ, WRITE, LTS = "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_bytes.sum"


_macros = gpu_shaped.macros


def _notebook(tmp_path, drop_metric=None, **write_kwargs):
    """The fixture into a scratch results folder holding nothing else (so only class h100
    runs), without the rows of `drop_metric` if given (a results file written before the ncu
    step recorded that metric), the notebook over it; returns (results, figures, generated,
    its output)."""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    res = tmp_path / "results"
    csv = fixture.write(res, **write_kwargs)
    if drop_metric:
        df = pd.read_csv(csv)
        df[df["metric"] != drop_metric].to_csv(csv, index=False)
    gen, fig, out = gpu_shaped.run_notebooks(tmp_path, ["io_complexity"], timeout=600)
    assert "for device class h100" in out and "skipped" not in out, out
    return res, fig, gen, out


def test_fixture_rows_are_the_ncu_steps():
    """The fixture's rows are the campaign's: its plan, its row writer, its not-measured rows."""
    from experiments import ncu as ncu_probe
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        df = pd.read_csv(fixture.write(tmp))
        bare = pd.read_csv(fixture.write(os.path.join(tmp, "bare"), ncu=False))
    plan = ncu_probe.ncu_probe_plan()
    assert len(df) == 3 * len(plan) and set(df["experiment"]) == {"io_complexity_ncu"}
    assert set(df["metric"]) == {READ, WRITE, LTS} and set(df["unit"]) == {"bytes"}
    assert set(df["device"]) == {gpu_shaped.GPU}
    assert {(p["provider"], p["seqlen"]) for p in plan} == set(zip(df["provider"], df["seqlen_q"]))
    budget = df[df["note"] == ncu_probe.NCU_NOT_MEASURED]
    assert set(budget["status"]) == {"error"} and len(budget) == 2 * 3  # the last two, at 1K
    assert set(budget["seqlen_q"]) == {1024}
    assert (df["status"] == "error").sum() == len(budget) + 1  # and one metric ncu lacked
    assert set(bare["status"]) == {"unsupported"} and bare["value"].isna().all()


@pytest.mark.slow
def test_notebook_and_paper_on_gpu_shaped_rows(tmp_path):
    res, fig, gen, _ = _notebook(tmp_path)
    m = _macros(gen / "io_complexity_h100.tex")
    assert all(k.startswith("HOneZeroZero") for k in m)
    assert _macros(gen / "io_complexity.tex") == _macros(
        os.path.join(ROOT, "paper", "generated", "io_complexity.tex"))  # CPU's untouched
    # The worst |measured / model - 1| of LongFlash beyond L2, from the rows themselves.
    df = pd.read_csv(res / "io_complexity" / "h100.csv")
    ok = df[(df["status"] == "ok") & (df["provider"] == "longflash")]
    dram = ok[ok["metric"].isin([READ, WRITE])].groupby("seqlen_q").agg(
        bytes=("value", "sum"), n=("value", "size"), model=("model_hbm_bytes", "first"),
        working_set=("working_set_bytes", "first"))
    beyond = dram[(dram["n"] == 2) & (dram["working_set"] > fixture.L2_BYTES)]
    worst = (beyond["bytes"] / beyond["model"] - 1).abs()
    assert len(beyond) == 3  # 4K, 16K, 64K
    assert m["HOneZeroZeroIoNcuWorstDev"] == f"{100 * worst.max():.1f}\\%"
    assert m["HOneZeroZeroIoNcuWorstDevAt"] == f"{worst.idxmax() // 1024}K"
    assert m["HOneZeroZeroIoNcuGoal"] == ("met" if worst.max() <= 0.10 else "not met")
    # standard / LongFlash at the largest N both measured (16K: standard stops there)
    both = df[df["metric"].isin([READ, WRITE]) & (df["seqlen_q"] == 16384)
              & (df["status"] == "ok")].groupby("provider")["value"].sum()
    assert m["HOneZeroZeroIoNcuStdOverLongflash"] == f"{both['standard'] / both['longflash']:.2f}"
    assert m["HOneZeroZeroIoNcuStdAt"] == "16K" and m["HOneZeroZeroIoNcuSdpaFlashAt"] == "64K"
    assert m["HOneZeroZeroIoNcuConfigs"] == "11" and m["HOneZeroZeroIoNcuNotMeasured"] == "2"
    assert "stage budget" in m["HOneZeroZeroIoNcuRatioOneK"]
    assert m["HOneZeroZeroIoNcuLTwoSource"].startswith("recorded by the campaign")
    # L2 bytes (lts__t_bytes.sum) over the model, from the rows themselves; LongFlash's 1K was
    # not reached (stage budget) and SDPA's 64K lacks its L2 bytes (the fixture's `missing`).
    lts = ok[ok["metric"] == LTS].set_index("seqlen_q")
    l2_ratio = lts["value"] / lts["model_hbm_bytes"]
    assert list(l2_ratio.index) == [4096, 16384, 65536]
    for n, name in ((4096, "FourK"), (16384, "OneSixK"), (65536, "SixFourK")):
        assert m[f"HOneZeroZeroIoNcuLtsRatio{name}"] == f"{l2_ratio[n]:.2f}"
    assert m["HOneZeroZeroIoNcuLtsRatioOneK"] == "not measured (stage budget)"
    assert m["HOneZeroZeroIoNcuLtsRatios"] == (
        "not measured at 1K (stage budget), "
        + ", ".join(f"{l2_ratio[n]:.2f} at {n // 1024}K" for n in l2_ratio.index))
    assert m["HOneZeroZeroIoNcuLtsRatioLargest"] == f"{l2_ratio[65536]:.2f}"
    assert m["HOneZeroZeroIoNcuLtsRatioLargestAt"] == "64K"
    share = dram.loc[65536, "bytes"] / lts.loc[65536, "value"]
    assert m["HOneZeroZeroIoNcuDramShareOfLts"] == f"{100 * share:.1f}\\%"
    assert m["HOneZeroZeroIoNcuDramShareOfLtsAt"] == "64K"
    qkvo = 4 * 16 * 128 * 2  # q, k, v, o per token: 16 heads, d 128, bfloat16, batch 1
    assert m["HOneZeroZeroIoNcuCompulsoryRatios"] == (
        "not measured at 1K (stage budget), "
        + ", ".join(f"{dram.loc[n, 'bytes'] / (qkvo * n):.2f} at {n // 1024}K"
                    for n in (4096, 16384, 65536)))
    assert m["HOneZeroZeroIoNcuKvHeadMiB"] == "32" and m["HOneZeroZeroIoNcuKvHeadAt"] == "64K"
    l2_16k = df[(df["metric"] == LTS) & (df["seqlen_q"] == 16384)
                & (df["status"] == "ok")].set_index("provider")["value"]
    assert m["HOneZeroZeroIoNcuLtsStdAt"] == "16K"
    assert m["HOneZeroZeroIoNcuLtsStdOverLongflash"] == (
        f"{l2_16k['standard'] / l2_16k['longflash']:.2f}")
    # SDPA's L2 bytes at 64K are missing: its L2 comparison falls back to 16K (DRAM's: 64K)
    assert m["HOneZeroZeroIoNcuLtsSdpaFlashAt"] == "16K"
    assert m["HOneZeroZeroIoNcuLtsSdpaFlashOverLongflash"] == (
        f"{l2_16k['sdpa_flash'] / l2_16k['longflash']:.2f}")
    devices = (gen / "devices.tex").read_text()
    assert "\\newcommand{\\GpuIoComplexity}{HOneZeroZero}" in devices
    assert (fig / "io_complexity_ncu_h100.pdf").exists()
    # A GPU paragraph of another RQ must not switch on for want of macros (not_measured.tex).
    assert not re.search(r"\\newcommand\{\\Gpu", (gen / "not_measured.tex").read_text()), (
        "run_notebooks.write_not_measured defined a \\Gpu<Rq> switch as 'not measured'")
    built = gpu_shaped.build_paper(tmp_path / "build", gen, [fig])
    if built:
        log = open(os.path.join(built[0], "main.log")).read()
        assert "io_complexity_ncu_h100" in log, log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("kwargs, goal", [
    (dict(ncu=False), "not measured"),              # ncu not found: every row unsupported
    (dict(reached=0), "not measured"),              # killed before the first configuration
    (dict(reached=3, l2_recorded=False), None),     # standard 1K, LongFlash and SDPA at 4K
], ids=["unsupported", "nothing-reached", "three-reached-no-l2"])
def test_notebook_on_partial_gpu_runs(tmp_path, kwargs, goal):
    _, fig, gen, _ = _notebook(tmp_path, **kwargs)
    m = _macros(gen / "io_complexity_h100.tex")
    if goal:
        assert m["HOneZeroZeroIoNcuGoal"] == goal and m["HOneZeroZeroIoNcuMeasured"] == "0"
        assert m["HOneZeroZeroIoNcuStdOverLongflash"].startswith("not measured")
        for name in ("LtsRatioLargest", "LtsRatioLargestAt", "DramShareOfLts",
                     "LtsStdOverLongflash", "LtsSdpaFlashOverLongflash", "LtsRatioSixFourK"):
            assert m[f"HOneZeroZeroIoNcu{name}"].startswith("not measured"), name
        for name in ("LtsRatios", "CompulsoryRatios"):
            parts = m[f"HOneZeroZeroIoNcu{name}"].split(", not measured")
            assert parts[0].startswith("not measured at 1K") and len(parts) == 4, name
        why = ("unsupported: ncu not found" if kwargs.get("ncu") is False
               else "not measured: stage budget")
        assert f"11 {why}" in m["HOneZeroZeroIoNcuNotMeasuredWhy"]
    else:
        assert m["HOneZeroZeroIoNcuMeasured"] == "3" and m["HOneZeroZeroIoNcuBeyondMeasured"] == "1"
        assert m["HOneZeroZeroIoNcuLTwoSource"].startswith("the documented default")
        assert m["HOneZeroZeroIoNcuSdpaFlashAt"] == "4K"
        assert math.isfinite(float(m["HOneZeroZeroIoNcuRatioFourK"]))
        assert math.isfinite(float(m["HOneZeroZeroIoNcuLtsRatioFourK"]))
        assert m["HOneZeroZeroIoNcuLtsRatioLargestAt"] == "4K"
        assert m["HOneZeroZeroIoNcuLtsRatioSixFourK"] == "not measured (stage budget)"
    assert (fig / "io_complexity_ncu_h100.pdf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [
    dict(drop_metric=LTS),                          # a results file with no L2 rows at all
    dict(missing=("longflash", 65536, LTS)),        # ncu's output lacked LongFlash's at 64K
], ids=["no-l2-rows", "longflash-64k-l2-missing"])
def test_notebook_without_l2_bytes(tmp_path, kwargs):
    """Missing L2 bytes say "not measured"; the DRAM comparison and its goal are unaffected."""
    _, fig, gen, _ = _notebook(tmp_path, **kwargs)
    m = _macros(gen / "io_complexity_h100.tex")
    assert m["HOneZeroZeroIoNcuMeasured"] == "9" and m["HOneZeroZeroIoNcuBeyondMeasured"] == "3"
    assert m["HOneZeroZeroIoNcuGoal"] in ("met", "not met")
    assert math.isfinite(float(m["HOneZeroZeroIoNcuRatioSixFourK"]))
    assert m["HOneZeroZeroIoNcuLtsRatioSixFourK"].startswith("not measured (")
    assert "not measured at 64K" in m["HOneZeroZeroIoNcuLtsRatios"]
    assert "not measured" not in m["HOneZeroZeroIoNcuCompulsoryRatios"].split(", ", 1)[1]
    if kwargs.get("drop_metric"):
        assert m["HOneZeroZeroIoNcuLtsRatioSixFourK"] == (
            "not measured (no lts\\_\\_t\\_bytes.sum row)")
        for name in ("LtsRatioLargest", "DramShareOfLts", "LtsStdOverLongflash",
                     "LtsSdpaFlashOverLongflash"):
            assert m[f"HOneZeroZeroIoNcu{name}"].startswith("not measured"), name
        assert m["HOneZeroZeroIoNcuLtsRatios"].count("not measured") == 4
    else:
        assert "lts" in m["HOneZeroZeroIoNcuLtsRatioSixFourK"]  # "error: lts__... missing ..."
        assert m["HOneZeroZeroIoNcuLtsRatioLargestAt"] == "16K"
        assert m["HOneZeroZeroIoNcuDramShareOfLtsAt"] == "16K"
        assert math.isfinite(float(m["HOneZeroZeroIoNcuLtsRatioLargest"]))
    assert (fig / "io_complexity_ncu_h100.pdf").exists()
