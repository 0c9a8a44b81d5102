"""RQ1, part "sparse": block-sparse attention against the fraction of blocks it keeps.

    python -m experiments.speedup --parts sparse          # CPU: 4K tokens, float32
    python -m experiments.speedup --full --parts sparse   # GPU: 16K and 64K tokens, bfloat16

A random block mask of 128 x 128 blocks shared by every head (as BigBird's or Longformer's
patterns are; Config.sparse_*), one per density in Config.sparse_densities (each block kept
with that probability, and every query block's diagonal block kept, so that every row sees a
key), non-causal, modes fwd and fwd_bwd; at density 1 no mask at all: the dense attention
each provider computes anyway. (The kernels skip a block per batch row and head, so a mask per
head costs them the same; the blockwise path, which batches the heads, skips a tile only where
every head hides it.) Providers (key
column density, beside experiments.results.KEY_COLUMNS):
  longflash   longflash.attention(q, k, v, block_mask=...): the kernels skip the hidden blocks
              (Triton on a GPU, the blockwise path on a CPU).
  flex        GPU only: compiled FlexAttention with the same blocks as a BlockMask of full
              blocks (BlockMask.from_kv_blocks, no mask_mod: it skips the hidden blocks too).
  sdpa_efficient (GPU), sdpa_cpu (CPU), standard
              scaled_dot_product_attention (standard: attention_ref in the run's dtype) with
              the blocks made elementwise, a (1, 1, N, N) boolean attn_mask: dense work,
              masked; "unsupported" where that mask would take more than SDPA_MASK_MAX_BYTES.
Rows (experiment "speedup", part "sparse"), as part batch's (experiments.speedup._rows):
  time_ms, peak_mem_mb, tflops (the kept blocks' FLOPs only: the dense attention's times
  the fraction kept, so that a provider that skips nothing shows a lower rate); column
  blocks_kept: the fraction of blocks the mask keeps (measured: density plus the diagonal).
"""

import math
import time

import torch

import longflash
from experiments.speedup import (SDPA_BACKENDS, Unsupported, _rows, _status, _summary,
                                 compiled_flex, measure, sdpa)

GPU_PROVIDERS = ("longflash", "flex", "sdpa_efficient")
CPU_PROVIDERS = ("longflash", "sdpa_cpu", "standard")
KEY_COLUMNS = ("density",)  # beside experiments.results.KEY_COLUMNS
MODES = ("fwd", "fwd_bwd")
BLOCK = longflash._common.BLOCK_SPARSE_UNIT  # the blocks: 128 x 128
SDPA_MASK_MAX_BYTES = 8 << 30


