"""Every implementation against the float64 reference: output, lse, dq, dk, dv.

The tolerance rule (ARCHITECTURE.md): the error against float64 is at most twice the
error of the same computation done by PyTorch in the input's precision, plus a floor.
Shapes are odd on purpose: lengths that are not multiples of any block, seqlen_q !=
seqlen_k both ways, GQA ratios 1, 2, 4, 8, head dims that are not powers of two.
"""

import contextlib

import pytest
import torch

import longflash
from longflash import attention_ref, blockwise
from conftest import HAS_TRITON, INTERPRET, check_close, needs_triton

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim)
SHAPES = [
    (1, 1, 1, 1, 1, 16),
    (2, 17, 17, 4, 2, 40),
    (1, 97, 113, 4, 1, 59),
    (1, 113, 97, 8, 1, 80),   # seqlen_q > seqlen_k: causal rows that see no key
    (1, 33, 203, 2, 2, 96),
    (1, 21, 37, 2, 2, 256),
    (1, 19, 23, 2, 1, 8),     # below the kernel's minimum tile width of 16
]


def shape_id(shape):
    b, nq, nk, h, hkv, d = shape
    return f"B{b}-Nq{nq}-Nk{nk}-H{h}/{hkv}-D{d}"


def make_inputs(shape, dtype, seed=0, device="cpu"):
    b, nq, nk, h, hkv, d = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, h, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, nk, hkv, d, generator=gen, dtype=torch.float64)
    do = torch.randn(b, nq, h, d, generator=gen, dtype=torch.float64)
    return [x.to(device=device, dtype=dtype).requires_grad_(x is not do) for x in (q, k, v, do)]


def run(fn, q, k, v, do):
    """Output, lse and the gradients of sum(o * do) with respect to q, k, v."""
    o, lse = fn(q, k, v)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    return o, lse, dq, dk, dv


def check_against_reference(shape, dtype, causal, backend, device="cpu"):
    q, k, v, do = make_inputs(shape, dtype, device=device)
    got = run(lambda q, k, v: longflash.attention(q, k, v, causal=causal, return_lse=True,
                                                  backend=backend), q, k, v, do)
    lowp = run(lambda q, k, v: attention_ref(q, k, v, causal=causal, upcast=False), q, k, v, do)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = run(lambda q, k, v: attention_ref(q, k, v, causal=causal), *x64, do.double())
    for name, a, b, r in zip(("o", "lse", "dq", "dk", "dv"), got, lowp, ref):
        assert a.dtype == (torch.float32 if name == "lse" else dtype)
        check_close(name, a, b, r)


@pytest.fixture(params=[(16, 32), (32, 16), (None, None)], ids=["tile16x32", "tile32x16", "tile-default"])
def small_tiles(request, monkeypatch):
    """Small blockwise tiles, so that short sequences span many blocks."""
    block_m, block_n = request.param
    if block_m:
        monkeypatch.setattr(blockwise, "BLOCK_M", block_m)
        monkeypatch.setattr(blockwise, "BLOCK_N", block_n)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_torch_path(small_tiles, dtype, shape, causal):
    check_against_reference(shape, dtype, causal, backend="torch")


TRITON_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[3], SHAPES[4], SHAPES[6]]
# fp16 on every shape, fp32 on the short ones: the kernels' loops are the same in both (the
# interpreter's fp32 twin of the long shapes cost CI a minute and checked nothing new).
TRITON_RUNS = [(dtype, shape) for shape in TRITON_SHAPES for dtype in (torch.float32, torch.float16)
               if dtype == torch.float16 or shape[1] * shape[2] * shape[3] < 5000]


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, shape", TRITON_RUNS,
                         ids=[f"{'fp32' if d == torch.float32 else 'fp16'}-{shape_id(s)}"
                              for d, s in TRITON_RUNS])
def test_triton_interpreter(dtype, shape, causal):
    check_against_reference(shape, dtype, causal, backend="triton")


KERNEL_FUNCTIONS = {"fwd": "_attn_fwd", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}


def force_configs(monkeypatch, configs):
    """Launch each kernel with configs[kernel] (a triton.Config) instead of autotuning."""
    from longflash import flash_triton
    for kernel, config in configs.items():
        monkeypatch.setattr(getattr(flash_triton, KERNEL_FUNCTIONS[kernel]), "configs", [config])


