"""RQ1, part "sparse_decode": a decoding step that reads only the key blocks each head selects.

    python -m experiments.speedup --parts sparse_decode          # CPU: a cache of 16K tokens
    python -m experiments.speedup --full --parts sparse_decode   # GPU: 32K and 128K, bfloat16

Block-selecting decoding (Quest, MoBA, NSA's selected branch) keeps a few key blocks of the
cache per step. Part decode's shape (Config.decode_*: 32 query heads over 8 KV heads, head dim
128), one query per sequence, caches of Config.sparse_decode_seqlens tokens, batches
Config.sparse_decode_batches. The mask: blocks of 128 keys, each kept with probability density
(Config.sparse_decode_densities), the first (the attention sink) and the last (the local
window) always; at density 1 no mask at all. Chosen (key column mask_heads) per KV head,
"kv", shared by its group of query heads as NSA selects them (a kernel that packs the group
into one tile reads the union of its heads' blocks: per-query-head choices would read more),
or once per sequence for every head, "shared" (a retrieval over the context, or
StreamingLLM's sink and window). Both paths loop over each KV head's list of the blocks its
group sees, the splits sharing them evenly; the PyTorch path reads a "shared" mask's runs of
blocks through views, a "kv" mask's blocks through a gathered copy per head (on a CPU the
copy costs about as much as the reads it saves at density 0.5). Routes (key columns density, mask_heads and route, beside
experiments.results.KEY_COLUMNS):
  longflash  route "block_mask": longflash.attention_with_kvcache(..., block_mask=): the
             split-KV kernel loads nothing of a hidden block (Triton on a GPU, the PyTorch
             path on a CPU); route "attn_mask": the same call given the blocks as an
             elementwise boolean attn_mask (b, h, 1, N): the kernel reads every key tile and
             masks it, what a decoding kernel without block sparsity does.
  flex       GPU only: compiled FlexAttention (enable_gqa) with the blocks as a BlockMask of
             full blocks (experiments.block_sparse.flex_block_mask): it skips the others.
  sdpa_efficient, sdpa_cudnn, sdpa_math (GPU), sdpa_cpu (CPU)
             route "attn_mask": scaled_dot_product_attention with the elementwise mask, the
             group's query heads as the query rows of their KV head (exact for one query: the
             GQA packing the kernel does, and no enable_gqa, whose CPU path falls back to the
             math kernel with a mask).
Rows (experiment "speedup", part "sparse_decode", mode "fwd", causal False; columns density,
blocks_kept: the fraction of (sequence, KV head, block) entries kept, measured), as part
decode's (experiments.decode.step_rows):
  time_ms (ms)          median with p20/p80 (on a CPU the routes of one shape in turn).
  time_ms_graph (ms)    GPU only: CUDA-graph replays, the GPU's time without the host's.
  read_gbps (GB/s)      the kept blocks' cache bytes (keys and values) / time, for every
                        route: what a step must read, whether it reads more or not.
  max_err_o_sampled     longflash only: max |o - o_ref| of the first sequence, against
                        attention_ref in float64 with the elementwise mask.
"""

import math
import time

import torch

import longflash
from experiments.block_sparse import BLOCK, elementwise, flex_block_mask
from experiments.decode import _max_err, _time, measured_rows, prepare_step, step_rows
from experiments.results import load_average
from experiments.speedup import SDPA_BACKENDS, Unsupported, compiled_flex, sdpa

GPU_PROVIDERS = ("longflash", "flex", "sdpa_efficient", "sdpa_cudnn", "sdpa_math")
CPU_PROVIDERS = ("longflash", "sdpa_cpu")
KEY_COLUMNS = ("density", "mask_heads", "route")  # beside experiments.results.KEY_COLUMNS
MASK_HEADS = ("kv", "shared")


def masks(densities):
    """The (density, mask_heads) pairs a shape is measured at: each density below 1 with both
    kinds of mask, density 1 (no mask) once, as "shared"."""
    return [(x, m) for x in densities for m in (MASK_HEADS if x < 1 else ("shared",))]


def routes(provider):
    """A provider's routes: LongFlash takes the blocks both ways, FlexAttention as blocks,
    SDPA as an elementwise mask."""
    return {"longflash": ("block_mask", "attn_mask"), "flex": ("block_mask",)}.get(
        provider, ("attn_mask",))


def blocks_kept(mask, group):
    """The fraction of (sequence, KV head, block) entries mask keeps (1 without a mask)."""
    return 1.0 if mask is None else mask[:, ::group].float().mean().item()


