"""GPU tests (marker `gpu`; skipped without CUDA): the Triton kernels in fp16 and bf16 at
lengths up to 16K, head dims 64, 128, 256, causal and not, and the split-KV decoding kernel in
bf16, against the float64 reference.

The float64 reference runs on the GPU here (IEEE float64, as on the CPU) because at
16K tokens the CPU would take minutes per case.
"""

import os

import pytest
import torch

import longflash
from conftest import check_close
from longflash import attention_ref
from test_correctness import KERNEL_FUNCTIONS, check_against_reference, force_configs, shape_id
from test_kvcache import (CASES, case_id, check_attention_routes_to_split_kv, check_case,
                          check_compiled_decoding, check_compiled_route,
                          check_fp8_append_rounds_as_torch, check_rotary,
                          route_small)  # noqa: F401 (route_small: a fixture)
from test_paged_varlen import check_float8_pages_in_place

pytestmark = pytest.mark.gpu

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
GPU_SHAPES = [
    (1, 16384, 16384, 2, 1, 128),
    (2, 4096, 4096, 4, 4, 64),
    (1, 4096, 4096, 2, 2, 256),
    (2, 1025, 2049, 6, 2, 80),
    (3, 977, 513, 4, 1, 96),
    (1, 113, 203, 8, 8, 40),
]


# Decoding over a KV cache (the split-KV kernel): the interpreter's cases in bf16, and caches of
# thousands of tokens that split into several key blocks per split, paged and not, with the
# lengths as a tensor and as one int (the kernel's UNIFORM_SEQLEN path, as RQ1 times it).
# First in the file: the campaign's pytest step runs the file in order with what is left of
# stage 1 (estimated under a minute here, unmeasured), and nothing else tests this kernel.
# (id, batch, seqlen_q, nheads, nheads_kv, headdim, page_size, capacity, lengths, seqlen_new, kw)
DECODE_LONG = [
    ("decode-H32/8-D128-4K", 2, 1, 32, 8, 128, None, 4200, [4095, 4095], 1, dict(causal=True)),
    ("paged256-H32/8-D128-ragged", 3, 1, 32, 8, 128, 256, 40, [9000, 17, 3001], 1,
     dict(causal=True)),
    ("spec4-H16/2-D64-8K-window", 1, 4, 16, 2, 64, None, 8200, [8100], 4,
     dict(causal=True, window_size=(2048, -1))),
    ("leftpad-H32/8-D128-6K", 2, 1, 32, 8, 128, None, 6200, [6000, 3000], 1,
     dict(causal=True, leftpad=[2500, 77])),
]


@pytest.mark.parametrize("num_splits", [0, 3], ids=["splits-auto", "splits3"])
@pytest.mark.parametrize("case", CASES + DECODE_LONG, ids=case_id)
def test_kvcache_gpu(case, num_splits):
    lengths = case[8]
    check_case(case, torch.bfloat16, "triton", num_splits, device="cuda")
    if len(set(lengths)) == 1:
        check_case(case, torch.bfloat16, "triton", num_splits, device="cuda", int_seqlens=True)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half-split"])
@pytest.mark.parametrize("paged, as_int", [(None, True), (4, False)], ids=["int", "paged4"])
def test_kvcache_rotary_gpu(interleaved, paged, as_int):
    """The append kernel's rotary (q and the new keys) in bf16: what rotating by hand in
    float64 gives, cache included, within a bf16 rounding."""
    check_rotary("triton", torch.bfloat16, interleaved, 16, dict(causal=True), paged, as_int,
                 device="cuda")


def test_decoding_step_does_not_synchronize_gpu():
    """With an int cache_seqlens, an eager decoding step (append with rotary, split-KV and
    merge kernels) never waits for the GPU: CUDA's sync debug mode turns any synchronizing
    call into an error (after a warm-up step, which compiles the kernels)."""
    gen = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = randn(2, 4096, 8, 128), randn(2, 4096, 8, 128)
    angles = torch.rand(4096, 64, device="cuda", generator=gen) * 6.3

    def step(length):
        return longflash.attention_with_kvcache(
            randn(2, 1, 32, 128), k_cache, v_cache, randn(2, 1, 8, 128), randn(2, 1, 8, 128),
            length, causal=True, rotary_cos=angles.cos(), rotary_sin=angles.sin())
    step(3000)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(3001)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("seqlen_q, kw", [(1, dict(causal=True)), (16, dict(causal=True)),
                                         (4, dict(window_size=(1000, 0), softcap=30.0))],
                         ids=["decode", "spec16", "spec4-window-softcap"])
