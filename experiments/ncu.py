"""RQ2 on the GPU: Nsight Compute's DRAM and L2 bytes of io_complexity's plan, beside the model.

    python3 -m experiments.gpu_campaign --probe ncu --probe-out results/io_complexity/h100.csv -- 300

The campaign's stage 2 runs this as its step `ncu` (experiments/gpu_campaign.py; GPU.md, "RQ2
under Nsight Compute"). Each configuration of ncu_probe_plan (forward, non-causal, d128, 16
heads, 1K-64K tokens; LongFlash, SDPA's FlashAttention-2, standard attention up to 16K) is a
fresh process under `ncu --clock-control none --nvtx --nvtx-include io_target/ --metrics
NCU_METRICS --print-units base --csv` (experiments.io_complexity --ncu-target: one call inside
the NVTX range), in a session of its own (experiments.process_groups), killed with its target
at NCU_CONFIG_TIMEOUT_S or at the budget. Configurations whose working set exceeds the L2 cache
come first (order_ncu_plan). Rows (experiment "io_complexity_ncu", metrics NCU_METRICS in
bytes, with the model's prediction model_hbm_bytes and working_set_bytes) are merged into the
results file after each configuration; those the budget does not reach keep rows with status
"error" and note NCU_NOT_MEASURED; configurations already "ok" there are not measured again.
Without ncu (or a GPU) every row is "unsupported"; ncu's raw output is appended to
<results stem>.ncu.log.
"""

import csv
import io
import json
import os
import shlex
import shutil
import sys
import time

from experiments.process_groups import kill_children_on_sigterm, run_group, track_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NCU_METRICS = "dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum"
# ncu: one configuration is a fresh process (start-up, a warm-up that autotunes, the profiled
# call replayed once per pass of the metrics): 15-60 s on an H100; cut at this.
NCU_CONFIG_TIMEOUT_S = 120
# Beside experiments.results.KEY_COLUMNS: a row of a model size is its own measurement.
KEY_COLUMNS = ("model_hbm_bytes",)
NCU_CONFIG_MIN_S = 20      # a configuration is started only with this much of the budget left
NCU_NOT_MEASURED = "not measured: stage budget"
L2_DEFAULT_BYTES = 50 * 2**20  # an H100's (an H200 reports 60 MB); where the device does not say


def ncu_working_set(p):
    """Bytes a configuration of the ncu plan touches: q, k, v, o, plus the N x N scores and
    probabilities that standard attention materializes."""
    el = 2 if p["dtype"] in ("bfloat16", "float16") else 4
    qkvo = 4 * p["batch"] * p["seqlen"] * p["nheads"] * p["headdim"] * el
    scores = 2 * p["batch"] * p["nheads"] * p["seqlen"] ** 2 * el
    return qkvo + (scores if p["provider"] == "standard" else 0)


def order_ncu_plan(plan, l2_bytes):
    """Most informative first (RQ2 asks whether HBM traffic follows the model once the working
    set exceeds L2; below L2 DRAM sees little more than the compulsory bytes): configurations
    whose working set exceeds `l2_bytes`, then the others; within each, shorter sequences first
    (the cost grows as N^2, so a cut budget keeps the most configurations and every provider at
    each length before the next length)."""
    providers = ["longflash", "sdpa_flash", "standard"]
    rank = lambda p: providers.index(p["provider"]) if p["provider"] in providers else 99  # noqa
    return sorted(plan, key=lambda p: (ncu_working_set(p) <= l2_bytes, p["seqlen"], rank(p)))


def _l2_bytes():
    import torch
    if torch.cuda.is_available():
        size = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", None)
        if size:
            return int(size)
    return L2_DEFAULT_BYTES


