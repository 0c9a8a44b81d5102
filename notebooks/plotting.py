"""What every notebook shares: which results it draws, where figures and paper macros go,
one figure style, saving figures, and writing the paper's generated numbers.

    from plotting import DEVICE, load, save_figure, write_macros
    df = load("speedup")            # the rows of one machine: the selected run of DEVICE
    fig, ax = plt.subplots(); ...; save_figure(fig, "speedup_tflops")
    write_macros("speedup", {"SpeedupOverStandard": r"8.1\\times"}, source="notebooks/speedup.ipynb")

Notebooks never run experiments: they read results/ and write figures/ and paper/generated/.

Devices. Every machine writes its own results file (results/<rq>/<device tag>.csv, see
experiments.results.device_tag), and a notebook draws one machine at a time, so no figure
or macro ever mixes two machines. Files fall into device classes: "cpu" (every CPU model)
and one per GPU model ("h100", "h200"). `make figures` runs each per-device notebook once per
class present (notebooks/run_notebooks.py sets $LONGFLASH_DEVICE_CLASS); within a class it
draws the most recent run (the file with the newest timestamp), unless $LONGFLASH_DEVICES
names the files to use ("cpu-amd-epyc,h100"). The CPU class keeps the plain names
(figures/scaling_weak.pdf, paper/generated/scaling.tex, \\RingCpu); another class adds its
tag to figure names (scaling_weak_h100.pdf) and a prefix to macro names (\\HOneZeroZeroRingCpu,
in paper/generated/scaling_h100.tex). $LONGFLASH_RESULTS, $LONGFLASH_FIGURES and
$LONGFLASH_GENERATED move the three folders (tests run the notebooks on scratch copies).
"""

import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")  # headless: notebooks run under nbclient in `make figures`

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # notebooks run from notebooks/; the shared writer lives in experiments/
from experiments.results import (atomic_write, device_class, device_tag, read_results,  # noqa: E402
                                 superseded)
RESULTS = os.environ.get("LONGFLASH_RESULTS") or os.path.join(ROOT, "results")
FIGURES = os.environ.get("LONGFLASH_FIGURES") or os.path.join(ROOT, "figures")
GENERATED = os.environ.get("LONGFLASH_GENERATED") or os.path.join(ROOT, "paper", "generated")
DEVICE = os.environ.get("LONGFLASH_DEVICE_CLASS") or "cpu"  # the class this execution draws

plt.rcParams.update({
    "figure.figsize": (5.5, 3.4), "figure.dpi": 120, "savefig.bbox": "tight",
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
    "font.size": 9, "legend.fontsize": 8, "legend.frameon": False,
})


class NotApplicable(Exception):
    """Raised by a notebook whose analysis the selected results cannot support (a GPU run that
    lacks a part, say); run_notebooks.py reports it as a skipped device, not a failure."""


def require(df, column, values):
    """NotApplicable unless every value occurs in df[column]: a notebook's first check that the
    selected run has every part its figures and macros draw."""
    missing = [v for v in values if v not in set(df[column])]
    if missing:
        raise NotApplicable(f"{sorted(set(df['source']))} lacks {column} {missing}")


def select_runs(rq, results=None):
    """{device class: results file} of experiment rq: per class the file whose newest row is the
    most recent, or the file $LONGFLASH_DEVICES names. Dry-run files are never selected."""
    folder = os.path.join(results or RESULTS, rq)
    chosen = [s.strip() for s in os.environ.get("LONGFLASH_DEVICES", "").split(",") if s.strip()]
    newest = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        stem, ext = os.path.splitext(name)
        cls = device_class(stem)
        if ext != ".csv" or cls is None:
            continue
        path = os.path.join(folder, name)
        when = str(pd.read_csv(path, usecols=["timestamp"])["timestamp"].max())
        rank = (stem in chosen, when, stem)  # a named file first, then the latest run
        if cls not in newest or rank > newest[cls][0]:
            newest[cls] = (rank, path)
    return {cls: path for cls, (_, path) in sorted(newest.items(), key=lambda kv: kv[0] != "cpu")}


def device_classes(rq):
    """The device classes with results for rq, the CPU first."""
    return list(select_runs(rq))


def load(rq, device=None):
    """The rows of one machine for experiment rq: the selected results file of device class
    `device` (default DEVICE), with a `source` column naming the file, less the rows that
    measured a kernel since replaced (experiments.results.superseded). NotApplicable if there
    is none. The schema is in experiments/results.py."""
    device = device or DEVICE
    runs = select_runs(rq)
    if device not in runs:
        raise NotApplicable(f"no results/{rq}/ file of device class {device!r} "
                            f"(found {sorted(runs) or 'none'})")
    print(f"{rq}: drawing {os.path.relpath(runs[device], ROOT)} (device class {device}; "
          f"other classes: {sorted(set(runs) - {device}) or 'none'})")
    df = read_results(runs[device])
    old = superseded(df)
    if old.any():  # measured a kernel the package has replaced since: not drawn, not claimed
        print(f"left out: {int(old.sum())} rows that time replaced kernels "
              f"(experiments.results.superseded)")
    return df[~old].reset_index(drop=True)


def results_file(rq, device=None):
    """The results file that load(rq, device) reads, relative to the repository."""
    return os.path.relpath(select_runs(rq)[device or DEVICE], ROOT)