def test_attention_routes_decoding_to_split_kv_gpu(seqlen_q, kw, route_small):
    """attention() without a gradient, short queries over 5K keys: the split-KV kernel (the key
    length as one int), in bf16 within the tolerance rule; with a gradient, the main kernel."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, seqlen_q, 32, 128, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 5000, 8, 128, generator=gen, dtype=torch.float64) for _ in range(2))
    check_attention_routes_to_split_kv(route_small, q, k, v, torch.bfloat16, "cuda", **kw)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_triton_gpu(dtype, shape, causal):
    check_against_reference(shape, dtype, causal, backend="triton", device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two GPUs")
def test_tensors_on_a_gpu_that_is_not_current_gpu():
    """Inputs on cuda:1 while cuda:0 is current (a model spread over GPUs in one process):
    the launchers make the tensors' device current (flash_triton.on_tensor_device), forward,
    backward and a decoding step against float64. Needs two GPUs: not run in the campaign."""
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        check_against_reference((2, 333, 333, 4, 2, 64), torch.bfloat16, True, backend="triton",
                                device="cuda:1")
        check_case(CASES[0], torch.bfloat16, "triton", 0, device="cuda:1")
    finally:
        torch.cuda.set_device(previous)


def test_compiling_then_running_gpu(monkeypatch):
    """flash_triton.compiling(): a forward and backward there compile every kernel they would
    launch and run nothing; the checked call that follows (its autotuning included) compiles
    nothing more (Triton's jit_cache_hook is called on each compile) and is exact. A shape no
    other test compiles (head dim 72)."""
    from triton import knobs
    from longflash import flash_triton
    from test_correctness import make_inputs
    shape = (2, 333, 333, 3, 1, 72)
    q, k, v, do = make_inputs(shape, torch.bfloat16, device="cuda")
    with flash_triton.compiling():
        o = longflash.attention(q, k, v, causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    compiled = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook",
                        lambda *args, **kwargs: compiled.append(kwargs.get("key")) and False)
    check_against_reference(shape, torch.bfloat16, True, backend="triton", device="cuda")
    assert compiled == []


def test_auto_uses_triton_on_cuda():
    from longflash import interface
    assert interface._resolve_backend("auto", torch.empty(1, device="cuda")) == "triton"


def test_compile_inductor_gpu():
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 1000, 4, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    fn = torch.compile(lambda q, k, v: longflash.attention(q, k, v, causal=True).float().sum(),
                       fullgraph=True)
    eager = longflash.attention(q, k, v, causal=True).float().sum()
    torch.testing.assert_close(fn(q, k, v), eager)


@pytest.mark.parametrize("paged", [None, 16], ids=["contiguous", "paged16"])
def test_compile_decoding_gpu(paged):
    """A decoding step under torch.compile(fullgraph=True) with inductor: the split-KV kernel
    as one op, the append compiled, no recompile from the third token on."""
    check_compiled_decoding("triton", "inductor", torch.bfloat16, paged, device="cuda")


def test_compile_decoding_cuda_graphs_gpu():
    """Decoding steps under torch.compile(mode="reduce-overhead"): CUDA graphs capture the
    step (the caches at static addresses, the lengths a tensor that advances between replays)
    and each replay appends and attends exactly as the eager call does (same splits)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = randn(2, 4096, 8, 128), randn(2, 4096, 8, 128)
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    for cache in (k_cache, v_cache):
        torch._dynamo.mark_static_address(cache)

    def step(q, k_cache, v_cache, k, v, lengths):
        return longflash.attention_with_kvcache(q, k_cache, v_cache, k, v, lengths,
                                                causal=True, num_splits=3)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    lengths = torch.tensor([3000, 1200], device="cuda", dtype=torch.int32)
    for _ in range(5):
        q, k, v = randn(2, 1, 32, 128), randn(2, 1, 8, 128), randn(2, 1, 8, 128)
        o = compiled(q, k_cache, v_cache, k, v, lengths).clone()
        assert torch.equal(o, step(q, k_eager, v_eager, k, v, lengths))
        lengths += 1
    assert torch.equal(k_cache, k_eager) and torch.equal(v_cache, v_eager)
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped"


# (id, (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v), kwargs)
TRAIN_GRAPH_CASES = [
    # the tuning sweep's target whose backward time_ms_graph could not capture (second and
    # fourth windows: "operation failed due to a previous error during capture")
    ("D256-1K", (2, 1024, 1024, 8, 8, 256, 256), dict()),
    ("D128-causal-GQA-odd", (2, 1031, 1031, 8, 2, 128, 128), dict(causal=True)),
]


@pytest.mark.parametrize("shape, kw", [c[1:] for c in TRAIN_GRAPH_CASES],
                         ids=[c[0] for c in TRAIN_GRAPH_CASES])
def test_training_cuda_graphs_gpu(shape, kw):
    """LongFlash's training forward and backward captured in CUDA graphs, as a training loop
    does (torch.cuda.make_graphed_callables: a graph each), and its backward alone on a
    forward run outside the graph, as the tuning sweep's time_ms_graph does. Each replay's
    output and gradients equal the eager call's bit for bit (deterministic=True: the same
    kernels on the same inputs)."""
    from test_headdim_v import make_inputs
    q, k, v, do = make_inputs(shape, torch.bfloat16, device="cuda")

    def attend(q, k, v):
        return longflash.attention(q, k, v, deterministic=True, backend="triton", **kw)
    o = attend(q, k, v)
    want = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
    graphed = torch.cuda.make_graphed_callables(attend, (q, k, v))
    for _ in range(2):
        o = graphed(q, k, v)
        got = (o.detach(), *torch.autograd.grad(o, (q, k, v), do))
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), name
    # the backward alone in a graph, its forward outside (the sweep's time_ms_graph)
    o = attend(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(("dq", "dk", "dv"), grads, want[1:]):
        assert torch.equal(a, b), name


def test_time_ms_graph_leaves_out_the_host_gpu():
    """experiments.measure.time_ms_graph (RQ1's decode time_ms_graph) times the GPU's work
    alone: a call that sleeps 2 ms on the host before a tiny kernel takes about 2 ms by
    time_ms (do_bench) and a small fraction of it as graph replays, while a matmul, all GPU
    work, takes about as long either way."""
    import time
    from experiments.measure import time_ms, time_ms_graph
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def slow_host():
        time.sleep(0.002)
        x[0, 0].add_(1)
    assert time_ms(slow_host, "cuda", warmup=5, rep=20)[0] >= 1.5
    assert time_ms_graph(slow_host)[0] < 0.5
    events, graph = time_ms(lambda: x @ x, "cuda")[0], time_ms_graph(lambda: x @ x)[0]
    assert 0.5 < events / graph < 2, (events, graph)


def test_compiled_attention_routes_decoding_to_split_kv_gpu(monkeypatch):
    from longflash import interface
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 20)
    check_compiled_route("inductor", torch.bfloat16, device="cuda")


