"""RQ1, part "decode": one generation step over a KV cache (experiments.speedup --parts decode).

    python -m experiments.speedup --parts decode                 # CPU: caches of 1K..32K tokens
    python -m experiments.speedup --full --parts decode          # GPU: 1K..128K, bfloat16

A decoding step reads the whole cache for one query row per sequence, so it is bound by
memory bandwidth: its limit is reading the cache once at the device's copy bandwidth. Shape:
Llama-like, 32 query heads sharing 8 KV heads, head dim 128 (Config.decode_*); seqlen_q 1; the
cache holds exactly seqlen_k tokens of every sequence (random normal, never zeros); batch 1
and 8. Providers, each in its own layout, built outside the measured call:
  longflash       longflash.attention_with_kvcache, split-KV with the number of splits chosen
                  by the library (num_splits 0), and without splitting (num_splits 1). Triton
                  on a GPU, the blockwise PyTorch path on a CPU. Also over a float8_e4m3fn
                  cache (splits chosen; kv_dtype "float8_e4m3fn"): the same cache quantized
                  once, before timing, with one scale per (sequence, KV head), its largest
                  magnitude / 448 (k_descale, v_descale), a quarter of a float32 cache's bytes
                  and half of a 16-bit one's.
  sdpa_flash, sdpa_efficient, sdpa_cudnn, sdpa_math, flex (GPU), sdpa_cpu (CPU)
                  scaled_dot_product_attention / flex_attention (compiled once with dynamic
                  shapes) with enable_gqa (torch >= 2.5; "unsupported" where a backend refuses
                  the shape).
Rows (experiment "speedup", part "decode", mode "fwd", causal False, key columns num_splits:
0 or 1 for longflash, empty for the others, and kv_dtype: the cache's dtype where it is not
the run's (float8_e4m3fn), else empty):
  time_ms (ms)          median with p20/p80 (experiments.measure.time_ms_interleaved: on a
                        CPU the providers of one shape are called in turn, round robin).
  time_ms_graph (ms)    GPU only: the same step captured in a CUDA graph and replayed
                        (experiments.measure.time_ms_graph): the GPU's time without the host's
                        (Python, checks, kernel launches), which time_ms can measure instead
                        on short caches. A step that cannot be captured is a row "error".
  read_gbps (GB/s)      the cache's bytes (keys and values, read once, in the cache's dtype)
                        / time; the notebook divides it by the run's copy_gbps ceiling.
  max_err_o_sampled     longflash only: max |o - o_ref| of the first sequence of the batch,
                        against attention_ref in float64 over the cache it read (a float8
                        cache's entries times its scales: the kernel's own error).
  quant_err_o_sampled   float8 caches only: the same against the unquantized cache (the
                        quantization's effect on the output).
"""

import math
import os
import time

import torch

import longflash
from longflash import kvcache
from experiments.measure import is_oom, time_ms, time_ms_graph, time_ms_interleaved
from experiments.results import load_average, measured_before
# Imported by experiments.speedup.run, once that module is loaded: its provider vocabulary and
# its rules for a failed call, shared.
from experiments.speedup import (SDPA_BACKENDS, Unsupported, _status, _summary, compiled_flex,
                                 sdpa)

