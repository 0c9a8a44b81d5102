"""The GPU window's last step when the lent machine is an H200, not an H100 (the device tool
lends either; a results file and its device class are named after the GPU's model): every
RQ's GPU-shaped rows written under the H200's name (tests/gpu_shaped, made-up values), every
per-device notebook, the README table and the paper. Nothing may assume "h100": the macros
of class h200 are prefixed HTwoZeroZero, the paper's GPU paragraphs name the H200.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests import gpu_shaped

ROOT = gpu_shaped.ROOT
GPU, TAG, PREFIX = "NVIDIA H200", "h200", "HTwoZeroZero"


def test_figures_readme_and_paper_on_an_h200(tmp_path, monkeypatch):
    pytest.importorskip("nbclient", reason="the notebooks need pip install .[analysis]")
    pytest.importorskip("matplotlib", reason="the notebooks need pip install .[analysis]")
    monkeypatch.setattr(gpu_shaped, "GPU", GPU)
    monkeypatch.setattr(gpu_shaped, "TAG", TAG)
    res = tmp_path / "results"
    gpu_shaped.write_all(res)
    assert sorted(p.name for p in res.glob("*/*.csv")) == [f"{TAG}.csv"] * len(gpu_shaped.RQS)
    gen, fig, out = gpu_shaped.run_notebooks(tmp_path, gpu_shaped.RQS, copy_figures=True,
                                             timeout=1200)
    for rq in gpu_shaped.RQS:
        assert f"{rq}.ipynb for device class {TAG}" in out, rq
        assert (gen / f"{rq}_{TAG}.tex").exists(), rq
    assert not list(gen.glob("*_h100.tex")) and not list(fig.glob("*_h100.*"))
    assert gpu_shaped.macros(gen / f"speedup_{TAG}.tex")[f"Speedup{PREFIX}Device"] == GPU
    devices = (gen / "devices.tex").read_text()
    assert f"\\newcommand{{\\GpuSpeedup}}{{{PREFIX}}}" in devices and "HOneZeroZero" not in devices
    # README: the GPU row names the H200 and its results file.
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    table = subprocess.run([sys.executable, "notebooks/readme_table.py", "--readme", str(readme)],
                           cwd=ROOT, env=dict(os.environ, LONGFLASH_GENERATED=str(gen)),
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    gpu_row = [line for line in readme.read_text().splitlines()
               if line.startswith("| RQ1 speed on a GPU |")]
    assert len(gpu_row) == 1 and GPU in gpu_row[0] and f"`results/speedup/{TAG}.csv`" in gpu_row[0]
    # The paper builds, with the H200's GPU paragraphs and no "no GPU was available".
    built = gpu_shaped.build_paper(tmp_path / "build", gen, [fig])
    if built and built[1]:
        flat = " ".join(built[1].split())
        assert f"On {GPU}, LongFlash" in flat and "No GPU was available" not in flat
