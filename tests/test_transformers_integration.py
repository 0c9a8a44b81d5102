"""LongFlash inside Hugging Face transformers models: attn_implementation="LongFlash".

Tiny randomly initialised models, nothing downloaded. For each architecture and padding,
the logits and every parameter gradient of the LongFlash model (float32) are compared by
the project's rule (`check_close`): the low-precision computation that sets the tolerance
is the same model with attn_implementation="eager" in float32; the float64 reference is
the same model with attn_implementation="sdpa" in float64 (eager itself cannot be the
reference: in float64 its additive mask, finfo(float64).min, overflows to -inf on the
fully masked rows of left padding, and their NaN spreads to every position in the next
layer; sdpa's boolean mask does not). Padded positions are left out of the comparison and of the
loss: there eager averages over masked keys and LongFlash gives 0 (see the integration's
docstring); no valid position depends on them.
"""

import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded; make sure of it

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip(
    "transformers", reason="transformers not installed: pip install .[transformers]")

import longflash  # noqa: E402
import longflash.integrations.transformers as lf_hf  # noqa: E402
from conftest import check_close  # noqa: E402

NAME = lf_hf.register(backend="torch")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread is faster, and on a loaded machine intra-op threads
    spend milliseconds per matmul waiting for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64)
CONFIGS = {
    "llama-gqa": lambda: transformers.LlamaConfig(num_key_value_heads=2, **SMALL),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=64, bos_token_id=1, eos_token_id=2,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    # a window shorter than the sequence: the mask is read as a causal sliding window
    "mistral-window4": lambda: transformers.MistralConfig(num_key_value_heads=1, sliding_window=4,
                                                          **SMALL),
    # attention sinks (s_aux) in a sliding-window layer and a full one, and mixture-of-experts
    # layers (their "eager" implementation: the default grouped_mm takes no float64)
    "gpt-oss-sinks": lambda: transformers.GptOssConfig(
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        **dict(SMALL, intermediate_size=64)),
    # multi-head latent attention: keys of head dim 24 (16 + 8 rotary), values of 16, passed
    # to the attention function as they are (dense MLPs only: first_k_dense_replace)
    "deepseek-v3-mla": lambda: transformers.DeepseekV3Config(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, **SMALL),
    # chunked attention (Llama 4: a layer's tokens attend causally within chunks of 4): found
    # as segments in a prefill (no N x N mask), read from transformers' mask in decoding
    "llama4-chunked": lambda: transformers.Llama4TextConfig(
        num_key_value_heads=2, head_dim=16, attention_chunk_size=4, intermediate_size_mlp=128,
        num_local_experts=2, num_experts_per_tok=1,
        layer_types=["chunked_attention", "full_attention"], **SMALL),
}
# Models without an sdpa implementation: eager in float64 is their reference (gpt-oss's eager
# adds the sink column to every row, so no row's softmax is all -inf; see the module docstring)
REFERENCE_IMPL = {"gpt-oss-sinks": "eager"}


def make_models(arch, dtypes=(torch.float64, torch.float32, torch.float32), impls=None):
    """The same random weights under each (dtype, attn_implementation); impls default: the
    reference (sdpa), eager, LongFlash. Each model gets its own config object: a model writes
    its attention implementation into its config. Attention sinks are drawn on the scale of
    the scores (their default initialization is near 0)."""
    impls = impls or (REFERENCE_IMPL.get(arch, "sdpa"), "eager", NAME)
    torch.manual_seed(0)
    models = []
    for dtype, impl in zip(dtypes, impls):
        model = transformers.AutoModelForCausalLM.from_config(
            CONFIGS[arch](), attn_implementation=impl, dtype=dtype,
            **({"experts_implementation": "eager"} if "gpt-oss" in arch else {}))
        assert model.config._attn_implementation == impl
        if models:
            model.load_state_dict(models[0].state_dict())
        else:
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(getattr(module, "sinks", None), torch.Tensor):
                        module.sinks.normal_(0.0, 2.0)
        models.append(model.eval())
    return models


