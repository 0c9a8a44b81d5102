"""experiments.gpu_campaign: the budget stops starting work near the limit, a failing or
hanging step becomes an error row, and a dry stage 1 leaves an archive that mirrors the
repository (what `make gpu-dry` checks for every stage)."""

import json
import os
import tarfile
import time

import pandas as pd
import pytest

from experiments import gpu_campaign as gc
from experiments import gpu_unpack
from experiments import ncu as ncu_probe
from experiments import results
from experiments.results import read_results, write_results
from conftest import needs_triton


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_budget_stops_starting_work_near_the_limit():
    clock = FakeClock()
    budget = gc.Budget(100, clock=clock, reserve_s=10)
    assert budget.allows(50) and budget.timeout(600) == 90
    clock.t = 45
    assert budget.allows(45) and not budget.allows(46)
    assert budget.timeout(20) == 20 and budget.timeout(600) == 45
    clock.t = 95
    assert not budget.allows(1) and budget.timeout(600) == 1.0  # never a zero timeout
    logged = []
    step = gc.Step("late", ["-c", "raise SystemExit('must not run')"], estimate_s=5)
    status, wall, note = gc.run_step(step, budget, dict(os.environ), logged.append, {})
    assert (status, wall, note) == ("skipped", 0.0, "budget spent")
    assert "not started" in logged[0]


def test_failing_and_hanging_steps_become_error_rows(tmp_path):
    steps = [gc.Step("ok", ["-c", "print('fine')"], estimate_s=1, timeout_s=60),
             gc.Step("crash", ["-c", "raise SystemExit(3)"], estimate_s=1, timeout_s=60),
             gc.Step("hang", ["-c", "import time; time.sleep(60)"], estimate_s=1, timeout_s=2),
             gc.Step("missing", ["-c", "pass"], needs="no-such-tool-xyz")]
    tar_path, records = gc.run_stage(1, tmp_path, dry=True, steps=steps, log_print=lambda m: 0)
    assert [r["status"] for r in records] == ["ok", "error", "error", "unsupported"]
    assert "timeout" in records[2]["note"] and "exit 3" in records[1]["note"]
    assert gc.check_archive(tar_path) == []
    with tarfile.open(tar_path) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    df = read_results(str(tmp_path / "x/results/gpu_campaign/dryrun-stage1.csv"))
    assert dict(zip(df["step"], df["status"])) == dict(ok="ok", crash="error", hang="error",
                                                       missing="unsupported")
    assert df["device"].str.startswith("dry run: ").all()
    log = (tmp_path / "x/results/gpu_campaign/dryrun-stage1.log").read_text()
    assert "crash: error, exit code 3" in log and "hang: error, timed out" in log


def test_dry_stage1_archive_mirrors_the_repository(tmp_path):
    tar_path, records = gc.run_stage(1, tmp_path, dry=True, log_print=lambda m: 0)
    assert [r["name"] for r in records] == ["preflight", "env", "speedup", "pytest_configs",
                                            "pytest"]
    assert [r["status"] for r in records] == ["ok"] * 5, records
    assert os.path.basename(tar_path) == "stage1.tar.gz"
    assert gc.check_archive(tar_path) == []
    with tarfile.open(tar_path) as tar:
        names = set(tar.getnames())
    assert {"results/speedup/dryrun.csv", "results/speedup/dryrun.log",
            "results/speedup/dryrun.json", "results/gpu_campaign/dryrun-stage1.csv",
            "results/gpu_campaign/dryrun-stage1-env.json",
            "results/gpu_campaign/dryrun-stage1-preflight.json"} <= names


def test_a_failed_preflight_switches_its_kind_off_for_the_later_steps(tmp_path):
    """A probe's JSON may carry "env" (the preflight: LONGFLASH_TMA / LONGFLASH_WS = "0"); the
    steps after it run with it."""
    write = ("import json, sys; json.dump(dict(rows=[], env=dict(LONGFLASH_WS='0')), "
             "open(sys.argv[1], 'w'))")
    see = "import os, sys; sys.exit(0 if os.environ.get('LONGFLASH_WS') == '0' else 5)"
    steps = [gc.Step("see_before", ["-c", see.replace("== '0'", "!= '0'")], estimate_s=1),
             gc.Step("preflight", ["-c", write, "{pre}-preflight.json"], estimate_s=1,
                     files=["preflight.json"]),
             gc.Step("see_after", ["-c", see], estimate_s=1)]
    _, records = gc.run_stage(1, tmp_path, dry=True, steps=steps, log_print=lambda m: 0)
    assert [r["status"] for r in records] == ["ok"] * 3, records


def test_a_steps_env_is_its_own(tmp_path):
    """Step.env (pytest_ws_fwd's LONGFLASH_WS=fwd) is set for that step alone, over the stage's
    environment, and named in the log."""
    see = "import os, sys; sys.exit(0 if os.environ.get('LONGFLASH_WS') {} else 5)"
    steps = [gc.Step("with", ["-c", see.format("== 'fwd'")], estimate_s=1,
                     env={"LONGFLASH_WS": "fwd"}),
             gc.Step("after", ["-c", see.format("!= 'fwd'")], estimate_s=1)]
    lines = []
    _, records = gc.run_stage(7, tmp_path, dry=True, steps=steps, log_print=lines.append)
    assert [r["status"] for r in records] == ["ok"] * 2, records
    assert any(line.startswith("-- with: LONGFLASH_WS=fwd ") for line in lines), lines


