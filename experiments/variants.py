"""Sliding-window attention: cost against sequence length, with and without a window.

    python -m experiments.variants            # CPU default: blockwise path, a few minutes
    python -m experiments.variants --full     # GPU sizes (Triton kernels), up to 64K tokens
    python -m experiments.variants --quick    # tiny sizes, seconds (the pipeline, in CI)

With a window of fixed width the kernels skip every key block outside it, so the
work per query block is constant and the total grows like N * window instead of
N^2 (causal). Rows (results/variants/<device>.csv; extra columns window_left,
window_right, block_m, block_n):
- time_ms (ms): forward time, median with p20/p80 (experiments.measure.time_ms), of
  longflash.attention on this device (the blockwise path on a CPU, Triton on a GPU).
- key_blocks_visited (blocks): key blocks the forward kernel loops over, summed over
  query blocks and counted by the Triton kernels' own range functions
  (flash_triton.block_ranges, run under TRITON_INTERPRET=1 when there is no GPU; without
  Triton installed, as on macOS, by _common.key_range, which tests/test_variants.py checks
  equal to them) for the tile block_m x block_n given in the row. A property of the loop
  structure; it does not depend on the device.
"""

import argparse
import os
from dataclasses import dataclass, replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the range probe runs on the CPU

import longflash  # noqa: E402
from longflash import _common  # noqa: E402
from experiments.measure import is_oom, time_ms  # noqa: E402
from experiments.results import default_out, write_results  # noqa: E402

KEY_COLUMNS = ("window_left", "window_right", "block_m", "block_n")  # beside results'


def _key_ranges(seqlen, left, right, block_m, block_n, device):
    """(query blocks, 4) key ranges (lo, mid_lo, mid_hi, hi) of a causal forward: the kernels'
    own, or _common's where Triton is not installed."""
    try:
        from longflash import flash_triton
    except ImportError:
        return torch.tensor([_common.key_range(start_m, block_m, block_n, seqlen, seqlen, left,
                                               right) for start_m in range(0, seqlen, block_m)])
    return flash_triton.block_ranges(seqlen, seqlen, left, right, block_m, block_n, keys=True,
                                     device=device)


@dataclass
class Config:
    batch: int = 1
    nheads: int = 4
    headdim: int = 64
    seqlens: tuple = (1024, 2048, 4096, 8192, 16384)
    windows: tuple = ((-1, 0), (256, 0))  # causal, and causal with a 256-token window
    block_m: int = 128                     # tile for the block count (a typical GPU tile)
    block_n: int = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="GPU sizes, up to 64K tokens")
    size.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the pipeline)")
    parser.add_argument("--seqlens", help="comma-separated sequence lengths (a slice, or tiny "
                        "ones for a dry run)")
    parser.add_argument("--out", default=None, help="CSV path (default results/variants/<device>.csv)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = Config(nheads=16, headdim=128, seqlens=tuple(2**i for i in range(10, 17))) \
        if args.full else Config(nheads=2, headdim=32, seqlens=(256, 512)) if args.quick \
        else Config()
    if args.seqlens:
        cfg = replace(cfg, seqlens=tuple(int(x) for x in args.seqlens.split(",")))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = "triton" if device == "cuda" else "torch"
    out = args.out or default_out("variants")
    rows = []
    for seqlen in cfg.seqlens:
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(cfg.batch, seqlen, cfg.nheads, cfg.headdim, device=device,
                               dtype=dtype, generator=gen) for _ in range(3))
        for left, right in cfg.windows:
            base = dict(experiment="variants", provider="longflash", mode="fwd",
                        dtype=str(dtype).replace("torch.", ""), batch=cfg.batch, seqlen_q=seqlen,
                        seqlen_k=seqlen, nheads=cfg.nheads, nheads_kv=cfg.nheads,
                        headdim=cfg.headdim, causal=True, window_left=left, window_right=right,
                        block_m=cfg.block_m, block_n=cfg.block_n)
            ranges = _key_ranges(seqlen, left, right, cfg.block_m, cfg.block_n, device)
            visited = ((ranges[:, 3] - ranges[:, 0] + cfg.block_n - 1) // cfg.block_n).sum()
            rows.append(dict(base, metric="key_blocks_visited", value=int(visited), unit="blocks",
                             p20=float("nan"), p80=float("nan"), status="ok"))
            try:
                med, p20, p80 = time_ms(lambda: longflash.attention(
                    q, k, v, causal=True, window_size=(left, right), backend=backend), device)
                rows.append(dict(base, metric="time_ms", value=med, unit="ms", p20=p20, p80=p80,
                                 status="ok"))
            except Exception as e:  # noqa: BLE001 - recorded as a row, not a crash
                rows.append(dict(base, metric="time_ms", value=float("nan"), unit="ms",
                                 p20=float("nan"), p80=float("nan"),
                                 status="oom" if is_oom(e) else "error"))
            print(f"N={seqlen:6d} window=({left},{right}): {rows[-2]['value']:6d} key blocks, "
                  f"{rows[-1]['value']:.1f} ms ({rows[-1]['status']})", flush=True)
    write_results(rows, out, key_columns=KEY_COLUMNS)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
