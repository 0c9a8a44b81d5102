"""The GPU campaign: every GPU result of the paper in three stages of under 9 minutes each,
a fourth for tuning, and a fifth for the second H100 window (what the first did not reach).

    python3 -m experiments.gpu_campaign --print-command --stage 1   # here: the line to run there
    LONGFLASH_GIT_COMMIT=<sha> LONGFLASH_GIT_DIRTY=False \
        python3 -m experiments.gpu_campaign --stage 1 --out $OUT     # on the GPU machine
    python3 -m experiments.gpu_campaign --stage 1 --out /tmp/c --dry-run  # CPU, tiny, in CI
    python3 -m experiments.gpu_campaign --stage 2 --out $OUT --steps speedup_long  # a rerun
    make gpu STAGE=1 OUT=/tmp/c          make gpu-dry   (every stage dry, archives checked)

A GPU window here is 15 minutes of device time (the first was 30), the machine's start
included, in runs of at most 10 minutes, on a bare machine that returns at most 8 files of
16 MiB (experiments/GPU.md): one stage, then a short second run of what it did not reach. So
each stage runs under its own wall budget (--budget-s, default 510 s including compilation and autotuning): a step is started
only if its estimate fits in what is left, and its timeout is cut to what is left once its
reserve_s (a share kept for the steps after it) is set aside, never below its estimate; a step
with a budget of its own (speedup, the ncu probe) gets "{budget}" = its timeout less tail_s,
so it stops starting work before it is killed. So the stage ends in time and keeps what it
measured. Each step is a subprocess in a session of its own with its own timeout, after which
its whole process group is killed (forked ranks and profiled targets included;
experiments/process_groups.py): a crash or a hang is a row with status "error" (or
"unsupported" for a missing tool) and a log line, never a lost stage. --steps runs some steps
of a stage only (with the preflight and env); --steps rest those its earlier runs did not
finish, and the resumable ones (unfinished_steps).

Stages, most important first (sizes are the GPU's; --dry-run runs the same steps on CPU at
tiny sizes with the Triton interpreter). Stages 1-3 start with a preflight of the Hopper-only
kernel candidates that no GPU had run before (TMA copies; warp specialization):
each forced in turn on a small odd shape against the float64 reference, one subprocess per kind
with its own timeout; a kind that fails or hangs is switched off for the rest of the stage
(LONGFLASH_TMA=0, LONGFLASH_WS=0 in the steps' environment), so that one broken candidate costs
a minute, not the stage's autotuning (rows preflight_tma, preflight_ws: the worst relative
error, or the failure in the note). The warp-specialized candidates are opt-in
(LONGFLASH_WS=1; NaN on an H100 with Triton 3.6): their check turns them on for itself only.
  1  env        device, versions, SM count, L2, memory, nvidia-smi, ncu, git commit (a JSON)
     speedup    RQ1 (experiments.speedup --full --parts batch): head dims 128 then 64,
                1K..16K tokens, causal and not, fwd/bwd/fwd_bwd, LongFlash against SDPA flash /
                cuDNN / efficient / math, compiled flex and standard; the bf16 matmul and copy
                ceilings at its start and end; the autotuner's chosen configs (a JSON)
     pytest_configs  tests/test_gpu.py::test_every_config_gpu: every autotune candidate under
                the strict tolerance rule
     pytest     the decoding kernels' GPU tests and test_triton_gpu (EARLY_TESTS), with what
                is left
  2  warm       longflash.attention at 64K tokens, so that the 1M-token call finds the
                autotuner's choice for its bucket on disk (row warm_s)
     scaling    RQ3 (experiments.scaling --full): exact causal attention over 1,048,576
                tokens on one GPU (part long), per-step ring block times and the alpha-beta
                projection (blocks, projection)
     ncu        RQ2 (experiments/ncu.py): Nsight Compute DRAM and L2 bytes for configurations
                of experiments.io_complexity's plan, those whose working set exceeds L2 first,
                beside the model's prediction; rows written after each configuration, the ones
                the budget does not reach marked (status "error", note "not measured: stage
                budget"); configurations already "ok" in the results file are not measured again
     speedup_long  RQ1 part long at 32K, 64K, 128K tokens (head dim 128, batch 1)
     scaling_exact  RQ3 part exactness: ring steps on gloo ranks against one-rank attention
  3  hf         a small random Llama: LongFlash logits against eager, one generate
     jax        longflash.jax on the GPU: attention and a decoding step against float64 (the
                Triton path needs jax-triton >= 0.4, triton >= 3.7)
     speedup_decode  RQ1 part decode: one step of attention_with_kvcache over 1K..128K
                tokens of cache, batch 1 then 8, against SDPA's backends and FlexAttention
     variants   experiments.variants --full
     long_context  RQ4 (experiments.long_context_training --full, parts max_context,
                memory_model, exactness): max trainable context per attention implementation
                under the card's memory, the memory model, exact training steps
     speedup_d256  RQ1 part batch at head dim 256, 1K..16K tokens
     pytest_late  the GPU tests stage 1 does not run, with what is left
  4  env        as in stage 1 (no preflight: the sweep checks each candidate it forces)
     tuning     experiments.tuning --full: where RQ1 found LongFlash slowest against
                FlashAttention-2, the call's time split into host and GPU (CUDA-graph
                replays, torch.profiler per kernel), then every candidate tile of the slow
                kernels (the config table's and TRIALS) forced, checked against float64 and
                timed (results/tuning/<gpu>.csv)
  5  env        as in stage 1 (no preflight: the first window found these kernels exact)
     speedup_d64  RQ1 part batch at head dim 64, 16K tokens (causal never measured; then the
                flex bwd retry), resumed
     speedup_d256  RQ1 part batch at head dim 256, 4K, 8K, 16K, then 2K, 1K, resumed
     pytest_exact  of stage 3's pytest_late (the GPU tests no window has run), those that
                check kernels against float64: variants, sinks, varlen, head-dim v, TMA routing
     preflight_ws  the preflight of the warp-specialized candidates alone (head dims 64, 128,
                256), since the workaround for Triton's partition row offset (flash_triton.
                _held_start); the stage's steps keep them off whatever it finds
     tuning     stage 4's sweep, resumed (--resume), within what is left; the warp-specialized
                candidates last in each target
     pytest_triton  test_triton_gpu (stage 1 stopped it at half), with what is left
     pytest_compile  the rest of pytest_late (torch.compile, CUDA graphs, routing)
     scaling_exact  stage 2's (its first window's run failed), with what is left
  6  env        as in stage 1
     pytest_configs  as in stage 1: every candidate forced, the backward's new tiles among them
     speedup_d128  RQ1 part batch at head dim 128, 4K-16K, LongFlash, SDPA flash and cuDNN,
                measured again where measured before the tiles changed (TILES_CHANGED)
     speedup_d256  the same at head dim 256
     pytest_exact  as in stage 5, with the new tiles and the fixed varlen test
     preflight_ws  as in stage 5, at head dims 64 and 128, since dK/dV's q and dO tiles go
                through registers (flash_triton._load_head_tile)
     pytest_triton, pytest_compile, scaling_exact  as in stage 5, with what is left
  7  env        as in stage 1
     host_time  the host's time per call (experiments.host_time): LongFlash's beside SDPA's
     pytest_ws_fwd  a gate: the forward's warp-specialized candidate forced (LONGFLASH_WS=fwd)
                on odd, causal, full-tile, d64-d256, fp16, window, ALiBi + softcap, dropout
                and packed calls against float64; if every case passes, the later steps run
                with LONGFLASH_WS=fwd (Step.then_env; a --steps rest run too)
     speedup_batch  RQ1 part batch at 4K-16K, d128, d64, d256: measured again only with the
                forward's WS on (rows under other switches count as not measured)
     speedup_short  RQ1 part batch at head dims 128, 256 and 64, 1K and 2K tokens, LongFlash,
                SDPA flash and cuDNN, measured again where measured before TILES_CHANGED
                (stage 6 did 4K-16K; results.superseded leaves the old rows out meanwhile)
     speedup_long  as speedup_short for part long (d128, 32K-128K tokens, batch 1)
     pytest_triton  test_triton_gpu's cases stage 6 did not reach (fp16 at d96 and d40)
     pytest_compile  as in stage 5 (no window has reached it)
     tuning     stage 4's sweep at d256's backward targets (the worst case against
                FlashAttention-2 since stage 6), measured again where measured before
                TILES_CHANGED: the new tiles against the other candidates and TRIALS
     preflight_ws  at head dim 128: dK/dV's WS candidate (NaN in stage 6) beside WS_TRIALS'
                tiles (32 rows with 2 stages, 64 rows)
     scaling_exact  as in stage 5, with what is left
     pytest_mask  attn_mask through the kernels against float64, its gradient too, and
                through the decoding kernel (attention_with_kvcache, attention's route)
     pytest_fp8   a float8 KV cache through the decoding and append kernels against float64
                (bit for bit the append's quantization)
     speedup_decode  RQ1 part decode again, every provider and the float8 cache in one run
  8  env        as in stage 1 (the next window: an H200's, the only kind lent now)
     pytest_fp8   as in stage 7 (4 of 5 failed there on -0, since fixed), and float8 pages
                read in place by the forward kernel (chunked prefill; new)
     pytest_shared_prefix  cascade decoding over a shared prefix, a masked tree of 16 queries
                (the split-KV kernel's 64-row tile), and MLA absorbed decoding (qv), against
                float64 (new)
     pytest_graphs  a training forward and backward captured in CUDA graphs, bit for bit eager
     speedup_decode  as in stage 7 (not reached there), before the gate
     host_time  as in stage 7, with each LongFlash call's cProfile to the log (--profile)
     pytest_ws_fwd  as in stage 7 (12 of 13 passed there; the packed call, which raised an
                illegal instruction, now checks that the autotuner leaves WS out there)
     speedup_batch  as in stage 7 (4K-16K, d128, d64, d256): measured again only under other
                switches than its rows' (on a GPU without rows, measured)
     speedup_shared_prefix  RQ1 part shared_prefix (new): the cascade call against the step
                over caches that each hold a copy of the prefix
     speedup_prefill  RQ1 part prefill (new): chunked prefill over bf16 and float8 pages read
                in place, and over float8 pages gathered into a dequantized copy first
     speedup_mla  RQ1 part mla (new): MLA's absorbed decoding step (qv) against SDPA over
                the concatenated form
     speedup_short, speedup_long  as speedup_batch at 1K-2K and 32K-128K
     preflight_ws  as in stage 7 (cut at 30 s there by the budget)
     scaling_exact  as in stage 5 (no window has reached it)

Outputs. The steps write into a scratch tree (a temporary folder, never under DIR, so that
DIR holds the archive alone) whose paths mirror the repository
(results/<rq>/<stem>.csv with their .log and .json, where <stem> is
experiments.results.device_tag(), or "dryrun" for a dry run). Every file of the repository's
results/<rq>/ for this device (<stem>.csv, .log, .json, .ncu.log, ...) is copied there first
(seed_scratch): rows merge by key and --resume skips what is measured, logs are appended to,
and each run's resolved config joins the JSON's "earlier_runs" (results.start_run), so the
archive unpacked over the repository loses nothing measured earlier (another stage, a rerun,
two steps writing the same file). The repository's results/ is never written. The campaign's
own rows (one per step: wall time and status; the hf/jax/warm measurements) go to
results/gpu_campaign/<stem>-stageN.csv, with the full log (<stem>-stageN.log) and the resolved
configuration (<stem>-stageN.json), kept across reruns of the stage the same way; the probes'
JSONs (-env, -preflight, -autotune-*) describe the latest run. Everything ends in
DIR/stageN.tar.gz (under 16 MiB): `python -m experiments.gpu_unpack DIR/stageN.tar.gz` at the
repository root merges each file into place (tar would replace rows that another stage's
archive, sent before this one was unpacked, brought in). A dry run's rows have "dry run: " at the start of their device column. The
summary table is printed last.

Provenance. The GPU machine gets a copy of the tree without .git, so the rows' git_commit and
git_dirty come from $LONGFLASH_GIT_COMMIT / $LONGFLASH_GIT_DIRTY there (results.git_state; git
wins where it answers); the stage's log and JSON record them and their source, and say loudly
when neither is there. --print-command prints the line with both filled in.

Campaign rows: experiment "gpu_campaign", provider "longflash", mode "fwd", metric
"wall_s" (s, the step's wall time) or the probe's metric (hf: max_abs_diff_logits,
generate_tokens; jax: max_abs_diff; warm: warm_s); key column `step`.
"""

