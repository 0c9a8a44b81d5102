"""experiments/codegen.py: the offline code-generation report of the Triton kernels."""

import pytest
import torch

import longflash
from conftest import needs_triton, run_uninterpreted

pytestmark = needs_triton  # the compiler report: Triton's own compiler


def test_config_table_is_small_and_fits_a_warpgroup():
    from longflash import flash_triton
    for major in (8, 9):  # the table is keyed on the major compute capability
        assert [c.num_warps for c in flash_triton.configs_for("fwd", major, 128)] == [
            c[2] for c in flash_triton.CONFIGS["fwd", major, 128]]
    for (kernel, major, _), configs in flash_triton.CONFIGS.items():
        assert 1 <= len(configs) <= 4, (kernel, major)
        # a TMA candidate (5th element) only where TMA exists (sm_90+), and never alone: the
        # pointer candidates serve the inputs a TMA copy cannot read; a warp-specialized one
        # (6th) TMA too, with 4 warps and 128 rows in its dots' M dimension (Triton's Hopper pass
        # makes them 12 warps: a copy warpgroup and two compute warpgroups of 64 rows)
        assert all(c[4:] in ((), (flash_triton.TMA,), (flash_triton.TMA, flash_triton.WS))
                   for c in configs), configs
        assert major == 9 or all(len(c) == 4 for c in configs), (kernel, major)
        assert any(len(c) == 4 for c in configs), (kernel, major)
        for block_m, block_n, warps, _, *flags in configs:
            rows = {"fwd": block_m, "dq": block_m, "dkdv": block_n}[kernel]  # a dot's M
            if major == 9:  # wgmma: at least 64 rows (a warpgroup of 4 warps); a second
                # warpgroup over 64 rows splits the dot's columns (the codegen report: wgmma)
                assert rows >= 64 and warps in (4, 8), (kernel, block_m, block_n, warps)
            if flash_triton.WS in flags:
                assert warps == 4 and rows == 128, (kernel, block_m, block_n, warps)


