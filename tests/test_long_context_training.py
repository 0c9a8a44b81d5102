"""RQ4's experiment: the --quick pipeline end to end, the max-context search, resumable
training, the file-level split of the stdlib data, MQAR batches and the memory projection.
No timing is asserted."""

import math
import os

import pandas as pd
import pytest
import torch

from experiments import byte_data
from experiments import long_context_training as lct
from experiments.results import COLUMNS, PROVENANCE_COLUMNS, STATUSES


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: extra threads only wait on each other. And the max-context probes fork
    (experiments.measure.peak_memory_mb): no OpenMP worker is busy in the parent then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def quick(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("lct") / "cpu.csv"
    lct.main(["--quick", "--out", str(out), "--run-dir", str(out.parent / "runs")])
    return out, pd.read_csv(out)


def test_quick_pipeline_writes_every_part(quick):
    out, df = quick
    assert set(COLUMNS + PROVENANCE_COLUMNS) <= set(df.columns)
    assert set(lct.KEY_COLUMNS) <= set(df.columns)
    assert set(df["experiment"]) == {"long_context_training"}
    assert set(df["status"]) <= set(STATUSES)
    assert set(df["part"]) == {"exactness", "max_context", "memory_model", "projection",
                               "quality", "mqar"}
    assert (df.loc[df["status"] == "ok", "value"].notna()).all()
    assert os.path.exists(out.with_suffix(".json")) and os.path.exists(out.with_suffix(".log"))
    # every probe is a row, plus one max_seqlen per provider
    mx = df[(df["part"] == "max_context") & (df["metric"] == "max_seqlen")]
    assert set(mx["provider"]) == {"standard", "sdpa_cpu", "longflash"}
    probes = df[(df["part"] == "max_context") & (df["metric"] == "peak_mem_mb")]
    assert {"ok", "oom"} <= set(probes[probes["provider"] == "standard"]["status"])
    # quality: val_bpb = val_loss / ln 2, for every context
    q = df[df["part"] == "quality"].pivot_table(index=["seqlen_q", "seed"], columns="metric",
                                                values="value")
    assert len(q) == 3 and (abs(q["val_bpb"] - q["val_loss"] / math.log(2)) < 1e-9).all()
    # projections are labelled as such
    proj = df[df["part"] == "projection"]
    assert len(proj) and set(proj["basis"]) == {"projected"}
    assert set(df[df["part"] != "projection"]["basis"]) == {"measured"}


def test_quick_max_context_standard_below_longflash(quick):
    _, df = quick
    mx = df[(df["part"] == "max_context") & (df["metric"] == "max_seqlen")]
    best = dict(zip(mx["provider"], mx["value"]))
    assert 0 < best["standard"] < best["longflash"], best
    # the found max is the longest ok probe, and the next probe up failed
    probes = df[(df["part"] == "max_context") & (df["metric"] == "peak_mem_mb")
                & (df["provider"] == "standard")]
    ok = probes[probes["status"] == "ok"]["seqlen_q"]
    assert ok.max() == best["standard"]
    assert (probes[probes["seqlen_q"] > best["standard"]]["status"] == "oom").all()


def test_quick_exactness_same_losses(quick):
    _, df = quick
    ex = df[(df["part"] == "exactness") & (df["metric"] == "train_loss")]
    curves = ex.pivot_table(index="step", columns="provider", values="value")
    assert len(curves) == lct.QUICK["exact_steps"]
    assert (abs(curves["longflash"] - curves["standard"]) < 1e-4).all()


@pytest.mark.parametrize("limit, start, cap, expect", [
    (3000, 512, 32768, (2816, False)),   # doubling to 4096 fails, bisection to 256
    (100, 512, 32768, (0, False)),       # the first probe fails
    (10**6, 512, 4096, (4096, True)),    # never fails: the cap, a lower bound
    (1024, 512, 32768, (1024, False)),   # exactly on a doubling
])
def test_search_finds_boundary(limit, start, cap, expect):
    best, capped, probes, stopped = lct.search_max_context(
        lambda n: ("ok", float(n)) if n <= limit else ("oom", math.nan), start, 256, cap)
    assert (best, capped, stopped) == (*expect, False)
    assert all((status == "ok") == (n <= limit) for n, status, _ in probes)


def _fits(limit):
    return lambda n: ("ok", float(n)) if n <= limit else ("oom", math.nan)


def test_search_fraction_stops_at_an_eighth_of_the_bracket():
    """--full: bisection to 1/8 of the doubling's bracket, 3 probes instead of 6."""
    limit = 100_000
    fine = lct.search_max_context(_fits(limit), 1024, 1024, 2**20)
    coarse = lct.search_max_context(_fits(limit), 1024, 1024, 2**20, fraction=1 / 8)
    doublings = 8  # 1K .. 128K
    assert len(fine.probes) == doublings + 6 and len(coarse.probes) == doublings + 3
    assert limit - 8192 < coarse.best <= limit and coarse.best % 1024 == 0
    assert not coarse.stopped and not coarse.capped
    # resolution still bounds it from below: a bracket of 1024 is not split
    assert lct.search_max_context(_fits(100), 1024, 1024, 2**20, fraction=1 / 8).best == 0


def test_search_stop_ends_it_with_a_lower_bound():
    asked = []

    def stop(n):
        asked.append(n)
        return len(asked) > 4  # four probes, then the budget is spent
    res = lct.search_max_context(_fits(3000), 256, 256, 32768, stop=stop)
    assert res.stopped and not res.capped and len(res.probes) == 4
    assert res.best == 2048 and all(s == "ok" for _, s, _ in res.probes)  # 256 .. 2048
    res = lct.search_max_context(_fits(3000), 256, 256, 32768, stop=lambda n: True)
    assert res == (0, False, [], True)


def test_max_context_budget_rows(monkeypatch):
    """A time budget: searches stop early and say so, the ones it leaves no time for are
    error rows "not measured"; every row goes to emit as it is measured."""
    now = [0.0]

    def probe_step(cfg, model, provider, n, budget):
        now[0] += n / 250  # a probe of n tokens takes n / 250 s
        return ("ok", float(n)) if n <= 3000 else ("oom", math.nan)
    monkeypatch.setattr(lct, "probe_step", probe_step)
    cfg = lct.Config(**lct.QUICK)
    emitted = []
    # standard: 256 tokens (1.02 s), then 512 is predicted at 4.1 s: past the 2 s, stop;
    # sdpa_cpu: 256 (the first probe of a search has no prediction), then nothing is left;
    # longflash: no time at all
    rows = lct.part_max_context(cfg, emitted.append, deadline=2.0, clock=lambda: now[0])
    assert [r for chunk in emitted for r in chunk] == rows and all(len(c) == 1 for c in emitted)
    best = {r["provider"]: r for r in rows if r["metric"] == "max_seqlen"}
    assert cfg.providers == ("standard", "sdpa_cpu", "longflash")
    for p in ("standard", "sdpa_cpu"):
        assert best[p]["status"] == "ok" and best[p]["value"] == 256
        assert best[p]["note"].startswith("lower bound: time budget")
    assert best["longflash"]["status"] == "error" and math.isnan(best["longflash"]["value"])
    assert best["longflash"]["note"] == "not measured: time budget"
    probes = [(r["provider"], r["seqlen_q"]) for r in rows if r["metric"] == "peak_mem_mb"]
    assert probes == [("standard", 256), ("sdpa_cpu", 256)]
    # without a deadline: the whole search, its note the bracket
    rows = lct.part_max_context(cfg, clock=lambda: now[0])
    best = {r["provider"]: r for r in rows if r["metric"] == "max_seqlen"}
    assert all(r["value"] == 2816 and r["note"] == "3072 did not fit" for r in best.values())


class Killed(BaseException):
    """The campaign's timeout killing the step, as far as the script can tell."""


def test_rows_are_written_as_measured(monkeypatch, tmp_path):
    """memory_model runs before max_context, and max_context writes every probe and every
    search as it ends: a run killed in its third search keeps all of that."""
    calls = []

    def probe_step(cfg, model, provider, n, budget):
        calls.append((provider, n))
        if provider == "longflash" and budget is not None and n > 512:
            raise Killed
        return ("ok", float(n)) if budget is None or n <= 1000 else ("oom", math.nan)
    monkeypatch.setattr(lct, "probe_step", probe_step)
    out = tmp_path / "cpu.csv"
    with pytest.raises(Killed):
        lct.main(["--quick", "--parts", "max_context,memory_model", "--out", str(out)])
    df = pd.read_csv(out)
    assert len(df[df["part"] == "memory_model"]) == sum(len(s) for _, s in lct.QUICK[
        "memory_seqlens"])
    mx = df[(df["part"] == "max_context") & (df["metric"] == "max_seqlen")]
    assert dict(zip(mx["provider"], mx["value"])) == {"standard": 768, "sdpa_cpu": 768}
    flash = df[(df["part"] == "max_context") & (df["provider"] == "longflash")]
    assert sorted(flash["seqlen_q"]) == [256, 512]  # its probes before the kill


def test_budget_zero_measures_no_max_context(tmp_path):
    out = tmp_path / "cpu.csv"
    lct.main(["--quick", "--parts", "max_context", "--budget-s", "0", "--out", str(out)])
    df = pd.read_csv(out)
    assert set(df["metric"]) == {"max_seqlen"} and set(df["status"]) == {"error"}
    assert set(df["note"]) == {"not measured: time budget"}


def _tiny_run(cfg, run_dir, resume=False, stop_after=None):
    model = lct.build("L1-d32-h2", "longflash", seed=0)
    opt = lct.make_optimizer(model, cfg.lr, cfg.weight_decay)
    data = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.uint8)
    return lct.train(cfg, "resume-test", model, opt,
                     lambda g: byte_data.sample_batch(data, 2, 32, g), 6, cfg.lr, run_dir,
                     resume, stop_after)