import argparse
import glob
import hashlib
import itertools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field

from experiments.measure import RELATIVE_ERROR_LIMIT, relative_errors
from experiments.ncu import probe_ncu
from experiments.process_groups import kill_children_on_sigterm, run_group, track_child
from experiments.results import TILES_CHANGED  # rows before it measured the old backward tiles
from experiments.results import DECODE_FP8_ADDED  # decode rows before it lack the float8 cache
# experiments.tuning.TARGETS's indices of d256's backward (non-causal 1K, causal 4K)
D256_BACKWARD_TARGETS = (0, 5)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTED = time.monotonic()  # this process's start, near enough: a probe's budget counts from it
BUDGET_S = 510.0            # a stage's wall budget: 8.5 minutes of the run's 10
ARCHIVE_RESERVE_S = 15.0    # kept for writing the rows and the archive
ARCHIVE_LIMIT = 16 * 2**20  # what the device machine brings back per file


# ----------------------------------------------------------------------------- budget

class Budget:
    """A stage's wall-clock budget. `clock` is injectable (tests use a fake one)."""

    def __init__(self, total_s, clock=time.monotonic, reserve_s=ARCHIVE_RESERVE_S):
        self.total_s, self.clock, self.reserve_s = total_s, clock, reserve_s
        self.start = clock()

    def elapsed(self):
        return self.clock() - self.start

    def left(self):
        """Seconds a step may still use (the archive's reserve excluded)."""
        return self.total_s - self.reserve_s - self.elapsed()

    def allows(self, estimate_s):
        """Start a step only if its estimate fits in what is left."""
        return estimate_s <= self.left()

    def timeout(self, step_timeout_s):
        return max(1.0, min(step_timeout_s, self.left()))

    def step_timeout(self, step):
        """A started step's timeout: its own limit, cut to what is left once `reserve_s` is
        kept for the steps after it, but never below its estimate (the reserve is a share
        for the later steps, not a reason to start a step that cannot do its minimum) and
        never past what is left."""
        left = self.left()
        return max(1.0, min(step.timeout_s, left, max(step.estimate_s, left - step.reserve_s)))


# ----------------------------------------------------------------------------- steps

@dataclass
class Step:
    name: str
    # after `python3`; filled in: "{out}" (results/<rq>/<stem>.csv), "{budget}" (seconds the
    # step may plan for), "{pre}" (results/gpu_campaign/<stem>-stageN, for probe files)
    argv: list
    rq: str = ""             # results/<rq>/ that the step writes ("" for none)
    estimate_s: float = 30   # not started unless this much is left
    timeout_s: float = 600   # killed after this (or what is left of the budget)
    reserve_s: float = 0     # kept for the steps after this one (Budget.step_timeout)
    tail_s: float = 0        # "{budget}" = the timeout - tail_s: what the step needs after its
    #                          own budget check (start-up, the piece of work in progress, writing)
    needs: str = ""          # "ncu": an external tool; missing -> status "unsupported"
    files: list = field(default_factory=list)  # extra files (under the scratch tree) to archive
    env: dict = field(default_factory=dict)    # set for this step alone, over the stage's
    # set for the later steps where this one, a pytest step, passed every test it selected
    # (none failed, none skipped: a gate; passed_every_test)
    then_env: dict = field(default_factory=dict)


def _py(*args):
    return ["-m", *args]


def _probe(name, argv_tail=(), **kw):
    """A probe of this module, writing results/gpu_campaign/<stem>-stageN-<name>.json."""
    return Step(name, _py("experiments.gpu_campaign", "--probe", name, "--probe-out",
                          f"{{pre}}-{name}.json", *argv_tail), files=[f"{name}.json"], **kw)


def _preflight(headdims, dry):
    """The preflight of the TMA and warp-specialized candidates at the stage's head dims.
    Estimate: two kinds, each compiling a few candidates of three kernels per head dim (about
    a minute together on an H100 machine; each kind is cut at PREFLIGHT_TIMEOUT_S)."""
    return _probe("preflight", estimate_s=60, timeout_s=300,
                  argv_tail=["--", ",".join(map(str, (64,) if dry else headdims))])


def _speedup(name, argv, **kw):
    """experiments.speedup with argv, resumed, within the budget; the autotuner's choices
    to results/gpu_campaign/<stem>-stageN-autotune-<name>.json. Its --budget-s stops it from
    starting a group; tail_s (default 60 s: start-up, then the last group, flex's compile
    included) is what it needs after that check."""
    fname = f"autotune-{name}.json"
    kw.setdefault("tail_s", 60)
    return Step(name, _py("experiments.gpu_campaign", "--probe", "speedup", "--probe-out",
                          f"{{pre}}-{fname}", "--", *argv, "--resume", "--budget-s", "{budget}",
                          "--out", "{out}"), rq="speedup", files=[fname], **kw)


# The most important test of tests/test_gpu.py: every candidate of the config tables (TMA and
# warp-specialized ones included) under the strict tolerance rule, not only the ones the
# autotuner keeps. Last in the file, it was never reached within the step's time: it runs
# first, in a step of its own, and the rest of the file after it.
KEY_COLUMNS = ("step",)  # the campaign's own rows: one per step (beside results')
EVERY_CONFIG_TEST = "test_every_config_gpu"
# The GPU tests stage 1 runs after the candidates (the decoding kernels' and test_triton_gpu);
# stage 3 runs the others. On the H100 (2026-11-25) the whole rest took more than stage 1's
# 141 s: it stopped in test_triton_gpu, about halfway.
EARLY_TESTS = ("test_kvcache_gpu or test_kvcache_rotary_gpu or test_decoding_step or "
               "test_attention_routes or test_triton_gpu")


# Of those (stage 3's pytest_late), the ones that check a kernel's numbers against float64:
# stage 5 runs them before the sweep, and the torch.compile, CUDA-graph and launcher-routing
# tests (each compiling with inductor: slow) after it.
LATE_TESTS = f"not {EVERY_CONFIG_TEST} and not ({EARLY_TESTS})"
EXACT_TESTS = ("test_variants_gpu or test_dropout_block_offsets_gpu or "
               "test_learnable_sink_gpu or test_varlen_gpu or "
               "test_paged_varlen_gpu or test_headdim_v_gpu or test_kvcache_headdim_v_gpu or "
               "test_tma_only_where_a_copy_can_read_gpu or test_warp_specialized_full_tiles_gpu or "
               "test_compiling_then_running_gpu or test_attn_mask_gpu or "
               "test_attn_mask_gradient_gpu or test_attn_mask_kvcache_gpu")


def _pytest(name, select, **kw):
    # No -x: one failing candidate or shape must not hide the others. -v: the log names each
    # test as it passes, so a step cut by its timeout still says how far it got.
    return Step(name, _py("pytest", "-m", "gpu", "-k", select, "-v", "--tb=short",
                          "-p", "no:cacheprovider", "tests/test_gpu.py"), **kw)


def _dry_batch(headdim):
    """A dry run's RQ1 part batch: one tiny group, LongFlash and standard attention."""
    return ["--quick", "--headdims", str(headdim), "--seqlens", "128", "--long-seqlens", "",
            "--parts", "batch", "--providers", "longflash,standard"]


def _preflight_ws(headdims, dry, **kw):
    """The warp-specialized candidates' preflight alone, at these head dims (d64 dry)."""
    return Step("preflight_ws", _py("experiments.gpu_campaign", "--probe", "preflight",
                                    "--probe-out", "{pre}-preflight_ws.json", "--",
                                    "64" if dry else headdims, "ws"),
                files=["preflight_ws.json"], **kw)


def _scaling_exact(dry, **kw):
    """RQ3 part exactness (experiments.scaling): ring steps on gloo ranks of this machine's
    CPU against one-rank attention."""
    return Step("scaling_exact", _py("experiments.scaling", "--quick" if dry else "--full",
                                     "--parts", "exactness", "--out", "{out}"),
                rq="scaling", **kw)


def _rq1_slices(dry):
    """The RQ1 slices that stages 7 and 8 measure again: part batch at 4K-16K (d128, d64,
    d256) and at 1K-2K (d128, d256, d64), part long (d128, 32K-128K), LongFlash beside SDPA's
    FlashAttention-2 and cuDNN backends; part decode with every provider. Dry: tiny ones."""
    if dry:
        batch = _dry_batch(16)
        return batch, batch, ["--quick", "--headdims", "16", "--seqlens", "", "--long-seqlens",
                              "512", "--parts", "long", "--providers", "longflash,standard"], \
            ["--quick", "--parts", "decode", "--providers", "longflash,sdpa_cpu"]
    providers = ["--providers", "longflash,sdpa_flash,sdpa_cudnn"]
    batch = ["--full", "--long-seqlens", "", "--parts", "batch", *providers]
    return ([*batch, "--headdims", "128,64,256", "--seqlens", "4096,8192,16384"],
            [*batch, "--headdims", "128,256,64", "--seqlens", "1024,2048"],
            ["--full", "--headdims", "128", "--seqlens", "", "--long-seqlens",
             "32768,65536,131072", "--parts", "long", *providers],
            ["--full", "--parts", "decode"])


