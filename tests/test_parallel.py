"""Ring attention (longflash.parallel) on gloo process groups of 1, 2 and 4 CPU ranks.

Each world size is spawned once (a module-scoped fixture): its ranks run every case on
shards of the same full inputs, and rank 0 sends back the unsharded output, lse and
gradients. The comparison with the float64 reference runs here, under the rule of
ARCHITECTURE.md (`check_close`): error at most twice that of standard attention computed in
the input dtype, plus a rounding floor. Errors that must be raised (on every rank) are
collected by the same ranks.
"""

import functools
import itertools
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pandas as pd
import pytest
import torch
import torch.distributed as dist

from conftest import check_close, errors_raised, needs_triton
from experiments.scaling import VARIANTS, project, spawn_ranks
from longflash import _common, attention_ref, attention_varlen_ref
from longflash.parallel import _Ring, _calls, _lane_srcs, _lanes, _rank_chunks, \
    _step_plan, ring_attention, shard_sequence, unshard_sequence
from test_correctness import make_inputs

WORLD_SIZES = [1, 2, 4]


@dataclass(frozen=True)
class Case:
    causal: bool
    layout: str
    nheads: int = 4
    nheads_kv: int = 4
    dtype: torch.dtype = torch.float32
    chunk_q: int = 5       # tokens per chunk: seqlen = chunk * (2P zigzag, P contiguous)
    chunk_k: int = 5
    headdim: int = 24
    with_lse_grad: bool = False  # the loss also has sum(lse * dlse)
    with_sink: bool = False      # attention sinks (learnable_sink), their gradient summed over ranks
    headdim_v: int = 0           # v's head dim where it differs from q's and k's (MLA)
    window: tuple = (-1, -1)     # window_size over the global sequence
    softcap: float = 0.0
    packed: bool = False         # documents of DOC_LENGTHS' lengths (cu_seqlens), batch 1
    alibi: bool = False          # ALiBi slopes (nheads,) over the global sequence
    dropout: float = 0.0         # dropout_p, with seed DROPOUT_SEED, over the global sequence

    @property
    def id(self):
        return (f"{self.layout}-{'causal' if self.causal else 'full'}-H{self.nheads}/"
                f"{self.nheads_kv}-Nq{self.chunk_q}/Nk{self.chunk_k}-{str(self.dtype)[6:]}"
                + ("-dlse" if self.with_lse_grad else "") + ("-sink" if self.with_sink else "")
                + (f"-Dv{self.headdim_v}" if self.headdim_v else "")
                + (f"-w{self.window[0]},{self.window[1]}" if self.window != (-1, -1) else "")
                + (f"-softcap{self.softcap:g}" if self.softcap else "")
                + ("-packed" if self.packed else "") + ("-alibi" if self.alibi else "")
                + (f"-dropout{self.dropout:g}" if self.dropout else ""))

    def shape(self, world_size):
        """(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim), as in test_correctness."""
        n_chunks = world_size * (2 if self.layout == "zigzag" else 1)
        return (1 if self.packed else 2, self.chunk_q * n_chunks, self.chunk_k * n_chunks,
                self.nheads, self.nheads_kv, self.headdim)

    def cu_seqlens(self, world_size):
        """Packed cases: document offsets over the global sequence, else None."""
        if not self.packed:
            return None
        return torch.tensor(doc_offsets(self.shape(world_size)[1]), dtype=torch.int32)


def doc_offsets(seqlen):
    """Offsets of documents of DOC_LENGTHS' lengths, in turn, over seqlen tokens."""
    offsets = [0]
    for n in itertools.cycle(DOC_LENGTHS):
        offsets.append(min(offsets[-1] + n, seqlen))
        if offsets[-1] == seqlen:
            return offsets


# Documents of packed cases (chunks of 5 tokens): within a chunk, across one boundary, across
# several, and of one token
DOC_LENGTHS = (3, 1, 9, 2, 17)


CASES = [Case(causal, layout, nheads, nheads_kv)
         for layout in ("zigzag", "contiguous") for causal in (False, True)
         for nheads, nheads_kv in ((4, 4), (6, 2), (4, 1))]