def make_batch(padding, batch=3, seqlen=13):
    """input_ids (batch, seqlen), attention_mask (or None) and position_ids."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 100, (batch, seqlen), generator=gen)
    if padding == "none":
        return input_ids, None, None
    lengths = [seqlen, seqlen - 4, 4][:batch]
    mask = torch.zeros(batch, seqlen, dtype=torch.long)
    for b, n in enumerate(lengths):
        if padding == "left":
            mask[b, seqlen - n:] = 1
        else:
            mask[b, :n] = 1
    input_ids = input_ids.masked_fill(mask == 0, 0)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() derives them
    return input_ids, mask, position_ids


def logits_and_grads(model, input_ids, mask, position_ids, weight, valid, **kwargs):
    model.zero_grad()
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                   **kwargs).logits
    loss = (logits * weight.to(logits.dtype) * valid[..., None]).sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach()[valid], grads


CASES = [(arch, padding) for arch in CONFIGS for padding in ("none", "left", "right")]


@pytest.mark.parametrize("arch, padding", CASES, ids=[f"{a}-{p}" for a, p in CASES])
def test_matches_eager(arch, padding):
    ref64, eager32, longflash32 = make_models(arch)
    input_ids, mask, position_ids = make_batch(padding)
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    weight = torch.randn(*input_ids.shape, 100, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)
    ref, ref_grads = logits_and_grads(ref64, input_ids, mask, position_ids, weight, valid)
    low, low_grads = logits_and_grads(eager32, input_ids, mask, position_ids, weight, valid)
    out, out_grads = logits_and_grads(longflash32, input_ids, mask, position_ids, weight, valid)
    check_close(f"{arch}-{padding} logits", out, low, ref)
    assert out_grads.keys() == ref_grads.keys() and len(ref_grads) > 10
    assert all(name in ref_grads for name in longflash32.state_dict() if name.endswith("sinks"))
    for name in ref_grads:
        check_close(f"d {name}", out_grads[name], low_grads[name], ref_grads[name])


def test_triton_backend_left_padding():
    """The same comparison through backend="auto": the Triton kernels (interpreted on CPU)."""
    try:
        lf_hf.register(backend="auto")
        test_matches_eager("llama-gqa", "left")
    finally:
        lf_hf.register(backend="torch")


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt-oss-sinks", "deepseek-v3-mla",
                                  "llama4-chunked"])
def test_generate_left_padding_with_cache(arch):
    """Greedy decoding with a KV cache: prefill on a left-padded batch, then one query per
    step (query offset from the cache); tokens and step logits equal eager's (float32)."""
    eager, longflash = make_models(arch, (torch.float32,) * 2, ("eager", NAME))
    input_ids, mask, _ = make_batch("left", seqlen=9)
    runs = [m.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=5,
                       do_sample=False, pad_token_id=0, output_logits=True,
                       return_dict_in_generate=True) for m in (eager, longflash)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for ref, out in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


COMPILED = [("llama-gqa", "left"), ("llama-gqa", "right"), ("mistral-window4", "left"),
            ("deepseek-v3-mla", "right")]