def test_tma_only_where_a_copy_can_read_gpu(monkeypatch):
    """The TMA candidates run only on Hopper, in fp16/bf16, with 16-byte aligned rows
    (flash_triton._tma_ok); other inputs get the pointer candidates (the autotuner keys its
    choice on tma_ok) and the same result."""
    from longflash import flash_triton
    hopper = torch.cuda.get_device_capability()[0] >= 9
    shape = (2, 300, 4, 64)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    assert flash_triton._tma_ok(x) == int(hopper)
    assert flash_triton._tma_ok(x.float()) == 0
    assert flash_triton._tma_ok(torch.randn(2, 300, 4, 59, device="cuda",
                                            dtype=torch.bfloat16)) == 0  # 118-byte rows
    shifted = [torch.randn(x.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(shape)
               for _ in range(3)]  # starts 2 bytes past a 16-byte boundary
    assert flash_triton._tma_ok(*shifted) == 0
    with monkeypatch.context() as m:
        m.setenv("LONGFLASH_TMA", "0")
        assert flash_triton._tma_ok(x) == 0
    aligned = [t.clone() for t in shifted]
    for t in shifted + aligned:
        t.requires_grad_()
    outs = [longflash.attention(*qkv, causal=True) for qkv in (aligned, shifted)]
    grads = [torch.autograd.grad(o.float().square().sum(), qkv)
             for o, qkv in zip(outs, (aligned, shifted))]
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=5e-2, rtol=5e-2)


def test_warp_specialized_only_on_hopper_with_tma_gpu(monkeypatch):
    """The warp-specialized candidates (sm_90 only: Triton's Hopper pass) are opt-in per kernel
    (LONGFLASH_WS=1 or a list such as fwd: they returned NaN on an H100 with Triton 3.6) and
    need TMA for every tile they copy (flash_triton._ws_ok, part of each kernel's autotuning
    key); LONGFLASH_TMA=0 turns them off with it."""
    from longflash import flash_triton
    x = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    monkeypatch.delenv("LONGFLASH_WS", raising=False)
    assert flash_triton._ws_ok("fwd", x, x, x) == 0  # off by default
    monkeypatch.setenv("LONGFLASH_WS", "1")
    assert [flash_triton._ws_ok(k, x, x, x) for k in ("fwd", "dkdv", "dq")] == [int(hopper)] * 3
    assert flash_triton._ws_ok("fwd", x.float(), x.float(), x.float()) == 0
    shifted = torch.randn(x.numel() + 1, device="cuda", dtype=torch.bfloat16)[1:].view(x.shape)
    assert flash_triton._ws_ok("fwd", shifted, x, x) == 0  # q unaligned: no TMA copy of q
    monkeypatch.setenv("LONGFLASH_WS", "fwd")
    assert [flash_triton._ws_ok(k, x, x, x) for k in ("fwd", "dkdv", "dq")] == [int(hopper), 0, 0]
    for name in ("LONGFLASH_WS", "LONGFLASH_TMA"):
        with monkeypatch.context() as m:
            m.setenv(name, "0")
            assert flash_triton._ws_ok("fwd", x, x, x) == 0


def launchable(forced, tables):
    """forced ({kernel: triton.Config}) as the launcher may run it in this environment: a
    warp-specialized config of a kernel whose candidates LONGFLASH_WS leaves off (opt-in,
    flash_triton.ws_kernels; LONGFLASH_WS=fwd: the forward's alone) replaced by the kernel's
    first candidate (tables[kernel][0]). Skips the test where no forced warp-specialized config
    is left, or a TMA one is forced under LONGFLASH_TMA=0: a forced config the autotuner's
    pruning drops leaves it no candidate, and a case without its WS configs repeats another."""
    from longflash import flash_triton
    ws = [kernel for kernel, c in forced.items() if c.kwargs.get("WARP_SPECIALIZE")]
    if ws and not set(ws) & flash_triton.ws_kernels():
        pytest.skip(f"warp-specialized candidates ({', '.join(ws)}) are opt-in (LONGFLASH_WS): "
                    "they returned NaN on an H100 with Triton 3.6 (PERFLOG)")
    if any(c.kwargs.get("USE_TMA") for c in forced.values()) and \
            os.environ.get("LONGFLASH_TMA") == "0":
        pytest.skip("TMA candidates switched off (LONGFLASH_TMA=0)")
    return {kernel: tables[kernel][0] if kernel in ws and kernel not in flash_triton.ws_kernels()
            else c for kernel, c in forced.items()}


