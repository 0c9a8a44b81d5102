"""The public API: bad input, the SDPA drop-in, backend choice, torch.compile."""

import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import longflash
from longflash import _common, interface
from longflash.reference import attention_ref
from conftest import INTERPRET, needs_triton, torch_sdpa


def qkv(b=2, nq=9, nk=11, h=4, hkv=2, d=16, dtype=torch.float32):
    return (torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hkv, d, dtype=dtype),
            torch.randn(b, nk, hkv, d, dtype=dtype))


# ----------------------------------------------------------------------------- bad input

q0, k0, v0 = qkv()
BAD_INPUTS = [
    # (id, args, kwargs, exception, words the message must contain)
    ("q-3d", (q0[0], k0, v0), {}, ValueError, ["q", "4 dimensions"]),
    ("k-not-tensor", (q0, k0.tolist(), v0), {}, TypeError, ["k", "torch.Tensor"]),
    ("batch", (q0, k0[:1], v0[:1]), {}, ValueError, ["batch"]),
    ("headdim", (q0, k0[..., :8], v0[..., :8]), {}, ValueError, ["headdim"]),
    ("k-v-shape", (q0, k0, v0[:, :5]), {}, ValueError, ["k and v"]),
    ("headdim-too-big", qkv(d=320), {}, ValueError, ["headdim", "256"]),
    ("gqa", qkv(h=4, hkv=3), {}, ValueError, ["nheads", "nheads_kv"]),
    ("int-dtype", (q0.long(), k0.long(), v0.long()), {}, TypeError, ["q", "dtype", "float16"]),
    ("mixed-dtype", (q0, k0.half(), v0.half()), {}, TypeError, ["same dtype"]),
    ("device", (q0, k0.to("meta"), v0.to("meta")), {}, ValueError, ["same device"]),
    ("scale-zero", (q0, k0, v0), {"softmax_scale": 0.0}, ValueError, ["softmax_scale"]),
    ("scale-negative", (q0, k0, v0), {"softmax_scale": -1.0}, ValueError, ["softmax_scale"]),
    ("scale-nan", (q0, k0, v0), {"softmax_scale": float("nan")}, ValueError, ["softmax_scale"]),
    ("scale-str", (q0, k0, v0), {"softmax_scale": "0.1"}, TypeError, ["softmax_scale"]),
    ("causal-int", (q0, k0, v0), {"causal": 1}, TypeError, ["causal", "bool"]),
    ("backend", (q0, k0, v0), {"backend": "cuda"}, ValueError, ["backend", "triton", "torch"]),
    ("triton-fp64", (q0.double(), k0.double(), v0.double()), {"backend": "triton"}, TypeError,
     ["float64", "backend='torch'"]),
]


