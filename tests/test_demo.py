"""The README's main command runs end to end (tiny sizes; no timing is asserted)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_quick():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it: on a CPU the PyTorch path, not
    # the suite's Triton interpreter (which timed every call for a minute)
    out = subprocess.run([sys.executable, "-m", "experiments.demo", "--quick"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    errors = [line.split() for line in lines if line.startswith("longflash ")]
    # accuracy row first: o, dq, dk, dv errors against float64 are small numbers
    assert all(float(e) < 1e-3 for e in errors[0][1:5]), errors[0]
    assert sum(line.startswith(("longflash", "standard", "sdpa_")) for line in lines) >= 3 + 12