@pytest.mark.parametrize("headdim", [64, 128, 256])
def test_warp_specialized_full_tiles_gpu(headdim, monkeypatch):
    """The warp-specialized candidates without masks (FULL_TILES: non-causal, lengths multiples
    of their tiles), which test_every_config_gpu (causal) never reaches; a kernel without one,
    or whose ones LONGFLASH_WS leaves off, runs its first candidate. bf16 against float64."""
    from longflash import flash_triton
    major = torch.cuda.get_device_capability()[0]
    tables = {kernel: flash_triton.configs_for(kernel, major, headdim)
              for kernel in KERNEL_FUNCTIONS}
    ws = {kernel: [c for c in configs if c.kwargs["WARP_SPECIALIZE"]]
          for kernel, configs in tables.items()}
    if not any(ws.values()):
        pytest.skip(f"no warp-specialized candidate on sm_{major}0 at head dim {headdim}")
    forced = {kernel: (ws[kernel] or tables[kernel])[0] for kernel in KERNEL_FUNCTIONS}
    force_configs(monkeypatch, launchable(forced, tables))
    check_against_reference((2, 2048, 4096, 4, 2, headdim), torch.bfloat16, False,
                            backend="triton", device="cuda")


# The forward's warp-specialized candidate forced on every kind of call it may serve: the
# evidence for turning it on by default (LONGFLASH_WS=fwd; the GPU campaign's pytest_ws_fwd).
# (id, (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, headdim_v), dtype, kwargs)
WS_FORWARD_CASES = [
    ("D128-odd-GQA", (2, 777, 1031, 4, 2, 128, 128), torch.bfloat16, dict()),
    ("D128-odd-GQA-causal", (2, 777, 1031, 4, 2, 128, 128), torch.bfloat16, dict(causal=True)),
    # more queries than keys: the first rows see no key (lse -inf, o 0)
    ("D128-causal-q-longer", (2, 1031, 777, 4, 2, 128, 128), torch.bfloat16, dict(causal=True)),
    ("D128-full-tiles", (2, 1024, 2048, 4, 2, 128, 128), torch.bfloat16, dict()),
    ("D64-causal", (2, 1025, 2049, 6, 2, 64, 64), torch.bfloat16, dict(causal=True)),
    ("D40-causal", (2, 1025, 2049, 6, 2, 40, 40), torch.bfloat16, dict(causal=True)),
    ("D256-causal", (1, 977, 1031, 4, 1, 256, 256), torch.bfloat16, dict(causal=True)),
    ("D192-V128-causal", (1, 1031, 1031, 4, 4, 192, 128), torch.bfloat16, dict(causal=True)),
    ("D80-fp16-causal", (2, 1025, 2049, 6, 2, 80, 80), torch.float16, dict(causal=True)),
    ("D128-window", (2, 2047, 2049, 8, 2, 128, 128), torch.bfloat16,
     dict(causal=True, window_size=(256, 0))),
    ("D128-alibi-softcap", (2, 2047, 2049, 8, 2, 128, 128), torch.bfloat16,
     dict(causal=True, alibi=(8,), softcap=30.0)),
    ("D128-dropout", (2, 2047, 2049, 8, 2, 128, 128), torch.bfloat16,
     dict(dropout_p=0.1, seed=3)),
]


def check_ws_forward(monkeypatch, headdim, attend, reference, q, k, v):
    """attend(q, k, v) -> (o, lse) with the forward's warp-specialized candidate at this head
    dim forced, against reference(q, k, v[, upcast=False]) in float64 by the tolerance rule,
    and the candidate checked to be what ran. Skips where it may not run (no such candidate on
    this GPU, or LONGFLASH_WS leaves it off)."""
    from longflash import flash_triton
    tables = {"fwd": flash_triton.configs_for("fwd", torch.cuda.get_device_capability()[0],
                                              headdim)}
    ws = [c for c in tables["fwd"] if c.kwargs["WARP_SPECIALIZE"]]
    if not ws:
        pytest.skip("no warp-specialized forward candidate on this GPU")
    force_configs(monkeypatch, launchable({"fwd": ws[0]}, tables))
    with torch.no_grad():
        got = attend(q, k, v)
        lowp = reference(q, k, v, upcast=False)
        ref = reference(q.double(), k.double(), v.double())
    assert flash_triton._attn_fwd.best_config is ws[0]  # what ran: the forced candidate
    for name, a, b, r in zip(("o", "lse"), got, lowp, ref):
        check_close(name, a, b, r)


@pytest.mark.parametrize("shape, dtype, kw", [c[1:] for c in WS_FORWARD_CASES],
                         ids=[c[0] for c in WS_FORWARD_CASES])