@pytest.mark.parametrize("arch, padding", COMPILED, ids=[f"{a}-{p}" for a, p in COMPILED])
def test_compiled_fullgraph_with_padding(arch, padding):
    """torch.compile(model, fullgraph=True): with padding and sliding windows the eager plans
    pack the valid tokens (data-dependent sizes, which a graph cannot hold), so there the
    kernels read the mask instead (the valid keys beside causal, or transformers' own mask),
    padding queries zeroed as packed: logits and gradients equal LongFlash's eager ones."""
    (model,) = make_models(arch, (torch.float32,), (NAME,))
    input_ids, mask, position_ids = make_batch(padding)
    valid = mask.bool()
    weight = torch.randn(*input_ids.shape, 100, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out, grads = logits_and_grads(model, input_ids, mask, position_ids, weight, valid)
    out_c, grads_c = logits_and_grads(compiled, input_ids, mask, position_ids, weight, valid)
    grads_c = {name.removeprefix("_orig_mod."): g for name, g in grads_c.items()}
    torch.testing.assert_close(out_c, out, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads_c[name], grads[name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama-gqa", "mistral-window4"])
def test_generate_compiled_with_a_static_cache(arch):
    """generate(cache_implementation="static") builds each step's masks before the forward
    and passes them in (the mask function's PaddingMask and SegmentMask come back to it, and
    to a compiled forward made outside its graph): a forward compiled with fullgraph=True
    picks eager's tokens from a left-padded batch."""
    (model,) = make_models(arch, (torch.float32,), (NAME,))
    input_ids, mask, _ = make_batch("left", seqlen=9)
    options = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    eager = model.generate(input_ids=input_ids, **options)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    static = model.generate(input_ids=input_ids, cache_implementation="static", **options)
    assert torch.equal(static, eager)


def test_4d_padding_mask_is_read_exactly():
    """A user's additive 4D mask (0 / dtype min) equal to causal x left padding is accepted."""
    ref64, eager32, longflash32 = make_models("llama-gqa")
    input_ids, mask, position_ids = make_batch("left")
    seqlen = input_ids.shape[1]
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    allowed = causal & mask.bool()[:, None, :]  # (B, Nq, Nk)
    valid = mask.bool()
    outs = []
    for model, dtype in ((ref64, torch.float64), (eager32, torch.float32),
                         (longflash32, torch.float32)):
        mask4d = torch.zeros(allowed.shape, dtype=dtype).masked_fill(
            ~allowed, torch.finfo(dtype).min)[:, None]
        outs.append(model(input_ids=input_ids, attention_mask=mask4d,
                          position_ids=position_ids).logits.detach()[valid])
    check_close("4D mask logits", outs[2], outs[1], outs[0])


def _pattern_and_bias(batch=2, seqlen=8):
    """Additive 4D masks (a user's 4D mask goes to eager as it is, which adds it): a pattern
    that is not padding x causal / full / window (every row sees key 0 and itself; 0 / the
    dtype's minimum), and a real-valued bias on a causal mask (a float mask that is not a
    mask)."""
    pattern = torch.eye(seqlen, dtype=torch.bool)
    pattern[:, 0] = True
    pattern = torch.zeros(batch, 1, seqlen, seqlen).masked_fill(~pattern,
                                                                torch.finfo(torch.float32).min)
    bias = torch.zeros(batch, 1, seqlen, seqlen).masked_fill(
        ~torch.ones(seqlen, seqlen, dtype=torch.bool).tril(), -1e9)
    bias[:, :, :, 0] = -0.5
    return pattern, bias


@pytest.mark.parametrize("case", ["pattern", "bias", "middle-padding", "middle-padding-window"])
def test_masks_beyond_padding_match_eager(case):
    """Masks that are not padding x (full | causal | window) run with the kernels reading them
    as attn_mask: a custom 4D pattern, a float bias, a sliding window over padding between
    valid tokens (the window counts the padding: not a window over the packed tokens); and a
    causal 2D padding mask with padding between valid tokens (packed: varlen). The logits of
    the valid positions equal eager's (float32). (Packed sequences from position_ids, and
    windows with left or right padding: test_segments_match_sdpa.)"""
    arch = "mistral-window4" if case == "middle-padding-window" else "llama-gqa"
    eager, longflash = make_models(arch, (torch.float32,) * 2, ("eager", NAME))
    input_ids, mask, _ = make_batch("none", batch=2, seqlen=8)
    kwargs = dict(input_ids=input_ids)
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    if case in ("pattern", "bias"):
        kwargs["attention_mask"] = _pattern_and_bias()[case == "bias"]
    else:
        mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 1], [0, 1, 1, 1, 1, 1, 1, 1]])
        kwargs["attention_mask"] = mask
        valid = mask.bool()
    ref, out = (model(**kwargs).logits.detach()[valid] for model in (eager, longflash))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _padded(*rows):
    """(position_ids, attention_mask) of a padded batch: rows of 0/1 (0: padding)."""
    mask = torch.tensor(rows)
    return (mask.cumsum(-1) - 1).clamp(min=0), mask


SEGMENTS = {  # arch, position_ids, attention_mask: transformers' masks that are segments
    # position_ids that restart: sequences packed in a row (padding-free batches)
    "llama-gqa-packed": ("llama-gqa", torch.tensor(
        [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2]]), None),
    # segments longer and shorter than the window of 4, one row a single sequence
    "mistral-window4-packed": ("mistral-window4", torch.tensor(
        [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2], list(range(13))]), None),
    # values' head dim 16, keys' 24; a sequence of one token
    "deepseek-v3-mla-packed": ("deepseek-v3-mla", torch.tensor(
        [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6], [0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]), None),
    # a sliding window with padding: batched prefill (left) and training batches (right)
    "mistral-window4-left": ("mistral-window4", *_padded([0] * 3 + [1] * 10, [0] * 11 + [1] * 2)),
    "mistral-window4-right": ("mistral-window4", *_padded([1] * 6 + [0] * 7, [1] * 13)),
}


