"""RQ4 on GPU-shaped rows (tests/gpu_shaped/long_context_training.py, made-up values): the
notebook draws device class h100 from what the campaign's long_context step writes, a search cut
short reads "at least N", one never started "not measured", a run that ended after exactness
does not crash, and the CPU class still gives the committed macros. Everything is written into
tmp_path; the repository's results/, figures/ and paper/generated/ are never touched."""

import os
import shutil

import pandas as pd
import pytest

from tests import gpu_shaped
from tests.gpu_shaped import long_context_training as lct_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RQ = "long_context_training"
P = "HOneZeroZero"  # camel("h100"): the prefix of every h100 macro


_macros = gpu_shaped.macros


def _thousands(n):
    return f"{int(n):,}".replace(",", "{,}")


def _notebook(tmp_path, with_cpu=True, **fixture):
    """Write the fixture (and, with_cpu, the committed CPU results) into tmp_path/results, run
    the notebook for device class h100; (stdout, folders)."""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    res = tmp_path / "results"
    if with_cpu:
        gpu_shaped.copy_cpu_results(RQ, res)
    csv = lct_gpu.write(res, **fixture)
    gen, fig, out = gpu_shaped.run_notebooks(tmp_path, [RQ], classes=[gpu_shaped.TAG])
    assert "skipped" not in out, out
    return out, pd.read_csv(csv), fig, gen


def _probe_maximum(df, model, provider):
    """(longest ok probe, shortest failed probe above it) of one search, from the probe rows."""
    probes = df[(df["part"] == "max_context") & (df["metric"] == "peak_mem_mb")
                & (df["model"] == model) & (df["provider"] == provider)]
    best = probes[probes["status"] == "ok"]["seqlen_q"].max()
    above = probes[(probes["status"] != "ok") & (probes["seqlen_q"] > best)]["seqlen_q"].min()
    return best, above


@pytest.mark.slow
def test_full_campaign_step(tmp_path):
    stdout, df, fig, gen = _notebook(tmp_path)
    assert "for device class h100" in stdout
    m = _macros(gen / f"{RQ}_h100.tex")
    assert all(k.startswith(P) for k in m)
    assert m[P + "LctDevice"] == gpu_shaped.GPU and m[P + "LctDtype"] == "bfloat16"
    assert m[P + "LctMissingParts"] == "none"
    cfg = lct_gpu.config()
    model_a, model_b = cfg.models
    assert (m[P + "LctModelA"], m[P + "LctModelB"]) == (model_a, model_b)

    # Computed here from the probe rows, not from the notebook's logic: GPT-2 small's three
    # searches ended in a bracket, and the goal (8x standard attention's context) is judged on
    # what the brackets prove.
    lf, lf_above = _probe_maximum(df, model_a, "longflash")
    std, std_above = _probe_maximum(df, model_a, "standard")
    assert m[P + "LctMaxLfA"] == _thousands(lf) and m[P + "LctMaxStdA"] == _thousands(std)
    assert m[P + "LctVsStdA"] == f"{lf / std:.1f}$\\times$ standard attention's"
    verdict = "met" if lf / std_above >= 8 else "not met" if lf_above / std <= 8 else None
    assert verdict and m[P + "LctGoalStdA"] == verdict
    sdpa, _ = _probe_maximum(df, model_a, "sdpa_flash")
    assert m[P + "LctVsSdpaA"].startswith(f"{lf / sdpa:.2f}$\\times$ FlashAttention-2's: ")

    # A search cut short by the time budget is a lower bound: "at least N", in the text and in
    # the list of lower bounds, never an exact maximum.
    rows = df[df["metric"] == "max_seqlen"].set_index(["model", "provider"])
    lower = rows[rows["note"].fillna("").str.startswith("lower bound")]
    assert len(lower), "the fixture's full run should have a search cut short"
    names = {"standard": "Std", "sdpa_flash": "Sdpa", "longflash": "Lf"}
    for (model, provider), r in lower.iterrows():
        key = f"{P}LctMax{names[provider]}{'AB'[cfg.models.index(model)]}"
        assert m[key] == f"at least {_thousands(r['value'])}", key
        assert model in m[P + "LctLowerBounds"]
    assert m[P + "LctGoalStdB"].startswith(("met", "not met", "not determined"))

    # Figures of the GPU class beside the CPU's, and the paper's switch for the GPU paragraph.
    for name in ("max_context", "memory_fit", "exactness"):
        assert (fig / f"long_context_{name}_h100.pdf").exists(), name
        assert m[P + "LctFig" + "".join(w.title() for w in name.split("_"))] == \
            f"long_context_{name}_h100"
    assert not (fig / "long_context_projection_h100.pdf").exists()  # a formula: CPU class only
    devices = (gen / "devices.tex").read_text()
    assert "\\newcommand{\\GpuLongContextTraining}{HOneZeroZero}" in devices
    assert "\\input{generated/long_context_training_h100}" in devices
    # The CPU class, drawn in the same execution, still gives the committed macros.
    assert _macros(gen / f"{RQ}.tex") == _macros(
        os.path.join(ROOT, "paper", "generated", f"{RQ}.tex"))


@pytest.mark.slow
@pytest.mark.parametrize("fixture", [dict(parts=("exactness",)), dict(budget_s=107),
                                     dict(error_from={"longflash": 131072})],
                         ids=["exactness-only", "late-stage-budget", "longflash-errors-from-128K"])
def test_partial_campaign_step(tmp_path, fixture):
    _, df, fig, gen = _notebook(tmp_path, with_cpu=False, **fixture)
    m = _macros(gen / f"{RQ}_h100.tex")
    assert (fig / "long_context_exactness_h100.pdf").exists()
    assert m[P + "LctExactCompare"] in ("smaller than", "larger than", "equal to")
    if fixture.get("parts") == ("exactness",):
        assert m[P + "LctMissingParts"] == "memory\\_model, max\\_context"
        assert not (fig / "long_context_max_context_h100.pdf").exists()
        assert P + "LctFigMaxContext" not in m and P + "LctFigMemoryFit" not in m
        for key in ("LctMaxLfA", "LctVsSdpaB", "LctCTwoStd"):
            assert m[P + key].startswith("not measured (the run ended before part"), key
        return
    if "error_from" in fixture:  # an error is not out of memory: the maximum is a lower bound
        assert m[P + "LctMaxLfA"].startswith("at least ")
        assert "131072 tokens failed with an error, not out of memory" in m[P + "LctLowerBounds"]
        assert not m[P + "LctGoalStdA"].startswith("not met")
        return
    # budget_s=107: GPT-2 medium's searches never started; the text says so and why.
    rows = df[df["metric"] == "max_seqlen"]
    unstarted = rows[rows["status"] == "error"]
    assert len(unstarted) and set(unstarted["note"]) == {"not measured: time budget"}
    model_b = lct_gpu.config().models[1]
    assert set(unstarted["model"]) == {model_b}
    for key in ("LctMaxStdB", "LctMaxSdpaB", "LctMaxLfB"):
        assert m[P + key] == "not measured (time budget)", key
    assert m[P + "LctGoalStdB"] == "not measured"
    assert m[P + "LctVsSdpaB"].startswith("not measured (LongFlash: time budget")
    assert m[P + "LctNotMeasured"].count(model_b) == 3
    assert m[P + "LctMaxStdA"] == _thousands(_probe_maximum(df, lct_gpu.config().models[0],
                                                            "standard")[0])
    assert (fig / "long_context_max_context_h100.pdf").exists()
