"""The helpers every experiment uses: results schema and writing, FLOP counts, timing, memory."""

import datetime
import json
import math
import os
import re
import subprocess
import sys
import time

import pandas as pd
import pytest
import torch

from experiments.measure import is_oom, time_ms, time_ms_interleaved
from experiments.results import (COLUMNS, KEY_COLUMNS, PROVENANCE_COLUMNS, causal_pairs, flops,
                                 provenance, read_results, tflops, write_results)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_row(seqlen=128, value=1.0, status="ok", **overrides):
    row = dict(experiment="speedup", provider="longflash", mode="fwd", dtype="float16", batch=2,
               seqlen_q=seqlen, seqlen_k=seqlen, nheads=4, nheads_kv=2, headdim=64, causal=True,
               metric="time_ms", value=value, unit="ms", p20=value, p80=value, status=status)
    row.update(overrides)
    return row


def files_under(path):
    return sorted(os.path.relpath(os.path.join(d, f), path)
                  for d, _, names in os.walk(path) for f in names)


# -- writing -----------------------------------------------------------------------------------

def test_write_replaces_by_key_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "speedup" / "cpu.csv"  # the folder does not exist yet
    write_results([make_row(128, 1.0), make_row(256, 2.0),
                   make_row(512, float("nan"), status="oom")], path, command="first")
    # Second batch: seqlen 256 measured again (and dtype given as a torch.dtype, which must
    # match "float16" after the CSV round trip), seqlen 1024 new.
    merged = write_results([make_row(256, 20.0, dtype=torch.float16), make_row(1024, 4.0)],
                           path, command="second")

    assert files_under(tmp_path) == [os.path.join("speedup", "cpu.csv")]
    df = pd.read_csv(path)
    assert list(df.columns) == COLUMNS + PROVENANCE_COLUMNS == list(merged.columns)
    assert len(df) == len(merged) == 4
    assert not df.duplicated(KEY_COLUMNS).any()
    by_seqlen = df.set_index("seqlen_q")
    assert sorted(by_seqlen.index) == [128, 256, 512, 1024]
    assert by_seqlen.loc[256, "value"] == 20.0 and by_seqlen.loc[256, "command"] == "second"
    assert by_seqlen.loc[128, "value"] == 1.0 and by_seqlen.loc[128, "command"] == "first"
    assert by_seqlen.loc[512, "status"] == "oom" and math.isnan(by_seqlen.loc[512, "value"])
    assert by_seqlen.loc[1024, "value"] == 4.0


def test_write_keeps_given_provenance_and_extra_columns(tmp_path):
    path = tmp_path / "r.csv"
    df = write_results([make_row(device="my CPU", block_m=64)], path)
    assert df.loc[0, "device"] == "my CPU"
    assert list(df.columns) == COLUMNS + PROVENANCE_COLUMNS + ["block_m"]


@pytest.mark.parametrize("bad, message", [
    (dict(provider="flash3"), r"provider 'flash3' is not one of \['longflash'"),
    (dict(mode="forward"), r"mode 'forward' is not one of \['fwd', 'bwd', 'fwd_bwd'"),
    (dict(status="crashed"), r"status 'crashed' is not one of \['ok', 'oom'"),
    (dict(value=float("nan")), r"status 'ok' needs a finite value"),
    (dict(value=float("inf")), r"status 'ok' needs a finite value"),
    (dict(headdim=None), None),  # removed below: a missing column
    ("duplicate", r"duplicate key"),
], ids=["provider", "mode", "status", "ok-nan", "ok-inf", "missing-column", "duplicate"])
def test_invalid_rows_raise_and_leave_file_untouched(tmp_path, bad, message):
    path = tmp_path / "r.csv"
    write_results([make_row(128)], path)
    before = path.read_bytes()
    if bad == "duplicate":
        rows = [make_row(256, 1.0), make_row(256, 2.0)]
    elif message is None:
        rows = [make_row(256)]
        del rows[0]["headdim"]
        message = r"missing measurement columns \['headdim'\]"
    else:
        rows = [make_row(256, **bad)]
    with pytest.raises(ValueError, match=message):
        write_results(rows, path)
    assert path.read_bytes() == before
    assert files_under(tmp_path) == ["r.csv"]


