"""experiments/tuning.py: the GPU window's tuning sweep, run here under the Triton interpreter."""

import math
import time

import pandas as pd
import pytest
import torch

pytest.importorskip("triton", reason="the tuning sweep times the Triton kernels (Linux only)")
from experiments import tuning  # noqa: E402
from experiments.results import KEY_COLUMNS, read_results  # noqa: E402
from longflash import flash_triton as ft  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's sweep")


def _entries(configs):
    return [ft._entry(c) for c in configs]


def test_candidates_are_the_table_then_the_trials_without_ws_unless_asked():
    for (kernel, block_d), trials in tuning.TRIALS.items():
        table = ft.CONFIGS[kernel, 9, block_d]  # a trial extends a bucket the launcher has
        assert not set(trials) & set(table), (kernel, block_d)  # a trial is new
        got = _entries(tuning.candidates(kernel, 9, block_d))
        plain = [c for c in table if ft.WS not in c]
        assert got == plain + trials, (kernel, block_d)
        assert _entries(tuning.candidates(kernel, 9, block_d, ws=True)) == \
            plain + trials + [c for c in table if ft.WS in c]
        assert _entries(tuning.candidates(kernel, 8, block_d)) == ft.CONFIGS[kernel, 8, block_d]
        for block_m, block_n, warps, _, *flags in trials:  # what test_codegen asks of the table
            assert {"fwd": block_m, "dq": block_m, "dkdv": block_n}[kernel] >= 64
            assert warps in (4, 8) and flags[0] == ft.TMA
            assert set(flags[1:]) <= {ft.SPLIT, ft.ATOMIC, ft.PIPE}
            assert len(set(flags)) == len(flags)
            # two passes, dQ by atomics: dK/dV's alone; a pipelined key loop: the forward's
            assert set(flags[1:]) <= {"dkdv": {ft.SPLIT, ft.ATOMIC}, "fwd": {ft.PIPE}}.get(
                kernel, set())


def test_every_target_sweeps_a_kernel_the_table_has():
    for t in tuning.TARGETS + tuning.QUICK_TARGETS:
        assert bool(t.kernels) != t.decode and set(t.kernels) <= set(tuning.KERNELS), t
        for kernel in t.kernels:
            assert tuning.candidates(kernel, 9, t.headdim)
    # On a GPU one compile serves a candidate's check and its timing: Triton specializes the
    # integer arguments on divisibility by 16 (the check has the target's heads)
    assert all(t.seqlen % 16 == 0 for t in tuning.TARGETS)
    assert all(n % 16 == 0 for n in tuning.CHECK_SEQLENS)


def test_ws_candidates_are_checked_where_they_run_without_masks():
    ws, tma = (tuning.candidates("fwd", 9, 128, ws=True)[i] for i in (-1, 1))
    assert ws.kwargs["WARP_SPECIALIZE"] and not tma.kwargs["WARP_SPECIALIZE"]
    full = next(t for t in tuning.TARGETS if t.headdim == 128 and not t.causal and t.kernels)
    causal = next(t for t in tuning.TARGETS if t.headdim == 128 and t.causal)
    check = tuning.check_seqlens_for(ws, full, tuning.CHECK_SEQLENS)
    assert check == (640, 1152) and all(n % 128 == 0 for n in check)
    assert tuning.check_seqlens_for(tma, full, tuning.CHECK_SEQLENS) == tuning.CHECK_SEQLENS
    assert tuning.check_seqlens_for(ws, causal, tuning.CHECK_SEQLENS) == tuning.CHECK_SEQLENS
    args = dict(WARP_SPECIALIZE=True, window_left=-1, window_right=-1, IS_VARLEN=False,
                BLOCK_M=128, BLOCK_N=128)  # what the launcher then compiles: no mask
    assert ft._full_tiles(dict(args, seqlen_q=check[0], seqlen_k=check[1]))
    assert ft._full_tiles(dict(args, seqlen_q=full.seqlen, seqlen_k=full.seqlen))


