"""GPU-shaped RQ1 rows: what `experiments.speedup --full` writes on an H100 over the campaign's
three stages (made-up values, never measurements; only ever written into a scratch folder).

The configurations are the campaign's own: the argv of each speedup step of
experiments.gpu_campaign.stage_steps (stage 1: part batch at head dims 128 then 64; stage 2:
part long at head dim 128 and part batch at head dim 256; stage 3: part decode), resolved into
experiments.speedup.Config the way speedup.main does, its groups from speedup.groups, and the
rows built by the script's own row functions (speedup._rows, decode._rows), so the columns,
units and status rules follow the script. Failures where an H100 run has them:
  standard, sdpa_math   "oom" where their N x N matrices exceed the 80 GB
  sdpa_cudnn            "unsupported" at head dim 256 (every mode, inherited as in run())
  flex                  "unsupported" at head dim 256 from fwd_bwd on (out of shared memory)
  decode: sdpa_efficient "unsupported" (a backend that refuses grouped-query attention)
and, for the partial-run tests, `error_parts` / `error_providers` turn rows into "error".

    from tests.gpu_shaped import speedup
    speedup.write(tmp_path / "results")                  # all three stages
    speedup.write(tmp_path / "results", stages=(1,))     # the GPU window ended after stage 1
"""

import math
from dataclasses import replace

import numpy as np

from . import as_gpu, path

GPU_MEMORY_MB = 80 * 1024
# Made-up throughputs (TFLOP/s, bf16, forward, long sequences) and the sequence length at which
# each provider reaches half of it; backward runs at BWD_FRACTION of the forward's rate.
PEAK_TFLOPS = {"longflash": 560, "sdpa_flash": 360, "sdpa_cudnn": 520, "sdpa_efficient": 200,
               "flex": 420, "sdpa_math": 90, "standard": 80}
HALF_AT = {"longflash": 1500, "sdpa_flash": 900, "sdpa_cudnn": 1200, "sdpa_efficient": 800,
           "flex": 1400, "sdpa_math": 300, "standard": 300}
BWD_FRACTION = {"longflash": 0.72, "sdpa_flash": 0.75, "sdpa_cudnn": 0.7, "sdpa_efficient": 0.6,
                "flex": 0.62, "sdpa_math": 0.8, "standard": 0.8}
MATMUL_TFLOPS, COPY_GBPS = 742.0, 2950.0
MACHINE = dict(cores=16, threads=math.nan, mem_budget_mb=math.nan)


def campaign_configs(stages=(1, 2, 3)):
    """[(stage, argv, Config, switches)] of every speedup step of the GPU campaign's stages, in
    order; switches: the NAME=value words its rows' command starts with if the gates before it
    in its stage pass (Step.then_env: LONGFLASH_WS=fwd after stage 8's)."""
    from experiments import gpu_campaign
    out = []
    for stage in stages:
        env = {}
        for step in gpu_campaign.stage_steps(stage, dry=False):
            if step.rq == "speedup":
                argv = step.argv[step.argv.index("--") + 1:]
                out.append((stage, argv, config(argv), [f"{k}={v}" for k, v in env.items()]))
            env.update(step.then_env)
    return out


def config(argv):
    """experiments.speedup.Config of a command line, as speedup.main resolves the options that
    the campaign uses (--full, --headdims, --seqlens, --long-seqlens, --parts)."""
    from experiments import speedup
    args = dict(zip(argv, argv[1:] + [""]))
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    cfg = speedup.Config(**(speedup.FULL if "--full" in argv else {}))
    if "--headdims" in args:
        d = ints(args["--headdims"])
        cfg = replace(cfg, headdims=d, long_headdims=tuple(h for h in cfg.long_headdims if h in d))
    if "--seqlens" in args:
        cfg = replace(cfg, seqlens=ints(args["--seqlens"]))
    if "--long-seqlens" in args:
        cfg = replace(cfg, long_seqlens=ints(args["--long-seqlens"]))
    if "--parts" in args:
        cfg = replace(cfg, parts=tuple(args["--parts"].split(",")))
    if "--providers" in args:
        cfg = replace(cfg, providers=tuple(args["--providers"].split(",")))
    return cfg