@pytest.mark.parametrize("case", list(SEGMENTS))
def test_segments_match_sdpa(case, monkeypatch):
    """Masks that are segments run as the segments of attention_varlen over the tokens that
    are not padding, the mask read a few rows at a time and never built whole: packed
    sequences (position_ids that restart, no attention_mask: transformers' padding-free
    batches) and sliding windows with padding. Logits and every parameter gradient of the
    valid positions against sdpa in float64 (eager in float32 the low precision). The mask
    is read 2 rows at a time here (chunk edges inside segments); every mask the model asks
    for is a SegmentMask, and the kernels get the sequences' boundaries."""
    from transformers import masking_utils
    rows, masks, varlen = [], [], []

    def sdpa_mask(**kwargs):
        rows.append(kwargs["q_length"])
        return sdpa_mask_(**kwargs)

    def mask_spy(**kwargs):
        masks.append(lf_hf.longflash_mask(**kwargs))
        return masks[-1]

    def varlen_spy(q, k, v, cu_seqlens_q, *args, **kwargs):
        varlen.append(cu_seqlens_q.tolist())
        return varlen_(q, k, v, cu_seqlens_q, *args, **kwargs)

    sdpa_mask_, varlen_ = masking_utils.sdpa_mask, lf_hf.attention_varlen
    monkeypatch.setattr(lf_hf, "MASK_CHUNK_ELEMENTS", 2 * 2 * 13)
    arch, position_ids, mask = SEGMENTS[case]
    ref64, eager32, longflash32 = make_models(arch)
    input_ids = torch.randint(1, 100, position_ids.shape, generator=torch.Generator().manual_seed(1))
    valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
    weight = torch.randn(*input_ids.shape, 100, generator=torch.Generator().manual_seed(2),
                         dtype=torch.float64)
    # (no cache: transformers looks for packed sequences only then, as in training)
    run = lambda model: logits_and_grads(model, input_ids, mask, position_ids, weight,  # noqa: E731
                                         valid, use_cache=False)
    ref, ref_grads = run(ref64)
    low, low_grads = run(eager32)
    monkeypatch.setattr(masking_utils, "sdpa_mask", sdpa_mask)
    monkeypatch.setattr(lf_hf, "attention_varlen", varlen_spy)
    from transformers.masking_utils import AttentionMaskInterface
    AttentionMaskInterface.register(NAME, mask_spy)
    try:
        out, out_grads = run(longflash32)
    finally:
        AttentionMaskInterface.register(NAME, lf_hf.longflash_mask)
    check_close(f"{case} logits", out, low, ref)
    for name in ref_grads:
        check_close(f"d {name}", out_grads[name], low_grads[name], ref_grads[name])
    assert masks and all(isinstance(m, lf_hf.SegmentMask) for m in masks), masks
    assert rows and max(rows) == 2  # the mask read 2 rows at a time, never whole
    starts = (position_ids[valid] == 0).nonzero().squeeze(1).tolist()  # over the packed tokens
    assert varlen and all(c == starts + [int(valid.sum())] for c in varlen), varlen


def test_llama4_chunked_attention_runs_as_segments():
    """Llama 4's chunked layers in a prefill: transformers' chunked mask is found to be causal
    attention within each chunk of 4 (a SegmentMask with the chunks' boundaries, the mask read
    a few rows at a time), so no (seqlen x seqlen) mask is built; the full layers' mask stays
    padding-only. (Their logits: test_matches_eager, decoding: the generate test.)"""
    from transformers.masking_utils import AttentionMaskInterface
    model = make_models("llama4-chunked", (torch.float32,), (NAME,))[0]
    masks = []

    def mask_spy(**kwargs):
        masks.append(lf_hf.longflash_mask(**kwargs))
        return masks[-1]
    AttentionMaskInterface.register(NAME, mask_spy)
    try:
        model(input_ids=torch.randint(1, 100, (2, 13)), use_cache=False)
    finally:
        AttentionMaskInterface.register(NAME, lf_hf.longflash_mask)
    segments = [m for m in masks if isinstance(m, lf_hf.SegmentMask)]
    assert len(segments) == 1 and segments[0].causal and segments[0].window_left == -1
    assert segments[0].cu_seqlens.tolist() == [0, 4, 8, 12, 13, 17, 21, 25, 26]
    assert all(isinstance(m, lf_hf.PaddingMask) for m in masks if m is not segments[0])


