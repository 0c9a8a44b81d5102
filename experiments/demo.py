"""Demo: LongFlash against the attention PyTorch already has, on this machine.

    python -m experiments.demo            # CPU: a minute or two; GPU: about a minute
    python -m experiments.demo --quick    # tiny sizes, seconds (used by the tests)

Prints two tables: (1) the max error of each provider's output and gradients
against the float64 reference at one small size, next to PyTorch's own error;
(2) median time (p20-p80) of forward and forward+backward over sequence lengths.
Providers: longflash (Triton on a GPU, the blockwise PyTorch path on a CPU),
PyTorch SDPA (its default backend on CPU; FlashAttention-2 and cuDNN forced on a
GPU), and standard attention (materializes the matrix). Nothing is written to
results/: the research-question scripts do that.
"""

import argparse
import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import longflash
from experiments.measure import is_oom, time_ms


@dataclass
class Config:
    batch: int = 1
    nheads: int = 8           # nheads_kv = nheads (plain multi-head attention)
    headdim: int = 64
    causal: bool = True
    check_seqlen: int = 1024  # length of the accuracy check
    seqlens: tuple = (1024, 2048, 4096)


def providers(device):
    """name -> fn(q, k, v) on (batch, seqlen, nheads, headdim) tensors."""
    def sdpa(backend=None):
        def fn(q, k, v, causal):
            ctx = contextlib.nullcontext() if backend is None else \
                torch.nn.attention.sdpa_kernel(backend)
            with ctx:
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=causal).transpose(1, 2)
        return fn

    fns = {"longflash": lambda q, k, v, causal: longflash.attention(q, k, v, causal=causal)}
    if device == "cuda":
        backends = torch.nn.attention.SDPBackend
        fns["sdpa_flash"] = sdpa(backends.FLASH_ATTENTION)
        fns["sdpa_cudnn"] = sdpa(backends.CUDNN_ATTENTION)
    else:
        fns["sdpa_cpu"] = sdpa()
    fns["standard"] = lambda q, k, v, causal: longflash.attention_ref(q, k, v, causal=causal)[0]
    return fns


def inputs(cfg, seqlen, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.batch, seqlen, cfg.nheads, cfg.headdim)
    return [torch.randn(shape, device=device, dtype=dtype, generator=gen).requires_grad_()
            for _ in range(3)]


def accuracy(cfg, device, dtype):
    """Max error of o, dq, dk, dv against the float64 reference, per provider."""
    q, k, v = inputs(cfg, cfg.check_seqlen, device, dtype)
    do = torch.randn_like(q)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o64 = longflash.attention_ref(*x64, causal=cfg.causal)[0]
    ref = [o64, *torch.autograd.grad(o64, x64, do.double())]
    rows = []
    for name, fn in providers(device).items():
        try:
            o = fn(q, k, v, cfg.causal)
            got = [o, *torch.autograd.grad(o, (q, k, v), do)]
            errs = [(a.double() - b).abs().max().item() for a, b in zip(got, ref)]
            rows.append((name, *[f"{e:.2e}" for e in errs]))
        except RuntimeError as e:  # a backend that this machine or this shape does not support
            rows.append((name, "unsupported: " + str(e).splitlines()[0][:60], "", "", ""))
    return rows


def timings(cfg, device, dtype):
    rows = []
    for seqlen in cfg.seqlens:
        q, k, v = inputs(cfg, seqlen, device, dtype)
        do = torch.randn_like(q)
        flop = 4 * cfg.batch * cfg.nheads * seqlen * seqlen * cfg.headdim / (2 if cfg.causal else 1)
        for name, fn in providers(device).items():
            for mode, factor in (("fwd", 1.0), ("fwd_bwd", 3.5)):
                def run():
                    o = fn(q, k, v, cfg.causal)
                    if mode == "fwd_bwd":
                        torch.autograd.grad(o, (q, k, v), do)
                try:
                    med, p20, p80 = time_ms(run, device)
                    rate = factor * flop / (med * 1e-3) / 1e12
                    rows.append((name, seqlen, mode, f"{med:.2f} ({p20:.2f}-{p80:.2f})",
                                 f"{rate:.3f}"))
                except Exception as e:  # noqa: BLE001 - the row records what happened
                    status = "oom" if is_oom(e) else "error: " + str(e).splitlines()[0][:50]
                    rows.append((name, seqlen, mode, status, ""))
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return rows


def print_table(title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for row in (header, ["-" * w for w in widths], *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = Config()
    if device == "cuda":
        cfg = Config(batch=2, nheads=16, headdim=128, seqlens=(1024, 4096, 16384))
    if args.quick:
        cfg = Config(batch=1, nheads=2, headdim=32, check_seqlen=64, seqlens=(64, 128))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"LongFlash demo on {name}: {dtype}, batch {cfg.batch}, {cfg.nheads} heads, "
          f"headdim {cfg.headdim}, causal={cfg.causal}, torch {torch.__version__}")
    print_table(f"Max error against float64 at seqlen {cfg.check_seqlen}",
                ("provider", "o", "dq", "dk", "dv"), accuracy(cfg, device, dtype))
    print_table("Median time in ms (p20-p80); TFLOP/s counts 4*B*H*N^2*D per forward, "
                f"{'halved for causal, ' if cfg.causal else ''}3.5x for forward+backward",
                ("provider", "seqlen", "mode", "time_ms", "TFLOP/s"), timings(cfg, device, dtype))


if __name__ == "__main__":
    main()