GPU_PROVIDERS = ("longflash", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex")
CPU_PROVIDERS = ("longflash", "sdpa_cpu")
FP8 = "float8_e4m3fn"
# longflash's variants, (num_splits, kv_dtype): splits chosen by the library, none, and
# chosen over a float8 cache ("": the run's dtype)
LONGFLASH_VARIANTS = ((0, ""), (1, ""), (0, FP8))
KEY_COLUMNS = ("num_splits", "kv_dtype")  # beside experiments.results.KEY_COLUMNS


def make_decode(provider, device, num_splits=0, kv_dtype=""):
    """(step, layout): step(q, k_cache, v_cache) -> o, inputs in layout "bnhd" (batch, seqlen,
    nheads, headdim), "bhnd" or, for a float8 cache, "fp8" (q, k_cache, v_cache, k_descale,
    v_descale: step(*inputs)). Raises Unsupported."""
    if provider == "longflash":
        backend = "triton" if device == "cuda" else "torch"
        return (lambda q, k, v, k_descale=None, v_descale=None: longflash.attention_with_kvcache(
            q, k, v, cache_seqlens=k.shape[1], backend=backend, num_splits=num_splits,
            k_descale=k_descale, v_descale=v_descale), "fp8" if kv_dtype else "bnhd")
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
        raise Unsupported(f"torch {torch.__version__}: scaled_dot_product_attention and "
                          "flex_attention take enable_gqa from torch 2.5")
    if provider == "sdpa_cpu" or provider in SDPA_BACKENDS:
        return sdpa(provider, enable_gqa=True), "bhnd"
    if provider == "flex":
        # dynamic shapes: one compilation for every cache length, not one each (minutes on a
        # GPU window); a recompilation shows in the warm-up call, not in the timing
        flex = compiled_flex(device, dynamic=True)
        return (lambda q, k, v: flex(q, k, v, enable_gqa=True), "bhnd")
    raise ValueError(f"unknown decode provider {provider!r}")


def _inputs(batch, seqlen_k, nheads, nheads_kv, headdim, dtype, device, seed):
    """q, k_cache, v_cache in both layouts ("bnhd": the cache (batch, seqlen_k, nheads_kv,
    headdim); "bhnd": (batch, nheads_kv, seqlen_k, headdim)). Random normal, never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((batch, 1, nheads, headdim), *(((batch, seqlen_k, nheads_kv, headdim),) * 2))
    bnhd = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
    return {"bnhd": bnhd, "bhnd": [x.transpose(1, 2).contiguous() for x in bnhd]}


def _quantized(inputs, kv_dtype):
    """inputs["fp8"]: q and the "bnhd" cache as a float8 cache with its scales, one per
    (sequence, KV head): its largest magnitude / the format's largest value."""
    if "fp8" not in inputs:
        q, k, v = inputs["bnhd"]
        dtype = getattr(torch, kv_dtype)
        scales = [x.abs().amax(dim=(1, 3)).float() / torch.finfo(dtype).max for x in (k, v)]
        inputs["fp8"] = [q, *(kvcache.quantize(x, s, dtype) for x, s in zip((k, v), scales)),
                         *scales]
    return inputs["fp8"]


def _max_err(o, q, k, v, k_descale=None, v_descale=None, attn_mask=None):
    """max |o - attention_ref| of the first sequence, the reference in float64 (over a float8
    cache's entries times its scales; with attn_mask, (batch, nheads, 1, seqlen_k), its
    first sequence's)."""
    k, v = (x[:1].double() * (1 if s is None else s[:1, None, :, None].double())
            for x, s in ((k, k_descale), (v, v_descale)))
    ref, _ = longflash.attention_ref(q[:1].double(), k, v,
                                     attn_mask=None if attn_mask is None else attn_mask[:1])
    return (o[:1].double() - ref).abs().max().item()


def measured_rows(path, part, column, after=None):
    """The time_ms rows of `part` in the CSV at path that --resume counts as measured: all
    but those with status error and, with after (an ISO time), those measured before it; None
    if there is no file or it has no `column` (a key column of the part: no row of it yet)."""
    if not os.path.exists(path):
        return None
    import pandas as pd
    df = pd.read_csv(path)
    if column not in df:
        return None
    df = df[(df["part"] == part) & (df["metric"] == "time_ms") & (df["status"] != "error")]
    return df[~measured_before(df, after)] if after else df


def existing_keys(path, after=None):
    """Keys of the part-decode time_ms rows already in path (for --resume), as measured_rows
    counts them (speedup._existing_keys)."""
    df = measured_rows(path, "decode", "num_splits", after)
    if df is None:
        return set()
    kv = df["kv_dtype"] if "kv_dtype" in df else [""] * len(df)  # older files: none
    return {_key(p, n, d, b, s, c) for (p, n, d, b, s), c in
            zip(df[["provider", "num_splits", "dtype", "batch", "seqlen_k"]].itertuples(
                index=False), kv)}


def _key(provider, num_splits, dtype, batch, seqlen_k, kv_dtype=""):
    kv_dtype = kv_dtype if isinstance(kv_dtype, str) else ""  # empty in a CSV: NaN
    return provider, _splits_name(num_splits), str(dtype), int(batch), int(seqlen_k), kv_dtype


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part decode, but none whose key is in `done` (existing_keys). Starts no
    (batch, seqlen_k) group once cfg.budget_s seconds have passed since `started`
    (time.perf_counter)."""
    dtype = getattr(torch, cfg.dtype)
    providers = [p for p in cfg.providers if p in (GPU_PROVIDERS if device == "cuda"
                                                    else CPU_PROVIDERS)]
    rows = []
    for batch in cfg.decode_batches:
        for seqlen_k in cfg.decode_seqlens:
            if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                log(f"budget of {cfg.budget_s:.0f} s spent: decode B={batch} N={seqlen_k} "
                    "not run")
                continue
            shape = dict(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, nheads=cfg.decode_nheads,
                         nheads_kv=cfg.decode_nheads_kv, headdim=cfg.decode_headdim)
            base = dict(experiment="speedup", part="decode", mode="fwd", dtype=cfg.dtype,
                        causal=False, load_avg_1m=load_average()[0], **shape, **machine)
            inputs = _inputs(batch, seqlen_k, cfg.decode_nheads, cfg.decode_nheads_kv,
                             cfg.decode_headdim, dtype, device, seed=seqlen_k + batch)
            cache_bytes = 2 * inputs["bnhd"][1].numel() * inputs["bnhd"][1].element_size()
            todo = [(provider, num_splits, kv_dtype) for provider in providers
                    for num_splits, kv_dtype in (LONGFLASH_VARIANTS if provider == "longflash"
                                                 else ((math.nan, ""),))
                    if _key(provider, num_splits, cfg.dtype, batch, seqlen_k, kv_dtype)
                    not in done]
            ready = [_prepare(provider, num_splits, kv_dtype, inputs, device)
                     for provider, num_splits, kv_dtype in todo]
            _time(ready, device, cfg)
            for (provider, num_splits, kv_dtype), r in zip(todo, ready):
                size = 1 if not kv_dtype else getattr(torch, kv_dtype).itemsize / dtype.itemsize
                rows += _rows(provider, num_splits, kv_dtype, r, base, cache_bytes * size, log)
            del inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _splits_name(num_splits):
    return "-" if math.isnan(num_splits) else "auto" if num_splits == 0 else str(int(num_splits))


def _prepare(provider, num_splits, kv_dtype, inputs, device):
    """One provider's step at one shape (prepare_step), with its error (longflash; a float8
    cache's also against the unquantized cache)."""
    def build():
        step, layout = make_decode(provider, device,
                                   0 if math.isnan(num_splits) else num_splits, kv_dtype)
        args = _quantized(inputs, kv_dtype) if kv_dtype else inputs[layout]
        o = step(*args)  # warm-up: compilation, autotuning
        err = _max_err(o, *args) if provider == "longflash" else math.nan
        quant_err = _max_err(o, *inputs["bnhd"]) if kv_dtype else math.nan
        return (lambda: step(*args)), err, quant_err
    return prepare_step(provider, build, device)


def prepare_step(provider, build, device):
    """A decoding step made by build() -> (step, err, quant_err), which calls it once (the
    warm-up: compilation, autotuning), with its status: {"provider", "step", "err",
    "quant_err", "status", "message", "times", "graph"}; a failure is a status, not a crash."""
    out = dict(provider=provider, step=None, err=math.nan, quant_err=math.nan, status="ok",
               message="", times=(math.nan,) * 3, graph=None)
    try:
        out["step"], out["err"], out["quant_err"] = build()
    except Exception as e:  # noqa: BLE001 - a row with its status, not a crash
        out.update(status=_status(e, provider), message=_summary(e))
        if is_oom(e) and device == "cuda":
            torch.cuda.empty_cache()
    return out


def _time(ready, device, cfg):
    """Time the prepared steps of one shape that are "ok" together (measure.time_ms_
    interleaved), then, on a GPU, each as CUDA-graph replays (r["graph"]: (times, status,
    message); a step that failed before keeps its status there too). If one fails while
    timed, each is timed again alone, and the one that fails gets its status."""
    _time_calls([r for r in ready if r["status"] == "ok"], device, cfg)
    if device != "cuda":
        return
    for r in ready:
        if r["status"] != "ok":
            r["graph"] = ((math.nan,) * 3, r["status"], r["message"])
            continue
        try:
            r["graph"] = (time_ms_graph(r["step"]), "ok", "")
        except Exception as e:  # noqa: BLE001 - a row with its status, not a crash
            r["graph"] = ((math.nan,) * 3, _status(e, r["provider"]), _summary(e))
            if is_oom(e):
                torch.cuda.empty_cache()


def _time_calls(ready, device, cfg):
    try:
        times = time_ms_interleaved([r["step"] for r in ready], device, warmup=cfg.warmup_ms,
                                    rep=cfg.rep_ms)
        for r, t in zip(ready, times):
            r["times"] = t
        return
    except Exception:  # noqa: BLE001 - found again below, step by step
        pass
    for r in ready:
        try:
            r["times"] = time_ms(r["step"], device, warmup=cfg.warmup_ms, rep=cfg.rep_ms)
        except Exception as e:  # noqa: BLE001 - a row with its status, not a crash
            r.update(status=_status(e, r["provider"]), message=_summary(e))
            if is_oom(e) and device == "cuda":
                torch.cuda.empty_cache()


def _rows(provider, num_splits, kv_dtype, r, base, cache_bytes, log):
    """The rows of one provider at one shape (step_rows)."""
    row = dict(base, provider=provider, num_splits=num_splits, kv_dtype=kv_dtype or math.nan)
    name = _splits_name(num_splits) + (f" {kv_dtype}" if kv_dtype else "")
    return step_rows(row, f"splits {name:<4}", r, cache_bytes, log, quantized=bool(kv_dtype))


def step_rows(row, label, r, cache_bytes, log, quantized=False):
    """The rows of one prepared, timed decoding step (time_ms, read_gbps: cache_bytes / time,
    on a GPU time_ms_graph, and longflash's errors): row holds the shape, provider and key
    columns, label names the variant in the log."""
    provider, part = row["provider"], row["part"]
    times, err, status, message = r["times"], r["err"], r["status"], r["message"]
    med, p20, p80 = times
    gb = (lambda ms: cache_bytes / (ms * 1e-3) / 1e9) if status == "ok" else (lambda ms: math.nan)
    head = f"{part} B={row['batch']:<2d} N={row['seqlen_k']:<7d} {provider:<14} {label}"
    log(f"{head} {med:9.3f} ms {gb(med):8.2f} GB/s  err {err:.2e}  [{status}]"
        + (f"  {message}" if message else ""))
    nan = math.nan
    out = [dict(row, metric="time_ms", value=med, unit="ms", p20=p20, p80=p80, status=status),
           dict(row, metric="read_gbps", value=gb(med), unit="GB/s", p20=gb(p80), p80=gb(p20),
                status=status)]
    if r["graph"] is not None:
        (g_med, g_p20, g_p80), g_status, g_message = r["graph"]
        log(f"{head} {g_med:9.3f} ms as CUDA-graph replays [{g_status}]"
            + (f"  {g_message}" if g_message else ""))
        out.append(dict(row, metric="time_ms_graph", value=g_med, unit="ms", p20=g_p20,
                        p80=g_p80, status=g_status))
    errors = ([("max_err_o_sampled", err)] if provider == "longflash" else []) + (
        [("quant_err_o_sampled", r["quant_err"])] if quantized else [])
    for metric, value in errors:
        out.append(dict(row, metric=metric, value=value, unit="abs", p20=nan, p80=nan,
                        status=status if math.isfinite(value) or status != "ok" else "error"))
    return out