@pytest.mark.parametrize("args, kwargs, exc, words", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(args, kwargs, exc, words, monkeypatch):
    if kwargs.get("backend") == "triton" and interface._TRITON_PROBLEM:
        pytest.skip("backend='triton' without a usable Triton: test_triton_not_installed")
    # Nothing may run before the error: make both implementations explode if called.
    def boom(*a, **k):
        raise AssertionError("work started before validation")
    monkeypatch.setattr(interface, "_implementation", boom)
    with pytest.raises(exc) as info:
        longflash.attention(*args, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {info.value}"


def test_triton_not_installed(monkeypatch):
    """Without the triton package (macOS, Windows), backend='triton' says so and names the
    alternative; 'auto' takes the PyTorch path."""
    monkeypatch.setattr(interface, "_TRITON_PROBLEM", "the triton package (Linux only)")
    with pytest.raises(ValueError, match=r"needs the triton package \(Linux only\); use "
                                         r"backend='torch'"):
        longflash.attention(*qkv(), backend="triton")
    assert interface._resolve_backend("auto", torch.empty(1)) == "torch"


@pytest.mark.parametrize("version, problem", [
    ("3.0.0", "triton >= 3.4 (found triton 3.0.0"),  # torch 2.4's: the kernels do not compile
    ("3.3.1", "triton >= 3.4 (found triton 3.3.1"),
    ("3.4.0", None), ("3.6.0", None), ("3.10.0+git1234abcd", None), ("4.0.0rc1", None),
    (None, "the triton package"),
])
def test_triton_too_old(version, problem, monkeypatch):
    """The kernels need _common.MIN_TRITON: an older Triton (torch 2.4-2.7 pin 3.0-3.3) is as
    none for them. backend='triton' raises, naming the version; 'auto' runs CUDA tensors on the
    PyTorch path with a warning that says why (not silently)."""
    import importlib.metadata
    import importlib.util
    if version is None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    else:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
        monkeypatch.setattr(importlib.metadata, "version", lambda name: version)
    found = _common.triton_problem()
    assert found == problem if problem is None else found.startswith(problem), found
    if problem is None:
        return
    monkeypatch.setattr(interface, "_TRITON_PROBLEM", found)
    with pytest.raises(ValueError, match=r"backend='triton' needs .*; use backend='torch'"):
        longflash.attention(*qkv(), backend="triton")
    cuda_q = types.SimpleNamespace(is_cuda=True, dtype=torch.float16)  # what it reads of q
    with pytest.warns(UserWarning, match=r"Triton kernels need .*PyTorch path"):
        assert interface._resolve_backend("auto", cuda_q) == "torch"


@pytest.mark.parametrize("capability, hip, expected", [
    ((7, 5), None, "torch"), ((7, 0), None, "torch"), ((8, 0), None, "triton"),
    ((8, 9), None, "triton"), ((12, 0), None, "triton"), ((9, 4), "6.2", "triton")],
    ids=["T4", "V100", "A100", "L4", "RTX-50", "MI300-ROCm"])
def test_gpus_older_than_ampere_take_the_pytorch_path(capability, hip, expected, monkeypatch):
    """Triton supports NVIDIA GPUs of compute capability 8.0 and newer: on an older one (T4,
    V100) 'auto' runs the PyTorch path with a warning saying why, backend='triton' raises;
    ROCm's GPUs report capabilities of their own and are not held to it."""
    monkeypatch.setattr(interface, "_TRITON_INTERPRET", False)
    monkeypatch.setattr(interface, "_TRITON_PROBLEM", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    interface.gpu_problem.cache_clear()
    cuda_q = types.SimpleNamespace(is_cuda=True, dtype=torch.float16,
                                   device=torch.device("cuda", 0))  # what it reads of q
    try:
        if expected == "triton":
            assert interface._resolve_backend("auto", cuda_q) == "triton"
            assert interface._resolve_backend("triton", cuda_q) == "triton"
            return
        with pytest.warns(UserWarning, match=r"compute capability 8.0 or newer \(this one is "
                                             rf"{capability[0]}\.{capability[1]}\).*PyTorch path"):
            assert interface._resolve_backend("auto", cuda_q) == "torch"
        with pytest.raises(ValueError, match=r"backend='triton' needs a GPU of compute "
                                             r"capability 8.0 or newer"):
            interface._resolve_backend("triton", cuda_q)
    finally:
        interface.gpu_problem.cache_clear()


@needs_triton
def test_triton_launchers_run_on_their_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: each launcher makes its first tensor's
    device current for the call where another is (tensors on cuda:1 while cuda:0 is current),
    and leaves it alone otherwise (the same device, CPU tensors under the interpreter)."""
    from longflash import decode_triton, flash_triton
    entered = []

    class Device:  # torch.cuda.device, recorded
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            entered.append("exit")

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = flash_triton.on_tensor_device(lambda x, y, z=0: (x, y, z))
    def on(index):
        return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))
    x1 = on(1)
    assert launcher(x1, 2, z=3) == (x1, 2, 3) and entered == [torch.device("cuda", 1), "exit"]
    entered.clear()
    launcher(on(0), 2)
    launcher(torch.empty(1), 2)
    assert entered == []
    for fn in (flash_triton.forward, flash_triton.backward, decode_triton.forward,
               decode_triton.append):
        assert fn.__wrapped__.__module__ == fn.__module__, fn  # each launcher is wrapped


@needs_triton
def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setattr(interface, "_TRITON_INTERPRET", False)
    with pytest.raises(ValueError, match="CUDA"):
        longflash.attention(*qkv(), backend="triton")


@needs_triton
def test_bf16_under_interpreter(monkeypatch):
    monkeypatch.setattr(interface, "_TRITON_INTERPRET", True)
    with pytest.raises(NotImplementedError, match="bfloat16"):
        longflash.attention(*qkv(dtype=torch.bfloat16), backend="triton")


@pytest.mark.parametrize("dtype, interpret, expected", [
    (torch.float32, False, "torch"),
    (torch.float32, True, "triton"),
    (torch.float16, True, "triton"),
    (torch.bfloat16, True, "torch"),   # the interpreter has no bf16 dot
    (torch.float64, True, "torch"),
])
def test_auto_backend_on_cpu(dtype, interpret, expected, monkeypatch):
    monkeypatch.setattr(interface, "_TRITON_INTERPRET", interpret)
    expected = "torch" if interface._TRITON_PROBLEM else expected  # no Triton: the PyTorch path
    assert interface._resolve_backend("auto", torch.empty(1, dtype=dtype)) == expected


# ----------------------------------------------------------------------------- SDPA drop-in

@pytest.mark.parametrize("nq, nk", [(13, 13), (7, 19), (19, 7)], ids=["square", "Nq<Nk", "Nq>Nk"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_sdpa_matches_pytorch(nq, nk, is_causal, gqa):
    """PyTorch semantics, including top-left causal alignment when seqlen_q != seqlen_k."""
    gen = torch.Generator().manual_seed(0)
    hkv = 2 if gqa else 4
    query = torch.randn(2, 4, nq, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    key = torch.randn(2, hkv, nk, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    value = torch.randn(2, hkv, nk, 24, dtype=torch.float64, generator=gen, requires_grad=True)
    kwargs = dict(is_causal=is_causal, scale=0.3, enable_gqa=gqa)
    out = longflash.scaled_dot_product_attention(query, key, value, **kwargs)
    ref = torch_sdpa(query, key, value, **kwargs)
    torch.testing.assert_close(out, ref)
    do = torch.randn_like(ref)
    for g, g_ref in zip(torch.autograd.grad(out, (query, key, value), do),
                        torch.autograd.grad(ref, (query, key, value), do)):
        torch.testing.assert_close(g, g_ref)


def test_sdpa_default_scale_and_layout():
    query, key, value = (x.transpose(1, 2) for x in qkv(h=2, hkv=2))
    torch.testing.assert_close(longflash.scaled_dot_product_attention(query, key, value),
                               F.scaled_dot_product_attention(query, key, value),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"attn_mask": torch.ones(9, 11, dtype=torch.bool), "is_causal": True, "enable_gqa": True},
     ValueError, ["attn_mask", "is_causal"]),
    ({"enable_gqa": False}, ValueError, ["enable_gqa"]),
], ids=["attn_mask-and-causal", "gqa-not-enabled"])
def test_sdpa_refuses_what_it_cannot_honour(kwargs, exc, words):
    query, key, value = (x.transpose(1, 2) for x in qkv(h=4, hkv=2))
    with pytest.raises(exc) as info:
        longflash.scaled_dot_product_attention(query, key, value, **kwargs)
    assert all(w in str(info.value) for w in words)


def test_sdpa_refuses_3d():
    """(Value head dims that differ from the query's are supported: test_headdim_v.)"""
    query, key, value = (x.transpose(1, 2) for x in qkv(h=2, hkv=2))
    with pytest.raises(NotImplementedError, match="4-D"):
        longflash.scaled_dot_product_attention(query[0], key[0], value[0])


# ----------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
def test_compile_fullgraph_forward_backward(backend):
    """The custom ops are captured whole (fullgraph=True fails on any graph break)."""
    torch._dynamo.reset()

    def block(x, wq, wk, wv):
        q, k, v = (x @ w for w in (wq, wk, wv))  # (B, N, H * D)
        q, k, v = (t.unflatten(-1, (2, 16)) for t in (q, k, v))  # (B, N, H, D)
        o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        return o.flatten(-2).sum() + lse.sum()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 21, 32, generator=gen)
    ws = [torch.randn(32, 32, generator=gen, requires_grad=True) for _ in range(3)]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    loss, loss_c = block(x, *ws), compiled(x, *ws)
    torch.testing.assert_close(loss_c, loss)
    for g, g_c in zip(torch.autograd.grad(loss, ws), torch.autograd.grad(loss_c, ws)):
        torch.testing.assert_close(g_c, g)


DYNAMIC_CALLS = {  # name: f(q, k, v, scale, softcap, window_left, cache_len), floats and ints
    # arguments of the compiled function (torch.compile(dynamic=True) makes them symbolic)
    "attention": lambda q, k, v, s, c, w, n: longflash.attention(
        q, k, v, causal=True, softmax_scale=s, softcap=c, window_size=(w, 0), dropout_p=s / 3,
        seed=n, backend="torch", learnable_sink=torch.zeros(q.shape[2])),
    "alibi-and-mask": lambda q, k, v, s, c, w, n: sum(longflash.attention(
        q, k, v, alibi_slopes=torch.ones(shape), attn_mask=torch.ones(1, 1, 1, k.shape[1],
                                                                      dtype=torch.bool),
        backend="torch") for shape in ((q.shape[2],), (q.shape[0], q.shape[2]))),
    "varlen": lambda q, k, v, s, c, w, n: longflash.attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), *[torch.tensor(
            [0, n, x.shape[0] * x.shape[1]], dtype=torch.int32) for x in (q, k)], q.shape[1] * 2,
        k.shape[1] * 2, softmax_scale=s, causal=True, backend="torch"),
    "sdpa": lambda q, k, v, s, c, w, n: longflash.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
        v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True, scale=s),
    "kvcache-float8": lambda q, k, v, s, c, w, n: longflash.attention_with_kvcache(
        q[:, :1].detach(), torch.zeros(q.shape[0], 32, k.shape[2], q.shape[3],
                                       dtype=torch.float8_e4m3fn),
        torch.zeros(q.shape[0], 32, k.shape[2], q.shape[3], dtype=torch.float8_e4m3fn),
        k[:, :1].detach(), v[:, :1].detach(), n, causal=True, softcap=c, k_descale=s,
        v_descale=torch.full((1, k.shape[2]), s), backend="torch"),
}


