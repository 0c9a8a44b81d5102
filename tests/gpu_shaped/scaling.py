"""GPU-shaped RQ3 rows: what experiments.scaling writes on the GPU machine, NOT measurements.

The campaign's stage 2 (experiments/gpu_campaign.py) runs scaling twice into
results/scaling/h100.csv:

    step scaling:       --full --parts long,blocks,projection --long-seqlens 65536 --long-budget-s 60
        1. one GPU: longflash.attention forward+backward over gpu_long_seqlen (1M) tokens,
           written first (part long, layout none; time_ms, tflops, peak_mem_mb, or the three
           with status oom / error), then its check on sampled rows (mode fwd:
           max_err_o_sampled, error_bound_o_sampled);
        2. blocks on the GPU (time_ms, tflops per BLOCKS entry and mode), then the alpha-beta
           projection from them (scaling._projection itself computes those rows here);
        3. the ring of long_ranks gloo ranks on the machine's CPU at 64K tokens (part long,
           layout zigzag; time_ms, peak_mem_mb, max_err_o_sampled, error_bound_o_sampled), or
           scaling._failed rows.
    step scaling_exact: --full --parts exactness, gloo ranks on the machine's CPU.

Rows measured on the CPU of the GPU machine carry that CPU as their device (scaling._on_device);
the rest the GPU. Configurations, shapes, keys and row layout come from experiments.scaling
(Config(**FULL), BLOCKS, _row, _projection, _failed), so this follows the script. Values are
made up, of a plausible size, from a seeded generator.
"""

import math
from dataclasses import asdict, replace

import numpy as np

from experiments import scaling
from experiments.results import Log, flops, start_run, tflops, write_results
from . import as_gpu, path

HOST_CPU = "Intel(R) Xeon(R) Platinum 8480+"  # made up: the GPU machine's CPU (16 cores there)
HOST_CORES = 16
# The campaign's arguments of the two steps (experiments/gpu_campaign.py, stage_steps, stage 2).
STEP_SCALING = dict(parts=["long", "blocks", "projection"], long_seqlens=(65536,),
                    long_budget_s=60.0)
STEP_EXACT = dict(parts=["exactness"])
# Everything write() can produce, in the order the two steps write it.
PIECES = ("one_gpu", "blocks", "projection", "ring_long", "exactness")


def config():
    """The resolved config of the campaign's scaling step (--full and its overrides)."""
    return replace(scaling.Config(**scaling.FULL), long_seqlens=STEP_SCALING["long_seqlens"],
                   long_budget_s=STEP_SCALING["long_budget_s"])


def _host(rows):
    """Rows that the GPU machine's CPU measured (gloo ranks): its name and core count."""
    return [dict(r, device=HOST_CPU, cores=HOST_CORES) for r in rows]


def one_gpu_rows(cfg, status="ok", rng=None, exact=True):
    """scaling._gpu_long on the GPU: forward+backward over gpu_long_seqlen tokens, bf16,
    timed leanly (time_ms_lean), and its exactness check (within the bound, or with exact
    False beyond it); status "oom" / "error": its three failure rows."""
    seqlen, shape = cfg.gpu_long_seqlen, cfg.gpu_long_shape
    row = lambda *a, **kw: scaling._row(shape, "bfloat16", "long", "none", 1, seqlen,  # noqa
                                        "fwd_bwd", *a, **kw)
    if status != "ok":
        return [dict(row(m, math.nan, u, status=status), cores=HOST_CORES)
                for m, u in (("time_ms", "ms"), ("tflops", "TFLOP/s"), ("peak_mem_mb", "MiB"))]
    rng = rng or np.random.default_rng(0)
    fl = flops(shape[0], seqlen, seqlen, shape[1], shape[3], True, "fwd_bwd")
    med = fl / 340e12 * 1e3 * rng.uniform(0.95, 1.05)  # about 340 TFLOP/s
    rows = [row("time_ms", med, "ms", p20=0.995 * med, p80=1.004 * med),
            row("tflops", tflops(fl, med), "TFLOP/s"),
            row("peak_mem_mb", 4.6 * 1024 * rng.uniform(0.98, 1.02), "MiB")]
    # scaling._gpu_long_exactness: one forward call checked on sampled rows (mode fwd)
    bound = 2 * 3.9e-3 * rng.uniform(0.9, 1.1) + 4 * 2**-7
    rows += [dict(row("max_err_o_sampled", bound * (0.3 if exact else 1.5), "abs"), mode="fwd"),
             dict(row("error_bound_o_sampled", bound, "abs"), mode="fwd")]
    return [dict(r, cores=HOST_CORES) for r in rows]


