"""RQ1, part "prefill": chunked prefill over a paged KV cache (experiments.speedup --parts prefill).

    python -m experiments.speedup --parts prefill                # CPU: 1K and 4K keys
    python -m experiments.speedup --full --parts prefill         # GPU: 4K..64K keys, bfloat16

A serving engine adds a long prompt to its paged KV cache a chunk at a time: the chunk's
seqlen_q new queries attend, causally (bottom-right aligned), to the seqlen_k - seqlen_q keys
already cached and to their own, every key read from the cache's pages through a block table
(FlashAttention-2's flash_attn_varlen_func(block_table=), here longflash.attention_varlen).
Shape: prefill_batch sequences of seqlen_k keys each (the cache's pages shuffled, random
normal entries, never zeros), a chunk of seqlen_q queries each, Config.prefill_* heads and head
dim (GPU: Llama's 32 query heads over 8 KV heads, d128), pages of prefill_page_size tokens. One
provider, longflash (the Triton kernels on a GPU, the blockwise PyTorch path on a CPU), by
route and cache dtype (key columns, beside experiments.results.KEY_COLUMNS):
  kv_dtype ""               a cache in the run's dtype (empty in the CSV), route "in_place":
                            the forward kernel reads its pages through the block table.
  kv_dtype "float8_e4m3fn"  the same cache quantized once, before timing, one scale per
                            (sequence, KV head) (its largest magnitude / 448: k_descale,
                            v_descale), route "in_place": the kernel converts each 8-bit tile
                            as it loads it (3ae739b), or route "gathered": the keys in use
                            first copied into a packed tensor dequantized to q's dtype, then
                            attention_varlen over it (what LongFlash did before 3ae739b, and
                            still does with a gradient), timed with the copy.
Rows (experiment "speedup", part "prefill", mode "fwd", causal True, dtype the queries'):
  time_ms (ms)          median with p20/p80 (experiments.measure.time_ms_interleaved: on a
                        CPU the routes of one shape are called in turn, round robin).
  tflops (TFLOP/s)      the causal chunk's FLOPs (experiments.results.flops: the visible
                        pairs counted exactly) / time.
  max_err_o_sampled     max |o - o_ref| over the first sequence's last 64 queries, against
                        attention_ref in float64 over the keys and values the pages stand
                        for (a float8 cache's entries times its scales).
No CUDA-graph timing: a paged call reads the lengths and the block table back to check them.
"""

import math
import time

import torch

import longflash
from longflash import interface, kvcache
from experiments.results import flops, load_average, tflops
from experiments.decode import FP8, _time_calls
from experiments.speedup import _status, _summary

ROUTES = (("", "in_place"), (FP8, "in_place"), (FP8, "gathered"))  # (kv_dtype, route)
KEY_COLUMNS = ("kv_dtype", "route")  # beside experiments.results.KEY_COLUMNS
ERR_QUERIES = 64  # max_err_o_sampled's queries: a float64 reference of 64 rows x 64K keys


def _inputs(cfg, seqlen_q, seqlen_k, dtype, device, seed):
    """{"q", "cu_seqlens_q", "cu_seqlens_k", "block_table", "pages": {kv_dtype: (k_pages,
    v_pages, k_descale, v_descale)}}: prefill_batch sequences of seqlen_k keys in shuffled
    pages, their float8 copy with its scales."""
    batch, page = cfg.prefill_batch, cfg.prefill_page_size
    gen = torch.Generator(device=device).manual_seed(seed)
    pages_per_seq = -(-seqlen_k // page)
    shape = (batch * pages_per_seq, page, cfg.prefill_nheads_kv, cfg.prefill_headdim)
    k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(2))
    table = torch.randperm(batch * pages_per_seq, device=device, generator=gen).view(
        batch, pages_per_seq).to(torch.int32)
    q = torch.randn(batch * seqlen_q, cfg.prefill_nheads, cfg.prefill_headdim, device=device,
                    dtype=dtype, generator=gen)
    offsets = (lambda n: torch.arange(0, (batch + 1) * n, n, device=device,
                                      dtype=torch.int32))
    fp8 = getattr(torch, FP8)
    # one scale per (sequence, KV head): over every slot of its pages (the unused tail too)
    scales = [x[table.long()].abs().amax(dim=(1, 2, 4)).float() / torch.finfo(fp8).max
              for x in (k, v)]
    owner = torch.argsort(table.flatten().long()) // pages_per_seq  # each page's sequence
    quantized = [kvcache.quantize(x, s[owner], fp8) for x, s in zip((k, v), scales)]
    return dict(q=q, cu_seqlens_q=offsets(seqlen_q), cu_seqlens_k=offsets(seqlen_k),
                block_table=table, pages={"": (k, v, None, None), FP8: (*quantized, *scales)})


def make_prefill(inputs, seqlen_q, seqlen_k, kv_dtype, route, device):
    """step() -> o: one chunk's attention over the cache in this dtype by this route."""
    backend = "triton" if device == "cuda" else "torch"
    q, cu_q, cu_k, table = (inputs[n] for n in ("q", "cu_seqlens_q", "cu_seqlens_k",
                                                 "block_table"))
    k, v, k_descale, v_descale = inputs["pages"][kv_dtype]
    total_k = table.shape[0] * seqlen_k
    args = (cu_q, cu_k, seqlen_q, seqlen_k)
    if route == "gathered":
        def step():
            keys, values = interface._gather_pages(k, v, table, cu_k, total_k, k_descale,
                                                   v_descale, q.dtype)
            return longflash.attention_varlen(q, keys, values, *args, causal=True,
                                              backend=backend)
        return step
    return lambda: longflash.attention_varlen(q, k, v, *args, causal=True, backend=backend,
                                              block_table=table, k_descale=k_descale,
                                              v_descale=v_descale)


