"""RQ1, part "mla": a decoding step of multi-head latent attention in its absorbed form.

    python -m experiments.speedup --parts mla                 # CPU: caches of 1K and 8K tokens
    python -m experiments.speedup --full --parts mla          # GPU: 4K and 32K, bfloat16

DeepSeek-V3's decoding shape under 8-way tensor parallelism (Config.mla_*): 16 query heads
over one KV head, each token cached as its 512-dim latent and its 64-dim rotary key; the
queries' rotary part q (64 dims) and their other part absorbed into the latent space, qv
(512 dims). Each score is q k^T + qv v^T with scale 1/sqrt(576); one query per sequence,
batches Config.mla_batches, random normal entries (never zeros). Routes (key column route,
beside experiments.results.KEY_COLUMNS):
  longflash  route "absorbed": longflash.attention_with_kvcache(q, rope_cache, latents, qv=qv),
             the latents read once for both products. Route "concatenated": the same
             attention as the plain one of [q, qv] over a key cache [rope, latent] (576 dims)
             with the latents as values: what a kernel without qv needs, the latents stored
             and read twice; "unsupported" where q' is wider than LongFlash's 256 dims (the
             real shape's 576: without qv LongFlash cannot run it). Triton on a GPU, the
             blockwise path on a CPU.
  sdpa_efficient, sdpa_cudnn, sdpa_math (GPU), sdpa_cpu (CPU)
             scaled_dot_product_attention over the concatenated form: route "concatenated",
             the 16 query heads over the one KV head by enable_gqa; route "heads_as_rows",
             the 16 heads as 16 query rows of one head (exact here: one KV head, one query, no
             mask), which on a CPU avoids SDPA's math fallback for enable_gqa with value
             dims other than the queries' ("unsupported" where a backend refuses the head
             dims: FlashAttention-2's takes at most 256).
Rows (experiment "speedup", part "mla", mode "fwd", causal False, headdim 64, key column
route), as part decode's (experiments.decode.step_rows):
  time_ms (ms)          median with p20/p80 (on a CPU the routes of one shape in turn).
  time_ms_graph (ms)    GPU only: CUDA-graph replays, the GPU's time without the host's.
  read_gbps (GB/s)      the cache bytes the route reads once / time: (64 + 512) dims a token
                        for "absorbed", (576 + 512) for the other routes.
  max_err_o_sampled     longflash only: max |o - o_ref| of the first sequence, against
                        attention_ref in float64 of [q, qv] over [rope, latent].
"""

import math
import time

import torch

import longflash
from longflash._common import MAX_HEADDIM
from experiments.decode import _time, measured_rows, prepare_step, step_rows
from experiments.results import load_average
from experiments.speedup import SDPA_BACKENDS, Unsupported, sdpa

GPU_PROVIDERS = ("longflash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")
CPU_PROVIDERS = ("longflash", "sdpa_cpu")
KEY_COLUMNS = ("route",)  # beside experiments.results.KEY_COLUMNS


def _inputs(cfg, batch, seqlen_k, dtype, device, seed):
    """{"absorbed": (q, qv, rope cache, latents), "concatenated": (q', k', latents) as
    (batch, seqlen, heads, dims), "bhnd": the same (batch, heads, seqlen, dims), "rows": the
    same with the query heads as the rows of one head, (batch, 1, heads, dims)}."""
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(shape, device=device, dtype=dtype,  # noqa: E731
                                       generator=gen)
    h, d, dv = cfg.mla_nheads, cfg.mla_rope_dim, cfg.mla_latent_dim
    q, qv = randn(batch, 1, h, d), randn(batch, 1, h, dv)
    rope, latents = randn(batch, seqlen_k, 1, d), randn(batch, seqlen_k, 1, dv)
    cat = (torch.cat([q, qv], -1), torch.cat([rope, latents], -1), latents)
    bhnd = tuple(x.transpose(1, 2).contiguous() for x in cat)
    return {"absorbed": (q, qv, rope, latents), "concatenated": cat, "bhnd": bhnd,
            "rows": (cat[0].view(batch, 1, h, d + dv), *bhnd[1:])}