def test_prune_keeps_tma_candidates_only_where_tma_ok():
    """The autotuner's pruning: this head dim's sm_90 candidates (a CPU tensor counts as sm_90),
    the TMA ones only when the launcher found the inputs fit (tma_ok, part of the key), the
    warp-specialized ones only where ws_ok too."""
    from longflash import flash_triton
    q = torch.empty(1, 8, 1, 128)
    for kernel in ("fwd", "dkdv", "dq"):
        candidates = [flash_triton._config(c) for c in flash_triton.all_configs(kernel)]
        prune = flash_triton._prune(kernel)
        table = flash_triton.CONFIGS[kernel, 9, 128]
        for tma_ok, ws_ok in ((0, 0), (1, 0), (1, 1)):
            kept = [flash_triton._entry(c) for c in prune(candidates, dict(Q=q), HEAD_DIM=128,
                                                          tma_ok=tma_ok, ws_ok=ws_ok)]
            assert kept == sorted(c for c in table if len(c) == 4 or (tma_ok and len(c) == 5)
                                  or (ws_ok and len(c) == 6)), (kernel, tma_ok, ws_ok)
        assert any(len(c) == 5 for c in table), kernel  # there is something to prune
    for kernel in ("fwd", "dkdv", "dq"):
        assert any(len(c) == 6 for c in flash_triton.CONFIGS[kernel, 9, 128]), kernel


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_forward_uses_wgmma_without_spills_on_sm90a():
    # Three compiles (a few seconds each): the forward at head dim 64, the first sm_90a
    # candidate (pointer loads, pipelined with cp.async), the first TMA one (TMA copies
    # instead) and the warp-specialized one (a TMA-copy warpgroup and two compute warpgroups).
    code = ("from experiments import codegen as cg; from longflash import flash_triton as ft; "
            "cs = ft.configs_for('fwd', 9, 64); "
            "tma = [c for c in cs if c.kwargs['USE_TMA']][0]; "
            "ws = [c for c in cs if c.kwargs['WARP_SPECIALIZE']][0]; "
            "ms = [cg.compile_launch('fwd', 'bfloat16', 'plain', 64, 'sm90a', c) "
            "for c in (cs[0], tma, ws)]; "
            "[print(m['wgmma_count'], m['mma_count'], m['spill_bytes'], m['cp_async_count'], "
            "m['tma_count'], m['warps'], m['setmaxnreg_count'], m['ws_offset_twice']) "
            "for m in ms]")
    out = run_uninterpreted("-c", code)
    pointer, tma, ws = ([int(x) for x in line.split()]
                        for line in out.stdout.splitlines()[-3:])
    # the second compute partition indexes its own rows (flash_triton._held_start)
    assert ws[7] == 0, "rows offset twice in a compute partition: " + out.stdout
    for wgmma, mma, spills, *_ in (pointer, tma, ws):
        assert wgmma > 0 and mma == 0, out.stdout
        assert spills == 0, out.stdout
    assert pointer[3] > 0 and pointer[4] == 0, "K/V loads are not pipelined: " + out.stdout
    assert tma[4] > 0 and tma[3] == 0, "K/V tiles are not TMA copies: " + out.stdout
    assert pointer[5:] == [8, 0, 0] and tma[5:] == [8, 0, 0], out.stdout
    assert ws[5] == 12 and ws[6] > 0, "not warp-specialized: " + out.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_pipelined_forward_puts_its_exp2s_beside_the_wgmma():
    """The PIPE trial's point, read from the SASS: most of a trip's exp2s are issued while the
    next block's q.k wgmma is in flight; in the loop as the table has it, none. At head dim 128
    (Triton 3.6.0 and 3.9.0; at 64, 3.9.0 waits for the wgmma before the softmax: PERFLOG)."""
    code = ("from experiments import codegen as cg; from longflash import flash_triton as ft; "
            "ms = [cg.compile_launch('fwd', 'bfloat16', 'plain', 128, 'sm90a', ft._config(c)) "
            "for c in ((128, 64, 8, 3, ft.TMA), (128, 64, 8, 3, ft.TMA, ft.PIPE))]; "
            "[print(m['loop_instructions'], m['loop_ex2'], m['ex2_beside_wgmma'], "
            "m['spill_bytes']) for m in ms]")
    out = run_uninterpreted("-c", code)
    plain, pipe = ([int(x) for x in line.split()] for line in out.stdout.splitlines()[-2:])
    assert plain[1] == pipe[1] > 0 and plain[3] == pipe[3] == 0, out.stdout
    assert plain[2] == 0 and pipe[2] > pipe[1] // 2, out.stdout


# The second compute partition's row index as Triton 3.6.0's Hopper pass wrote it for the
# warp-specialized forward before flash_triton._held_start (abridged TTGIR), and as it writes
# it since: the splat of the shifted copy coordinate, or of the program's start.
_PARTITION_ROWS = """
      %c64_i32_23 = arith.constant {async_task_id = array<i32: 2>} 64 : i32 loc(#loc1)
      %x = arith.addi %start_m_31, %c64_i32_23 {async_task_id = array<i32: 2>} : i32 loc(#loc3)
      %offs_m = tt.make_range {async_task_id = array<i32: 2>, end = 128 : i32, start = 64 : \
i32} : tensor<64xi32, #ttg.slice<{dim = 1, parent = #mma}>> loc(#loc5)
      %offs_m_59 = tt.splat %x {async_task_id = array<i32: 2>} : i32 -> tensor<64xi32, \
#ttg.slice<{dim = 1, parent = #mma}>> loc(#loc6)
      %offs_m_62 = arith.addi %offs_m_59, %offs_m {async_task_id = array<i32: 2>} : \
tensor<64xi32, #ttg.slice<{dim = 1, parent = #mma}>> loc(#loc6)
""".replace("\\\n", "")


def test_ws_offset_twice_finds_a_partition_indexed_twice_offset():
    from experiments.codegen import ws_offset_twice
    assert ws_offset_twice(_PARTITION_ROWS) == 1
    assert ws_offset_twice(_PARTITION_ROWS.replace("tt.splat %x", "tt.splat %start_m_31")) == 0
    assert ws_offset_twice(_PARTITION_ROWS.replace("start = 64 :", "start = 0 :")) == 0
    # the same names printed again in another partition, without the shift: not counted
    again = _PARTITION_ROWS.replace("arith.addi %start_m_31, %c64_i32_23",
                                    "arith.addi %start_m_31, %n")
    assert ws_offset_twice(_PARTITION_ROWS + again) == 1