def stage_steps(stage, dry):
    """The steps of one stage, GPU-sized or (dry) tiny.

    A stage has BUDGET_S - ARCHIVE_RESERVE_S = 495 s for its steps. The estimates below are
    what a step needs to be worth starting; reserve_s is the share kept for the steps after it,
    so that a step with its own budget (speedup, the ncu probe) cannot take everything; the
    steps come most important first. Assumed (no GPU has run them yet): the preflight about
    60-120 s, env under 10 s."""
    if stage == 1:
        if dry:
            rq1 = ["--quick", "--providers", "longflash,standard,sdpa_cpu,sdpa_flash,flex",
                   "--seqlens", "128", "--long-seqlens", "", "--parts", "batch"]
        else:
            rq1 = ["--full", "--headdims", "128,64", "--seqlens", "1024,2048,4096,8192,16384",
                   "--long-seqlens", "", "--parts", "batch"]
        return [
            _preflight((128, 64), dry),
            _probe("env", estimate_s=5, timeout_s=60),
            # RQ1 at d128 then d64 (20 groups of 7 providers x 3 modes, each autotuning and
            # compiling flex: more than the stage has). After the preflight it gets about
            # 250-300 s; 150 s stay for the two pytest steps.
            _speedup("speedup", rq1, estimate_s=120, timeout_s=420, reserve_s=150),
            # 12 tests, each compiling the forced candidate of 3 kernels: about 1-2 minutes.
            _pytest("pytest_configs", EVERY_CONFIG_TEST, estimate_s=40, timeout_s=150),
            # The decoding kernels' tests and test_triton_gpu: whatever is left of the stage
            # (the rest is stage 3's pytest_late).
            _pytest("pytest", f"not {EVERY_CONFIG_TEST} and ({EARLY_TESTS})", estimate_s=30,
                    timeout_s=300),
        ]
    if stage == 2:
        if dry:
            long_ = ["--quick", "--headdims", "16", "--seqlens", "", "--long-seqlens", "512",
                     "--parts", "long"]
            scaling = ["--quick", "--parts", "long,blocks,projection",
                       "--long-seqlens", "256", "--long-budget-s", "20"]
            warm = ["128", "16"]
        else:
            long_ = ["--full", "--headdims", "128", "--seqlens", "",
                     "--long-seqlens", "32768,65536,131072", "--parts", "long"]
            # the 1M-token run on the GPU is in part long; the CPU ring there gets one size
            scaling = ["--full", "--parts", "long,blocks,projection",
                       "--long-seqlens", "65536", "--long-budget-s", "60"]
            warm = ["65536", "128"]
        return [
            _preflight((128, 256), dry),
            _probe("env", estimate_s=5, timeout_s=60),
            # RQ3 first. The 1M-token call autotunes at the 64K bucket (seqlen_bucket); timed
            # at 1M tokens, 2 x ~10 candidates would take minutes, so `warm` tunes that bucket
            # at 64K tokens (same head dim, heads, dtype, causal) and the choice is on disk.
            _probe("warm", estimate_s=20, timeout_s=120, argv_tail=["--", *warm]),
            # First 1M tokens forward+backward on one GPU (written at once): ~8-15 s a call,
            # a warm-up and at most 3 timed calls (scaling's lean timing, capped at 60 s), one
            # more forward checked on 16 sampled rows against float64 (~5 s); then blocks
            # (autotuning at 8K) and the CPU ring at 64K: 150-250 s in all; 90 s stay for ncu.
            Step("scaling", _py("experiments.scaling", *scaling, "--out", "{out}"),
                 rq="scaling", estimate_s=150, timeout_s=330, reserve_s=90),
            # RQ2: one fresh process under ncu per configuration, 15-60 s each, the ones whose
            # working set exceeds L2 first; rows written after each one, the rest marked
            # "not measured: stage budget". 60 s stay for RQ1's long lengths.
            Step("ncu", _py("experiments.gpu_campaign", "--probe", "ncu", "--probe-out", "{out}",
                            "--", "{budget}"),
                 rq="io_complexity", estimate_s=45, timeout_s=360, reserve_s=60, tail_s=15),
            # RQ1 at 32K-128K (with flex's compiles: 183 s on the H100): what is left; a rerun
            # of stage 2 with --steps speedup_long resumes it. (d256 is stage 3's: here the
            # H100 left it no time.)
            _speedup("speedup_long", long_, estimate_s=60, timeout_s=300, reserve_s=25),
            # The ring's exactness on gloo ranks of this machine's CPU (the same code as the
            # committed CPU rows): last.
            _scaling_exact(dry, estimate_s=20, timeout_s=60),
        ]
    if stage == 3:
        lct = (["--quick", "--parts", "max_context,memory_model,exactness"] if dry
               else ["--full", "--parts", "max_context,memory_model,exactness"])
        decode = (["--quick", "--parts", "decode", "--providers", "longflash,sdpa_cpu"] if dry
                  else ["--full", "--parts", "decode"])
        d256 = (["--quick", "--headdims", "32", "--seqlens", "128", "--long-seqlens", "",
                 "--parts", "batch"] if dry else
                ["--full", "--headdims", "256", "--seqlens", "1024,2048,4096,8192,16384",
                 "--long-seqlens", "", "--parts", "batch"])
        sparse = (["--quick", "--parts", "sparse", "--providers", "longflash,sdpa_cpu"] if dry
                  else ["--full", "--parts", "sparse"])
        sparse_decode = (["--quick", "--parts", "sparse_decode", "--providers",
                          "longflash,sdpa_cpu"] if dry else ["--full", "--parts", "sparse_decode"])
        return [
            _preflight((128, 64), dry),
            _probe("env", estimate_s=5, timeout_s=60),
            _probe("hf", estimate_s=20, timeout_s=90),
            _probe("jax", estimate_s=10, timeout_s=60),
            # About 330 s are left here. Decode (1K-128K tokens of cache, batch 1 and 8,
            # against SDPA's backends and flex) keeps 200 s for variants and RQ4 (its old
            # reserve of 330 s left it nothing); tail 30 s: decode groups are short.
            _speedup("speedup_decode", decode, estimate_s=60, timeout_s=240, reserve_s=200,
                     tail_s=30),
            Step("variants", _py("experiments.variants",
                                 *(["--seqlens", "256,512"] if dry else ["--full"]),
                                 "--out", "{out}"),
                 rq="variants", estimate_s=30, timeout_s=120, reserve_s=130),
            # exactness, the memory model, then the max-context searches, which stop starting
            # probes at --budget-s and write each result as it comes (lower bounds noted)
            # On the H100: 167 s. (The stage's steps up to here took 307 s there.)
            Step("long_context", _py("experiments.long_context_training", *lct,
                                     "--budget-s", "{budget}", "--out", "{out}"),
                 rq="long_context_training", estimate_s=60, timeout_s=300, reserve_s=150,
                 tail_s=30),
            # RQ1 at d256 (moved from stage 2, which had no time left for it; 1K took 42 s
            # with autotuning), then the GPU tests stage 1 leaves: whatever is left.
            _speedup("speedup_d256", d256, estimate_s=60, timeout_s=300, reserve_s=90),
            # RQ1 part sparse (block_mask, added after the H100's windows; not measured on a
            # GPU yet): LongFlash and FlexAttention over the same blocks, 16K and 64K tokens,
            # SDPA with the blocks as a mask at 16K; pytest_late then runs its GPU tests
            # (test_block_sparse*_gpu) with the others
            _speedup("speedup_sparse", sparse, estimate_s=60, timeout_s=200, reserve_s=30),
            # RQ1 part sparse_decode (block_mask in attention_with_kvcache, newer still): the
            # split-KV kernel over the blocks each KV head keeps, 32K and 128K tokens of cache
            # at batch 1 and 8, against its attn_mask route, SDPA and FlexAttention
            _speedup("speedup_sparse_decode", sparse_decode, estimate_s=45, timeout_s=150,
                     reserve_s=30),
            _pytest("pytest_late", LATE_TESTS, estimate_s=30, timeout_s=300),
        ]
    if stage == 4:
        tune = ["--quick", "--ws"] if dry else ["--full", "--ws"]
        return [
            _probe("env", estimate_s=5, timeout_s=60),
            # Issue 16's tuning step (experiments.tuning), after stages 1-3: per RQ1 shape where
            # LongFlash fell short, the call's host and GPU time, then each candidate tile of its
            # slow kernels forced, checked against float64 and timed; targets slowest first,
            # rows written after each. No preflight: every candidate is checked before it is
            # timed, the warp-specialized ones too (last; opt-in in the launcher, NaN in the
            # first window: which kernels, and with or without masks?). About 4-6 minutes
            # for the seven targets (estimated: 70 compiles of 1-3 s).
            Step("tuning", _py("experiments.tuning", *tune, "--budget-s", "{budget}",
                               "--out", "{out}"),
                 rq="tuning", estimate_s=60, timeout_s=480, tail_s=90),
        ]
    if stage == 5:
        # The second H100 window, 15 minutes of device time (a machine's start, one run of this
        # stage, a short second run of what it did not reach: experiments/GPU.md): what the
        # first window left unmeasured, the paper's results first, then correctness, then
        # tuning. No preflight: the candidates the launcher may choose are those the first
        # window found exact (TMA on; warp specialization off unless LONGFLASH_WS=1), the
        # forward since with its row max taken before the scaling (an arithmetic reorder,
        # exact under the interpreter; pytest_exact checks it on the GPU, after RQ1's rows),
        # and the sweep checks every candidate it forces.
        if dry:
            d64, d256, tune = _dry_batch(16), _dry_batch(32), ["--quick", "--targets", "0"]
        else:
            # d64 causal at 16K, a goal row never measured (--resume: then the flex bwd retry
            # of non-causal 16K); d256 at the goals' lengths (N >= 4K) first
            d64 = ["--full", "--headdims", "64", "--seqlens", "16384", "--long-seqlens", "",
                   "--parts", "batch"]
            d256 = ["--full", "--headdims", "256", "--seqlens", "4096,8192,16384,2048,1024",
                    "--long-seqlens", "", "--parts", "batch"]
            tune = ["--full"]
        return [
            _probe("env", estimate_s=5, timeout_s=60),
            # one or two groups of 7 providers x 3 modes (stage 1: about 12 s a group, flex's
            # compile included): under a minute
            _speedup("speedup_d64", d64, estimate_s=30, timeout_s=90, reserve_s=400),
            # d256: 8 new groups (1K took 42 s with autotuning on the H100); a rerun resumes
            _speedup("speedup_d256", d256, estimate_s=60, timeout_s=220, reserve_s=220),
            # the GPU tests no window has run that check kernels against float64 (variants,
            # sinks, varlen, paged varlen, head-dim v, TMA routing; warp-specialized ones skip
            # without LONGFLASH_WS=1): 15 tests, about a minute
            _pytest("pytest_exact", f"{LATE_TESTS} and ({EXACT_TESTS})", estimate_s=30,
                    timeout_s=120, reserve_s=60),
            # the warp-specialized candidates since flash_triton._held_start (Triton's Hopper
            # pass had indexed their second partition's rows 64 too far: codegen's
            # ws_offset_twice), each forced in turn against float64, masked and not, at the
            # head dims where the first window found NaN (64, 256) and at 128: about 30 s of
            # compiles and runs. The stage's steps keep them off either way
            _preflight_ws("64,128,256", dry, estimate_s=30, timeout_s=150, reserve_s=60),
            # the sweep with what is left (per candidate: a compile, a check, a timing), the
            # warp-specialized candidates last in each target (each checked before it is
            # timed); rows written as they come, so the second run's --steps tuning resumes it
            Step("tuning", _py("experiments.tuning", *tune, "--ws", "--resume", "--budget-s",
                               "{budget}", "--out", "{out}"),
                 rq="tuning", estimate_s=60, timeout_s=300, reserve_s=30, tail_s=40),
            # test_triton_gpu: stage 1 stopped it at half (the fp16 and odd head-dim cases)
            _pytest("pytest_triton", "test_triton_gpu", estimate_s=30, timeout_s=300,
                    reserve_s=30),
            # the rest of stage 3's pytest_late: torch.compile (inductor), CUDA graphs, the
            # launcher's routing
            _pytest("pytest_compile", f"{LATE_TESTS} and not ({EXACT_TESTS})", estimate_s=30,
                    timeout_s=300, reserve_s=20),
            # stage 2's RQ3 ring exactness on gloo ranks of this machine's CPU (the first
            # window's failed: forked after CUDA; ranks now start from a forkserver there)
            _scaling_exact(dry, estimate_s=20, timeout_s=90),
        ]
    if stage == 6:
        # The third H100 window (15 minutes): the backward's tiles that the second window's
        # sweep found faster (flash_triton.CONFIGS since TILES_CHANGED; PERFLOG "Backward tiles
        # from the H100's sweep") checked against float64 on odd shapes, then RQ1's rows at d128
        # and d256 measured again with them (rows from before TILES_CHANGED count as
        # unmeasured: --resume-after), beside SDPA's FlashAttention-2 and cuDNN backends in
        # the same run; then the GPU tests the second window did not finish.
        if dry:
            d128, d256 = _dry_batch(16), _dry_batch(32)
        else:
            rq1 = ["--full", "--long-seqlens", "", "--parts", "batch",
                   "--providers", "longflash,sdpa_flash,sdpa_cudnn"]
            d128 = rq1 + ["--headdims", "128", "--seqlens", "4096,8192,16384"]
            d256 = rq1 + ["--headdims", "256", "--seqlens", "4096,8192,16384"]
        again = ["--resume-after", TILES_CHANGED]
        return [
            _probe("env", estimate_s=5, timeout_s=60),
            # every candidate of the tables forced (12 tests, the new tiles at d80 with GQA,
            # 1025 x 2049 queries and keys, and at d256): stage 1 ran it in about a minute
            _pytest("pytest_configs", EVERY_CONFIG_TEST, estimate_s=40, timeout_s=150,
                    reserve_s=330),
            # the goals' head dim first, then d256: 6 groups each (3 providers x 3 modes, the
            # new tiles' autotuning on the first), about 10 s a group
            _speedup("speedup_d128", d128 + again, estimate_s=40, timeout_s=130, reserve_s=280),
            _speedup("speedup_d256", d256 + again, estimate_s=40, timeout_s=130, reserve_s=150),
            # the float64 checks of the variants, varlen (its test fixed since the second
            # window), sinks, head-dim v: each runs the new backward tiles
            _pytest("pytest_exact", f"{LATE_TESTS} and ({EXACT_TESTS})", estimate_s=30,
                    timeout_s=150, reserve_s=60),
            # the warp-specialized candidates since dK/dV's q and dO go through registers
            # (flash_triton._load_head_tile; the second window: dK/dV's wrong with GQA, the
            # forward's exact), at the head dims that have a dK/dV one: about a minute
            _preflight_ws("64,128", dry, estimate_s=30, timeout_s=120, reserve_s=30),
            # the second window stopped test_triton_gpu at 15 of 24, at its fp16 d64 case
            _pytest("pytest_triton", "test_triton_gpu", estimate_s=30, timeout_s=300,
                    reserve_s=30),
            _pytest("pytest_compile", f"{LATE_TESTS} and not ({EXACT_TESTS})", estimate_s=30,
                    timeout_s=300, reserve_s=60),
            # the second window's was cut at 30 s, after its 1-8 rank rows at 256-2048 tokens
            _scaling_exact(dry, estimate_s=60, timeout_s=150),
        ]
    if stage == 7:
        # The fourth window (15 minutes; GPU.md "The next window"): what stage 6 left. RQ1's
        # rows that still time the old backward tiles (1K-2K, part long), the GPU tests no
        # window has finished, then the sweep at the worst case against FlashAttention-2.
        batch_4k_16k, short, long_, decode = _rq1_slices(dry)
        tune = (["--quick", "--targets", "1"] if dry  # the decoding target: call rows, fast
                else ["--full", "--targets", ",".join(str(i) for i in D256_BACKWARD_TARGETS)])
        again = ["--resume-after", TILES_CHANGED]
        return [
            _probe("env", estimate_s=5, timeout_s=60),
            # the host's time per call, LongFlash's and SDPA's (7 runs of 50 calls of each of 3
            # kinds, at 128 tokens): since the ops dropped custom_op's layers (PERFLOG), the
            # first GPU measure of what RQ1's short rows and the sweep's host_ms rows timed
            Step("host_time", _py("experiments.host_time", *(["--quick"] if dry else []),
                                  "--out", "{out}"),
                 rq="host_time", estimate_s=20, timeout_s=90, reserve_s=400),
            # The gate: the forward's warp-specialized candidate forced on every kind of call it
            # may serve (13 cases, one compile each), against float64. Exact in two windows'
            # preflights and 1.20x the autotuner's choice at d128 4K in the sweep; if every
            # case passes, the later steps run with it on (LONGFLASH_WS=fwd, named in their
            # rows' command), and the session after the window makes that the default
            # (GPU.md, PERFLOG "The forward's warp-specialized candidate, alone").
            _pytest("pytest_ws_fwd", "test_forward_warp_specialized", estimate_s=75,
                    timeout_s=180, reserve_s=300, env=WS_FORWARD, then_env=WS_FORWARD),
            # RQ1's 4K-16K rows, the goals' d128 first: measured already (stage 6) unless the
            # gate switched the forward's WS on, which --resume then measures again
            # (results.same_switches): 9 groups of 3 providers x 3 modes (stage 6: 3 in 44-49 s)
            _speedup("speedup_batch", batch_4k_16k, estimate_s=30, timeout_s=200,
                     reserve_s=250),
            # 12 groups (1K-2K; d64's last, first measured with the first window's code
            # (34b433c), whose 1K forward took 0.681 ms there against 0.400 in the sweep)
            _speedup("speedup_short", short + again, estimate_s=60, timeout_s=160,
                     reserve_s=250),
            # 3 groups at 32K-128K (stage 2: 183 s with flex's compiles, here without flex)
            _speedup("speedup_long", long_ + again, estimate_s=60, timeout_s=200,
                     reserve_s=190),
            # the four cases stage 6 did not reach (each compiles 3 kernels: about 15 s each)
            _pytest("pytest_triton", "test_triton_gpu and fp16 and (D96 or D40)",
                    estimate_s=30, timeout_s=120, reserve_s=160),
            _pytest("pytest_compile", f"{LATE_TESTS} and not ({EXACT_TESTS})", estimate_s=30,
                    timeout_s=240, reserve_s=100),
            # the sweep's d256 targets with the new tiles (rows before the change measured
            # again); rows written as they come, so the second run's --steps rest resumes it
            Step("tuning", _py("experiments.tuning", *tune, "--resume", *again, "--budget-s",
                               "{budget}", "--out", "{out}"),
                 rq="tuning", estimate_s=60, timeout_s=300, reserve_s=60, tail_s=40),
            # dK/dV's WS candidate at d128 (NaN in stage 6) beside WS_TRIALS' tiles: a 32-row
            # tile's fault or not (the d64 one is exact since _load_head_tile): about a minute.
            # A failure switches WS off (LONGFLASH_WS=0) for what follows, the gate's too:
            # scaling_exact, whose ranks run on the CPU.
            _preflight_ws("128", dry, estimate_s=30, timeout_s=150, reserve_s=60),
            _scaling_exact(dry, estimate_s=60, timeout_s=150, reserve_s=35),
            # attn_mask (new since stage 6) against float64, with what is left (the estimate
            # is the least worth starting for): three cases of the training kernels, each
            # autotuning its own specialization (about 20 s each), then four of the
            # decoding kernel (one compile each, a few seconds)
            _pytest("pytest_mask", "test_attn_mask", estimate_s=35, timeout_s=150),
            # the float8 KV cache (new, never run on a GPU): three decoding cases against
            # float64 and the append's rounding bit for bit, NaN included (one compile each)
            _pytest("pytest_fp8", "fp8", estimate_s=20, timeout_s=90),
            # RQ1 part decode again, rows before DECODE_FP8_ADDED measured again: every
            # provider and LongFlash's float8 cache in one run, the float8 cache's first
            # timing (PERFLOG "A float8 KV cache"; stage 3's run of the part took 52 s)
            _speedup("speedup_decode", decode + ["--resume-after", DECODE_FP8_ADDED],
                     estimate_s=60, timeout_s=150, tail_s=30),
        ]
    if stage == 8:
        # The next window (15 minutes; GPU.md "The next window"), on an H200 since the device
        # tool lends no other kind (its first: no H200 row yet, so each RQ1 step measures its
        # whole slice there): the fourth H100 window's two faults, mended offline, and the
        # features no GPU has run checked against float64 first (a minute), then the float8
        # cache's first timing and the host's time per call, then the forward's WS gate and
        # RQ1's goals (part batch at 4K-16K) with WS if it passed, the cascade's and chunked
        # prefill's first timings, then RQ1's other slices and what no window has reached
        # (likely the second call's).
        batch_4k_16k, short, long_, decode = _rq1_slices(dry)
        return [
            _probe("env", estimate_s=5, timeout_s=60),
            # the float8 cache against float64 and the append's rounding bit for bit torch's,
            # NaN included (the fourth window: 4 of 5 failed on -0, before the fix; 10 s), and
            # chunked prefill over float8 pages, read in place by the forward kernel (one more
            # autotuned compile)
            _pytest("pytest_fp8", "fp8", estimate_s=30, timeout_s=120, reserve_s=300),
            # cascade decoding over a shared prefix and a masked tree of 16 queries, both on the
            # split-KV kernel's 64-row tile (its 8-warp masked config new), and MLA absorbed
            # decoding (qv, 512-dim latents: a config of its own, new), against float64
            _pytest("pytest_shared_prefix", "shared_prefix or 64rows or mla", estimate_s=20,
                    timeout_s=90, reserve_s=300),
            # a training forward and backward in CUDA graphs (make_graphed_callables, and the
            # backward alone as the sweep's time_ms_graph captures it, which failed at d256 1K
            # in two windows), bit for bit the eager call's: two cases, a compile each
            _pytest("pytest_graphs", "test_training_cuda_graphs", estimate_s=20,
                    timeout_s=90, reserve_s=300),
            # RQ1 part decode, rows before DECODE_FP8_ADDED measured again: every provider and
            # LongFlash's float8 cache in one run (stage 3's run of the part took 52 s on the
            # H100). Before the gate, so that its rows are the default switches'.
            _speedup("speedup_decode", decode + ["--resume-after", DECODE_FP8_ADDED],
                     estimate_s=60, timeout_s=150, reserve_s=250, tail_s=30),
            # the host's time per call (the fourth window: LongFlash's launched forward
            # 169-319 us, 47-64 us of it above Triton's launcher; SDPA's 17-21 us), with each
            # LongFlash call's profile (its top 25 functions by own time) to the log
            Step("host_time", _py("experiments.host_time", *(["--quick"] if dry else []),
                                  "--profile", "25", "--out", "{out}"),
                 rq="host_time", estimate_s=25, timeout_s=90, reserve_s=250),
            # the gate (13 cases; the fourth window: 12 passed, the packed sequences' raised an
            # illegal instruction, which the autotuner now leaves out): if every case passes,
            # the later steps run with the forward's WS on (LONGFLASH_WS=fwd)
            _pytest("pytest_ws_fwd", "test_forward_warp_specialized", estimate_s=40,
                    timeout_s=180, reserve_s=220, env=WS_FORWARD, then_env=WS_FORWARD),
            # RQ1 with --resume: rows measured under other switches count as not measured
            # (results.same_switches). On a GPU with rows (the H100) these measure again only
            # if the gate turned the forward's WS on; on one without (the H200) they measure
            # their whole slice (the H100's fourth window: 4K-16K about 45 s a head dim, 1K-2K
            # 85 s, 32K-128K 68 s). The goals' slice first; its reserve keeps the two new
            # parts' timings in the first call.
            _speedup("speedup_batch", batch_4k_16k, estimate_s=30, timeout_s=200,
                     reserve_s=75),
            # the cascade's first timing, RQ1 part shared_prefix (the cascade call against the
            # step over duplicated caches, LongFlash's and SDPA's; PERFLOG "Cascade decoding")
            _speedup("speedup_shared_prefix", ["--quick" if dry else "--full", "--parts",
                                               "shared_prefix"],
                     estimate_s=30, timeout_s=120, reserve_s=45, tail_s=30),
            # RQ1 part prefill: chunked prefill over a paged cache, bf16 and float8 pages read
            # in place against float8 pages gathered first (PERFLOG "Float8 pages read in place
            # by the forward kernel")
            _speedup("speedup_prefill", ["--quick" if dry else "--full", "--parts", "prefill"],
                     estimate_s=45, timeout_s=120, reserve_s=30, tail_s=30),
            # RQ1 part mla: MLA's absorbed decoding step (qv) against SDPA over the
            # concatenated form (PERFLOG "MLA absorbed decoding"; new)
            _speedup("speedup_mla", ["--quick" if dry else "--full", "--parts", "mla"],
                     estimate_s=10, timeout_s=120, reserve_s=30, tail_s=30),
            _speedup("speedup_short", short, estimate_s=30, timeout_s=160, reserve_s=30),
            _speedup("speedup_long", long_, estimate_s=30, timeout_s=200, reserve_s=60),
            # dK/dV's WS candidate at d128 beside WS_TRIALS' tiles (cut at 30 s twice in the
            # fourth window, by the budget left, not its own timeout)
            _preflight_ws("128", dry, estimate_s=60, timeout_s=150, reserve_s=60),
            # no window has reached it (the fourth's budget ran out before it twice)
            _scaling_exact(dry, estimate_s=60, timeout_s=150),
        ]
    raise ValueError(f"stage must be 1, 2, 3, 4, 5, 6, 7 or 8, got {stage!r}")


