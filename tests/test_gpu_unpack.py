"""experiments.gpu_unpack: archives of stages run back to back (neither holding the other's rows)
merge into the repository instead of replacing each other's files."""

import json
import os
import tarfile

import pandas as pd
import pytest

from experiments import gpu_campaign, gpu_unpack
from experiments.results import COLUMNS, write_results
from conftest import needs_triton


def _row(seqlen, value, provider="longflash"):
    row = {c: None for c in COLUMNS}
    row.update(experiment="speedup", provider=provider, mode="fwd", dtype="bfloat16", batch=1,
               seqlen_q=seqlen, seqlen_k=seqlen, nheads=16, nheads_kv=16, headdim=128,
               causal=True, metric="time_ms", value=value, unit="ms", status="ok",
               device="NVIDIA H100 80GB HBM3", num_splits=float("nan"), kv_dtype=float("nan"),
               route=float("nan"), prefix_len=float("nan"),
               # the GPU run's provenance; a clean tree's git_dirty_files is empty
               torch="2.11.0", triton="3.6.0", python="3.12.3", git_commit="abc",
               git_dirty=False, git_dirty_files="", timestamp="then", command="there")
    return row


def _archive(tmp_path, name, rows, log, runs, probe):
    """A stage's archive: results/speedup/h100.{csv,log,json} and a probe's JSON."""
    tree = tmp_path / f"{name}-tree"
    res = tree / "results" / "speedup"
    res.mkdir(parents=True)
    write_results(rows, str(res / "h100.csv"), key_columns=gpu_unpack.KEY_COLUMNS["speedup"])
    (res / "h100.log").write_text(log)
    latest, earlier = runs[-1], runs[:-1]
    (res / "h100.json").write_text(json.dumps(dict(latest, earlier_runs=earlier)))
    camp = tree / "results" / "gpu_campaign"
    camp.mkdir()
    (camp / "h100-stage1-env.json").write_text(json.dumps(probe))
    path = tmp_path / f"{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree / "results", arcname="results")
    return str(path)


def test_back_to_back_stages_merge(tmp_path, monkeypatch):
    from experiments import results
    prov = results.provenance()
    root = tmp_path / "repo"
    root.mkdir()
    first = _archive(tmp_path, "a", [_row(1024, 1.0), _row(2048, 2.0)], "run A\n",
                     [{"run": "A"}], {"env": "A"})
    # The second stage was sent before the first was unpacked: none of its rows, its log or
    # its run; one row of the same key, measured again.
    second = _archive(tmp_path, "b", [_row(2048, 2.5), _row(4096, 4.0)], "run B\n",
                      [{"run": "B"}], {"env": "B"})
    # This machine's provenance must not leak into the GPU's rows (empty cells included).
    monkeypatch.setattr(results, "provenance", lambda command=None: dict(
        prov, git_dirty_files="HERE", command="HERE", timestamp="HERE"))
    for archive in (first, second):
        gpu_unpack.unpack(archive, str(root), log=lambda _: None)
    res = root / "results" / "speedup"
    df = pd.read_csv(res / "h100.csv").sort_values("seqlen_q")
    assert list(df["seqlen_q"]) == [1024, 2048, 4096]
    assert list(df["value"]) == [1.0, 2.5, 4.0]           # the later archive's row wins
    assert not (df[["git_dirty_files", "command", "timestamp"]] == "HERE").any().any()
    assert (res / "h100.log").read_text() == "run A\nrun B\n"
    runs = json.loads((res / "h100.json").read_text())
    assert runs["run"] == "B" and runs["earlier_runs"] == [{"run": "A"}]
    env = json.loads((root / "results" / "gpu_campaign" / "h100-stage1-env.json").read_text())
    assert env == {"env": "B"}                             # a probe's JSON: the latest run's


def test_speedup_parts_with_their_own_keys_merge(tmp_path):
    """Stage 8's RQ1 archive holds part decode's rows (keyed also by num_splits, kv_dtype) and
    part prefill's (kv_dtype, route: the float8 pages read in place and gathered differ only
    there), and part shared_prefix's (route and prefix_len), into a repository file that has
    none of these columns yet: every row stays (the speedup folder merged by decode's keys
    alone refused the archive: "duplicate key")."""
    def prefill(route, value):
        return dict(_row(4096, value), part="prefill", seqlen_q=512, kv_dtype="float8_e4m3fn",
                    route=route, num_splits=float("nan"))
    def decode(num_splits, value):
        return dict(_row(4096, value), part="decode", seqlen_q=1, num_splits=num_splits,
                    kv_dtype=float("nan"), route=float("nan"))
    def shared(route, prefix_len, value):
        return dict(_row(4096 + 512, value), part="shared_prefix", seqlen_q=1, route=route,
                    prefix_len=prefix_len)
    root = tmp_path / "repo"
    (root / "results" / "speedup").mkdir(parents=True)
    write_results([_row(1024, 1.0)], str(root / "results" / "speedup" / "h100.csv"))
    rows = [prefill("in_place", 0.5), prefill("gathered", 0.6), decode(0, 0.1), decode(1, 0.2),
            shared("cascade", 4096, 0.3), shared("duplicated", 4096, 0.4)]
    gpu_unpack.unpack(_archive(tmp_path, "a", rows, "run A\n", [{"run": "A"}], {}), str(root),
                      log=lambda _: None)
    df = pd.read_csv(root / "results" / "speedup" / "h100.csv")
    assert sorted(df["value"]) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 1.0]