def test_provenance_columns():
    prov = provenance()
    assert list(prov) == PROVENANCE_COLUMNS
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]) or prov["git_commit"] == "unknown"
    assert prov["git_dirty"] in (True, False, "unknown")
    assert prov["torch"] == torch.__version__ and prov["device"]
    stamp = datetime.datetime.fromisoformat(prov["timestamp"])
    assert stamp.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - stamp).total_seconds()) < 60
    assert provenance("python -m experiments.speedup")["command"] == "python -m experiments.speedup"


def test_the_command_names_the_kernels_switches(monkeypatch):
    """A run under LONGFLASH_TMA / LONGFLASH_WS times other candidates: its rows' command says
    so, before the command line."""
    from experiments.results import this_command
    for name in ("LONGFLASH_TMA", "LONGFLASH_WS"):
        monkeypatch.delenv(name, raising=False)
    plain = this_command()
    assert "LONGFLASH" not in plain.split()[0]
    monkeypatch.setenv("LONGFLASH_WS", "fwd")
    monkeypatch.setenv("LONGFLASH_TMA", "0")
    assert this_command() == "LONGFLASH_TMA=0 LONGFLASH_WS=fwd " + plain
    assert provenance()["command"] == this_command()
    monkeypatch.setenv("LONGFLASH_TMA", "1")  # the defaults: not named
    monkeypatch.setenv("LONGFLASH_WS", "0")
    assert this_command() == plain


def test_same_switches_reads_them_back_from_the_command(monkeypatch):
    """--resume's filter (speedup, tuning): a row counts as measured only under the switches
    this run has; a command without any, or an older row's, has the defaults."""
    from experiments.results import same_switches, switches_of
    assert switches_of("LONGFLASH_WS=fwd LONGFLASH_TMA=0 python3 -m x --a=b") == [
        "LONGFLASH_WS=fwd", "LONGFLASH_TMA=0"]
    assert switches_of("python3 -m x LONGFLASH_WS=fwd") == [] == switches_of(float("nan"))
    assert switches_of("LONGFLASH_WS=0 LONGFLASH_TMA=1 python3 -m x") == []  # the defaults
    df = pd.DataFrame(dict(command=["python3 -m x", "LONGFLASH_WS=fwd python3 -m x"]))
    monkeypatch.delenv("LONGFLASH_TMA", raising=False)
    monkeypatch.delenv("LONGFLASH_WS", raising=False)
    assert same_switches(df).tolist() == [True, False]
    monkeypatch.setenv("LONGFLASH_WS", "fwd")
    assert same_switches(df).tolist() == [False, True]
    assert same_switches(df.drop(columns="command")).tolist() == [True, True]



def test_rows_measured_under_an_earlier_default_say_so(monkeypatch):
    """Once a switch's default changes (the forward's WS "0" -> "fwd" after a window's gate),
    a row measured before, whose command names no value for it, ran with the earlier default:
    switches_of names it, --resume measures it again, the notebooks say what it ran."""
    from experiments import results
    monkeypatch.setitem(results.KERNEL_SWITCHES, "LONGFLASH_WS", "fwd")
    monkeypatch.setattr(results, "EARLIER_DEFAULTS",
                        {"LONGFLASH_WS": [("0", "2026-12-01T00:00:00")]})
    before, after = "2026-11-27T10:00:00+00:00", "2026-12-02T10:00:00+00:00"
    assert results.switches_of("python3 -m x", before) == ["LONGFLASH_WS=0"]
    assert results.switches_of("python3 -m x", after) == []
    assert results.switches_of("python3 -m x") == []  # no timestamp: the command alone
    assert results.switches_of("LONGFLASH_WS=fwd python3 -m x", before) == []  # named: today's
    assert results.switches_of("LONGFLASH_WS=0 python3 -m x", after) == ["LONGFLASH_WS=0"]
    assert results.switches_of("LONGFLASH_TMA=0 python3 -m x", "2026-11-27T10:00:00") == [
        "LONGFLASH_TMA=0", "LONGFLASH_WS=0"]  # a naive time reads as UTC
    df = pd.DataFrame(dict(command=["python3 -m x"] * 2 + ["LONGFLASH_WS=fwd python3 -m x"],
                           timestamp=[before, after, before]))
    monkeypatch.delenv("LONGFLASH_TMA", raising=False)
    monkeypatch.delenv("LONGFLASH_WS", raising=False)
    assert results.same_switches(df).tolist() == [False, True, True]
    monkeypatch.setenv("LONGFLASH_WS", "0")
    assert results.same_switches(df).tolist() == [True, False, False]

