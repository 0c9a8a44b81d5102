"""Results in the one long-format schema of ARCHITECTURE.md, with provenance, plus FLOP counts.

One row per measurement:

    experiment, provider, mode, dtype, batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
    causal, metric, value, unit, p20, p80, status          (COLUMNS)
    device, torch, triton, python, git_commit, git_dirty,
    timestamp, command                                      (PROVENANCE_COLUMNS)

    rows = [dict(experiment="speedup", provider="longflash", mode="fwd", dtype="float16",
                 batch=2, seqlen_q=1024, seqlen_k=1024, nheads=8, nheads_kv=8, headdim=64,
                 causal=True, metric="time_ms", value=0.41, unit="ms", p20=0.40, p80=0.42,
                 status="ok")]
    write_results(rows, "results/speedup/h100.csv")   # validate, merge by key, write atomically
    df = read_results("results/speedup/*.csv")

A row is identified by KEY_COLUMNS; writing a row whose key is already in the file replaces it,
so re-running a configuration never duplicates it. A failed configuration is a row with status
"oom" / "error" / "unsupported" and value NaN, not a missing row.
"""

import datetime
import glob
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile

import numpy as np
import pandas as pd

COLUMNS = ["experiment", "provider", "mode", "dtype", "batch", "seqlen_q", "seqlen_k", "nheads",
           "nheads_kv", "headdim", "causal", "metric", "value", "unit", "p20", "p80", "status"]
PROVENANCE_COLUMNS = ["device", "torch", "triton", "python", "git_commit", "git_dirty",
                      "git_dirty_files", "timestamp", "command"]
# Rows with equal keys are the same measurement (on the same device); the rest is its outcome.
KEY_COLUMNS = [c for c in COLUMNS
               if c not in ("value", "unit", "p20", "p80", "status")] + ["device"]

PROVIDERS = ["longflash", "standard", "sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn",
             "flex", "sdpa_cpu",
             "ceiling"]  # the machine's ceilings measured in the same run (a matmul, a copy)