CASES += [
    Case(True, "zigzag", 6, 2, dtype=torch.bfloat16),   # merged in fp32: no error growth
    Case(True, "contiguous", 4, 1, dtype=torch.float16),
    Case(False, "zigzag", 4, 2, chunk_q=3, chunk_k=7),  # seqlen_q != seqlen_k
    Case(True, "zigzag", 4, 2, with_lse_grad=True),
    Case(False, "contiguous", 4, 2, chunk_q=7, chunk_k=3, with_lse_grad=True),
    Case(True, "zigzag", 4, 2, with_lse_grad=True, with_sink=True),
    Case(True, "zigzag", 4, 2, with_lse_grad=True, headdim_v=16),
    # sliding windows over the global sequence (chunks of 5 tokens): shorter than a chunk,
    # longer, and both sides of a bidirectional one; softcap
    Case(True, "zigzag", 4, 2, window=(3, -1), with_lse_grad=True),
    Case(True, "contiguous", 4, 2, window=(7, -1)),
    Case(False, "zigzag", 4, 4, window=(2, 6)),
    Case(False, "contiguous", 6, 2, window=(11, 0), softcap=2.0),
    Case(False, "contiguous", 4, 2, window=(2, 3), with_lse_grad=True),  # a neighbour each way
    Case(True, "zigzag", 6, 2, dtype=torch.bfloat16, window=(4, -1), softcap=5.0),
    # packed sequences over the global sequence (cu_seqlens): each token within its document
    Case(True, "zigzag", 6, 2, packed=True, with_lse_grad=True),
    Case(True, "contiguous", 4, 1, packed=True),
    Case(False, "zigzag", 4, 4, packed=True, softcap=3.0),
    Case(True, "zigzag", 4, 2, dtype=torch.bfloat16, packed=True, with_sink=True),
    # packed sequences under a sliding window: shorter than a chunk, longer, both sides
    Case(True, "zigzag", 4, 2, packed=True, window=(3, -1), with_lse_grad=True),
    Case(True, "contiguous", 6, 2, packed=True, window=(7, -1)),
    Case(False, "zigzag", 4, 4, packed=True, window=(2, 6), softcap=3.0),
    Case(True, "zigzag", 4, 2, dtype=torch.bfloat16, packed=True, window=(4, -1), with_sink=True),
    # ALiBi over the global sequence: keys before the rows (causal), after them too (not
    # causal), with a window, packed documents, bf16 with softcap
    Case(True, "zigzag", 6, 2, alibi=True, with_lse_grad=True),
    Case(False, "contiguous", 4, 4, alibi=True, with_lse_grad=True),
    Case(False, "zigzag", 4, 2, alibi=True, window=(6, 3)),
    Case(True, "contiguous", 4, 1, alibi=True, packed=True, with_sink=True),
    Case(True, "zigzag", 4, 2, dtype=torch.bfloat16, alibi=True, packed=True, window=(7, -1),
         softcap=4.0),
    # dropout over the global sequence: the mask one device draws for the whole sequence,
    # whatever the ranks and layout (causal, not, a window, ALiBi, bf16 with a sink)
    Case(True, "zigzag", 6, 2, dropout=0.3, with_lse_grad=True),
    Case(False, "contiguous", 4, 4, dropout=0.5),
    Case(True, "contiguous", 4, 2, dropout=0.2, window=(7, -1), softcap=3.0),
    Case(False, "zigzag", 4, 1, dropout=0.25, alibi=True, window=(6, 3)),
    Case(True, "zigzag", 4, 2, dtype=torch.bfloat16, dropout=0.1, with_sink=True),
]


DROPOUT_SEED = 2**40 + 7  # both 32-bit halves of the key in use


def alibi_for(case):
    """The same (nheads,) ALiBi slopes on every rank, steep enough that far keys are damped
    (chunks of 5 tokens), or None."""
    return torch.linspace(0.05, 0.6, case.nheads) if case.alibi else None


def sink_for(case):
    """The same (nheads,) sinks on every rank, or None."""
    if not case.with_sink:
        return None
    sink = torch.linspace(-1.0, 3.0, case.nheads, dtype=torch.float64)
    return sink.to(case.dtype).requires_grad_()


def full_inputs(case, world_size):
    """q, k, v, do (leaves, as in test_correctness) and dlse (batch, nheads, seqlen_q)."""
    q, k, v, do = make_inputs(case.shape(world_size), case.dtype, seed=world_size)
    gen = torch.Generator().manual_seed(world_size + 100)
    if case.headdim_v:
        v, do = (torch.randn(x.shape[:3] + (case.headdim_v,), generator=gen,
                             dtype=torch.float64).to(case.dtype) for x in (v, do))
        v.requires_grad_()
    dlse = torch.randn(q.shape[0], q.shape[2], q.shape[1], generator=gen, dtype=torch.float64)
    return q, k, v, do, dlse if case.with_lse_grad else None


def loss_grads(o, lse, do, dlse, inputs):
    loss = (o * do).sum() + (0 if dlse is None else (lse * dlse.to(lse.dtype)).sum())
    return torch.autograd.grad(loss, inputs)


# ----------------------------------------------------------------------------- in each rank

def _seq_last(lse):
    return lse.transpose(1, 2)  # (batch, nheads, seqlen) <-> (batch, seqlen, nheads)