# ----------------------------------------------------------------------------- probes
# Small measurements that no experiment script makes; each runs in its own subprocess
# (`--probe NAME`) and writes a JSON: {"rows": [{metric, value, unit, status, note}], ...}.

def _dump(path, obj):
    """Write obj as JSON atomically (a temp file beside it, then a rename): a reader, or a
    step killed at its timeout, sees the old file or the new one, never half of one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1, default=str)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _row(metric, value, unit, status="ok", note=""):
    return dict(metric=metric, value=value, unit=unit, status=status, note=note)


def probe_env(path):
    import platform
    import torch
    info = dict(python=platform.python_version(), torch=torch.__version__,
                cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                ncu=shutil.which("ncu"), nvidia_smi=shutil.which("nvidia-smi"),
                longflash_tma=os.environ.get("LONGFLASH_TMA", "1"),  # 0: TMA candidates off
                longflash_ws=os.environ.get("LONGFLASH_WS", "0"))  # 1: warp specialization on
    from experiments.results import git_state
    info.update(zip(("git_commit", "git_dirty", "git_dirty_files", "git_source"), git_state()))
    for mod in ("triton", "numpy", "pandas", "transformers", "jax", "jax_triton"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001 - record any import failure as it is
            info[mod] = f"unavailable: {type(exc).__name__}: {exc}"
    try:  # equal to another machine's: a kernel compiled there (same Python ABI) is one here
        from triton.runtime.cache import triton_key
        info["triton_key_sha256"] = hashlib.sha256(triton_key().encode()).hexdigest()
    except Exception as exc:  # noqa: BLE001
        info["triton_key_sha256"] = f"unavailable: {type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_mb=p.total_memory / 2**20,
                    l2_bytes=getattr(p, "L2_cache_size", None))
        info["nvidia_smi_q"] = _cmd(["nvidia-smi", "-q", "-d", "CLOCK,MEMORY,POWER"])
    from experiments.results import cpu_name
    info["cpu"] = cpu_name()
    _dump(path, info)
    print(json.dumps({k: v for k, v in info.items() if k != "nvidia_smi_q"}, indent=1))


def _cmd(argv):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable: {exc}"


def _autotune_choices():
    """{kernel: {key: chosen config}} of every Triton autotuner in longflash.flash_triton."""
    try:
        from longflash import flash_triton
    except Exception as exc:  # noqa: BLE001
        return {"unavailable": repr(exc)}
    chosen = {}
    for name, obj in vars(flash_triton).items():
        cache = getattr(obj, "cache", None)
        if isinstance(cache, dict) and hasattr(obj, "configs"):
            chosen[name] = dict(n_configs=len(obj.configs),
                                chosen={str(k): str(c) for k, c in cache.items()})
    return chosen


def probe_speedup(path, argv):
    """experiments.speedup's main() with argv, then the autotuner's choices to `path`."""
    from experiments import speedup
    sys.argv = ["experiments.speedup", *argv]
    try:
        speedup.main()
    finally:
        _dump(path, dict(argv=argv, autotune=_autotune_choices()))


def probe_warm(path, seqlen, headdim):
    """Autotune longflash.attention (bf16, causal, forward and backward) at `seqlen` tokens with
    the heads of experiments.scaling's one-GPU long run, so that its 1M-token call, keyed on
    the same sequence bucket (flash_triton.seqlen_bucket stops at 64K), finds the choice on
    disk instead of timing each candidate at 1M tokens."""
    import torch
    import longflash
    from experiments.scaling import FULL, Config, _inputs
    batch, nheads, nheads_kv, _ = Config(**FULL).gpu_long_shape
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    t0 = time.monotonic()
    q, k, v, do = _inputs((batch, nheads, nheads_kv, headdim), seqlen, dtype, seed=3,
                          device=device)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    torch.autograd.grad(longflash.attention(q, k, v, causal=True), (q, k, v), do)
    if cuda:
        torch.cuda.synchronize()
    wall = time.monotonic() - t0
    note = f"{seqlen} tokens, d{headdim}, {nheads}/{nheads_kv} heads, {dtype}, causal, fwd+bwd"
    _dump(path, dict(rows=[_row("warm_s", wall, "s", note=note + ", autotuning included")]))
    print(f"warm: {note}: {wall:.1f} s (autotuning included)")


def probe_hf(path):
    """A small random Llama: LongFlash logits against eager, one greedy generate."""
    import torch
    rows = []
    try:
        import transformers
        import longflash.integrations.transformers as lf_hf
    except Exception as exc:  # noqa: BLE001
        _dump(path, dict(rows=[_row("max_abs_diff_logits", float("nan"), "", "unsupported",
                                    f"transformers unavailable: {exc}")]))
        return
    lf_hf.register()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2) if cuda else \
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
    config = transformers.LlamaConfig(vocab_size=1000, max_position_embeddings=4096, **size)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(0, 1000, (2, 1024 if cuda else 64), device=device)
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        ref = model(ids).logits.float()
        model.config._attn_implementation = "LongFlash"
        out = model(ids).logits.float()
        diff = (out - ref).abs().max().item()
        gen = model.generate(ids[:, :32], max_new_tokens=8, do_sample=False)
    rows.append(_row("max_abs_diff_logits", diff, "", "ok" if diff < (0.1 if cuda else 1e-3)
                     else "error", f"{transformers.__version__}, {device}, {dtype}"))
    rows.append(_row("generate_tokens", gen.shape[1] - 32, "tokens"))
    _dump(path, dict(rows=rows))
    print(rows)


def probe_jax(path):
    """longflash.jax on the GPU; its Triton path needs jax-triton >= 0.4 and triton >= 3.7,
    which the GPU image lacks (it has triton 3.6, no jax-triton, no network): then one
    'unsupported' row saying why, and the default (blockwise) backend checked."""
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
        from longflash import jax as lf_jax
    except Exception as exc:  # noqa: BLE001
        _dump(path, dict(rows=[_row("max_abs_diff", float("nan"), "", "unsupported",
                                    f"jax unavailable: {exc}")]))
        return
    gpu = any(d.platform == "gpu" for d in jax.devices())
    missing = lf_jax.jax_triton_missing()
    has_jt = missing is None
    note = f"jax {jax.__version__}, devices {[d.platform for d in jax.devices()]}, " \
           f"jax_triton {'usable' if has_jt else 'unusable: ' + missing}"
    rows = []
    if gpu and not has_jt:
        rows.append(_row("max_abs_diff", float("nan"), "", "unsupported",
                         "the Triton path needs jax-triton >= 0.4 and triton >= 3.7 "
                         "(experiments/GPU.md). " + note))
    rng = np.random.default_rng(0)
    shape = (1, 256 if gpu else 64, 2, 64)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    try:  # the binding's default backend here (the blockwise JAX path without jax-triton)
        out = lf_jax.attention(q, k, v, causal=True)
        import torch
        import longflash
        ref, _ = longflash.attention_ref(*(torch.from_numpy(np.array(x)).double()
                                           for x in (q, k, v)), causal=True)
        diff = float(np.abs(np.asarray(out, np.float64) - ref.numpy()).max())
        rows.append(_row("max_abs_diff_default_backend", diff, "",
                         # float32 matmuls on a GPU may run at TF32 precision
                         "ok" if diff < (1e-2 if gpu else 1e-3) else "error",
                         f"backend {'triton' if gpu and has_jt else 'jax (blockwise)'}, {note}"))
    except Exception as exc:  # noqa: BLE001
        rows.append(_row("max_abs_diff_default_backend", float("nan"), "", "error",
                         f"{type(exc).__name__}: {exc}"))
    rows.append(_probe_jax_decoding(lf_jax, q, k, v, gpu))
    _dump(path, dict(rows=rows))
    print(rows)


def _probe_jax_decoding(lf_jax, q, k, v, gpu):
    """One decoding step of longflash.jax.attention_with_kvcache (jitted, lengths traced) over
    k and v as a cache of two sequences of different lengths, against longflash.attention_ref
    per sequence in float64: a row."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    import longflash
    lengths = [k.shape[1] - 1, k.shape[1] // 3]
    k_cache, v_cache = (jnp.concatenate([x, x[:, ::-1]]) for x in (k, v))  # (2, N, H, D)
    try:
        step = jax.jit(lambda *a: lf_jax.attention_with_kvcache(*a, causal=True)[0])
        out = np.asarray(step(q[:, -1:].repeat(2, 0), k_cache, v_cache, k_cache[:, :1],
                              v_cache[:, :1], jnp.asarray(lengths)), np.float64)
        diff = 0.0
        for b, n in enumerate(lengths):
            new_k, new_v = (np.concatenate([np.asarray(c[b, :n]), np.asarray(c[b, :1])])
                            for c in (k_cache, v_cache))
            ref, _ = longflash.attention_ref(*(torch.from_numpy(np.asarray(x, np.float64))[None]
                                               for x in (q[0, -1:], new_k, new_v)), causal=True)
            diff = max(diff, float(np.abs(out[b] - ref.numpy()[0]).max()))
        return _row("max_abs_diff_kvcache", diff, "", "ok" if diff < (1e-2 if gpu else 1e-3)
                    else "error", "jax attention_with_kvcache, batch 2, lengths "
                    f"{[n + 1 for n in lengths]} after the append")
    except Exception as exc:  # noqa: BLE001
        return _row("max_abs_diff_kvcache", float("nan"), "", "error",
                    f"{type(exc).__name__}: {exc}")


# The preflight: the Hopper-only candidates, in the order they are checked (the warp-specialized
# ones read their tiles by TMA too), each with the switch that turns it off. The
# warp-specialized ones are opt-in (flash_triton._ws_ok: they returned NaN on an H100 with
# Triton 3.6), so their check turns them on in its subprocess; the stage's steps keep the
# library's default either way.
PREFLIGHT_KINDS = {"tma": "LONGFLASH_TMA", "ws": "LONGFLASH_WS"}
PREFLIGHT_ON = {"ws": {"LONGFLASH_WS": "1"}}
PREFLIGHT_TIMEOUT_S = 120
# measure.RELATIVE_ERROR_LIMIT: what a working tile stays far below; tests/test_gpu.py applies
# the strict tolerance rule to every candidate later in stage 1.
PREFLIGHT_TOLERANCE = RELATIVE_ERROR_LIMIT
# Warp-specialized tiles the tables lack, checked after the table's own by preflight_ws at their
# head dim (the launcher never chooses them). The two WS kernels that returned NaN on the H100,
# dK/dV d128 (32, 128, 4, 3) and dQ d256 (128, 32, 4, 2), are the only ones whose loops copy
# 32-row tiles (m64n32 score wgmmas); the IR showed nothing else apart (PERFLOG). These tell a
# 32-row tile with fewer stages from a 64-row tile: NaN in both, or in the first only.
# The forward's warp-specialized candidates alone (stage 7's gate and what it turns on).
WS_FORWARD = {"LONGFLASH_WS": "fwd"}
WS_TRIALS = {("dkdv", 128): [(32, 128, 4, 2, "tma", "ws"), (64, 128, 4, 2, "tma", "ws")]}


def probe_preflight(path, headdims, kinds=",".join(PREFLIGHT_KINDS)):
    """Each kind of Hopper-only candidate (of `kinds`) in a subprocess of its own (a hang or an
    illegal address ends that subprocess only); a kind that fails is switched off for the
    stage's later steps through the JSON's "env" (run_stage applies it)."""
    rows, env = [], {}
    kill_children_on_sigterm()
    for kind, switch in PREFLIGHT_KINDS.items():
        if kind not in kinds.split(","):
            continue
        metric = f"preflight_{kind}"
        if env:  # TMA is off, and the warp-specialized candidates need it
            rows.append(_row(metric, float("nan"), "", "unsupported", "TMA switched off"))
            env[switch] = "0"
            continue
        argv = [sys.executable, "-m", "experiments.gpu_campaign", "--probe", "preflight-kind",
                "--probe-out", "-", "--", kind, headdims]
        rc, stdout, stderr = run_group(argv, PREFLIGHT_TIMEOUT_S, cwd=ROOT, started=track_child,
                                       env=dict(os.environ, **PREFLIGHT_ON.get(kind, {})))
        print(stdout + stderr)
        if rc is None:
            row = _row(metric, float("nan"), "", "error",
                       f"no result after {PREFLIGHT_TIMEOUT_S} s (a hang?)")
        else:
            found = [ln for ln in stdout.splitlines() if ln.startswith("PREFLIGHT ")]
            last = ([ln for ln in (stdout + stderr).splitlines() if ln.strip()] or [""])[-1]
            row = json.loads(found[-1][len("PREFLIGHT "):]) if found and rc == 0 \
                else _row(metric, float("nan"), "", "error", f"exit {rc}: {last[:300]}")
        rows.append(row)
        if row["status"] == "error" and os.environ.get(switch) != "0":
            env[switch] = "0"
        print(f"preflight {kind}: {row['status']} {row['value']} {row['note']}", flush=True)
    _dump(path, dict(rows=rows, env=env))


def _kind(config):
    k = config.kwargs
    return "ws" if k.get("WARP_SPECIALIZE") else "tma" if k.get("USE_TMA") else "pointer"


def probe_preflight_kind(kind, headdims):
    """The candidates of one kind, each forced in turn, forward and backward, causal and not,
    on a small odd shape with GQA, against the float64 reference; the warp-specialized ones
    also without masks (FULL_TILES), non-causal on lengths that are multiples of every tile.
    TMA candidates are forced in all three kernels at once (a kernel without one runs its first
    candidate); warp-specialized ones in one kernel at a time, the others on their first
    (pointer) candidate, so that a failure names its kernel. Prints one row, "PREFLIGHT
    {json}"; its note names the runs that failed (kernel, config, head dim, shape, causal)."""
    import torch
    from longflash import flash_triton as ft

    metric, errors, failed = f"preflight_{kind}", [], []
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    major = torch.cuda.get_device_capability()[0] if cuda else 9
    kernels = ("fwd", "dkdv", "dq")
    gen = torch.Generator(device).manual_seed(0)
    try:
        shapes = [((2, 777, 1031, 4, 2) if cuda else (1, 150, 203, 2, 1), (False, True))]
        if kind == "ws":
            shapes.append(((2, 1024, 2048, 4, 2) if cuda else (1, 256, 256, 2, 1), (False,)))
        for headdim, ((batch, seqlen_q, seqlen_k, nheads, nheads_kv), causals) in (
                itertools.product(headdims, shapes)):
            q, do = (torch.randn(batch, seqlen_q, nheads, headdim, device=device, dtype=dtype,
                                 generator=gen) for _ in range(2))
            k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device=device, dtype=dtype,
                                generator=gen) for _ in range(2))
            usable = ft._ws_ok("fwd", q, k, v) if kind == "ws" else ft._tma_ok(k, v)
            if cuda and not usable:
                row = _row(metric, float("nan"), "", "unsupported",
                           f"the launcher would not choose them here (d={headdim})")
                print("PREFLIGHT " + json.dumps(row))
                return
            tables = {name: ft.configs_for(name, major, headdim) for name in kernels}
            mine = {name: [c for c in cs if _kind(c) == kind]
                    + [ft._config(c) for c in (WS_TRIALS.get((name, headdim), [])
                                               if kind == "ws" and major == 9 else [])]
                    for name, cs in tables.items()}
            targets = [tuple(kernels)] if kind == "tma" else [(n,) for n in kernels if mine[n]]
            for target in targets:
                for i in range(max(len(mine[name]) for name in target)):
                    forced = {name: mine[name][i % len(mine[name])]
                              if name in target and mine[name] else tables[name][0]
                              for name in kernels}
                    for causal in causals:
                        with ft.forced_configs(forced):
                            errs = relative_errors(q, k, v, do, causal)
                        errors += errs
                        if not all(e < PREFLIGHT_TOLERANCE for e in errs):  # NaN fails too
                            failed.append(
                                f"{'+'.join(target)} {ft._entry(forced[target[0]])} "
                                f"d{headdim} {seqlen_q}x{seqlen_k} "
                                f"{'causal' if causal else 'full'}: o/dq/dk/dv "
                                + "/".join(f"{e:.2g}" for e in errs))
    except Exception as exc:  # noqa: BLE001 - a failure here is the finding
        row = _row(metric, float("nan"), "", "error", f"{type(exc).__name__}: {exc}"[:500])
    else:
        worst = float("nan") if any(e != e for e in errors) else max(errors)
        ok = worst < PREFLIGHT_TOLERANCE and not failed  # NaN fails too
        row = _row(metric, worst, "", "ok" if ok else "error",
                   f"{len(errors) // 4} runs, head dims {list(headdims)}, worst relative error "
                   f"of o, dq, dk, dv against float64 (limit {PREFLIGHT_TOLERANCE})"
                   + (f"; failed {len(failed)}: " + "; ".join(failed) if failed else ""))
    print("PREFLIGHT " + json.dumps(row, default=str))