@pytest.mark.parametrize("summary, passed", [
    ("======= 10 passed, 115 deselected in 61.20s (0:01:01) =======", True),
    ("======= 9 passed, 1 skipped, 115 deselected in 50.1s =======", False),
    ("======= 1 failed, 9 passed, 115 deselected in 50.1s =======", False),
    ("======= 115 deselected in 0.5s =======", False),
    ("======= 9 passed, 1 error in 9.0s =======", False)])
def test_a_gate_passes_only_where_every_test_passed(summary, passed):
    """A skipped case (a GPU whose candidates may not run) checked nothing: not a pass."""
    out = "tests/test_gpu.py::test_x PASSED\n" + summary + "\n"
    assert gc.passed_every_test(out) is passed


def test_a_passed_gate_sets_its_env_for_the_later_steps_and_the_rest_run(tmp_path):
    """Step.then_env (stage 7's pytest_ws_fwd: LONGFLASH_WS=fwd): set for the steps after a
    gate that passed every test, not after one that did not; a --steps rest run, which does
    not run the gate again, sets it where the first run's rows say the gate passed."""
    out = "import sys; print('=== {} in 1.0s ===')"
    see = "import os, sys; sys.exit(0 if os.environ.get('LONGFLASH_WS') {} else 5)"
    for summary, after in (("2 passed", "== 'fwd'"), ("1 passed, 1 skipped", "!= 'fwd'")):
        steps = [gc.Step("gate", ["-c", out.format(summary)], estimate_s=1,
                         then_env={"LONGFLASH_WS": "fwd"}),
                 gc.Step("after", ["-c", see.format(after)], estimate_s=1)]
        _, records = gc.run_stage(7, tmp_path / summary[0], dry=True, steps=steps,
                                  log_print=lambda m: 0)
        assert [r["status"] for r in records] == ["ok"] * 2, (summary, records)
    camp = tmp_path / "camp.csv"
    rows = gc.campaign_rows([dict(name="gate", status="ok", wall_s=1.0, note=gc.GATE_PASSED),
                             dict(name="other", status="ok", wall_s=1.0, note="")], {})
    pd.DataFrame(rows).to_csv(camp, index=False)
    steps = [gc.Step("gate", [], then_env={"LONGFLASH_WS": "fwd"}), gc.Step("other", [])]
    assert gc.gates_passed_before(steps, str(camp)) == {"LONGFLASH_WS": "fwd"}
    seeded = tmp_path / "results" / "gpu_campaign"  # the first run's rows, unpacked
    seeded.mkdir(parents=True)
    results.write_results(rows, str(seeded / "dryrun-stage7.csv"), key_columns=gc.KEY_COLUMNS)
    steps = [gc.Step("gate", ["-c", "import sys; sys.exit(7)"], estimate_s=1,
                     then_env={"LONGFLASH_WS": "fwd"}),
             gc.Step("after", ["-c", see.format("== 'fwd'")], estimate_s=1)]
    _, records = gc.run_stage(7, tmp_path / "rest", dry=True, steps=steps, only=["after"],
                              seed_from=str(tmp_path / "results"), log_print=lambda m: 0)
    assert [(r["name"], r["status"]) for r in records] == [("after", "ok")], records
    rows[0]["note"] = "gate not passed"
    pd.DataFrame(rows).to_csv(camp, index=False)
    assert gc.gates_passed_before(steps, str(camp)) == {}


@needs_triton
def test_preflight_row_is_an_error_when_a_candidate_is_wrong(monkeypatch, capsys):
    """One kind's check (the interpreter here, the GPU in a stage): the row's status says
    whether its candidates computed attention; a wrong result makes it an error."""
    import json
    from longflash import flash_triton as ft
    for fn in (ft._attn_fwd, ft._attn_bwd_dkdv, ft._attn_bwd_dq):  # restored afterwards
        monkeypatch.setattr(fn, "configs", fn.configs)
    gc.probe_preflight_kind("ws", [16])
    row = json.loads(capsys.readouterr().out.split("PREFLIGHT ")[-1])
    assert row["status"] == "ok" and row["value"] < 1e-2, row
    monkeypatch.setattr(gc, "relative_errors", lambda *a: [1e-3, 0.5, 1e-3, float("nan")])
    gc.probe_preflight_kind("ws", [16])
    row = json.loads(capsys.readouterr().out.split("PREFLIGHT ")[-1])
    assert row["status"] == "error", row


def test_preflight_of_one_kind_checks_that_kind_alone(monkeypatch, tmp_path):
    """Stage 5's preflight_ws: only the warp-specialized kind's subprocess, turned on in it; a
    failure switches the kind off for the later steps (it is off by default anyway)."""
    import json
    calls = []

    def fake_run(argv, timeout, cwd, started, env):
        calls.append((argv[-2], env.get("LONGFLASH_WS")))
        row = gc._row(f"preflight_{argv[-2]}", status, "", "ok" if status < 0.03 else "error",
                      "")
        return 0, "PREFLIGHT " + json.dumps(row), ""

    monkeypatch.setattr(gc, "run_group", fake_run)
    monkeypatch.setattr(gc, "kill_children_on_sigterm", lambda: None)
    for status, env in ((1e-3, {}), (0.5, {"LONGFLASH_WS": "0"})):
        calls.clear()
        gc.probe_preflight(str(tmp_path / "p.json"), "64,128", "ws")
        found = json.loads((tmp_path / "p.json").read_text())
        assert calls == [("ws", "1")], calls
        assert [r["metric"] for r in found["rows"]] == ["preflight_ws"]
        assert found["env"] == env, found