def _status(provider, mode, batch, seqlen, nheads, headdim):
    """The status a provider gets on an H100 (see the module docstring)."""
    if provider in ("standard", "sdpa_math"):
        matrices = {"fwd": 3, "fwd_bwd": 6, "bwd": 6}[mode]  # scores, probabilities, grads
        if batch * nheads * seqlen**2 * 2 * matrices / 2**20 > GPU_MEMORY_MB:
            return "oom"
    if provider == "sdpa_cudnn" and headdim > 128:
        return "unsupported"
    if provider == "flex" and headdim > 128 and mode != "fwd":
        return "unsupported"
    return "ok"


def _time_ms(rng, provider, mode, batch, seqlen, nheads, headdim, causal):
    from experiments.results import flops
    rate = PEAK_TFLOPS[provider] * seqlen / (seqlen + HALF_AT[provider] * (2 if causal else 1))
    rate *= {"fwd": 1.0, "bwd": BWD_FRACTION[provider]}.get(mode, (1 + 2.5) / (
        1 + 2.5 / BWD_FRACTION[provider]))
    rate *= (0.9 if headdim == 64 else 0.95 if headdim == 256 else 1.0) * rng.uniform(0.96, 1.04)
    med = flops(batch, seqlen, seqlen, nheads, headdim, causal, mode) / (rate * 1e12) * 1e3
    return med, med * 0.985, med * 1.02


def _peak_mb(provider, mode, batch, seqlen, nheads, headdim):
    tensor = batch * seqlen * nheads * headdim * 2 / 2**20  # one (B, N, H, D) bf16 tensor, MiB
    if provider in ("standard", "sdpa_math"):
        return tensor + batch * nheads * seqlen**2 * 2 * (3 if mode == "fwd" else 5) / 2**20
    return tensor * {"fwd": 1.1, "bwd": 4.2, "fwd_bwd": 4.4}[mode]