# ----------------------------------------------------------------------------- the stage

def _fill(argv, **values):
    return [a.format(**values) if "{" in a else a for a in argv]


GATE_PASSED = "gate passed"  # a gate's note in the campaign's rows, read by a later --steps run


def gates_passed_before(steps, camp_csv):
    """The then_env of the gates among `steps` that an earlier run of the stage (its rows in
    camp_csv) passed: a window's second run (--steps rest) does not run a gate again, and
    its steps keep the first run's environment (rows measured under other switches would be
    measured again and replaced)."""
    env = {}
    if os.path.exists(camp_csv):
        import pandas as pd
        df = pd.read_csv(camp_csv)
        passed = set(df.loc[(df["metric"] == "wall_s") & (df["note"] == GATE_PASSED), "step"])
        for step in steps:
            if step.then_env and step.name in passed:
                env.update(step.then_env)
    return env


def passed_every_test(out):
    """Whether pytest's output says every test it ran passed: some passed, none failed, none
    skipped, no error (a skip, on a GPU whose candidates may not run, checked nothing)."""
    summary = [ln for ln in out.splitlines() if re.match(r"^=+ .* in [\d.]+s", ln)][-1:]
    return bool(summary) and re.search(r"\b\d+ passed\b", summary[0]) is not None and \
        re.search(r"\b\d+ (failed|skipped|errors?|xfailed|xpassed)\b", summary[0]) is None