# A compute partition of dK/dV's warp-specialized loop as Triton 3.6.0's Hopper pass wrote it
# before flash_triton._load_head_tile went through registers (abridged TTGIR): q's buffer is
# released right after its reshape, then two warpgroup MMAs read it.
_FREED_EARLY = """
        %x_122 = ttg.memdesc_reshape %121 {async_task_id = array<i32: 1>} : \
!ttg.memdesc<32x1x128xbf16, #shared2, #smem> -> !ttg.memdesc<32x128xbf16, #shared1, #smem>
        %qkT = ttg.memdesc_trans %x_122 {async_task_id = array<i32: 1>, order = array<i32: 1, \
0>} : !ttg.memdesc<32x128xbf16, #shared1, #smem> -> !ttg.memdesc<128x32xbf16, #shared3, #smem>
        ttng.arrive_barrier %122, 128 {async_task_id = array<i32: 1>} : !ttg.memdesc<1xi64>
        %qkT_128 = ttng.warp_group_dot %84, %qkT, %cst_29 {async_task_id = array<i32: 1>} : \
!ttg.memdesc<64x128xbf16> * !ttg.memdesc<128x32xbf16> -> tensor<64x32xf32>
        %dk = ttng.warp_group_dot %dsT_151, %x_122, %arg94 {async_task_id = array<i32: 1>} : \
tensor<64x32xbf16> * !ttg.memdesc<32x128xbf16> -> tensor<64x128xf32>
""".replace("\\\n", "")


def test_ws_freed_before_read_finds_a_tile_read_after_its_release():
    from experiments.codegen import ws_freed_before_read
    assert ws_freed_before_read(_FREED_EARLY) == 2
    lines = _FREED_EARLY.strip("\n").split("\n")
    released_last = "\n".join(lines[:2] + lines[3:] + lines[2:3])  # the release after the dots
    assert ws_freed_before_read(released_last) == 0
    # a tile in registers (local_alloc after a load, no reshape of the buffer): nothing to find
    in_registers = _FREED_EARLY.replace("ttg.memdesc_reshape", "ttg.local_alloc")
    assert ws_freed_before_read(in_registers) == 0


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_warp_specialized_dkdv_reads_q_and_do_before_releasing_them():
    """dK/dV's warp-specialized loop with grouped query heads (its 3-D q and dO copies): no MMA
    reads a tile after its buffer went back to the copy warpgroup (Triton 3.6.0's pass put the
    release before the dots where a reshape sat between: 8 such reads; PERFLOG)."""
    code = ("from experiments import codegen as cg; from longflash import flash_triton as ft; "
            "c = ft._config((64, 128, 4, 2, ft.TMA, ft.WS)); "
            "m = cg.compile_launch('dkdv', 'bfloat16', 'gqa', 64, 'sm90a', c); "
            "print(m['ws_freed_before_read'], m['ws_offset_twice'], m['warps'], m['spill_bytes'])")
    out = run_uninterpreted("-c", code)
    freed, twice, warps, _ = (int(x) for x in out.stdout.split()[-4:])
    assert freed == 0 and twice == 0, out.stdout
    assert warps == 12, "not warp-specialized: " + out.stdout


def test_config_names_parse_back_to_their_entries():
    import argparse
    from experiments import codegen
    from longflash import flash_triton as ft
    for entry in [(128, 64, 8, 3), (128, 64, 8, 3, ft.TMA, ft.PIPE),
                  (64, 128, 8, 2, ft.TMA, ft.SPLIT, ft.ATOMIC), (128, 128, 4, 2, ft.TMA, ft.WS)]:
        assert codegen.parse_config(codegen.config_name(ft._config(entry))) == entry
    for bad in ("128/64/8", "128/64/x/3", "128/64/8/3/fast", "128/64/4/2/tma/ws/pipe"):
        with pytest.raises(argparse.ArgumentTypeError):
            codegen.parse_config(bad)