def test_parse_ncu_csv_sums_kernels_in_bytes():
    text = ('==PROF== Connected\n"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","a","dram__bytes_read.sum","Mbyte","1.5"\n'
            '"1","b","dram__bytes_read.sum","Kbyte","500"\n'
            '"1","b","lts__t_bytes.sum","byte","1,024"\n')
    assert ncu_probe.parse_ncu_csv(text) == {"dram__bytes_read.sum": 2.0e6, "lts__t_bytes.sum": 1024.0}


def test_parse_ncu_csv_base_units_and_unknown_units():
    """--print-units base gives "byte"; a unit that is no byte count is skipped, not guessed."""
    text = ('"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","a","dram__bytes_write.sum","byte","1,048,576"\n'
            '"0","a","lts__t_bytes.sum","sector","10"\n')
    assert ncu_probe.parse_ncu_csv(text) == {"dram__bytes_write.sum": 1048576.0}


# ----------------------------------------------------------------------------- process groups

def _alive(pid):
    """pid runs (a zombie, reaped or not, does not count)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(ln.startswith("State:") and "Z" in ln.split()[1] for ln in f)
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_timeout_kills_the_steps_whole_process_group(tmp_path):
    """A hanging step's children (scaling's forked gloo ranks, ncu's target) go with it, and
    the step ends at its timeout, not when a child still holding its output pipe exits."""
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(40)']); "
            "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(40)")
    step = gc.Step("hang", ["-c", code, str(pid_file)], estimate_s=1, timeout_s=3)
    budget = gc.Budget(100, clock=FakeClock(), reserve_s=0)
    t0 = time.monotonic()
    status, wall, note = gc.run_step(step, budget, dict(os.environ), lambda m: 0, {})
    assert status == "error" and "timeout" in note
    assert time.monotonic() - t0 < 20
    pid = int(pid_file.read_text())
    for _ in range(50):  # reaped by init or a subreaper, or a zombie: not running either way
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the step's child survived its timeout"


# ----------------------------------------------------------------------------- budget shares

def test_step_timeout_keeps_the_reserve_and_budget_ends_before_the_timeout():
    clock = FakeClock()
    budget = gc.Budget(500, clock=clock, reserve_s=0)
    step = gc.Step("s", ["-c", "import sys; print('BUDGET', sys.argv[1])", "{budget}"],
                   estimate_s=50, timeout_s=400, reserve_s=100, tail_s=30)
    assert budget.step_timeout(step) == 400           # 500 left: its own limit
    clock.t = 200                                     # 300 left: 100 kept for later steps
    assert budget.step_timeout(step) == 200
    logged = []
    assert gc.run_step(step, budget, dict(os.environ), logged.append, {})[0] == "ok"
    assert "(timeout 200 s)" in logged[0] and "BUDGET 170" in "\n".join(logged)
    clock.t = 430                                     # 70 left: the reserve never cuts a
    assert budget.step_timeout(step) == 50            # started step below its estimate
    clock.t = 480                                     # 20 left: not started at all
    assert not budget.allows(step.estimate_s)


def _argv(stage, dry, name):
    return next(s.argv for s in gc.stage_steps(stage, dry) if s.name == name)


@pytest.mark.parametrize("dry", [False, True], ids=["full", "dry"])
def test_speedup_steps_run_only_their_part(dry):
    """speedup's Config.parts defaults to batch,long,decode: without --parts, stages 1 and 2
    would also run part decode, which stage 3 runs."""
    def parts(argv):
        return argv[argv.index("--parts", argv.index("--")) + 1]
    assert parts(_argv(1, dry, "speedup")) == "batch"
    assert parts(_argv(3, dry, "speedup_d256")) == "batch"
    assert parts(_argv(2, dry, "speedup_long")) == "long"
    assert parts(_argv(3, dry, "speedup_decode")) == "decode"


def test_stage_plans_fit_and_put_the_important_steps_first():
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    for stage in (1, 2, 3):
        steps = gc.stage_steps(stage, False)
        assert [s.name for s in steps[:2]] == ["preflight", "env"]
        # the later steps' estimates fit in what a step keeps for them
        for s in steps:
            assert s.estimate_s <= usable and s.reserve_s < usable
        assert sum(s.estimate_s for s in steps) <= usable + 60, stage
    names = [s.name for s in gc.stage_steps(1, False)]
    # RQ1 first, then the strict check of every autotune candidate, then the other GPU tests
    assert names[2:] == ["speedup", "pytest_configs", "pytest"]
    configs, rest = _argv(1, False, "pytest_configs"), _argv(1, False, "pytest")
    assert configs[configs.index("-k") + 1] == gc.EVERY_CONFIG_TEST
    assert rest[rest.index("-k") + 1] == f"not {gc.EVERY_CONFIG_TEST} and ({gc.EARLY_TESTS})"
    assert "-x" not in configs and "-x" not in rest
    stage1 = {s.name: s for s in gc.stage_steps(1, False)}
    assert stage1["speedup"].reserve_s >= stage1["pytest_configs"].estimate_s
    # stage 2: RQ3's 1M-token run (after the 64K autotuning) and RQ2's ncu rows first
    stage2 = {s.name: s for s in gc.stage_steps(2, False)}
    names = list(stage2)
    assert names.index("warm") < names.index("scaling") < names.index("ncu") \
        < names.index("speedup_long")
    ncu = stage2["ncu"]
    assert "{budget}" in ncu.argv and ncu.timeout_s >= 2 * ncu_probe.NCU_CONFIG_TIMEOUT_S
    assert stage2["scaling"].reserve_s >= ncu.estimate_s and ncu.tail_s > 0
    # stage 3: decode no longer keeps more than is left after it starts
    stage3 = gc.stage_steps(3, False)
    before = sum(s.estimate_s for s in stage3[:4]) + 60
    decode = next(s for s in stage3 if s.name == "speedup_decode")
    assert usable - before - decode.reserve_s >= decode.estimate_s


def test_stage4_is_the_tuning_sweep_within_the_budget():
    """Stage 4: env, then experiments.tuning with its own budget (it starts no target after
    it) and a timeout that fits the stage; no preflight (the sweep checks each candidate)."""
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    for dry in (False, True):
        steps = gc.stage_steps(4, dry)
        assert [s.name for s in steps] == ["env", "tuning"]
        tune = steps[1]
        assert tune.rq == "tuning" and tune.argv[:2] == ["-m", "experiments.tuning"]
        assert ("--quick" if dry else "--full") in tune.argv and "{budget}" in tune.argv
        assert tune.tail_s > 0 and sum(s.timeout_s for s in steps) <= usable + 60
    assert gpu_unpack.KEY_COLUMNS["tuning"] == ("kernel", "config")


def test_stage5_is_the_second_windows_gaps_in_order_within_the_budget():
    """Stage 5 (a 15-minute window on the H100 that ran stages 1-3): no preflight; the goal
    rows never measured first (d64 causal 16K, then d256 from 4K), then the GPU tests no window
    ran that check kernels against float64, then the warp-specialized candidates' preflight
    (since the partition row fix), then the sweep (resumable, the warp-specialized candidates
    last), then test_triton_gpu, then the torch.compile tests; the estimates fit the stage,
    and each reserve leaves its step its estimate and keeps the next one's."""
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    for dry in (False, True):
        steps = gc.stage_steps(5, dry)
        assert [s.name for s in steps] == ["env", "speedup_d64", "speedup_d256", "pytest_exact",
                                           "preflight_ws", "tuning", "pytest_triton",
                                           "pytest_compile", "scaling_exact"]
        assert steps[-1].argv[-4:-2] == ["--parts", "exactness"] and steps[-1].rq == "scaling"
        assert sum(s.estimate_s for s in steps) <= usable
        ws = steps[4]
        assert ws.argv[ws.argv.index("--probe") + 1] == "preflight" and ws.argv[-1] == "ws"
        assert ws.files == ["preflight_ws.json"] and ws.name not in gc.ALWAYS
        tune = steps[5]
        assert tune.argv[:2] == ["-m", "experiments.tuning"] and "--resume" in tune.argv
        assert "--ws" in tune.argv and "{budget}" in tune.argv and tune.tail_s > 0
        for s in steps:
            assert s.estimate_s <= usable and s.reserve_s < usable
    d64, d256 = _argv(5, False, "speedup_d64"), _argv(5, False, "speedup_d256")
    assert d64[d64.index("--headdims") + 1] == "64" and d64[d64.index("--seqlens") + 1] == "16384"
    assert d256[d256.index("--seqlens") + 1].startswith("4096,")
    assert "--resume" in d64 and "--resume" in d256
    _assert_shares_fit(5)
    triton = _argv(5, False, "pytest_triton")
    assert triton[triton.index("-k") + 1] == "test_triton_gpu"


