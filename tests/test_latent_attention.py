"""longflash.nn.MultiheadLatentAttention: multi-head latent attention (DeepSeek-V2/V3).

Its forward against a direct implementation of the formulas in float64 (each head's key
[W_UK c, k_r], value W_UV c, query [q_nope, q_rope], rotary at the token's position, scale
1/sqrt(nope + rope)), outputs and gradients; generation over its latent cache (a prompt, then
steps of one and of two tokens, in the absorbed form: qv over the latents) against the forward
over the whole sequence, on both backends; a float8 cache within the quantization's effect;
the cache holds the latents and rotary keys and nothing else; errors.
"""

import pytest
import torch

import longflash
from longflash.nn import MultiheadLatentAttention, apply_rotary, rotary_cos_sin
from conftest import INTERPRET

BACKENDS = ["torch"] + (["triton"] if INTERPRET else [])
SMALL = dict(embed_dim=48, num_heads=4, kv_lora_rank=40, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=24)


def make(dtype=torch.float64, backend="torch", seed=0, **kw):
    torch.manual_seed(seed)
    module = MultiheadLatentAttention(**{**SMALL, **kw}, backend=backend, dtype=dtype)
    with torch.no_grad():  # RMSNorm weights away from 1, so that they count
        for m in module.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return module


def direct(module, x):
    """The formulas, head by head, with a materialized softmax (float64)."""
    B, N, _ = x.shape
    H, dn, dr, dv, L = (module.num_heads, module.nope, module.rope, module.v_head_dim,
                        module.kv_lora_rank)
    q = module.q_proj(x).view(B, N, H, dn + dr)
    c, kr = module.kv_down(x).split([L, dr], dim=-1)
    c = module.kv_norm(c)
    cos, sin = rotary_cos_sin(N, dr, module.rotary_base)
    q_rope = apply_rotary(q[..., dn:], cos, sin)
    kr = apply_rotary(kr[:, :, None], cos, sin)[:, :, 0]  # (B, N, dr), one for every head
    w_uk = module.k_up.weight.view(H, dn, L)
    w_uv = module.v_up.weight.view(H, dv, L)
    out = []
    for h in range(H):
        k_h = torch.cat([c @ w_uk[h].T, kr], -1)  # (B, N, dn + dr)
        q_h = torch.cat([q[:, :, h, :dn], q_rope[:, :, h]], -1)
        s = q_h @ k_h.transpose(1, 2) * (dn + dr) ** -0.5
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        out.append(s.softmax(-1) @ (c @ w_uv[h].T))  # (B, N, dv)
    return module.out_proj(torch.stack(out, 2).reshape(B, N, H * dv))


@pytest.mark.parametrize("q_lora_rank", [None, 20], ids=["q-direct", "q-lora"])
def test_forward_is_the_formulas(q_lora_rank):
    module = make(q_lora_rank=q_lora_rank)
    x = torch.randn(2, 13, 48, dtype=torch.float64, requires_grad=True)
    y, want = module(x), direct(module, x)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, *module.parameters()], g)
    wants = torch.autograd.grad(want, [x, *module.parameters()], g)
    for got, expected in zip(grads, wants):
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("backend, dtype, tol", [("torch", torch.float64, 1e-10)]
                         + ([("triton", torch.float32, 2e-5)] if INTERPRET else []),
                         ids=lambda v: str(v).split(".")[-1])
def test_generation_over_the_latent_cache_is_the_forward(backend, dtype, tol):
    """A prompt of 9 tokens, then steps of 1, 1, 2 and 1 tokens over the cache (the absorbed
    form: the cache's rotary keys and latents, qv), each step's output that of the forward
    over the whole sequence at those positions."""
    module = make(dtype, backend)
    x = torch.randn(2, 14, 48, dtype=dtype)
    with torch.no_grad():
        want = module(x)
        cache = module.make_cache(2, 16)
        got, start = [], 0
        for n in (9, 1, 1, 2, 1):
            got.append(module(x[:, start:start + n], kv_cache=cache))
            start += n
    assert cache.seqlen == cache.position == 14
    assert cache.k.shape == (2, 16, 1, 8) and cache.v.shape == (2, 16, 1, 40)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=tol, atol=tol)