def test_forward_warp_specialized_gpu(shape, dtype, kw, monkeypatch):
    """The forward's warp-specialized candidate forced (LONGFLASH_WS=1 or fwd), its o and lse
    against the float64 reference (tolerance rule): odd lengths with grouped query heads,
    causal and not, rows that see no key, full tiles (FULL_TILES, no mask), head dims 40 to
    256 and MLA's 192 / 128, fp16, a window, ALiBi with softcap, dropout; forward only, so
    each case compiles one kernel."""
    from test_headdim_v import make_inputs
    from test_variants import kwargs_for, ref_kwargs
    kw = kwargs_for(kw, "cuda")
    q, k, v, _ = make_inputs(shape, dtype, device="cuda")
    check_ws_forward(monkeypatch, max(shape[-2:]),
                     lambda *x: longflash.attention(*x, return_lse=True, backend="triton", **kw),
                     lambda *x, **r: attention_ref(*x, **ref_kwargs(kw), **r), q, k, v)


def test_forward_warp_specialized_varlen_gpu(monkeypatch):
    """Packed causal sequences (attention_varlen; one empty, seqlen_q != seqlen_k, GQA) with
    the forward's warp-specialized candidates turned on (LONGFLASH_WS=fwd): the autotuner
    leaves them out (_launch_args' ws_ok: forced on these, one raised an illegal instruction on
    the H100 in the fourth window, 2026-11-27), and o, lse match float64."""
    from longflash import flash_triton
    from test_variants import packed
    monkeypatch.setenv("LONGFLASH_WS", "fwd")
    (q, k, v), cu_q, cu_k, max_q, max_k = packed([1000, 0, 3000, 17], [1200, 9, 2999, 17],
                                                 nheads=8, nheads_kv=2, headdim=128,
                                                 dtype=torch.bfloat16)
    q, k, v, cu_q, cu_k = (x.detach().cuda() for x in (q, k, v, cu_q, cu_k))
    reference = lambda *x, **r: longflash.attention_varlen_ref(  # noqa: E731
        *x, cu_q, cu_k, causal=True, **r)
    with torch.no_grad():
        got = longflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                         return_lse=True)
        lowp = reference(q, k, v, upcast=False)
        ref = reference(q.double(), k.double(), v.double())
    assert not flash_triton._attn_fwd.best_config.kwargs.get("WARP_SPECIALIZE")
    for name, a, b, r in zip(("o", "lse"), got, lowp, ref):
        check_close(name, a, b, r)


VARIANTS = [
    ("window", dict(causal=True, window_size=(256, 0))),
    ("alibi-softcap", dict(causal=True, alibi=(8,), softcap=30.0)),
    ("dropout", dict(dropout_p=0.1, seed=3)),
]