def _assert_shares_fit(stage, second_call=()):
    """Each step's share: after env and the estimates before it, its reserve leaves the step
    at least its estimate, and keeps the next step's (but the steps named in second_call,
    last, which wait for the window's second call unless the first leaves time)."""
    full = [s for s in gc.stage_steps(stage, False) if s.name not in second_call]
    left = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S - full[0].estimate_s
    for i, s in enumerate(full[1:], 1):
        assert left - s.reserve_s >= s.estimate_s, s.name
        assert s.reserve_s >= sum(t.estimate_s for t in full[i + 1:i + 2]), s.name
        left -= s.estimate_s


def test_stage6_checks_the_new_tiles_then_measures_rq1_again_with_them():
    """Stage 6 (the third window): every candidate forced first (the backward's new tiles),
    then RQ1 at d128 and d256 with rows from before TILES_CHANGED measured again, SDPA's
    FlashAttention-2 and cuDNN backends in the same run; then the tests left over. The
    estimates fit, and each reserve leaves its step its estimate and keeps the next one's."""
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    for dry in (False, True):
        steps = gc.stage_steps(6, dry)
        assert [s.name for s in steps] == ["env", "pytest_configs", "speedup_d128",
                                           "speedup_d256", "pytest_exact", "preflight_ws",
                                           "pytest_triton", "pytest_compile", "scaling_exact"]
        assert sum(s.estimate_s for s in steps) <= usable
        for name in ("speedup_d128", "speedup_d256"):
            argv = _argv(6, dry, name)
            assert "--resume" in argv
            assert argv[argv.index("--resume-after") + 1] == gc.TILES_CHANGED
    for name, headdim in (("speedup_d128", "128"), ("speedup_d256", "256")):
        argv = _argv(6, False, name)
        assert argv[argv.index("--headdims") + 1] == headdim
        assert argv[argv.index("--seqlens") + 1] == "4096,8192,16384"
        assert set(argv[argv.index("--providers") + 1].split(",")) >= {
            "longflash", "sdpa_flash", "sdpa_cudnn"}
    _assert_shares_fit(6)
    configs = _argv(6, False, "pytest_configs")
    assert configs[configs.index("-k") + 1] == gc.EVERY_CONFIG_TEST