def test_the_cache_holds_the_latents_and_rotary_keys():
    """After the prompt: rows 0..n-1 hold each token's normed latent and its rotated key."""
    module = make()
    x = torch.randn(1, 5, 48, dtype=torch.float64)
    cache = module.make_cache(1, 8)
    with torch.no_grad():
        module(x, kv_cache=cache)
        c, kr = module.kv_down(x).split([40, 8], dim=-1)
        cos, sin = rotary_cos_sin(5, 8)
        torch.testing.assert_close(cache.v[0, :5, 0], module.kv_norm(c)[0])
        torch.testing.assert_close(cache.k[:, :5], apply_rotary(kr[:, :, None], cos, sin))
    assert not cache.k[:, 5:].any() and not cache.v[:, 5:].any()


def test_float8_cache():
    """A float8_e4m3fn latent cache with per-sequence scales: the steps within the float8
    quantization's effect of the forward (float32)."""
    module = make(torch.float32)
    x = torch.randn(2, 10, 48)
    with torch.no_grad():
        want = module(x)
        cache = module.make_cache(2, 12, dtype=torch.float8_e4m3fn, k_descale=4 / 448,
                                  v_descale=torch.full((2, 1), 4 / 448))
        got = torch.cat([module(x[:, :7], kv_cache=cache), module(x[:, 7:8], kv_cache=cache),
                         module(x[:, 8:], kv_cache=cache)], 1)
    assert cache.v.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(got[:, :7], want[:, :7], rtol=1e-5, atol=1e-6)  # the prompt
    err = (got - want).abs().max().item()
    assert 0 < err < 0.05 * want.abs().max().item(), err


def test_errors():
    with pytest.raises(ValueError, match="qk_rope_head_dim must be even"):
        MultiheadLatentAttention(48, 4, qk_rope_head_dim=7)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive int"):
        MultiheadLatentAttention(48, 4, kv_lora_rank=0)
    with pytest.raises(ValueError, match="attn_impl"):
        MultiheadLatentAttention(48, 4, attn_impl="sdpa")
    with pytest.raises(ValueError, match="at most 512"):
        make(kv_lora_rank=520).make_cache(1, 4)
    with pytest.raises(NotImplementedError, match="kv_cache needs attn_impl 'longflash'"):
        m = make(attn_impl="standard")
        m(torch.randn(1, 2, 48, dtype=torch.float64), kv_cache=m.make_cache(1, 4))


def test_standard_is_the_reference_path():
    module, ref = make(), make(attn_impl="standard")
    x = torch.randn(1, 7, 48, dtype=torch.float64)
    torch.testing.assert_close(module(x), ref(x), rtol=1e-10, atol=1e-12)
    assert isinstance(longflash.nn.MultiheadLatentAttention(48, 4), torch.nn.Module)


def test_compiles_fullgraph():
    """torch.compile(fullgraph=True) (aot_eager) of the module: training's forward and backward
    and the decoding steps over its cache, as eager computes them."""
    torch._dynamo.reset()
    module = make(torch.float32)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 9, 48, requires_grad=True)
    y, want = compiled(x), module(x)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0],
                               torch.autograd.grad(want.sum(), x)[0], rtol=1e-6, atol=1e-6)
    caches = [module.make_cache(2, 16) for _ in range(2)]
    with torch.no_grad():
        for step in (x[:, :6], x[:, 6:7], x[:, 7:9], x[:, 8:9]):
            torch.testing.assert_close(compiled(step, kv_cache=caches[0]),
                                       module(step, kv_cache=caches[1]), rtol=1e-6, atol=1e-6)
