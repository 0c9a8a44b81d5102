"""Decoding over a KV cache sharded across gloo ranks (longflash.parallel.
attention_with_sharded_kvcache) against the float64 reference over the whole cache.

Each world size is spawned once: every rank builds the same full inputs, keeps its part of
each sequence's cache (parts of different lengths, some empty, the slots past them NaN so
that a key read past its part fails), and the ranks' outputs, lse and caches after the call
come back to the parent, where they are compared with attention over the concatenation of
the parts and the new tokens (the tolerance rule of ARCHITECTURE.md, `check_close`).
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from conftest import check_close, errors_raised, needs_triton
from experiments.scaling import spawn_ranks
from longflash import _common, attention_ref
from longflash.kvcache import quantize
from longflash.parallel import attention_with_sharded_kvcache

WORLD_SIZES = [1, 2, 4]


@dataclass(frozen=True)
class Case:
    seqlen_q: int = 1
    new: bool = True             # k, v of the new tokens given (seqlen_new = seqlen_q)
    causal: bool = True
    nheads: int = 4
    nheads_kv: int = 2
    headdim: int = 24
    dtype: torch.dtype = torch.float32
    append_last: bool = False    # append_rank P - 1 (else 0)
    softcap: float = 0.0
    sink: bool = False
    int_seqlens: bool = False    # every sequence of a rank as long: an int cache_seqlens
    paged: bool = False          # each rank's part in pages of 4 slots, shuffled
    fp8: bool = False            # float8_e4m3fn caches with per-(batch, head) scales
    window_left: int = -1        # a sliding window over the global sequence, as rank masks
    alibi: bool = False          # ALiBi over the global sequence, as float rank masks
    headdim_v: int = 0           # the values' head dim (0: headdim's)
    qv: bool = False             # MLA absorbed: qv (batch, seqlen_q, nheads, headdim_v)

    @property
    def id(self):
        return (f"Nq{self.seqlen_q}-{'new' if self.new else 'cached'}-"
                f"{'causal' if self.causal else 'full'}-H{self.nheads}/{self.nheads_kv}-"
                f"{str(self.dtype)[6:]}" + ("-last" if self.append_last else "")
                + (f"-softcap{self.softcap:g}" if self.softcap else "")
                + ("-sink" if self.sink else "") + ("-int" if self.int_seqlens else "")
                + ("-paged" if self.paged else "") + ("-fp8" if self.fp8 else "")
                + (f"-window{self.window_left}" if self.window_left >= 0 else "")
                + ("-alibi" if self.alibi else "")
                + (f"-dv{self.headdim_v}" if self.headdim_v else "") + ("-qv" if self.qv else ""))

    @property
    def dv(self):
        return self.headdim_v or self.headdim


CASES = [
    Case(),                                                    # a decoding step
    Case(new=False, causal=False, nheads_kv=1),                # no append, MQA
    Case(seqlen_q=3, append_last=True, softcap=2.0, sink=True),  # speculative, causal
    Case(seqlen_q=2, causal=False, nheads_kv=4),               # new tokens all visible
    Case(dtype=torch.bfloat16, nheads=6),
    Case(dtype=torch.float16, seqlen_q=2, int_seqlens=True),
    Case(paged=True, seqlen_q=2),
    Case(fp8=True, append_last=True),
    Case(seqlen_q=2, window_left=6),                           # some ranks' rows see no key
    Case(seqlen_q=3, alibi=True, append_last=True, nheads_kv=4),
    Case(nheads_kv=1, headdim=16, headdim_v=40, qv=True, append_last=True),  # MLA absorbed
]
BATCH, PAGE = 2, 4


def part_lengths(case, world_size):
    """[rank][sequence]: the keys each rank holds of each sequence (0 for some with P > 1)."""
    if case.int_seqlens:
        return [[5 + 3 * r] * BATCH for r in range(world_size)]
    return [[(4 + 5 * r + 7 * b) % 13 if world_size > 1 else 6 + b for b in range(BATCH)]
            for r in range(world_size)]


def full_inputs(case, world_size):
    """q, new k and v (or None), each rank's (k part, v part) at full precision (float32, NaN
    past each part's length), the float8 scales, the sink, qv (or None)."""
    gen = torch.Generator().manual_seed(11)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = rand(BATCH, case.seqlen_q, case.nheads, case.headdim)
    k, v = (rand(BATCH, case.seqlen_q, case.nheads_kv, d) if case.new else None
            for d in (case.headdim, case.dv))
    lengths = part_lengths(case, world_size)
    capacity = -(-(max(max(n) for n in lengths) + case.seqlen_q + 2) // PAGE) * PAGE
    parts = []
    for r in range(world_size):
        kp, vp = (rand(BATCH, capacity, case.nheads_kv, d) for d in (case.headdim, case.dv))
        for b, n in enumerate(lengths[r]):
            kp[b, n:], vp[b, n:] = float("nan"), float("nan")
        parts.append((kp, vp))
    descale = ((rand(BATCH, case.nheads_kv).abs() * 0.05 + 0.01) if case.fp8 else None
               for _ in range(2))
    sink = rand(case.nheads) if case.sink else None
    qv = rand(BATCH, case.seqlen_q, case.nheads, case.dv) if case.qv else None
    return q, k, v, parts, lengths, tuple(descale), sink, qv


SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625])