def block_mask(seqlen, density, seed, device):
    """(1, 1, blocks, blocks) bool: each block kept with probability density, the diagonal
    always; None at density 1 (no mask)."""
    if density >= 1:
        return None
    blocks = -(-seqlen // BLOCK)
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(1, 1, blocks, blocks, generator=gen) < density
    mask |= torch.eye(blocks, dtype=torch.bool)
    return mask.to(device)


def flex_block_mask(mask, seqlen_q, seqlen_k=None):
    """FlexAttention's BlockMask of exactly these blocks (mask: (batch or 1, heads or 1,
    query blocks, key blocks)), each a full block: the compiled kernel skips the others and
    never evaluates the mask_mod inside a full one; the mask_mod (the same blocks,
    elementwise) is what eager flex_attention, which ignores the blocks, computes.
    seqlen_k: default seqlen_q."""
    from torch.nn.attention.flex_attention import BlockMask
    counts = mask.sum(-1, dtype=torch.int32)
    order = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    empty = torch.zeros_like(counts)
    one_b, one_h = mask.shape[0] == 1, mask.shape[1] == 1

    def mask_mod(b, h, q_idx, kv_idx):
        return mask[0 if one_b else b, 0 if one_h else h, q_idx // BLOCK, kv_idx // BLOCK]

    return BlockMask.from_kv_blocks(empty, order, counts, order, BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod,
                                    seq_lengths=(seqlen_q, seqlen_k or seqlen_q))


def elementwise(mask, seqlen_q, seqlen_k=None):
    """The (.., seqlen_q, seqlen_k) boolean attn_mask the blocks stand for (of the mask's
    batch and heads: (1, 1, N, N) for part sparse's); seqlen_k: default seqlen_q."""
    return longflash._common.block_mask_elements(mask, BLOCK, BLOCK, seqlen_q,
                                                 seqlen_k or seqlen_q)


def make_attention(provider, device, mask, seqlen):
    """(attn, layout) as experiments.speedup.make_attention, over this block mask (None:
    dense). Raises Unsupported."""
    if provider == "longflash":
        backend = "triton" if device == "cuda" else "torch"
        return (lambda q, k, v: longflash.attention(q, k, v, backend=backend,
                                                    block_mask=mask)), "bnhd"
    if provider == "flex":
        flex, blocks = compiled_flex(device), None
        if mask is not None:
            blocks = flex_block_mask(mask, seqlen)
        return (lambda q, k, v: flex(q, k, v, block_mask=blocks)), "bhnd"
    dense = None
    if mask is not None:
        nbytes = seqlen * seqlen
        if nbytes > SDPA_MASK_MAX_BYTES:
            raise Unsupported(f"the elementwise mask would take {nbytes / 2**30:.0f} GiB")
        dense = elementwise(mask, seqlen)
    if provider == "standard":
        return (lambda q, k, v: longflash.attention_ref(q, k, v, upcast=False,
                                                        attn_mask=dense)[0]), "bnhd"
    if provider == "sdpa_cpu" and device == "cuda":
        raise Unsupported("sdpa_cpu is PyTorch's SDPA on CPU tensors")
    if provider == "sdpa_cpu" or provider in SDPA_BACKENDS:
        return sdpa(provider, attn_mask=dense), "bhnd"
    raise ValueError(f"unknown sparse provider {provider!r}")


def existing_keys(path, after=None):
    """Keys of the part-sparse time_ms rows already in path (for --resume)."""
    from experiments.decode import measured_rows
    df = measured_rows(path, "sparse", "density", after)
    if df is None:
        return set()
    return {_key(*row) for row in df[["provider", "mode", "dtype", "seqlen_q",
                                      "density"]].itertuples(index=False)}


def _key(provider, mode, dtype, seqlen, density):
    return provider, mode, str(dtype), int(seqlen), float(density)


def _inputs(cfg, seqlen, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (1, seqlen, cfg.sparse_nheads, cfg.sparse_headdim)
    x = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(4)]
    bnhd = [t.requires_grad_(i < 3) for i, t in enumerate(x)]
    bhnd = [t.detach().transpose(1, 2).contiguous().requires_grad_(i < 3)
            for i, t in enumerate(x)]
    return {"bnhd": bnhd, "bhnd": bhnd}


def run(cfg, device, log, machine, started, done=frozenset()):
    """Rows of part sparse, but none whose key is in `done` (existing_keys). Starts no
    (seqlen, density) group once cfg.budget_s seconds have passed since `started`."""
    dtype = getattr(torch, cfg.dtype)
    providers = [p for p in cfg.providers if p in (GPU_PROVIDERS if device == "cuda"
                                                    else CPU_PROVIDERS)]
    rows = []
    for seqlen in cfg.sparse_seqlens:
        inputs = _inputs(cfg, seqlen, dtype, device, seed=seqlen)
        for density in cfg.sparse_densities:
            if cfg.budget_s and time.perf_counter() - started > cfg.budget_s:
                log(f"budget of {cfg.budget_s:.0f} s spent: sparse N={seqlen} "
                    f"density={density} not run")
                continue
            todo = [(p, m) for p in providers for m in MODES
                    if _key(p, m, cfg.dtype, seqlen, density) not in done]
            if not todo:
                continue
            mask = block_mask(seqlen, density, seed=seqlen, device=device)
            kept = 1.0 if mask is None else mask.float().mean().item()
            base = dict(experiment="speedup", part="sparse", dtype=cfg.dtype, batch=1,
                        seqlen_q=seqlen, seqlen_k=seqlen, nheads=cfg.sparse_nheads,
                        nheads_kv=cfg.sparse_nheads, headdim=cfg.sparse_headdim, causal=False,
                        density=density, blocks_kept=kept, **machine)
            nan = math.nan
            for provider in dict.fromkeys(p for p, _ in todo):
                try:
                    attn, layout = make_attention(provider, device, mask, seqlen)
                    failure = None
                except Exception as e:  # noqa: BLE001 - rows with their status
                    attn, failure = None, (_status(e, provider), _summary(e))
                for mode in [m for p, m in todo if p == provider]:
                    if failure:
                        status, peak, times, message = failure[0], nan, (nan,) * 3, failure[1]
                    else:
                        status, peak, times, message = measure(
                            attn, inputs[layout], mode, device, cfg, False, provider)
                    new = _rows(base, provider, mode, status, peak, times)
                    new[2] = dict(new[2], value=new[2]["value"] * kept,
                                  p20=new[2]["p20"] * kept, p80=new[2]["p80"] * kept)
                    rows += new
                    log(f"sparse N={seqlen:<6d} density={density:<6g} kept={kept:.3f} "
                        f"{provider:<14} {mode:<7} {times[0]:10.3f} ms {peak:9.1f} MiB "
                        f"[{status}]" + (f"  {message}" if message else ""))
                attn = None
            if device == "cuda":
                torch.cuda.empty_cache()
        del inputs
    return rows
