"""attn_mask (PyTorch's: boolean, or float added to the scores, broadcastable to (batch,
nheads, seqlen_q, seqlen_k)) against the float64 reference, forward and gradients, on the
blockwise path and the Triton kernels (interpreter), alone and with the other variants;
the SDPA drop-in against PyTorch's; bad masks."""

import pytest
import torch

import longflash
from longflash import attention_ref
from conftest import INTERPRET, check_with_grads, needs_triton, torch_sdpa
from test_correctness import make_inputs
from test_variants import check_variant, use_tiles


def _mask(kind, shape, dims, seed=5):
    """A mask of `kind` ("bool" or "float") and of shape `dims` (each 1 or the full size of
    (batch, nheads, seqlen_q, seqlen_k), or fewer leading dims) for inputs of `shape`."""
    batch, seqlen_q, seqlen_k, nheads = shape[0], shape[1], shape[2], shape[3]
    full = dict(B=batch, H=nheads, Q=seqlen_q, K=seqlen_k)
    size = [full[d] if d in full else 1 for d in dims]
    gen = torch.Generator().manual_seed(seed)
    if kind == "bool":
        return torch.rand(size, generator=gen) > 0.35
    mask = torch.randn(size, generator=gen) * 2
    return mask.masked_fill(torch.rand(size, generator=gen) > 0.8, float("-inf"))


# (id, shape (B, Nq, Nk, H, Hkv, D), mask kind, mask dims, keyword arguments); mask dims: "B",
# "H", "Q", "K" for a full dimension, "1" for a broadcast one
CASES = [
    ("pad-keys-bool", (2, 37, 53, 4, 2, 16), "bool", "B11K", {}),
    ("bool-every-dim-causal", (2, 41, 41, 2, 1, 16), "bool", "BHQK", dict(causal=True)),
    ("float-2d-window", (1, 45, 61, 2, 1, 16), "float", "QK", dict(window_size=(8, 4))),
    ("float-heads-all", (2, 47, 53, 2, 1, 24), "float", "1HQK",
     dict(causal=True, alibi=(2, 2), softcap=1.0, dropout_p=0.2, seed=7)),
    ("bool-rows-see-nothing", (1, 61, 29, 2, 2, 16), "bool", "1QK", dict(causal=True)),
]
RUNS = [("torch", (16, 32)), ("torch", None)] + ([("triton", None)] if INTERPRET else [])
# The Triton kernels' default tiles run fp16 only (the extra runs below, fp32): the interpreter
# runs the same loops and _bias for both dtypes, and it is CI's slowest part.
# fp32, where the interpreter has them: the TMA tiles with a boolean and a float mask, the
# sweep's trials (their own loops, the same _bias) with the case that has every option
EXTRA_RUNS = {"bool-every-dim-causal": ["tma"], "float-2d-window": ["tma"],
              "float-heads-all": ["split", "atomic", "pipe"]} if INTERPRET else {}
PARAMS = [pytest.param(b, t, d, *c[1:], id=f"{c[0]}-{b}{'-' + t if isinstance(t, str) else ''}"
                       f"{'-' + 'x'.join(map(str, t)) if isinstance(t, tuple) else ''}-{n}")
          for c in CASES for d, n in ((torch.float32, "fp32"), (torch.float16, "fp16"))
          for b, t in RUNS + ([("triton", t) for t in EXTRA_RUNS.get(c[0], [])]
                              if n == "fp32" else [])
          if not (b == "triton" and t is None and n == "fp32")]  # see RUNS


def _case_kwargs(shape, kind, dims, kw):
    mask = _mask(kind, shape, dims)
    if len(dims) >= 3 and dims[-2] == "Q":  # a row that sees no key: o = 0, lse = -inf
        mask[..., 3, :] = False if kind == "bool" else float("-inf")
    return dict(kw, attn_mask=mask)


@pytest.mark.parametrize("backend, tiles, dtype, shape, kind, dims, kw", PARAMS)
def test_attn_mask_against_reference(backend, tiles, dtype, shape, kind, dims, kw, monkeypatch):
    use_tiles(monkeypatch, tiles)
    check_variant(shape, dtype, _case_kwargs(shape, kind, dims, kw), backend)


def test_attn_mask_bfloat16_torch_path():
    shape, kind, dims, kw = CASES[3][1:]
    check_variant(shape, torch.bfloat16, _case_kwargs(shape, kind, dims, kw), "torch")