def run_step(step, budget, env, log, values, python=sys.executable):
    """Run one step as a subprocess within the budget. Returns (status, wall_s, note). A gate
    (step.then_env) that passed every test adds its then_env to `env`, the stage's
    environment, for the later steps."""
    if not budget.allows(step.estimate_s):
        log(f"-- {step.name}: not started, {budget.left():.0f} s left < estimate "
            f"{step.estimate_s:.0f} s")
        return "skipped", 0.0, "budget spent"
    if step.needs and shutil.which(step.needs) is None:
        log(f"-- {step.name}: unsupported, {step.needs} not found")
        return "unsupported", 0.0, f"{step.needs} not found"
    timeout = budget.step_timeout(step)
    # "{budget}" ends before the timeout: a step that keeps to it is never killed
    values = dict(values, budget=f"{max(1.0, timeout - step.tail_s):.0f}")
    argv = [python, *_fill(step.argv, **values)]
    with_env = "".join(f"{k}={shlex.quote(str(v))} " for k, v in step.env.items())
    log(f"-- {step.name}: {with_env}{shlex.join(argv)} (timeout {timeout:.0f} s)")
    stage_env, env = env, dict(env, **step.env)
    t0 = time.monotonic()
    # A session of its own: at the timeout the whole group goes (scaling's forked gloo ranks,
    # a probe's children), not only the direct child, and nothing is left holding the GPU or
    # the output pipes.
    rc, stdout, stderr = run_group(argv, timeout, cwd=ROOT, env=env)
    out = stdout + stderr
    wall = time.monotonic() - t0
    log(out.rstrip())
    if rc is None:
        log(f"-- {step.name}: error, timed out after {wall:.0f} s")
        return "error", wall, f"timeout after {wall:.0f} s"
    if rc != 0:
        last = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
        log(f"-- {step.name}: error, exit code {rc}")
        return "error", wall, f"exit {rc}: {last[0][:200]}"
    log(f"-- {step.name}: ok, {wall:.1f} s")
    if step.then_env:
        if passed_every_test(out):
            stage_env.update(step.then_env)
            log(f"-- {step.name}: every test passed; the later steps run with {step.then_env}")
            return "ok", wall, GATE_PASSED
        else:
            log(f"-- {step.name}: not every test passed (or some skipped); the later steps run "
                f"without {step.then_env}")
            return "ok", wall, "gate not passed"
    return "ok", wall, ""


