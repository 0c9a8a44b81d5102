"""One results file per machine, notebooks that draw one machine at a time, and git_dirty that
means the code (issue: `make reproduce` failed on every machine but the one that made the
committed results)."""

import json
import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from experiments import results
from experiments.results import device_class, device_tag
from tests import gpu_shaped
from conftest import run_uninterpreted

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "notebooks"))


def _plotting():
    """notebooks/plotting.py, which needs matplotlib (the analysis extra, not the test one)."""
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    import plotting
    return plotting


OTHER_CPU = "Other CPU 9000 @ 1.00GHz"
GPU = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("name, tag, cls", [
    ("AMD EPYC", "cpu-amd-epyc", "cpu"),
    ("AMD EPYC 7B13 64-Core Processor", "cpu-amd-epyc-7b13-64-core-processor", "cpu"),
    ("Intel(R) Xeon(R) Processor @ 2.80GHz", "cpu-intel-xeon-processor-2-80ghz", "cpu"),
    ("NVIDIA H100 80GB HBM3", "h100", "h100"),
    ("NVIDIA H100 PCIe", "h100-pcie", "h100-pcie"),
    ("NVIDIA H200", "h200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100", "a100"),
    ("dry run: Intel(R) Xeon(R) Processor", "dryrun", None),
], ids=lambda x: str(x))
def test_device_tag_and_class(name, tag, cls):
    assert device_tag(name) == tag
    assert device_class(tag) == cls


def test_notebooks_read_results_without_torch():
    """The notebooks' modules never import torch (1.5 s a notebook, each run in its own kernel),
    and the results helpers they use give the same tags without it."""
    _plotting()
    code = ("import sys; sys.path.insert(0, 'notebooks'); import plotting, readme_table, "
            "run_notebooks; from experiments.results import device_tag; "
            f"print(device_tag({GPU!r}), device_tag('AMD EPYC'), 'torch' in sys.modules)")
    assert run_uninterpreted("-c", code).stdout.split() == ["h100", "cpu-amd-epyc", "False"]