def test_a_seeded_archive_adds_only_what_is_new(tmp_path):
    """An archive made from a tree that had the repository's files (seed_scratch) holds them
    too: unpacking it adds nothing twice."""
    root = tmp_path / "repo"
    root.mkdir()
    gpu_unpack.unpack(_archive(tmp_path, "a", [_row(1024, 1.0)], "run A\n", [{"run": "A"}],
                               {}), str(root), log=lambda _: None)
    seeded = _archive(tmp_path, "b", [_row(1024, 1.0), _row(2048, 2.0)], "run A\nrun B\n",
                      [{"run": "A"}, {"run": "B"}], {})
    gpu_unpack.unpack(seeded, str(root), log=lambda _: None)
    res = root / "results" / "speedup"
    assert len(pd.read_csv(res / "h100.csv")) == 2
    assert (res / "h100.log").read_text() == "run A\nrun B\n"
    runs = json.loads((res / "h100.json").read_text())
    assert runs["run"] == "B" and runs["earlier_runs"] == [{"run": "A"}]


def test_a_second_run_sent_before_the_first_was_unpacked_keeps_the_first_runs_rows(tmp_path):
    """The fourth window: both runs seeded from one tree (rows of 2026-11-25, log "seed"); the
    first measured 1024 again, the second 4096; the second's stale copy of 1024 must not
    replace the first's new row, nor its log repeat the seed."""
    def row(seqlen, value, when):
        return dict(_row(seqlen, value), timestamp=when)
    old, t1, t2 = ("2026-11-25T15:00:00+00:00", "2026-11-27T22:06:00+00:00",
                   "2026-11-27T22:13:00+00:00")
    root = tmp_path / "repo"
    root.mkdir()
    seed = [row(1024, 1.0, old), row(2048, 2.0, old)]
    first = _archive(tmp_path, "a", [row(1024, 0.5, t1), seed[1]], "seed\n== A\n",
                     [{"run": "A"}], {})
    second = _archive(tmp_path, "b", seed + [row(4096, 4.0, t2)], "seed\n== B\n",
                      [{"run": "B"}], {})
    for archive in (first, second):
        gpu_unpack.unpack(archive, str(root), log=lambda _: None)
    res = root / "results" / "speedup"
    df = pd.read_csv(res / "h100.csv").sort_values("seqlen_q")
    assert list(df["value"]) == [0.5, 2.0, 4.0]
    assert list(df["timestamp"]) == [t1, old, t2]
    assert (res / "h100.log").read_text() == "seed\n== A\n== B\n"


def test_an_archive_outside_results_is_refused(tmp_path):
    evil = tmp_path / "x.tar.gz"
    (tmp_path / "README.md").write_text("x")
    with tarfile.open(evil, "w:gz") as tar:
        tar.add(tmp_path / "README.md", arcname="README.md")
    with pytest.raises(ValueError, match="not results/"):
        gpu_unpack.unpack(str(evil), str(tmp_path / "repo"), log=lambda _: None)
    assert not os.path.exists(tmp_path / "repo" / "README.md")


@needs_triton
def test_every_results_folder_of_a_stage_merges_by_its_writers_keys():
    """A folder whose writer passes extra key columns merges by them (else two rows that
    differ only there would be one key twice, and the archive would not merge)."""
    import importlib
    for stage in range(1, 9):
        for step in gpu_campaign.stage_steps(stage, False):
            keys = getattr(importlib.import_module(f"experiments.{step.rq}"), "KEY_COLUMNS",
                           ()) if step.rq else ()
            if keys:
                assert gpu_unpack.KEY_COLUMNS.get(step.rq) == keys, (stage, step.name)


@needs_triton
def test_tuning_rows_merge_by_kernel_and_config(tmp_path):
    """Stage 4's rows (experiments.tuning) differ only in kernel and config for one shape:
    two archives' rows all stay, and a candidate measured again replaces its row."""
    from experiments import tuning

    def rows(configs, value):
        base = _row(1024, value)
        return [dict(base, experiment="tuning", kernel="dkdv", config=c) for c in configs]

    root = tmp_path / "repo"
    root.mkdir()
    for name, configs, value in (("a", ["16/64/8/3", "32/64/8/2/tma"], 1.0),
                                 ("b", ["32/64/8/2/tma", "64/64/8/2/tma"], 2.0)):
        tree = tmp_path / f"{name}-tree" / "results" / "tuning"
        tree.mkdir(parents=True)
        write_results(rows(configs, value), str(tree / "h100.csv"),
                      key_columns=tuning.KEY_COLUMNS)
        path = tmp_path / f"{name}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            tar.add(tree.parent, arcname="results")
        gpu_unpack.unpack(str(path), str(root), log=lambda _: None)
    df = pd.read_csv(root / "results" / "tuning" / "h100.csv").set_index("config")
    assert df["value"].to_dict() == {"16/64/8/3": 1.0, "32/64/8/2/tma": 2.0,
                                     "64/64/8/2/tma": 2.0}