def test_resume_equals_uninterrupted(tmp_path):
    cfg = lct.Config(**{**lct.QUICK, "checkpoint_every": 3})
    whole = _tiny_run(cfg, str(tmp_path / "a"))
    first = _tiny_run(cfg, str(tmp_path / "b"), stop_after=3)  # "interrupted" after step 3
    assert len(first) == 3
    resumed = _tiny_run(cfg, str(tmp_path / "b"), resume=True)
    assert resumed == whole
    again = _tiny_run(cfg, str(tmp_path / "b"), resume=True)  # finished: nothing repeated
    assert again == whole


def test_stdlib_split_is_by_file_and_disjoint():
    files = byte_data.stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f or f"{os.sep}test{os.sep}" in f for f in files)
    train, val = byte_data.split_by_file(files, 0.05)
    assert not set(train) & set(val) and sorted(train + val) == files
    assert 0.01 < len(val) / len(files) < 0.15
    assert byte_data.split_by_file(files, 0.05) == (train, val)  # deterministic
    data = byte_data.load_bytes(val[:3])
    assert int((data == byte_data.SEPARATOR).sum()) == 3
    x, y = byte_data.eval_windows(data, 64, 256)
    assert x.shape == y.shape == (4, 64) and torch.equal(x.flatten()[1:], y.flatten()[:-1])


def test_mqar_batch_targets_are_the_queried_values():
    x, y = lct.mqar_batch(torch.Generator().manual_seed(0), 3, 128, 8)
    for b in range(3):
        pairs = dict(zip(x[b, 0:16:2].tolist(), x[b, 1:16:2].tolist()))
        assert len(pairs) == 8
        pos = (y[b] != -100).nonzero().flatten()
        assert len(pos) == 8 and (pos >= 16).all()
        for p in pos.tolist():
            assert y[b, p] == pairs[int(x[b, p])] == x[b, p + 1]


def test_projection_quadratic_term_and_order():
    s, h, a = 8192, 4096, 32
    assert lct.activation_bytes(s, h, a, "standard") - lct.activation_bytes(s, h, a, "longflash") \
        == pytest.approx(5 * a * s * s - 4 * a * s)
    best = {(att, ck): lct.projected_max_seqlen(att, ck) for att in ("standard", "longflash")
            for ck in (False, True)}
    assert best["standard", False] < best["longflash", False] < best["longflash", True]
    assert best["standard", False] < best["standard", True] < best["longflash", True]