def test_steps_rest_are_those_an_earlier_run_did_not_finish(tmp_path):
    """--steps rest (a window's second run): the steps not run, skipped for the budget or cut
    by a timeout, and the resumable ones (their own budget, --resume); not those that ended,
    with an error exit too (a failing test is a result, not a reason to run it again)."""
    camp = tmp_path / "h100-stage5.csv"
    assert gc.unfinished_steps(5, False, str(camp)) == [s.name for s in gc.stage_steps(5, False)]
    records = [dict(name="env", status="ok", wall_s=3.0, note=""),
               dict(name="speedup_d64", status="ok", wall_s=40.0, note=""),
               dict(name="speedup_d256", status="ok", wall_s=200.0, note=""),
               dict(name="pytest_exact", status="error", wall_s=80.0, note="exit 1: 1 failed"),
               dict(name="preflight_ws", status="ok", wall_s=30.0, note=""),
               dict(name="tuning", status="error", wall_s=150.0, note="timeout after 150 s"),
               dict(name="pytest_triton", status="skipped", wall_s=0.0, note="budget spent")]
    write_results(gc.campaign_rows(records, {}), str(camp), key_columns=gc.KEY_COLUMNS)
    assert gc.unfinished_steps(5, False, str(camp)) == [
        "speedup_d64", "speedup_d256", "tuning", "pytest_triton", "pytest_compile",
        "scaling_exact"]


# One process collects for every -k expression (importing torch and the suite once, not per
# expression): pytest.main on the same file again finds its modules imported.
_COLLECT = """import sys, pytest
for select in sys.argv[1:]:
    print("== select", flush=True)
    pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                 *(["-k", select] if select else []), "tests/test_gpu.py"])
"""


def _collected(*selects):
    """Per -k expression of `selects` ("": none), the GPU tests of tests/test_gpu.py it picks
    (collected, not run), as names without the file."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # -q, --junitxml: ours
    out = subprocess.run([sys.executable, "-c", _COLLECT, *selects], capture_output=True,
                         text=True, cwd=gc.ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    runs = out.stdout.split("== select\n")[1:]
    assert len(runs) == len(selects), out.stdout[-2000:]
    return [[ln.split("::")[1] for ln in run.splitlines() if "::" in ln] for run in runs]


def _select(stage, name):
    """The -k expression of a stage's pytest step."""
    argv = _argv(stage, False, name)
    return argv[argv.index("-k") + 1]


def test_stage5_splits_stage3s_late_tests_exact_first():
    """Stage 5's pytest_exact and pytest_compile are stage 3's pytest_late, once each: the
    float64 checks of the kernels first, torch.compile's tests last."""
    exact, rest, late = _collected(_select(5, "pytest_exact"), _select(5, "pytest_compile"),
                                   _select(3, "pytest_late"))
    assert exact and rest
    assert sorted(exact + rest) == sorted(late)
    assert not set(exact) & set(rest)
    for name in ("test_variants_gpu", "test_learnable_sink_gpu", "test_varlen_gpu",
                 "test_paged_varlen_gpu", "test_headdim_v_gpu", "test_kvcache_headdim_v_gpu"):
        assert any(t.startswith(name) for t in exact), name
    assert all("compile" not in t for t in exact)
    assert any(t.startswith("test_compile_inductor_gpu") for t in rest)


# ----------------------------------------------------------------------------- ncu

def _plan(seqlens=(1024, 4096, 16384), providers=("longflash", "sdpa_flash", "standard")):
    return [dict(provider=p, mode="fwd", batch=1, seqlen=n, nheads=16, headdim=128, causal=False,
                 dtype="bfloat16", model_hbm_bytes=float(n * 1000 + i))
            for n in seqlens for i, p in enumerate(providers)]


def test_ncu_plan_puts_configurations_beyond_l2_first():
    l2 = 50 * 2**20
    plan = ncu_probe.order_ncu_plan(_plan(), l2)
    over = [ncu_probe.ncu_working_set(p) > l2 for p in plan]
    assert over == sorted(over, reverse=True) and over[0] and not over[-1]
    assert [(p["provider"], p["seqlen"]) for p in plan[:4]] == [
        ("standard", 1024), ("longflash", 4096), ("sdpa_flash", 4096), ("standard", 4096)]
    assert {(p["provider"], p["seqlen"]) for p in plan[-2:]} == {("longflash", 1024),
                                                                  ("sdpa_flash", 1024)}