def rank_mask(case, world_size, rank, capacity):
    """This rank's attn_mask over its part, from global positions (a sequence's parts in rank
    order, then its new tokens, which the queries are): the window as a boolean, ALiBi as a
    float (batch, nheads, seqlen_q, capacity) mask; None for the other cases."""
    if case.window_left < 0 and not case.alibi:
        return None
    lengths = part_lengths(case, world_size)
    append_rank = world_size - 1 if case.append_last else 0
    rows = torch.arange(capacity)
    pos_k, pos_q = [], []
    for b in range(BATCH):
        start = sum(lengths[r][b] for r in range(rank))  # the global position of row 0
        total = sum(lengths[r][b] for r in range(world_size))
        pos = start + rows
        if rank == append_rank:  # the new keys, at the part's end, are the last positions
            n = lengths[rank][b]
            pos = torch.where(rows >= n, total + rows - n, pos)
        pos_k.append(pos)
        pos_q.append(total + torch.arange(case.seqlen_q))
    pos_k, pos_q = torch.stack(pos_k)[:, None, None, :], torch.stack(pos_q)[:, None, :, None]
    if case.alibi:
        return -SLOPES[:case.nheads][None, :, None, None] * (pos_q - pos_k).abs().float()
    return (pos_k >= pos_q - case.window_left) & (pos_k <= pos_q)


def _cache_dtype(case):
    return torch.float8_e4m3fn if case.fp8 else case.dtype


def _rank_call(case, world_size, rank, backend):
    """This rank's call; returns (o, lse, its cache after, in the caller's layout)."""
    q, k, v, parts, lengths, (k_descale, v_descale), sink, qv = full_inputs(case, world_size)
    dt = case.dtype
    q, k, v, qv = (None if x is None else x.to(dt) for x in (q, k, v, qv))
    k_part, v_part = parts[rank]
    if case.fp8:  # NaN past the parts: quantized as NaN, never read
        k_part, v_part = (quantize(x, s, torch.float8_e4m3fn)
                          for x, s in ((k_part, k_descale), (v_part, v_descale)))
    else:
        k_part, v_part = k_part.to(dt), v_part.to(dt)
    block_table = None
    if case.paged:  # pages of PAGE slots, sequence b's pages shuffled over the pool
        pages = k_part.shape[1] // PAGE
        k_part, v_part = (x[:, :pages * PAGE].reshape(BATCH * pages, PAGE, *x.shape[2:])
                          for x in (k_part, v_part))
        order = torch.randperm(BATCH * pages, generator=torch.Generator().manual_seed(rank))
        k_part, v_part = k_part[order].contiguous(), v_part[order].contiguous()
        block_table = torch.argsort(order).view(BATCH, pages).to(torch.int32)
    seqlens = lengths[rank][0] if case.int_seqlens else torch.tensor(lengths[rank])
    append_rank = world_size - 1 if case.append_last else 0
    o, lse = attention_with_sharded_kvcache(
        q, k_part, v_part, k, v, seqlens, block_table=block_table, causal=case.causal,
        softcap=case.softcap, return_lse=True, backend=backend, append_rank=append_rank,
        learnable_sink=sink, attn_mask=rank_mask(case, world_size, rank, parts[rank][0].shape[1]),
        k_descale=k_descale, v_descale=v_descale, qv=qv)
    if case.paged:  # back to (batch, slots, ...) for the parent
        k_part, v_part = (x[block_table.long().flatten()].view(BATCH, -1, *x.shape[2:])
                          for x in (k_part, v_part))
    if case.fp8:  # exactly, as float32: all_gather_object cannot pickle float8 storages
        k_part, v_part = k_part.float(), v_part.float()
    return o, lse, k_part, v_part


