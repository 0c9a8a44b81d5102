"""RQ1's benchmark, end to end on tiny shapes: experiments/speedup.py --quick writes one row per
provider, mode, configuration and metric, in the results schema, with the right statuses; an
over-budget configuration is an "oom" row; part decode (experiments/decode.py) one row per
provider, split choice, batch, cache length and metric; part prefill (experiments/prefill.py)
one row per route, cache dtype, key count, chunk and metric; part shared_prefix
(experiments/shared_prefix.py) one row per provider, route, batch, prefix length and metric;
part mla (experiments/mla_decode.py) one row per provider, route, batch, cache length and
metric; part sparse (experiments/block_sparse.py) one row per provider, mode, density and
metric. No timing is asserted."""

import math
import os
import subprocess
import sys

import pandas as pd
import pytest

from experiments import speedup
from experiments.results import COLUMNS, KEY_COLUMNS, PROVENANCE_COLUMNS, flops, tflops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROVIDERS = ["longflash", "sdpa_cpu", "standard", "sdpa_efficient", "flex"]
METRICS = {"time_ms", "tflops", "peak_mem_mb"}
BUDGET_MB = 64  # standard attention at 2048 tokens, 2 heads: 32 MiB per N x N matrix, several


def run_quick(out, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]))
    return subprocess.run([sys.executable, "-m", "experiments.speedup", "--quick", "--out",
                           str(out), "--cpu-mem-budget-mb", str(BUDGET_MB), "--providers",
                           ",".join(PROVIDERS), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("speedup") / "cpu.csv"
    proc = run_quick(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, pd.read_csv(out), proc.stdout


def test_schema_and_one_row_per_measurement(quick):
    out, df, _ = quick
    assert list(df.columns[:len(COLUMNS + PROVENANCE_COLUMNS)]) == COLUMNS + PROVENANCE_COLUMNS
    assert not df.duplicated(KEY_COLUMNS + ["num_splits", "kv_dtype", "route",
                                            "prefix_len", "density", "mask_heads"]).any()
    assert set(df["experiment"]) == {"speedup"}
    assert set(df["part"]) == {"batch", "long", "decode", "prefill", "shared_prefix", "mla",
                               "sparse", "sparse_decode", "ceiling"}
    cfg = speedup.Config(**speedup.QUICK)
    runs = df[df["part"].isin(["batch", "long"])]
    groups = runs.groupby(["part", "seqlen_q", "headdim", "causal", "provider", "mode"])
    expected = len(PROVIDERS) * (len(cfg.seqlens) * len(cfg.causals) * len(cfg.modes)
                                 + len(cfg.long_seqlens) * len(cfg.long_modes))
    assert groups.ngroups == expected
    assert all(set(g["metric"]) == METRICS and len(g) == len(METRICS) for _, g in groups)
    # part batch: tokens per batch fixed; part long: batch 1
    batch = runs[runs["part"] == "batch"]
    assert (batch["batch"] * batch["seqlen_q"] == cfg.tokens_per_batch).all()
    assert (runs[runs["part"] == "long"]["batch"] == 1).all()
    assert (batch["nheads"] * batch["headdim"] == cfg.hidden).all()
    assert os.path.exists(out.with_suffix(".log")) and os.path.exists(out.with_suffix(".json"))
    log = out.with_suffix(".log").read_text()
    assert "load average at start" in log and "load average at end" in log
    assert "ceiling at the start" in log and "ceiling at the end" in log


def test_statuses(quick):
    _, df, _ = quick
    status = lambda p: set(df[df["provider"] == p]["status"])  # noqa: E731
    assert status("longflash") == status("sdpa_cpu") == {"ok"}
    assert status("sdpa_efficient") == status("flex") == {"unsupported"}  # not on a CPU
    std = df[df["provider"] == "standard"]
    over = std["seqlen_q"] == max(speedup.QUICK["long_seqlens"])
    assert set(std[~over]["status"]) == {"ok"}
    # Over the budget: an oom row for every metric and mode, with no value, not a crash.
    assert set(std[over]["status"]) == {"oom"}
    assert std[over]["value"].isna().all()
    assert set(std[over]["mode"]) == set(speedup.Config(**speedup.QUICK).long_modes)


def test_values_are_consistent(quick):
    _, df, _ = quick
    ok = df[df["status"] == "ok"]
    ceiling = ok[ok["provider"] == "ceiling"].set_index("metric")["value"]
    assert ceiling["matmul_tflops"] > 0 and ceiling["copy_gbps"] > 0
    key = ["part", "provider", "mode", "batch", "seqlen_q", "nheads", "headdim", "causal"]
    wide = ok[ok["part"].isin(["batch", "long"])].pivot_table(index=key, columns="metric",
                                                      values="value", aggfunc="first")
    wide = wide.reset_index()
    assert len(wide) and wide[list(METRICS)].notna().all().all()
    for _, r in wide.iterrows():
        fl = flops(r["batch"], r["seqlen_q"], r["seqlen_q"], r["nheads"], r["headdim"],
                   bool(r["causal"]), r["mode"])
        assert math.isclose(r["tflops"], tflops(fl, r["time_ms"]), rel_tol=1e-9)
        assert r["time_ms"] > 0 and r["peak_mem_mb"] >= 0
    times = ok[ok["metric"] == "time_ms"]
    assert ((times["p20"] <= times["value"]) & (times["value"] <= times["p80"])).all()
    rates = ok[ok["metric"].isin(["tflops", "read_gbps"])]
    assert ((rates["p20"] <= rates["value"]) & (rates["value"] <= rates["p80"])).all()


def test_decode_part(quick):
    """Part decode: every provider of the CPU at every batch and cache length, LongFlash with
    the library's split choice, with one split, and over a float8 cache; bandwidth from the
    cache's bytes and the time; LongFlash's output against float64 (over the float8 cache's
    entries times its scales), and the float8 cache's against the unquantized cache."""
    _, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    dec = df[df["part"] == "decode"]
    assert set(dec["status"]) == {"ok"} and (dec["seqlen_q"] == 1).all()
    assert set(dec["provider"]) == {"longflash", "sdpa_cpu"}  # GPU-only providers: none
    assert (dec["nheads"] == cfg.decode_nheads).all()
    assert (dec["nheads_kv"] == cfg.decode_nheads_kv).all()
    assert set(dec[dec["provider"] == "longflash"]["num_splits"]) == {0, 1}
    assert dec[dec["provider"] == "sdpa_cpu"]["num_splits"].isna().all()
    assert set(dec["kv_dtype"].dropna()) == {"float8_e4m3fn"}
    assert set(dec[dec["kv_dtype"].notna()]["num_splits"]) == {0}
    dec = dec.assign(num_splits=dec["num_splits"].fillna(-1), kv_dtype=dec["kv_dtype"].fillna(""))
    index = ["provider", "num_splits", "kv_dtype", "batch", "seqlen_k"]
    assert dec.groupby(index).ngroups == 4 * len(cfg.decode_batches) * len(cfg.decode_seqlens)
    wide = dec.pivot_table(index=index, columns="metric", values="value").reset_index()
    cache_bytes = (2 * wide["batch"] * wide["seqlen_k"] * cfg.decode_nheads_kv
                   * cfg.decode_headdim * wide["kv_dtype"].map({"": 4, "float8_e4m3fn": 1}))
    assert ((cache_bytes / (wide["time_ms"] * 1e-3) / 1e9 - wide["read_gbps"]).abs()
            <= 1e-9 * wide["read_gbps"]).all()
    errors = wide[wide["provider"] == "longflash"]["max_err_o_sampled"]
    assert len(errors) == 3 * len(cfg.decode_batches) * len(cfg.decode_seqlens)
    assert (errors < 1e-5).all()
    # the quantization's own error: well above the kernel's, within float8_e4m3fn's spacing
    fp8 = wide[wide["kv_dtype"] != ""]
    assert fp8["quant_err_o_sampled"].notna().all()
    assert (fp8["quant_err_o_sampled"] > 10 * fp8["max_err_o_sampled"]).all()
    assert (fp8["quant_err_o_sampled"] < 0.1).all()
    assert "time_ms per decoding step" in stdout


def test_prefill_part(quick):
    """Part prefill: at every key count and chunk, LongFlash over pages in the run's dtype and
    in float8 read in place, and over float8 pages gathered first; TFLOP/s from the causal
    chunk's FLOPs and the time; the output against float64 over the keys the pages stand for."""
    from experiments import prefill
    _, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    pre = df[df["part"] == "prefill"].assign(kv_dtype=lambda d: d["kv_dtype"].fillna(""))
    assert set(pre["status"]) == {"ok"} and set(pre["provider"]) == {"longflash"}
    assert pre["causal"].all() and (pre["batch"] == cfg.prefill_batch).all()
    assert (pre["nheads"] == cfg.prefill_nheads).all()
    assert (pre["nheads_kv"] == cfg.prefill_nheads_kv).all()
    index = ["kv_dtype", "route", "seqlen_k", "seqlen_q"]
    wide = pre.pivot_table(index=index, columns="metric", values="value").reset_index()
    assert set(zip(wide["kv_dtype"], wide["route"])) == set(prefill.ROUTES)
    assert len(wide) == len(prefill.ROUTES) * len(cfg.prefill_seqlens) * len(cfg.prefill_chunks)
    for _, r in wide.iterrows():
        fl = flops(cfg.prefill_batch, r["seqlen_q"], r["seqlen_k"], cfg.prefill_nheads,
                   cfg.prefill_headdim, True, "fwd")
        assert math.isclose(r["tflops"], tflops(fl, r["time_ms"]), rel_tol=1e-9)
    assert (wide["max_err_o_sampled"] < 1e-5).all()  # float32 queries, float64 reference
    assert "time_ms per prefill chunk" in stdout


def test_prefill_resume_after_measures_older_rows_again(quick):
    from experiments import prefill
    out, _, _ = quick
    cfg = speedup.Config(**speedup.QUICK)
    keys = prefill.existing_keys(out)
    assert len(keys) == len(prefill.ROUTES) * len(cfg.prefill_seqlens) * len(cfg.prefill_chunks)
    assert prefill.existing_keys(out, "2000-01-01T00:00:00") == keys
    assert prefill.existing_keys(out, "2999-01-01T00:00:00") == set()


def test_shared_prefix_part(quick):
    """Part shared_prefix: at every batch and prefix length, LongFlash's cascade call and the
    step over duplicated caches (LongFlash's and SDPA's); bandwidth from the bytes each route
    reads (the prefix once, or once per sequence) and the time; LongFlash's output against
    float64 over the prefix and the sequence's own tokens."""
    from experiments import shared_prefix
    out, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    sp = df[df["part"] == "shared_prefix"]
    assert set(sp["status"]) == {"ok"} and (sp["seqlen_q"] == 1).all()
    assert (sp["seqlen_k"] == sp["prefix_len"] + cfg.shared_suffix_len).all()
    assert (sp["nheads"] == cfg.decode_nheads).all()
    assert (sp["nheads_kv"] == cfg.decode_nheads_kv).all()
    index = ["provider", "route", "batch", "prefix_len"]
    wide = sp.pivot_table(index=index, columns="metric", values="value").reset_index()
    calls = {("longflash", "cascade"), ("longflash", "duplicated"), ("sdpa_cpu", "duplicated")}
    assert set(zip(wide["provider"], wide["route"])) == calls
    assert len(wide) == len(calls) * len(cfg.shared_batches) * len(cfg.shared_prefixes)
    tokens = wide["prefix_len"] + wide["batch"] * cfg.shared_suffix_len
    tokens = tokens.where(wide["route"] == "cascade",
                          wide["batch"] * (wide["prefix_len"] + cfg.shared_suffix_len))
    read = 2 * tokens * cfg.decode_nheads_kv * cfg.decode_headdim * 4  # float32
    assert ((read / (wide["time_ms"] * 1e-3) / 1e9 - wide["read_gbps"]).abs()
            <= 1e-9 * wide["read_gbps"]).all()
    errors = wide[wide["provider"] == "longflash"]["max_err_o_sampled"]
    assert len(errors) == 2 * len(cfg.shared_batches) * len(cfg.shared_prefixes)
    assert (errors < 1e-5).all()
    assert "time_ms per decoding step over a shared prefix" in stdout
    keys = shared_prefix.existing_keys(out)
    assert len(keys) == len(wide)
    assert shared_prefix.existing_keys(out, "2999-01-01T00:00:00") == set()


def test_mla_part(quick):
    """Part mla: at every batch and cache length, LongFlash's absorbed call (qv) and the
    concatenated form (LongFlash's and SDPA's); bandwidth from the cache bytes each route reads
    (the latents once, or twice) and the time; LongFlash's output against float64."""
    from experiments import mla_decode
    out, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    mla = df[df["part"] == "mla"]
    assert set(mla["status"]) == {"ok"} and (mla["seqlen_q"] == 1).all()
    assert (mla["nheads"] == cfg.mla_nheads).all() and (mla["nheads_kv"] == 1).all()
    assert (mla["headdim"] == cfg.mla_rope_dim).all()
    index = ["provider", "route", "batch", "seqlen_k"]
    wide = mla.pivot_table(index=index, columns="metric", values="value").reset_index()
    calls = {("longflash", "absorbed"), ("longflash", "concatenated"),
             ("sdpa_cpu", "concatenated"), ("sdpa_cpu", "heads_as_rows")}
    assert set(zip(wide["provider"], wide["route"])) == calls
    assert len(wide) == len(calls) * len(cfg.mla_batches) * len(cfg.mla_seqlens)
    dims = (cfg.mla_rope_dim + cfg.mla_latent_dim
            + cfg.mla_latent_dim * (wide["route"] != "absorbed"))
    read = wide["batch"] * wide["seqlen_k"] * dims * 4  # float32
    assert ((read / (wide["time_ms"] * 1e-3) / 1e9 - wide["read_gbps"]).abs()
            <= 1e-9 * wide["read_gbps"]).all()
    errors = wide[wide["provider"] == "longflash"]["max_err_o_sampled"]
    assert len(errors) == 2 * len(cfg.mla_batches) * len(cfg.mla_seqlens)
    assert (errors < 1e-5).all()
    assert "time_ms per MLA decoding step" in stdout
    keys = mla_decode.existing_keys(out)
    assert len(keys) == len(wide)
    assert mla_decode.existing_keys(out, "2999-01-01T00:00:00") == set()


def test_sparse_part(quick):
    """Part sparse: every CPU provider and mode at every density (density 1: no mask), the
    fraction of blocks kept beside each row (density plus the diagonal), the rate over the
    kept blocks' FLOPs only."""
    from experiments import block_sparse
    out, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    sp = df[df["part"] == "sparse"]
    assert set(sp["status"]) == {"ok"} and (sp["causal"] == False).all()  # noqa: E712
    assert set(sp["provider"]) == set(block_sparse.CPU_PROVIDERS)
    wide = sp.pivot_table(index=["provider", "mode", "seqlen_q", "density", "blocks_kept"],
                          columns="metric", values="value").reset_index()
    assert len(wide) == (len(block_sparse.CPU_PROVIDERS) * len(block_sparse.MODES)
                         * len(cfg.sparse_seqlens) * len(cfg.sparse_densities))
    assert set(wide.columns) >= METRICS
    dense = wide["density"] == 1
    assert (wide[dense]["blocks_kept"] == 1).all()
    assert ((wide[~dense]["blocks_kept"] >= wide[~dense]["density"] - 0.35)
            & (wide[~dense]["blocks_kept"] < 1)).all()
    fl = wide.apply(lambda r: flops(1, r["seqlen_q"], r["seqlen_q"], cfg.sparse_nheads,
                                    cfg.sparse_headdim, False, r["mode"]), axis=1)
    expect = tflops(fl, wide["time_ms"]) * wide["blocks_kept"]
    assert ((wide["tflops"] - expect).abs() <= 1e-9 * expect).all()
    assert "time_ms of block-sparse attention" in stdout
    assert len(block_sparse.existing_keys(out)) == len(wide)


def test_sparse_decode_part(quick):
    """Part sparse_decode: every CPU route at every density and kind of mask (density 1: no
    mask, once), the blocks kept beside each row, the bandwidth over the kept blocks' bytes,
    LongFlash's output against float64 in both routes."""
    from experiments import sparse_decode
    out, df, stdout = quick
    cfg = speedup.Config(**speedup.QUICK)
    sd = df[df["part"] == "sparse_decode"]
    assert set(sd["status"]) == {"ok"} and (sd["seqlen_q"] == 1).all()
    assert (sd["nheads"] == cfg.decode_nheads).all()
    assert (sd["nheads_kv"] == cfg.decode_nheads_kv).all()
    index = ["provider", "route", "batch", "seqlen_k", "density", "mask_heads", "blocks_kept"]
    wide = sd.pivot_table(index=index, columns="metric", values="value").reset_index()
    calls = {("longflash", "block_mask"), ("longflash", "attn_mask"), ("sdpa_cpu", "attn_mask")}
    assert set(zip(wide["provider"], wide["route"])) == calls
    masks = sum(len(sparse_decode.MASK_HEADS) if x < 1 else 1
                for x in cfg.sparse_decode_densities)
    assert len(wide) == (len(calls) * masks * len(cfg.sparse_decode_batches)
                         * len(cfg.sparse_decode_seqlens))
    dense = wide["density"] == 1
    assert (wide[dense]["blocks_kept"] == 1).all() and set(wide[dense]["mask_heads"]) == {"shared"}
    assert ((wide[~dense]["blocks_kept"] > 0) & (wide[~dense]["blocks_kept"] < 1)).all()
    read = (2 * wide["batch"] * wide["seqlen_k"] * cfg.decode_nheads_kv * cfg.decode_headdim * 4
            * wide["blocks_kept"])  # float32
    assert ((read / (wide["time_ms"] * 1e-3) / 1e9 - wide["read_gbps"]).abs()
            <= 1e-9 * wide["read_gbps"]).all()
    errors = wide[wide["provider"] == "longflash"]["max_err_o_sampled"]
    assert len(errors) == 2 * masks and (errors < 1e-5).all()
    assert "time_ms per block-sparse decoding step" in stdout
    assert len(sparse_decode.existing_keys(out)) == len(wide)


def test_sparse_decode_masks():
    """The part's masks: per KV head (repeated over each group of query heads) or shared by
    every head, the first and last blocks always kept; FlexAttention's BlockMask of them is
    the same mask (eager flex_attention with GQA on a CPU, against the reference)."""
    import torch
    from experiments import sparse_decode
    from longflash import attention_ref
    kv = sparse_decode.block_mask(2, 8, 2, 1000, 0.3, "kv", seed=1, device="cpu")
    assert kv.shape == (2, 8, 1, 8) and kv[..., 0].all() and kv[..., -1].all()
    assert torch.equal(kv, kv[:, ::4].repeat_interleave(4, dim=1))
    assert not torch.equal(kv[:, 0], kv[:, 4])  # two KV heads, two choices (seed 1)
    shared = sparse_decode.block_mask(2, 8, 2, 1000, 0.3, "shared", seed=1, device="cpu")
    assert shared.shape == (2, 8, 1, 8) and torch.equal(shared, shared[:, :1].expand_as(shared))
    assert sparse_decode.block_mask(2, 8, 2, 1000, 1.0, "kv", seed=1, device="cpu") is None
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from experiments import block_sparse
    q = torch.randn(2, 8, 1, 16, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 1000, 16, dtype=torch.float64) for _ in range(2))
    o = flex.flex_attention(q, k, v, block_mask=block_sparse.flex_block_mask(kv, 1, 1000),
                            enable_gqa=True)
    ref = attention_ref(*(x.transpose(1, 2) for x in (q, k, v)),
                        attn_mask=block_sparse.elementwise(kv, 1, 1000))[0].transpose(1, 2)
    torch.testing.assert_close(o, ref)


def test_block_sparse_masks():
    """The part's masks: the diagonal always kept; FlexAttention's BlockMask of them is the
    same boolean mask (eager flex_attention on a CPU, forward, against the reference)."""
    import torch
    from experiments import block_sparse
    from longflash import attention_ref
    mask = block_sparse.block_mask(384, 0.3, seed=1, device="cpu")
    assert mask.shape == (1, 1, 3, 3) and mask.diagonal(dim1=-2, dim2=-1).all()
    assert block_sparse.block_mask(384, 1.0, seed=1, device="cpu") is None
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    blocks = block_sparse.flex_block_mask(mask, 384)
    q, k, v = (torch.randn(1, 2, 384, 16, dtype=torch.float64) for _ in range(3))
    o = flex.flex_attention(q, k, v, block_mask=blocks)
    ref = attention_ref(*(x.transpose(1, 2) for x in (q, k, v)),
                        block_mask=mask)[0].transpose(1, 2)
    torch.testing.assert_close(o, ref)


def test_resume_measures_nothing_twice(quick, tmp_path):
    out, df, _ = quick
    copy = tmp_path / "cpu.csv"
    df.to_csv(copy, index=False)
    proc = run_quick(copy, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stdout.splitlines()
                if line.startswith(("[", "decode ", "prefill ", "mla "))]
    again = pd.read_csv(copy)
    assert len(again) == len(df)
    runs = lambda d: d[d["provider"] != "ceiling"].sort_values(  # noqa: E731
        KEY_COLUMNS + ["num_splits", "kv_dtype", "route"])
    assert runs(again)["timestamp"].tolist() == runs(df)["timestamp"].tolist()


def test_decode_resume_after_measures_older_rows_again(quick):
    """Part decode's --resume-after: rows measured before the time count as never measured
    (every provider measured again in one run), rows after it as measured."""
    from experiments import decode
    out, df, _ = quick
    keys = decode.existing_keys(out)
    assert len(keys) == 4 * len(speedup.Config(**speedup.QUICK).decode_batches) * len(
        speedup.Config(**speedup.QUICK).decode_seqlens)
    assert decode.existing_keys(out, "2000-01-01T00:00:00") == keys
    assert decode.existing_keys(out, "2999-01-01T00:00:00") == set()


def resume_with_one_row_changed(quick, tmp_path, change, *args):
    """The quick run's rows with `change`(df, index) applied to its first LongFlash forward
    time_ms row of part batch, then --resume (and args) over them: (rows after, that row
    after). Every measurement the resumed run makes is LongFlash's (that row's group)."""
    out, df, _ = quick
    copy = tmp_path / "cpu.csv"
    changed = df.copy()
    hit = (changed["provider"] == "longflash") & (changed["metric"] == "time_ms") & \
        (changed["mode"] == "fwd") & (changed["part"] == "batch")
    first = changed[hit].index[0]
    change(changed, first)
    changed.to_csv(copy, index=False)
    proc = run_quick(copy, "--resume", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = pd.read_csv(copy)
    key = changed.loc[first, KEY_COLUMNS]
    row = again[(again[KEY_COLUMNS].astype(str) == key.astype(str)).all(axis=1)]
    assert len(row) == 1, row
    measured = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert measured and all("longflash" in ln for ln in measured), measured
    assert len(again) == len(df)
    return again, row


def test_resume_measures_error_rows_again(quick, tmp_path):
    """A row with status error (a harness or kernel failure, maybe fixed since) is measured
    again on --resume; the others are kept."""
    def fail(df, i):
        df.loc[i, ["status", "value"]] = ["error", float("nan")]
    _, row = resume_with_one_row_changed(quick, tmp_path, fail)
    assert row["status"].item() == "ok", row


@pytest.mark.parametrize("args, message", [
    (["--resume-after", "2021-01-01"], "--resume-after needs --resume"),
    (["--resume", "--resume-after", "yesterday"], "--resume-after: not an ISO time")])
def test_resume_after_rejects_bad_input_before_any_work(tmp_path, args, message):
    out = tmp_path / "cpu.csv"
    proc = run_quick(out, *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def test_resume_after_measures_older_rows_again(quick, tmp_path):
    """--resume-after TIME: a row measured before TIME (a kernel changed since) is measured
    again and replaced; the rows measured after it are kept."""
    def age(df, i):
        df.loc[i, "timestamp"] = "2020-01-01T00:00:00+00:00"
    _, row = resume_with_one_row_changed(quick, tmp_path, age, "--resume-after",
                                         "2021-01-01T00:00:00")
    assert row["timestamp"].item() > "2021", row


def test_resume_measures_rows_of_other_kernel_switches_again(quick, tmp_path):
    """A row whose command names kernel switches this run does not have (LONGFLASH_WS=fwd:
    other candidates timed) is measured again on --resume, its command then without them."""
    def switch(df, i):
        df.loc[i, "command"] = "LONGFLASH_WS=fwd " + df.loc[i, "command"]
    _, row = resume_with_one_row_changed(quick, tmp_path, switch)
    assert not row["command"].item().startswith("LONGFLASH"), row


@pytest.mark.parametrize("message, provider, status", [
    ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes", "standard",
     "oom"),
    ("No viable backend for scaled_dot_product_attention was found.", "sdpa_cudnn",
     "unsupported"),
    ("No available kernel. Aborting execution.", "sdpa_flash", "unsupported"),
    ("out of resource: shared memory, Required: 262144, Hardware limit: 232448", "flex",
     "unsupported"),
    ("out of resource: shared memory", "longflash", "error"),  # our own kernel: a bug
    ("shape mismatch", "sdpa_math", "error"),
])
def test_status_of_a_failure(message, provider, status):
    assert speedup._status(RuntimeError(message), provider) == status


def test_groups_run_in_the_stated_order():
    cfg = speedup.Config(**speedup.FULL)
    plan = speedup.groups(cfg)
    assert plan[0][:3] == ("batch", 512, 128)
    first_long = next(i for i, g in enumerate(plan) if g[0] == "long")
    assert all(g[2] == 128 for g in plan[:first_long + len(cfg.long_seqlens)])
    assert len(plan) == (len(cfg.seqlens) * len(cfg.headdims) * len(cfg.causals)
                         + len(cfg.long_seqlens) * len(cfg.long_headdims))


def test_a_provider_that_fails_to_build_is_rows_and_the_run_goes_on(tmp_path, monkeypatch):
    """Building a provider (make_attention: FlexAttention's block mask, for example) can fail
    with any exception, not only Unsupported: every mode and metric of it is then a row with
    the status of the failure (oom / error / unsupported), and the providers after it in the
    same group are measured. In process, with make_attention mocked."""
    import torch

    original = speedup.make_attention
    built = []

    def make_attention(provider, device, causal, seqlen):
        built.append(provider)
        if provider == "standard":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        if provider == "sdpa_cpu":
            raise RuntimeError("something else broke")
        return original(provider, device, causal, seqlen)

    monkeypatch.setattr(speedup, "make_attention", make_attention)
    monkeypatch.setattr(speedup.log, "path", None)
    cfg = speedup.Config(**dict(speedup.QUICK, providers=("standard", "sdpa_cpu", "longflash"),
                                seqlens=(128,), causals=(False,), long_seqlens=(),
                                parts=("batch",), threads=0, ceiling_rep_ms=0))
    out = tmp_path / "cpu.csv"
    speedup.run(cfg, "cpu", str(out))
    df = pd.read_csv(out)
    runs = df[df["part"] == "batch"]
    for provider, status in (("standard", "oom"), ("sdpa_cpu", "error"), ("longflash", "ok")):
        rows = runs[runs["provider"] == provider]
        assert set(rows["mode"]) == set(cfg.modes), provider
        assert set(rows["metric"]) == METRICS and len(rows) == len(cfg.modes) * len(METRICS)
        assert set(rows["status"]) == {status}, provider
        assert rows["value"].isna().all() == (status != "ok")
    assert built == ["standard", "sdpa_cpu", "longflash"]  # built once per group each
    # --resume builds only the provider whose rows are errors (measured again); oom and ok
    # rows stay
    built.clear()
    speedup.run(cfg, "cpu", str(out), resume=True)
    assert built == ["sdpa_cpu"]


def test_resume_measures_what_was_never_measured_before_the_errors(tmp_path, monkeypatch):
    """--resume: the groups holding a configuration with no row at all come first, the groups
    whose only gaps are error rows after them (a budget that runs out leaves the retries, not
    new results). In process, the measurements mocked."""
    monkeypatch.setattr(speedup.log, "path", None)
    cfg = speedup.Config(**dict(speedup.QUICK, providers=("sdpa_cpu", "longflash"),
                                seqlens=(128, 256), causals=(False, True), long_seqlens=(),
                                parts=("batch",), modes=("fwd",), threads=0,
                                ceiling_rep_ms=0))
    measured = []

    def fake_measure(attn, inputs, mode, device, cfg, long_part, provider, fits=False):
        measured.append((provider, inputs[0].shape[1]))  # (B, N, H, D) or (B, H, N, D)
        return "ok", 1.0, (1.0, 1.0, 1.0), ""

    monkeypatch.setattr(speedup, "measure", fake_measure)
    out = tmp_path / "cpu.csv"
    speedup.run(cfg, "cpu", str(out))
    plan = [g for g in speedup.groups(cfg) if g[0] == "batch"]
    assert len(plan) == 4 and len(measured) == 8
    df = pd.read_csv(out)
    runs = (df["provider"] == "longflash") & (df["part"] == "batch")
    first, last = plan[0], plan[-1]  # (part, seqlen, headdim, causal)
    at = lambda g: runs & (df["seqlen_q"] == g[1]) & (df["causal"] == g[3])  # noqa: E731
    df.loc[at(first), ["status", "value"]] = ["error", float("nan")]  # a retry
    df = df[~at(last)]                                                 # never measured
    df.to_csv(out, index=False)
    measured.clear()
    speedup.run(cfg, "cpu", str(out), resume=True)
    # the last group (never measured) first, then the first one (its error measured again)
    assert measured == [("longflash", last[1]), ("longflash", first[1])]
    assert first[1] != last[1]


def test_causal_block_mask_is_compiled_above_the_eager_limit(monkeypatch):
    """Above EAGER_BLOCK_MASK_MAX mask elements the block mask is built by a compiled
    create_block_mask (eager would materialize seqlen x seqlen booleans), and it is the same
    BlockMask as the eager one."""
    import torch
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import create_block_mask

    compiled = []

    def fake_compile(fn, **kwargs):
        compiled.append(fn)
        return fn  # the eager function: the same result, without a compilation in the test

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(speedup, "_FLEX", {})
    eager = speedup.causal_block_mask(256, "cpu")
    assert not compiled
    monkeypatch.setattr(speedup, "EAGER_BLOCK_MASK_MAX", 256 * 256 - 1)
    big = speedup.causal_block_mask(256, "cpu")
    assert compiled == [create_block_mask]
    for a, b in zip(eager.as_tuple(), big.as_tuple()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_resume_of_decode_rows_skips_all_but_errors(tmp_path):
    from experiments import decode
    rows = pd.DataFrame([dict(part="decode", metric="time_ms", provider=p, num_splits=0,
                              dtype="bfloat16", batch=1, seqlen_k=1024, status=s)
                         for p, s in (("longflash", "ok"), ("flex", "error"),
                                      ("sdpa_math", "oom"))])
    path = tmp_path / "h100.csv"
    rows.to_csv(path, index=False)
    assert {k[0] for k in decode.existing_keys(str(path))} == {"longflash", "sdpa_math"}


def with_ceilings(df, matmul, copy_gbps):
    """df with its one matmul and one copy ceiling row set to the given values."""
    df = df.copy()
    for metric, value in (("matmul_tflops", matmul), ("copy_gbps", copy_gbps)):
        hit = (df["provider"] == "ceiling") & (df["metric"] == metric)
        assert hit.sum() == 1
        df.loc[hit, "value"] = value
    return df


def ceilings_of(path):
    df = pd.read_csv(path)
    return df[df["provider"] == "ceiling"].set_index("metric")["value"]


def test_resume_keeps_the_best_ceiling_of_the_file(quick, tmp_path):
    """--resume that measures a row of part batch: the file's rows come from several runs and
    one ceiling row serves them all, the best any run measured; a run that measures more keeps
    its own."""
    def fail(df, i):
        df.loc[i, "status"] = "error"
        df.loc[i, "value"] = math.nan
    _, df, _ = quick
    quick = (quick[0], with_ceilings(df, 1e9, 1e-9), quick[2])  # one far above, one far below
    again, _ = resume_with_one_row_changed(quick, tmp_path, fail)
    ceil = ceilings_of(tmp_path / "cpu.csv")
    assert ceil["matmul_tflops"] == 1e9 and 1e-9 < ceil["copy_gbps"] < 1e9, ceil


def test_resume_that_measures_no_ceiling_relative_row_keeps_the_files_ceilings(quick, tmp_path):
    """--resume that measures only rows reported against no ceiling (here: a prefill row, the
    part added after the others were measured) leaves the file's ceiling rows as they were,
    values and provenance: they belong to the runs that measured the other rows."""
    out, df, _ = quick
    old = with_ceilings(df, 1e-9, 1e-9)  # far below this machine's: a best-of rule would replace
    prefill = old[(old["part"] == "prefill") & (old["metric"] == "time_ms")].index[0]
    old.loc[prefill, ["status", "value"]] = ["error", math.nan]
    copy = tmp_path / "cpu.csv"
    old.to_csv(copy, index=False)
    proc = run_quick(copy, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("prefill ")]
    assert not [ln for ln in proc.stdout.splitlines() if ln.startswith(("[", "decode "))]
    again = pd.read_csv(copy)
    before = old[old["provider"] == "ceiling"].sort_values("metric").reset_index(drop=True)
    after = again[again["provider"] == "ceiling"].sort_values("metric").reset_index(drop=True)
    pd.testing.assert_frame_equal(after, before, check_dtype=False)
    assert "ceilings of" in proc.stdout and "kept" in proc.stdout