def test_ncu_rows_are_written_after_each_configuration_and_the_rest_marked(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("LONGFLASH_DEVICE_NAME", "dry run: test")
    out = str(tmp_path / "io.csv")
    plan = _plan(seqlens=(4096,))
    clock = FakeClock()
    seen = []

    def run(p, timeout):
        df = pd.read_csv(out)  # what an interrupted probe would have left at this point
        seen.append(sorted(set(df.loc[df["status"] == "ok", "provider"])))
        clock.t += 30
        assert timeout == min(ncu_probe.NCU_CONFIG_TIMEOUT_S, 70 - (clock.t - 30))
        return {m: 1.0e6 for m in ncu_probe.NCU_METRICS.split(",")}, "ok", "fake"

    ncu_probe.measure_ncu(plan, out, run, budget_s=70, clock=clock)
    # the third starts with 10 s left < NCU_CONFIG_MIN_S
    assert seen == [[], ["longflash"]]
    df = pd.read_csv(out)
    assert len(df) == 3 * len(plan)
    status = dict(zip(df["provider"], df["status"]))
    assert status == dict(longflash="ok", sdpa_flash="ok", standard="error")
    assert set(df.loc[df["provider"] == "standard", "note"]) == {ncu_probe.NCU_NOT_MEASURED}
    # a rerun (a seeded results file) measures only what is not "ok" yet
    again = []
    ncu_probe.measure_ncu(plan, out, lambda p, t: (again.append(p["provider"]) or {}, "error", "x"),
                   budget_s=100, clock=clock)
    assert again == ["standard"]
    df = pd.read_csv(out)
    assert dict(zip(df["provider"], df["status"]))["longflash"] == "ok"


def test_ncu_step_gets_the_budget_and_keeps_rows_on_a_timeout(tmp_path, monkeypatch):
    """The probe writes per configuration; a step killed at its timeout keeps them."""
    monkeypatch.setenv("LONGFLASH_DEVICE_NAME", "dry run: test")
    script = tmp_path / "fake_ncu_probe.py"
    script.write_text(
        "import sys, time\n"
        "from experiments import ncu\n"
        "ncu.NCU_CONFIG_MIN_S = 1\n"
        "plan = [dict(provider='longflash', mode='fwd', batch=1, seqlen=n, nheads=1, headdim=16,\n"
        "             causal=False, dtype='float32', model_hbm_bytes=float(n))\n"
        "        for n in (64, 128, 256)]\n"
        "def run(p, timeout):  # the second configuration hangs\n"
        "    time.sleep(0 if p['seqlen'] == 64 else 60)\n"
        "    return {m: 1.0 for m in ncu.NCU_METRICS.split(',')}, 'ok', ''\n"
        "ncu.measure_ncu(plan, sys.argv[1], run, float(sys.argv[2]))\n")
    step = gc.Step("ncu", [str(script), "{out}", "{budget}"], rq="io_complexity",
                   estimate_s=1, timeout_s=8, tail_s=3)
    _, records = gc.run_stage(2, tmp_path, dry=True, steps=[step], log_print=lambda m: 0)
    assert records[0]["status"] == "error" and "timeout" in records[0]["note"]
    with tarfile.open(tmp_path / "stage2.tar.gz") as tar:
        tar.extractall(tmp_path / "x", filter="data")
    df = pd.read_csv(tmp_path / "x/results/io_complexity/dryrun.csv")
    status = df.groupby("seqlen_q")["status"].agg(set).to_dict()
    assert status == {64: {"ok"}, 128: {"error"}, 256: {"error"}}


# ----------------------------------------------------------------------------- earlier runs

def test_earlier_logs_configs_and_rows_are_kept(tmp_path):
    """Files of the repository (here a fake results/) for this device are copied into the
    scratch tree: the log is appended to, the JSON keeps each run, rows merge by key; two
    steps writing the same <stem>.json (scaling, scaling_exact) keep both configs."""
    seed = tmp_path / "repo_results"
    (seed / "fake").mkdir(parents=True)
    (seed / "fake" / "dryrun.log").write_text("stage-1 log line\n")
    (seed / "fake" / "dryrun.json").write_text(json.dumps(dict(part="from stage 1")))
    (seed / "fake" / "dryrun-other.log").write_text("not this device's\n")
    (seed / "gpu_campaign").mkdir()
    (seed / "gpu_campaign" / "dryrun-stage2.log").write_text("earlier stage-2 run\n")
    code = ("import sys; from experiments.results import Log, start_run; "
            "start_run('fake', sys.argv[1], Log(), dict(part=sys.argv[2]), 'header')")
    steps = [gc.Step("a", ["-c", code, "{out}", "a"], rq="fake", estimate_s=1),
             gc.Step("b", ["-c", code, "{out}", "b"], rq="fake", estimate_s=1)]
    tar_path, records = gc.run_stage(2, tmp_path / "o", dry=True, steps=steps,
                                     log_print=lambda m: 0, seed_from=str(seed))
    assert [r["status"] for r in records] == ["ok", "ok"]
    with tarfile.open(tar_path) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "x", filter="data")
    assert "results/fake/dryrun-other.log" not in names
    x = tmp_path / "x/results"
    log = (x / "fake/dryrun.log").read_text()
    assert log.startswith("stage-1 log line\n") and log.count("\nheader\n") == 2
    config = json.loads((x / "fake/dryrun.json").read_text())
    assert config["part"] == "b"
    assert [r["part"] for r in config["earlier_runs"]] == ["from stage 1", "a"]
    assert (x / "gpu_campaign/dryrun-stage2.log").read_text().startswith("earlier stage-2 run")


