"""GPU-shaped results for testing the notebooks and the paper before a GPU has run anything.

Nothing here is a measurement. Each module writes, into a scratch results folder, rows shaped
like those its experiment writes on an H100: the same experiment, provider, mode, metric, unit
and status vocabulary, the configurations taken from the experiment's own plan (so the fixture
follows the script when the script changes), out-of-memory, unsupported and unmeasured rows
where a GPU run has them, and made-up values of a plausible size. Tests run the notebooks on
them (device class h100) and build the paper, so that the GPU window's last step,
`make figures paper` on the campaign's results, does not fail on a shape the CPU never writes.

    from tests import gpu_shaped
    gpu_shaped.write_all(tmp_path / "results")     # results/<rq>/h100.csv (+ .json) per RQ

Each module has `write(results_dir)`; values are deterministic (a seeded generator).
"""

import contextlib
import importlib
import os
import re
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU = "NVIDIA H100 80GB HBM3"
TAG = "h100"
RQS = ("speedup", "io_complexity", "scaling", "long_context_training")


@contextlib.contextmanager
def as_gpu():
    """experiments.results writes GPU provenance (device name) while inside."""
    old = os.environ.get("LONGFLASH_DEVICE_NAME")
    os.environ["LONGFLASH_DEVICE_NAME"] = GPU
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LONGFLASH_DEVICE_NAME", None)
        else:
            os.environ["LONGFLASH_DEVICE_NAME"] = old


def path(results_dir, rq, ext="csv"):
    """results_dir/<rq>/h100.<ext>, its folder created."""
    folder = os.path.join(str(results_dir), rq)
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{TAG}.{ext}")


def write_all(results_dir, rqs=RQS):
    """Every RQ's GPU-shaped results into results_dir (a scratch copy, never results/)."""
    for rq in rqs:
        importlib.import_module(f".{rq}", __name__).write(results_dir)


def macros(path):
    """{name: value} of a generated macro file (\\newcommand{\\Name}{value} lines)."""
    with open(path) as f:
        return dict(re.findall(r"\\newcommand\{\\(\w+)\}\{(.*)\}\n", f.read()))


def build_paper(build_dir, generated, figures=()):
    """Build the paper as `make paper` does (latexmk, -Werror) in build_dir/paper, on the macro
    files of `generated` and the repository's figures overlaid with each folder of `figures`.
    Returns (paper folder, its text: "" without pdftotext), or None without latexmk. Fails the
    test with latexmk's output if the build fails."""
    if not shutil.which("latexmk"):
        return None
    paper = os.path.join(str(build_dir), "paper")
    shutil.copytree(os.path.join(ROOT, "paper", "sections"), os.path.join(paper, "sections"))
    for name in ("main.tex", "refs.bib"):
        shutil.copy(os.path.join(ROOT, "paper", name), paper)
    shutil.copytree(str(generated), os.path.join(paper, "generated"))
    for folder in (os.path.join(ROOT, "figures"), *map(str, figures)):
        shutil.copytree(folder, os.path.join(str(build_dir), "figures"), dirs_exist_ok=True)
    env = dict(os.environ, max_print_line="10000")  # see the Makefile's paper target
    build = subprocess.run(["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error",
                            "-Werror", "main.tex"], cwd=paper, env=env, capture_output=True,
                           text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:]
    text = subprocess.run(["pdftotext", "main.pdf", "-"], cwd=paper, capture_output=True,
                          text=True).stdout if shutil.which("pdftotext") else ""
    return paper, text