@pytest.mark.parametrize("name, kw", VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_variants_gpu(dtype, name, kw):
    from test_variants import check_variant
    check_variant((2, 2047, 2049, 8, 2, 128), dtype, kw, "triton", device="cuda")


def test_dropout_block_offsets_gpu():
    """The kernels' dropout counter offset to a block's first row and key (ring attention's
    calls), bf16, forward and backward, against the whole attention's rows in float64; offsets
    that are not multiples of a tile."""
    from test_variants import check_block_dropout
    check_block_dropout((2, 1100, 1300, 8, 2, 128), (101, 1000), (77, 1203), torch.bfloat16,
                        "triton", device="cuda")


@pytest.mark.parametrize("kind, dims, kw", [("bool", "B11K", dict(causal=True)),
                                             ("float", "1HQK", dict(window_size=(300, 200)))],
                         ids=["bool-padding-causal", "float-heads-window"])
def test_attn_mask_gpu(kind, dims, kw):
    """attn_mask in bf16 through the Triton kernels (BIAS_KIND: pointer loads of the mask's
    tiles in every kernel, TMA candidates included), forward and backward, against the
    float64 reference (tolerance rule): a broadcast key-padding mask and a float mask per head
    with -inf entries and a row that sees no key."""
    from test_attn_mask import _case_kwargs
    from test_variants import check_variant
    shape = (2, 777, 1031, 8, 2, 128)
    kw = _case_kwargs(shape, kind, dims, kw)
    kw["attn_mask"] = kw["attn_mask"].cuda()
    check_variant(shape, torch.bfloat16, kw, "triton", device="cuda")


def test_attn_mask_gradient_gpu():
    """A float mask per head that requires grad (a learned bias): its gradient, and q, k, v's,
    in bf16 through the Triton kernels against float64 (the dQ kernel writes dL/ds)."""
    from test_attn_mask import check_mask_gradient
    check_mask_gradient((2, 777, 1031, 8, 2, 128), torch.bfloat16, "1HQK", dict(causal=True),
                        "triton", device="cuda")


@pytest.mark.parametrize("dims, block_size, kw", [("BH", 128, dict(causal=True)),
                                                  ("11", (256, 128), dict(window_size=(600, 0))),
                                                  ("1H", (64, 192), dict(causal=True))],
                         ids=["per-head-causal", "shared-256x128-window", "heads-64x192-causal"])
def test_block_sparse_gpu(dims, block_size, kw):
    """block_mask in bf16 through the Triton kernels (the loops over each row's list of
    visible tiles, TMA candidates included), forward and backward, against the float64
    reference (tolerance rule), with a query block that sees no key; blocks of 64 x 192 get
    the table's tiles shrunk to divide them (flash_triton._fit_blocks)."""
    from test_block_sparse import _kwargs
    from test_variants import check_variant
    shape = (2, 1100, 1300, 8, 2, 128)
    kw = _kwargs(shape, dims, block_size, kw)
    kw["block_mask"] = kw["block_mask"].cuda()
    check_variant(shape, torch.bfloat16, kw, "triton", device="cuda")


def test_block_sparse_skips_hidden_blocks_gpu():
    """NaN keys and values in the hidden blocks leave every output and gradient finite: the
    kernels never load them (test_block_sparse's check, on the GPU)."""
    from test_block_sparse import test_hidden_blocks_are_skipped
    test_hidden_blocks_are_skipped("triton", device="cuda")


def test_block_sparse_cuda_graph_gpu():
    """A forward with a block_mask captured in a CUDA graph after eager calls (which keep the
    mask's block lists), the mask then changed in place: the replay follows the new mask, as
    the launcher makes the lists inside the graph while capturing (flash_triton.
    _cached_block_lists) instead of reusing the kept ones; bf16 against float64."""
    from test_block_sparse import UNIT, _blocks
    from test_headdim_v import make_inputs
    shape = (1, 1100, 1300, 4, 2, 128)
    q, k, v, _ = make_inputs(shape[:5] + (128, 128), torch.bfloat16, device="cuda")
    mask = _blocks(shape, "1H", UNIT, density=0.5).cuda()

    def attend():
        with torch.no_grad():
            return longflash.attention(q, k, v, backend="triton", block_mask=mask)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # eager calls (autotuning) keep this mask's lists
        for _ in range(3):
            attend()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = attend()
    mask.logical_not_()
    graph.replay()
    torch.cuda.synchronize()
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    ref = attention_ref(q64, k64, v64, block_mask=mask)[0]
    lowp = attention_ref(q, k, v, block_mask=mask, upcast=False)[0]
    check_close("o", o, lowp, ref)


# 16 queries x 4 heads a KV head: the split-KV kernel's 64-row tile (8 warps with a mask)
SPEC16 = ("spec16-H32/8-D128-5K", 1, 16, 32, 8, 128, None, 5200, [5100], 16, dict(causal=True))


@pytest.mark.parametrize("case, mask_kind", [(DECODE_LONG[2], "bool-keys"),
                                             (DECODE_LONG[1], "float-heads"),
                                             (DECODE_LONG[3], "bool-rows"),
                                             (SPEC16, "bool-keys")],
                         ids=["spec4-window-tree", "paged-ragged-float", "leftpad-rows",
                              "spec16-tree-64rows"])
def test_attn_mask_kvcache_gpu(case, mask_kind):
    """attn_mask in decoding (the split-KV kernel's BIAS_KIND) in bf16 against float64: a
    boolean mask shared by the heads over a speculative step's 4 queries (tree attention's
    shape), a float mask per head over a ragged paged cache, one boolean per row, and a
    tree over 16 queries (64 packed rows a KV head: the kernel's largest tile)."""
    check_case(case, torch.bfloat16, "triton", 0, device="cuda", mask_kind=mask_kind)


def _sparse_decoding(case, dims, block_size=128):
    """A decoding case with a block_mask over its cache's positions (test_kvcache_block_sparse's
    _blocks: block 1 seen by no row; with heads, head 1 by none)."""
    from test_kvcache_block_sparse import _blocks
    name, batch, seqlen_q, nheads, _, _, page_size, capacity = case[:8]
    mask = _blocks(batch, nheads, seqlen_q, capacity * (page_size or 1), dims, block_size)
    return (f"{name}-blocks-{dims}",) + case[1:10] + (
        dict(case[10], block_mask=mask, block_size=block_size),)


@pytest.mark.parametrize("case, mask_kind", [
    (_sparse_decoding(DECODE_LONG[0], "BH"), None),
    (_sparse_decoding(DECODE_LONG[1], "1H", (128, 256)), None),
    (_sparse_decoding(DECODE_LONG[3], "BH"), None),
    (_sparse_decoding(SPEC16, "B1"), None),
    (_sparse_decoding(DECODE_LONG[2], "1H"), "bool-keys"),
    (_sparse_decoding(DECODE_LONG[0], "BH", 64), None)],
    ids=["4K-per-head", "paged-ragged-shared-128x256", "leftpad-per-head", "spec16-64rows",
         "spec4-window-tree", "4K-per-head-blocks64"])
def test_block_sparse_kvcache_gpu(case, mask_kind):
    """block_mask in decoding (the split-KV kernel's BLOCK_SPARSE: each packed row's bit of a
    tile's key block, a tile no row sees not loaded) in bf16 against float64, splits chosen
    by the heuristic: per-head and shared masks, a paged ragged cache, cache_leftpad, the
    64-row tile, and with a tree attn_mask beside it."""
    check_case(case, torch.bfloat16, "triton", 0, device="cuda", mask_kind=mask_kind)


def test_block_sparse_kvcache_skips_hidden_blocks_gpu():
    """NaN keys and values in a block no row sees leave the output finite: the split-KV
    kernel never loads them (test_kvcache_block_sparse's check, on the GPU)."""
    from test_kvcache_block_sparse import test_hidden_blocks_are_not_read
    for num_splits in (1, 2):
        for heads in (1, 4):
            test_hidden_blocks_are_not_read("triton", num_splits, heads, device="cuda")


@pytest.mark.parametrize("case, fp8", [(DECODE_LONG[0], (torch.float8_e4m3fn, "tensors")),
                                       (DECODE_LONG[1], (torch.float8_e5m2, "floats")),
                                       (DECODE_LONG[2], (torch.float8_e4m3fn, "none"))],
                         ids=["4K-e4m3-per-head", "paged-ragged-e5m2-floats", "spec4-window-e4m3"])
def test_fp8_kvcache_gpu(case, fp8):
    """A float8 cache (the split-KV kernel converting its tiles, the scales folded in; the
    append kernel quantizing) in bf16 against float64 over the cache's entries times its
    scales, and the appended entries bit for bit kvcache.quantize's."""
    check_case(case, torch.bfloat16, "triton", 0, device="cuda", fp8=fp8)


@pytest.mark.parametrize("cache_dtype, scales", [(torch.float8_e4m3fn, "both"),
                                                 (torch.float8_e5m2, "keys")],
                         ids=["e4m3", "e5m2-keys"])
def test_fp8_paged_prefill_gpu(cache_dtype, scales):
    """Chunked prefill over float8 pages (attention_varlen with block_table, no gradient): the
    forward kernel reads the 8-bit tiles in place and converts them (compiled here for the
    first time), in bf16 against float64 over the keys the pages stand for: ragged chunks of
    queries over thousands of keys in pages of 16, GQA 8/2, d128, causal."""
    check_float8_pages_in_place("triton", torch.bfloat16, cache_dtype, dict(causal=True),
                                scales, [200, 1, 0, 77], [3000, 1, 0, 1500], 8, 2, 128, 16,
                                device="cuda")


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_fp8_append_rounds_as_torch_gpu(cache_dtype):
    """The append kernel's quantization compiled (cvt to float8 after _quantized's rounding):
    bit for bit torch's on every kind of value, NaN included (the interpreter's NaN is
    wrong)."""
    check_fp8_append_rounds_as_torch("triton", cache_dtype, device="cuda", nan=True)


def test_shared_prefix_gpu():
    """Cascade decoding in bf16: 24 sequences over a shared prefix of 3000 tokens (its one call
    on the split-KV kernel, 96 query rows a KV head: two tiles) and their own paged caches of 0
    to 700 tokens, GQA 32/8, d128, against float64 per sequence (tolerance rule)."""
    from test_cascade import check_shared_prefix
    case = ("gpu-decode24-H32/8-D128", 24, 1, 32, 8, 128, 3000,
            [0, 700, 17, 256, 511, 3, 650, 128] * 3, 16, dict(causal=True))
    check_shared_prefix(case, torch.bfloat16, "triton", device="cuda")


# MLA absorbed decoding (qv): DeepSeek-V3's shapes under 8-way tensor parallelism, 16 query
# heads on one latent KV head, rotary dims 64 for q and k, 512-dim latents in v_cache and qv
MLA_GPU = [
    ("mla-H16/1-D64-V512-paged64", 3, 1, 16, 1, 64, 512, 64, 80, [5000, 0, 1234], 1,
     dict(causal=True)),
    ("mla-spec2-H16/1-D64-V512-8K", 1, 2, 16, 1, 64, 512, None, 8200, [8100], 2,
     dict(causal=True)),
]


@pytest.mark.parametrize("fp8", [None, (torch.float8_e4m3fn, "tensors")], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("case", MLA_GPU, ids=lambda case: case[0])
def test_mla_decoding_gpu(case, fp8):
    """attention_with_kvcache's qv in bf16 on the split-KV kernel's MLA config (32 rows, 512
    latent columns), the splits chosen by the heuristic, and over a float8 cache with its
    scales, against float64 per sequence (tolerance rule): q' = [q, qv] over [keys, latents]."""
    from test_mla_decoding import check_mla
    check_mla(case, torch.bfloat16, "triton", 0, device="cuda", fp8=fp8)


def test_latent_attention_generation_gpu():
    """longflash.nn.MultiheadLatentAttention at DeepSeek-V3's head dims (16 heads, latents of
    512, rotary 64, nope 128, values 128), bf16: a prompt of 700 tokens through the forward
    kernels (head dims 192 and 128), then steps of 1 and 3 tokens in the absorbed form over its
    latent cache, against the forward over the whole sequence (bf16; max error under 2% of
    the output's largest magnitude: two bf16 computations in different orders). Not in stage
    8's "mla" selection (its prompt autotunes the forward kernel); on CPU in bf16 the same
    steps came within 2.4e-4 of the forward (output magnitude 1.2)."""
    from longflash.nn import MultiheadLatentAttention
    torch.manual_seed(0)
    module = MultiheadLatentAttention(1024, 16, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 704, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = module(x)
        cache = module.make_cache(2, 800)
        got = torch.cat([module(x[:, :700], kv_cache=cache), module(x[:, 700:701], kv_cache=cache),
                         module(x[:, 701:], kv_cache=cache)], 1)
    err = (got.float() - want.float()).abs().max().item()
    assert err < 0.02 * want.float().abs().max().item(), err


def test_attn_mask_routes_decoding_to_split_kv_gpu(route_small):
    """attention() with a key-padding attn_mask, 4 queries over 5K keys, no gradient: the
    split-KV kernel, in bf16 within the tolerance rule."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 32, 128, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 5000, 8, 128, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = (torch.arange(5000) < torch.tensor([5000, 3100])[:, None])[:, None, None]
    check_attention_routes_to_split_kv(route_small, q, k, v, torch.bfloat16, "cuda",
                                       causal=True, attn_mask=mask)


def test_learnable_sink_gpu():
    """Attention sinks in bf16 through the Triton kernels: forward, and the backward with the
    lse gradient the sink adds, against the float64 reference (tolerance rule), at
    test_variants_gpu's window case (its autotuning keys: nothing new to tune)."""
    from test_learnable_sink import check_attention
    check_attention((2, 2047, 2049, 8, 2, 128), torch.bfloat16,
                    dict(causal=True, window_size=(256, 0)), "triton", device="cuda")


def test_varlen_gpu():
    """attention_varlen in bf16 on packed causal sequences (one empty, seqlen_q != seqlen_k),
    GQA, forward and backward through the Triton kernels, against the float64 reference of
    each sequence (tolerance rule). (It compared the packed output with per-sequence launches
    at bf16's default tolerance: two kernels autotuned on their own keys round differently, by
    6e-4 at most on the H100, and that failed; both are approximations of the reference.)"""
    from conftest import check_with_grads
    from test_variants import packed
    (q, k, v), cu_q, cu_k, max_q, max_k = packed([1000, 0, 3000, 17], [1200, 9, 2999, 17],
                                                 nheads=8, nheads_kv=2, headdim=128,
                                                 dtype=torch.bfloat16)
    q, k, v = (x.detach().cuda().requires_grad_() for x in (q, k, v))
    cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
    gen = torch.Generator("cuda").manual_seed(2)
    do = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
    dlse = torch.randn(q.shape[1], q.shape[0], device="cuda", generator=gen)
    check_with_grads(
        lambda q, k, v: longflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k,
                                                   causal=True, return_lse=True),
        lambda q, k, v, **r: longflash.attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True,
                                                            **r),
        (q, k, v), ("q", "k", "v"), do, dlse)


def test_paged_varlen_gpu():
    """attention_varlen over paged keys in bf16, no gradient: the forward kernel reads the pages
    in place (PAGED, pointer loads; pages of 16 tokens, as vLLM's), against the float64
    reference of the packed keys (tolerance rule). Varlen lengths of test_varlen_gpu's
    autotuning bucket; PAGED is a key of its own: one autotuning of the pointer candidates."""
    from conftest import check_close
    from test_paged_varlen import make_paged
    q, k, v, cu_q, cu_k, k_pages, v_pages, table = make_paged(
        [700, 1, 0, 300], [900, 3000, 3, 300], 8, 2, 128, 16, torch.bfloat16)
    with torch.no_grad():
        got = longflash.attention_varlen(*(x.cuda() for x in (q, k_pages, v_pages, cu_q, cu_k)),
                                         700, 3000, causal=True, return_lse=True,
                                         block_table=table.cuda())
    lowp = longflash.attention_varlen_ref(q.cuda(), k.cuda(), v.cuda(), cu_q.cuda(), cu_k.cuda(),
                                          causal=True, upcast=False)
    ref = longflash.attention_varlen_ref(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         causal=True)
    for name, a, b, r in zip(("o", "lse"), got, lowp, ref):
        check_close(name, a.cpu(), b.cpu(), r)


def test_headdim_v_gpu():
    """MLA's head dims, 192 for q and k and 128 for v (HEAD_DIM, HEAD_DIM_V), bf16, causal,
    forward and backward through the Triton kernels (the d256 bucket's candidates), against the
    float64 reference (tolerance rule). Its own autotuning key: after the other tests, so that
    a short budget spends its compilation last."""
    from test_headdim_v import check_attention
    check_attention((1, 1031, 1031, 4, 4, 192, 128), torch.bfloat16, dict(causal=True),
                    "triton", device="cuda")


def test_kvcache_headdim_v_gpu():
    """MLA decoding: a bf16 paged cache (pages of 16) with keys of head dim 192 and values of
    128, taken as they are by the split-KV and append kernels (no autotuning: fixed configs),
    splits chosen by the heuristic, against the float64 reference of each sequence."""
    from test_headdim_v import check_kvcache
    check_kvcache("triton", 16, [1000, 4000], 4096, (192, 128), dtype=torch.bfloat16,
                  device="cuda")


# Last in the file: the tests above autotune, and so compile every candidate of these shapes.
@pytest.mark.parametrize("index", range(4))  # the most candidates a kernel has (test_codegen)
@pytest.mark.parametrize("shape", [GPU_SHAPES[1], GPU_SHAPES[3], GPU_SHAPES[2]], ids=shape_id)
def test_every_config_gpu(shape, index, monkeypatch):
    """Each candidate of this GPU's config table (the index-th of each kernel, TMA ones
    included, warp-specialized ones where LONGFLASH_WS turns them on), not only the one the
    autotuner keeps: bf16, causal, head dims 64, 80 (the 128 bucket) and 256."""
    from longflash import flash_triton
    major = torch.cuda.get_device_capability()[0]
    tables = {kernel: flash_triton.configs_for(kernel, major, shape[-1])
              for kernel in KERNEL_FUNCTIONS}
    forced = {kernel: configs[index % len(configs)] for kernel, configs in tables.items()}
    force_configs(monkeypatch, launchable(forced, tables))
    check_against_reference(shape, torch.bfloat16, True, backend="triton", device="cuda")