def gpu_tiles(kernel):
    """The (BLOCK_M, BLOCK_N, flags) tiles a GPU may launch `kernel` with (flash_triton.CONFIGS,
    every architecture and head dim; flags: TMA if the loop reads its tiles by TMA copies, WS
    for the warp-specialized code path)."""
    from longflash import flash_triton
    return sorted({(*c[:2], tuple(c[4:])) for c in flash_triton.all_configs(kernel)})


def force_tiles(monkeypatch, tiles, case):
    """Launch each kernel with the case-th of its tiles[kernel] (cycling through shorter lists),
    tiles as gpu_tiles gives them; warps and stages do not matter to the interpreter."""
    from longflash.flash_triton import _config
    force_configs(monkeypatch, {kernel: _config((block_m, block_n, 4, 1, *flags))
                                for kernel, ts in tiles.items()
                                for block_m, block_n, flags in [ts[case % len(ts)]]})


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", range(max(len(gpu_tiles(k)) for k in KERNEL_FUNCTIONS)
                                         if HAS_TRITON else 1))
def test_triton_interpreter_gpu_tiles(case, causal, monkeypatch):
    """The interpreter otherwise runs one small tile; here every tile of the GPU config table
    (case i: the i-th tile of each kernel), so the block ranges and edge masks of the shapes a
    GPU launches are checked before a GPU runs them, and the TMA candidates' tensor descriptors
    (zeros past the sequence end and the head dim, one descriptor per sequence and head), and
    the warp-specialized code paths (one loop, every block masked; dK/dV's over the query heads
    of a GQA group and their query blocks together).
    Lengths span several tiles, neither a multiple of any; seqlen_q > seqlen_k (rows that see
    no key when causal) and the reverse; head dim 40 pads to 64; two sequences (full), two
    query heads of one GQA group (causal)."""
    force_tiles(monkeypatch, {kernel: gpu_tiles(kernel) for kernel in KERNEL_FUNCTIONS}, case)
    shape = (1, 300, 203, 2, 1, 40) if causal else (2, 203, 300, 1, 1, 64)
    check_against_reference(shape, torch.float16, causal, backend="triton")


@needs_triton
def test_trial_candidates_name_their_flags_and_exclude_warp_specialization():
    """A dK/dV candidate in two passes (SPLIT) or adding dQ by atomics (ATOMIC), and a forward
    software-pipelined (PIPE), maps to its entry and back and is never also warp-specialized
    (their numbers: test_variants' "split", "atomic" and "pipe" cases)."""
    from longflash import flash_triton as ft
    for entry in [(32, 64, 8, 3, ft.TMA, ft.SPLIT), (64, 128, 8, 2, ft.TMA, ft.ATOMIC),
                  (32, 64, 8, 3, ft.TMA, ft.SPLIT, ft.ATOMIC), (64, 64, 4, 2, ft.ATOMIC),
                  (128, 64, 8, 3, ft.TMA, ft.PIPE), (128, 64, 8, 3, ft.PIPE)]:
        config = ft._config(entry)
        assert ft._entry(config) == entry
        assert config.kwargs.get("SPLIT", False) == (ft.SPLIT in entry)
        assert config.kwargs.get("ATOMIC_DQ", False) == (ft.ATOMIC in entry)
        assert config.kwargs.get("PIPELINE", False) == (ft.PIPE in entry)
    plain = ft._config((32, 64, 8, 3, ft.TMA)).kwargs  # the other kernels take no such flag
    assert "SPLIT" not in plain and "ATOMIC_DQ" not in plain and "PIPELINE" not in plain
    for flag in (ft.SPLIT, ft.ATOMIC, ft.PIPE):
        with pytest.raises(ValueError, match="warp-specialized or split/atomic"):
            ft._config((32, 64, 4, 2, ft.TMA, ft.WS, flag))