def test_check_flags_a_spilling_forward():
    from experiments import codegen
    row = dict(arch="sm90a", causal=False, kernel="fwd", headdim=128, dtype="bfloat16",
               flags="plain", config="128/64/8/3", status="ok")
    metrics = dict(registers=255, spill_bytes=8, wgmma_count=36, mma_count=0,
                   shared_mem_bytes=98304)
    rows = [dict(row, metric=k, value=v) for k, v in metrics.items()]
    assert any("spill-free" in p for p in codegen.check(rows))
    rows = [dict(r, value=0) if r["metric"] == "spill_bytes" else r for r in rows]
    assert codegen.check(rows) == []
    too_big = [dict(r, value=240 * 1024) if r["metric"] == "shared_mem_bytes" else r
               for r in rows]
    assert any("shared memory" in p for p in codegen.check(too_big))


# A Hopper GPU for compiling only (no GPU here): Triton asks its driver for the device, stream
# and target before it compiles; nothing in these tests launches (a launch fails here).
_HOPPER_FOR_COMPILING = '''
import os, torch
from triton.runtime.driver import driver
from experiments.codegen import StandInGPU
driver.set_active(StandInGPU(90))
os.environ["LONGFLASH_COMPILE_WORKERS"] = "2"  # threads even on a 1-CPU machine
from longflash import flash_triton as ft
from longflash.interface import _options
def compiled():
    return [len(ft.jit_function(kernel).device_caches[0][0]) for kernel in
            (ft._attn_fwd, ft._attn_bwd_preprocess, ft._attn_bwd_dkdv, ft._attn_bwd_dq)]
def qkv(headdim):
    return [torch.randn(2, 160, 4, headdim, dtype=torch.bfloat16) for _ in range(4)]
def opts(headdim):
    return _options(None, True, headdim ** -0.5, -1, -1, None, 0.0, 0.0, None, None, None, 0, 0)
'''


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_compiling_compiles_what_a_launch_runs_in_threads():
    """flash_triton.compiling(): a forward and backward compile every kernel they would launch
    (the autotuner's pruned candidates; a forced config) and launch nothing; the launch that
    follows finds its kernel compiled (Triton's jit_cache_hook, called on a miss, is not); and
    on an autotuning miss the pruned candidates are all compiled before the first is timed.
    For sm_90 with this Triton (codegen.StandInGPU), CPU tensors (so no TMA candidate), two
    threads."""
    code = _HOPPER_FOR_COMPILING + '''
from triton import knobs
q, k, v, do = qkv(128)
with ft.compiling(2):
    o, lse = ft.forward(q, k, v, opts(128))
    ft.backward(do, q, k, v, o, lse, None, opts(128))
    pipe = ft._config((128, 64, 8, 3, ft.PIPE))
    with ft.forced_configs({"fwd": pipe}):
        ft.forward(q, k, v, opts(128))
print(*compiled())
misses = []
knobs.runtime.jit_cache_hook = lambda *args, **kwargs: misses.append(kwargs["key"]) or False
for config in ft.configs_for("fwd", 9, 128)[:1] + [pipe]:
    try:
        with ft.forced_configs({"fwd": config}):
            ft.forward(q, k, v, opts(128))
    except Exception as e:  # the launch itself: no GPU
        print(type(e).__name__)
print(len(misses))
q, k, v, do = qkv(256)  # a new specialization, not within compiling(): the autotuner's miss
try:
    ft.forward(q, k, v, opts(256))
except Exception as e:  # timing the first candidate: no GPU
    print(type(e).__name__)
print(*compiled())
'''
    out = run_uninterpreted("-c", code).stdout.splitlines()
    from longflash import flash_triton as ft
    pointer = {kernel: sum(len(c) == 4 for c in ft.CONFIGS[kernel, 9, 128])
               for kernel in ("fwd", "dkdv", "dq")}
    first = [int(x) for x in out[-6].split()]
    assert first == [pointer["fwd"] + 1, 1, pointer["dkdv"], pointer["dq"]], out
    assert out[-3] == "0", "a launch after compiling() compiled again: " + "\n".join(out)
    d256 = sum(len(c) == 4 for c in ft.CONFIGS["fwd", 9, 256])
    assert d256 > 1
    assert [int(x) for x in out[-1].split()] == [first[0] + d256, *first[1:]], out


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_report_compiles_each_flag_as_its_launch():
    """The report's flash kernels compile as launched (codegen.compile_launch), each flag its
    own call: without grouped query heads Triton folds dK/dV's loop over a group's heads, so
    the "gqa" launch needs more registers than "plain" (d64, the first sm_90 candidate; PERFLOG:
    232 against 255 with Triton 3.6.0); at 4096 tokens ("full_tiles") the warp-specialized
    forward's loop has no masks, so fewer instructions than at 4000 ("plain"). A config compiled
    a second time in the process compiles again (compile_s is never a cache hit). sm_80: the
    first forward candidate after those sm_90a compiles is an sm_80 kernel (no wgmma)."""
    code = ("from experiments import codegen as cg; from longflash import flash_triton as ft; "
            "dkdv = ft.configs_for('dkdv', 9, 64)[0]; "
            "ws = [c for c in ft.configs_for('fwd', 9, 64) if c.kwargs['WARP_SPECIALIZE']][0]; "
            "ms = [cg.compile_launch(k, 'bfloat16', f, 64, 'sm90a', c) for k, f, c in ("
            "('dkdv', 'plain', dkdv), ('dkdv', 'gqa', dkdv), ('dkdv', 'plain', dkdv), "
            "('fwd', 'plain', ws), ('fwd', 'full_tiles', ws))]; "
            "ms.append(cg.compile_launch('fwd', 'bfloat16', 'plain', 64, 'sm80', "
            "ft.configs_for('fwd', 8, 64)[0])); "
            "[print(m['registers'], m.get('loop_instructions', 0), m['wgmma_count'], "
            "m['compile_s']) for m in ms]")
    out = run_uninterpreted("-c", code)
    rows = [line.split() for line in out.stdout.splitlines()[-6:]]
    plain, gqa, again, masked, full, sm80 = ([int(x) for x in r[:3]] + [float(r[3])]
                                             for r in rows)
    assert plain[0] < gqa[0], out.stdout
    assert again[:3] == plain[:3] and again[3] > 0.3 * plain[3], out.stdout
    assert full[1] < masked[1], out.stdout
    assert sm80[2] == 0 < masked[2], out.stdout


