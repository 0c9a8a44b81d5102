"""RQ4, long-context training: how much longer a context fits in the same memory with an exact
IO-aware attention, and whether the longer context helps.

    python -m experiments.long_context_training --quality-provider sdpa_cpu   # CPU (~35 min)
    python -m experiments.long_context_training --parts max_context,memory_model
    python -m experiments.long_context_training --quick --out /tmp/l.csv   # tiny, for the tests
    python -m experiments.long_context_training --full               # GPU sizes
    python -m experiments.long_context_training --full --budget-s 240    # the search cut short
    python -m experiments.long_context_training --parts quality --resume   # continue runs

The model is longflash.models.GPT (byte-level, rotary, pre-norm) with attn_impl "longflash",
"sdpa" or "standard" (materialized); everything else is identical. Writes
results/long_context_training/<device>.csv ("cpu", or the GPU, e.g. "h100"), the log
<device>.log and the resolved config <device>.json. Rows are written (merged by key,
atomically) as they are measured: after each part, and in max_context after every probe and
every search, so a run killed at a timeout keeps what it measured. Parts run in the order of
PARTS (the cheap memory_model before max_context), whatever the order of --parts. Training
runs keep checkpoints (model, optimizer, step, RNG states) every `checkpoint_every` steps in
`run_dir`/<run name>/; --resume continues each run from its last checkpoint (a finished run
is not repeated).

Rows follow experiments/results.py, experiment "long_context_training", dtype "float32" on
CPU ("bfloat16" autocast with --full), causal, with extra columns part, model
("L2-d128-h4": layers, width, heads; "7b" for the projection), budget_mb, checkpoint
(activation checkpointing), seed, step, basis ("measured" / "projected"); all but basis are
key columns; a column note says how to read a row where that needs saying (max_seqlen: the
bracket, a lower bound, not measured). Providers: "longflash", "standard", "sdpa_cpu"
(PyTorch SDPA on CPU: a fused, memory-efficient kernel) or "sdpa_flash" (--full). seqlen_q =
seqlen_k = the context; 0 on summary rows (max_seqlen, projections) so that their keys do not
depend on their value.

Parts and metrics:
  max_context   per model and attention, one full training step (forward, backward, AdamW
                step, batch 1) per probe under a memory budget of budget_mb (CPU: a forked
                child whose address space is capped, experiments.measure.peak_memory_mb;
                GPU: torch.cuda peak stats, and a real CUDA OOM): contexts double from
                search_start, then bisect in multiples of search_resolution tokens until the
                gap is at most search_resolution or search_fraction of the bracket that the
                doubling left (--full: 1/8, three bisection probes). Every probe is a row,
                mode "train_step", metric peak_mem_mb (status ok or oom); then max_seqlen
                (unit tokens; seqlen 0), the longest context that fit, note "N did not fit"
                (the true maximum lies in [max_seqlen, N)). Lower bounds (status ok, the note
                starts with "lower bound"): the search stops doubling at search_cap; and with
                a time budget (--budget-s, counted from the start of the run) no probe is
                started whose predicted time (the last probe's, scaled by the square of the
                length ratio) runs past it, and the search ends there.
                A search that the budget leaves no time to start is a max_seqlen row with
                status error, value NaN, note "not measured: time budget". On CUDA each model
                is built once per search (one model on the GPU at a time) and reused by its
                probes, each probe with a fresh optimizer; on CPU each probe builds its own.
  memory_model  peak_mem_mb of one training step, batch 1, at memory_seqlens[provider], no
                budget (the notebook fits peak = c0 + c1 s + c2 s^2). Plus the projection
                (basis "projected", model "7b", never measured): projected_peak_gb per GPU
                at projection_seqlens, and projected_max_seqlen, for standard (materialized)
                and longflash attention, with and without full activation checkpointing,
                from Korthikanti et al.'s per-layer activations (see activation_bytes).
  quality       byte-level language modelling of the Python standard library's sources
                (experiments.byte_data: split by file, 95/5), one run per context in
                quality_contexts, equal tokens per step (batch = tokens_per_step / context)
                and equal steps, attention quality_provider (the CPU run: sdpa_cpu, for speed;
                every provider is exact, see exactness): train_loss (mean of the logged
                interval, nats/byte, key step), val_loss (nats/byte) and val_bpb (bits per
                byte) on the same first eval_tokens validation bytes for every context, and
                train_time_s. Seeds: quality_seeds for every context, noise_seeds for
                noise_context (the seed noise).
  exactness     longflash, standard and SDPA trained side by side from the same initialization
                on the same batches: train_loss at every step (mode train), and
                max_loss_diff (provider longflash or sdpa_*) = max over steps
                |loss_provider - loss_standard|.
  mqar          multi-query associative recall (Zoology, Arora et al. 2023): key-value pairs
                at the start, queried later, at mqar_seqlen where standard attention is over
                the budget (probe rows: peak_mem_mb of one training step, batch 1, under
                budget_mb for standard and longflash), trained with longflash first at
                mqar_short_seqlen then at mqar_seqlen: mqar_acc (fraction of queries whose
                value is the arg-max prediction, held-out sequences) at both lengths,
                mqar_chance (1 / number of values) and train_loss.
"""