def _mask_from_runs(first, last):
    """A transformers mask function (index tensors broadcast) whose row i of batch b sees the
    keys first[b, i] .. last[b, i]."""
    return lambda b, h, q, kv: (kv >= first[b, q]) & (kv <= last[b, q])


def _segment_runs(lengths, causal, window_left):
    """(first, last) key of each query of one row of segments of the given lengths."""
    first, last, start = [], [], 0
    for n in lengths:
        for i in range(start, start + n):
            lo = start if window_left < 0 else max(start, i - window_left)
            first.append(lo if causal else start)
            last.append(i if causal else start + n - 1)
        start += n
    return first, last


SEGMENT_CASES = [  # (segment lengths of each row, causal, window_left, padding)
    ([[3, 1, 5], [9]], True, -1, None),
    ([[4, 5], [2, 2, 2, 3]], True, 2, None),   # the window binds in the longer segments
    ([[1] * 9, [9]], True, 0, None),           # a window of one key: every query alone (found
                                               # as segments of one token, no window)
    ([[3, 6], [9]], False, -1, None),          # full attention within each segment
    ([[9], [9]], True, -1, None),              # plain causal (one segment a row)
    # padding (left, right) in each row: the segments lie on the other tokens
    ([[2, 5], [4]], True, 2, ((2, 0), (0, 5))),
    ([[7], [6]], True, 3, ((2, 0), (3, 0))),   # left-padded prefill with a sliding window
    ([[3, 3], [1, 5]], False, -1, ((1, 2), (3, 0))),
    ([[], [9]], True, -1, ((9, 0), (0, 0))),   # a row of padding only
]


