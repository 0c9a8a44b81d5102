"""Execute notebooks headless, in the order given, once per device class, saving their outputs.

    python notebooks/run_notebooks.py notebooks/io_complexity.ipynb notebooks/scaling.ipynb
    python notebooks/run_notebooks.py --out-dir /tmp/nb notebooks/speedup.ipynb   # keep the repo's
    python notebooks/run_notebooks.py --device-class h200 notebooks/speedup.ipynb  # one class

Used by `make figures`. Each notebook runs with notebooks/ as its working directory, reads
results/ and writes figures/ and paper/generated/; a failing cell stops the run.

A notebook whose metadata names its results folder ({"longflash": {"results": "speedup"}})
draws one machine at a time: it runs once per device class found in results/<rq>/ (the CPU
first, then each GPU model; see notebooks/plotting.py), with $LONGFLASH_DEVICE_CLASS set.
The CPU execution is saved as the notebook itself, another class's as <name>.<class>.ipynb
beside it. A notebook that raises plotting.NotApplicable (the results of that device cannot
support its analysis) is reported as skipped for that device, not as a failure. Last,
paper/generated/devices.tex is rewritten to \\input every per-device macro file present, so
the paper sees GPU numbers the moment their notebooks have run, and not_measured.tex defines
"not measured" for any macro the paper uses that no results provided (a QUICK=1 run).

Without Jupyter (nbclient and nbformat missing, as on the GPU machines' image, which has no
network to install them) each notebook's code cells run in order in a fresh Python process
instead (run_plain): the same figures and macros are written, but the executed notebook is not
saved, and the run says so.
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys

try:
    import nbclient
    import nbformat
except ImportError:  # run_plain
    nbclient = nbformat = None

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import plotting  # noqa: E402


def _set_device(device):
    os.environ.pop("LONGFLASH_DEVICE_CLASS", None)
    if device is not None:
        os.environ["LONGFLASH_DEVICE_CLASS"] = device  # the kernel inherits the environment


def run(path, device, out_path, timeout=1200):
    """Execute the notebook at path for one device class (None: no device); returns the
    NotApplicable message if the notebook declined, else None."""
    _set_device(device)
    if nbclient is None:
        return run_plain(path, timeout)
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        if e.ename == "NotApplicable":
            return e.evalue
        raise
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    nbformat.write(notebook, out_path)
    return None


NOT_APPLICABLE_EXIT = 3  # run_plain's child: the notebook raised plotting.NotApplicable


def code_cells(path):
    """The notebook's code cells, as source strings (plain JSON: no nbformat needed)."""
    with open(path) as f:
        cells = json.load(f)["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells if c["cell_type"] == "code"]


def run_plain(path, timeout=1200):
    """run() without Jupyter: the code cells in order in a fresh process (so that plotting
    reads this device class), with the notebook's folder as working directory. Its output is
    shown only if it fails; the executed notebook is not saved."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--exec-cells", path],
                          cwd=os.path.dirname(path), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode == NOT_APPLICABLE_EXIT:
        return proc.stderr.strip().splitlines()[-1]
    if proc.returncode != 0:
        raise SystemExit(f"{path} failed (run without Jupyter):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    return None


def exec_cells(path):
    """The child of run_plain: every code cell of the notebook at path, in one namespace."""
    namespace = {"__name__": "__main__"}
    for i, source in enumerate(code_cells(path)):
        try:
            exec(compile(source, f"{path} (code cell {i + 1})", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - NotApplicable is a skip, the rest a failure
            if type(e).__name__ == "NotApplicable":
                print(e, file=sys.stderr)
                raise SystemExit(NOT_APPLICABLE_EXIT)
            raise


RQS = ("speedup", "io_complexity", "scaling", "long_context_training")


def write_device_index():
    """paper/generated/devices.tex: \\input of every per-device macro file (<rq>_<class>.tex),
    and for each research question with a GPU's macros: \\Gpu<Rq> (the macro prefix of the
    first such GPU class: HOneZeroZero for h100) and \\Gpu<Rq>Tag (its class, for figure and
    label names), e.g. \\GpuSpeedup, \\GpuScalingTag, which the paper's GPU paragraphs test and
    its headline sentences (abstract, conclusion) use; \\Gpu<Rq>All (every such prefix, comma
    separated: the README's GPU rows) and \\Gpu<Rq>ForEach{body}, which sets the two to each GPU
    class in turn around the body (the section's per-GPU paragraphs, tables and figures), then
    leaves the first's; and \\GpuSpeedupDevices, the GPUs of RQ1 by name."""
    files = sorted(glob.glob(os.path.join(plotting.GENERATED, "*_*.tex")))
    files = [f for f in files if os.path.basename(f) != "devices.tex"
             and os.path.splitext(os.path.basename(f))[0].rsplit("_", 1)[0] in RQS]
    lines = ["% Generated by notebooks/run_notebooks.py: the macros of every device class other "
             "than the CPU.\n"]
    lines += [f"\\input{{generated/{os.path.splitext(os.path.basename(f))[0]}}}\n" for f in files]
    for rq in RQS:  # a GPU whose notebook declined (NotApplicable) wrote no macros: not named
        gpus = [c for c in plotting.device_classes(rq) if c != "cpu"
                and os.path.exists(os.path.join(plotting.GENERATED, f"{rq}_{c}.tex"))]
        if gpus:
            name = f"Gpu{plotting.camel(rq)}"
            each = "".join(f"\\begingroup\\def\\{name}{{{plotting.camel(c)}}}"
                           f"\\def\\{name}Tag{{{c}}}#1\\endgroup" for c in gpus)
            lines += [f"\\newcommand{{\\{name}}}{{{plotting.camel(gpus[0])}}}\n",
                      f"\\newcommand{{\\{name}Tag}}{{{gpus[0]}}}\n",
                      f"\\newcommand{{\\{name}All}}{{{','.join(map(plotting.camel, gpus))}}}\n",
                      f"\\newcommand{{\\{name}ForEach}}[1]{{{each}}}\n"]
            if rq == "speedup":  # the GPUs RQ1 ran on, named: "A and B", "A, B and C"
                names = [f"\\Speedup{plotting.camel(c)}Device{{}}" for c in gpus]
                listed = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1
                                      else names)
                lines.append(f"\\newcommand{{\\GpuSpeedupDevices}}{{{listed}}}\n")

    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(lines)
    plotting.atomic_write(os.path.join(plotting.GENERATED, "devices.tex"), write)


# Names the paper's algorithms use that look like generated macros but are LaTeX's.
LATEX_NAMES = {"Comment", "State", "For", "EndFor", "If", "EndIf", "Return", "Require", "Ensure",
               "Theta"}


def write_not_measured():
    """paper/generated/not_measured.tex: "not measured" for every generated-looking macro the
    paper's sections (or the README's table) use that no notebook defined, so that a run at other sizes (QUICK=1, a
    partial GPU run) still builds, saying what is missing. Empty after a full run; the test
    suite checks that the committed macros leave nothing to it."""
    defined = set()
    for path in glob.glob(os.path.join(plotting.GENERATED, "*.tex")):
        if os.path.basename(path) != "not_measured.tex":
            with open(path) as f:
                defined |= set(re.findall(r"\\newcommand\{\\(\w+)\}", f.read()))
    def prefix(name):  # \SpeedupCpuDevice -> Speedup
        match = re.match(r"[A-Z][a-z]+", name)
        return match.group(0) if match else None
    prefixes = {prefix(m) for m in defined}
    used = set()
    for path in glob.glob(os.path.join(plotting.ROOT, "paper", "sections", "*.tex")):
        with open(path) as f:
            used |= set(re.findall(r"\\([A-Z]\w+)", f.read()))
    from readme_table import ROWS  # the README's headline table uses the same macros
    used |= set(re.findall(r"\{(\w+)\}", " ".join(" ".join(row) for row in ROWS)))
    # The \Gpu<Rq> switches (write_device_index) say whether a GPU's macros exist: never
    # "not measured", which would define them and open a GPU paragraph with nothing behind it.
    missing = sorted(n for n in used - defined - LATEX_NAMES
                     if prefix(n) in prefixes and not n.startswith("Gpu"))
    if missing:
        print(f"not measured at these sizes ({len(missing)} macros): {', '.join(missing)}")
    lines = ["% Generated by notebooks/run_notebooks.py: macros the paper uses that the results "
             "did not provide.\n"] + [f"\\newcommand{{\\{n}}}{{not measured}}\n" for n in missing]

    def write(tmp):
        with open(tmp, "w") as f:
            f.writelines(lines)
    plotting.atomic_write(os.path.join(plotting.GENERATED, "not_measured.tex"), write)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("--out-dir", help="save executed notebooks here instead of in place")
    parser.add_argument("--device-class", action="append", metavar="CLASS",
                        help="run the per-device notebooks for this device class only (repeat "
                        "for several; default: every class with results), e.g. h200 after a "
                        "GPU window, the CPU's figures and macros left as they are")
    parser.add_argument("--exec-cells", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.exec_cells:  # run_plain's child
        return exec_cells(os.path.abspath(args.notebooks[0]))
    if nbclient is None:
        print("Jupyter (nbclient, nbformat) is not installed: running each notebook's code "
              "cells in a plain Python process; figures and macros are written, the executed "
              "notebooks are not saved (pip install -e \".[analysis]\" to save them).",
              flush=True)
    for notebook_path in map(os.path.abspath, args.notebooks):
        with open(notebook_path) as f:
            rq = json.load(f).get("metadata", {}).get("longflash", {}).get("results")
        devices = plotting.device_classes(rq) if rq else [None]
        if rq and not devices:
            raise SystemExit(f"{notebook_path}: no results in results/{rq}/")
        if rq and args.device_class:
            devices = [d for d in devices if d in args.device_class]
            if not devices:
                print(f"{notebook_path}: no results/{rq}/ file of device class "
                      f"{', '.join(args.device_class)}: not run", flush=True)
        for device in devices:
            stem = os.path.splitext(os.path.basename(notebook_path))[0]
            name = stem if device in (None, "cpu") else f"{stem}.{device}"
            out = os.path.join(args.out_dir or os.path.dirname(notebook_path), name + ".ipynb")
            print(f"executing {notebook_path}" + (f" for device class {device}" if device else ""),
                  flush=True)
            skipped = run(notebook_path, device, out)
            if skipped:
                print(f"  skipped for {device}: {skipped}", flush=True)
    write_device_index()
    write_not_measured()


if __name__ == "__main__":
    main()