def campaign_rows(records, probes):
    """The campaign's own rows: one wall_s row per step, plus the probes' measurements."""
    nan = float("nan")
    base = dict(experiment="gpu_campaign", provider="longflash", mode="fwd", dtype="",
                batch=0, seqlen_q=0, seqlen_k=0, nheads=0, nheads_kv=0, headdim=0,
                causal=False, p20=nan, p80=nan)
    rows = []
    for rec in records:
        status = "error" if rec["status"] == "skipped" else rec["status"]
        rows.append(dict(base, step=rec["name"], metric="wall_s",
                         value=rec["wall_s"] if status == "ok" else nan, unit="s",
                         status=status, note=rec["note"] or rec["status"]))
        for r in probes.get(rec["name"], []):
            rows.append(dict(base, step=rec["name"], **r))
    return rows


def _prefix_dry(path, device_prefix="dry run: "):
    """Mark every row of a dry run's CSV as such in its device column."""
    import pandas as pd
    df = pd.read_csv(path)
    if "device" in df.columns:
        df["device"] = df["device"].astype(str).map(
            lambda d: d if d.startswith(device_prefix) else device_prefix + d)
        df.to_csv(path, index=False)


def make_archive(scratch, tar_path):
    """Pack the scratch tree (paths relative to the repository root) into tar_path."""
    with tarfile.open(tar_path, "w:gz") as tar:
        for dirpath, _, names in sorted(os.walk(scratch)):
            for name in sorted(names):
                full = os.path.join(dirpath, name)
                tar.add(full, arcname=os.path.relpath(full, scratch))
    return os.path.getsize(tar_path)


def seed_scratch(src_dir, dst_dir, prefix):
    """Copy the files of src_dir whose names start with `prefix` (a results stem and a dot:
    "h100." takes h100.csv, .log, .json, .ncu.log, not h100-pcie.csv) into dst_dir, where not
    there already. Returns the names copied. The steps then merge rows into the CSV, append to
    the log and add their config to the JSON's "earlier_runs" (results.start_run), so the
    archive, unpacked over the repository, replaces each file with a superset of it."""
    copied = []
    if not os.path.isdir(src_dir):
        return copied
    for name in sorted(os.listdir(src_dir)):
        src, dst = os.path.join(src_dir, name), os.path.join(dst_dir, name)
        if name.startswith(prefix) and os.path.isfile(src) and not os.path.exists(dst):
            os.makedirs(dst_dir, exist_ok=True)
            shutil.copy2(src, dst)
            copied.append(name)
    return copied


ALWAYS = ("preflight", "env")  # steps that run in every stage, --steps or not


def unfinished_steps(stage, dry, camp_csv):
    """The steps of `stage` that its earlier runs (their rows in camp_csv, the repository's
    results/gpu_campaign/<stem>-stageN.csv) did not finish: never run, skipped for the budget
    or cut by a timeout (a step that exited with an error, a failing test say, finished: its
    failure is its result), and those that keep a budget of their own and resume (speedup,
    tuning: "{budget}" in their argv), which stop early with status ok. For --steps rest: a
    window's second run, on what its first did not reach."""
    steps = stage_steps(stage, dry)
    finished = set()
    if os.path.exists(camp_csv):
        import pandas as pd
        df = pd.read_csv(camp_csv)
        df = df[df["metric"] == "wall_s"]
        done = (df["status"] == "ok") | df["note"].astype(str).str.startswith("exit")
        finished = set(df.loc[done, "step"])
    return [s.name for s in steps
            if s.name not in finished or "{budget}" in s.argv]