MODES = ["fwd", "bwd", "fwd_bwd", "train_step", "train"]  # train*: a whole model (RQ4)
STATUSES = ["ok", "oom", "error", "unsupported"]
# Metrics are open: experiments document their own names in their docstring.
STANDARD_METRICS = ["time_ms", "tflops", "peak_mem_mb"]

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where experiments write and notebooks read: results/ of this tree, or $LONGFLASH_RESULTS (a
# scratch copy, for tests and dry runs).
RESULTS_DIR = os.environ.get("LONGFLASH_RESULTS") or os.path.join(_REPO, "results")


# -- provenance --------------------------------------------------------------------------------

# Tests and emulations can name the device their rows are attributed to (for example a second
# CPU model); real runs never set it.
DEVICE_ENV = "LONGFLASH_DEVICE_NAME"
DRY_RUN_PREFIX = "dry run"  # rows of a dry run (a GPU campaign rehearsed on a CPU) start so


def _on_gpu():
    """Whether this process can measure on a CUDA device. Only a process that imported torch
    can: the notebooks read results without it (importing it took 1.5 s a notebook), so this
    module imports torch only where it writes provenance."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def usable_cores():
    """CPUs this process may run on (its affinity on Linux; the machine's count elsewhere,
    where os.sched_getaffinity does not exist: macOS, Windows)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_average():
    """os.getloadavg(), or three NaNs where the system has none (Windows)."""
    return os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3


def cpu_name():
    """The CPU model ("AMD EPYC 7B13"); $LONGFLASH_DEVICE_NAME overrides it on a machine
    without a GPU."""
    if os.environ.get(DEVICE_ENV) and not _on_gpu():
        return os.environ[DEVICE_ENV]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name():
    """The device rows are measured on: the CUDA device's name if there is one, else the CPU
    model ("NVIDIA H100 80GB HBM3", "AMD EPYC 7B13"); $LONGFLASH_DEVICE_NAME overrides."""
    if os.environ.get(DEVICE_ENV):
        return os.environ[DEVICE_ENV]
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_name()


def device_tag(name=None):
    """The results file stem of one machine, from its device name (default device_name()):
    a GPU is its model in lower case ("NVIDIA H100 80GB HBM3" -> "h100", a PCIe card
    "h100-pcie"); a CPU is "cpu-" and its model ("AMD EPYC 7B13" -> "cpu-amd-epyc-7b13");
    a dry run is "dryrun". Each machine writes its own file, so a rerun on another machine
    never mixes its rows into the committed ones (results/README.md)."""
    name = device_name() if name is None else name
    if name.lower().startswith(DRY_RUN_PREFIX):
        return "dryrun"
    if name.startswith("NVIDIA") or (_on_gpu() and name == device_name()):
        match = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", name)
        tag = match.group(1).lower() if match else _slug(name)
        return tag + ("-pcie" if "pcie" in name.lower() else "")
    return "cpu-" + _slug(re.sub(r"\((R|TM|tm|r)\)|\bCPU\b|@", " ", name))


def _slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def device_class(tag):
    """What a results file is compared within: "cpu" for every CPU model, the GPU's tag
    ("h100") for a GPU, None for a dry run (never read by the notebooks)."""
    if tag == "dryrun":
        return None
    return "cpu" if tag.startswith("cpu") else tag


class Log:
    """log(message) prints it and, once log.path is set, appends it to that file (the raw log
    beside a results CSV). Forked processes inherit the path."""

    def __init__(self, path=None):
        self.path = path

    def __call__(self, message):
        print(message, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(message + "\n")


# The kernels' switches (longflash.flash_triton) and their defaults: a run with one set
# otherwise may time other candidates (LONGFLASH_TMA=0 after a failed preflight, LONGFLASH_WS=fwd),
# so its rows' command names it, and --resume measures again a row measured under other ones.
KERNEL_SWITCHES = {"LONGFLASH_TMA": "1", "LONGFLASH_WS": "0"}  # flash_triton's (WS_DEFAULT)


def kernel_switches():
    """The kernels' switches this process's environment sets to other than their defaults,
    as NAME=value words."""
    return [f"{name}={shlex.quote(os.environ[name].strip())}"
            for name, default in KERNEL_SWITCHES.items()
            if os.environ.get(name, default).strip() not in ("", default)]


# A switch's earlier defaults, {name: [(value, until), ...]} (until: an ISO time, UTC): a row
# measured before `until` whose command names no value for the switch ran with `value`.
# Empty until a default changes (experiments/GPU.md: LONGFLASH_WS "0" -> "fwd" once a window's
# gate passes: then {"LONGFLASH_WS": [("0", <the change's time>)]}), so that the rows measured
# before keep saying what they ran (switches_of) and --resume measures them again.
EARLIER_DEFAULTS = {}


def _named_switches(command):
    """{name: value} of the kernels' switches a command's leading NAME=value words set."""
    named = {}
    for word in str(command).split():
        name, _, value = word.partition("=")
        if name not in KERNEL_SWITCHES:
            break
        named[name] = value
    return named


def switches_of(command, timestamp=None):
    """The kernels' switches a row ran with, other than today's defaults (KERNEL_SWITCHES: a
    default may become what a switch turned on before, and the rows measured with it are then
    the default's), as NAME=value words: those its command's leading words set, and, for a row
    measured at `timestamp` while a switch it does not name had another default
    (EARLIER_DEFAULTS), that default."""
    named = _named_switches(command)
    if timestamp is not None and not pd.isna(timestamp):
        when = pd.Timestamp(timestamp)
        when = when.tz_localize("UTC") if when.tzinfo is None else when
        for name, history in EARLIER_DEFAULTS.items():
            for value, until in sorted(history, key=lambda h: h[1]):
                if name not in named and when < pd.Timestamp(until, tz="UTC"):
                    named[name] = value
    return [f"{name}={value}" for name, value in named.items()
            if value != KERNEL_SWITCHES[name]]


def same_switches(df):
    """Boolean mask of df's rows measured under this process's kernel switches (--resume:
    the others timed other candidates)."""
    if "command" not in df:
        return pd.Series(True, index=df.index)
    now = kernel_switches()
    stamps = df["timestamp"] if "timestamp" in df else pd.Series(None, index=df.index)
    return pd.Series([switches_of(c, t) == now for c, t in zip(df["command"], stamps)],
                     index=df.index, dtype=bool)


def this_command():
    """This process's command line, after the kernels' switches set in its environment
    ("LONGFLASH_WS=fwd python3 -m experiments.speedup ...")."""
    # orig_argv keeps "python3 -m experiments.speedup ..."; argv would show the file path.
    return " ".join(kernel_switches() + [shlex.join(getattr(sys, "orig_argv", sys.argv))])


def default_out(rq):
    """results/<rq>/<device_tag()>.csv (under RESULTS_DIR): where experiment `rq` writes on
    this machine."""
    return os.path.join(RESULTS_DIR, rq, f"{device_tag()}.csv")


def start_run(rq, out, log, config, header):
    """Open one run of experiment `rq`: the results CSV `out` (default
    results/<rq>/<device>.csv), with the raw log (<stem>.log, appended) and the resolved
    config (<stem>.json, written atomically) beside it. Sets log.path, logs a header line with
    the time and the command, then `header`. Returns (out, command).

    <stem>.json holds this run's config at its top level and every earlier run's, oldest
    first, under "earlier_runs" (`earlier_runs`): a second run into the same file (another
    part, a later GPU stage, a rerun) keeps what the first one recorded, as the log does."""
    out = out or default_out(rq)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stem = os.path.splitext(out)[0]
    log.path = stem + ".log"
    command = this_command()
    started = datetime.datetime.now().isoformat(timespec='seconds')
    earlier = earlier_runs(stem + ".json")

    def write_config(tmp):
        with open(tmp, "w") as f:
            json.dump(dict(config, command=command, started=started,
                           **({"earlier_runs": earlier} if earlier else {})), f, indent=1,
                      default=str)
    atomic_write(stem + ".json", write_config)
    log(f"== {started} {command}\n{header}")
    return out, command


def earlier_runs(path):
    """The runs recorded in the config JSON at `path` (see start_run), oldest first: its
    "earlier_runs" and then its top level; [] if there is no file. A file that is not such a
    JSON is kept whole as one run ({"unreadable": its text})."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            last = json.load(f)
    except (OSError, ValueError) as exc:
        try:
            with open(path, errors="replace") as f:
                return [{"unreadable": f"{type(exc).__name__}: {exc}", "text": f.read()}]
        except OSError:
            return []
    if not isinstance(last, dict):
        return [{"unreadable": "not a JSON object", "text": last}]
    earlier = last.pop("earlier_runs", [])
    return (earlier if isinstance(earlier, list) else [earlier]) + [last]


def _git(*args):
    """stdout of `git <args>` in the repository holding this file; None if git fails."""
    try:
        out = subprocess.run(["git", *args], cwd=_REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


# The code whose changes a result depends on. Everything else in the tree is either an output
# of the experiments (results/, figures/, paper/generated/, the README's generated table,
# executed notebooks) or never runs in an experiment (tests, paper text), so it is no dirt.
CODE_PATHS = ("kernels", "experiments", "pyproject.toml", "Makefile", "environment.yml")


def dirty_code_files():
    """Files under CODE_PATHS that differ from the commit (modified, staged or untracked),
    sorted; None if git fails."""
    status = _git("status", "--porcelain", "--untracked-files=all", "--", *CODE_PATHS)
    if status is None:
        return None
    return sorted(line[3:].split(" -> ")[-1] for line in status.splitlines() if line.strip())


# Where git cannot say (a copy of the working tree without .git, as on the GPU machines), the
# commit that was sent and whether its code differed from it come from these variables, set by
# whoever starts the run (experiments/GPU.md; `experiments.gpu_campaign --print-command`).
GIT_COMMIT_ENV = "LONGFLASH_GIT_COMMIT"
GIT_DIRTY_ENV = "LONGFLASH_GIT_DIRTY"
_warned_unknown = []  # once per process


def git_state():
    """(git_commit, git_dirty, git_dirty_files, source) of the code that runs: from git when it
    answers (source "git"), else from $LONGFLASH_GIT_COMMIT and $LONGFLASH_GIT_DIRTY ("True" or
    "False"; source "environment", git_dirty_files empty), else "unknown" (source "unknown")."""
    commit = _git("rev-parse", "HEAD")
    if commit and commit.strip():
        dirty = dirty_code_files()
        return (commit.strip(), bool(dirty) if dirty is not None else "unknown",
                ";".join(dirty or []), "git")
    env_commit = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if env_commit:
        flag = os.environ.get(GIT_DIRTY_ENV, "").strip().lower()
        dirty = {"true": True, "1": True, "yes": True,
                 "false": False, "0": False, "no": False}.get(flag, "unknown")
        return env_commit, dirty, "", "environment"
    return "unknown", "unknown", "", "unknown"


def warn_unknown_commit(print_=None):
    """Say loudly (stderr, or print_) that rows will carry git_commit "unknown", and how to
    avoid it. Once per process unless print_ is given."""
    message = (f"WARNING: provenance: git_commit 'unknown': no git repository at {_REPO} and "
               f"${GIT_COMMIT_ENV} is not set; set {GIT_COMMIT_ENV}=<sha of the commit sent> "
               f"{GIT_DIRTY_ENV}=<True|False> before the command (experiments/GPU.md)")
    if print_ is not None:
        print_(message)
    elif not _warned_unknown:
        _warned_unknown.append(True)
        print(message, file=sys.stderr, flush=True)
    return message


def provenance(command=None):
    """Where and how a result was produced: a dict with one entry per PROVENANCE_COLUMNS.

    device: device_name(). An experiment that measures on the CPU of a GPU machine puts its
    own `device` in the rows (it is kept).
    git_commit, git_dirty: from git, or where git cannot answer (a copy of the tree without
    .git) from $LONGFLASH_GIT_COMMIT / $LONGFLASH_GIT_DIRTY (git_state); "unknown" if neither,
    with a warning on stderr. git_dirty: True if the code that ran (CODE_PATHS) differs from
    git_commit; git_dirty_files names those files (";"-separated, empty when clean or when the
    environment gave git_dirty). Outputs of the experiments and notebooks never count.
    command: default the command line of this process.
    """
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # not installed, or broken on this platform
        triton_version = "none"
    commit, dirty, dirty_files, source = git_state()
    if source == "unknown":
        warn_unknown_commit()
    if command is None:
        command = this_command()
    return {
        "device": device_name(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "git_dirty_files": dirty_files,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
    }


# -- writing and reading -----------------------------------------------------------------------

def _key_str(x):
    """One cell of a key as a string that survives a CSV round trip (64, 64.0 and "64" agree)."""
    if x is None or (isinstance(x, (float, np.floating)) and math.isnan(x)):
        return ""
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (float, np.floating)) and float(x).is_integer():
        return str(int(x))
    return str(x)


def _keys(df, key_columns=()):
    """(rows,) Series of strings, one per row, joining its KEY_COLUMNS (and extra keys)."""
    cols = [df[c].map(_key_str) for c in KEY_COLUMNS + list(key_columns)]
    return cols[0].str.cat(cols[1:], sep="\x1f")


def _validate(df):
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"rows are missing measurement columns {missing}; expected {COLUMNS}")
    for col, accepted in (("provider", PROVIDERS), ("mode", MODES), ("status", STATUSES)):
        bad = sorted(set(df[col].astype(str)) - set(accepted))
        if bad:
            raise ValueError(f"{col} {bad[0]!r} is not one of {accepted}")
    value = pd.to_numeric(df["value"], errors="coerce").to_numpy(dtype=float)
    bad = (df["status"] == "ok").to_numpy() & ~np.isfinite(value)
    if bad.any():
        row = df[bad].iloc[0]
        raise ValueError(f"a row with status 'ok' needs a finite value, got {row['value']!r} "
                         f"for {row[[c for c in KEY_COLUMNS if c in df.columns]].to_dict()}")


def write_results(rows, path, command=None, key_columns=()):
    """Validate rows, merge them into the CSV at path by key, and write it atomically.

    rows: a list of dicts or a DataFrame with at least COLUMNS. Provenance columns missing
    from the rows (or empty in some) are filled with `provenance(command)`.
    key_columns: extra columns that also identify a measurement in this experiment (for
    example the modelled memory size), documented by the experiment.
    Rows whose keys match a row already in the file replace it; the others are kept.
    Raises ValueError, before the file is touched, for missing columns, a provider / mode /
    status outside the vocabulary, a non-finite value with status "ok", or duplicate keys.
    Returns the whole merged table, columns ordered COLUMNS + PROVENANCE_COLUMNS + extras.
    """
    df = pd.DataFrame(rows, copy=True).reset_index(drop=True)  # never modify the caller's frame
    if df.empty:
        raise ValueError(f"no rows to write to {path}")
    _validate(df)
    # torch.float16 -> "float16", so a dtype object and its name make the same key.
    torch = sys.modules.get("torch")  # None: the rows hold no torch dtype (not imported)
    df["dtype"] = df["dtype"].map(lambda d: str(d).removeprefix("torch.")
                                  if torch is not None and isinstance(d, torch.dtype) else d)
    if any(c not in df.columns or df[c].isna().any() for c in PROVENANCE_COLUMNS):
        prov = provenance(command)
        for c in PROVENANCE_COLUMNS:
            if c not in df.columns:
                df[c] = prov[c]
            else:
                df[c] = df[c].astype(object).where(df[c].notna(), prov[c])

    missing = [c for c in key_columns if c not in df.columns]
    if missing:
        raise ValueError(f"rows are missing the key columns {missing}")
    keys = _keys(df, key_columns)
    dup = keys[keys.duplicated()]
    if len(dup):
        first = df.loc[dup.index[0], KEY_COLUMNS + list(key_columns)].to_dict()
        raise ValueError(f"duplicate key in the new rows: {first}")
    merged = df
    if os.path.exists(path):
        old = pd.read_csv(path)
        missing = [c for c in KEY_COLUMNS if c not in old.columns]
        if missing:
            raise ValueError(f"{path} lacks key columns {missing}; not a results file?")
        for c in key_columns:  # an extra key that an experiment added later: empty in old rows
            if c not in old.columns:
                old[c] = math.nan
        kept = old[~_keys(old, key_columns).isin(set(keys))]
        if len(kept):
            merged = pd.concat([kept, df], ignore_index=True)
    extras = sorted(set(merged.columns) - set(COLUMNS) - set(PROVENANCE_COLUMNS))
    merged = merged[COLUMNS + PROVENANCE_COLUMNS + extras]

    atomic_write(path, lambda tmp: merged.to_csv(tmp, index=False))
    return merged


def atomic_write(path, write):
    """Create path through write(tmp_path), atomically: a reader (or a crash) sees the old
    file or the new one, never half of one. The temp file sits in the same directory, so
    os.replace is a rename; it keeps path's extension, for writers that go by it."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                               suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are shared files
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_results(paths):
    """Concatenate results CSVs: one path, a glob pattern, or a list of either.

    Adds a `source` column with each row's file name (for example "h100.csv").
    Raises FileNotFoundError if a pattern matches nothing.
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for p in map(os.fspath, paths):
        if any(ch in p for ch in "*?["):
            matched = sorted(glob.glob(p))
            if not matched:
                raise FileNotFoundError(f"no results file matches {p!r}")
            files += matched
        else:
            files.append(p)
    return pd.concat([pd.read_csv(f).assign(source=os.path.basename(f)) for f in files],
                     ignore_index=True)


# -- Rows of kernels no longer in the package -------------------------------------------------

def measured_before(df, when):
    """Boolean mask of df's rows whose timestamp precedes the ISO time `when` (UTC): rows that
    a kernel changed since has made stale (--resume-after, superseded)."""
    return (pd.to_datetime(df["timestamp"], utc=True, format="ISO8601")
            < pd.Timestamp(when, tz="UTC"))


def check_resume_after(parser, args):
    """--resume-after's rules (speedup, tuning): it needs --resume and an ISO time; otherwise a
    usage error before any work."""
    if args.resume_after is None:
        return
    if not args.resume:
        parser.error("--resume-after needs --resume")
    try:
        datetime.datetime.fromisoformat(args.resume_after)
    except ValueError:
        parser.error(f"--resume-after: not an ISO time: {args.resume_after!r}")


# When flash_triton.CONFIGS's backward tiles for Hopper (sm_90) last changed: the second H100
# window's sweep found faster ones at head dims 128 and 256 (experiments/PERFLOG.md, "Backward
# tiles from the H100's sweep"). LongFlash's backward and forward+backward rows of those head
# dims measured on a Hopper GPU before then time tiles the package no longer has: the campaign
# measures them again (speedup --resume-after) and the notebooks leave the rest out.
TILES_CHANGED = "2026-11-26T17:00:00"
# RQ1's part decode gained a variant over a float8 cache (6e7bde0), which the notebook
# compares with the 16-bit cache only within one run: the campaign measures the whole part
# again from this time (speedup --resume-after), every provider in one run.
DECODE_FP8_ADDED = "2026-11-27T17:30:17"
HOPPER = r"H100|H200|H800|H20\b|GH200"  # device names of sm_90 GPUs


def superseded(df):
    """Boolean mask of df's rows that measured a kernel the package has replaced since (the
    backward tiles of TILES_CHANGED), so a figure or a claim does not mix old and current code."""
    for column in ("experiment", "provider", "mode", "headdim", "device", "timestamp"):
        if column not in df:
            return pd.Series(False, index=df.index)
    return ((df["experiment"] == "speedup") & (df["provider"] == "longflash")
            & df["mode"].isin(["bwd", "fwd_bwd"]) & df["headdim"].isin([128, 256])
            & df["device"].astype(str).str.contains(HOPPER)
            & measured_before(df, TILES_CHANGED))


# -- FLOPs -------------------------------------------------------------------------------------

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}  # backward = 2.5x forward


def causal_pairs(seqlen_q, seqlen_k):
    """Number of (query, key) pairs visible under the bottom-right-aligned causal mask.

    Query i sees key j iff j <= i + seqlen_k - seqlen_q (1 = visible):

        seqlen_q=2, seqlen_k=5:   seqlen_q=5, seqlen_k=2:
            1 1 1 1 0                 0 0
            1 1 1 1 1                 0 0
                                      0 0
                                      1 0
                                      1 1

    Row counts are consecutive integers ending at seqlen_k (the last row sees every key), so
    the total is 1 + ... + seqlen_k minus the rows cut off above: 1 + ... + (seqlen_k - seqlen_q).
    """
    cut = max(seqlen_k - seqlen_q, 0)
    return seqlen_k * (seqlen_k + 1) // 2 - cut * (cut + 1) // 2


def flops(batch, seqlen_q, seqlen_k, nheads, headdim, causal, mode):
    """FLOPs of attention, FlashAttention convention: forward 4 * B * H * Nq * Nk * D (QK^T and
    PV, 2 FLOPs per multiply-add), backward 2.5x forward, fwd_bwd 3.5x forward.

    causal: halved when seqlen_q == seqlen_k (the papers' convention, so TFLOPs compare with
    theirs); otherwise the visible pairs are counted exactly (`causal_pairs`). nheads counts
    query heads (with GQA the work scales with them, not with nheads_kv).
    """
    if mode not in MODE_FLOP_FACTOR:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    if not causal:
        pairs = seqlen_q * seqlen_k
    elif seqlen_q == seqlen_k:
        pairs = seqlen_q * seqlen_k / 2
    else:
        pairs = causal_pairs(seqlen_q, seqlen_k)
    return 4.0 * batch * nheads * headdim * pairs * MODE_FLOP_FACTOR[mode]


def tflops(flop_count, time_ms):
    """Throughput in TFLOP/s (1e12 FLOP per second) of flop_count FLOPs done in time_ms ms."""
    return flop_count / (time_ms * 1e-3) / 1e12