import argparse
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import NamedTuple

import torch

from longflash.models.gpt import GPT, GPTConfig
from longflash.nn import attention_function
from experiments import byte_data
from experiments.measure import is_oom, peak_memory_mb
from experiments.results import Log, cpu_name, start_run, usable_cores, write_results

try:
    from tqdm.auto import tqdm
except ImportError:  # printed counters instead
    tqdm = None

# In running order: the cheap parts first, so that a run cut short (the GPU campaign's stage 3
# kills the step at its timeout) has them; max_context has a time budget of its own.
PARTS = ("exactness", "memory_model", "max_context", "mqar", "quality")
KEY_COLUMNS = ("part", "model", "budget_mb", "checkpoint", "seed", "step")
IMPLS = {"longflash": "longflash", "standard": "standard", "sdpa_cpu": "sdpa",
         "sdpa_flash": "sdpa"}  # provider -> GPTConfig.attn_impl


@dataclass
class Config:
    models: tuple = ("L2-d128-h4", "L4-d256-h8")  # max_context: layers, width, heads
    budgets_mb: tuple = (256, 384)        # max_context: one budget per model (MiB)
    providers: tuple = ("standard", "sdpa_cpu", "longflash")
    search_start: int = 512               # max_context: first probe (tokens)
    search_resolution: int = 256          # ... bisection stops at this gap
    search_cap: int = 32768               # ... no probe beyond (then max is a lower bound)
    search_fraction: float = 0.0          # ... or at this fraction of the doubling's bracket
    time_budget_s: float = math.inf       # max_context: no probe predicted to end past this
    #                                       many seconds after the start of the run
    memory_seqlens: tuple = (("standard", (256, 512, 1024, 1536, 2048, 3072)),
                             ("sdpa_cpu", (512, 1024, 2048, 4096, 6144, 8192)),
                             ("longflash", (512, 1024, 2048, 4096, 6144, 8192)))
    memory_model: str = "L2-d128-h4"      # memory_model: the model measured
    quality_model: str = "L2-d128-h4"     # quality, exactness, mqar
    quality_provider: str = "longflash"   # quality: any exact attention (see exactness)
    quality_contexts: tuple = (256, 512, 1024, 2048)
    tokens_per_step: int = 2048           # quality: batch = tokens_per_step / context
    quality_steps: int = 200              # quality: same for every context
    quality_seeds: tuple = (0,)
    noise_context: int = 512              # quality: extra seeds at this context ...
    noise_seeds: tuple = (1,)             # ... for the seed noise
    eval_tokens: int = 65536              # validation bytes scored (multiple of each context)
    val_fraction: float = 0.05
    lr: float = 2e-3                      # AdamW, linear warm-up then cosine to lr / 10
    warmup_steps: int = 20
    weight_decay: float = 0.1
    log_every: int = 10                   # train_loss rows, progress
    checkpoint_every: int = 50            # steps between checkpoints
    run_dir: str = "/tmp/longflash_runs"  # checkpoints, one folder per run
    exact_context: int = 512              # exactness
    exact_batch: int = 4
    exact_steps: int = 30
    mqar_seqlen: int = 4096               # mqar: long length (standard over budget_mb there)
    mqar_budget_mb: int = 256
    mqar_short_seqlen: int = 256
    mqar_num_kv: int = 16                 # key-value pairs per sequence (= queries)
    mqar_short_steps: int = 150
    mqar_short_batch: int = 8
    mqar_steps: int = 10
    mqar_batch: int = 1
    mqar_lr: float = 3e-3
    mqar_eval_seqs: int = 16
    device: str = "cpu"
    dtype: str = "float32"                # with CUDA: bfloat16 autocast, float32 weights
    projection_gpus: int = 8              # 7B projection: ZeRO-3 shards model states
    projection_gpu_gb: float = 80.0
    projection_seqlens: tuple = tuple(2**i for i in range(11, 21))  # 2K .. 1M