def batch_rows(cfg, rng, error_parts=(), error_providers=()):
    """The rows of parts batch and long that speedup.run writes for cfg, group by group."""
    from experiments import speedup
    rows = []
    for part, seqlen, headdim, causal in [g for g in speedup.groups(cfg) if g[0] in cfg.parts]:
        long_part = part == "long"
        batch = 1 if long_part else max(1, cfg.tokens_per_batch // seqlen)
        nheads = max(1, (cfg.long_hidden if long_part else cfg.hidden) // headdim)
        modes = [m for m in speedup.MODE_ORDER if m in (cfg.long_modes if long_part else cfg.modes)]
        base = dict(experiment="speedup", dtype=cfg.dtype, batch=batch, seqlen_q=seqlen,
                    seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads, headdim=headdim,
                    causal=causal, part=part, load_avg_1m=round(rng.uniform(0.5, 2.0), 2),
                    **MACHINE)
        for provider in cfg.providers:
            inherited = None
            for mode in modes:
                if inherited:
                    status = inherited
                elif part in error_parts or provider in error_providers:
                    status = "error"
                else:
                    status = _status(provider, mode, batch, seqlen, nheads, headdim)
                if status == "ok":
                    peak = _peak_mb(provider, mode, batch, seqlen, nheads, headdim)
                    times = _time_ms(rng, provider, mode, batch, seqlen, nheads, headdim, causal)
                else:
                    peak, times, inherited = math.nan, (math.nan,) * 3, status
                rows += speedup._rows(base, provider, mode, status, peak, times)
    return rows


def ceiling_rows(cfg):
    """The two ceilings, as experiments.speedup.ceilings writes them."""
    n = cfg.ceiling_matmul_n
    elements = cfg.ceiling_copy_mb * 2**20 // 2  # bf16
    base = dict(experiment="speedup", provider="ceiling", mode="fwd", dtype=cfg.dtype, batch=1,
                nheads=1, nheads_kv=1, causal=False, status="ok", part="ceiling",
                load_avg_1m=0.5, **MACHINE)
    return [
        dict(base, seqlen_q=n, seqlen_k=n, headdim=n, metric="matmul_tflops",
             value=MATMUL_TFLOPS, unit="TFLOP/s", p20=MATMUL_TFLOPS * 0.99,
             p80=MATMUL_TFLOPS * 1.01, size=f"{n}x{n}x{n}"),
        dict(base, seqlen_q=elements, seqlen_k=elements, headdim=1, metric="copy_gbps",
             value=COPY_GBPS, unit="GB/s", p20=COPY_GBPS * 0.99, p80=COPY_GBPS * 1.01,
             size=f"{cfg.ceiling_copy_mb} MiB"),
    ]


def decode_rows(cfg, rng, error_parts=(), error_providers=(), decode_errors=()):
    """Part decode's rows (experiments.decode._rows): time_ms, read_gbps, max_err_o_sampled
    (and a float8 cache's quant_err_o_sampled).
    decode_errors: the variants whose decode rows are "error" ("longflash_split",
    "longflash_nosplit", "longflash_split_fp8", or another provider's name)."""
    from experiments import decode
    rows = []
    for batch in cfg.decode_batches:
        for seqlen_k in cfg.decode_seqlens:
            shape = dict(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, nheads=cfg.decode_nheads,
                         nheads_kv=cfg.decode_nheads_kv, headdim=cfg.decode_headdim)
            base = dict(experiment="speedup", part="decode", mode="fwd", dtype=cfg.dtype,
                        causal=False, load_avg_1m=0.7, **shape, **MACHINE)
            cache_bytes = 2 * batch * seqlen_k * cfg.decode_nheads_kv * cfg.decode_headdim * 2
            for provider in [p for p in cfg.providers if p in decode.GPU_PROVIDERS]:
                for num_splits, kv_dtype in (decode.LONGFLASH_VARIANTS if provider == "longflash"
                                             else ((math.nan, ""),)):
                    name = (provider if provider != "longflash" else
                            "longflash_nosplit" if num_splits == 1 else "longflash_split")
                    name += "_fp8" if kv_dtype else ""
                    size = 0.5 if kv_dtype else 1.0  # a float8 cache: half the bf16 bytes
                    status = ("error" if "decode" in error_parts or provider in error_providers
                              or name in decode_errors
                              else "unsupported" if provider == "sdpa_efficient" else "ok")
                    r = dict(status=status, err=math.nan, quant_err=math.nan,
                             times=(math.nan,) * 3,
                             message="" if status == "ok" else "made-up failure",
                             graph=((math.nan,) * 3, status, "made-up failure"))
                    if status == "ok":
                        # bandwidth-bound: a fraction of the copy rate, lower on short caches
                        frac = {"longflash": 0.8 if num_splits == 0 else 0.35,
                                "sdpa_flash": 0.55, "sdpa_cudnn": 0.6, "sdpa_math": 0.2,
                                "flex": 0.5}[provider] * seqlen_k / (seqlen_k + 2048)
                        if num_splits == 1 and batch == 8:
                            frac *= 2  # more sequences fill the GPU without splitting
                        ms = size * cache_bytes / (COPY_GBPS * 1e9 * frac) * 1e3 + 0.008
                        ms *= rng.uniform(0.97, 1.03)
                        r["times"] = (ms, ms * 0.99, ms * 1.02)
                        graph_ms = ms - 0.006  # replays skip the host's launch work
                        r["graph"] = ((graph_ms, graph_ms * 0.99, graph_ms * 1.02), "ok", "")
                        r["err"] = 3.9e-3 if provider == "longflash" else math.nan
                        r["quant_err"] = 2.1e-2 if kv_dtype else math.nan
                    rows += decode._rows(provider, num_splits, kv_dtype, r, base,
                                         size * cache_bytes, lambda message: None)
    return rows


def prefill_rows(cfg, rng, error_parts=()):
    """Part prefill's rows (experiments.prefill._rows): time_ms, tflops, max_err_o_sampled of
    each route at each (keys, chunk); float8 pages in place a little faster than the gathered
    copy and a little slower than bf16 pages (made up)."""
    from experiments import prefill
    from experiments.results import flops
    rows = []
    for seqlen_k in cfg.prefill_seqlens:
        for seqlen_q in [n for n in cfg.prefill_chunks if n <= seqlen_k]:
            base = dict(experiment="speedup", part="prefill", mode="fwd", dtype=cfg.dtype,
                        causal=True, provider="longflash", batch=cfg.prefill_batch,
                        seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=cfg.prefill_nheads,
                        nheads_kv=cfg.prefill_nheads_kv, headdim=cfg.prefill_headdim,
                        load_avg_1m=0.5, **MACHINE)
            fl = flops(cfg.prefill_batch, seqlen_q, seqlen_k, cfg.prefill_nheads,
                       cfg.prefill_headdim, True, "fwd")
            for kv_dtype, route in prefill.ROUTES:
                status = "error" if "prefill" in error_parts else "ok"
                slower = {("", "in_place"): 1.0, (prefill.FP8, "in_place"): 1.05,
                          (prefill.FP8, "gathered"): 1.2}[kv_dtype, route]
                med = fl / (PEAK_TFLOPS["longflash"] * 0.8e12) * 1e3 * slower * rng.uniform(
                    0.98, 1.02) if status == "ok" else math.nan
                r = dict(times=(med, med * 0.99, med * 1.01), status=status, message="",
                         err=1e-3 if status == "ok" else math.nan)
                rows += prefill._rows(base, kv_dtype, route, r, fl, lambda m: None)
    return rows


def _made_up_step(status, ms, provider):
    """A prepared, timed decoding step as experiments.decode.step_rows takes it: a median of ms
    (p20 and p80 beside it, CUDA-graph replays 6 us less), LongFlash's error 3.9e-3; or, with a
    status other than ok, nothing measured."""
    r = dict(status=status, err=math.nan, quant_err=math.nan, times=(math.nan,) * 3,
             message="" if status == "ok" else "made-up failure",
             graph=((math.nan,) * 3, status, "made-up failure"))
    if status == "ok":
        r.update(times=(ms, ms * 0.99, ms * 1.02),
                 graph=((ms - 0.006, ms * 0.99 - 0.006, ms * 1.02 - 0.006), "ok", ""),
                 err=3.9e-3 if provider == "longflash" else math.nan)
    return r


def shared_prefix_rows(cfg, rng, error_parts=()):
    """Part shared_prefix's rows (experiments.shared_prefix, through decode.step_rows): each
    route's step bandwidth-bound on the keys and values it reads once (made up: the cascade
    reads the prefix once and pays a merge; sdpa_efficient refuses grouped-query heads)."""
    from experiments import decode, shared_prefix
    rows = []
    token_bytes = 2 * cfg.decode_nheads_kv * cfg.decode_headdim * 2  # bf16 keys and values
    for batch in cfg.shared_batches:
        for prefix_len in cfg.shared_prefixes:
            seqlen_k = prefix_len + cfg.shared_suffix_len
            base = dict(experiment="speedup", part="shared_prefix", mode="fwd",
                        dtype=cfg.dtype, causal=False, batch=batch, seqlen_q=1,
                        seqlen_k=seqlen_k, nheads=cfg.decode_nheads,
                        nheads_kv=cfg.decode_nheads_kv, headdim=cfg.decode_headdim,
                        prefix_len=prefix_len, load_avg_1m=0.6, **MACHINE)
            for provider in [p for p in cfg.providers if p in shared_prefix.GPU_PROVIDERS]:
                for route in (("cascade", "duplicated") if provider == "longflash"
                              else ("duplicated",)):
                    tokens = (prefix_len + batch * cfg.shared_suffix_len if route == "cascade"
                              else batch * seqlen_k)
                    status = ("error" if "shared_prefix" in error_parts else
                              "unsupported" if provider == "sdpa_efficient" else "ok")
                    ms = math.nan
                    if status == "ok":
                        frac = {"longflash": 0.75, "sdpa_flash": 0.5, "sdpa_cudnn": 0.55}[provider]
                        ms = tokens * token_bytes / (COPY_GBPS * 1e9 * frac) * 1e3 + (
                            0.015 if route == "cascade" else 0.008)
                        ms *= rng.uniform(0.97, 1.03)
                    r = _made_up_step(status, ms, provider)
                    rows += decode.step_rows(dict(base, provider=provider, route=route), route,
                                             r, tokens * token_bytes, lambda message: None)
    return rows


def mla_rows(cfg, rng, error_parts=()):
    """Part mla's rows (experiments.mla_decode, through decode.step_rows): each route's step
    bandwidth-bound on the cache bytes it reads (made up: LongFlash's absorbed call reads the
    latents once; its concatenated route and cuDNN's refuse 576-dim queries; SDPA's math
    backend at a tenth of the copy rate)."""
    from experiments import decode, mla_decode
    rows = []
    dims = {"absorbed": cfg.mla_rope_dim + cfg.mla_latent_dim}
    dims["concatenated"] = dims["heads_as_rows"] = dims["absorbed"] + cfg.mla_latent_dim
    for batch in cfg.mla_batches:
        for seqlen_k in cfg.mla_seqlens:
            base = dict(experiment="speedup", part="mla", mode="fwd", dtype=cfg.dtype,
                        causal=False, batch=batch, seqlen_q=1, seqlen_k=seqlen_k,
                        nheads=cfg.mla_nheads, nheads_kv=1, headdim=cfg.mla_rope_dim,
                        load_avg_1m=0.6, **MACHINE)
            for provider in [p for p in cfg.providers if p in mla_decode.GPU_PROVIDERS]:
                for route in (("absorbed", "concatenated") if provider == "longflash"
                              else ("concatenated", "heads_as_rows")):
                    cache_bytes = batch * seqlen_k * dims[route] * 2  # bf16
                    status = ("error" if "mla" in error_parts else "unsupported"
                              if (provider, route) == ("longflash", "concatenated")
                              or provider == "sdpa_cudnn" else "ok")
                    ms = math.nan
                    if status == "ok":
                        frac = {"longflash": 0.7, "sdpa_efficient": 0.5, "sdpa_math": 0.1}[provider]
                        ms = cache_bytes / (COPY_GBPS * 1e9 * frac) * 1e3 + 0.01
                        ms *= rng.uniform(0.97, 1.03)
                    r = _made_up_step(status, ms, provider)
                    rows += decode.step_rows(dict(base, provider=provider, route=route), route,
                                             r, cache_bytes, lambda message: None)
    return rows


def sparse_rows(cfg, rng, error_parts=()):
    """Part sparse's rows (experiments.block_sparse, through speedup._rows): made up, LongFlash
    and flex at their dense time times the fraction of blocks kept plus a tenth, SDPA's
    memory-efficient backend with the blocks as a mask at its dense time whatever the mask."""
    from experiments import block_sparse, speedup
    rows = []
    for seqlen in cfg.sparse_seqlens:
        for density in cfg.sparse_densities:
            mask = block_sparse.block_mask(seqlen, density, seed=seqlen, device="cpu")
            kept = 1.0 if mask is None else mask.float().mean().item()
            base = dict(experiment="speedup", part="sparse", dtype=cfg.dtype, batch=1,
                        seqlen_q=seqlen, seqlen_k=seqlen, nheads=cfg.sparse_nheads,
                        nheads_kv=cfg.sparse_nheads, headdim=cfg.sparse_headdim, causal=False,
                        density=density, blocks_kept=kept, **MACHINE)
            for provider in [p for p in cfg.providers if p in block_sparse.GPU_PROVIDERS]:
                for mode in block_sparse.MODES:
                    status = "error" if "sparse" in error_parts else "ok"
                    dense = _time_ms(rng, provider, mode, 1, seqlen, cfg.sparse_nheads,
                                     cfg.sparse_headdim, False)
                    share = 1.0 if provider == "sdpa_efficient" else kept + 0.1 * (kept < 1)
                    times = tuple(t * share for t in dense) if status == "ok" else (math.nan,) * 3
                    peak = _peak_mb(provider, mode, 1, seqlen, cfg.sparse_nheads,
                                    cfg.sparse_headdim)
                    new = speedup._rows(base, provider, mode, status, peak, times)
                    new[2] = dict(new[2], value=new[2]["value"] * kept,
                                  p20=new[2]["p20"] * kept, p80=new[2]["p80"] * kept)
                    rows += new
    return rows


def sparse_decode_rows(cfg, rng, error_parts=()):
    """Part sparse_decode's rows (experiments.sparse_decode, through decode.step_rows), with
    the part's own masks: made up, LongFlash's block_mask step bandwidth-bound on the blocks
    kept (plus a fixed 20 us), its attn_mask route and SDPA on the whole cache, FlexAttention
    on the blocks kept at half LongFlash's rate, cuDNN refusing the mask."""
    from experiments import decode, sparse_decode
    rows = []
    h, hkv, d = cfg.decode_nheads, cfg.decode_nheads_kv, cfg.decode_headdim
    providers = [p for p in cfg.providers if p in sparse_decode.GPU_PROVIDERS]
    for batch in cfg.sparse_decode_batches:
        for seqlen_k in cfg.sparse_decode_seqlens:
            cache_bytes = 2 * batch * seqlen_k * hkv * d * 2  # bf16 keys and values
            for density, heads in sparse_decode.masks(cfg.sparse_decode_densities):
                mask = sparse_decode.block_mask(batch, h, hkv, seqlen_k, density, heads,
                                                seed=seqlen_k + batch, device="cpu")
                kept = sparse_decode.blocks_kept(mask, h // hkv)
                base = dict(experiment="speedup", part="sparse_decode", mode="fwd",
                            dtype=cfg.dtype, causal=False, batch=batch, seqlen_q=1,
                            seqlen_k=seqlen_k, nheads=h, nheads_kv=hkv, headdim=d,
                            density=density, mask_heads=heads, blocks_kept=kept,
                            load_avg_1m=0.6, **MACHINE)
                for provider in providers:
                    for route in sparse_decode.routes(provider):
                        status = ("error" if "sparse_decode" in error_parts else "unsupported"
                                  if provider == "sdpa_cudnn" else "ok")
                        share = kept if route == "block_mask" else 1.0
                        frac = {"longflash": 0.7, "flex": 0.35, "sdpa_efficient": 0.5,
                                "sdpa_math": 0.1}.get(provider, 0.5)
                        ms = (cache_bytes * share / (COPY_GBPS * 1e9 * frac) * 1e3 + 0.02) \
                            * rng.uniform(0.97, 1.03)
                        r = _made_up_step(status, ms, provider)
                        rows += decode.step_rows(dict(base, provider=provider, route=route),
                                                 route, r, cache_bytes * kept, lambda m: None)
    return rows


def write(results_dir, stages=(1, 2, 3), error_parts=(), error_providers=(), decode_errors=(),
          prefill=True, gates_pass=False):
    """results_dir/speedup/h100.csv as the campaign's speedup steps of `stages` leave it, and
    with `prefill` stage 8's part prefill (--full --parts prefill) after them where `stages`
    has none. error_parts ("batch", "long", "decode", "prefill", "shared_prefix", "mla",
    "sparse", "sparse_decode") /
    error_providers: every such row has status "error" (a part that failed, for the
    partial-results tests); decode_errors: see decode_rows; gates_pass: the steps after a
    stage's gate ran with its switches (their command names them, as results.this_command
    writes it). Returns the path."""
    from experiments import block_sparse, decode, mla_decode, shared_prefix, sparse_decode
    from experiments import prefill as prefill_part
    from experiments.results import write_results
    out = path(results_dir, "speedup")
    rng = np.random.default_rng(1)
    configs = campaign_configs(stages)
    if prefill and not any("prefill" in cfg.parts for _, _, cfg, _ in configs):
        argv = ["--full", "--parts", "prefill"]
        configs.append((8, argv, config(argv), []))
    with as_gpu():
        for stage, argv, cfg, switches in configs:
            command = " ".join((switches if gates_pass else []) + [
                "tests/gpu_shaped/speedup.py, made-up values shaped like: python3 -m "
                "experiments.speedup"] + argv)
            write_results(ceiling_rows(cfg), out, command=command)
            rows = batch_rows(cfg, rng, error_parts, error_providers)
            if rows:
                write_results(rows, out, command=command)
            parts = {  # part -> (its rows, its module's key columns)
                "decode": (lambda: decode_rows(cfg, rng, error_parts, error_providers,
                                               decode_errors), decode.KEY_COLUMNS),
                "prefill": (lambda: prefill_rows(cfg, rng, error_parts),
                            prefill_part.KEY_COLUMNS),
                "shared_prefix": (lambda: shared_prefix_rows(cfg, rng, error_parts),
                                  shared_prefix.KEY_COLUMNS),
                "mla": (lambda: mla_rows(cfg, rng, error_parts), mla_decode.KEY_COLUMNS),
                "sparse": (lambda: sparse_rows(cfg, rng, error_parts), block_sparse.KEY_COLUMNS),
                "sparse_decode": (lambda: sparse_decode_rows(cfg, rng, error_parts),
                                  sparse_decode.KEY_COLUMNS)}
            for part, (make, key_columns) in parts.items():
                if part in cfg.parts:
                    write_results(make(), out, command=command, key_columns=key_columns)
    return out