def test_read_results_concatenates_with_source(tmp_path):
    write_results([make_row(128)], tmp_path / "cpu.csv")
    write_results([make_row(128, device="NVIDIA H100 80GB HBM3"), make_row(256)],
                  tmp_path / "h100.csv")
    df = read_results(str(tmp_path / "*.csv"))
    assert len(df) == 3 and sorted(df["source"]) == ["cpu.csv", "h100.csv", "h100.csv"]
    assert len(read_results([tmp_path / "cpu.csv"])) == 1
    with pytest.raises(FileNotFoundError):
        read_results(str(tmp_path / "nothing*.csv"))


# -- FLOPs -------------------------------------------------------------------------------------

def test_flops_non_causal_and_modes():
    fwd = flops(2, 1024, 512, 8, 64, causal=False, mode="fwd")
    assert fwd == 4 * 2 * 8 * 1024 * 512 * 64
    assert flops(2, 1024, 512, 8, 64, False, "bwd") == 2.5 * fwd
    assert flops(2, 1024, 512, 8, 64, False, "fwd_bwd") == 3.5 * fwd
    assert tflops(2e12, 1000.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="mode 'backward'"):
        flops(1, 1, 1, 1, 1, False, "backward")


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (1, 7), (7, 1), (17, 5), (5, 17),
                                                (13, 13), (97, 113), (113, 97), (203, 1025)])
def test_causal_pairs_match_the_mask(seqlen_q, seqlen_k):
    # Bottom-right alignment: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.int64).tril(diagonal=seqlen_k - seqlen_q)
    visible = int(mask.sum())
    assert causal_pairs(seqlen_q, seqlen_k) == visible
    causal = flops(3, seqlen_q, seqlen_k, 2, 40, causal=True, mode="fwd")
    if seqlen_q == seqlen_k:
        # The papers' convention: exactly half; the mask has the diagonal on top of that.
        assert causal == flops(3, seqlen_q, seqlen_k, 2, 40, causal=False, mode="fwd") / 2
        assert visible == seqlen_q * seqlen_q / 2 + seqlen_q / 2
    else:
        assert causal == 4 * 3 * 2 * 40 * visible


# -- measuring ---------------------------------------------------------------------------------

def test_time_ms_cpu_sleep():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.002)

    median, p20, p80 = time_ms(fn, "cpu", warmup=5, rep=30)
    assert 2.0 <= median < 50.0
    assert p20 <= median <= p80
    assert len(calls) >= 1 + 5


def test_time_ms_interleaved_calls_in_turn():
    order = []

    def sleeper(name, seconds):
        def fn():
            order.append(name)
            time.sleep(seconds)
        return fn

    fast, slow = time_ms_interleaved([sleeper("a", 0.001), sleeper("b", 0.004)], "cpu",
                                     warmup=2, rep=20)
    assert 1.0 <= fast[0] < slow[0] and 4.0 <= slow[0] < 50.0
    assert all(p20 <= median <= p80 for median, p20, p80 in (fast, slow))
    timed = order[order.index("b") + 1:]  # after the warm-up of both
    assert timed[::2] == ["a"] * len(timed[::2]) and timed[1::2] == ["b"] * len(timed[1::2])
    assert len(timed) >= 10


def test_is_oom():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert is_oom(MemoryError())
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("causal must be a bool"))


