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
    best, capped, probes = lct.search_max_context(
        lambda n: ("ok", float(n)) if n <= limit else ("oom", math.nan), start, 256, cap)
    assert (best, capped) == expect
    assert all((status == "ok") == (n <= limit) for n, status, _ in probes)


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