def make_step(provider, route, device, scale):
    """step(*inputs[route or layout]) -> o, and the inputs' key."""
    if provider == "longflash":
        backend = "triton" if device == "cuda" else "torch"
        if route == "absorbed":
            return (lambda q, qv, k, v: longflash.attention_with_kvcache(
                q, k, v, cache_seqlens=k.shape[1], backend=backend, qv=qv)), "absorbed"
        dims = round(scale ** -2)
        if dims > MAX_HEADDIM:
            raise Unsupported(f"the concatenated queries' {dims} dims: LongFlash takes at most "
                              f"{MAX_HEADDIM} without qv")
        return (lambda q, k, v: longflash.attention_with_kvcache(
            q, k, v, cache_seqlens=k.shape[1], softmax_scale=scale, backend=backend)), \
            "concatenated"
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
        raise Unsupported(f"torch {torch.__version__}: scaled_dot_product_attention takes "
                          "enable_gqa from torch 2.5")
    if provider == "sdpa_cpu" or provider in SDPA_BACKENDS:
        if route == "heads_as_rows":
            return sdpa(provider, scale=scale), "rows"
        return sdpa(provider, enable_gqa=True, scale=scale), "bhnd"
    raise ValueError(f"unknown mla provider {provider!r}")


def _max_err(o, q, k, v, scale):
    """max |o - attention_ref| of the first sequence, the concatenated form in float64."""
    ref, _ = longflash.attention_ref(q[:1].double(), k[:1].double(), v[:1].double(),
                                     softmax_scale=scale)
    return (o[:1].double() - ref).abs().max().item()


def existing_keys(path, after=None):
    """Keys of the part-mla time_ms rows already in path (for --resume), as
    experiments.decode.measured_rows counts them."""
    df = measured_rows(path, "mla", "route", after)
    if df is None:
        return set()
    return {_key(*row) for row in df[["provider", "route", "dtype", "batch",
                                      "seqlen_k"]].itertuples(index=False)}


def _key(provider, route, dtype, batch, seqlen_k):
    return provider, route, str(dtype), int(batch), int(seqlen_k)


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part mla, but none whose key is in `done` (existing_keys). Starts no (batch,
    seqlen_k) group once cfg.budget_s seconds have passed since `started`."""
    dtype = getattr(torch, cfg.dtype)
    providers = [p for p in cfg.providers if p in (GPU_PROVIDERS if device == "cuda"
                                                    else CPU_PROVIDERS)]
    routes = [(p, r) for p in providers
              for r in (("absorbed", "concatenated") if p == "longflash"
                        else ("concatenated", "heads_as_rows"))]
    d, dv = cfg.mla_rope_dim, cfg.mla_latent_dim
    scale = (d + dv) ** -0.5
    rows = []
    for batch in cfg.mla_batches:
        for seqlen_k in cfg.mla_seqlens:
            if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                log(f"budget of {cfg.budget_s:.0f} s spent: mla B={batch} N={seqlen_k} not run")
                continue
            todo = [(p, r) for p, r in routes if _key(p, r, cfg.dtype, batch, seqlen_k) not in done]
            if not todo:
                continue
            base = dict(experiment="speedup", part="mla", mode="fwd", dtype=cfg.dtype,
                        causal=False, batch=batch, seqlen_q=1, seqlen_k=seqlen_k,
                        nheads=cfg.mla_nheads, nheads_kv=1, headdim=d,
                        load_avg_1m=load_average()[0], **machine)
            inputs = _inputs(cfg, batch, seqlen_k, dtype, device, seed=seqlen_k + batch)
            ready = [_prepare(p, r, inputs, device, scale) for p, r in todo]
            _time(ready, device, cfg)
            for (provider, route), r in zip(todo, ready):
                dims = d + dv if route == "absorbed" else d + 2 * dv
                rows += step_rows(dict(base, provider=provider, route=route), f"{route:<13}",
                                  r, batch * seqlen_k * dims * dtype.itemsize, log)
            del inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _prepare(provider, route, inputs, device, scale):
    """One route's step at one shape (experiments.decode.prepare_step), with its error
    (longflash) against float64 over the first sequence."""
    def build():
        step, layout = make_step(provider, route, device, scale)
        args = inputs[layout]
        o = step(*args)  # warm-up: compilation, autotuning
        err = (_max_err(o, *inputs["concatenated"], scale) if provider == "longflash"
               else math.nan)
        return (lambda: step(*args)), err, math.nan
    return prepare_step(provider, build, device)