def save_figure(fig, name, device_in_name=False):
    """figures/<name>.pdf for the paper and figures/<name>.png for the README. For a device
    class other than the CPU the class is appended (<name>_h100), unless the notebook put
    the device in the name itself (device_in_name=True)."""
    if DEVICE != "cpu" and not device_in_name:
        name = f"{name}_{DEVICE}"
    for ext in ("pdf", "png"):
        # No timestamps in the PDF, so regenerating unchanged results changes no bytes.
        atomic_write(os.path.join(FIGURES, f"{name}.{ext}"), lambda tmp: fig.savefig(
            tmp, format=ext, metadata={"CreationDate": None} if ext == "pdf" else None))
    return os.path.join(FIGURES, f"{name}.pdf")


DIGITS = "Zero One Two Three Four Five Six Seven Eight Nine".split()


def camel(text):
    """A LaTeX-safe CamelCase word: "long_context_training" -> "LongContextTraining",
    "h100" -> "HOneZeroZero" (macro names are letters only)."""
    words = re.split(r"[^A-Za-z0-9]+", text)
    name = "".join(w[:1].upper() + w[1:] for w in words)
    return "".join(DIGITS[int(c)] if c.isdigit() else c for c in name)


def latex_text(s):
    return re.sub(r"([&%$#_{}])", r"\\\1", str(s))


def write_macros(rq, values, source, device_in_names=False):
    r"""paper/generated/<rq>.tex: one \newcommand per value, so the paper never types a number.

    values: {"MacroName": "text"}; names are letters only (a LaTeX rule), and are prefixed
    with nothing: choose names that say the research question (\IoExponentN, \RingMaxRanks).
    source: the notebook that wrote them, named in the file's header.
    Two macros are added: \<Rq>ResultsFile and \<Rq>ResultsDevice (Rq = camel(rq)), the
    results file drawn and its device (the device of this class that wrote the most rows: the
    GPU, not the host CPU of a GPU run's CPU-side rows such as RQ3's gloo ranks). For a
    device class other than the CPU the file is <rq>_<class>.tex and every name gets
    camel(class) in front, unless the notebook put the device in the names itself
    (device_in_names=True).
    """
    prefix = "" if DEVICE == "cpu" else camel(DEVICE)
    values = {(name if device_in_names else prefix + name): v for name, v in values.items()}
    runs = select_runs(rq)
    if DEVICE in runs:
        path = runs[DEVICE]
        devices = pd.read_csv(path, usecols=["device"])["device"].astype(str)
        own = devices[devices.map(lambda name: device_class(device_tag(name)) == DEVICE)]
        device = (own if len(own) else devices).mode().iloc[0]
        values[f"{prefix}{camel(rq)}ResultsFile"] = latex_text(
            "/".join(("results", rq, os.path.basename(path))))
        values[f"{prefix}{camel(rq)}ResultsDevice"] = latex_text(device)
    lines = [f"% Generated by {source} from results/ (device class {DEVICE}). Do not edit: "
             f"rerun the notebook.\n"]
    for name, value in values.items():
        if not re.fullmatch(r"[A-Za-z]+", name):
            raise ValueError(f"macro name {name!r}: LaTeX macro names are letters only")
        lines.append(f"\\newcommand{{\\{name}}}{{{value}}}\n")
    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(lines)
    path = os.path.join(GENERATED, f"{rq}.tex" if DEVICE == "cpu" else f"{rq}_{DEVICE}.tex")
    atomic_write(path, write)
    return path


# -- shared by the figures that compare attention providers (RQ1) ------------------------------

PROVIDER_STYLE = {  # one color, marker and name per provider, the same in every figure
    "longflash": dict(color="C3", marker="o", label="LongFlash"),
    "standard": dict(color="0.35", marker="s", label="standard (materializing)"),
    "sdpa_math": dict(color="C7", marker="v", label="SDPA math"),
    "sdpa_flash": dict(color="C0", marker="^", label="SDPA flash (FlashAttention-2)"),
    "sdpa_efficient": dict(color="C2", marker="D", label="SDPA memory-efficient"),
    "sdpa_cudnn": dict(color="C4", marker="P", label="SDPA cuDNN"),
    "flex": dict(color="C1", marker="X", label="FlexAttention (compiled)"),
    "sdpa_cpu": dict(color="C0", marker="^", label="SDPA (PyTorch CPU kernel)"),
}


def tokens(n, other=str):
    """A sequence length as the papers write it: 512, 2K, 128K, 1M (powers of two); other
    lengths by `other` (str for tick labels; thousands for the paper's text)."""
    n = int(n)
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}K"
    return other(n)


def seqlen_axis(ax, seqlens):
    """x axis in sequence length, log base 2, one labelled tick per length measured."""
    from matplotlib.ticker import NullLocator
    seqlens = sorted(set(int(n) for n in seqlens))
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [tokens(n) for n in seqlens])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("sequence length (tokens)")


def thousands(n):
    """An integer with thousands separators that survive LaTeX: 1{,}048{,}576."""
    return latex_number(int(n), 0)


def sci(x, digits=1):
    """x in scientific notation for LaTeX math mode: 7.2\\times 10^{-9}; 0 is "0"."""
    if x == 0:
        return "0"
    e = math.floor(math.log10(abs(x)))
    mantissa = round(x / 10**e, digits)
    if abs(mantissa) >= 10:  # 9.96e-9 at one digit is 1.0e-8, not 10.0e-9
        mantissa, e = mantissa / 10, e + 1
    return rf"{mantissa:.{digits}f}\times 10^{{{e}}}"


def pct(x, digits=0):
    """A fraction as a LaTeX percentage: 0.904 -> 90\\%."""
    return f"{100 * x:.{digits}f}\\%"


def latex_number(x, digits=1):
    """x with `digits` decimals and thousands separators that survive LaTeX: 12{,}345.6."""
    return f"{x:,.{digits}f}".replace(",", "{,}")