@pytest.mark.parametrize("call", DYNAMIC_CALLS)
def test_compile_fullgraph_dynamic(call):
    """torch.compile(fullgraph=True, dynamic=True): the options' floats and ints, and every
    size, are symbolic there (so are defaults); the argument checks compare them (no
    math.isfinite, no `in` over sizes, which Dynamo cannot or does not guard) and the graph
    gives eager's values and gradients at two sequence lengths."""
    torch._dynamo.reset()
    fn = DYNAMIC_CALLS[call]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for nq, nk in ((9, 11), (13, 17)):
        q, k, v = (x.requires_grad_() for x in qkv(nq=nq, nk=nk))
        args = (q, k, v, 0.3, 5.0, 4, 7)
        out, out_c = fn(*args), compiled(*args)
        torch.testing.assert_close(out_c, out)
        if out.requires_grad:
            for g, g_c in zip(torch.autograd.grad(out.square().sum(), (q, k, v)),
                              torch.autograd.grad(out_c.square().sum(), (q, k, v))):
                torch.testing.assert_close(g_c, g)


def test_compile_fullgraph_one_tensor_as_q_k_and_v():
    """attention(x, x, x) under torch.compile: Dynamo refuses an autograd.Function given one
    tensor as two inputs, so the call passes k and v as aliases of their own there."""
    torch._dynamo.reset()
    x = torch.randn(2, 19, 2, 16, requires_grad=True)

    def fn(x):
        return longflash.attention(x, x, x, causal=True, backend="torch").square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), fn(x))
    torch.testing.assert_close(torch.autograd.grad(compiled(x), x)[0],
                               torch.autograd.grad(fn(x), x)[0])