@pytest.mark.parametrize("lengths, causal, window_left, padding", SEGMENT_CASES)
def test_segments_found_exactly(lengths, causal, window_left, padding):
    """_segments on masks built from segment layouts: the plan found gives back transformers'
    mask exactly on the tokens that are not padding (SegmentMask.dense against sdpa_mask's
    whole mask; padding queries, which here see every real key, see none in the plan), and
    its cu_seqlens (over the packed real tokens), causal flag and window are the layout's (a
    window that never binds is unbounded)."""
    from transformers import masking_utils
    first, last, valid = [], [], []
    for row, (left, right) in zip(lengths, padding or [(0, 0)] * 2):
        f, lst = _segment_runs(row, causal, window_left)
        first.append([0] * left + [x + left for x in f] + [0] * right)
        last.append([8] * left + [x + left for x in lst] + [8] * right)
        valid.append([0] * left + [1] * sum(row) + [0] * right)
    first, last, valid = torch.tensor(first), torch.tensor(last), torch.tensor(valid).bool()
    kwargs = dict(batch_size=2, q_length=9, kv_length=9, q_offset=0, kv_offset=0,
                  mask_function=_mask_from_runs(first, last),
                  attention_mask=None if padding is None else valid,
                  allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    mask = lf_hf._segments(kwargs)
    assert isinstance(mask, lf_hf.SegmentMask) and mask.padded == (padding is not None)
    dense, expected = mask.dense()[:, 0], masking_utils.sdpa_mask(**kwargs)[:, 0]
    assert torch.equal(dense[valid], expected[valid]) and not dense[~valid].any()
    if causal and window_left == 0:
        lengths, window_left = [[1] * 9] * 2, -1
    starts = [0]
    for n in sum(lengths, []):
        starts.append(starts[-1] + n)
    assert mask.cu_seqlens.tolist() == starts and mask.causal == causal
    binds = causal and window_left >= 0 and any(n > window_left + 1 for n in sum(lengths, []))
    assert mask.window_left == (window_left if binds else -1)


@pytest.mark.parametrize("case", ["two-runs", "empty-row", "middle-padding-window",
                                  "two-windows", "full-short-row", "cache"])
def test_segments_refuse_other_masks(case):
    """Masks that are not segments of causal / windowed / full attention give None (the mask is
    then built whole and read by the kernels): a row that sees two runs of keys (from the
    first key and up to the last that causal attention gives it), a token (not padding) that
    sees none, a window that counts padding between tokens, two different windows, full
    attention with one row that stops short, queries that are not the keys (a KV cache)."""
    first, last = _segment_runs([9], True, -1)
    first, last = torch.tensor([first] * 2), torch.tensor([last] * 2)
    fn, extra = _mask_from_runs(first, last), {}
    if case == "two-runs":  # query 4 of row 0 sees keys 0, 1, 3 and 4, not 2
        fn = lambda b, h, q, kv: (_mask_from_runs(first, last)(b, h, q, kv)  # noqa: E731
                                  & ~((b == 0) & (q == 4) & (kv == 2)))
    elif case == "empty-row":  # query 4 of row 0 sees no key
        fn = lambda b, h, q, kv: (_mask_from_runs(first, last)(b, h, q, kv)  # noqa: E731
                                  & ~((b == 0) & (q == 4)))
    elif case == "middle-padding-window":  # packed, query 4 sees 1, 3, 4 and 7 sees 4, 7
        from transformers import masking_utils
        fn = masking_utils.sliding_window_causal_mask_function(4)
        extra["attention_mask"] = torch.tensor([[1, 1, 0, 1, 1, 0, 0, 1, 1], [1] * 9])
    elif case == "two-windows":
        first[0] = torch.tensor(_segment_runs([9], True, 2)[0])
        first[1] = torch.tensor(_segment_runs([9], True, 3)[0])
    elif case == "full-short-row":
        first, last = (torch.tensor([r] * 2) for r in _segment_runs([9], False, -1))
        last[1, 3] = 5  # query 3 of row 1 sees keys 0..5, the others 0..8
        fn = _mask_from_runs(first, last)
    else:
        extra.update(q_length=3, q_offset=6)
    kwargs = dict(batch_size=2, q_length=9, kv_length=9, q_offset=0, kv_offset=0,
                  mask_function=fn, attention_mask=None, allow_is_causal_skip=False,
                  allow_is_bidirectional_skip=False)
    assert lf_hf._segments(dict(kwargs, **extra)) is None


def test_t5_relative_position_bias(monkeypatch):
    """T5 (encoder-decoder) passes its learned relative position bias as position_bias: it runs
    as a float attn_mask beside the padding masks (encoder: left and right padding; decoder:
    causal; cross-attention), and its embedding gets its gradient through the kernels'. Logits
    and every parameter gradient against eager in float64 (tolerance rule, eager in float32 as
    the low precision)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        return lf_hf_attention(*args, **kwargs)

    lf_hf_attention = lf_hf.attention
    monkeypatch.setattr(lf_hf, "attention", spy)
    config = lambda: transformers.T5Config(  # noqa: E731
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0)
    torch.manual_seed(0)
    models = []
    for dtype, impl in ((torch.float64, "eager"), (torch.float32, "eager"), (torch.float32, NAME)):
        model = transformers.T5ForConditionalGeneration._from_config(
            config(), attn_implementation=impl, dtype=dtype)
        if models:
            model.load_state_dict(models[0].state_dict())
        models.append(model.eval())
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 100, (3, 11), generator=gen)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:], mask[2, :3] = 0, 0
    decoder_ids = torch.randint(1, 100, (3, 6), generator=gen)
    results = []
    for model in models:
        model.zero_grad()
        logits = model(input_ids=input_ids, attention_mask=mask,
                       decoder_input_ids=decoder_ids).logits
        logits.square().sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref, ref_grads), (low, low_grads), (out, out_grads) = results
    check_close("t5 logits", out, low, ref)
    assert any(m is not None and m.requires_grad for m in calls)  # the bias, with its gradient
    for name in ref_grads:
        check_close(f"d {name}", out_grads[name], low_grads[name], ref_grads[name])


def test_t5_compiled_fullgraph_with_padding():
    """T5 under torch.compile(fullgraph=True) with padded encoder and decoder inputs: the
    position bias beside a causal padding mask, whose plan there is the valid keys beside
    causal, keeps causal (it was dropped once: the bias replaced the plan's mask); the valid
    positions' logits equal eager LongFlash's."""
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration._from_config(
        config, attn_implementation=NAME).eval()
    gen = torch.Generator().manual_seed(1)
    inputs = dict(input_ids=torch.randint(1, 100, (3, 11), generator=gen),
                  attention_mask=torch.ones(3, 11, dtype=torch.long),
                  decoder_input_ids=torch.randint(1, 100, (3, 6), generator=gen),
                  decoder_attention_mask=torch.ones(3, 6, dtype=torch.long),
                  use_cache=False)  # transformers 5.17 makes a cache by copy.deepcopy there
    inputs["attention_mask"][1, 7:], inputs["attention_mask"][2, :3] = 0, 0
    inputs["decoder_attention_mask"][1, 4:], inputs["decoder_attention_mask"][2, :2] = 0, 0
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**inputs).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(**inputs).logits
    valid = inputs["decoder_attention_mask"].bool()
    torch.testing.assert_close(compiled[valid], eager[valid], rtol=1e-5, atol=1e-5)


def test_causal_padding_mask_with_keys_after_the_queries():
    """A causal PaddingMask whose valid keys go on past the queries (queries at key positions
    2..5 of 10) is no packed bottom-right problem: it runs on the dense mask transformers
    means, query i seeing the keys up to position 2 + i, against the float64 reference."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 4, 16, generator=gen, dtype=torch.float64)  # (B, H, Nq, D)
    k, v = (torch.randn(2, 2, 10, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    valid_k = torch.ones(2, 10, dtype=torch.bool)
    valid_k[1, 7] = False
    mask = lf_hf.PaddingMask(valid_k=valid_k, causal=True, q_offset=2)
    assert lf_hf._plan_padding(mask, 2, 4, 10, q.device)[4].shape == (2, 1, 4, 10)  # dense
    out, _ = lf_hf.longflash_attention_forward(None, q, k, v, mask)
    allowed = valid_k[:, None, None, :] & (torch.arange(10) <= torch.arange(2, 6)[:, None])
    ref, _ = longflash.attention_ref(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=allowed)
    torch.testing.assert_close(out, ref)


def test_unsupported_masks_raise():
    """A dense mask the attention function cannot read: another shape, an integer dtype."""
    q = torch.randn(2, 4, 8, 16)
    k = v = torch.randn(2, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="a mask of shape"):
        lf_hf.longflash_attention_forward(None, q, k, v, torch.ones(2, 8, 8, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dtype"):
        lf_hf.longflash_attention_forward(None, q, k, v,
                                          torch.ones(2, 1, 8, 8, dtype=torch.int32))


def test_register_rejects_flash_names():
    with pytest.raises(ValueError, match="flash"):
        lf_hf.register(name="longflash")
    with pytest.raises(ValueError, match="backend"):
        lf_hf.register(backend="cuda")


def test_import_longflash_does_not_import_transformers():
    code = ("import sys, longflash, longflash.integrations, longflash.integrations.transformers;"
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("padding", ["none", "left"])
def test_generate_with_cache_uses_split_kv(padding, monkeypatch):
    """Cached greedy generation through backend="auto" (the Triton kernels, interpreted on a
    CPU) with the decoding route on from 8 keys: the steps after the prefill run on the
    split-KV kernel (attention without padding, attention_varlen with it), and the tokens
    and step logits equal eager's (float32)."""
    from longflash import interface, kvcache
    if not interface._TRITON_INTERPRET and not torch.cuda.is_available():
        pytest.skip("the decoding route is on the Triton backend")
    monkeypatch.setattr(interface, "SPLIT_KV_MIN_SEQLEN_K", 8)
    calls = []
    original = kvcache._forward
    monkeypatch.setattr(kvcache, "_forward",
                        lambda *a, **kw: calls.append(1) or original(*a, **kw))
    eager, longflash = make_models("llama-gqa", (torch.float32,) * 2, ("eager", NAME))
    input_ids, mask, _ = make_batch(padding, batch=2, seqlen=17)  # prefill: 17 > 16 queries
    try:
        lf_hf.register(backend="auto")
        runs = [m.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=4,
                           do_sample=False, pad_token_id=0, output_logits=True,
                           return_dict_in_generate=True) for m in (eager, longflash)]
    finally:
        lf_hf.register(backend="torch")
    assert len(calls) == 3 * 2  # 3 decoding steps x 2 layers
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for ref, out in zip(runs[0].logits, runs[1].logits):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