def block_mask(batch, nheads, nheads_kv, seqlen_k, density, mask_heads, seed, device):
    """(batch, nheads, 1, key blocks) bool, chosen per KV head and repeated over its group
    (mask_heads "kv"), or (batch, 1, 1, key blocks) ("shared"): each block kept with
    probability density, the first and last always; None at density 1 (no mask)."""
    if density >= 1:
        return None
    blocks = -(-seqlen_k // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    heads = nheads_kv if mask_heads == "kv" else 1
    mask = torch.rand(batch, heads, 1, blocks, generator=gen) < density
    mask[..., 0] = mask[..., -1] = True
    return mask.repeat_interleave(nheads // heads, dim=1).to(device)


def _inputs(cfg, batch, seqlen_k, dtype, device, seed):
    """{"bnhd": (q, k_cache, v_cache) as attention_with_kvcache takes them, "rows": q as
    (batch, nheads_kv, group, headdim) and the cache as (batch, nheads_kv, seqlen_k,
    headdim)}. Random normal, never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hkv, d = cfg.decode_nheads, cfg.decode_nheads_kv, cfg.decode_headdim
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=gen)
               for shape in ((batch, 1, h, d), *((batch, seqlen_k, hkv, d),) * 2))
    rows = (q.view(batch, hkv, h // hkv, d), *(x.transpose(1, 2).contiguous() for x in (k, v)))
    return {"bnhd": (q, k, v), "rows": rows,
            "bhnd": (q.transpose(1, 2).contiguous(), *rows[1:])}


def make_step(provider, route, device, mask, dense, seqlen_k, nheads_kv):
    """(step, layout): step(*inputs[layout]) -> o, over the blocks (mask) or their elementwise
    (batch, nheads, 1, seqlen_k) mask (dense). Raises Unsupported."""
    if provider == "longflash":
        backend = "triton" if device == "cuda" else "torch"
        kw = dict(block_mask=mask) if route == "block_mask" else dict(attn_mask=dense)
        return (lambda q, k, v: longflash.attention_with_kvcache(
            q, k, v, cache_seqlens=seqlen_k, backend=backend, **kw)), "bnhd"
    if provider == "flex":
        flex = compiled_flex(device)
        blocks = None if mask is None else flex_block_mask(mask, 1, seqlen_k)
        return (lambda q, k, v: flex(q, k, v, block_mask=blocks, enable_gqa=True)), "bhnd"
    if provider == "sdpa_cpu" or provider in SDPA_BACKENDS:
        if dense is not None:  # (B, H, 1, N) -> the group's heads as rows, (B, Hkv, G, N)
            dense = dense.view(dense.shape[0], nheads_kv, -1, seqlen_k)
        return sdpa(provider, attn_mask=dense), "rows"
    raise ValueError(f"unknown sparse_decode provider {provider!r}")


def existing_keys(path, after=None):
    """Keys of the part's time_ms rows already in path (for --resume)."""
    df = measured_rows(path, "sparse_decode", "route", after)
    if df is None:
        return set()
    return {_key(*row) for row in df[["provider", "route", "dtype", "batch", "seqlen_k",
                                      "density", "mask_heads"]].itertuples(index=False)}


def _key(provider, route, dtype, batch, seqlen_k, density, mask_heads):
    return provider, route, str(dtype), int(batch), int(seqlen_k), float(density), mask_heads


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part sparse_decode, but none whose key is in `done` (existing_keys). Starts no
    (batch, seqlen_k, density) group once cfg.budget_s seconds have passed since `started`."""
    dtype = getattr(torch, cfg.dtype)
    providers = [p for p in cfg.providers if p in (GPU_PROVIDERS if device == "cuda"
                                                    else CPU_PROVIDERS)]
    calls = [(p, r) for p in providers for r in routes(p)]
    h, hkv, d = cfg.decode_nheads, cfg.decode_nheads_kv, cfg.decode_headdim
    rows = []
    for batch in cfg.sparse_decode_batches:
        for seqlen_k in cfg.sparse_decode_seqlens:
            inputs = None
            for density, heads in masks(cfg.sparse_decode_densities):
                if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                    log(f"budget of {cfg.budget_s:.0f} s spent: sparse_decode B={batch} "
                        f"N={seqlen_k} density={density} {heads} not run")
                    continue
                todo = [(p, r) for p, r in calls
                        if _key(p, r, cfg.dtype, batch, seqlen_k, density, heads) not in done]
                if not todo:
                    continue
                if inputs is None:
                    inputs = _inputs(cfg, batch, seqlen_k, dtype, device, seed=seqlen_k + batch)
                mask = block_mask(batch, h, hkv, seqlen_k, density, heads,
                                  seed=seqlen_k + batch, device=device)
                kept = blocks_kept(mask, h // hkv)
                dense = None if mask is None else elementwise(mask, 1, seqlen_k)
                base = dict(experiment="speedup", part="sparse_decode", mode="fwd",
                            dtype=cfg.dtype, causal=False, batch=batch, seqlen_q=1,
                            seqlen_k=seqlen_k, nheads=h, nheads_kv=hkv, headdim=d,
                            density=density, mask_heads=heads, blocks_kept=kept,
                            load_avg_1m=load_average()[0], **machine)
                ready = [_prepare(p, r, inputs, device, mask, dense, seqlen_k, hkv)
                         for p, r in todo]
                _time(ready, device, cfg)
                kept_bytes = 2 * batch * seqlen_k * hkv * d * dtype.itemsize * kept
                for (provider, route), r in zip(todo, ready):
                    rows += step_rows(dict(base, provider=provider, route=route),
                                      f"{route:<10} {density:<6g} {heads:<6}", r,
                                      kept_bytes, log)
                if device == "cuda":
                    torch.cuda.empty_cache()
            del inputs
    return rows


def _prepare(provider, route, inputs, device, mask, dense, seqlen_k, nheads_kv):
    """One route's step at one shape and mask (experiments.decode.prepare_step), with its
    error (longflash) against float64 over the first sequence."""
    def build():
        step, layout = make_step(provider, route, device, mask, dense, seqlen_k, nheads_kv)
        args = inputs[layout]
        o = step(*args)  # warm-up: compilation, autotuning
        err = (_max_err(o, *inputs["bnhd"], attn_mask=dense) if provider == "longflash"
               else math.nan)
        return (lambda: step(*args)), err, math.nan
    return prepare_step(provider, build, device)