@pytest.mark.parametrize("used", ["o", "lse"])
def test_gradient_of_one_output_alone(used):
    """An unused output's gradient reaches the backward as None (no zeros materialized): the
    gradients equal those of the same loss through the float64 reference, eager and under
    torch.compile(fullgraph=True)."""
    q, k, v = (x.double().requires_grad_() for x in qkv())

    def loss(q, k, v, fn):
        o, lse = fn(q, k, v)
        return o.square().sum() if used == "o" else lse.sum()

    def ours(q, k, v):
        return longflash.attention(q.float(), k.float(), v.float(), causal=True,
                                   return_lse=True, backend="torch")

    def ref(q, k, v):
        return attention_ref(q, k, v, causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: loss(q, k, v, ours), fullgraph=True,
                             backend="aot_eager")
    # lse does not depend on v: the reference's graph leaves v out (a zero gradient)
    want = torch.autograd.grad(loss(q, k, v, ref), (q, k, v), allow_unused=True)
    want = [torch.zeros_like(x) if w is None else w for x, w in zip((q, k, v), want)]
    seen = []
    backward_op = interface._backward_op

    def spy(do, q, k, v, o, lse, dlse, *args):
        seen.append(dlse)
        return backward_op(do, q, k, v, o, lse, dlse, *args)

    with mock.patch.object(interface, "_backward_op", spy):
        eager = torch.autograd.grad(loss(q, k, v, ours), (q, k, v))
    assert (seen[0] is None) == (used == "o")  # lse unused: no zero dlse to subtract
    for got in (eager, torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4)