@needs_triton
def test_attn_mask_through_strides():
    """A transposed (non-contiguous) mask and a broadcast one are read in place: the kernels
    get the mask's own memory with stride 0 on the broadcast dimensions."""
    from longflash import flash_triton
    mask = torch.rand(2, 1, 1, 53) > 0.3
    args = flash_triton._bias_args(mask, 2, 4, 37, 53)
    assert args["BIAS"].data_ptr() == mask.data_ptr() and args["BIAS"].dtype == torch.uint8
    assert (args["stride_bb"], args["stride_bh"], args["stride_bm"], args["stride_bn"]) == \
        (53, 0, 0, 1)
    shape = (1, 29, 31, 2, 1, 16)
    mask_t = torch.randn(1, 2, 31, 29).transpose(-1, -2)  # (1, H, Nq, Nk), strides (.., 1, 29)
    check_variant(shape, torch.float32, dict(attn_mask=mask_t), "triton" if INTERPRET else "torch")


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if INTERPRET else []))
def test_attn_mask_decoding_shape(backend):
    """One query over many keys (the split-KV route of the Triton backend without a mask):
    with a mask, the main kernel runs and the mask holds."""
    q, k, v, _ = make_inputs((1, 1, 1100, 4, 1, 16), torch.float32)
    mask = torch.rand(1, 1, 1, 1100, generator=torch.Generator().manual_seed(1)) > 0.5
    with torch.no_grad():
        o = longflash.attention(q, k, v, backend=backend, attn_mask=mask)
    ref, _ = attention_ref(q.double(), k.double(), v.double(), attn_mask=mask)
    assert (o.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("mask_shape", [(1, 1, 1, 23), (2, 1, 17, 23), (17, 23), (2, 4, 17, 23)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_attn_mask_matches_pytorch(mask_shape, kind):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 17, 16, generator=gen)
    k, v = (torch.randn(2, 2, 23, 16, generator=gen) for _ in range(2))
    mask = torch.rand(mask_shape, generator=gen)
    mask = mask > 0.3 if kind == "bool" else mask.log()  # finite, with large negatives
    if kind == "bool" and mask.shape[-2] > 1:
        mask[..., 3, :] = False  # a row that sees no key: 0 in both
    ours = longflash.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    theirs = torch_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=1e-5)


SLOPES = torch.rand(4, generator=torch.Generator().manual_seed(6)) * 0.5
GRAD_CASES = [("1HQK", dict(causal=True)), ("QK", dict(softcap=1.0, window_size=(9, 3))),
              ("BHQK", dict(alibi_slopes=SLOPES, dropout_p=0.2, seed=3))]


@pytest.mark.parametrize("backend, dtype", [
    pytest.param(b, d, id=f"{n}-{b}") for b in ["torch"] + (["triton"] if INTERPRET else [])
    for d, n in ((torch.float32, "fp32"), (torch.float16, "fp16"))
    if not (b == "triton" and n == "fp32")])  # the kernels fp16 only, as in RUNS
@pytest.mark.parametrize("dims, kw", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_attn_mask_gradient(backend, dtype, dims, kw):
    """A float mask that requires grad gets dL/dmask (the scores' gradient summed over the
    dimensions the mask broadcasts; with the lse's gradient too), against float64 autograd
    through the reference, by the tolerance rule; q, k, v's gradients as well."""
    check_mask_gradient((2, 37, 45, 4, 2, 16), dtype, dims, kw, backend)


def check_mask_gradient(shape, dtype, dims, kw, backend, device="cpu"):
    q, k, v, do = make_inputs(shape, dtype, device=device)
    mask = _mask("float", shape, dims).to(device).requires_grad_()
    dlse = torch.randn(shape[0], shape[3], shape[1],
                       generator=torch.Generator().manual_seed(4)).to(device)
    got = check_with_grads(
        lambda q, k, v, m: longflash.attention(q, k, v, return_lse=True, backend=backend,
                                               attn_mask=m, **kw),
        lambda q, k, v, m, upcast=True: attention_ref(q, k, v, attn_mask=m, upcast=upcast,
                                                      **kw),
        [q, k, v, mask], ("q", "k", "v", "mask"), do, dlse)
    assert got[-1].shape == mask.shape and got[-1].dtype == mask.dtype


q0, k0, v0, _ = make_inputs((2, 9, 11, 4, 2, 16), torch.float32)
BAD = [
    ("int-mask", torch.ones(9, 11, dtype=torch.int32), TypeError),
    ("not-a-tensor", [[True] * 11] * 9, TypeError),
    ("shape", torch.ones(9, 12, dtype=torch.bool), ValueError),
    ("heads", torch.ones(2, 2, 9, 11, dtype=torch.bool), ValueError),
    ("five-dims", torch.ones(1, 2, 4, 9, 11, dtype=torch.bool), ValueError),
]


@pytest.mark.parametrize("mask, exc", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_attn_mask(mask, exc):
    with pytest.raises(exc, match="attn_mask"):
        longflash.attention(q0, k0, v0, attn_mask=mask)


def test_sdpa_attn_mask_with_is_causal_raises():
    q = q0.transpose(1, 2)
    with pytest.raises(ValueError, match="attn_mask"):
        longflash.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(9, 9, dtype=bool),
                                               is_causal=True)


def test_compile_fullgraph_learned_bias():
    """A float mask that requires grad inside torch.compile(fullgraph=True): one graph, and
    the same loss and gradients (q, k, v and the mask's) as eager."""
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 19, 4, 16, generator=gen, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 19, 19, generator=gen, requires_grad=True)

    def fn(q, k, v, bias):
        return longflash.attention(q, k, v, causal=True, backend="torch",
                                   attn_mask=bias).square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    loss, loss_c = fn(q, k, v, bias), compiled(q, k, v, bias)
    torch.testing.assert_close(loss_c, loss)
    for g, g_c in zip(torch.autograd.grad(loss, (q, k, v, bias)),
                      torch.autograd.grad(loss_c, (q, k, v, bias))):
        torch.testing.assert_close(g_c, g)
