"""RQ1, part "shared_prefix": decoding over a prefix shared by the batch (cascade attention).

    python -m experiments.speedup --parts shared_prefix          # CPU: prefixes of 4K, 16K
    python -m experiments.speedup --full --parts shared_prefix   # GPU: 4K, 32K; bfloat16

A batch of sequences that continue one prompt (a system prompt, several samples of one
prompt): each has the prefix's prefix_len tokens, then shared_suffix_len of its own. One
decoding step (seqlen_q 1, seqlen_k prefix_len + shared_suffix_len), part decode's heads and
head dim (Config.decode_*), batches Config.shared_batches, random normal entries (never
zeros). Providers and routes (key columns, beside experiments.results.KEY_COLUMNS):
  longflash  route "cascade": longflash.attention_with_shared_prefix, the prefix stored once,
             (1, prefix_len, nheads_kv, headdim), read once for the whole batch, then each
             sequence's own cache, merged by log-sum-exp. Route "duplicated":
             attention_with_kvcache over (batch, seqlen_k) caches that each hold a copy of the
             prefix: a step without sharing. Triton on a GPU, the blockwise path on a CPU.
  sdpa_flash, sdpa_efficient, sdpa_cudnn (GPU), sdpa_cpu (CPU)
             scaled_dot_product_attention over the duplicated caches (enable_gqa; "unsupported"
             where a backend refuses), route "duplicated".
Rows (experiment "speedup", part "shared_prefix", mode "fwd", causal False, key columns
route and prefix_len), as part decode's (experiments.decode.step_rows):
  time_ms (ms)          median with p20/p80 (on a CPU the routes of one shape in turn).
  time_ms_graph (ms)    GPU only: CUDA-graph replays, the GPU's time without the host's.
  read_gbps (GB/s)      the bytes of the keys and values the route reads once / time:
                        (prefix_len + batch * shared_suffix_len) tokens for "cascade",
                        batch * seqlen_k for "duplicated".
  max_err_o_sampled     longflash only: max |o - o_ref| of the first sequence, against
                        attention_ref in float64 over the prefix and its own tokens.
"""

import math
import time

import torch

import longflash
from experiments.decode import (_max_err, _time, make_decode, measured_rows, prepare_step,
                                step_rows)
from experiments.results import load_average

GPU_PROVIDERS = ("longflash", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn")
CPU_PROVIDERS = ("longflash", "sdpa_cpu")
KEY_COLUMNS = ("route", "prefix_len")  # beside experiments.results.KEY_COLUMNS


def _inputs(cfg, batch, prefix_len, dtype, device, seed):
    """{"cascade": (q, prefix_k, prefix_v, k_cache, v_cache), "bnhd": (q, k, v) with the
    prefix copied into every sequence's cache, "bhnd": the same (batch, nheads, seqlen,
    headdim)}."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nheads, nheads_kv, headdim = cfg.decode_nheads, cfg.decode_nheads_kv, cfg.decode_headdim
    randn = lambda *shape: torch.randn(shape, device=device, dtype=dtype,  # noqa: E731
                                       generator=gen)
    q = randn(batch, 1, nheads, headdim)
    prefix = [randn(1, prefix_len, nheads_kv, headdim) for _ in range(2)]
    own = [randn(batch, cfg.shared_suffix_len, nheads_kv, headdim) for _ in range(2)]
    full = [torch.cat([p.expand(batch, -1, -1, -1), o], 1) for p, o in zip(prefix, own)]
    return {"cascade": (q, *prefix, *own), "bnhd": (q, *full),
            "bhnd": tuple(x.transpose(1, 2).contiguous() for x in (q, *full))}


def make_cascade(device):
    """step(q, prefix_k, prefix_v, k_cache, v_cache) -> o: the shared-prefix call."""
    backend = "triton" if device == "cuda" else "torch"
    return lambda q, pk, pv, k, v: longflash.attention_with_shared_prefix(
        q, pk, pv, k, v, cache_seqlens=k.shape[1], causal=False, backend=backend)


def existing_keys(path, after=None):
    """Keys of the part-shared_prefix time_ms rows already in path (for --resume), as
    experiments.decode.measured_rows counts them."""
    df = measured_rows(path, "shared_prefix", "prefix_len", after)
    if df is None:
        return set()
    return {_key(*row) for row in df[["provider", "route", "dtype", "batch",
                                      "prefix_len"]].itertuples(index=False)}


def _key(provider, route, dtype, batch, prefix_len):
    return provider, route, str(dtype), int(batch), int(prefix_len)


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part shared_prefix, but none whose key is in `done` (existing_keys). Starts no
    (batch, prefix_len) group once cfg.budget_s seconds have passed since `started`."""
    dtype = getattr(torch, cfg.dtype)
    providers = [p for p in cfg.providers if p in (GPU_PROVIDERS if device == "cuda"
                                                    else CPU_PROVIDERS)]
    routes = [(p, r) for p in providers
              for r in (("cascade", "duplicated") if p == "longflash" else ("duplicated",))]
    rows = []
    for batch in cfg.shared_batches:
        for prefix_len in cfg.shared_prefixes:
            if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                log(f"budget of {cfg.budget_s:.0f} s spent: shared prefix B={batch} "
                    f"P={prefix_len} not run")
                continue
            todo = [(p, r) for p, r in routes
                    if _key(p, r, cfg.dtype, batch, prefix_len) not in done]
            if not todo:
                continue
            seqlen_k = prefix_len + cfg.shared_suffix_len
            base = dict(experiment="speedup", part="shared_prefix", mode="fwd",
                        dtype=cfg.dtype, causal=False, batch=batch, seqlen_q=1,
                        seqlen_k=seqlen_k, nheads=cfg.decode_nheads,
                        nheads_kv=cfg.decode_nheads_kv, headdim=cfg.decode_headdim,
                        prefix_len=prefix_len, load_avg_1m=load_average()[0], **machine)
            inputs = _inputs(cfg, batch, prefix_len, dtype, device, seed=prefix_len + batch)
            token_bytes = 2 * cfg.decode_nheads_kv * cfg.decode_headdim * dtype.itemsize
            ready = [_prepare(provider, route, inputs, device) for provider, route in todo]
            _time(ready, device, cfg)
            for (provider, route), r in zip(todo, ready):
                tokens = (prefix_len + batch * cfg.shared_suffix_len if route == "cascade"
                          else batch * seqlen_k)
                rows += step_rows(dict(base, provider=provider, route=route), f"{route:<10}",
                                  r, tokens * token_bytes, log)
            del inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _prepare(provider, route, inputs, device):
    """One route's step at one shape (experiments.decode.prepare_step), with its error
    (longflash) against float64 over the duplicated cache's first sequence."""
    def build():
        if route == "cascade":
            step, args = make_cascade(device), inputs["cascade"]
        else:
            step, layout = make_decode(provider, device)
            args = inputs[layout]
        o = step(*args)  # warm-up: compilation, autotuning
        err = _max_err(o, *inputs["bnhd"]) if provider == "longflash" else math.nan
        return (lambda: step(*args)), err, math.nan
    return prepare_step(provider, build, device)