def _worker(rank, world_size, cases, backend):
    _common.POISON_OUTPUTS = True
    mine = {case.id: _rank_call(case, world_size, rank, backend) for case in cases}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    errors = [None] * world_size
    dist.all_gather_object(errors, _errors(rank) if world_size == 2 else {})
    return everyone, errors


def reference(case, world_size, dtype):
    """(o, lse) of attention over each sequence's parts, in rank order, then its new keys,
    computed in `dtype` (float64: the reference; the input dtype: the tolerance's yardstick),
    the sink included; float8 parts and new keys as the cache holds them, times the scales."""
    q, k, v, parts, lengths, (k_descale, v_descale), sink, qv = full_inputs(case, world_size)
    low = dtype != torch.float64
    rnd = lambda x: x.to(case.dtype).to(dtype)  # noqa: E731 - rounded to the input dtype
    if case.fp8:
        deq = lambda x, s: quantize(x, s, torch.float8_e4m3fn).to(dtype) * \
            s.to(dtype)[:, None, :, None]  # noqa: E731
    else:
        deq = lambda x, s: rnd(x)  # noqa: E731
    outs, lses = [], []
    for b in range(BATCH):
        keys = [deq(kp, k_descale)[b:b + 1, :lengths[r][b]] for r, (kp, _) in enumerate(parts)]
        values = [deq(vp, v_descale)[b:b + 1, :lengths[r][b]] for r, (_, vp) in enumerate(parts)]
        if case.new:
            keys.append(deq(k, k_descale)[b:b + 1])
            values.append(deq(v, v_descale)[b:b + 1])
        kb, vb = torch.cat(keys, 1), torch.cat(values, 1)
        qb = rnd(q[b:b + 1])
        scale = None
        if qv is not None:  # the absorbed scores: [q, qv] against [keys, values]
            qb, kb = torch.cat([qb, rnd(qv[b:b + 1])], -1), torch.cat([kb, vb], -1)
            scale = (case.headdim + case.dv) ** -0.5
        if kb.shape[1] == 0:
            o = qb.new_zeros(1, case.seqlen_q, case.nheads, case.dv)
            lse = qb.new_full((1, case.nheads, case.seqlen_q), float("-inf"))
        else:
            o, lse = attention_ref(qb, kb, vb, causal=case.causal and case.new,
                                   softmax_scale=scale,
                                   softcap=case.softcap, upcast=not low,
                                   learnable_sink=None if sink is None else sink.to(dtype),
                                   window_size=(case.window_left, -1),
                                   alibi_slopes=SLOPES[:case.nheads] if case.alibi else None)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = spawn_ranks(world_size, _worker, CASES, "torch", timeout_s=120)
        return cache[world_size]
    return get


def check_case(everyone, case, world_size):
    ref = reference(case, world_size, torch.float64)
    low = reference(case, world_size, case.dtype)
    o0, lse0 = everyone[0][case.id][:2]
    check_close(f"{case.id} o", o0, low[0], ref[0])
    check_close(f"{case.id} lse", lse0, low[1].float(), ref[1])
    for rank in range(1, world_size):  # the same result on every rank
        assert torch.equal(everyone[rank][case.id][0], o0)
        assert torch.equal(everyone[rank][case.id][1], lse0)
    # the new keys written on the appending rank only, at its parts' ends; the rest unchanged
    q, k, v, parts, lengths, (k_descale, v_descale), _, _ = full_inputs(case, world_size)
    append_rank = world_size - 1 if case.append_last else 0
    for rank in range(world_size):
        k_after, v_after = everyone[rank][case.id][2:]
        for b in range(BATCH):
            n = lengths[rank][b]
            for name, after, before, new, s in (("k", k_after, parts[rank][0], k, k_descale),
                                                ("v", v_after, parts[rank][1], v, v_descale)):
                expected = before[b].clone()
                if case.new and rank == append_rank:
                    expected[n:n + case.seqlen_q] = new[b]
                if case.fp8:
                    expected = quantize(expected[None], s[b:b + 1], torch.float8_e4m3fn)[0]
                got = after[b, :expected.shape[0]]
                assert torch.equal(got.float().nan_to_num(7.0),
                                   expected.to(got.dtype).float().nan_to_num(7.0)), \
                    f"{case.id}: rank {rank}'s {name} cache of sequence {b}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda p: f"P{p}")