def block_times(cfg, rng):
    """{block: {mode: ms}} as scaling._blocks returns them, and its rows (GPU)."""
    T, shape, dtype = cfg.block_tokens_per_rank, cfg.block_shape, cfg.block_dtype
    speed = {"fwd": 330e12, "bwd": 250e12}  # FLOP/s; causal blocks lose some to masking
    times, rows = {}, []
    for name, (fq, fk, causal) in scaling.BLOCKS.items():
        nq, nk = int(fq * T), int(fk * T)
        for mode in ("fwd", "bwd"):
            fl = flops(shape[0], nq, nk, shape[1], shape[3], causal, mode)
            med = fl / (speed[mode] * (0.85 if causal else 1.0)) * 1e3 * rng.uniform(0.97, 1.03)
            times.setdefault(name, {})[mode] = med
            row = lambda *a, **kw: scaling._row(shape, dtype, "blocks", "none", 1, T, mode,  # noqa
                                                *a, seqlen_q=nq, seqlen_k=nk, causal=causal, **kw)
            rows += [row("time_ms", med, "ms", p20=0.99 * med, p80=1.01 * med),
                     row("tflops", tflops(fl, med), "TFLOP/s")]
    return times, [dict(r, cores=HOST_CORES) for r in rows]


def ring_long_rows(cfg, rng):
    """scaling._long on long_ranks gloo ranks of the host CPU: its one length (64K)."""
    rows = []
    for seqlen in cfg.long_seqlens:
        row = lambda *a, **kw: scaling._row(cfg.long_shape, cfg.dtype, "long", "zigzag",  # noqa
                                            cfg.long_ranks, seqlen // cfg.long_ranks, "fwd",
                                            *a, **kw)
        rows += [row("time_ms", 9000 * (seqlen / 65536) ** 2 * rng.uniform(0.9, 1.1), "ms"),
                 row("peak_mem_mb", 6.0 * rng.uniform(0.9, 1.1), "MiB"),
                 row("max_err_o_sampled", 4e-9 * rng.uniform(0.5, 1.5), "abs"),
                 row("error_bound_o_sampled", 2e-6 * rng.uniform(0.9, 1.1), "abs")]
    return _host(rows)


def exactness_rows(cfg, rng):
    """scaling._exactness for every ring size of exact_ranks (host CPU): per dtype, the ring
    in each layout, longflash on one device and standard in the input dtype."""
    base = {"float32": 1e-6, "bfloat16": 8e-3}  # standard's error in the input dtype
    rows = []
    for world_size in cfg.exact_ranks:
        seqlen = world_size * cfg.exact_tokens_per_rank
        for dtype in cfg.exact_dtypes:
            results = [("longflash", layout, world_size, 1.2) for layout in cfg.layouts]
            results += [("longflash", "none", 1, 1.0), ("standard", "none", 1, 2.0)]
            for provider, layout, ranks, scale in results:
                for name in ("o", "lse", "dq", "dk", "dv"):
                    err = base[dtype] * scale * rng.uniform(0.8, 1.2)
                    rows.append(scaling._row(
                        cfg.shape, dtype, "exactness", layout, ranks, seqlen // ranks,
                        "fwd" if name in ("o", "lse") else "bwd", f"max_err_{name}", err, "abs",
                        causal=cfg.causal, provider=provider))
    return _host(rows)


def failed_rows(cfg, part):
    """scaling._failed for a ring part whose gloo ranks failed at every ring size."""
    sizes = cfg.exact_ranks if part == "exactness" else (cfg.long_ranks,)
    cfg = cfg if part == "exactness" else replace(cfg, layouts=("zigzag",))
    return _host([r for n in sizes for r in scaling._failed(
        cfg, [part], n, RuntimeError("gloo rank exited (made up)"))])


def write(results_dir, pieces=PIECES, one_gpu="ok", failed=(), exact=True):
    """results_dir/scaling/h100.csv (+ .json, .log) as stage 2 of the campaign leaves them.

    pieces: which of PIECES exist (a partial stage: e.g. ("one_gpu",) when the step was killed
    after its first rows); one_gpu: the status of the 1M-token run ("ok", "oom", "error");
    failed: ring pieces ("ring_long", "exactness") whose gloo ranks failed (status error);
    exact: whether the 1M-token run's sampled error is within its bound."""
    unknown = set(pieces) - set(PIECES)
    if unknown:
        raise ValueError(f"pieces: unknown {sorted(unknown)}; choose from {PIECES}")
    rng = np.random.default_rng(3)
    cfg = config()
    out = path(results_dir, "scaling")
    with as_gpu():
        steps = [(STEP_SCALING, ("one_gpu", "blocks", "projection", "ring_long")),
                 (STEP_EXACT, ("exactness",))]
        for step, names in steps:
            if not set(names) & set(pieces):
                continue
            step_cfg = cfg if step is STEP_SCALING else scaling.Config(**scaling.FULL)
            start_run("scaling", out, Log(), dict(asdict(step_cfg), parts=step["parts"]),
                      "GPU-shaped rows (tests/gpu_shaped/scaling.py): made up, not measured")
            times = None
            for name in (n for n in names if n in pieces):
                if name in failed:
                    rows = failed_rows(cfg, "long" if name == "ring_long" else name)
                elif name == "one_gpu":
                    rows = one_gpu_rows(cfg, one_gpu, rng, exact)
                elif name == "blocks":
                    times, rows = block_times(cfg, rng)
                elif name == "projection":
                    times = times or block_times(cfg, rng)[0]
                    rows = [dict(r, cores=HOST_CORES)
                            for r in scaling._projection(cfg, times, cfg.block_device)]
                elif name == "ring_long":
                    rows = ring_long_rows(cfg, rng)
                else:
                    rows = exactness_rows(cfg, rng)
                write_results(rows, out, key_columns=scaling.KEY_COLUMNS)
    return out