FULL = dict(  # GPT-2 small and medium on one 80 GB GPU (run on an H100 in the GPU campaign)
    models=("L12-d768-h12", "L24-d1024-h16"), budgets_mb=(80 * 1024, 80 * 1024),
    providers=("standard", "sdpa_flash", "longflash"), search_start=1024, search_cap=2**20,
    # a probe near the maximum (256K+ tokens) takes 10-30 s on an H100; no time budget here
    # (the campaign's stage 3 passes its own, about 270 s for exactness, memory_model and
    # max_context)
    search_resolution=1024, search_fraction=1 / 8,
    memory_model="L12-d768-h12",
    memory_seqlens=(("standard", (1024, 2048, 4096, 8192, 16384)),
                    ("sdpa_flash", (4096, 8192, 16384, 32768, 65536)),
                    ("longflash", (4096, 8192, 16384, 32768, 65536))),
    quality_model="L12-d768-h12", quality_contexts=(1024, 2048, 4096, 8192, 16384),
    tokens_per_step=65536, quality_steps=2000, lr=6e-4, eval_tokens=2**20, exact_context=2048,
    exact_steps=100, mqar_seqlen=65536, mqar_budget_mb=8 * 1024, mqar_steps=200,
    mqar_short_steps=2000, device="cuda", dtype="bfloat16")
QUICK = dict(
    models=("L1-d32-h2",), budgets_mb=(48,), search_start=256, search_resolution=256,
    search_cap=4096, memory_seqlens=(("standard", (128, 256, 512)),
                                     ("sdpa_cpu", (128, 256, 512)),
                                     ("longflash", (128, 256, 512))),
    memory_model="L1-d32-h2", quality_model="L1-d32-h2", quality_contexts=(64, 128),
    tokens_per_step=256, quality_steps=6, noise_context=64, eval_tokens=1024, log_every=2,
    checkpoint_every=3, warmup_steps=2, exact_context=64, exact_batch=2, exact_steps=4,
    mqar_seqlen=512, mqar_budget_mb=48, mqar_short_seqlen=64, mqar_num_kv=4,
    mqar_short_steps=4, mqar_short_batch=4, mqar_steps=2, mqar_batch=1, mqar_eval_seqs=2)


# ----------------------------------------------------------------------------- the model

def parse_model(spec):
    """"L2-d128-h4" -> (n_layer, n_embd, n_head)."""
    m = re.fullmatch(r"L(\d+)-d(\d+)-h(\d+)", spec)
    if not m:
        raise ValueError(f"model {spec!r}: expected 'L<layers>-d<width>-h<heads>'")
    return tuple(int(g) for g in m.groups())


def build(spec, provider, seed=0, checkpoint=False, vocab_size=256, device="cpu"):
    """GPT of `spec` with `provider`'s attention, initialized from `seed`. On CPU, LongFlash
    runs its blockwise PyTorch path even where TRITON_INTERPRET=1 is set (the tests)."""
    n_layer, n_embd, n_head = parse_model(spec)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          attn_impl=IMPLS[provider], checkpoint=checkpoint))
    if torch.device(device).type == "cpu":
        for block in model.blocks:
            block.attn.attn = attention_function(IMPLS[provider], backend="torch")
    return model.to(device)


def make_optimizer(model, lr, weight_decay):
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on norms
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def _autocast(cfg):
    if cfg.device == "cuda":
        return torch.autocast("cuda", dtype=getattr(torch, cfg.dtype))
    return torch.autocast("cpu", enabled=False)


