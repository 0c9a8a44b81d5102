"""experiments.gpu_campaign: the budget stops starting work near the limit, a failing or
hanging step becomes an error row, and a dry stage 1 leaves an archive that mirrors the
repository (what `make gpu-dry` checks for all three stages in CI)."""

import os
import tarfile

from experiments import gpu_campaign as gc
from experiments.results import read_results


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
    assert [r["status"] for r in records] == ["ok"] * 4, records
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
    monkeypatch.setattr(gc, "_relative_errors", lambda *a: [1e-3, 0.5, 1e-3, float("nan")])
    gc.probe_preflight_kind("ws", [16])
    row = json.loads(capsys.readouterr().out.split("PREFLIGHT ")[-1])
    assert row["status"] == "error", row


def test_parse_ncu_csv_sums_kernels_in_bytes():
    text = ('==PROF== Connected\n"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
            '"0","a","dram__bytes_read.sum","Mbyte","1.5"\n'
            '"1","b","dram__bytes_read.sum","Kbyte","500"\n'
            '"1","b","lts__t_bytes.sum","byte","1,024"\n')
    assert gc.parse_ncu_csv(text) == {"dram__bytes_read.sum": 2.0e6, "lts__t_bytes.sum": 1024.0}
