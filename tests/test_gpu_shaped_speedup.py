"""RQ1's last step of the GPU window, before any GPU: GPU-shaped rows (tests/gpu_shaped/speedup.py,
made-up values, written only into tmp_path) -> notebooks/speedup.ipynb for device class h100 ->
the issue's goals as macros, the README's GPU row and the paper; and the same on partial
results (the window ended after stage 1, a part that failed, kernels that failed)."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from tests import gpu_shaped
from tests.gpu_shaped import speedup as gpu_speedup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow
VERDICTS = {"met", "not met", "not measured"}
GOALS = ("FwdFlash", "FwdCudnn", "FwdBwdFlash", "NeverSlowerDSixtyFour",
         "NeverSlowerDTwoFiftySix", "NeverSlowerCausal", "FwdMatmul")
P = "SpeedupHOneZeroZero"


_macros = gpu_shaped.macros


def _notebook(tmp_path, edit=None, **fixture):
    """Fixture rows -> tmp_path/results/speedup/h100.csv (the only results file, so only the
    h100 class runs; `edit` changes its DataFrame first), then the notebook on them with copies
    of paper/generated and figures/. Returns (rows, generated folder, run_notebooks' output)."""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    csv = gpu_speedup.write(tmp_path / "results", **fixture)
    if edit:
        edit(pd.read_csv(csv)).to_csv(csv, index=False)
    gen, _, out = gpu_shaped.run_notebooks(tmp_path, ["speedup"], copy_figures=True)
    return pd.read_csv(csv), gen, out


def _readme(tmp_path, gen):
    """The README's headline table filled from gen (a copy of README.md; the repository's is
    never written)."""
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    env = dict(os.environ, LONGFLASH_GENERATED=str(gen))
    out = subprocess.run([sys.executable, "notebooks/readme_table.py", "--readme", str(readme)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = readme.read_text()
    return text.split("<!-- headline:start -->")[1].split("<!-- headline:end -->")[0]


def _paper(tmp_path, gen):
    """Build the paper on gen and tmp_path/figures (skipped without latexmk); its text."""
    built = gpu_shaped.build_paper(tmp_path / "build", gen, [tmp_path / "figures"])
    return built and built[1]


def _worst(rows, baseline, mode, headdim, causal, seqlen_min=4096):
    """The issue's goal computed here, independently of the notebook: the smallest
    time(baseline) / time(longflash) over part batch at this mode, head dim and causal, from
    seqlen_min tokens on (baseline "matmul": longflash's TFLOP/s over the matmul ceiling)."""
    r = rows[(rows["experiment"] == "speedup") & (rows["part"] == "batch")
             & (rows["mode"] == mode) & (rows["headdim"] == headdim)
             & (rows["causal"] == causal) & (rows["seqlen_q"] >= seqlen_min)
             & (rows["status"] == "ok")]
    if baseline == "matmul":
        matmul = rows[rows["metric"] == "matmul_tflops"]["value"].iloc[0]
        lf = r[(r["provider"] == "longflash") & (r["metric"] == "tflops")]
        return (lf["value"] / matmul).min()
    t = r[r["metric"] == "time_ms"].pivot_table(index="seqlen_q", columns="provider",
                                                 values="value")
    return (t[baseline] / t["longflash"]).min()


def test_paper_text_reads_a_sentence_across_a_page_turn():
    """The paper's checks find a sentence that a page break, and the [t] floats atop the next
    page, fall inside (as in pdftotext's text of the built paper), and only such a sentence."""
    text = ("Attention decoded in 17\fTable 2: The goals set for LongFlash. Goal Verdict "
            "its absorbed form (16 configurations). The end. 18\fNext page.")
    assert gpu_shaped.has(text, "Attention decoded in its absorbed form (16")
    assert gpu_shaped.find(text, "decoded in its absorbed") == text.index("decoded")
    assert gpu_shaped.count(text, "The goals set for") == 1
    assert not gpu_shaped.has(text, "Attention in its absorbed")  # a word is missing
    assert not gpu_shaped.has(text, "The end. Goal")  # out of order
    assert not gpu_shaped.has(text.replace("\f", " "), "decoded in its")  # no page turn
    # the rule's premise: every float of the paper is placed at the top of a page
    for path in glob.glob(os.path.join(gpu_shaped.ROOT, "paper", "sections", "*.tex")):
        with open(path) as f:
            placed = re.findall(r"\\begin\{(?:figure|table)\*?\}(\[\w*\])?", f.read())
        assert set(placed) <= {"[t]"}, path


def test_goals_readme_and_paper_on_the_full_campaign(tmp_path):
    rows, gen, out = _notebook(tmp_path)
    assert "for device class h100" in out and "skipped" not in out
    m = _macros(gen / "speedup_h100.tex")
    assert m[f"{P}Device"] == gpu_shaped.GPU and m[f"{P}Dtype"] == "bfloat16"
    # Two goals recomputed from the rows: the value, and the verdict that follows from it.
    fwd = _worst(rows, "sdpa_flash", "fwd", 128, False)
    assert m[f"{P}GoalFwdFlashValue"] == f"{fwd:.2f}$\\times$"
    assert m[f"{P}GoalFwdFlashVerdict"] == ("met" if fwd >= 1.5 else "not met")
    assert m[f"{P}GoalFwdFlashMeasured"] == "3 of 3"  # 4K, 8K, 16K
    frac = _worst(rows, "matmul", "fwd", 128, False)
    assert m[f"{P}GoalFwdMatmulValue"] == f"{100 * frac:.1f}\\%"
    assert m[f"{P}GoalFwdMatmulVerdict"] == ("met" if frac >= 0.75 else "not met")
    slow = min(_worst(rows, "sdpa_flash", mode, 256, c) for mode in ("fwd", "bwd", "fwd_bwd")
               for c in (False, True))
    assert m[f"{P}GoalNeverSlowerDTwoFiftySixValue"] == f"{slow:.2f}$\\times$"
    for goal in GOALS:
        assert m[f"{P}Goal{goal}Verdict"] in VERDICTS - {"not measured"}, goal
        assert m[f"{P}Goal{goal}Target"] and m[f"{P}Goal{goal}Scope"], goal
    counts = [int(m[f"{P}Goals{k}"]) for k in ("Met", "NotMet", "NotMeasured")]
    assert sum(counts) == int(m[f"{P}GoalsCount"]) == len(GOALS)
    # cuDNN and flex cannot run every configuration: said, with the status, not dropped.
    assert "sdpa\\_cudnn unsupported" in m[f"{P}OverSdpaCudnnSlower"]
    assert "flex unsupported" in m[f"{P}OverFlexSlower"]
    assert "\\newcommand{\\GpuSpeedup}{HOneZeroZero}" in (gen / "devices.tex").read_text()
    # Decoding timed as CUDA-graph replays, recomputed from the rows: LongFlash (splits chosen)
    # against the fastest other provider of each (batch, cache length).
    d = rows[(rows["part"] == "decode") & (rows["metric"] == "time_ms_graph")
             & (rows["status"] == "ok")]
    lf = d[(d["provider"] == "longflash") & (d["num_splits"] == 0) & d["kv_dtype"].isna()]
    best = d[d["provider"] != "longflash"].groupby(["batch", "seqlen_k"])["value"].min()
    ratio = (best / lf.set_index(["batch", "seqlen_k"])["value"]).dropna()
    assert m[f"{P}DecodeGraphOverBestPeerMin"] == f"{ratio.min():.2f}"
    assert m[f"{P}DecodeGraphOverBestPeerMax"] == f"{ratio.max():.2f}"
    assert m[f"{P}DecodeGraphOverBestPeerConfigs"] == str(len(ratio)) == "16"
    # the float8 cache against the bf16 one (per call, splits chosen), from the rows
    t = rows[(rows["part"] == "decode") & (rows["metric"] == "time_ms")
             & (rows["provider"] == "longflash") & (rows["num_splits"] == 0)]
    by = lambda x: x.set_index(["batch", "seqlen_k"])["value"]  # noqa: E731
    gain = by(t[t["kv_dtype"].isna()]) / by(t[t["kv_dtype"] == "float8_e4m3fn"])
    assert m[f"{P}DecodeFpEightGainMin"] == f"{gain.min():.2f}"
    assert m[f"{P}DecodeFpEightGainMax"] == f"{gain.max():.2f}"
    assert m[f"{P}DecodeFpEightConfigs"] == str(len(gain)) == "16"
    assert m[f"{P}DecodeFpEightQuantErrMax"] == "2.1e-02"
    # chunked prefill: float8 pages in place against the gathered copy and bf16 pages
    p = rows[(rows["part"] == "prefill") & (rows["metric"] == "time_ms")]
    route = p["kv_dtype"].fillna("bf16") + " " + p["route"]
    by = lambda name: p[route == name].set_index(["seqlen_k", "seqlen_q"])["value"]  # noqa: E731
    in_place = by("float8_e4m3fn in_place")
    over_gathered = by("float8_e4m3fn gathered") / in_place
    assert m[f"{P}PrefillOverGatheredMin"] == f"{over_gathered.min():.2f}"
    assert m[f"{P}PrefillOverNativeMax"] == f"{(by('bf16 in_place') / in_place).max():.2f}"
    assert m[f"{P}PrefillConfigs"] == str(len(over_gathered)) == "9"
    assert m[f"{P}PrefillShape"] == "batch 4, 32 query and 8 KV heads of dimension 128"
    # block-sparse attention at the sparsest mask, at 64K tokens: LongFlash's time over its
    # dense time, and the fastest other provider's over LongFlash's, from the rows
    sp = rows[(rows["part"] == "sparse") & (rows["metric"] == "time_ms")
              & (rows["seqlen_q"] == rows["seqlen_q"][rows["part"] == "sparse"].max())]
    t = sp[sp["mode"] == "fwd"].set_index(["provider", "density"])["value"]
    low = sp["density"].min()
    assert m[f"{P}SparseLongflashFracFwd"] == f"{t[('longflash', low)] / t[('longflash', 1.0)]:.2f}"
    best = min(t[(p, low)] for p in ("flex", "sdpa_efficient"))
    assert m[f"{P}SparseOverBestPeerFwd"] == f"{best / t[('longflash', low)]:.2f}"
    assert m[f"{P}SparseBestPeers"] == "FlexAttention" and m[f"{P}SparseSeqlen"] == "64K"
    # block-sparse decoding at the sparsest mask per KV head, 128K tokens of cache, batch 8:
    # LongFlash's block_mask step over its dense step, the fastest other one's over it
    sd = rows[(rows["part"] == "sparse_decode") & (rows["metric"] == "time_ms")
              & (rows["seqlen_k"] == 131072) & (rows["batch"] == 8) & (rows["status"] == "ok")]
    own = sd[(sd["provider"] == "longflash") & (sd["route"] == "block_mask")]
    low = own[(own["mask_heads"] == "kv") & (own["density"] == own["density"].min())]
    frac = low["value"].iloc[0] / own[own["density"] == 1]["value"].iloc[0]
    assert m[f"{P}SparseDecodeKvLongflashFrac"] == f"{frac:.2f}"
    peers = sd[(sd["provider"] != "longflash") & (sd["mask_heads"] == "kv")
               & (sd["density"] == low["density"].iloc[0])]["value"]
    assert m[f"{P}SparseDecodeKvOverBestPeer"] == f"{peers.min() / low['value'].iloc[0]:.2f}"
    assert m[f"{P}SparseDecodeKvBestPeer"] == "FlexAttention"
    assert m[f"{P}SparseDecodeSeqlen"] == "128K" and m[f"{P}SparseDecodeBatch"] == "8"
    # README: the GPU row first, the CPU rows kept.
    table = _readme(tmp_path, gen)
    lines = [line for line in table.splitlines() if line.startswith("| RQ")]
    assert lines[0].startswith("| RQ1 speed on a GPU |")
    assert f"forward {fwd:.2f}x the speed of FlashAttention-2" in lines[0]
    assert gpu_shaped.GPU in lines[0] and "`results/speedup/h100.csv`" in lines[0]
    assert [line.split(" | ")[0] for line in lines[1:]] == [
        "| RQ1 speed and memory", "| RQ2 IO complexity", "| RQ3 sequence parallelism",
        "| RQ4 long-context training"]
    assert "no GPU comparison yet" not in lines[1]
    # The paper: the GPU paragraph and its goals table, and no "no GPU was available".
    text = _paper(tmp_path, gen)
    if text:
        has, find = gpu_shaped.has, gpu_shaped.find
        assert has(text, f"On {gpu_shaped.GPU}.") and has(text, "measured (worst, where)")
        assert has(text, "timed instead as replays of each step captured in a CUDA graph")
        start = find(text, "RQ1: How much faster")  # this section's text only
        rq1 = text[start:find(text, "RQ2: ", start)]
        assert start >= 0 and rq1
        assert not has(rq1, "No GPU was available") and not has(rq1, "could not make")
        assert has(rq1, "run on GPUs only") and has(rq1, "measured below")
        assert has(rq1, "In chunked prefill over a paged cache (batch 4")
        assert not has(rq1, "Block-sparse attention (block_mask) was not measured on this GPU")
        assert has(rq1, "Block-sparse decoding (attention_with_kvcache with a block_mask of")
        assert not has(rq1, "Block-sparse decoding (block_mask in attention_with_kvcache) was not")
        assert has(rq1, "the speed of the fastest other implementation there (FlexAttention)")


@pytest.mark.parametrize("fixture, declined", [
    (dict(stages=(1,)), False),                              # the window ended after stage 1
    (dict(error_parts=("long", "decode")), False),           # two parts failed entirely
    (dict(error_providers=("longflash",)), False),           # LongFlash's kernels failed
    (dict(error_parts=("batch",)), True),                    # nothing of part batch measured
], ids=["stage1-only", "long-decode-error", "longflash-error", "batch-error"])
def test_partial_results(tmp_path, fixture, declined):
    rows, gen, out = _notebook(tmp_path, **fixture)
    table = _readme(tmp_path, gen)
    if declined:  # skipped with its reason; no GPU macros, no GPU paragraph, no GPU row
        assert "skipped for h100" in out and "part batch" in out
        assert not (gen / "speedup_h100.tex").exists()
        assert "GpuSpeedup" not in (gen / "devices.tex").read_text()
        assert "RQ1 speed on a GPU" not in table
        return
    m = _macros(gen / "speedup_h100.tex")
    for goal in GOALS:
        assert m[f"{P}Goal{goal}Verdict"] in VERDICTS, goal
    if fixture.get("stages") == (1,):  # d = 256 is stage 2: not measured, and why
        assert m[f"{P}GoalNeverSlowerDTwoFiftySixVerdict"] == "not measured"
        assert m[f"{P}GoalNeverSlowerDTwoFiftySixValue"] == "not measured"
        assert "not run" in m[f"{P}GoalNeverSlowerDTwoFiftySixWhere"]
        fwd = _worst(rows, "sdpa_flash", "fwd", 128, False)
        assert m[f"{P}GoalFwdFlashValue"] == f"{fwd:.2f}$\\times$"
        assert f"{P}DecodeBOneLongflashMs" not in m and f"{P}LongSeqlenMax" not in m
        assert m[f"{P}DecodeStatus"] == "part decode is not in this run"
    if "longflash" in fixture.get("error_providers", ()):
        assert {m[f"{P}Goal{g}Verdict"] for g in GOALS} == {"not measured"}
        assert "longflash error" in m[f"{P}GoalFwdFlashWhere"]
        assert m[f"{P}OverSdpaFlashNotMeasured"].startswith("not measured (longflash error in")
        assert m[f"{P}LongflashStatus"] == "longflash error in 90 configurations"  # 5 x 2 x 3 x 3
        assert m[f"{P}GoalsNotMeasured"] == str(len(GOALS))
    assert "RQ1 speed on a GPU" in table
    if fixture.get("stages") == (1,) or "longflash" in fixture.get("error_providers", ()):
        text = _paper(tmp_path, gen)
        if text:
            assert gpu_shaped.has(text, "not measured")


def test_decode_comparisons_not_measured(tmp_path):
    """LongFlash's unsplit decode variant and every other provider failed in part decode: the
    paper says the two comparisons were not measured, and why, instead of empty numbers."""
    peers = ("sdpa_flash", "sdpa_cudnn", "sdpa_math", "flex")
    rows, gen, out = _notebook(tmp_path, decode_errors=("longflash_nosplit",) + peers)
    m = _macros(gen / "speedup_h100.tex")
    assert f"{P}DecodeBOneLongflashMs" in m  # the split variant still ran
    assert f"{P}DecodeSplitGainMin" not in m and f"{P}DecodeOverBestPeerMin" not in m
    assert "longflash\\_nosplit error in 16 configurations" in m[f"{P}DecodeSplitGainNotMeasured"]
    peer = m[f"{P}DecodeOverBestPeerNotMeasured"]
    assert "sdpa\\_flash error in 16 configurations" in peer and "longflash\\_split ok" in peer
    graph = m[f"{P}DecodeGraphOverBestPeerNotMeasured"]
    assert "sdpa\\_flash error in 16 configurations" in graph and "longflash\\_split ok" in graph
    text = _paper(tmp_path, gen)
    if text:
        has = gpu_shaped.has
        assert has(text, "the gain from splitting the cache was not measured (")
        assert has(text, "longflash_nosplit error in 16 configurations")
        assert has(text, "the comparison was not measured (") and not has(text, "× to × ")
        assert has(text, "timed as CUDA-graph replays, the comparison was not measured")


def test_goals_judge_only_bf16_at_16k_tokens_per_batch(tmp_path):
    """A run in float16: every goal is "not measured", saying which rows the goals need, and
    the table's caption names the goals' dtype, not the run's."""
    def to_fp16(r):
        return r.assign(dtype=r["dtype"].replace("bfloat16", "float16"))
    rows, gen, out = _notebook(tmp_path, edit=to_fp16, stages=(1,))
    m = _macros(gen / "speedup_h100.tex")
    assert m[f"{P}Dtype"] == "float16" and m[f"{P}GoalDtype"] == "bfloat16"
    for goal in GOALS:
        assert m[f"{P}Goal{goal}Verdict"] == "not measured", goal
        assert "bfloat16 with 16K tokens per batch" in m[f"{P}Goal{goal}Where"], goal
    assert m[f"{P}GoalsNotMeasured"] == str(len(GOALS))