def train_step(model, opt, x, y, cfg):
    """One full step: forward, backward, gradient clipping, AdamW. Returns the loss."""
    with _autocast(cfg):
        _, loss = model(x, y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


# ----------------------------------------------------------------------------- rows, log

log = Log()  # the raw log beside the results; set log.path in main


def row(cfg, part, provider, model, seqlen, batch, metric, value, unit, status="ok",
        mode="train", budget_mb=0, checkpoint=False, seed=0, step=-1, basis="measured",
        note=""):
    _, n_embd, n_head = parse_model(model) if model != "7b" else (32, 4096, 32)
    return dict(experiment="long_context_training", provider=provider, mode=mode,
                dtype=cfg.dtype if basis == "measured" else "bfloat16", batch=batch,
                seqlen_q=seqlen, seqlen_k=seqlen, nheads=n_head, nheads_kv=n_head,
                headdim=n_embd // n_head, causal=True, metric=metric,
                value=value if status == "ok" else math.nan, unit=unit, p20=math.nan,
                p80=math.nan, status=status, part=part, model=model, budget_mb=budget_mb,
                checkpoint=checkpoint, seed=seed, step=step, basis=basis, note=note)


# ----------------------------------------------------------------------------- max context

_WARM = set()
_CACHED = {}  # CUDA: {(model, provider): GPT}, at most one (see _model)


def _model(cfg, model_spec, provider):
    """The model a probe trains. CPU: a fresh one every time (the step runs in a forked child,
    so the parent's copy is never trained). CUDA: built once per (model, provider) and kept
    for the next probes, which is what a search needs (building GPT-2 medium takes seconds);
    only one is kept, so that no other model's weights take GPU memory from a probe."""
    if cfg.device != "cuda":
        return build(model_spec, provider, device=cfg.device)
    if (model_spec, provider) not in _CACHED:
        release_models(cfg)
        _CACHED[(model_spec, provider)] = build(model_spec, provider, device=cfg.device)
    return _CACHED[(model_spec, provider)]


def release_models(cfg):
    """Drop the model kept by _model (CUDA) and give its memory back."""
    _CACHED.clear()
    if cfg.device == "cuda":
        torch.cuda.empty_cache()


def probe_step(cfg, model_spec, provider, seqlen, budget_mb):
    """One full training step at seqlen, batch 1, under budget_mb: (status, peak MiB).

    A short step runs first in this process (once per model and attention), so that the
    library code and allocator arenas it touches are resident before the measuring child
    forks and are not counted as the step's memory. On CUDA the model is reused across
    probes (_model) with a fresh optimizer each time: what the step allocates (activations,
    gradients, AdamW's state) counts, as with a fresh model."""
    if (model_spec, provider) not in _WARM:
        model = _model(cfg, model_spec, provider)
        x = torch.randint(0, 256, (1, 128), device=cfg.device)
        train_step(model, make_optimizer(model, cfg.lr, cfg.weight_decay), x, x, cfg)
        _WARM.add((model_spec, provider))
    model = _model(cfg, model_spec, provider)
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    x = torch.randint(0, 256, (1, seqlen), device=cfg.device)
    fn = lambda: train_step(model, opt, x, x, cfg)  # noqa: E731
    try:
        if cfg.device == "cuda":
            peak = peak_memory_mb(fn, "cuda")  # a real CUDA OOM raises
            return ("ok", peak) if budget_mb is None or peak <= budget_mb else ("oom", peak)
        return "ok", peak_memory_mb(fn, "cpu", limit_mb=budget_mb)
    except Exception as e:  # noqa: BLE001 - recorded as a status row
        if not is_oom(e):
            log(f"  probe {provider} {seqlen}: {str(e)[-300:]}")
        return ("oom" if is_oom(e) else "error"), math.nan
    finally:
        if cfg.device == "cuda":
            model.zero_grad(set_to_none=True)  # a step that failed in its backward left some
        del model, opt, x, fn
        if cfg.device == "cuda":
            torch.cuda.empty_cache()


class Search(NamedTuple):
    best: int        # the longest context that fit (0: not even the first probe)
    capped: bool     # the doubling reached the cap: best is a lower bound
    probes: list     # (n, status, peak) in the order probed
    stopped: bool    # stop(n) ended the search: best is a lower bound


def search_max_context(probe, start, resolution, cap, fraction=0.0, stop=None):
    """Longest n in multiples of `resolution` with probe(n) ok: double from start while ok
    (not beyond cap), then bisect until the gap is at most max(resolution, fraction * the
    bracket the doubling left). probe(n) -> (status, peak). stop(n) -> True: n is not probed
    and the search ends (a time budget). Returns a Search; best 0 if start fails."""
    probes = []

    def ok(n):
        status, peak = probe(n)
        probes.append((n, status, peak))
        return status == "ok"

    lo, hi, n = 0, None, start
    while n <= cap:
        if stop is not None and stop(n):
            return Search(lo, False, probes, True)
        if not ok(n):
            hi = n
            break
        lo, n = n, 2 * n
    if hi is None:
        return Search(lo, True, probes, False)
    gap = max(resolution, fraction * (hi - lo))
    while hi - lo > gap:
        mid = (lo + hi) // 2 // resolution * resolution
        if mid <= lo:
            mid = lo + resolution
        if stop is not None and stop(mid):
            return Search(lo, False, probes, True)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Search(lo, False, probes, False)


def _search_note(search, cap):
    failed = [n for n, status, _ in search.probes if status != "ok" and n > search.best]
    bracket = f"{min(failed)} did not fit" if failed else ""
    if search.stopped and not search.probes:
        return "not measured: time budget"
    if search.stopped:
        return "lower bound: time budget spent" + (f"; {bracket}" if bracket else
                                                   ", still doubling")
    if search.capped:
        return f"lower bound: search_cap {cap} reached"
    return bracket


def part_max_context(cfg, emit=None, deadline=None, clock=time.monotonic):
    """The max_context rows. emit(rows), if given, is called with each probe's row as it is
    measured and with each search's max_seqlen row: the caller writes them. deadline (a time
    of `clock`): no probe is started that is predicted to end after it."""
    emit = emit or (lambda rows: None)
    rows = []
    for model_spec, budget in zip(cfg.models, cfg.budgets_mb):
        for provider in cfg.providers:
            t0 = time.perf_counter()
            last = []  # (seqlen, seconds) of this search's latest probe

            def probe(n):
                t1 = clock()
                status, peak = probe_step(cfg, model_spec, provider, n, budget)
                last[:] = [(n, clock() - t1)]
                log(f"  max_context {model_spec} {provider:<9} budget {budget} MiB  seqlen "
                    f"{n:>6}: {status} {peak:.0f} MiB ({time.perf_counter() - t0:.0f} s)")
                r = row(cfg, "max_context", provider, model_spec, n, 1, "peak_mem_mb", peak,
                        "MiB", status, "train_step", budget)
                rows.append(r)
                emit([r])
                return status, peak

            def stop(n):
                if deadline is None:
                    return False
                predicted = last[0][1] * max(1.0, n / last[0][0]) ** 2 if last else 0.0
                left = deadline - clock()
                if predicted < left:
                    return False
                log(f"  max_context {model_spec} {provider}: not probing {n} tokens: "
                    f"predicted {predicted:.0f} s, {max(left, 0):.0f} s of the budget left")
                return True

            search = search_max_context(probe, cfg.search_start, cfg.search_resolution,
                                        cfg.search_cap, cfg.search_fraction, stop)
            note = _search_note(search, cfg.search_cap)
            measured = bool(search.probes) or not search.stopped
            r = row(cfg, "max_context", provider, model_spec, 0, 1, "max_seqlen",
                    search.best if measured else math.nan, "tokens",
                    "ok" if measured else "error", "train_step", budget, note=note)
            rows.append(r)
            emit([r])
            log(f"max_context {model_spec} {provider}: {search.best} tokens"
                f"{f' ({note})' if note else ''}")
    release_models(cfg)
    return rows


# ----------------------------------------------------------------------------- memory model

def activation_bytes(s, h, a, attention, b=1):
    """Activation bytes of one transformer layer, Korthikanti et al. 2022 (16-bit activations,
    dropout masks of 1 byte): s*b*h*(34 + 5*a*s/h). The 5*a*s^2*b term (scores, softmax,
    its dropout mask and output) is the attention matrix; an IO-aware kernel stores none of
    it, only its output and a float32 log-sum-exp per row and head (4*a*s*b)."""
    if attention == "standard":
        return s * b * h * (34 + 5 * a * s / h)
    return s * b * h * 34 + 4 * a * s * b


def projected_peak_bytes(s, attention, checkpoint, n_layer=32, h=4096, a=32, params=6.7e9,
                         gpus=8):
    """Per-GPU bytes of a training step of a 7B model (default: Llama/GPT-3-style 6.7B) on
    batch 1: model states (16 bytes per parameter: bf16 weights and gradients, fp32 master
    weights and two Adam moments) sharded over `gpus` (ZeRO-3); activations unsharded.
    Without checkpointing all layers' activations are stored; with full activation
    checkpointing only each layer's input (2*s*b*h bytes per layer) plus one layer's
    activations while it is recomputed. Logits and temporary buffers are not modelled."""
    states = 16 * params / gpus
    layer = activation_bytes(s, h, a, attention)
    acts = (2 * s * h * n_layer + layer) if checkpoint else n_layer * layer
    return states + acts


def projected_max_seqlen(attention, checkpoint, gpu_gb=80.0, **kw):
    """Longest s (tokens) with projected_peak_bytes(s) <= gpu_gb * 1e9, by bisection."""
    lo, hi = 0, 2**26
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if projected_peak_bytes(mid, attention, checkpoint, **kw) <= \
            gpu_gb * 1e9 else (lo, mid)
    return lo


def part_memory_model(cfg):
    rows = []
    for provider, seqlens in cfg.memory_seqlens:
        if provider not in cfg.providers:
            continue
        for n in seqlens:
            status, peak = probe_step(cfg, cfg.memory_model, provider, n, None)
            log(f"  memory_model {cfg.memory_model} {provider:<9} seqlen {n:>6}: {status} "
                f"{peak:.1f} MiB")
            rows.append(row(cfg, "memory_model", provider, cfg.memory_model, n, 1,
                            "peak_mem_mb", peak, "MiB", status, "train_step"))
    release_models(cfg)
    kw = dict(gpus=cfg.projection_gpus)
    for attention in ("standard", "longflash"):
        for ckpt in (False, True):
            for n in cfg.projection_seqlens:
                rows.append(row(cfg, "projection", attention, "7b", n, 1, "projected_peak_gb",
                                projected_peak_bytes(n, attention, ckpt, **kw) / 1e9, "GB",
                                mode="train_step", checkpoint=ckpt, basis="projected"))
            best = projected_max_seqlen(attention, ckpt, cfg.projection_gpu_gb, **kw)
            rows.append(row(cfg, "projection", attention, "7b", 0, 1, "projected_max_seqlen",
                            best, "tokens", mode="train_step", checkpoint=ckpt,
                            budget_mb=int(cfg.projection_gpu_gb * 1000), basis="projected"))
            log(f"projection 7B, {attention}, checkpointing {ckpt}: max {best} tokens")
    return rows


# ----------------------------------------------------------------------------- training runs

def _progress(total, initial, desc):
    if tqdm is not None and sys.stderr.isatty():
        return tqdm(total=total, initial=initial, desc=desc, leave=False)
    return None


def train(cfg, name, model, opt, batches, steps, lr, run_dir=None, resume=False,
          stop_after=None):
    """Train `steps` steps on batches(generator) -> (x, y); the generator is the run's only
    source of data randomness. Saves {model, optimizer, step, generator and torch RNG
    states, losses} to run_dir/<name>/checkpoint.pt every cfg.checkpoint_every steps and at
    the end; resume=True continues from there. stop_after: return after that many steps
    (an interruption, for tests). Returns the per-step losses."""
    path = os.path.join(run_dir, name, "checkpoint.pt") if run_dir else None
    # The data stream depends on the run's name only (str hash() is salted per process).
    gen, losses, start = torch.Generator().manual_seed(sum(map(ord, name)) * 7919), [], 0
    if resume and path and os.path.exists(path):
        state = torch.load(path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        gen.set_state(state["generator"])
        torch.set_rng_state(state["torch_rng"])
        losses, start = state["losses"], state["step"]
        log(f"  {name}: resumed at step {start}")

    def save(step):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step,
                        generator=gen.get_state(), torch_rng=torch.get_rng_state(),
                        losses=losses), path + ".tmp")
        os.replace(path + ".tmp", path)

    bar = _progress(steps, start, name)
    t0 = time.perf_counter()
    for step in range(start, steps):
        warm = min(1.0, (step + 1) / max(cfg.warmup_steps, 1))
        cos = 0.5 * (1 + math.cos(math.pi * min(step / max(steps - 1, 1), 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr * warm * (0.1 + 0.9 * cos)
        x, y = batches(gen)
        losses.append(train_step(model, opt, x.to(cfg.device), y.to(cfg.device), cfg))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        elif (step + 1) % cfg.log_every == 0 or step + 1 == steps:
            rate = (step + 1 - start) / (time.perf_counter() - t0)
            print(f"  {name}: step {step + 1}/{steps} loss {losses[-1]:.4f} "
                  f"({rate:.2f} steps/s)", flush=True)
        if path and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == steps):
            save(step + 1)
        if stop_after is not None and step + 1 - start >= stop_after:
            break
    if bar is not None:
        bar.close()
    return losses


@torch.no_grad()
def evaluate(model, x, y, cfg, max_tokens=8192):
    """Mean cross-entropy (nats per byte) over all of y, in batches of <= max_tokens."""
    model.eval()
    total, count = 0.0, 0
    per = max(1, max_tokens // x.shape[1])
    for i in range(0, len(x), per):
        with _autocast(cfg):
            logits, _ = model(x[i:i + per].to(cfg.device))
        total += float(torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), y[i:i + per].to(cfg.device).flatten(),
            reduction="sum"))
        count += y[i:i + per].numel()
    model.train()
    return total / count


def stdlib_data(cfg):
    train_files, val_files = byte_data.split_by_file(byte_data.stdlib_files(), cfg.val_fraction)
    train_bytes, val_bytes = byte_data.load_bytes(train_files), byte_data.load_bytes(val_files)
    log(f"stdlib: {len(train_files)} train files ({len(train_bytes) / 1e6:.1f} MB), "
        f"{len(val_files)} validation files ({len(val_bytes) / 1e6:.1f} MB)")
    return train_bytes, val_bytes


def loss_rows(cfg, part, provider, model, context, batch, losses, seed, every):
    """train_loss rows: the mean over each logged interval of `every` steps."""
    return [row(cfg, part, provider, model, context, batch, "train_loss",
                sum(losses[i:i + every]) / len(losses[i:i + every]), "nats", seed=seed,
                step=min(i + every, len(losses))) for i in range(0, len(losses), every)]


def part_quality(cfg, resume):
    train_bytes, val_bytes = stdlib_data(cfg)
    runs = [(c, s) for c in cfg.quality_contexts for s in cfg.quality_seeds]
    runs += [(cfg.noise_context, s) for s in cfg.noise_seeds if s not in cfg.quality_seeds]
    rows = []
    for context, seed in runs:
        batch = cfg.tokens_per_step // context
        model = build(cfg.quality_model, cfg.quality_provider, seed, device=cfg.device)
        opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
        t0 = time.perf_counter()
        losses = train(cfg, f"quality-{cfg.quality_provider}-{cfg.quality_model}-ctx{context}-"
                       f"seed{seed}", model, opt,
                       lambda g: byte_data.sample_batch(train_bytes, batch, context, g),
                       cfg.quality_steps, cfg.lr, cfg.run_dir, resume)
        seconds = time.perf_counter() - t0
        val = evaluate(model, *byte_data.eval_windows(val_bytes, context, cfg.eval_tokens), cfg)
        log(f"quality ctx {context} seed {seed} (batch {batch}): train {losses[-1]:.4f}, "
            f"val {val:.4f} nats = {val / math.log(2):.4f} bpb, {seconds:.0f} s")
        rows += loss_rows(cfg, "quality", cfg.quality_provider, cfg.quality_model, context,
                          batch, losses, seed, cfg.log_every)
        rows += [row(cfg, "quality", cfg.quality_provider, cfg.quality_model, context, batch, m, v, u,
                     seed=seed, step=len(losses)) for m, v, u in
                 (("val_loss", val, "nats"), ("val_bpb", val / math.log(2), "bits"),
                  ("train_time_s", seconds, "s"))]
    return rows


def part_exactness(cfg):
    train_bytes, _ = stdlib_data(cfg)
    curves = {}
    for provider in ("longflash", "standard", "sdpa_flash" if cfg.device == "cuda" else "sdpa_cpu"):
        model = build(cfg.quality_model, provider, seed=0, device=cfg.device)
        opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
        curves[provider] = train(
            cfg, "exactness", model, opt,  # same name: the same data generator seed
            lambda g: byte_data.sample_batch(train_bytes, cfg.exact_batch, cfg.exact_context, g),
            cfg.exact_steps, cfg.lr)
    sdpa = [p for p in curves if p.startswith("sdpa")][0]
    diff = max(abs(a - b) for a, b in zip(curves["longflash"], curves["standard"]))
    diff_sdpa = max(abs(a - b) for a, b in zip(curves[sdpa], curves["standard"]))
    log(f"exactness: max |loss longflash - loss standard| over {cfg.exact_steps} steps = "
        f"{diff:.3g}")
    rows = [row(cfg, "exactness", p, cfg.quality_model, cfg.exact_context, cfg.exact_batch,
                "train_loss", v, "nats", step=i + 1)
            for p, c in curves.items() for i, v in enumerate(c)]
    rows.append(row(cfg, "exactness", "longflash", cfg.quality_model, cfg.exact_context,
                    cfg.exact_batch, "max_loss_diff", diff, "nats", step=cfg.exact_steps))
    rows.append(row(cfg, "exactness", sdpa, cfg.quality_model, cfg.exact_context,
                    cfg.exact_batch, "max_loss_diff", diff_sdpa, "nats", step=cfg.exact_steps))
    return rows


def mqar_batch(gen, batch, seqlen, num_kv, vocab=256):
    """Multi-query associative recall: (x, y) each (batch, seqlen) int64. Keys are drawn from
    1..vocab/2-1, values from vocab/2..vocab-1, distinct keys per sequence. The sequence
    opens with the pairs k1 v1 ... kD vD; each key is queried once later (position uniform
    over the rest, its value after it); filler 0 elsewhere. y is -100 (ignored) except at
    query positions, where it is the queried key's value."""
    half = vocab // 2
    x = torch.zeros(batch, seqlen, dtype=torch.long)
    y = torch.full((batch, seqlen), -100, dtype=torch.long)
    for b in range(batch):
        keys = torch.randperm(half - 1, generator=gen)[:num_kv] + 1
        values = torch.randint(half, vocab, (num_kv,), generator=gen)
        x[b, 0:2 * num_kv:2], x[b, 1:2 * num_kv:2] = keys, values
        slots = (seqlen - 2 * num_kv) // 2  # query slots: pairs of positions after the pairs
        pos = 2 * num_kv + 2 * torch.randperm(slots, generator=gen)[:num_kv]
        x[b, pos], x[b, pos + 1], y[b, pos] = keys, values, values
    return x, y


@torch.no_grad()
def mqar_accuracy(model, cfg, seqlen, gen):
    model.eval()
    correct = total = 0
    for _ in range(cfg.mqar_eval_seqs):
        x, y = mqar_batch(gen, 1, seqlen, cfg.mqar_num_kv)
        with _autocast(cfg):
            logits, _ = model(x.to(cfg.device))
        mask = y.to(cfg.device) != -100
        correct += int((logits.argmax(-1)[mask] == y.to(cfg.device)[mask]).sum())
        total += int(mask.sum())
    model.train()
    return correct / total


def part_mqar(cfg, resume):
    rows = []
    for provider in ("standard", "longflash"):
        status, peak = probe_step(cfg, cfg.quality_model, provider, cfg.mqar_seqlen,
                                  cfg.mqar_budget_mb)
        log(f"mqar probe {provider} seqlen {cfg.mqar_seqlen} budget {cfg.mqar_budget_mb} MiB: "
            f"{status} {peak:.0f} MiB")
        rows.append(row(cfg, "mqar", provider, cfg.quality_model, cfg.mqar_seqlen, 1,
                        "peak_mem_mb", peak, "MiB", status, "train_step", cfg.mqar_budget_mb))
    release_models(cfg)
    model = build(cfg.quality_model, "longflash", seed=0, device=cfg.device)
    opt = make_optimizer(model, cfg.mqar_lr, 0.0)
    name = f"mqar-{cfg.quality_model}-kv{cfg.mqar_num_kv}"
    for seqlen, batch, steps in ((cfg.mqar_short_seqlen, cfg.mqar_short_batch,
                                  cfg.mqar_short_steps),
                                 (cfg.mqar_seqlen, cfg.mqar_batch, cfg.mqar_steps)):
        losses = train(cfg, f"{name}-n{seqlen}", model, opt,
                       lambda g: mqar_batch(g, batch, seqlen, cfg.mqar_num_kv),
                       steps, cfg.mqar_lr, cfg.run_dir, resume)
        rows += loss_rows(cfg, "mqar", "longflash", cfg.quality_model, seqlen, batch, losses, 0,
                          cfg.log_every)
    gen = torch.Generator().manual_seed(12345)  # held out: no training generator uses it
    for seqlen in (cfg.mqar_short_seqlen, cfg.mqar_seqlen):
        acc = mqar_accuracy(model, cfg, seqlen, gen)
        log(f"mqar accuracy at {seqlen}: {acc:.3f} (chance {2 / 256:.4f})")
        rows += [row(cfg, "mqar", "longflash", cfg.quality_model, seqlen, 1, "mqar_acc", acc,
                     "fraction", step=cfg.mqar_short_steps + cfg.mqar_steps),
                 row(cfg, "mqar", "longflash", cfg.quality_model, seqlen, 1, "mqar_chance",
                     2 / 256, "fraction", step=cfg.mqar_short_steps + cfg.mqar_steps)]
    return rows


# ----------------------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Parts and metrics: see the module docstring.")
    parser.add_argument("--full", action="store_true", help="GPU sizes (FULL; untested)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds (QUICK)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    parser.add_argument("--resume", action="store_true", help="continue training runs from "
                        "their checkpoints in --run-dir")
    parser.add_argument("--run-dir", help=f"checkpoints (default {Config.run_dir})")
    parser.add_argument("--quality-steps", type=int, help="steps per quality run")
    parser.add_argument("--quality-provider", choices=sorted(IMPLS),
                        help=f"attention of the quality runs (default {Config.quality_provider})")
    parser.add_argument("--budgets-mb", help="comma-separated, one per model")
    parser.add_argument("--budget-s", type=float,
                        help="seconds for the whole run, from its start: max_context starts no "
                        "probe predicted to end past it (default: none)")
    parser.add_argument("--out", help="results CSV (default results/long_context_training/"
                        "<device>.csv); log and config beside it")
    args = parser.parse_args(argv)
    started = time.monotonic()
    cfg = Config(**(FULL if args.full else QUICK if args.quick else {}))
    if args.run_dir:
        cfg = replace(cfg, run_dir=args.run_dir)
    if args.quality_steps:
        cfg = replace(cfg, quality_steps=args.quality_steps)
    if args.quality_provider:
        cfg = replace(cfg, quality_provider=args.quality_provider)
    if args.budgets_mb:
        cfg = replace(cfg, budgets_mb=tuple(int(b) for b in args.budgets_mb.split(",")))
    if args.budget_s is not None:
        cfg = replace(cfg, time_budget_s=args.budget_s)
    parts = args.parts.split(",")
    if not set(parts) <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        parser.error("--full needs a GPU, and there is none here")
    out, command = start_run(
        "long_context_training", args.out, log, dict(asdict(cfg), parts=parts),
        f"long_context_training on {cpu_name()} ({usable_cores()} cores), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, parts {parts}\n{cfg}")
    deadline = started + cfg.time_budget_s if math.isfinite(cfg.time_budget_s) else None
    written = [0]

    def emit(rows):
        """Write rows now (merged by key, atomically): a run killed later keeps them."""
        if not rows:
            return
        if cfg.device != "cuda":
            for r in rows:
                if r["basis"] == "measured":
                    r["device"] = cpu_name()
        write_results(rows, out, command=command, key_columns=KEY_COLUMNS)
        written[0] += len(rows)

    runners = dict(max_context=lambda: part_max_context(cfg, emit, deadline),  # writes as it goes
                   memory_model=lambda: emit(part_memory_model(cfg)),
                   quality=lambda: emit(part_quality(cfg, args.resume)),
                   exactness=lambda: emit(part_exactness(cfg)),
                   mqar=lambda: emit(part_mqar(cfg, args.resume)))
    for part in PARTS:
        if part in parts:
            t0, before = time.perf_counter(), written[0]
            runners[part]()
            log(f"{part}: {written[0] - before} rows, {time.perf_counter() - t0:.0f} s")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