def test_launch_inputs_stand_for_their_calls():
    """The inputs of each flag's launch (nothing compiled): RQ1's shape, grouped KV heads,
    packed sequences, a paged cache whose block table covers each sequence's keys, and a
    key-padding attn_mask broadcast over heads and rows."""
    from experiments import codegen as cg
    q, k, v, opts = cg.launch_inputs("plain", "bfloat16", 64)
    assert q.shape == k.shape == (1, cg.LAUNCH_TOKENS, cg.LAUNCH_HEADS, 64)
    assert q.dtype == torch.bfloat16 and opts.window_right == -1 and opts.dropout_p == 0
    assert cg.LAUNCH_TOKENS % 16 == 0 and cg.LAUNCH_TOKENS % 128 != 0
    assert cg.LAUNCH_TOKENS_FULL % 128 == 0
    assert cg.launch_inputs("gqa", "float16", 64)[1].shape[2] == cg.LAUNCH_KV_HEADS_GQA
    q, k, v, opts = cg.launch_inputs("varlen", "bfloat16", 128)
    assert q.shape[0] == k.shape[0] == opts.cu_seqlens_q[-1] == sum(cg.LAUNCH_SEQLENS)
    q, k, v, opts = cg.launch_inputs("paged", "bfloat16", 128)
    assert k.shape[1] == cg.LAUNCH_PAGE and opts.cu_seqlens_k.diff().tolist() == list(
        cg.LAUNCH_SEQLENS)
    for b, n in enumerate(cg.LAUNCH_SEQLENS):  # the pages of a sequence: its own, all of them
        pages = opts.block_table[b, :-(-n // cg.LAUNCH_PAGE)]
        assert len(set(pages.tolist())) == len(pages) and int(pages.max()) < k.shape[0]
    assert set(opts.block_table[0].tolist()).isdisjoint(opts.block_table[1].tolist()[:12])
    for flag, field in (("softcap", "softcap"), ("dropout", "dropout_p")):
        assert getattr(cg.launch_inputs(flag, "bfloat16", 64)[3], field) > 0
    assert cg.launch_inputs("alibi", "bfloat16", 64)[3].alibi_slopes.shape == (
        1, cg.LAUNCH_HEADS)
    mask = cg.launch_inputs("mask", "bfloat16", 64)[3].attn_mask  # key padding, broadcast
    assert mask.dtype == torch.bool and mask.shape == (1, cg.LAUNCH_HEADS, cg.LAUNCH_TOKENS,
                                                       cg.LAUNCH_TOKENS)
    assert mask.stride()[1:3] == (0, 0)


def test_compile_workers_reads_its_variable(monkeypatch):
    from longflash import flash_triton as ft
    monkeypatch.setenv("LONGFLASH_COMPILE_WORKERS", "3")
    assert ft.compile_workers() == 3
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv("LONGFLASH_COMPILE_WORKERS", bad)
        with pytest.raises(ValueError, match="LONGFLASH_COMPILE_WORKERS"):
            ft.compile_workers()
    monkeypatch.delenv("LONGFLASH_COMPILE_WORKERS")
    assert 1 <= ft.compile_workers() <= 8


def test_ws_kernels_reads_its_variable(monkeypatch):
    """LONGFLASH_WS: off by default, 1 for every kernel, or a list of kernels (fwd: the
    forward's warp-specialized candidates alone); anything else a ValueError naming the
    variable, raised by a call before any kernel runs."""
    from longflash import flash_triton as ft
    from experiments.results import KERNEL_SWITCHES  # rows name the switches set otherwise
    assert KERNEL_SWITCHES["LONGFLASH_WS"] == ft.WS_DEFAULT
    monkeypatch.delenv("LONGFLASH_WS", raising=False)
    assert ft.ws_kernels() == frozenset()
    for value, kernels in (("0", ()), ("", ()), ("1", ("fwd", "dkdv", "dq")), ("fwd", ("fwd",)),
                           (" dq , fwd", ("fwd", "dq"))):
        monkeypatch.setenv("LONGFLASH_WS", value)
        assert ft.ws_kernels() == frozenset(kernels), value
    q = torch.randn(1, 8, 2, 16, dtype=torch.float16,
                    device="cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("yes", "fwd,bwd", ",", "2"):
        monkeypatch.setenv("LONGFLASH_WS", bad)
        with pytest.raises(ValueError, match="LONGFLASH_WS"):
            ft.ws_kernels()
    with pytest.raises(ValueError, match="LONGFLASH_WS"):
        longflash.attention(q, q, q, backend="triton")


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile and run the kernels")
def test_a_new_dropout_seed_compiles_nothing_new():
    """The dropout seed changes every call; Triton specializes integer arguments on their
    divisibility by 16, so the seed's halves are not specialized (flash_triton._SEED): one
    compile of each kernel serves seeds of every such class."""
    code = _HOPPER_FOR_COMPILING + '''
q, k, v, do = qkv(64)
o, lse = torch.empty_like(q), torch.empty(2, 4, 160)
forced = {name: ft.configs_for(name, 9, 64)[0] for name in ("fwd", "dkdv", "dq")}
for seed in (16, 17, 2 ** 32 + 5, 3 * 2 ** 32 + 112):
    o_ = _options(None, False, 0.125, -1, -1, None, 0.0, 0.1, seed, None, None, 0, 0)
    with ft.compiling(1), ft.forced_configs(forced):
        ft.forward(q, k, v, o_)
        ft.backward(do, q, k, v, o, lse, None, o_)
    print(*compiled())
'''
    out = run_uninterpreted("-c", code).stdout.splitlines()
    assert out[-1] == out[-4] == "1 1 1 1", out