def test_quick_sweep_checks_and_times_every_candidate(tmp_path):
    out = tmp_path / "tuning.csv"
    tuning.main(["--quick", "--out", str(out)])
    df = read_results(str(out))
    assert not df.duplicated(KEY_COLUMNS + list(tuning.KEY_COLUMNS)).any()
    assert set(df["experiment"]) == {"tuning"} and set(df["status"]) == {"ok"}
    t = tuning.QUICK_TARGETS[0]
    calls = df[(df["kernel"] == "call") & (df["seqlen_q"] == t.seqlen)]
    assert set(zip(calls["mode"], calls["metric"])) == {
        (m, x) for m in ("fwd", "bwd") for x in ("time_ms", "host_ms")}  # no graph on a CPU
    again = calls[calls["config"] == tuning.CALL_AGAIN]  # timed again after the lead tiles
    assert sorted(again["mode"]) == ["bwd", "fwd"] and set(again["metric"]) == {"time_ms"}
    step = df[df["seqlen_q"] == 1]  # the decoding target: one query over the cache
    d = tuning.QUICK_TARGETS[1]
    assert d.decode and set(step["seqlen_k"]) == {d.seqlen} and set(step["nheads_kv"]) == {2}
    assert sorted(step["metric"]) == ["host_ms", "time_ms"] and set(step["kernel"]) == {"call"}
    for kernel in t.kernels:
        rows = df[df["kernel"] == kernel]
        names = [tuning.config_name(c) for c in tuning.candidates(kernel, 9, t.headdim)]
        for metric in ("max_rel_err", "time_ms"):
            assert sorted(rows.loc[rows["metric"] == metric, "config"]) == sorted(names), metric
        err = rows.loc[rows["metric"] == "max_rel_err", "value"]
        assert (err < 1e-2).all() and (err > 0).all()  # fp16 against float64: small, not zero
        assert set(rows["mode"]) == {"fwd" if kernel == "fwd" else "bwd"}
    log = (out.parent / "tuning.log").read_text()
    for kernel in t.kernels:  # a summary line per kernel: the interpreter's one tile is none
        assert f"  {kernel}: fastest " in log and "not timed here" in log  # of the candidates
    assert (out.parent / "tuning.json").exists() and log.count("host profile, ") == 3
    # every target's calls (host or GPU?) before any candidate
    assert log.index("target 1, calls") < log.index("target 0, candidates")
    assert log.index("target 0, lead") < log.index("call fwd again") < log.index(
        "target 0, candidates")
    assert log.count("ncalls") == 3  # cProfile's tables


def test_a_wrong_candidate_is_an_error_row_and_is_not_timed(monkeypatch):
    """A planted broken tile (its check returns an error of order 1, or NaN): status error,
    no time; the right ones are timed."""
    real = tuning.relative_errors
    broken = {"128/128/8/2/tma": 0.5, "128/64/8/2/tma": math.nan}  # forced fwd candidates

    def planted(*args, **kwargs):
        cfg = ft._attn_fwd.configs
        name = tuning.config_name(cfg[0]) if len(cfg) == 1 else None
        return [broken[name]] * 4 if name in broken else real(*args, **kwargs)

    monkeypatch.setattr(tuning, "relative_errors", planted)
    monkeypatch.setattr(tuning, "time_ms", lambda fn, device: (fn(), 1.0, 0.5, 2.0)[1:])
    before = _entries(ft._attn_fwd.configs)
    t = tuning.Target(32, False, 48, 1, 2, ("fwd",))
    rows = pd.DataFrame([r for batch in tuning.sweep_target(t, "cpu", torch.float16, (40, 56),
                                                            part="candidates")
                         for r in batch])
    fwd = rows[rows["kernel"] == "fwd"].set_index(["config", "metric"])
    names = [tuning.config_name(c) for c in tuning.candidates("fwd", 9, 32)]
    assert set(broken) < set(names)
    for name in names:
        want = "error" if name in broken else "ok"
        assert fwd.loc[(name, "max_rel_err"), "status"] == want, name
        assert fwd.loc[(name, "time_ms"), "status"] == want, name
        assert math.isnan(fwd.loc[(name, "time_ms"), "value"]) == (name in broken), name
    assert _entries(ft._attn_fwd.configs) == before  # the autotuner's candidates restored


def _fake_row(t):
    return dict(experiment="tuning", provider="longflash", mode="fwd", dtype="float16",
                batch=t.batch, seqlen_q=t.seqlen, seqlen_k=t.seqlen, nheads=t.nheads,
                nheads_kv=t.nheads, headdim=t.headdim, causal=t.causal, kernel="call",
                config="auto", metric="time_ms", value=1.0, unit="ms", p20=1.0, p80=1.0,
                status="ok")


@pytest.fixture
def no_kernels(monkeypatch):
    """For the tests of the sweep's order and bookkeeping: no kernel runs (the untimed calls
    that set the autotuner's choice, the call timed again) and every call row is made up; the
    quick sweep above runs them all."""
    monkeypatch.setattr(tuning, "pass_fn", lambda *a: lambda: None)
    for name in tuning.KERNELS.values():  # as after a call: the interpreter's tile, no candidate
        monkeypatch.setattr(getattr(ft, name), "best_config", ft._config(ft._INTERPRET_CONFIG),
                            raising=False)
    monkeypatch.setattr(tuning, "time_ms", lambda fn, device: (1.0, 0.5, 2.0))
    monkeypatch.setattr(tuning, "call_rows", lambda b, make_fn, device: [
        tuning._row(b, "call", "auto", "time_ms", 2.0)])


def test_budget_stops_starting_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "QUICK_TARGETS", tuning.QUICK_TARGETS * 2)
    calls = []
    monkeypatch.setattr(tuning, "sweep_target", lambda t, *a, **k: calls.append(t) or [
        [_fake_row(t)]])
    tuning.main(["--quick", "--budget-s", "-1", "--out", str(tmp_path / "t.csv")])
    assert len(calls) == 1  # the first target starts; none after the budget


