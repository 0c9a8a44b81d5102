"""RQ2 on an H100, GPU-shaped: the rows the campaign's ncu step writes (made-up bytes).

The configurations are the ncu step's own (experiments.ncu.ncu_probe_plan, in the order
of order_ncu_plan), and the rows are written by the step's own measure_ncu and _ncu_rows with a
stand-in for ncu: experiment "io_complexity_ncu", metrics dram__bytes_read.sum,
dram__bytes_write.sum, lts__t_bytes.sum (bytes), extra columns model_hbm_bytes and
working_set_bytes, a note; configurations the budget did not reach keep status "error" and note
NCU_NOT_MEASURED; without ncu every row is "unsupported". Beside them, the stage's env JSON
(results/gpu_campaign/h100-stage2-env.json) with the L2 size the campaign records.

Made-up values of a plausible size, not measurements: DRAM read + write near the model's
prediction (LongFlash within a few percent, SDPA's FlashAttention-2 a little below, standard
attention above, its softmax making more passes than the idealized count) once the working set
exceeds L2, and near the compulsory bytes (q, k, v read, o written) while it fits; L2 bytes
larger than DRAM bytes.
"""

import json
import os

import numpy as np

from tests import gpu_shaped

L2_BYTES = 50 * 2**20  # what an H100 SXM reports (torch: L2_cache_size)


def _bytes(p, l2_bytes, rng):
    """Made-up ncu sums for one configuration of the plan: {metric: bytes}."""
    from experiments.ncu import ncu_working_set
    model, working_set = p["model_hbm_bytes"], ncu_working_set(p)
    el = 2 if p["dtype"] in ("bfloat16", "float16") else 4
    o = p["batch"] * p["seqlen"] * p["nheads"] * p["headdim"] * el
    scores = 2 * p["batch"] * p["nheads"] * p["seqlen"] ** 2 * el  # S and P, written once
    if working_set > l2_bytes:
        factor = dict(longflash=rng.uniform(0.95, 1.06), sdpa_flash=rng.uniform(0.90, 0.99),
                      standard=rng.uniform(1.05, 1.25))[p["provider"]]
        dram = model * factor
    else:  # K/V re-reads hit L2: DRAM sees about the compulsory bytes
        dram = working_set * rng.uniform(1.0, 1.1)
    written = o + (scores if p["provider"] == "standard" else 0)
    return {"dram__bytes_read.sum": round(dram - written), "dram__bytes_write.sum": written,
            "lts__t_bytes.sum": round(max(model, dram) * rng.uniform(1.2, 1.8))}


def write(results_dir, reached=None, ncu=True, missing=("sdpa_flash", 65536, "lts__t_bytes.sum"),
          l2_recorded=True, seed=0):
    """results_dir/io_complexity/h100.csv as the campaign's ncu step writes it.

    reached: how many configurations (in the step's order) the budget reached; the others keep
    "not measured: stage budget" (default: all but the last two, LongFlash's and SDPA's at 1K,
    whose working sets fit in L2 and so come last). 0: the step was killed before measuring
    anything. ncu=False: ncu was not found, every configuration "unsupported".
    missing: (provider, seqlen, metric) that ncu's output lacks (status "error"), or None.
    l2_recorded: write the stage's env JSON with the L2 size (else the notebook falls back to
    experiments.ncu.L2_DEFAULT_BYTES).
    """
    from experiments import ncu as ncu_probe
    rng = np.random.default_rng(seed)
    plan = ncu_probe.order_ncu_plan(ncu_probe.ncu_probe_plan(), L2_BYTES)
    reached = len(plan) - 2 if reached is None else reached

    def run(p, timeout):
        clock.now += 30.0  # a configuration takes 30 s of the (pretend) stage budget
        if not ncu:
            return {}, "unsupported", "ncu not found"
        sums = _bytes(p, L2_BYTES, rng)
        if missing and (p["provider"], p["seqlen"]) == tuple(missing[:2]):
            sums.pop(missing[2])
        return sums, "ok", "ncu, 30 s"

    def clock():
        return clock.now
    clock.now = 0.0
    out = gpu_shaped.path(results_dir, "io_complexity")
    # measure_ncu starts a configuration only with NCU_CONFIG_MIN_S left: this budget reaches
    # exactly `reached` of them (every one when ncu is missing: each takes no time then).
    budget = 30.0 * reached + ncu_probe.NCU_CONFIG_MIN_S - 1 if ncu else None
    with gpu_shaped.as_gpu():
        ncu_probe.measure_ncu(plan, out, run, budget_s=budget, clock=clock, start=0.0)
    if l2_recorded:
        env = os.path.join(str(results_dir), "gpu_campaign", f"{gpu_shaped.TAG}-stage2-env.json")
        os.makedirs(os.path.dirname(env), exist_ok=True)
        with open(env, "w") as f:  # the keys of gpu_campaign.probe_env that matter here
            json.dump(dict(device=gpu_shaped.GPU, capability="9.0", sm_count=132,
                           memory_mb=81008.0, l2_bytes=L2_BYTES, ncu="/usr/local/cuda/bin/ncu",
                           cuda_available=True), f, indent=1)
    return out