def _run_case(case, world_size, backend="torch", seed=DROPOUT_SEED):
    q, k, v, do, dlse = full_inputs(case, world_size)
    shard = functools.partial(shard_sequence, layout=case.layout)
    local = [shard(x.detach()).requires_grad_() for x in (q, k, v)]
    sink = sink_for(case)
    o, lse = ring_attention(*local, causal=case.causal, layout=case.layout, return_lse=True,
                            backend=backend, learnable_sink=sink, window_size=case.window,
                            softcap=case.softcap, cu_seqlens=case.cu_seqlens(world_size),
                            alibi_slopes=alibi_for(case), dropout_p=case.dropout,
                            seed=seed if case.dropout else None)
    dlse_local = None if dlse is None else _seq_last(shard(_seq_last(dlse)))
    grads = loss_grads(o, lse, shard(do), dlse_local, local + ([sink] if case.with_sink else []))
    unshard = functools.partial(unshard_sequence, layout=case.layout)
    out = dict(o=unshard(o), lse=_seq_last(unshard(_seq_last(lse))),
               **{name: unshard(g) for name, g in zip(("dq", "dk", "dv"), grads)})
    if case.with_sink:
        dist.all_reduce(grads[3])  # each rank holds its rows' share
        out["dsink"] = grads[3]
    return out


def _errors(rank):
    """The error each bad call raises on this rank: {name: (type name, message)}."""
    x = torch.randn(1, 4, 2, 8)
    calls = {
        "seqlen_odd_for_zigzag": lambda: ring_attention(x[:, :3], x[:, :3], x[:, :3]),
        "shard_not_divisible": lambda: shard_sequence(torch.randn(1, 6, 2, 8)),
        "shapes_differ": lambda: ring_attention(*[torch.randn(1, 4 + 2 * rank, 2, 8)] * 3),
        "dtypes_differ": lambda: ring_attention(*[x.double() if rank else x] * 3, backend="torch"),
        "causal_differs": lambda: ring_attention(x, x, x, causal=bool(rank)),
        "causal_seqlen_q_neq_k": lambda: ring_attention(x[:, :2], x, x, causal=True),
        "window_seqlen_q_neq_k": lambda: ring_attention(x[:, :2], x, x, window_size=(1, 1)),
        "window_differs": lambda: ring_attention(x, x, x, window_size=(1 + rank, 0),
                                                 backend="torch"),
        "unshard_shapes_differ": lambda: unshard_sequence(torch.randn(1, 2 + 2 * rank, 3)),
        "cu_seqlens_short": lambda: ring_attention(x, x, x, cu_seqlens=torch.tensor([0, 4])),
        "cu_seqlens_differ": lambda: ring_attention(
            x, x, x, backend="torch", cu_seqlens=torch.tensor([0, 3 + rank, 8])),
        "cu_seqlens_batch_2": lambda: ring_attention(
            *[torch.randn(2, 4, 2, 8)] * 3, cu_seqlens=torch.tensor([0, 8])),
        "dropout_seqlen_q_neq_k": lambda: ring_attention(x[:, :2], x, x, dropout_p=0.1),
        "dropout_packed": lambda: ring_attention(x, x, x, dropout_p=0.1,
                                                 cu_seqlens=torch.tensor([0, 3, 8])),
        "dropout_differs": lambda: ring_attention(x, x, x, dropout_p=0.1 * (1 + rank), seed=3,
                                                  backend="torch"),
        "seed_differs": lambda: ring_attention(x, x, x, dropout_p=0.1, seed=2**33 * rank + 5,
                                               backend="torch"),
        "seed_not_int": lambda: ring_attention(x, x, x, dropout_p=0.1, seed=0.5),
    }
    # A group this rank is not in: every rank must create it, only rank 0 is a member.
    only_rank0 = dist.new_group([0])
    calls["not_in_group"] = lambda: ring_attention(x, x, x, group=only_rank0, backend="torch")
    return errors_raised(calls)


def _worker(rank, world_size):
    _common.POISON_OUTPUTS = True  # as in the parent's tests: an unwritten element is NaN
    results = {case.id: _run_case(case, world_size) for case in CASES}
    errors = [None] * world_size
    dist.all_gather_object(errors, _errors(rank) if world_size == 2 else {})
    return results, errors


# The Triton kernels in the ring (under the interpreter on a CPU: small), dense, packed, with
# ALiBi (its key term an attn_mask read in place, broadcast over rows) and with dropout (the
# kernels' counter offset to each call's global rows and keys)
TRITON_CASES = [Case(True, "zigzag", 4, 2, dtype=torch.float16, chunk_q=4, chunk_k=4,
                     headdim=16, with_lse_grad=True),
                Case(True, "zigzag", 4, 2, dtype=torch.float16, chunk_q=4, chunk_k=4,
                     headdim=16, packed=True, with_lse_grad=True),
                Case(False, "zigzag", 4, 2, dtype=torch.float16, chunk_q=4, chunk_k=4,
                     headdim=16, alibi=True, with_lse_grad=True),
                Case(True, "zigzag", 4, 2, dtype=torch.float16, chunk_q=4, chunk_k=4,
                     headdim=16, dropout=0.3, with_lse_grad=True)]


def _triton_worker(rank, world_size):
    _common.POISON_OUTPUTS = True
    return {case.id: _run_case(case, world_size, "triton") for case in TRITON_CASES}