def test_budget_stops_starting_candidates_and_the_log_names_them(tmp_path, monkeypatch,
                                                                 capsys, no_kernels):
    """Past the budget the first target's calls still run (a run measures something), no
    candidate does; a budget that runs out within a kernel's candidates stops before the
    next one and the log names those not run: a step's timeout then never kills a sweep with
    rows unwritten."""
    measured = []
    monkeypatch.setattr(tuning, "candidate_rows", lambda *a: measured.append(a) or [])
    out = tmp_path / "t.csv"
    tuning.main(["--quick", "--targets", "0", "--budget-s", "-1", "--out", str(out)])
    df = read_results(str(out))
    assert not measured and set(df["kernel"]) == {"call"}  # planted: without the check, all
    log = (tmp_path / "t.log").read_text()
    assert "spent: candidates of targets 0.. not run" in log

    def slow(t, b, kernel, cfg, *a):  # each candidate outlasts the budget
        time.sleep(0.3)
        return [tuning._row(b, kernel, tuning.config_name(cfg), "time_ms", 1.0)]
    monkeypatch.setattr(tuning, "candidate_rows", slow)
    t = tuning.Target(32, False, 48, 1, 2, ("fwd",))
    capsys.readouterr()
    rows = [r for batch in tuning.sweep_target(t, "cpu", torch.float16, (40, 56),
                                               deadline=time.monotonic() + 0.1,
                                               part="candidates") for r in batch]
    names = [tuning.config_name(c) for c in tuning.candidates("fwd", 9, 32)]
    assert [r["config"] for r in rows] == names[:1]  # the first, then the budget is spent
    assert f"budget spent: not run: fwd {', '.join(names[1:])}" in capsys.readouterr().out


def test_lead_trials_come_first_at_every_target_and_nothing_runs_twice(tmp_path, monkeypatch,
                                                                      no_kernels):
    """After every target's calls, every target's lead candidates (the autotuner's choice and
    the first LEAD_TRIALS trials of each kernel: the largest predicted gains), then the
    others; each candidate once."""
    targets = [tuning.Target(32, True, 48, 1, 2, ("fwd", "dkdv")),
               tuning.Target(32, False, 64, 1, 2, ("dkdv",))]
    monkeypatch.setattr(tuning, "QUICK_TARGETS", targets)
    measured = []

    def fake(t_, b, kernel, cfg, *a):
        measured.append((t_.seqlen, kernel, tuning.config_name(cfg)))
        return [tuning._row(b, kernel, tuning.config_name(cfg), "time_ms", 1.0)]
    monkeypatch.setattr(tuning, "candidate_rows", fake)
    tuning.main(["--quick", "--out", str(tmp_path / "t.csv")])
    assert len(measured) == len(set(measured))

    def names(kernel, entries):
        return [tuning.config_name(ft._config(c)) for c in entries]
    # the interpreter's autotuner holds one tile, none of the candidates: the trials lead
    lead = [(t.seqlen, k, n) for t in targets for k in t.kernels
            for n in names(k, tuning.TRIALS[k, 64][:tuning.LEAD_TRIALS[k]])]
    assert measured[:len(lead)] == lead
    rest = [(t.seqlen, k, tuning.config_name(c)) for t in targets for k in t.kernels
            for c in tuning.candidates(k, 9, t.headdim)]
    assert measured[len(lead):] == [m for m in rest if m not in lead]


def test_resume_measures_only_what_the_file_lacks(tmp_path, monkeypatch, no_kernels):
    t = tuning.QUICK_TARGETS[0]
    out = tmp_path / "t.csv"
    measured = []

    def fake(t_, b, kernel, cfg, *a):
        measured.append((kernel, tuning.config_name(cfg)))
        return [tuning._row(b, kernel, tuning.config_name(cfg), "time_ms", 1.0)]
    monkeypatch.setattr(tuning, "candidate_rows", fake)
    argv = ["--quick", "--targets", "0", "--out", str(out)]
    tuning.main(argv)
    first = list(measured)
    assert len(first) == sum(len(tuning.candidates(k, 9, t.headdim)) for k in t.kernels)
    # one candidate's row lost (an error, or a run cut short): the rerun measures it alone
    df = read_results(str(out))
    lost = (df["kernel"] == first[-1][0]) & (df["config"] == first[-1][1])
    df.loc[lost, "status"], df.loc[lost, "value"] = "error", float("nan")
    df.to_csv(out, index=False)
    measured.clear()
    tuning.main(argv + ["--resume"])
    assert measured == [first[-1]]
    measured.clear()
    tuning.main(argv)  # planted: without --resume everything again
    assert measured == first
    # --resume-after: a row measured before it (the tables changed since) counts as missing
    df = read_results(str(out))
    old = (df["kernel"] == first[0][0]) & (df["config"] == first[0][1])
    df.loc[old, "timestamp"] = "2020-01-01T00:00:00+00:00"
    df.drop(columns="source").to_csv(out, index=False)
    measured.clear()
    tuning.main(argv + ["--resume", "--resume-after", "2021-01-01T00:00:00"])
    assert measured == [first[0]]
    for bad, message in ((["--resume-after", "2021-01-01"], "needs --resume"),
                         (["--resume", "--resume-after", "soon"], "not an ISO time")):
        with pytest.raises(SystemExit):
            tuning.main(argv + bad)