PEAK_SCRIPT = """
import json, torch
from experiments.measure import is_oom, peak_memory_mb
out = {}
out["big"] = peak_memory_mb(lambda: torch.empty(200 * 2**20, dtype=torch.uint8).fill_(1), "cpu")
out["noop"] = peak_memory_mb(lambda: None, "cpu")
out["within_budget"] = peak_memory_mb(lambda: torch.ones(100 * 2**20, dtype=torch.uint8), "cpu",
                                      limit_mb=300)
big = lambda: torch.ones(400 * 2**20, dtype=torch.uint8)  # fits the machine, not the budget
def onednn():  # how oneDNN reports a failed allocation (and any other failure)
    raise RuntimeError("could not create a primitive")
for name, fn, limit in [("error", lambda: 1 / 0, None),
                        ("oom", lambda: torch.empty(2**62, dtype=torch.uint8), None),
                        ("over_budget", big, 300), ("onednn_over_budget", onednn, 300),
                        ("onednn_error", onednn, None)]:
    try:
        peak_memory_mb(fn, "cpu", limit_mb=limit)
    except RuntimeError as e:
        out[name] = [str(e), is_oom(e)]
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork + /proc: Linux only")
def test_peak_memory_mb_cpu_in_fresh_process():
    # A fresh interpreter, so that what this test process has allocated before cannot matter.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO, os.path.join(REPO, "kernels"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(out)
    assert 180 <= out["big"] <= 260  # 200 MiB, touched
    assert 0 <= out["noop"] < 20
    message, oom = out["error"]
    assert "ZeroDivisionError" in message and not oom
    message, oom = out["oom"]
    assert oom, message
    assert 90 <= out["within_budget"] <= 140
    message, oom = out["over_budget"]
    assert oom, message
    message, oom = out["onednn_over_budget"]  # under the budget: its failed allocation
    assert oom and "could not create a primitive" in message, message
    message, oom = out["onednn_error"]  # without a budget: an error like any other
    assert not oom, message


def test_extra_key_columns(tmp_path):
    """Rows that differ only in an experiment's own key column are different measurements."""
    path = tmp_path / "r.csv"
    row = make_row()
    rows = [dict(row, sram=1024), dict(row, sram=2048, value=2.0)]
    assert len(write_results(rows, path, key_columns=("sram",))) == 2
    df = write_results([dict(row, sram=2048, value=3.0)], path, key_columns=("sram",))
    assert sorted(df["value"]) == [1.0, 3.0]
    with pytest.raises(ValueError, match="duplicate key"):
        write_results(rows, path)  # without the extra key the two rows collide


def test_extra_key_column_added_later(tmp_path):
    """A file written before an experiment had its extra key column: its old rows read the
    column as empty, stay, and new rows that set it are told apart by it."""
    path = tmp_path / "r.csv"
    row = make_row()
    write_results([row], path)
    df = write_results([dict(row, num_splits=0, value=2.0), dict(row, num_splits=1, value=3.0)],
                       path, key_columns=("num_splits",))
    assert sorted(df["value"]) == [1.0, 2.0, 3.0]
    df = write_results([dict(row, num_splits=1, value=4.0)], path, key_columns=("num_splits",))
    assert sorted(df["value"]) == [1.0, 2.0, 4.0]
    assert df["num_splits"].isna().sum() == 1


def test_start_run_appends_the_log_and_keeps_every_runs_config(tmp_path):
    """A second run into the same results file (another part, a later GPU stage) keeps the
    first one's log and resolved config."""
    from experiments.results import Log, earlier_runs, start_run
    out = str(tmp_path / "rq" / "dev.csv")
    for part in ("a", "b", "c"):
        start_run("rq", out, Log(), dict(part=part), f"header {part}")
    log = (tmp_path / "rq" / "dev.log").read_text()
    assert [ln for ln in log.splitlines() if ln.startswith("header")] == \
        ["header a", "header b", "header c"]
    config = json.loads((tmp_path / "rq" / "dev.json").read_text())
    assert config["part"] == "c" and "command" in config and "started" in config
    assert [r["part"] for r in config["earlier_runs"]] == ["a", "b"]
    assert [r["part"] for r in earlier_runs(str(tmp_path / "rq" / "dev.json"))] == \
        ["a", "b", "c"]
    (tmp_path / "broken.json").write_text("{not json")
    assert earlier_runs(str(tmp_path / "broken.json"))[0]["text"] == "{not json"


def test_superseded_rows_are_the_old_backward_tiles_on_hopper():
    """results.superseded: LongFlash's bwd/fwd_bwd rows at d128/d256 measured on a Hopper GPU
    before TILES_CHANGED, and nothing else (forward, other head dims, other devices, later)."""
    from experiments.results import TILES_CHANGED, superseded
    before, after = "2026-11-25T15:48:34+00:00", "2026-11-27T02:24:10+00:00"
    assert before < TILES_CHANGED < after
    base = dict(experiment="speedup", provider="longflash", mode="bwd", headdim=128,
                device="NVIDIA H100 80GB HBM3", timestamp=before)
    rows = [base, dict(base, mode="fwd_bwd", headdim=256), dict(base, device="NVIDIA H200"),
            dict(base, mode="fwd"), dict(base, headdim=64), dict(base, provider="sdpa_flash"),
            dict(base, device="NVIDIA A100-SXM4-80GB"), dict(base, device="AMD EPYC 7B13"),
            dict(base, timestamp=after), dict(base, experiment="scaling")]
    assert superseded(pd.DataFrame(rows)).tolist() == [True] * 3 + [False] * 7
    assert not superseded(pd.DataFrame([{"experiment": "speedup"}])).any()  # columns missing
