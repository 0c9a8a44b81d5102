"""Where Triton cannot be installed (macOS, Windows: no wheels), LongFlash runs on its PyTorch
path and the README's commands still work: checked here in fresh Pythons in which `import
triton` fails as it does there (a sitecustomize puts None in sys.modules["triton"], so
importlib finds no spec and the import raises ImportError), and, for the experiments, where
os.sched_getaffinity does not exist either (macOS, Windows) nor os.getloadavg (Windows)."""

import os
import subprocess
import sys

from conftest import ROOT

BLOCK_TRITON = 'import sys\nsys.modules["triton"] = None  # as where Triton is not installed\n'


NOT_LINUX = "import os\ndel os.sched_getaffinity, os.getloadavg  # as on Windows\n"


def run_without_triton(tmp_path, *argv, timeout=600, not_linux=False):
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK_TRITON + (NOT_LINUX if not_linux else ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.path.join(ROOT, "kernels"),
                                                       ROOT]))
    env.pop("TRITON_INTERPRET", None)
    env.pop("PYTEST_ADDOPTS", None)  # the outer run's options (-q, --junitxml) are not its own
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_library_runs_on_the_pytorch_path(tmp_path):
    code = ("import torch, longflash\n"
            "from longflash import interface\n"
            "assert interface._TRITON_PROBLEM\n"
            "q = torch.randn(1, 40, 2, 16)\n"
            "o = longflash.attention(q, q, q, causal=True)\n"
            "ref, _ = longflash.attention_ref(q, q, q, causal=True)\n"
            "assert (o - ref).abs().max() < 1e-5\n"
            "try:\n"
            "    longflash.attention(q, q, q, backend='triton')\n"
            "    raise SystemExit('no error')\n"
            "except ValueError as e:\n"
            "    assert 'needs the triton package' in str(e), e\n")
    out = run_without_triton(tmp_path, "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]


def test_suite_collects_and_variants_runs(tmp_path):
    """Every test module collects (those of the Triton kernels skip their tests), and the one
    experiment that counted blocks with a Triton kernel runs (experiments.variants)."""
    out = run_without_triton(tmp_path, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                             "-p", "no:cacheprovider", "tests")
    assert out.returncode == 0 and "error" not in out.stdout.splitlines()[-1], \
        (out.stdout[-3000:], out.stderr[-3000:])
    out = run_without_triton(tmp_path, "-m", "experiments.variants", "--quick", "--out",
                             str(tmp_path / "variants.csv"))
    assert out.returncode == 0, out.stderr[-3000:]


def test_experiments_run_without_linux_calls(tmp_path):
    """RQ1, RQ3 and RQ4 at tiny sizes where neither Triton nor os.sched_getaffinity nor
    os.getloadavg exists: the cores and load columns come from what the system has."""
    for module, args in (("speedup", ("--parts", "batch,decode", "--headdims", "64")),
                         ("scaling", ()), ("long_context_training", ())):
        out = run_without_triton(tmp_path, "-m", f"experiments.{module}", "--quick", *args,
                                 "--out", str(tmp_path / f"{module}.csv"), not_linux=True)
        assert out.returncode == 0, (module, out.stderr[-3000:])