def _max_err(o, inputs, seqlen_q, seqlen_k, kv_dtype):
    """max |o - attention_ref| over sequence 0's last ERR_QUERIES queries (bottom-right
    aligned, they see what they see in the chunk), the reference in float64 over the keys and
    values its pages stand for."""
    k, v, k_descale, v_descale = inputs["pages"][kv_dtype]
    pages = inputs["block_table"][0].long()
    kv = [x[pages].flatten(0, 1)[None, :seqlen_k].double()
          * (1 if s is None else s[0, :, None].double())
          for x, s in ((k, k_descale), (v, v_descale))]
    rows = slice(max(seqlen_q - ERR_QUERIES, 0), seqlen_q)
    ref, _ = longflash.attention_ref(inputs["q"][None, rows].double(), *kv, causal=True)
    return (o[None, rows].double() - ref).abs().max().item()


def existing_keys(path, after=None):
    """Keys of the part-prefill time_ms rows already in path (for --resume), as
    experiments.decode.measured_rows counts them."""
    from experiments.decode import measured_rows
    df = measured_rows(path, "prefill", "route", after)
    if df is None:
        return set()
    return {_key(*row) for row in df[["dtype", "seqlen_q", "seqlen_k", "kv_dtype",
                                      "route"]].itertuples(index=False)}


def _key(dtype, seqlen_q, seqlen_k, kv_dtype, route):
    kv_dtype = kv_dtype if isinstance(kv_dtype, str) else ""  # empty in a CSV: NaN
    return str(dtype), int(seqlen_q), int(seqlen_k), kv_dtype, route


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part prefill, but none whose key is in `done` (existing_keys). Starts no
    (seqlen_k, seqlen_q) group once cfg.budget_s seconds have passed since `started`."""
    dtype = getattr(torch, cfg.dtype)
    rows = []
    for seqlen_k in cfg.prefill_seqlens:
        for seqlen_q in [n for n in cfg.prefill_chunks if n <= seqlen_k]:
            if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                log(f"budget of {cfg.budget_s:.0f} s spent: prefill N={seqlen_k} "
                    f"chunk={seqlen_q} not run")
                continue
            todo = [r for r in ROUTES if _key(cfg.dtype, seqlen_q, seqlen_k, *r) not in done]
            if not todo:
                continue
            shape = dict(batch=cfg.prefill_batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                         nheads=cfg.prefill_nheads, nheads_kv=cfg.prefill_nheads_kv,
                         headdim=cfg.prefill_headdim)
            base = dict(experiment="speedup", part="prefill", mode="fwd", dtype=cfg.dtype,
                        causal=True, provider="longflash", load_avg_1m=load_average()[0],
                        **shape, **machine)
            try:
                inputs = _inputs(cfg, seqlen_q, seqlen_k, dtype, device,
                                 seed=seqlen_k + seqlen_q)
            except Exception as e:  # noqa: BLE001 - rows with the status, not a crash
                ready = [dict(status=_status(e, "longflash"), message=_summary(e),
                              times=(math.nan,) * 3, err=math.nan) for _ in todo]
            else:
                ready = [_prepare(inputs, seqlen_q, seqlen_k, *r, device) for r in todo]
                _time_calls([r for r in ready if r["status"] == "ok"], device, cfg)
            fl = flops(cfg.prefill_batch, seqlen_q, seqlen_k, cfg.prefill_nheads,
                       cfg.prefill_headdim, True, "fwd")
            for (kv_dtype, route), r in zip(todo, ready):
                rows += _rows(base, kv_dtype, route, r, fl, log)
            inputs = None
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def _prepare(inputs, seqlen_q, seqlen_k, kv_dtype, route, device):
    """One route's step at one shape, warmed up (compilation, autotuning), with its error:
    {"step", "err", "status", "message", "times"}."""
    out = dict(step=None, err=math.nan, status="ok", message="", times=(math.nan,) * 3)
    try:
        step = make_prefill(inputs, seqlen_q, seqlen_k, kv_dtype, route, device)
        out["err"] = _max_err(step(), inputs, seqlen_q, seqlen_k, kv_dtype)
        out["step"] = step
    except Exception as e:  # noqa: BLE001 - a row with its status, not a crash
        out.update(status=_status(e, "longflash"), message=_summary(e))
        if device == "cuda":
            torch.cuda.empty_cache()
    return out


def _rows(base, kv_dtype, route, r, fl, log):
    """time_ms, tflops and max_err_o_sampled of one route at one shape."""
    row = dict(base, kv_dtype=kv_dtype or math.nan, route=route)
    (med, p20, p80), status = r["times"], r["status"]
    ok = status == "ok"
    rate = (lambda ms: tflops(fl, ms)) if ok else (lambda ms: math.nan)
    log(f"prefill B={base['batch']} N={base['seqlen_k']:<6d} chunk={base['seqlen_q']:<5d} "
        f"{kv_dtype or base['dtype']:<13} {route:<9} {med:9.3f} ms {rate(med):8.3f} TFLOP/s "
        f"err {r['err']:.2e}  [{status}]" + (f"  {r['message']}" if r["message"] else ""))
    err_status = status if not ok or math.isfinite(r["err"]) else "error"
    return [dict(row, metric="time_ms", value=med, unit="ms", p20=p20, p80=p80, status=status),
            dict(row, metric="tflops", value=rate(med), unit="TFLOP/s", p20=rate(p80),
                 p80=rate(p20), status=status),
            dict(row, metric="max_err_o_sampled", value=r["err"], unit="abs", p20=math.nan,
                 p80=math.nan, status=err_status)]