def ncu_probe_plan(dry=False):
    """The configurations of io_complexity's plan that the ncu step profiles (unordered):
    forward, non-causal, d128, 16 heads, 1K-64K tokens, standard attention up to 16K; a dry
    run: LongFlash at 128 tokens, one head."""
    from experiments import io_complexity
    return [p for p in io_complexity.ncu_plan(
        seqlens=(128,) if dry else (1024, 4096, 16384, 65536), headdims=(128,),
        providers=("longflash",) if dry else ("longflash", "sdpa_flash", "standard"),
        nheads=1 if dry else 16)
        if p["mode"] == "fwd" and not p["causal"]
        and not (p["provider"] == "standard" and p["seqlen"] > 16384)]


def probe_ncu(out, budget_s=None, start=None):
    """RQ2 on the GPU: ncu's DRAM and L2 bytes for configurations of io_complexity's plan that
    cross the L2 size, beside the model's prediction; rows in `out`, written after each
    configuration (measure_ncu)."""
    import torch
    from experiments import io_complexity
    dry = not torch.cuda.is_available()
    plan = ncu_probe_plan(dry)
    l2 = _l2_bytes()
    plan = order_ncu_plan(plan, l2)
    print(f"ncu: {len(plan)} configurations, L2 {l2 / 2**20:.0f} MiB, budget "
          f"{budget_s if budget_s is not None else 'none'} s", flush=True)
    ncu = shutil.which("ncu")
    if dry or ncu is None:
        why = "no GPU" if dry else "ncu not found"

        def run(p, timeout):
            if dry:  # the profiled code path itself, once, tiny, on CPU
                io_complexity.run_target(_ncu_spec(p) | dict(dtype="float32"))
            return {}, "unsupported", why
    else:
        log_path = os.path.splitext(out)[0] + ".ncu.log"
        run = lambda p, timeout: _run_ncu(ncu, p, timeout, log_path)  # noqa: E731
    # If the step is stopped from outside (its timeout), ncu and its target go too: they run
    # in a session of their own (so that a configuration's timeout kills them alone).
    kill_children_on_sigterm()
    measure_ncu(plan, out, run, budget_s, start=start)


def _ncu_spec(p):
    return {k: p[k] for k in ("provider", "mode", "batch", "seqlen", "nheads", "headdim",
                              "causal", "dtype")}


def _ncu_rows(p, sums, status, note):
    nan = float("nan")
    base = dict(experiment="io_complexity_ncu", provider=p["provider"], mode=p["mode"],
                dtype=p["dtype"], batch=p["batch"], seqlen_q=p["seqlen"], seqlen_k=p["seqlen"],
                nheads=p["nheads"], nheads_kv=p["nheads"], headdim=p["headdim"],
                causal=p["causal"], p20=nan, p80=nan, model_hbm_bytes=p["model_hbm_bytes"],
                working_set_bytes=ncu_working_set(p))
    rows = []
    for m in NCU_METRICS.split(","):
        found = status == "ok" and m in sums
        rows.append(dict(base, metric=m, value=sums[m] if found else nan, unit="bytes",
                         status="ok" if found else ("error" if status == "ok" else status),
                         note=note if found or status != "ok" else f"{m} missing in ncu's output"))
    return rows


def _ncu_done(out):
    """Configurations (as _ncu_key) whose every metric has an "ok" row in `out` already: a
    results file seeded from the repository, or a rerun of the stage, does not measure them
    again."""
    if not os.path.exists(out):
        return set()
    import pandas as pd
    df = pd.read_csv(out)
    if "experiment" not in df.columns:
        return set()
    df = df[(df["experiment"] == "io_complexity_ncu") & (df["status"] == "ok")]
    ok = {}
    for rec in df.to_dict("records"):
        ok.setdefault(_ncu_key(rec, "seqlen_q"), set()).add(rec["metric"])
    return {k for k, ms in ok.items() if set(NCU_METRICS.split(",")) <= ms}


def _ncu_key(p, seqlen="seqlen"):
    """A configuration's identity, from a plan entry or (seqlen="seqlen_q") a results row."""
    from experiments.results import _key_str
    return tuple(_key_str(p[c]) for c in ("provider", "mode", "dtype", "batch", seqlen,
                                          "nheads", "headdim", "causal"))


