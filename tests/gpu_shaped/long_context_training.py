"""GPU-shaped RQ4 rows: what `experiments.long_context_training --full` writes on an H100 in the
campaign's stage 3 (made-up values, never measurements; only ever written into a scratch folder).

The run is the campaign's own: the argv of the long_context step of
experiments.gpu_campaign.stage_steps(3) (--full, parts max_context, memory_model, exactness,
--budget-s: the step's timeout less its tail), resolved into the script's Config. The parts run
in the script's order (exactness, memory_model, max_context) and their rows come from the
script's own code: memory_model and max_context are experiments.long_context_training's
part_memory_model and part_max_context with probe_step replaced by a made-up memory model of
one training step (peak = c0 + c1 s + c2 s^2 MiB; "oom" above the 80 GB budget), and with a
fake clock, so the searches' doubling, bisection at 1/8 of the bracket, time budget, notes
("N did not fit", "lower bound: ...", "not measured: time budget") and the 7B projection rows
are exactly the script's. Exactness rows are built with the script's row() as part_exactness
builds them (bfloat16 loss curves differing by rounding).

With the step's budget (270 s) the run ends like this: GPT-2 small's three searches finish
(standard 8K, sdpa_flash and longflash 240K tokens), GPT-2 medium's standard search finishes,
and its sdpa_flash and longflash searches are cut by the time budget (lower bounds, "still
doubling"). With budget_s=107 (a stage that ran late) GPT-2 small's standard search finishes,
its other two stop at their first length (lower bounds), and none of GPT-2 medium's starts
("not measured: time budget").

    from tests.gpu_shaped import long_context_training as lct_gpu
    lct_gpu.write(tmp_path / "results")                          # the whole step
    lct_gpu.write(tmp_path / "results", parts=("exactness",))     # killed after exactness
    lct_gpu.write(tmp_path / "results", budget_s=0)               # no search started
"""

import math
from contextlib import ExitStack
from dataclasses import replace
from unittest import mock

import numpy as np

from . import as_gpu, path

# Made-up memory model of one bf16 training step (batch 1, AdamW), MiB: model states and
# workspace (c0), activations per token (c1: about 34 bytes per token and unit of width and
# layer, Korthikanti et al., plus the block's temporaries), and for materialized attention the
# score, softmax and gradient matrices (c2, bytes per token^2 and head and layer).
C1_BYTES_PER_TOKEN_WIDTH_LAYER = {"longflash": 36.0, "sdpa_flash": 35.0, "standard": 38.0}
C2_BYTES_PER_TOKEN2_HEAD_LAYER = {"longflash": 0.0, "sdpa_flash": 0.0, "standard": 7.0}
PARAMS = {"L12-d768-h12": 85e6, "L24-d1024-h16": 302e6, "L2-d128-h4": 0.5e6}
# Made-up seconds: a training step at s tokens takes about SECONDS_PER_TOKEN * s * (L * h) /
# (12 * 768) (256K tokens of GPT-2 small: about 11 s), plus a fixed second.
SECONDS_PER_TOKEN = 4e-5
EXACTNESS_S, MEMORY_BUILD_S = 60.0, 8.0   # three 100-step runs; building the model once


def campaign_argv():
    """The argv of the campaign's stage-3 long_context step, after `-m module`."""
    from experiments import gpu_campaign
    step = next(s for s in gpu_campaign.stage_steps(3, dry=False)
                if s.rq == "long_context_training")
    return step, step.argv[2:]


def config(budget_s=None):
    """experiments.long_context_training.Config as main() resolves the campaign's argv
    (--full, --budget-s {budget}: the step's timeout less its tail unless budget_s is given)."""
    from experiments import long_context_training as lct
    step, argv = campaign_argv()
    cfg = lct.Config(**(lct.FULL if "--full" in argv else {}))
    if budget_s is None:
        budget_s = step.timeout_s - step.tail_s
    return replace(cfg, time_budget_s=float(budget_s))


def campaign_parts():
    _, argv = campaign_argv()
    return argv[argv.index("--parts") + 1].split(",")


