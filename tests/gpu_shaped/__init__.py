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
import glob
import importlib
import os
import re
import shutil
import subprocess
import sys

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


def committed_gpu_classes():
    """The device classes other than the CPU's with results committed under results/<rq>/."""
    from experiments.results import device_class
    tags = {os.path.splitext(os.path.basename(p))[0] for rq in RQS
            for p in glob.glob(os.path.join(ROOT, "results", rq, "*.csv"))}
    return sorted({device_class(t) for t in tags} - {"cpu"})


def copy_cpu_results(rq, results_dir):
    """results/<rq>/ into results_dir/<rq>/ without the committed GPU classes' files (their
    rows would mix with the made-up ones a test writes under the same name)."""
    shutil.copytree(os.path.join(ROOT, "results", rq), os.path.join(str(results_dir), rq),
                    ignore=shutil.ignore_patterns(*(f"{c}.*" for c in committed_gpu_classes())))


def run_notebooks(tmp_path, notebooks, copy_figures=False, timeout=900, classes=None):
    """notebooks/run_notebooks.py on `notebooks` (names, e.g. "speedup") over the results the
    caller wrote into tmp_path/results, for every device class found there (or those of
    `classes`: the CPU's macros are the committed ones, its run is CI's `make figures`),
    writing into scratch folders: tmp_path/generated (a copy of paper/generated: the committed CPU macros)
    and tmp_path/figures (a copy of figures/ with copy_figures, else new). Returns (generated,
    figures, the run's stdout); fails the test with its output if the run fails."""
    gen, fig = tmp_path / "generated", tmp_path / "figures"
    # Not the committed GPU classes' macros and figures (*_h100.tex, *_h100.pdf, ...): they come
    # from the committed results, and the caller's made-up rows make their own.
    committed = shutil.ignore_patterns(*(f"*_{c}.*" for c in committed_gpu_classes()))
    shutil.copytree(os.path.join(ROOT, "paper", "generated"), gen, ignore=committed)
    if copy_figures:
        shutil.copytree(os.path.join(ROOT, "figures"), fig, ignore=committed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]),
               LONGFLASH_RESULTS=str(tmp_path / "results"), LONGFLASH_FIGURES=str(fig),
               LONGFLASH_GENERATED=str(gen))
    env.pop("LONGFLASH_DEVICES", None)
    out = subprocess.run([sys.executable, os.path.join("notebooks", "run_notebooks.py"),
                          "--out-dir", str(tmp_path / "nb"),
                          *(f"--device-class={c}" for c in classes or ()),
                          *(os.path.join("notebooks", f"{n}.ipynb") for n in notebooks)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ran = set(re.findall(r"for device class (\S+)", out.stdout))
    assert not classes or ran <= set(classes), ran  # --device-class left the others alone
    return gen, fig, out.stdout


def macros(path):
    """{name: value} of a generated macro file (\\newcommand{\\Name}{value} lines)."""
    with open(path) as f:
        return dict(re.findall(r"\\newcommand\{\\(\w+)\}\{(.*)\}\n", f.read()))


def build_paper(build_dir, generated, figures=()):
    """Build the paper as `make paper` does (latexmk, -Werror) in build_dir/paper, on the macro
    files of `generated` and the repository's figures overlaid with each folder of `figures`.
    Returns (paper folder, its text: "" without pdftotext), or None without latexmk; the text is
    pdftotext's with each page's whitespace collapsed to single spaces, pages apart by form
    feeds (read it with find, has and count). Fails the test with latexmk's output if the build
    fails."""
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
    return paper, "\f".join(" ".join(page.split()) for page in text.split("\f"))


# Between two words of a sentence the text may turn a page: the page's number, the form feed,
# then the floats at the top of the next page (all of the paper's floats are [t]) before the
# sentence goes on. Where the floats end is not marked: a word missing just after them passes.
_GAP = r"(?: | \d+\f(?:[^\f]{0,4000}? )?)"


def _phrase(phrase):
    return re.compile(_GAP.join(map(re.escape, phrase.split(" "))))


def find(text, phrase, start=0):
    """Where phrase starts in the paper's text (build_paper's: each page's whitespace collapsed
    to single spaces, pages apart by form feeds), a page turn allowed between any two of its
    words (where a page break or a float falls inside a sentence); -1 if nowhere."""
    found = _phrase(phrase).search(text, start)
    return found.start() if found else -1


def has(text, phrase):
    """Whether the paper's text holds phrase (as find: a page turn allowed inside it)."""
    return find(text, phrase) >= 0


def count(text, phrase):
    """How often the paper's text holds phrase (as find: a page turn allowed inside it)."""
    return len(_phrase(phrase).findall(text))