def measure_ncu(plan, out, run, budget_s=None, clock=time.monotonic, start=None):
    """Each configuration of `plan` in turn: run(p, timeout) -> (sums, status, note); its rows
    are merged into `out` (atomically) right after it, so a timeout keeps what was measured.
    Before the first, every configuration still to measure gets rows with status "error" and
    note NCU_NOT_MEASURED, so those that the budget (`budget_s` seconds from now; the step's
    "{budget}", counted from `start`, default now) does not reach, or that a kill interrupts,
    say so."""
    from experiments.results import write_results
    deadline = (clock() if start is None else start) + (
        budget_s if budget_s is not None else float("inf"))
    done = _ncu_done(out)
    todo = [p for p in plan if _ncu_key(p) not in done]
    if len(todo) < len(plan):
        print(f"ncu: {len(plan) - len(todo)} configurations measured already", flush=True)
    if not todo:
        return

    def write(rows):
        write_results(rows, out, key_columns=KEY_COLUMNS)
    write([r for p in todo for r in _ncu_rows(p, {}, "error", NCU_NOT_MEASURED)])
    for i, p in enumerate(todo):
        left = deadline - clock()
        if left < NCU_CONFIG_MIN_S:
            print(f"ncu: {left:.0f} s left: {len(todo) - i} configurations "
                  f"{NCU_NOT_MEASURED}", flush=True)
            break
        sums, status, note = run(p, min(NCU_CONFIG_TIMEOUT_S, left))
        write(_ncu_rows(p, sums, status, note))
        print(f"ncu: {p['provider']} N={p['seqlen']}: {status} {sums} "
              f"(model {p['model_hbm_bytes']:.3g} B, working set "
              f"{ncu_working_set(p) / 2**20:.0f} MiB) {note}", flush=True)


def _run_ncu(ncu, p, timeout, log_path):
    """One configuration under ncu, in a session of its own, killed with its target at the
    timeout. --print-units base: byte counts in bytes (parse_ncu_csv still scales any other
    unit it is given)."""
    argv = [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "io_target/",
            "--metrics", NCU_METRICS, "--print-units", "base", "--csv", sys.executable, "-m",
            "experiments.io_complexity", "--ncu-target", json.dumps(_ncu_spec(p))]
    t0 = time.monotonic()
    rc, stdout, stderr = run_group(argv, timeout, cwd=ROOT, started=track_child)
    wall = time.monotonic() - t0
    with open(log_path, "a") as f:
        f.write(f"== {shlex.join(argv)} (exit {rc}, {wall:.0f} s)\n{stdout[-20000:]}\n"
                f"{stderr[-5000:]}\n")
    if rc is None:
        return {}, "error", f"ncu timed out after {wall:.0f} s"
    sums = parse_ncu_csv(stdout)
    if rc != 0 or not sums:
        last = ([ln for ln in (stdout + stderr).splitlines() if ln.strip()] or [""])[-1]
        return sums, "error", f"ncu exit {rc}: {last[:200]}"
    return sums, "ok", f"ncu, {wall:.0f} s"


_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "kibyte": 2**10, "mibyte": 2**20, "gibyte": 2**30, "tibyte": 2**40,
          "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}


def parse_ncu_csv(text):
    """Sum each metric over the kernels of ncu's --csv output, in bytes."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    sums = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        name, unit, value = rec.get("Metric Name"), rec.get("Metric Unit", ""), \
            rec.get("Metric Value")
        if not name or value is None:
            continue
        unit = (unit or "").strip().lower()
        if unit and unit not in _UNITS:
            continue  # not a byte count (never asked for); guessing its scale would be worse
        try:
            v = float(value.replace(",", "")) * _UNITS.get(unit, 1)
        except ValueError:
            continue
        sums[name] = sums.get(name, 0.0) + v
    return sums