def run_stage(stage, out_dir, dry=False, budget_s=BUDGET_S, clock=time.monotonic,
              steps=None, log_print=lambda m: print(m, flush=True), only=None, seed_from=None):
    """Run one stage; returns (archive path, records).

    only: names of the steps to run (the preflight and env always run); None for all.
    seed_from: the results/ folder whose files of this device (results/<rq>/<stem>.*, and
    results/gpu_campaign/<stem>-stageN.*) are copied into the scratch tree first
    (seed_scratch); default the repository's, None in a dry run (its files are the dry run's
    own)."""
    from experiments.results import device_tag, earlier_runs, git_state, warn_unknown_commit
    from experiments.results import write_results

    stem = "dryrun" if dry else device_tag()
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    # Outside out_dir: the device machine brings back at most 8 files from it, so it holds
    # the archive alone. Kept after the stage (its path is logged) for a look by hand.
    scratch = tempfile.mkdtemp(prefix=f"gpu_campaign_stage{stage}_")
    camp_dir = os.path.join(scratch, "results", "gpu_campaign")
    os.makedirs(camp_dir)
    camp = os.path.join(camp_dir, f"{stem}-stage{stage}")
    lines = []

    def log(msg):
        lines.append(msg)
        with open(camp + ".log", "a") as f:
            f.write(msg + "\n")
        log_print(msg if len(msg) < 2000 else msg[:300] + " ... " + msg[-1500:])

    budget = Budget(budget_s, clock=clock)
    every_step = stage_steps(stage, dry) if steps is None else steps
    steps = every_step if only is None else [s for s in every_step
                                             if s.name in only or s.name in ALWAYS]
    if seed_from is None and not dry:
        seed_from = os.path.join(ROOT, "results")
    if seed_from:  # an earlier run of this stage: its log, JSON and rows are kept
        seed_scratch(os.path.join(seed_from, "gpu_campaign"), camp_dir,
                     f"{stem}-stage{stage}.")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "kernels"), ROOT] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""   # a dry run is a CPU run, also on a GPU machine
        env["TRITON_INTERPRET"] = "1"
    env["TRITON_CACHE_AUTOTUNING"] = "1"
    # gates an earlier run passed and this one does not run again (--steps rest)
    gated = gates_passed_before([s for s in every_step if s not in steps], camp + ".csv")
    env.update(gated)
    commit, dirty, dirty_files, source = git_state()
    config = dict(stage=stage, dry_run=dry, budget_s=budget_s, stem=stem, out=out_dir,
                  python=sys.executable, git_commit=commit, git_dirty=dirty,
                  git_dirty_files=dirty_files, git_source=source,
                  started=time.strftime("%Y-%m-%dT%H:%M:%S"), steps=[asdict(s) for s in steps])
    earlier = earlier_runs(camp + ".json")  # the same stage run before (seeded)
    if earlier:
        config["earlier_runs"] = earlier
    _dump(camp + ".json", config)
    log(f"== gpu_campaign stage {stage}{' (dry run)' if dry else ''}: {len(steps)} steps, "
        f"budget {budget_s:.0f} s, results stem {stem!r}, scratch {scratch}")
    log(f"code: git_commit {commit}, git_dirty {dirty} (from {source})")
    if source == "unknown":  # every row of the stage would say git_commit "unknown"
        warn_unknown_commit(log)
    if gated:
        log(f"gates passed in an earlier run of this stage: the steps run with {gated}")

    records, probes = [], {}
    for step in steps:
        out_csv = os.path.join(scratch, "results", step.rq or "gpu_campaign",
                               f"{stem}.csv" if step.rq else f"{stem}-{step.name}.csv")
        if step.rq and seed_from:
            # the device's CSV (rows merge by key, --resume skips measured ones), its log
            # (appended) and config JSON (runs accumulate), and files such as <stem>.ncu.log
            seeded = seed_scratch(os.path.join(seed_from, step.rq),
                                  os.path.dirname(out_csv), f"{stem}.")
            if seeded:
                log(f"-- {step.name}: kept from results/{step.rq}/: {', '.join(seeded)}")
        os.makedirs(os.path.dirname(out_csv), exist_ok=True)
        status, wall, note = run_step(step, budget, env, log,
                                      dict(out=out_csv, pre=camp))
        records.append(dict(name=step.name, rq=step.rq, status=status, wall_s=wall, note=note))
        for fname in step.files:
            p = f"{camp}-{fname}"
            if os.path.exists(p):
                try:
                    with open(p) as f:
                        found = json.load(f)
                except (ValueError, OSError):
                    continue
                probes[step.name] = found.get("rows", [])
                if found.get("env"):  # the preflight switched something off
                    env.update(found["env"])
                    log(f"-- {step.name}: the later steps run with {found['env']}")

    rows = campaign_rows(records, probes)
    write_results(rows, camp + ".csv", key_columns=KEY_COLUMNS)
    if dry:
        for dirpath, _, names in os.walk(os.path.join(scratch, "results")):
            for name in names:
                if name.endswith(".csv"):
                    _prefix_dry(os.path.join(dirpath, name))
    config["records"] = records
    _dump(camp + ".json", config)
    tar_path = os.path.join(out_dir, f"stage{stage}.tar.gz")
    size = make_archive(scratch, tar_path)
    if size > ARCHIVE_LIMIT:
        log(f"WARNING: {tar_path} is {size / 2**20:.1f} MiB, over the 16 MiB the machine returns")
    summary = [f"stage {stage}{' (dry run)' if dry else ''}: {budget.elapsed():.0f} s of "
               f"{budget_s:.0f}, archive {tar_path} ({size / 2**20:.2f} MiB)",
               f"{'step':<14} {'status':<12} {'wall_s':>7}  note"]
    summary += [f"{r['name']:<14} {r['status']:<12} {r['wall_s']:>7.1f}  {r['note'][:80]}"
                for r in records]
    summary += [f"  {name}: {r['metric']} = {r['value']} [{r['status']}] {r['note'][:60]}"
                for name, rs in probes.items() for r in rs]
    summary.append("unpack at the repository root: PYTHONPATH=kernels:. python3 -m "
                   f"experiments.gpu_unpack {tar_path}")
    log("\n".join(summary))
    if dry:
        shutil.rmtree(scratch, ignore_errors=True)
    return tar_path, records


def _merge_problem(csv_path, rq):
    """Why a CSV of results/<rq>/ would not merge into the repository's GPU file there
    (results/<rq>/h100.csv) as experiments.gpu_unpack merges it, tried on a copy; None if it
    merges or there is no such file. (Stage 8's RQ1 archive, with part prefill's rows keyed by
    route, did not: found so, dry, before a window.)"""
    from experiments import gpu_unpack  # (it imports this module)
    dst = os.path.join(ROOT, "results", rq, "h100.csv")
    if not os.path.exists(dst):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        copy = shutil.copy(dst, tmp)
        try:
            gpu_unpack.merge_csv(csv_path, copy, gpu_unpack.KEY_COLUMNS.get(rq, ()))
        except Exception as exc:  # noqa: BLE001 - reported
            return f"{csv_path}: would not merge into results/{rq}/h100.csv: {exc}"
    return None


def check_archive(tar_path):
    """Problems with an archive: paths outside results/<rq>/, size, unreadable CSVs, CSVs that
    would not merge into the repository's GPU results (_merge_problem)."""
    from experiments.results import read_results
    problems = []
    if os.path.getsize(tar_path) > ARCHIVE_LIMIT:
        problems.append(f"{tar_path}: over 16 MiB")
    with tarfile.open(tar_path) as tar, tempfile.TemporaryDirectory() as tmp:
        names = tar.getnames()
        for n in names:
            parts = n.split("/")
            if n.startswith("/") or ".." in parts or parts[0] != "results" or len(parts) != 3:
                problems.append(f"{n}: not results/<rq>/<file>")
        tar.extractall(tmp, filter="data") if sys.version_info >= (3, 12) else tar.extractall(tmp)
        csvs = [os.path.join(tmp, n) for n in names if n.endswith(".csv")]
        if not csvs:
            problems.append(f"{tar_path}: no CSV")
        for c in csvs:
            try:
                df = read_results(c)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{c}: unreadable: {exc}")
                continue
            if "device" in df.columns and "dryrun" in os.path.basename(c) and \
                    not df["device"].astype(str).str.startswith("dry run").all():
                problems.append(f"{c}: a dry-run row without 'dry run' in its device")
            rq = os.path.relpath(c, tmp).split(os.sep)[1]
            problems += [p for p in (_merge_problem(c, rq),) if p]
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Stages and outputs: see the module docstring.")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3, 4, 5, 6, 7, 8))
    parser.add_argument("--out", help="folder for stageN.tar.gz")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, the Triton "
                        "interpreter; rows labelled 'dry run', files named dryrun.csv")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="wall budget of the stage (default %(default).0f s)")
    parser.add_argument("--steps", help="comma-separated steps of the stage to run (a rerun of "
                        "what a stage did not reach), or 'rest': those its earlier runs in this "
                        "tree's results/gpu_campaign/ did not finish, and the resumable ones; "
                        "the preflight and env always run")
    parser.add_argument("--print-command", action="store_true", help="print the command for "
                        "--stage on the GPU machine, with this tree's git commit and state in "
                        "LONGFLASH_GIT_COMMIT / LONGFLASH_GIT_DIRTY (the copy sent there has no "
                        ".git), and exit")
    parser.add_argument("--check", nargs="+", metavar="TAR", help="check archives and exit")
    parser.add_argument("--probe", choices=("env", "speedup", "ncu", "hf", "jax", "preflight",
                                            "preflight-kind", "warm"),
                        help=argparse.SUPPRESS)   # one step, run by the campaign itself
    parser.add_argument("--probe-out", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.check:
        bad = [p for t in args.check for p in check_archive(t)]
        print("\n".join(bad) or f"{len(args.check)} archive(s) OK")
        sys.exit(1 if bad else 0)
    if args.probe:
        rest = rest[1:] if rest[:1] == ["--"] else rest
        fn = dict(env=probe_env, ncu=probe_ncu, hf=probe_hf, jax=probe_jax)
        if args.probe == "speedup":
            probe_speedup(args.probe_out, rest)
        elif args.probe == "preflight":
            probe_preflight(args.probe_out, *rest)
        elif args.probe == "preflight-kind":
            probe_preflight_kind(rest[0], [int(d) for d in rest[1].split(",")])
        elif args.probe == "ncu":
            probe_ncu(args.probe_out, float(rest[0]) if rest else None, start=STARTED)
        elif args.probe == "warm":
            probe_warm(args.probe_out, int(rest[0]), int(rest[1]))
        else:
            fn[args.probe](args.probe_out)
        return
    if rest:
        parser.error(f"unrecognized arguments: {rest}")
    if args.print_command:
        if args.stage is None:
            parser.error("--print-command needs --stage")
        print(print_command(args.stage, args.steps))
        return
    if args.stage is None or not args.out:
        parser.error("--stage and --out are required")
    only = None
    if args.steps == "rest":
        from experiments.results import device_tag
        stem = "dryrun" if args.dry_run else device_tag()
        camp = os.path.join(ROOT, "results", "gpu_campaign", f"{stem}-stage{args.stage}.csv")
        only = unfinished_steps(args.stage, args.dry_run, camp)
        print(f"--steps rest: {','.join(only)} (from {camp})", flush=True)
    elif args.steps:
        only = args.steps.split(",")
        known = [s.name for s in stage_steps(args.stage, args.dry_run)]
        if set(only) - set(known):
            parser.error(f"--steps: stage {args.stage} has no {sorted(set(only) - set(known))};"
                         f" its steps: {','.join(known)}")
    _, records = run_stage(args.stage, args.out, dry=args.dry_run, budget_s=args.budget_s,
                           only=only)
    sys.exit(0)


def print_command(stage, steps=None):
    """The command line for the GPU machine (experiments/GPU.md), run on the machine that
    sends the tree: its git commit and whether its code differs from it, which the copy sent
    (without .git) cannot tell, in LONGFLASH_GIT_COMMIT / LONGFLASH_GIT_DIRTY."""
    from experiments.results import GIT_COMMIT_ENV, GIT_DIRTY_ENV, git_state
    commit, dirty, _, source = git_state()
    if source != "git":
        raise SystemExit(f"--print-command: git cannot say the commit here (source {source})")
    camp = glob.glob(os.path.join(ROOT, "results", "gpu_campaign", f"*-stage{stage}.csv"))
    if steps == "rest" and not [c for c in camp if not os.path.basename(c).startswith("dryrun")]:
        # the second call reads which steps the first finished from the tree it is sent
        # (the fourth window's was sent before the first's archive was unpacked: it ran
        # every step again)
        raise SystemExit(f"--print-command --steps rest: no results/gpu_campaign/<gpu>-stage"
                         f"{stage}.csv here; unpack the first call's archive (gpu_unpack) first")
    return (f"{GIT_COMMIT_ENV}={commit} {GIT_DIRTY_ENV}={dirty} python3 -m "
            f"experiments.gpu_campaign --stage {stage} --out $OUT"
            + (f" --steps {steps}" if steps else ""))


if __name__ == "__main__":
    main()