def peak_mb(model, provider, seqlen, rng=None):
    from experiments.long_context_training import parse_model
    n_layer, n_embd, n_head = parse_model(model)
    c0 = 16 * PARAMS[model] / 2**20 + 600  # weights, gradients, AdamW's two moments; workspace
    c1 = C1_BYTES_PER_TOKEN_WIDTH_LAYER[provider] * n_embd * n_layer / 2**20
    c2 = C2_BYTES_PER_TOKEN2_HEAD_LAYER[provider] * n_head * n_layer / 2**20
    noise = 1.0 if rng is None else rng.uniform(0.995, 1.005)
    return (c0 + c1 * seqlen + c2 * seqlen**2) * noise


def step_seconds(model, seqlen):
    from experiments.long_context_training import parse_model
    n_layer, n_embd, _ = parse_model(model)
    return 1.0 + SECONDS_PER_TOKEN * seqlen * n_layer * n_embd / (12 * 768)


def exactness_rows(cfg, rng):
    """part_exactness's rows: train_loss per step for longflash, standard and sdpa_flash,
    trained side by side, and max_loss_diff of longflash and sdpa_flash against standard."""
    from experiments.long_context_training import row
    steps = np.arange(1, cfg.exact_steps + 1)
    base = 2.4 + 3.1 * np.exp(-steps / 25) + rng.normal(0, 0.03, len(steps))
    curves = {"longflash": base + rng.normal(0, 4e-3, len(steps)), "standard": base,
              "sdpa_flash": base + rng.normal(0, 3e-3, len(steps))}
    rows = [row(cfg, "exactness", p, cfg.quality_model, cfg.exact_context, cfg.exact_batch,
                "train_loss", float(v), "nats", step=i + 1)
            for p, c in curves.items() for i, v in enumerate(c)]
    for p in ("longflash", "sdpa_flash"):
        diff = float(np.abs(curves[p] - curves["standard"]).max())
        rows.append(row(cfg, "exactness", p, cfg.quality_model, cfg.exact_context,
                        cfg.exact_batch, "max_loss_diff", diff, "nats", step=cfg.exact_steps))
    return rows


def write(results_dir, parts=None, budget_s=None, error_from=None, seed=4):
    """results_dir/long_context_training/h100.csv as the campaign's long_context step leaves
    it. parts: the parts that ran before the step ended (default: the campaign's; they run in
    the script's order whatever the order given); budget_s: its --budget-s (default: the
    step's); error_from {provider: tokens}: that provider's training step raises an error
    (not an out-of-memory one) from that many tokens on, as a kernel that breaks at long
    contexts would (probe_step's status "error"). Returns the path."""
    from experiments import long_context_training as lct
    from experiments.results import write_results
    cfg = config(budget_s)
    parts = campaign_parts() if parts is None else list(parts)
    out = path(results_dir, "long_context_training")
    _, argv = campaign_argv()
    command = ("tests/gpu_shaped/long_context_training.py, made-up values shaped like: "
               "python3 -m experiments.long_context_training " + " ".join(argv))
    rng = np.random.default_rng(seed)
    clock = [0.0]  # seconds since the run started

    def probe_step(cfg, model, provider, seqlen, budget_mb):
        clock[0] += step_seconds(model, seqlen)
        if error_from and seqlen >= error_from.get(provider, math.inf):
            return "error", math.nan
        peak = peak_mb(model, provider, seqlen, rng)
        if peak > 80 * 1024:  # the whole GPU: a real CUDA out-of-memory error, no peak
            return "oom", math.nan
        return ("ok", peak) if budget_mb is None or peak <= budget_mb else ("oom", peak)

    def emit(rows):
        write_results(rows, out, command=command, key_columns=lct.KEY_COLUMNS)

    with as_gpu(), ExitStack() as stack:
        stack.enter_context(mock.patch.object(lct, "probe_step", probe_step))
        stack.enter_context(mock.patch.object(lct, "release_models", lambda cfg: None))
        stack.enter_context(mock.patch.object(lct, "log", lambda message: None))
        for part in [p for p in lct.PARTS if p in parts]:
            if part == "exactness":
                emit(exactness_rows(cfg, rng))
                clock[0] += EXACTNESS_S
            elif part == "memory_model":
                clock[0] += MEMORY_BUILD_S
                emit(lct.part_memory_model(cfg))
            elif part == "max_context":
                lct.part_max_context(cfg, emit, deadline=cfg.time_budget_s,
                                     clock=lambda: clock[0])
            else:
                raise ValueError(f"part {part!r}: the campaign runs {campaign_parts()}")
    return out