def test_device_name_override(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGFLASH_DEVICE_NAME", OTHER_CPU)
    assert results.provenance()["device"] == OTHER_CPU
    assert device_tag() == "cpu-other-9000-1-00ghz"


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_dirty_ignores_outputs(monkeypatch, tmp_path):
    for path in ("kernels/a.py", "experiments/b.py", "results/speedup/cpu-x.csv",
                 "figures/f.pdf", "paper/generated/speedup.tex", "notebooks/n.ipynb", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("v1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(results, "_REPO", str(tmp_path))
    assert results.provenance()["git_dirty"] is False
    # What experiments and notebooks write is no dirt ...
    for path in ("results/speedup/cpu-x.csv", "figures/f.pdf", "paper/generated/speedup.tex",
                 "notebooks/n.ipynb", "README.md"):
        (tmp_path / path).write_text("v2\n")
    (tmp_path / "results/speedup/cpu-x.log").write_text("new\n")
    prov = results.provenance()
    assert prov["git_dirty"] is False and prov["git_dirty_files"] == ""
    # ... a changed or new file of the code is, and is named.
    (tmp_path / "kernels/a.py").write_text("v2\n")
    (tmp_path / "experiments/new.py").write_text("x\n")
    prov = results.provenance()
    assert prov["git_dirty"] is True
    assert prov["git_dirty_files"] == "experiments/new.py;kernels/a.py"


def test_git_commit_from_the_environment_where_git_cannot_say(monkeypatch, tmp_path, capsys):
    """The GPU machines get a copy of the tree without .git: the commit and its state come from
    $LONGFLASH_GIT_COMMIT / $LONGFLASH_GIT_DIRTY; without them, "unknown" and a warning."""
    monkeypatch.setattr(results, "_REPO", str(tmp_path))  # no repository here
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("LONGFLASH_GIT_COMMIT", raising=False)
    monkeypatch.delenv("LONGFLASH_GIT_DIRTY", raising=False)
    monkeypatch.setattr(results, "_warned_unknown", [])
    prov = results.provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == ("unknown", "unknown")
    assert "LONGFLASH_GIT_COMMIT" in capsys.readouterr().err
    monkeypatch.setenv("LONGFLASH_GIT_COMMIT", "a" * 40)
    monkeypatch.setenv("LONGFLASH_GIT_DIRTY", "False")
    prov = results.provenance()
    assert (prov["git_commit"], prov["git_dirty"], prov["git_dirty_files"]) == ("a" * 40, False,
                                                                                 "")
    assert "WARNING" not in capsys.readouterr().err
    monkeypatch.setenv("LONGFLASH_GIT_DIRTY", "True")
    assert results.provenance()["git_dirty"] is True
    # git, where it answers, wins over the environment
    for path in ("kernels/a.py",):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("v1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    prov = results.provenance()
    assert (prov["git_commit"], prov["git_dirty"]) == (head, False)


def _csv(path, device, timestamp):
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([dict(device=device, timestamp=timestamp, value=1.0)]).to_csv(path, index=False)


def test_number_formats():
    """The notebooks' one set of number formats (notebooks/plotting.py)."""
    plotting = _plotting()
    assert plotting.sci(7.24e-9) == "7.2\\times 10^{-9}"
    assert plotting.sci(9.96e-9) == "1.0\\times 10^{-8}"  # rounding carries into the exponent
    assert plotting.sci(-3.1e2, 0) == "-3\\times 10^{2}" and plotting.sci(0) == "0"
    assert plotting.pct(0.904) == "90\\%" and plotting.pct(0.0123, 1) == "1.2\\%"
    assert plotting.thousands(1048576) == "1{,}048{,}576"


def test_select_runs_newest_per_class(monkeypatch, tmp_path):
    _csv(tmp_path / "rq" / "cpu-amd-epyc.csv", "AMD EPYC", "2026-11-01T00:00:00+00:00")
    _csv(tmp_path / "rq" / "cpu-intel-x.csv", "Intel X", "2026-11-20T00:00:00+00:00")
    _csv(tmp_path / "rq" / "h100.csv", GPU, "2026-10-01T00:00:00+00:00")
    _csv(tmp_path / "rq" / "dryrun.csv", "dry run: Intel X", "2026-12-01T00:00:00+00:00")
    monkeypatch.delenv("LONGFLASH_DEVICES", raising=False)
    plotting = _plotting()
    runs = plotting.select_runs("rq", results=str(tmp_path))
    assert list(runs) == ["cpu", "h100"]  # the CPU first; the dry run never
    assert os.path.basename(runs["cpu"]) == "cpu-intel-x.csv"
    monkeypatch.setenv("LONGFLASH_DEVICES", "cpu-amd-epyc")
    assert os.path.basename(plotting.select_runs("rq", results=str(tmp_path))["cpu"]) \
        == "cpu-amd-epyc.csv"


def _run(args, env, timeout=600):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"{args}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


_macros = gpu_shaped.macros


@pytest.mark.slow
def test_notebooks_draw_a_rerun_on_another_machine_beside_the_committed_results(tmp_path):
    """A user's rerun of one experiment on another CPU lands in a file of its own beside the
    committed CPU results; that RQ's notebook draws the rerun (the newest CPU run), another
    RQ's still draws the committed file, and each output names its one machine. (The
    committed results alone run in CI's `make figures`, a new machine's alone in `make
    reproduce QUICK=1`, GPU classes in tests/test_gpu_shaped_*.py.)"""
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    plotting = _plotting()
    before = subprocess.run(["git", "status", "--porcelain", "results", "figures", "paper"],
                            cwd=ROOT, capture_output=True, text=True).stdout
    res, fig, gen, nb = (tmp_path / d for d in ("results", "figures", "generated", "nb"))
    rerun, kept = "io_complexity", "scaling"
    for rq in (rerun, kept):  # the CPU's files only: no GPU class to draw
        gpu_shaped.copy_cpu_results(rq, res)
    shutil.copytree(os.path.join(ROOT, "paper", "generated"), gen)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]),
               LONGFLASH_RESULTS=str(res), LONGFLASH_FIGURES=str(fig),
               LONGFLASH_GENERATED=str(gen), LONGFLASH_DEVICE_NAME=OTHER_CPU)
    env.pop("LONGFLASH_DEVICES", None)
    _run(["-m", f"experiments.{rerun}"], env)
    tag = device_tag(OTHER_CPU)
    mine = pd.read_csv(res / rerun / f"{tag}.csv")
    assert set(mine["device"]) == {OTHER_CPU}  # the rerun has a file of its own
    assert set(mine["git_dirty"]) <= {True, False}
    assert len(os.listdir(res / rerun)) > 1  # beside the committed ones

    out = _run([os.path.join("notebooks", "run_notebooks.py"), "--out-dir", str(nb),
                *[os.path.join("notebooks", f"{n}.ipynb") for n in (rerun, kept)]], env, 600)
    assert "for device class h100" not in out
    committed = _macros(os.path.join(ROOT, "paper", "generated", f"{kept}.tex"))
    for rq, device, file in ((rerun, OTHER_CPU, f"results/{rerun}/{tag}.csv"),
                             (kept, committed[f"{plotting.camel(kept)}ResultsDevice"], None)):
        macros = _macros(gen / f"{rq}.tex")
        assert macros[f"{plotting.camel(rq)}ResultsDevice"] == device, rq
        if file:
            assert macros[f"{plotting.camel(rq)}ResultsFile"] == file.replace("_", "\\_"), rq
    assert committed[f"{plotting.camel(kept)}ResultsDevice"] != OTHER_CPU
    assert (fig / "io_complexity_sweeps.pdf").exists() and (fig / "scaling_weak.png").exists()
    # The repository itself was not touched.
    after = subprocess.run(["git", "status", "--porcelain", "results", "figures", "paper"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    assert after == before


@pytest.mark.slow
def test_notebooks_without_jupyter(tmp_path):
    """The GPU machines' image has no Jupyter and no network: run_notebooks.py then runs each
    notebook's code cells in a plain process, and writes the same macros (CPU and GPU class);
    a notebook that declines (NotApplicable) is still a skip, a failing one still a failure."""
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    shim = tmp_path / "shim"
    shim.mkdir()
    for name in ("nbclient", "nbformat"):  # importing them fails, as where they are missing
        (shim / f"{name}.py").write_text("raise ImportError('no Jupyter here (test)')\n")
    res, gen, fig = tmp_path / "results", tmp_path / "generated", tmp_path / "figures"
    shutil.copytree(os.path.join(ROOT, "results"), res)
    shutil.copytree(os.path.join(ROOT, "paper", "generated"), gen)
    gpu_shaped.write_all(res, rqs=("scaling",))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(shim), os.path.join(ROOT, "kernels"), ROOT]), LONGFLASH_RESULTS=str(res),
        LONGFLASH_FIGURES=str(fig), LONGFLASH_GENERATED=str(gen))
    env.pop("LONGFLASH_DEVICES", None)
    declines = tmp_path / "declines.ipynb"
    declines.write_text(json.dumps({"cells": [{"cell_type": "code", "source": [
        "from plotting import NotApplicable\n", "raise NotApplicable('nothing to draw')\n"]}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    out = _run([os.path.join("notebooks", "run_notebooks.py"), "--out-dir", str(tmp_path / "nb"),
                os.path.join("notebooks", "scaling.ipynb"), str(declines)], env, 600)
    assert "Jupyter (nbclient, nbformat) is not installed" in out
    assert "for device class h100" in out and "skipped for None: nothing to draw" in out
    assert _macros(gen / "scaling.tex") == _macros(
        os.path.join(ROOT, "paper", "generated", "scaling.tex"))
    assert _macros(gen / "scaling_h100.tex")["HOneZeroZeroRingOneGpuGoal"] == "met"
    assert (fig / "scaling_weak_h100.pdf").exists() and not (tmp_path / "nb").exists()
    broken = tmp_path / "broken.ipynb"
    broken.write_text(declines.read_text().replace("raise NotApplicable('nothing to draw')",
                                                   "1 / 0"))
    failed = subprocess.run([sys.executable, os.path.join("notebooks", "run_notebooks.py"),
                             str(broken)], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode != 0 and "ZeroDivisionError" in failed.stderr