@pytest.fixture(scope="module")
def ring_runs():
    """world_size -> (results by case id, per-rank errors), spawning each world size once."""
    cache = {}

    def get(world_size):
        if world_size not in cache:
            cache[world_size] = spawn_ranks(world_size, _worker, timeout_s=120)
        return cache[world_size]
    return get


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda p: f"P{p}")
def test_matches_reference(ring_runs, world_size, case):
    check_against_reference(ring_runs(world_size)[0][case.id], case, world_size)


DRAWN_SEED_CASE = Case(True, "zigzag", 4, 2, dropout=0.4, with_lse_grad=True)


def _drawn_seed_worker(rank, world_size):
    """Dropout without a seed, each rank's generator in another state: the group's first
    rank's draw is everyone's."""
    torch.manual_seed(100 + rank)
    return _run_case(DRAWN_SEED_CASE, world_size, seed=None)


def test_dropout_seed_drawn_on_the_first_rank():
    got = spawn_ranks(2, _drawn_seed_worker, timeout_s=120)
    torch.manual_seed(100)  # rank 0's generator: its draw, as longflash.attention makes it
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    check_against_reference(got, DRAWN_SEED_CASE, 2, seed=seed)
    with pytest.raises(AssertionError):  # another seed's mask: not the result
        check_against_reference(got, DRAWN_SEED_CASE, 2, seed=seed + 1)


@needs_triton
def test_triton_kernels_in_the_ring():
    """Two ranks running each block on the Triton kernels (interpreted), dense, packed, with
    ALiBi and with dropout."""
    got = spawn_ranks(2, _triton_worker, timeout_s=300)
    for case in TRITON_CASES:
        check_against_reference(got[case.id], case, 2)


def check_against_reference(got, case, world_size, seed=DROPOUT_SEED):
    q, k, v, do, dlse = full_inputs(case, world_size)

    sink = sink_for(case)
    inputs = (q, k, v) + ((sink,) if case.with_sink else ())

    def reference(*inputs, upcast):
        kw = dict(causal=case.causal, upcast=upcast, window_size=case.window,
                  softcap=case.softcap, learnable_sink=inputs[3] if case.with_sink else None,
                  alibi_slopes=alibi_for(case), dropout_p=case.dropout, seed=seed)
        if case.packed:  # batch 1: each document on its own
            cu = case.cu_seqlens(world_size)
            o, lse = attention_varlen_ref(*(x[0] for x in inputs[:3]), cu, cu, **kw)
            o, lse = o[None], lse[None]
        else:
            o, lse = attention_ref(*inputs[:3], **kw)
        return (o, lse, *loss_grads(o, lse, do.to(q.dtype), dlse, inputs))
    lowp = reference(*inputs, upcast=False)
    ref = reference(*[x.detach().double().requires_grad_() for x in inputs], upcast=True)
    for i, name in enumerate(("o", "lse", "dq", "dk", "dv", "dsink")[:len(inputs) + 2]):
        assert got[name].dtype == (torch.float32 if name == "lse" else case.dtype)
        check_close(name, got[name], lowp[i], ref[i])


EXPECTED_ERRORS = {
    "seqlen_odd_for_zigzag": ("ValueError", "multiple of 2"),
    "shard_not_divisible": ("ValueError", "divisible by 4"),
    "shapes_differ": ("ValueError", "q_shape differs across ranks"),
    "dtypes_differ": ("ValueError", "dtype differs across ranks"),
    "causal_differs": ("ValueError", "causal differs across ranks"),
    "causal_seqlen_q_neq_k": ("NotImplementedError", "seqlen_q == seqlen_k"),
    "window_seqlen_q_neq_k": ("NotImplementedError", "window_size=(1, 1) needs seqlen_q"),
    "window_differs": ("ValueError", "window_size differs across ranks"),
    "unshard_shapes_differ": ("ValueError", "shape differs across ranks"),
    "cu_seqlens_short": ("ValueError", "cu_seqlens must go from 0 to the global seqlen 8"),
    "cu_seqlens_differ": ("ValueError", "cu_seqlens differs across ranks"),
    "cu_seqlens_batch_2": ("ValueError", "needs batch 1"),
    "dropout_seqlen_q_neq_k": ("NotImplementedError", "dropout_p needs seqlen_q == seqlen_k"),
    "dropout_packed": ("NotImplementedError", "no dropout over packed sequences"),
    "dropout_differs": ("ValueError", "dropout_p differs across ranks"),
    "seed_differs": ("ValueError", "seed differs across ranks"),
    "seed_not_int": ("TypeError", "seed must be an int"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ERRORS))
def test_error_on_every_rank(ring_runs, name):
    """Two ranks; a bad call raises a clear error on both, never a hang or a wrong result."""
    kind, text = EXPECTED_ERRORS[name]
    for rank, errors in enumerate(ring_runs(2)[1]):
        assert errors[name] is not None, f"rank {rank}: no error"
        assert errors[name][0] == kind and text in errors[name][1], (rank, errors[name])