def test_matches_reference(runs, world_size, case):
    check_case(runs(world_size)[0], case, world_size)


TRITON_CASES = [Case(dtype=torch.float16, headdim=16, seqlen_q=2, window_left=6),
                Case(dtype=torch.float32, headdim=16, new=False, causal=False, paged=True)]


@needs_triton
def test_triton_kernels():
    """Two ranks running their parts on the decoding kernel (interpreted on a CPU)."""
    everyone, _ = spawn_ranks(2, _worker, TRITON_CASES, "triton", timeout_s=300)
    for case in TRITON_CASES:
        check_case(everyone, case, 2)


def _errors(rank):
    """The error each bad call raises on this rank: {name: (type name, message)}."""
    q = torch.randn(1, 1, 2, 8)
    cache = torch.randn(1, 6, 2, 8)
    new = torch.randn(1, 1, 2, 8)
    calls = {
        "q_differs": lambda: attention_with_sharded_kvcache(
            torch.randn(1, 1 + rank, 2, 8), cache, cache, cache_seqlens=2, backend="torch"),
        "append_rank_differs": lambda: attention_with_sharded_kvcache(
            q, cache, cache, new, new, 2, append_rank=rank, backend="torch"),
        "qv_differs": lambda: attention_with_sharded_kvcache(
            q, cache, cache, cache_seqlens=2, backend="torch",
            qv=torch.randn(1, 1, 2, 8) if rank else None),
        "append_rank_outside": lambda: attention_with_sharded_kvcache(
            q, cache, cache, new, new, 2, append_rank=2),
        "causal_without_keys": lambda: attention_with_sharded_kvcache(
            torch.randn(1, 2, 2, 8), cache, cache, cache_seqlens=2, causal=True),
        # rank 1's cache has another head dim: its own error there, RuntimeError on rank 0
        "one_rank_fails": lambda: attention_with_sharded_kvcache(
            q, cache[..., :8 - 2 * rank], cache, cache_seqlens=2, backend="torch"),
        "one_rank_no_cache": lambda: attention_with_sharded_kvcache(
            q, cache, None if rank else cache, cache_seqlens=2, backend="torch"),
    }
    return errors_raised(calls)


EXPECTED_ERRORS = {  # name -> (rank 0's, rank 1's): (type, a piece of the message)
    "q_differs": [("ValueError", "q_shape differs across ranks")] * 2,
    "append_rank_differs": [("ValueError", "append_rank differs across ranks")] * 2,
    "qv_differs": [("ValueError", "qv_shape differs across ranks")] * 2,
    "append_rank_outside": [("ValueError", "append_rank must be a rank of the group")] * 2,
    "causal_without_keys": [("NotImplementedError", "needs k and v")] * 2,
    "one_rank_fails": [("RuntimeError", "failed on another rank"),
                       ("ValueError", "k_cache headdim 6 differs")],
    "one_rank_no_cache": [("RuntimeError", "failed on another rank"),
                          ("TypeError", "v_cache must be a torch.Tensor")],
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_error_on_every_rank(runs, name):
    errors = runs(2)[1]
    for rank, (kind, text) in enumerate(EXPECTED_ERRORS[name]):
        assert errors[rank][name] is not None, f"rank {rank} raised nothing for {name}"
        assert errors[rank][name][0] == kind and text in errors[rank][name][1], errors[rank][name]


def test_without_process_group():
    x = torch.randn(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        attention_with_sharded_kvcache(x, x, x)