def test_seed_scratch_copies_only_this_devices_files(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    for name in ("h100.csv", "h100.log", "h100.ncu.log", "h100-pcie.csv", "cpu-x.csv"):
        (src / name).write_text(name)
    (dst).mkdir()
    (dst / "h100.csv").write_text("already here")
    assert gc.seed_scratch(str(src), str(dst), "h100.") == ["h100.log", "h100.ncu.log"]
    assert (dst / "h100.csv").read_text() == "already here"
    assert gc.seed_scratch(str(tmp_path / "none"), str(dst), "h100.") == []


def test_steps_option_runs_the_named_steps_and_the_preflight(tmp_path):
    steps = [gc.Step(n, ["-c", "pass"], estimate_s=1) for n in ("preflight", "env", "a", "b")]
    _, records = gc.run_stage(2, tmp_path, dry=True, steps=steps, only=["b"],
                              log_print=lambda m: 0)
    assert [r["name"] for r in records] == ["preflight", "env", "b"]


# ----------------------------------------------------------------------------- provenance

def test_campaign_records_the_commit_and_says_when_it_is_unknown(tmp_path, monkeypatch):
    steps = [gc.Step("ok", ["-c", "pass"], estimate_s=1)]
    monkeypatch.setattr(results, "git_state", lambda: ("unknown", "unknown", "", "unknown"))
    logged = []
    gc.run_stage(1, tmp_path, dry=True, steps=steps, log_print=logged.append)
    assert any(m.startswith("WARNING: provenance: git_commit 'unknown'") for m in logged)
    monkeypatch.setattr(results, "git_state", lambda: ("abc123", False, "", "environment"))
    logged = []
    gc.run_stage(1, tmp_path, dry=True, steps=steps, log_print=logged.append)
    assert "code: git_commit abc123, git_dirty False (from environment)" in logged
    assert not any("WARNING" in m for m in logged)


def test_print_command_fills_in_the_commit(monkeypatch):
    monkeypatch.setattr(results, "git_state", lambda: ("f" * 40, True, "kernels/a.py", "git"))
    assert gc.print_command(2) == (f"LONGFLASH_GIT_COMMIT={'f' * 40} LONGFLASH_GIT_DIRTY=True "
                                   "python3 -m experiments.gpu_campaign --stage 2 --out $OUT")


def test_pytest_steps_run_every_gpu_test_once():
    """Stage 1's pytest_configs and pytest and stage 3's pytest_late select each GPU test of
    tests/test_gpu.py exactly once (their -k expressions, collected without running)."""
    configs, stage1, late, every = _collected(
        _select(1, "pytest_configs"), _select(1, "pytest"), _select(3, "pytest_late"), "")
    picked = configs + stage1 + late
    assert len(picked) == len(set(picked))
    assert any("test_triton_gpu" in t for t in stage1)
    assert any("test_headdim_v_gpu" in t for t in late)
    assert sorted(picked) == sorted(every)


@needs_triton
def test_stage7_measures_what_still_times_the_old_tiles_then_tests_and_tunes_d256():
    """Stage 7 (the fourth window): the forward's warp-specialized candidate checked (a gate
    that turns it on for the later steps), RQ1's rows that still time the old backward tiles
    (1K-2K, part long) measured again, and its 4K-16K rows if the gate passed, the GPU tests
    no window finished, the sweep at d256's backward targets with rows from before
    TILES_CHANGED measured again, and last attn_mask's and the float8 cache's GPU tests.
    The estimates fit, and each
    reserve leaves its step its estimate and keeps the next one's."""
    from experiments import tuning
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    names = ["env", "host_time", "pytest_ws_fwd", "speedup_batch", "speedup_short",
             "speedup_long", "pytest_triton", "pytest_compile", "tuning", "preflight_ws",
             "scaling_exact", "pytest_mask", "pytest_fp8", "speedup_decode"]
    second_call = ("pytest_fp8", "speedup_decode")
    for dry in (False, True):
        steps = gc.stage_steps(7, dry)
        assert [s.name for s in steps] == names
        # the float8 cache's test and timing (last) wait for the window's second call
        # (--steps rest, GPU.md) unless the first leaves time
        assert sum(s.estimate_s for s in steps if s.name not in second_call) <= usable
        decode = _argv(7, dry, "speedup_decode")  # every decode row older than the variant
        assert "--resume" in decode and decode[decode.index("--parts") + 1] == "decode"
        assert decode[decode.index("--resume-after") + 1] == gc.DECODE_FP8_ADDED
        for name in ("speedup_short", "speedup_long", "tuning"):
            argv = _argv(7, dry, name)
            assert "--resume" in argv
            assert argv[argv.index("--resume-after") + 1] == gc.TILES_CHANGED
    short, long_ = _argv(7, False, "speedup_short"), _argv(7, False, "speedup_long")
    assert short[short.index("--headdims") + 1] == "128,256,64"
    assert short[short.index("--seqlens") + 1] == "1024,2048"
    assert long_[long_.index("--parts") + 1] == "long"
    assert _argv(7, False, "preflight_ws")[-2:] == ["128", "ws"]
    # the forward's WS checks with its WS candidates on, and on for the later steps if they pass
    ws_fwd = next(s for s in gc.stage_steps(7, False) if s.name == "pytest_ws_fwd")
    assert ws_fwd.env == ws_fwd.then_env == {"LONGFLASH_WS": "fwd"}
    batch = _argv(7, False, "speedup_batch")  # no --resume-after: measured unless switched
    assert "--resume" in batch and "--resume-after" not in batch
    assert batch[batch.index("--seqlens") + 1] == "4096,8192,16384"
    assert batch[batch.index("--headdims") + 1].startswith("128,")
    import test_gpu
    select = ws_fwd.argv[ws_fwd.argv.index("-k") + 1]
    assert [n for n in dir(test_gpu) if n.startswith("test_") and select in n] == [
        "test_forward_warp_specialized_gpu", "test_forward_warp_specialized_varlen_gpu"]
    mask = next(s for s in gc.stage_steps(7, False) if s.name == "pytest_mask")
    assert [n for n in dir(test_gpu) if mask.argv[mask.argv.index("-k") + 1] in n] == [
        "test_attn_mask_gpu", "test_attn_mask_gradient_gpu", "test_attn_mask_kvcache_gpu",
        "test_attn_mask_routes_decoding_to_split_kv_gpu"]
    fp8 = next(s for s in gc.stage_steps(7, False) if s.name == "pytest_fp8")
    assert [n for n in dir(test_gpu) if n.startswith("test_")
            and fp8.argv[fp8.argv.index("-k") + 1] in n] == [
        "test_fp8_append_rounds_as_torch_gpu", "test_fp8_kvcache_gpu",
        "test_fp8_paged_prefill_gpu"]
    from longflash import flash_triton as ft
    for (kernel, headdim), tiles in gc.WS_TRIALS.items():  # tiles the table lacks, each a WS one
        table = ft.CONFIGS[ft._table_key(kernel, 9, headdim)]
        assert all(t[4:] == (ft.TMA, ft.WS) and t not in table for t in tiles), tiles
    tune = _argv(7, False, "tuning")
    picked = [tuning.TARGETS[int(i)] for i in tune[tune.index("--targets") + 1].split(",")]
    assert picked and all(t.headdim == 256 and "dkdv" in t.kernels for t in picked), picked
    _assert_shares_fit(7, second_call=second_call)


def test_stage8_checks_what_no_gpu_ran_first_then_times_it_and_the_goals():
    """Stage 8 (the next window, an H200's): the GPU tests of what no GPU has run first (the
    float8 cache, 4 of 5 failed in the fourth window on -0; cascade decoding and the 64-row
    tile; a training step in CUDA graphs), then the float8 cache's first timing (RQ1 part
    decode, every provider in one run, before the gate so that its rows are the default
    switches'), the host's time per call with LongFlash's profile, the forward's WS gate (its
    packed case now checks that WS is left out), RQ1's goals slice (measured where its rows
    are missing or under other switches), the cascade's and chunked prefill's first timings,
    RQ1's other slices, then what no window reached. Every step fits the first call; each
    reserve leaves its step its estimate and keeps the next one's."""
    usable = gc.BUDGET_S - gc.ARCHIVE_RESERVE_S
    names = ["env", "pytest_fp8", "pytest_shared_prefix", "pytest_graphs", "speedup_decode",
             "host_time", "pytest_ws_fwd", "speedup_batch", "speedup_shared_prefix",
             "speedup_prefill", "speedup_mla", "speedup_short", "speedup_long", "preflight_ws",
             "scaling_exact"]
    for dry in (False, True):
        steps = gc.stage_steps(8, dry)
        assert [s.name for s in steps] == names
        assert sum(s.estimate_s for s in steps) <= usable
        decode = _argv(8, dry, "speedup_decode")
        assert "--resume" in decode and decode[decode.index("--parts") + 1] == "decode"
        assert decode[decode.index("--resume-after") + 1] == gc.DECODE_FP8_ADDED
        assert "--profile" in _argv(8, dry, "host_time")
        for name in ("speedup_batch", "speedup_short", "speedup_long"):
            argv = _argv(8, dry, name)  # measured again only under other switches
            assert "--resume" in argv and "--resume-after" not in argv
    by_name = {s.name: s for s in gc.stage_steps(8, False)}
    assert by_name["pytest_ws_fwd"].env == by_name["pytest_ws_fwd"].then_env == gc.WS_FORWARD
    assert not by_name["speedup_decode"].env  # before the gate: the default switches
    import test_gpu
    fp8 = by_name["pytest_fp8"].argv
    assert [n for n in dir(test_gpu) if n.startswith("test_") and fp8[fp8.index("-k") + 1] in n
            ] == ["test_fp8_append_rounds_as_torch_gpu", "test_fp8_kvcache_gpu",
                  "test_fp8_paged_prefill_gpu"]
    graphs = by_name["pytest_graphs"].argv
    assert [n for n in dir(test_gpu) if n.startswith("test_")
            and graphs[graphs.index("-k") + 1] in n] == ["test_training_cuda_graphs_gpu"]
    assert _argv(8, False, "preflight_ws")[-2:] == ["128", "ws"]
    for name, part in (("speedup_prefill", "prefill"), ("speedup_shared_prefix", "shared_prefix"),
                       ("speedup_mla", "mla")):
        argv = _argv(8, False, name)
        assert "--full" in argv and argv[argv.index("--parts") + 1] == part
    shared = by_name["pytest_shared_prefix"].argv
    assert shared[shared.index("-k") + 1] == "shared_prefix or 64rows or mla"
    assert "test_mla_decoding_gpu" in dir(test_gpu)
    assert "test_shared_prefix_gpu" in dir(test_gpu)
    assert "spec16-tree-64rows" in open(test_gpu.__file__).read()
    assert _argv(8, False, "speedup_short")[_argv(8, False, "speedup_short").index(
        "--seqlens") + 1] == "1024,2048"
    _assert_shares_fit(8)


def test_print_command_for_the_rest_needs_the_first_calls_rows(tmp_path, monkeypatch):
    """--print-command --steps rest refuses until the first call's archive is unpacked here:
    the second call reads which steps the first finished from the tree it is sent (the fourth
    window's was sent before, and ran every step again). A dry run's rows do not count."""
    camp = tmp_path / "results" / "gpu_campaign"
    camp.mkdir(parents=True)
    (camp / "dryrun-stage8.csv").write_text("step\n")
    monkeypatch.setattr(gc, "ROOT", str(tmp_path))
    with pytest.raises(SystemExit, match="unpack the first call's archive"):
        gc.print_command(8, "rest")
    assert gc.print_command(8).endswith("--stage 8 --out $OUT")  # the first call's line
    (camp / "h100-stage8.csv").write_text("step\n")
    assert gc.print_command(8, "rest").endswith("--stage 8 --out $OUT --steps rest")