def test_double_backward_is_a_clear_error():
    """The backward is differentiable once: a second derivative raises, never a silent zero."""
    q = torch.randn(1, 9, 2, 16, requires_grad=True)
    o = longflash.attention(q, q, q, backend="torch")
    (g,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


@pytest.mark.parametrize("op", ["attention_forward", "attention_backward"])
@pytest.mark.parametrize("masked", [False, True], ids=["", "attn_mask"])
def test_opcheck(op, masked):
    """torch.library's own consistency checks of the ops' registration (schema, fake against
    real, torch.compile's tracing). The ops carry no autograd (longflash.attention's
    autograd.Function does): their inputs need no gradient."""
    q, k, v = qkv()
    mask = torch.rand(q.shape[0], 1, q.shape[1], k.shape[1]) > 0.3 if masked else None
    o, lse = longflash.attention(q, k, v, causal=True, return_lse=True, backend="torch",
                                 attn_mask=mask)
    args = (q, k, v, True, 0.25, "torch") if op == "attention_forward" else \
        (torch.randn_like(o), q, k, v, o, lse, None, True, 0.25, "torch")
    kwargs = {"attn_mask": mask} if masked else {}
    torch.library.opcheck(getattr(torch.ops.longflash, op).default, args, kwargs)


def test_compile_fullgraph_variants_and_varlen():
    """Window, ALiBi, softcap, dropout (seeded), an attn_mask and packed sequences inside one
    graph."""
    torch._dynamo.reset()
    slopes = torch.rand(4)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    mask = torch.rand(1, 1, 12, 12, generator=torch.Generator().manual_seed(1)) > 0.3

    def fn(q, k, v):
        o = longflash.attention(q[None], k[None], v[None], causal=True, window_size=(4, -1),
                                alibi_slopes=slopes, softcap=2.0, dropout_p=0.1, seed=3,
                                backend="torch", attn_mask=mask)
        o2 = longflash.attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, backend="torch")
        return o.sum() + o2.sum()

    q, k, v = (torch.randn(12, 4, 16, requires_grad=True) for _ in range(3))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), fn(q, k, v))
    for g, g_c in zip(torch.autograd.grad(fn(q, k, v), (q, k, v)),
                      torch.autograd.grad(compiled(q, k, v), (q, k, v))):
        torch.testing.assert_close(g_c, g)