@needs_triton
def test_atomic_dq_only_where_the_caller_allows_a_non_deterministic_backward(monkeypatch):
    """The launcher runs dK/dV's ATOMIC candidates (dQ by atomics, no dQ kernel) where the
    GPU's and head dim's table holds them and neither deterministic=True nor torch's
    deterministic mode forbids it; the autotuner then keeps those candidates alone (atomic_dq),
    and else none of them. A forced ATOMIC config under deterministic=True is an error naming
    the argument, not a silent non-deterministic backward."""
    from longflash import flash_triton as ft
    q = torch.zeros(1, 8, 2, 128)
    assert not any(ft.ATOMIC in c for cs in ft.CONFIGS.values() for c in cs)  # trials only
    plain, atomic = (64, 128, 8, 2, ft.TMA), (64, 128, 8, 2, ft.TMA, ft.ATOMIC)
    monkeypatch.setattr(ft._attn_bwd_dkdv, "configs", [ft._config(plain), ft._config(atomic)])
    assert not ft._atomic_dq(q, 128, deterministic=False)  # the table has none
    monkeypatch.setitem(ft.CONFIGS, ("dkdv", 9, 128), [plain, atomic])
    assert ft._atomic_dq(q, 128, deterministic=False)
    assert not ft._atomic_dq(q, 128, deterministic=True)
    assert not ft._atomic_dq(q, 64, deterministic=False)  # another head dim's table
    assert not ft._atomic_dq(q, 128, deterministic=False, tma_ok=0)  # none that may run
    with torch_deterministic():
        assert not ft._atomic_dq(q, 128, deterministic=False)
    prune = ft._prune("dkdv")
    args = dict(Q=q, HEAD_DIM=128, HEAD_DIM_V=128, tma_ok=1, ws_ok=0)
    configs = ft._attn_bwd_dkdv.configs
    assert [ft._entry(c) for c in prune(configs, {**args, "atomic_dq": 1})] == [atomic]
    assert [ft._entry(c) for c in prune(configs, {**args, "atomic_dq": 0})] == [plain]
    monkeypatch.setattr(ft._attn_bwd_dkdv, "configs", [ft._config(atomic)])  # forced
    assert ft._atomic_dq(q, 64, deterministic=False)
    with pytest.raises(ValueError, match="deterministic=True"):
        ft._atomic_dq(q, 64, deterministic=True)


@needs_triton
def test_deterministic_reaches_the_backward(monkeypatch):
    """deterministic=True travels from the public function through the custom ops to the
    launcher: with a forced ATOMIC dK/dV config the backward refuses it (above), and without
    deterministic the same call runs."""
    from longflash import flash_triton as ft
    if not INTERPRET:
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    force_configs(monkeypatch, {"dkdv": ft._config((*ft._INTERPRET_CONFIG, ft.ATOMIC))})
    q, k, v, do = make_inputs((1, 20, 20, 2, 2, 16), torch.float32)
    with pytest.raises(ValueError, match="deterministic=True"):
        longflash.attention(q, k, v, backend="triton", deterministic=True).backward(do)
    longflash.attention(q, k, v, backend="triton").backward(do)
    assert torch.isfinite(q.grad).all()


@contextlib.contextmanager
def torch_deterministic():
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)


@needs_triton
def test_full_tiles_only_where_no_block_needs_a_mask():
    """FULL_TILES (a warp-specialized loop without masks): only without a causal mask or
    window, packed sequences or a partial tile."""
    from longflash.flash_triton import _full_tiles
    args = dict(WARP_SPECIALIZE=True, window_left=-1, window_right=-1, IS_VARLEN=False,
                seqlen_q=256, seqlen_k=384, BLOCK_M=128, BLOCK_N=128)
    assert _full_tiles(args)
    for change in (dict(WARP_SPECIALIZE=False), dict(window_right=0), dict(window_left=7),
                   dict(IS_VARLEN=True), dict(seqlen_q=255), dict(seqlen_k=320)):
        assert not _full_tiles({**args, **change}), change


@needs_triton
def test_autotuning_key_stops_growing_at_64k_tokens():
    """Lengths share an autotuning choice per power of two up to 64K and one beyond it, so a
    1M-token call reuses the 64K choice instead of timing every candidate at seconds a run."""
    from longflash.flash_triton import seqlen_bucket
    assert [seqlen_bucket(n, n) for n in (1, 17, 1024, 1025)] == [1, 32, 1024, 2048]
    assert seqlen_bucket(4096, 100) == seqlen_bucket(100, 4096) == 4096
    assert {seqlen_bucket(n, n) for n in (65536, 65537, 131072, 2**20)} == {65536}


@pytest.mark.skipif(not INTERPRET, reason="interpreter tests; GPU tests are in test_gpu.py")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_interpreter_ws_full_tiles(causal, monkeypatch):
    """The warp-specialized tiles of every kernel on lengths that are multiples of each: without
    causal mask every kernel takes the unmasked loop (FULL_TILES), with it none does; both
    match float64. Head dim 40: the tiles' zero-filled head-dim padding is all that remains."""
    from longflash import flash_triton
    from longflash.flash_triton import WS
    chosen = []
    for name in KERNEL_FUNCTIONS.values():
        values = getattr(flash_triton, name).fn.values  # the heuristics under the autotuner
        rule = values["FULL_TILES"]
        monkeypatch.setitem(values, "FULL_TILES", lambda args, rule=rule: chosen.append(
            rule(args)) or chosen[-1])
    tiles = {kernel: [t for t in gpu_tiles(kernel) if WS in t[2]] for kernel in KERNEL_FUNCTIONS}
    for case in range(max(map(len, tiles.values()))):
        force_tiles(monkeypatch, tiles, case)
        check_against_reference((1, 256, 384, 4, 2, 40), torch.float16, causal, backend="triton")
    assert len(chosen) == 3 * case + 3 and set(chosen) == {not causal}, chosen


BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_gradient(backend):
    """Gradients flow through the returned lse as well as through the output."""
    q, k, v, do = make_inputs((1, 37, 29, 2, 1, 32), torch.float32)
    dlse = torch.randn(1, 2, 37, dtype=torch.float64)
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    o_ref, lse_ref = attention_ref(*x64, causal=True)
    finite = torch.isfinite(lse_ref)
    loss = (o * do).sum() + (lse[finite] * dlse[finite].float()).sum()
    loss_ref = (o_ref * do.double()).sum() + (lse_ref[finite] * dlse[finite]).sum()
    for g, g_ref in zip(torch.autograd.grad(loss, (q, k, v)), torch.autograd.grad(loss_ref, x64)):
        torch.testing.assert_close(g.double(), g_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_without_keys(backend):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see nothing."""
    q, k, v, do = make_inputs((1, 40, 9, 2, 2, 16), torch.float32)
    o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert torch.equal(o[:, :31], torch.zeros_like(o[:, :31]))
    assert torch.isneginf(lse[:, :, :31]).all() and torch.isfinite(lse[:, :, 31:]).all()
    assert torch.equal(dq[:, :31], torch.zeros_like(dq[:, :31]))
    assert all(torch.isfinite(g).all() for g in (o, dq, dk, dv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_key_sequence(backend):
    """seqlen_k = 0: no row sees a key, so o = 0, lse = -inf and dq = 0."""
    q = torch.randn(2, 5, 2, 16, requires_grad=True)
    k = torch.randn(2, 0, 1, 16, requires_grad=True)
    v = torch.randn(2, 0, 1, 16, requires_grad=True)
    o, lse = longflash.attention(q, k, v, return_lse=True, backend=backend)
    (dq,) = torch.autograd.grad(o.sum(), (q,))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()
    assert torch.equal(dq, torch.zeros_like(dq))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(2, 0, 7, 2, 1, 16), (0, 7, 7, 2, 1, 16)], ids=["Nq0", "B0"])
def test_empty_queries(backend, shape):
    q, k, v, do = make_inputs(shape, torch.float32)
    o, lse = longflash.attention(q, k, v, return_lse=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    assert o.shape == q.shape and lse.shape == (shape[0], shape[3], shape[1])
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend):
    """(batch, nheads, seqlen, headdim) tensors transposed to the API layout, and a
    non-contiguous last dim, give the same result as contiguous copies."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 19, 32, generator=gen).transpose(1, 2)
    k = torch.randn(2, 3, 23, 32, generator=gen).transpose(1, 2)
    v = torch.randn(2, 3, 64, 23, generator=gen).permute(0, 3, 1, 2)[..., ::2]
    assert not q.is_contiguous() and v.stride(-1) != 1
    o = longflash.attention(q, k, v, causal=True, backend=backend)
    o_ref = longflash.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                                backend=backend)
    torch.testing.assert_close(o, o_ref, atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_is_deterministic(backend):
    q, k, v, do = make_inputs((1, 45, 51, 4, 1, 32), torch.float16)
    grads = [torch.autograd.grad(longflash.attention(q, k, v, causal=True, backend=backend),
                                 (q, k, v), do) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_gradcheck_float64():
    """Finite differences on the blockwise path (float64, several blocks)."""
    q, k, v, _ = make_inputs((1, 7, 9, 2, 1, 4), torch.float64)

    def fn(q, k, v):
        o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend="torch")
        return o, lse[torch.isfinite(lse)]
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.skipif(not INTERPRET, reason="compares the two CPU paths")
def test_backends_agree():
    q, k, v, do = make_inputs((2, 29, 31, 4, 2, 24), torch.float32)
    a = run(lambda *x: longflash.attention(*x, causal=True, return_lse=True, backend="torch"),
            q, k, v, do)
    b = run(lambda *x: longflash.attention(*x, causal=True, return_lse=True, backend="triton"),
            q, k, v, do)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
