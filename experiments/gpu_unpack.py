"""Unpack GPU campaign archives into the repository without losing what is already there.

    python -m experiments.gpu_unpack stage1.tar.gz [stage2.tar.gz ...]   # at the repository root

A stage's archive holds every results file of its device as the stage's machine last saw it:
the files the repository had when the tree was sent, plus what the stage measured
(gpu_campaign.seed_scratch). Stages run back to back on one warm machine are sent before the
previous stage's archive is unpacked here, so their archives do not hold each other's rows,
and `tar xzf` of the second would replace the first one's CSVs (on the first H100 window,
stage 2's results/speedup/h100.csv held none of stage 1's 1,200 rows). This merges instead,
archive by archive in the order given:

- a results CSV: rows merged by key with experiments.results.write_results (a row of the
  archive replaces the repository's row of the same key unless that one was measured later
  or is the same measurement; the others are kept), the key columns those of the experiment
  that writes the file (KEY_COLUMNS below). A window's second run sent before its first
  run's archive was unpacked holds the older rows the first one measured again (seeded from
  the tree): on the fourth window they replaced 407 of the first run's new rows with the
  ones they superseded;
- a log (.log, .ncu.log): the archive's lines after those it shares with the start of the
  repository's file are appended (the seeded lines are the repository's older start);
- a run's config JSON (results/<rq>/<stem>.json): the archive's latest run on top, every
  earlier run of both under "earlier_runs" (results.start_run's layout), none twice;
- anything else (the probes' JSONs: -env, -preflight, -autotune-*, which describe the latest
  run of their stage): the archive's file, as tar would.

Writes each file atomically; prints one line per file. Never deletes anything.
"""

import argparse
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile

import pandas as pd

from experiments import (decode, gpu_campaign, host_time, long_context_training, mla_decode,
                         ncu, prefill, scaling, shared_prefix, variants)
from experiments.results import (PROVENANCE_COLUMNS, _keys, atomic_write, earlier_runs,
                                 write_results)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A probe's JSON (<stem>-stageN-<name>.json): the latest run of its stage only.
PROBE_JSON = re.compile(r"-stage\d+-[\w.-]+\.json$")

# Extra key columns of each results folder's CSVs (beside results.KEY_COLUMNS): those its
# writers pass to write_results (speedup: its parts decode's, prefill's, shared_prefix's and
# mla's, together: a part's rows are empty in the others'; io_complexity on the GPU: the ncu
# probe's).
KEY_COLUMNS = {"speedup": tuple(dict.fromkeys(decode.KEY_COLUMNS + prefill.KEY_COLUMNS
                                                 + shared_prefix.KEY_COLUMNS
                                                 + mla_decode.KEY_COLUMNS)),
               "io_complexity": ncu.KEY_COLUMNS,
               "scaling": scaling.KEY_COLUMNS, "gpu_campaign": gpu_campaign.KEY_COLUMNS,
               "long_context_training": long_context_training.KEY_COLUMNS,
               # tuning.KEY_COLUMNS (that module loads the Triton kernels, which this one
               # needs not: test_gpu_unpack checks they agree)
               "variants": variants.KEY_COLUMNS, "tuning": ("kernel", "config"),
               "host_time": host_time.KEY_COLUMNS}


def _later(new, old, keys):
    """Boolean mask of new's rows that no row of old with the same key postdates or equals in
    time (the same measurement: the repository's row stays where it is)."""
    def when(df):  # seconds since 1970, NaN where unparsable
        t = pd.to_datetime(df["timestamp"], utc=True, format="ISO8601", errors="coerce")
        return (t - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    for c in keys:  # an extra key that an experiment added later: empty in old rows
        if c not in old.columns:
            old[c] = float("nan")
    old_when = pd.Series(when(old).to_numpy(), index=_keys(old, keys).to_numpy())
    old_when = old_when[~old_when.index.duplicated(keep="last")]
    theirs = _keys(new, keys).map(old_when)
    return ~(theirs >= when(new)).to_numpy()  # unparsable or no such row: the archive's


def merge_csv(src, dst, keys):
    new = pd.read_csv(src)
    # Empty provenance cells (git_dirty_files of a clean tree reads back as NaN) stay empty:
    # write_results would fill them with this machine's provenance, not the GPU run's.
    for c in PROVENANCE_COLUMNS:
        if c in new.columns:
            new[c] = new[c].astype(object).where(new[c].notna(), "")
    for c in keys:  # a key the archive's rows lack (batch rows have no num_splits): empty
        if c not in new.columns:
            new[c] = float("nan")
    new = new[_later(new, pd.read_csv(dst), keys)]
    if new.empty:  # every row of the archive is the repository's or older
        return len(pd.read_csv(dst))
    return len(write_results(new, dst, key_columns=keys))


def merge_log(src, dst):
    with open(src, errors="replace") as f:
        new = f.read()
    with open(dst, errors="replace") as f:
        old = f.read()
    # The archive's log starts with the repository's (seeded) when the tree had it, or with an
    # older start of it when a run's archive was unpacked after the tree was sent: append only
    # what the stage added, the lines after those the two share (each run's first line names
    # its time, so a stage's lines start where they differ).
    new_lines, old_lines = new.splitlines(keepends=True), old.splitlines(keepends=True)
    shared = 0
    while (shared < min(len(new_lines), len(old_lines))
           and new_lines[shared] == old_lines[shared]):
        shared += 1
    add = "".join(new_lines[shared:])
    if add:
        def write(tmp):
            with open(tmp, "w") as f:
                f.write(old + add)
        atomic_write(dst, write)
    return len(add)


def merge_run_json(src, dst):
    runs = earlier_runs(dst)
    for run in earlier_runs(src):
        if run not in runs:
            runs.append(run)
    latest, earlier = runs[-1], runs[:-1]

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(dict(latest, **({"earlier_runs": earlier} if earlier else {})), f,
                      indent=1, default=str)
    atomic_write(dst, write)
    return len(runs)


def unpack(archive, root=ROOT, log=print):
    """Merge one archive's files into root (see the module docstring)."""
    with tarfile.open(archive) as tar, tempfile.TemporaryDirectory() as tmp:
        tar.extractall(tmp, filter="data")
        for dirpath, _, names in sorted(os.walk(tmp)):
            for name in sorted(names):
                src = os.path.join(dirpath, name)
                rel = os.path.relpath(src, tmp)
                parts = rel.split(os.sep)
                if parts[0] != "results" or len(parts) != 3:
                    raise ValueError(f"{archive}: {rel} is not results/<folder>/<file>")
                dst = os.path.join(root, rel)
                rq = parts[1]
                if not os.path.exists(dst):
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    atomic_write(dst, lambda t: shutil.copyfile(src, t))
                    log(f"new     {rel}")
                elif name.endswith(".csv"):
                    log(f"merged  {rel}: {merge_csv(src, dst, KEY_COLUMNS.get(rq, ()))} rows")
                elif name.endswith(".log"):
                    log(f"append  {rel}: {merge_log(src, dst)} characters")
                elif name.endswith(".json") and not PROBE_JSON.search(name):
                    log(f"runs    {rel}: {merge_run_json(src, dst)}")
                else:
                    atomic_write(dst, lambda t: shutil.copyfile(src, t))
                    log(f"replace {rel}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archives", nargs="+", help="stageN.tar.gz files, in the order run")
    parser.add_argument("--root", default=ROOT, help="the repository (default: %(default)s)")
    args = parser.parse_args(argv)
    for archive in args.archives:
        print(f"== {archive}")
        unpack(archive, args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