def test_error_not_in_group(ring_runs):
    rank0, rank1 = (errors["not_in_group"] for errors in ring_runs(2)[1])
    assert rank0 is None  # a group of one: plain attention
    assert rank1[0] == "ValueError" and "group" in rank1[1]


def test_errors_without_process_group():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="layout must be one of"):
        ring_attention(x, x, x, layout="striped")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            ring_attention(x, x, x)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_causal_plan(world_size, layout):
    """The ring's causal plan computes every visible chunk pair exactly once, never a masked
    one, and with zigzag gives every rank the same number of (query, key) pairs."""
    chunk, per_rank = 4, (2 if layout == "zigzag" else 1)
    seqlen = chunk * per_rank  # tokens per rank
    computed, pairs_per_rank = [], []
    for rank in range(world_size):
        ring = _Ring(None, rank, world_size, layout, None, None)
        pairs = 0
        for src in range(world_size):
            plan = _step_plan(ring, src, True, seqlen)
            if plan is None:
                continue
            rows, cols, causal = (range(seqlen)[plan[0]], range(seqlen)[plan[1]], plan[2])
            q_chunks = [_rank_chunks(ring, rank)[i // chunk] for i in rows[::chunk]]
            k_chunks = [_rank_chunks(ring, src)[j // chunk] for j in cols[::chunk]]
            # Under the local causal mask, a pair of chunks is computed iff it comes before
            # in the local order; without it, every pair is.
            computed += [(a, b) for x, a in enumerate(q_chunks) for y, b in enumerate(k_chunks)
                         if not causal or y <= x]
            assert not causal or (rows, cols, q_chunks) == (range(seqlen),) * 2 + (k_chunks,)
            pairs += len(rows) * (len(rows) + 1) // 2 if causal else len(rows) * len(cols)
        pairs_per_rank.append(pairs)
    n_chunks = per_rank * world_size
    assert sorted(computed) == [(a, b) for a in range(n_chunks) for b in range(a + 1)]
    if layout == "zigzag":
        assert len(set(pairs_per_rank)) == 1, pairs_per_rank


def _kernel_sees(i, j, n_rows, n_keys, window_left, window_right):
    """The kernels' window rule for one block (diagonal aligned to its bottom right)."""
    diag = i + n_keys - n_rows
    return (window_left < 0 or j >= diag - window_left) and \
        (window_right < 0 or j <= diag + window_right)


def _block_runs(block, seqlen):
    """[(local rows, local keys)] of one call of a ring step: one pair, or one per sequence of
    a packed call."""
    if not block.varlen:
        return [(range(seqlen)[block.rows], range(seqlen)[block.cols])]
    rows, cols = block.rows.tolist(), block.cols.tolist()
    cu_q, cu_k = (cu.tolist() for cu in block.varlen[:2])
    return [(rows[a:b], cols[c:d]) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]


def _check_positions(block, seqlen, row_at, key_at):
    """A call of a ring per pair of chunks (ALiBi, dropout): its rows and keys (of each
    sequence) are runs of the global sequence, q_pos and k_pos their first positions (packed
    calls of a chunk against itself: -1), and where the chunks differ (apart) all keys lie
    before or all after the rows, else rows and keys are the same positions."""
    for rows, cols in _block_runs(block, seqlen):
        p, s = [row_at(x) for x in rows], [key_at(y) for y in cols]
        assert p == list(range(p[0], p[0] + len(p))) and s == list(range(s[0], s[0] + len(s)))
        if block.apart:
            assert s[-1] < p[0] or p[-1] < s[0]
        else:
            assert p == s
        if block.q_pos >= 0 or not block.varlen:
            assert (block.q_pos, block.k_pos) == (p[0], s[0])


def _block_pairs(block, seqlen):
    """The (row, key) pairs of the local shards that one call of a ring step computes, under
    the kernels' window rule (per sequence of a packed call)."""
    runs = _block_runs(block, seqlen)
    assert all(rows and cols for rows, cols in runs)
    right = 0 if block.causal else block.window_right  # causal: the diagonal's right side
    return [(x, y) for rows, cols in runs for i, x in enumerate(rows) for j, y in enumerate(cols)
            if _kernel_sees(i, j, len(rows), len(cols), block.window_left, right)]


@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("causal, window", [(True, (0, -1)), (True, (3, -1)), (True, (4, -1)),
                                            (True, (9, -1)), (True, (30, -1)), (False, (2, 6)),
                                            (False, (0, 4)), (False, (5, 0)), (False, (11, 13)),
                                            (True, (-1, -1)), (False, (-1, -1))])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_window_plan(world_size, layout, causal, window, packed, alibi):
    """With a sliding window, the ring's calls over the steps it takes (their rows and keys,
    each under the kernels' window rule) see every (query, key) pair of the global sequence
    that the window shows exactly once, and no other: windows shorter than a chunk (5
    tokens), longer than several, on one side, on both, and one key wide; no window (causal
    or not: _step_plan's calls over the whole ring) too; alibi: a call per pair of chunks,
    each with rows and keys that are runs of the global sequence, its q_pos and k_pos theirs
    where they differ (all keys before or all after the rows), else the same runs; packed: documents
    of DOC_LENGTHS over the global sequence, each token seeing its own document's only."""
    chunk, per_rank = 5, (2 if layout == "zigzag" else 1)
    seqlen = chunk * per_rank  # tokens per rank
    left, right = window[0], 0 if causal else window[1]
    n = seqlen * world_size
    offsets = doc_offsets(n) if packed else [0, n]
    docs = tuple(zip(offsets, offsets[1:]))
    doc_of = [d for d, (a, b) in enumerate(docs) for _ in range(a, b)]
    expected = {(i, j) for i in range(n) for j in range(n) if doc_of[i] == doc_of[j]
                and (left < 0 or j >= i - left) and (right < 0 or j <= i + right)}
    seen = []
    for rank in range(world_size):
        ring = _Ring(None, rank, world_size, layout, None, None)
        to_global = lambda r, x: _rank_chunks(ring, r)[x // chunk] * chunk + x % chunk  # noqa: E731
        lanes = _lanes(ring, causal, window, seqlen)  # the shards may stop early
        srcs = [src for step in range(max(last for _, last in lanes) + 1)
                for _, src in _lane_srcs(ring, lanes, step)]
        for src in srcs:
            for block in _calls(ring, src, causal, window, seqlen, docs if packed else None,
                                "cpu", alibi):
                seen += [(to_global(rank, x), to_global(src, y))
                         for x, y in _block_pairs(block, seqlen)]
                if alibi:
                    _check_positions(block, seqlen, lambda x: to_global(rank, x),
                                     lambda y: to_global(src, y))
    assert len(seen) == len(set(seen)) and set(seen) == expected


@pytest.mark.parametrize("layout, causal, window, world_size, lanes", [
    ("contiguous", True, (3, -1), 4, ((1, 1),)),    # within a chunk of 5: the one before
    ("contiguous", True, (7, -1), 4, ((1, 2),)),    # reaches two chunks back
    ("contiguous", True, (7, -1), 2, ((1, 1),)),
    ("contiguous", False, (2, 2), 4, ((1, 1), (-1, 1))),  # both sides: a neighbour each way
    ("contiguous", False, (2, 2), 3, ((1, 2),)),    # two transfers either way: forward
    ("contiguous", False, (0, 2), 4, ((1, 0), (-1, 1))),  # only the next rank's keys
    ("zigzag", True, (3, -1), 4, ((1, 1), (-1, 1))),  # chunk 2P-1-r needs 2P-2-r, on rank r+1
    ("zigzag", True, (3, -1), 8, ((1, 1), (-1, 1))),  # the whole ring (7 transfers) before
    ("zigzag", True, (3, -1), 2, ((1, 1),)),
    ("zigzag", True, (9, -1), 8, ((1, 2), (-1, 2))),  # two chunks back, each way
    ("zigzag", True, (2, -1), 1, ((1, 0),)),
    ("contiguous", True, (-1, -1), 4, ((1, 3),)),   # no window: the whole ring forward
    ("zigzag", False, (-1, -1), 8, ((1, 7),)),
])
def test_window_lanes(layout, causal, window, world_size, lanes):
    """The shards travel only as far as some rank's window reaches them, each way round the
    ring where that takes fewer transfers; every visible pair is still computed
    (test_window_plan over those lanes, and the distributed cases against float64)."""
    ring = _Ring(None, 0, world_size, layout, None, None)
    seqlen = 5 * (2 if layout == "zigzag" else 1)
    assert _lanes(ring, causal, window, seqlen) == lanes


# ----------------------------------------------------------------------------- the experiment

def test_projection_model():
    """The alpha-beta model of experiments/scaling.py on made-up block times: with free
    communication zigzag is balanced and contiguous is bound by its last rank; a slow link
    adds exactly the transfers that compute cannot hide."""
    half = {"fwd": 1.0, "bwd": 2.5}
    times = {"local": half, "kv_half": half, "q_half": half, "full": {"fwd": 2.0, "bwd": 5.0}}
    ideal = lambda layout, p: project(times, p, layout, True, 0, 0, "ideal")  # noqa: E731
    assert ideal("zigzag", 1) == ideal("contiguous", 1) == 3.5
    assert ideal("zigzag", 8) == 8 * 3.5             # every step: half a block on every rank
    assert ideal("contiguous", 8) == 3.5 + 7 * 7.0    # the last rank: 7 full blocks
    # 1 GB per transfer over the model's InfiniBand link (50 GB/s, 20 us): 20.02 ms per
    # transfer, longer than any block; forward 3 hidden + 1 compute, backward 4 + exposed.
    slow = project(times, 4, "zigzag", True, 1e9, 1e9, "infiniband")
    step, both = 0.02 + 1e9 / 50e9 * 1e3, 0.02 + 2e9 / 50e9 * 1e3
    assert abs(slow - (3 * step + 1.0 + step + 2 * both + step + step)) < 1e-9


def test_scaling_experiment_quick(tmp_path):
    """experiments/scaling.py --quick runs every part end to end and writes its rows."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "kernels"), root]))
    out = tmp_path / "cpu.csv"
    run = subprocess.run([sys.executable, "-m", "experiments.scaling", "--quick", "--out",
                          str(out)], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    df = pd.read_csv(out)
    assert (df["status"] == "ok").all()
    assert set(df["part"]) == {"exactness", "memory", "weak", "blocks", "projection", "window",
                               "variants", "decode", "long"}
    errors = df[df["metric"].str.startswith("max_err") & (df["dtype"] == "float32")]
    assert (errors["value"] < 1e-4).all()
    assert set(df[df["basis"] == "projected"]["part"]) == {"projection"}
    # Part window's bytes are what the lanes send: k, v forward and backward at each step of
    # each lane, and the travelling float32 dK, dV after each of its steps (shape of QUICK)
    sent = df[(df["part"] == "window") & (df["metric"] == "sent_mb")]
    assert len(sent) == 2 * 2 * 2  # ranks 2 and 4, both layouts, with and without the window
    for _, r in sent.iterrows():
        ring = _Ring(None, 0, r["ranks"], r["layout"], None, None)
        lanes = _lanes(ring, True, (int(r["window_left"]), -1), r["tokens_per_rank"])
        kv_bytes = 2 * r["tokens_per_rank"] * r["nheads_kv"] * r["headdim"] * 4  # float32
        transfers = sum(2 * last + last + (direction == 1) for direction, last in lanes)
        assert r["value"] == transfers * kv_bytes / 2**20, (r["layout"], r["ranks"], lanes)
    windowed, full = (sent[side].set_index(["layout", "ranks"])["value"]
                      for side in (sent["window_left"] >= 0, sent["window_left"] < 0))
    assert (windowed <= full).all() and (windowed[:, 4] < full[:, 4]).all()  # 2 ranks: 1 step
    # Part variants: each option's five tensors, both layouts, each error within its bound
    var = df[df["part"] == "variants"].pivot_table(
        index=["variant", "layout", "dtype", "ranks"], columns="metric", values="value")
    assert set(var.index.get_level_values("variant")) == set(VARIANTS)
    assert len(var) == len(VARIANTS) * 2 and var.notna().all().all()
    for name in ("o", "lse", "dq", "dk", "dv"):
        assert (var[f"max_err_{name}"] <= var[f"error_bound_{name}"]).all(), name
    # Part decode: exact; each rank holds its part of the cache (and the step's slot); what a
    # rank sends in a step does not grow with the cache
    dec = df[df["part"] == "decode"].pivot_table(index=["ranks", "seqlen_k"], columns="metric",
                                                 values="value")
    exact = dec.dropna(subset=["max_err_o"])
    assert len(exact) == 2 and (exact["max_err_o"] <= exact["error_bound_o"]).all()
    assert (exact["max_err_lse"] <= exact["error_bound_lse"]).all()
    timed = dec.dropna(subset=["time_ms"]).reset_index()
    assert len(timed) == 2 * 2 and (timed["time_ms"] > 0).all()
    slots = timed["seqlen_k"] // timed["ranks"] + 1
    assert (timed["cache_mb"] == 2 * slots * 1 * 16 * 4 / 2**20).all()  # k, v; QUICK's shape
    sent = timed.set_index(["ranks", "seqlen_k"])["sent_kb"]
    assert (sent[1] == 0).all() and sent[2].nunique() == 1 and (sent[2] > 0).all()


# ----------------------------------------------------------------------------- the one-GPU long run

def _long_cfg(**kw):
    from experiments.scaling import QUICK, Config
    return Config(**{**QUICK, **dict(gpu_long_seqlen=128, gpu_long_shape=(1, 2, 1, 16),
                                     gpu_long_lean_seqlen=128, gpu_long_reps=2), **kw})


def _count_attention(monkeypatch):
    import longflash
    calls, attention = [], longflash.attention

    def counted(*a, **kw):
        calls.append(1)
        return attention(*a, **kw)
    monkeypatch.setattr(longflash, "attention", counted)
    return calls


def _refuse(*a, **kw):
    raise AssertionError("not this timing path")


def test_gpu_long_lean_timing_at_long_lengths(monkeypatch):
    """From gpu_long_lean_seqlen on: one warm-up call and gpu_long_reps timed calls, no
    do_bench (8 calls at 1M tokens) and no separate peak-memory call."""
    from experiments import scaling
    calls = _count_attention(monkeypatch)
    monkeypatch.setattr(scaling, "time_ms", _refuse)
    monkeypatch.setattr(scaling, "peak_memory_mb", _refuse)
    rows = {r["metric"]: r for r in scaling._gpu_long(_long_cfg(), device="cpu")}
    assert len(calls) == 1 + 2 + 1  # warm-up, timed calls, the exactness check's forward
    t = rows["time_ms"]
    assert t["status"] == "ok" and t["p20"] <= t["value"] <= t["p80"]
    assert rows["tflops"]["status"] == "ok" and rows["tflops"]["value"] > 0
    assert rows["peak_mem_mb"]["status"] == "unsupported"  # the lean path measures it on CUDA
    assert t["part"] == "long" and t["layout"] == "none" and t["seqlen_q"] == 128


def test_gpu_long_is_checked_against_the_reference():
    """The one-GPU run's exactness rows: sampled rows of a forward call within the tolerance
    rule's bound; a wrong output (1% off) is beyond it, so the check can fail."""
    import longflash
    from experiments import scaling
    rows = {r["metric"]: r for r in scaling._gpu_long(_long_cfg(), device="cpu")}
    err, bound = rows["max_err_o_sampled"], rows["error_bound_o_sampled"]
    assert err["status"] == bound["status"] == "ok" and err["mode"] == "fwd"
    assert 0 <= err["value"] <= bound["value"]
    q, k, v, _ = scaling._inputs((1, 2, 1, 16), 96, "float32", seed=1)
    o = longflash.attention(q, k, v, causal=True, backend="torch")
    assert scaling._sampled_error(q, k, v, o, 4)[0] <= scaling._sampled_error(q, k, v, o, 4)[1]
    err, bound = scaling._sampled_error(q, k, v, o * 1.01, 4)
    assert err > bound


def test_time_ms_lean_calls_and_time_cap():
    """measure.time_ms_lean: 1 warm-up + reps calls; max_s ends the timed calls early."""
    import time
    from experiments.measure import time_ms_lean
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02)
    (med, p20, p80), peak = time_ms_lean(fn, "cpu", reps=3)
    assert len(calls) == 4 and 15 < p20 <= med <= p80 and math.isnan(peak)
    calls.clear()
    time_ms_lean(fn, "cpu", reps=5, max_s=0.03)  # 2 timed calls reach 0.03 s
    assert len(calls) == 1 + 2


def test_gpu_long_short_lengths_keep_time_ms(monkeypatch):
    from experiments import scaling
    used = []
    monkeypatch.setattr(scaling, "time_ms_lean", _refuse)
    monkeypatch.setattr(scaling, "time_ms", lambda fn, device: used.append("t") or (2., 1., 3.))
    monkeypatch.setattr(scaling, "peak_memory_mb", lambda fn, device: used.append("m") or 5.)
    rows = {r["metric"]: r for r in scaling._gpu_long(_long_cfg(gpu_long_lean_seqlen=256),
                                                      device="cpu")}
    assert used == ["t", "m"]
    assert (rows["time_ms"]["value"], rows["peak_mem_mb"]["value"]) == (2., 5.)


@pytest.mark.parametrize("error, status", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB"), "oom"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "error")])
def test_gpu_long_failure_is_rows(monkeypatch, error, status):
    import longflash
    from experiments import scaling

    def fail(*a, **kw):
        raise error
    monkeypatch.setattr(longflash, "attention", fail)
    rows = scaling._gpu_long(_long_cfg(), device="cpu")
    assert {r["metric"] for r in rows} == {"time_ms", "tflops", "peak_mem_mb"}
    assert all(r["status"] == status and math.isnan(r["value"]) for r in rows)


def test_gpu_long_rows_are_written_first(monkeypatch, tmp_path):
    """--parts long,blocks,projection: the one-device long run comes first and its rows are
    in the file before a later part fails (or the campaign's timeout kills the step)."""
    from experiments import scaling
    monkeypatch.setattr(scaling.log, "path", None)  # restored after main() sets it
    monkeypatch.setattr(scaling, "QUICK", dict(
        scaling.QUICK, gpu_long_seqlen=128, gpu_long_shape=(1, 2, 1, 16),
        gpu_long_lean_seqlen=128, gpu_long_reps=1, gpu_long_device="cpu"))

    def blocks_fail(*a, **kw):
        raise RuntimeError("a later part fails")
    monkeypatch.setattr(scaling, "_blocks", blocks_fail)
    out = tmp_path / "s.csv"
    monkeypatch.setattr(sys, "argv", ["scaling", "--quick", "--parts", "long,blocks,projection",
                                      "--out", str(out)])
    with pytest.raises(RuntimeError, match="a later part fails"):
        scaling.main()
    df = pd.read_csv(out)
    assert set(df["part"]) == {"long"} and set(df["layout"]) == {"none"}
    assert set(df["metric"]) == {"time_ms", "tflops", "peak_mem_mb", "max_err_o_sampled",
                                 "error_bound_o_sampled"}
    assert df.set_index("metric").loc["time_ms", "status"] == "ok"
