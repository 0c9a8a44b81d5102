"""experiments/scaling.py's ranks on a machine like the GPU campaign's: there the parent process
has run autograd (on a machine with a GPU its first backward starts the engine's worker
threads) before the gloo ranks start, and a rank forked from it cannot run a backward
("Unable to handle autograd's threading in combination with fork-based multiprocessing"):
every ring size of part exactness failed on the H100. A CPU machine starts no such thread,
except for a reentrant backward nested deeper than the engine's limit (60), which moves to a
worker thread: that is how these tests put a CPU process in the GPU machine's state. Each
runs in a subprocess of its own, as that state cannot be undone."""

import json
import os
import subprocess
import sys

import pandas as pd

from experiments import scaling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = r'''
import json, os, sys
import torch
from experiments import scaling


class Nested(torch.autograd.Function):
    """A backward that runs a backward, `depth` deep: past the autograd engine's reentrant
    depth limit the engine hands it to a worker thread, as it does on a machine with a GPU."""

    @staticmethod
    def forward(ctx, x, depth):
        ctx.depth = depth
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.depth:
            y = torch.zeros((), requires_grad=True)
            with torch.enable_grad():
                torch.autograd.grad(Nested.apply(y, ctx.depth - 1), y)
        return g, None


x = torch.zeros((), requires_grad=True)
torch.autograd.grad(Nested.apply(x, 70), x)

# Proof that this process is now in the GPU machine's state: a forked child cannot backward.
r, w = os.pipe()
if os.fork() == 0:
    try:
        z = torch.ones(2, requires_grad=True)
        torch.autograd.grad(z.sum(), z)
        message = "ok"
    except RuntimeError as e:
        message = str(e)
    os.write(w, message.encode()[:1000])
    os._exit(0)
os.close(w)
forked = os.read(r, 1000).decode()
os.wait()

scaling._fork_is_safe = lambda: False  # what a machine with a GPU answers
sys.argv = ["scaling", "--quick", "--parts", "exactness", "--out", sys.argv[1]]
scaling.main()
print(json.dumps(dict(forked=forked)))
'''


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT]))
    env.pop("LONGFLASH_RANKS_START_METHOD", None)  # each test says which start it means
    return env


def test_exactness_ranks_run_after_autograd_in_the_parent(tmp_path):
    """With a GPU visible, the ranks start from a forkserver (never from the parent that ran
    autograd): part exactness measures every ring size, and its numbers are those of ranks
    forked as on a CPU machine."""
    out = tmp_path / "gpu-like.csv"
    run = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    forked = json.loads(run.stdout.strip().splitlines()[-1])["forked"]
    assert "fork-based multiprocessing" in forked  # the state the H100 parent was in
    df = pd.read_csv(out)
    cfg = scaling.Config(**scaling.QUICK)
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"].to_dict("records")
    assert set(df["ranks"]) == set(cfg.exact_ranks)
    assert set(df["metric"]) == {f"max_err_{n}" for n in ("o", "lse", "dq", "dk", "dv")}
    assert (df["value"] < 1e-4).all()
    # The same numbers, bit for bit, from ranks forked (this process is a CPU one: fork is
    # safe), as the CPU runs start them.
    key = ("provider", "layout", "ranks", "seqlen_q", "dtype", "metric")
    forked = {tuple(r[c] for c in key): r["value"] for world_size in cfg.exact_ranks
              for r in scaling.spawn_ranks(world_size, scaling._ranks_worker, cfg,
                                           ["exactness"], start_method="fork")}
    assert {tuple(r[c] for c in key): r["value"] for r in df.to_dict("records")} == forked


def test_forkserver_ranks_as_the_gpu_machine_runs_the_script(tmp_path):
    """`python -m experiments.scaling` with ranks from the forkserver (what a machine with a
    GPU uses; the functions are those of __main__): the parts on ranks write their rows, and
    rank 0's lines reach the log beside them."""
    out = tmp_path / "cpu.csv"
    run = subprocess.run([sys.executable, "-m", "experiments.scaling", "--quick", "--parts",
                          "exactness,weak,long", "--long-seqlens", "256", "--out", str(out)],
                         cwd=ROOT, env=dict(_env(), LONGFLASH_RANKS_START_METHOD="forkserver"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    df = pd.read_csv(out)
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"].to_dict("records")
    assert set(df["part"]) == {"exactness", "weak", "long"}
    assert "long: seqlen 256 on 2 ranks" in (tmp_path / "cpu.log").read_text()


def test_fork_is_used_only_where_no_gpu_is_visible(monkeypatch):
    import torch
    for cuda, safe in ((False, True), (True, False)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        assert scaling._fork_is_safe() is safe


def test_failed_ranks_are_rows_with_the_error_that_a_later_run_replaces(tmp_path, monkeypatch):
    """A failing rank gives status rows that name the rank's exception (column note), keyed
    as the rows they stand for, so that a later run that succeeds replaces them."""
    monkeypatch.setattr(scaling.log, "path", None)  # restored after main() sets it
    out = tmp_path / "cpu.csv"
    argv = ["scaling", "--quick", "--parts", "exactness", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    spawn = scaling.spawn_ranks

    def failing(world_size, fn, *args, **kw):
        raise RuntimeError(f"\n\n-- Process {world_size - 1} terminated with the following "
                           "error:\nTraceback (most recent call last):\n  File \"x.py\"\n"
                           "RuntimeError: Unable to handle autograd's threading in "
                           "combination with fork-based multiprocessing.\n")
    monkeypatch.setattr(scaling, "spawn_ranks", failing)
    scaling.main()
    cfg = scaling.Config(**scaling.QUICK)
    df = pd.read_csv(out)
    assert (df["status"] == "error").all() and df["value"].isna().all()
    assert len(df) == len(cfg.exact_ranks) * len(cfg.exact_dtypes) * len(cfg.layouts)
    assert (df["note"] == "RuntimeError: Unable to handle autograd's threading in "
                          "combination with fork-based multiprocessing.").all()
    assert set(df["seqlen_q"]) == {r * cfg.exact_tokens_per_rank for r in cfg.exact_ranks}

    monkeypatch.setattr(scaling, "spawn_ranks", spawn)
    scaling.main()
    df = pd.read_csv(out)
    assert (df["status"] == "ok").all(), df[df["status"] != "ok"].to_dict("records")
